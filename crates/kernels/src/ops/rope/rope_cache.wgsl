// The step between a decode pass's Q/K/V product and its attention, in one dispatch: for each row of
// [q | k | v] (rows ld_in apart), each query head is RMS-normed (optional), rotated and written to the
// query output; each key head normed, rotated and written to the row's cache row with its value head.
// One workgroup per (row, head): y < heads are query heads, the rest key/value heads.
//
// The norm is the norm kernel's (256 threads, thread d holds dimension d, the same tree), and the
// rotation the rope kernel's (a·c − b·s, a·s + b·c with the host's table), so the result equals norm,
// rope and copy run one after another.
struct Params { rows: u32, heads: u32, kv_heads: u32, head_dim: u32, n_rot: u32, neox: u32, ld_in: u32,
                q_at: u32, k_at: u32, v_at: u32, ld_q: u32, ld_kv: u32, o_in: u32, o_q: u32, o_kv: u32,
                o_tab: u32, o_rope: u32, norm: u32, o_qw: u32, o_kw: u32, eps: f32, lo_row: u32, hi_row: u32,
                queries: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> qo: array<f32>;
@group(0) @binding(3) var<storage, read_write> kv: array<f32>;
@group(0) @binding(4) var<storage, read> tab: array<u32>;
@group(0) @binding(5) var<storage, read> rope: array<f32>;
@group(0) @binding(6) var<storage, read> qw: array<f32>;
@group(0) @binding(7) var<storage, read> kw: array<f32>;

var<workgroup> vals: array<f32, 256>;
var<workgroup> wbase: u32;
var<workgroup> wpos: u32;

// reduce_sum and WG: ops/common.rs, ROW_REDUCE; rope_pair: ops/rope, ROPE_PAIR.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let r = wid.x;
  let h = wid.y;
  if (r >= p.rows) { return; }
  if (lid == 0u) {
    wbase = tab[p.o_tab + 2u * r];
    wpos = tab[p.o_tab + 2u * r + 1u];
  }
  let base = workgroupUniformLoad(&wbase);
  let pos = workgroupUniformLoad(&wpos);
  let is_q = h < p.heads;
  // Key and value heads of rows in other cache buffers are another dispatch's; queries, one dispatch's.
  if (!is_q && (base < p.lo_row || base >= p.hi_row)) { return; }
  if (is_q && p.queries == 0u) { return; }
  let kh = h - select(p.heads, 0u, is_q);
  let row = p.o_in + r * p.ld_in;
  var at = row + p.k_at + kh * p.head_dim;
  if (is_q) { at = row + p.q_at + h * p.head_dim; }
  let d = lid;
  var x = 0.0;
  if (d < p.head_dim) { x = src[at + d]; }
  if (p.norm != 0u) {
    var w = 0.0;
    if (d < p.head_dim) {
      if (is_q) { w = qw[p.o_qw + d]; } else { w = kw[p.o_kw + d]; }
    }
    let rstd = 1.0 / sqrt(reduce_sum(x * x, lid) * (1.0 / f32(p.head_dim)) + p.eps);
    x = x * rstd * w;
  }
  vals[d] = x;
  workgroupBarrier();
  let half = p.n_rot / 2u;
  var y = x;
  if (d < p.n_rot) {
    let pr = rope_pair(d, p.n_rot, p.neox != 0u);
    let t = p.o_rope + (pos * half + pr.i) * 2u;
    let c = rope[t];
    let s = rope[t + 1u];
    if (pr.first) { y = x * c - vals[pr.partner] * s; } else { y = vals[pr.partner] * s + x * c; }
  }
  if (d < p.head_dim) {
    if (is_q) {
      qo[p.o_q + r * p.ld_q + h * p.head_dim + d] = y;
    } else {
      let crow = p.o_kv + (base + pos - p.lo_row) * p.ld_kv;
      kv[crow + kh * p.head_dim + d] = y;
      kv[crow + p.kv_heads * p.head_dim + kh * p.head_dim + d] = src[row + p.v_at + kh * p.head_dim + d];
    }
  }
}
