// Decode attention: each query row against its own sequence's rows of a shared KV cache, for the rows of
// several sequences at once (a server's batch) in one dispatch. Row r's table entry [base, pos] says
// its keys and values are cache rows base .. base + pos (position pos is the row's own, written just
// before) and that it sees positions first ..= pos (first > 0 with a sliding window).
//
// Work split: one workgroup per (row, KV head, up to GMAX of the query heads that share it) and split of
// the positions (CHUNK per split, along y), so the K and V rows are read once for the group's heads
// and long contexts spread over many workgroups (flash decoding):
//
//   scores   thread t takes position lo + t: GMAX dot products with the queries in workgroup memory
//   softmax  max and sum over the workgroup for the GMAX heads at once (vec4 trees)
//   values   lane = lid % (head_dim / 4) takes 4 dimensions, lid / (head_dim / 4) every NJ-th position
//
// With one split the row's output is written normalised; with several, each split writes its partial
// (max, sum of exponentials, unnormalised output) and attend_combine.wgsl merges them.
struct Params { rows: u32, heads: u32, kv_heads: u32, head_dim: u32, ld_q: u32, ld_kv: u32, ld_o: u32,
                window: u32, scale: f32, softcap: f32, o_q: u32, o_k: u32, o_v: u32, o_out: u32,
                o_tab: u32, lo_row: u32, hi_row: u32, n_split: u32, o_part: u32, groups: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> kv: array<f32>;
@group(0) @binding(3) var<storage, read> tab: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> part: array<f32>;

const WG: u32 = 256u;
const CHUNK: u32 = 256u;
const GMAX: u32 = 4u;
var<workgroup> qs: array<vec4<f32>, 256>;          // GMAX heads x head_dim / 4 (head_dim <= 256)
var<workgroup> ps: array<vec4<f32>, CHUNK>;        // the GMAX heads' probabilities of one position
var<workgroup> red: array<vec4<f32>, WG>;
var<workgroup> wbase: u32;
var<workgroup> wpos: u32;

fn tree_max(v: vec4<f32>, lid: u32) -> vec4<f32> {
  red[lid] = v;
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s = s >> 1u) {
    if (lid < s) { red[lid] = max(red[lid], red[lid + s]); }
    workgroupBarrier();
  }
  let r = red[0];
  workgroupBarrier();
  return r;
}

fn tree_sum(v: vec4<f32>, lid: u32) -> vec4<f32> {
  red[lid] = v;
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s = s >> 1u) {
    if (lid < s) { red[lid] = red[lid] + red[lid + s]; }
    workgroupBarrier();
  }
  let r = red[0];
  workgroupBarrier();
  return r;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let gx = wid.x + wid.z * nwg.x;
  let per_row = p.kv_heads * p.groups;
  if (gx >= p.rows * per_row) { return; }
  let r = gx / per_row;
  let kvh = (gx % per_row) / p.groups;
  let gq = gx % p.groups;
  let group = p.heads / p.kv_heads;
  let h0 = kvh * group + gq * GMAX;
  let nh = min(GMAX, group - gq * GMAX);
  // Through workgroup memory, so the compiler knows every thread sees the same values.
  if (lid == 0u) {
    wbase = tab[p.o_tab + 2u * r];
    wpos = tab[p.o_tab + 2u * r + 1u];
  }
  let base = workgroupUniformLoad(&wbase);
  let pos = workgroupUniformLoad(&wpos);
  // Rows of other cache buffers are another dispatch's.
  if (base < p.lo_row || base >= p.hi_row) { return; }
  var first = 0u;
  if (p.window > 0u && pos + 1u > p.window) { first = pos + 1u - p.window; }
  let lo = first + wid.y * CHUNK;
  let hi = min(lo + CHUNK, pos + 1u);
  let hd4 = p.head_dim / 4u;
  if (lo >= hi) {
    // An empty split (rows of a batch differ in length): nothing to merge.
    if (lid < nh) {
      let at = p.o_part + ((r * p.heads + h0 + lid) * p.n_split + wid.y) * (p.head_dim + 2u);
      part[at] = bitcast<f32>(0xff800000u);
      part[at + 1u] = 0.0;
    }
    return;
  }
  for (var i = lid; i < nh * hd4; i = i + WG) {
    let g = i / hd4;
    let c = 4u * (i % hd4);
    let qb = p.o_q + r * p.ld_q + (h0 + g) * p.head_dim + c;
    qs[i] = vec4<f32>(q[qb], q[qb + 1u], q[qb + 2u], q[qb + 3u]);
  }
  workgroupBarrier();

  // Scores of position lo + lid for the nh heads (-inf past the split, so they weigh nothing).
  let ninf = bitcast<f32>(0xff800000u);
  var sc = vec4<f32>(ninf);
  let j = lo + lid;
  if (j < hi) {
    let kb = p.o_k + (base + j - p.lo_row) * p.ld_kv + kvh * p.head_dim;
    var acc = vec4<f32>(0.0);
    for (var c = 0u; c < hd4; c = c + 1u) {
      let k4 = vec4<f32>(kv[kb + 4u * c], kv[kb + 4u * c + 1u], kv[kb + 4u * c + 2u], kv[kb + 4u * c + 3u]);
      acc.x = acc.x + dot(qs[c], k4);
      if (nh > 1u) { acc.y = acc.y + dot(qs[hd4 + c], k4); }
      if (nh > 2u) { acc.z = acc.z + dot(qs[2u * hd4 + c], k4); }
      if (nh > 3u) { acc.w = acc.w + dot(qs[3u * hd4 + c], k4); }
    }
    sc = acc * p.scale;
    if (p.softcap > 0.0) { sc = p.softcap * tanh(clamp(sc / p.softcap, vec4<f32>(-15.0), vec4<f32>(15.0))); }
  }
  let m = tree_max(sc, lid);
  var e = vec4<f32>(0.0);
  if (j < hi) { e = exp(sc - m); }
  ps[lid] = e;
  let l = tree_sum(e, lid);

  // Values: lane takes dimensions 4·lane .. 4·lane + 3; its position group every NJ-th position.
  let nj = WG / hd4;
  let lane = lid % hd4;
  let jg = lid / hd4;
  var a0 = vec4<f32>(0.0);
  var a1 = vec4<f32>(0.0);
  var a2 = vec4<f32>(0.0);
  var a3 = vec4<f32>(0.0);
  if (jg < nj) {
    for (var jj = jg; jj < hi - lo; jj = jj + nj) {
      let vb = p.o_v + (base + lo + jj - p.lo_row) * p.ld_kv + kvh * p.head_dim + 4u * lane;
      let v4 = vec4<f32>(kv[vb], kv[vb + 1u], kv[vb + 2u], kv[vb + 3u]);
      let w = ps[jj];
      a0 = a0 + w.x * v4;
      a1 = a1 + w.y * v4;
      a2 = a2 + w.z * v4;
      a3 = a3 + w.w * v4;
    }
  }
  for (var g = 0u; g < nh; g = g + 1u) {
    var a = a0;
    if (g == 1u) { a = a1; }
    if (g == 2u) { a = a2; }
    if (g == 3u) { a = a3; }
    red[lid] = a;
    workgroupBarrier();
    if (jg == 0u) {
      var s = red[lane];
      for (var t = 1u; t < nj; t = t + 1u) { s = s + red[t * hd4 + lane]; }
      let h = h0 + g;
      if (p.n_split == 1u) {
        let ob = p.o_out + r * p.ld_o + h * p.head_dim + 4u * lane;
        let o = s / l[g];
        out[ob] = o.x;
        out[ob + 1u] = o.y;
        out[ob + 2u] = o.z;
        out[ob + 3u] = o.w;
      } else {
        let at = p.o_part + ((r * p.heads + h) * p.n_split + wid.y) * (p.head_dim + 2u);
        if (lane == 0u) {
          part[at] = m[g];
          part[at + 1u] = l[g];
        }
        part[at + 2u + 4u * lane] = s.x;
        part[at + 3u + 4u * lane] = s.y;
        part[at + 4u + 4u * lane] = s.z;
        part[at + 5u + 4u * lane] = s.w;
      }
    }
    workgroupBarrier();
  }
}
