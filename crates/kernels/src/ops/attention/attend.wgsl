// Attention of query rows against a KV cache, one workgroup per (query row, head). Query row r sits at
// position q_pos0 + r and sees cache rows j <= that position (and, with a sliding window, only the last
// `window` of them). Grouped-query heads: head h reads KV head h / (heads / kv_heads).
// Scores go through a scratch row of length s_stride: pass 1 writes scale * q.k (soft-capped if asked),
// pass 2 exponentiates (each thread touches only its own j, so no barrier between them), pass 3 mixes V.
struct Params { n: u32, start: u32, o_q: u32, o_k: u32, o_v: u32, o_out: u32,
                heads: u32, kv_heads: u32, head_dim: u32, ld_q: u32, ld_kv: u32, ld_o: u32,
                q_pos0: u32, kv_len: u32, window: u32, scale: f32, softcap: f32, s_stride: u32, row0: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> s: array<f32>;

var<workgroup> qs: array<f32, 512>;

// reduce_sum / reduce_max and WG: ops/common.rs, ROW_REDUCE.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let g = group_index(wid, nwg);
  if (g >= p.n * p.heads) { return; }
  let r = g / p.heads;
  let h = g % p.heads;
  let kvh = h / (p.heads / p.kv_heads);
  let qpos = p.q_pos0 + p.row0 + r;
  let last = min(qpos + 1u, p.kv_len);
  var first = 0u;
  if (p.window > 0u && qpos + 1u > p.window) { first = qpos + 1u - p.window; }
  let qb = p.o_q + r * p.ld_q + h * p.head_dim;
  for (var d = lid; d < p.head_dim; d = d + WG) { qs[d] = q[qb + d]; }
  workgroupBarrier();
  let sb = g * p.s_stride;
  let kb = p.o_k + kvh * p.head_dim;
  var m = bitcast<f32>(0xff7fffffu); // -f32::MAX, as bits: the decimal literal is out of range for some compilers (Tint)
  for (var j = first + lid; j < last; j = j + WG) {
    var dot = 0.0;
    let kr = kb + j * p.ld_kv;
    for (var d = 0u; d < p.head_dim; d = d + 1u) { dot = dot + qs[d] * k[kr + d]; }
    var sc = dot * p.scale;
    if (p.softcap > 0.0) { sc = p.softcap * tanh(clamp(sc / p.softcap, -15.0, 15.0)); }
    s[sb + j] = sc;
    m = max(m, sc);
  }
  m = reduce_max(m, lid);
  var sum = 0.0;
  for (var j = first + lid; j < last; j = j + WG) {
    let e = exp(s[sb + j] - m);
    s[sb + j] = e;
    sum = sum + e;
  }
  let inv = 1.0 / reduce_sum(sum, lid);
  storageBarrier();
  workgroupBarrier();
  let vb = p.o_v + kvh * p.head_dim;
  let ob = p.o_out + r * p.ld_o + h * p.head_dim;
  for (var d = lid; d < p.head_dim; d = d + WG) {
    var acc = 0.0;
    for (var j = first; j < last; j = j + 1u) { acc = acc + s[sb + j] * v[vb + j * p.ld_kv + d]; }
    out[ob + d] = acc * inv;
  }
}
