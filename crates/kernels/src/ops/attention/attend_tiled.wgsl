// Prompt attention, flash style: one workgroup per (block of BQ query rows, head, split of the keys)
// walks the keys of its split that its rows see in blocks of BK, keeping each row's running maximum, sum of exponentials and unnormalised
// output (online softmax), so no score row is stored and each key and value row is read once per
// block of BQ queries instead of once per query. Query row r sits at position q_pos0 + r and sees keys
// j <= that position (with a sliding window, only the last `window` of them); head h reads KV head
// h / (heads / kv_heads). With one split the rows are written normalised; with several (long prompts:
// the splits shorten the longest workgroup's walk), each split writes its rows' partials (maximum, sum
// of exponentials, unnormalised output) and attend_combine.wgsl merges them.
//
// Threads: 256 = BQ rows x 16. For the scores, thread (qv, j) = (lid / 16, lid % 16) takes the dot of
// query row qv with key j of the block; for the values, thread (qv, lane) takes dimensions 4·lane ..
// 4·lane + 3 of every 64-wide chunk of the head. The head is staged through workgroup memory in chunks
// of 64 dimensions (NC chunks; the last zero-padded), so workgroup memory stays near 10 KiB for any
// head size up to 512 (WebGPU's default limit is 16 KiB). mod.rs prepends NC and repeats every line
// holding `$c` once per chunk (the output registers o0, o1, ...).
struct Params { rows: u32, heads: u32, kv_heads: u32, head_dim: u32, ld_q: u32, ld_kv: u32, ld_o: u32,
                q_pos0: u32, kv_len: u32, window: u32, scale: f32, softcap: f32,
                o_q: u32, o_k: u32, o_v: u32, o_out: u32, n_split: u32, split_keys: u32, o_part: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> part: array<f32>;

const BQ: u32 = 16u;
const BK: u32 = 16u;
// vec4s per staged row: 16 for the chunk, one of padding so that the 16 key rows a score step reads
// fall on different banks.
const KS: u32 = 17u;
var<workgroup> qs: array<vec4<f32>, 272>;   // BQ x KS
var<workgroup> kvs: array<vec4<f32>, 272>;  // BK x KS: a chunk of the block's keys, then of its values
var<workgroup> ps: array<f32, 256>;         // BQ x BK scores, then probabilities

// Element i of q (t = 0), k (1) or v (2).
fn elem(t: u32, i: u32) -> f32 {
  if (t == 0u) { return q[i]; }
  if (t == 1u) { return k[i]; }
  return v[i];
}

// Four consecutive elements of q, k or v from `at`, which holds dimension d of a head: those at or past
// the head's end as zeros.
fn load4(t: u32, at: u32, d: u32) -> vec4<f32> {
  var r = vec4<f32>(0.0);
  if (d < p.head_dim) { r.x = elem(t, at); }
  if (d + 1u < p.head_dim) { r.y = elem(t, at + 1u); }
  if (d + 2u < p.head_dim) { r.z = elem(t, at + 2u); }
  if (d + 3u < p.head_dim) { r.w = elem(t, at + 3u); }
  return r;
}

// Stages chunk c of the tile's query rows (rows past the pass read as zeros).
fn load_q(c: u32, r0: u32, h: u32, lid: u32) {
  let row = lid / 16u;
  let d = c * 64u + 4u * (lid % 16u);
  var x = vec4<f32>(0.0);
  if (r0 + row < p.rows) { x = load4(0u, p.o_q + (r0 + row) * p.ld_q + h * p.head_dim + d, d); }
  qs[row * KS + lid % 16u] = x;
}

// Stages chunk c of the block's keys (values with `vals`) from key kb on; keys at or past kend as zeros.
fn load_kv(c: u32, kb: u32, kend: u32, kvh: u32, lid: u32, vals: bool) {
  let j = lid / 16u;
  let d = c * 64u + 4u * (lid % 16u);
  var x = vec4<f32>(0.0);
  if (kb + j < kend) {
    let at = (kb + j) * p.ld_kv + kvh * p.head_dim + d;
    if (vals) { x = load4(2u, p.o_v + at, d); } else { x = load4(1u, p.o_k + at, d); }
  }
  kvs[j * KS + lid % 16u] = x;
}

// Σ_j P[qv, j] · V[j, dims of `lane`] over the staged chunk of values.
fn mix_v(c: u32, kb: u32, kend: u32, kvh: u32, qv: u32, lane: u32, lid: u32) -> vec4<f32> {
  workgroupBarrier();
  load_kv(c, kb, kend, kvh, lid, true);
  workgroupBarrier();
  var a = vec4<f32>(0.0);
  for (var j = 0u; j < BK; j = j + 1u) { a = a + ps[qv * BK + j] * kvs[j * KS + lane]; }
  return a;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let r0 = wid.x * BQ;
  let h = wid.y;
  let kvh = h / (p.heads / p.kv_heads);
  let qv = lid / 16u;
  let j = lid % 16u;
  let lane = lid % 16u;
  let qrow = r0 + qv;
  let qpos = p.q_pos0 + qrow;
  // The keys any row of the tile sees: from the first row's window start to the last row's position.
  let last_row = min(r0 + BQ, p.rows) - 1u;
  let kend_all = min(p.q_pos0 + last_row + 1u, p.kv_len);
  var kbeg_all = 0u;
  if (p.window > 0u && p.q_pos0 + r0 + 1u > p.window) { kbeg_all = p.q_pos0 + r0 + 1u - p.window; }
  // This workgroup's split of them (splits are counted from the tile's first key).
  let kbeg = kbeg_all + wid.z * p.split_keys;
  let kend = min(kend_all, kbeg + p.split_keys);

  let lowest = bitcast<f32>(0xff7fffffu); // -f32::MAX, as bits (the literal is out of range for some compilers)
  var m = lowest;
  var l = 0.0;
  var o$c = vec4<f32>(0.0);
  if (NC == 1u) { load_q(0u, r0, h, lid); }
  for (var kb = kbeg; kb < kend; kb = kb + BK) {
    // Scores of the block, chunk by chunk of the head.
    var s = 0.0;
    for (var c = 0u; c < NC; c = c + 1u) {
      workgroupBarrier();
      if (NC > 1u) { load_q(c, r0, h, lid); }
      load_kv(c, kb, kend, kvh, lid, false);
      workgroupBarrier();
      for (var i = 0u; i < 16u; i = i + 1u) { s = s + dot(qs[qv * KS + i], kvs[j * KS + i]); }
    }
    let key = kb + j;
    let seen = qrow < p.rows && key < kend && key <= qpos && (p.window == 0u || key + p.window > qpos);
    var sc = s * p.scale;
    if (p.softcap > 0.0) { sc = p.softcap * tanh(clamp(sc / p.softcap, -15.0, 15.0)); }
    if (!seen) { sc = lowest; }
    ps[qv * BK + j] = sc;
    workgroupBarrier();
    // Online softmax: every thread of row qv reads the row's BK scores.
    var mx = lowest;
    for (var i = 0u; i < BK; i = i + 1u) { mx = max(mx, ps[qv * BK + i]); }
    let mn = max(m, mx);
    let alpha = exp(m - mn);
    var e = 0.0;
    if (seen) { e = exp(sc - mn); }
    workgroupBarrier();
    ps[qv * BK + j] = e;
    workgroupBarrier();
    var sum = 0.0;
    for (var i = 0u; i < BK; i = i + 1u) { sum = sum + ps[qv * BK + i]; }
    l = l * alpha + sum;
    m = mn;
    o$c = o$c * alpha + mix_v($cu, kb, kend, kvh, qv, lane, lid);
  }
  if (qrow >= p.rows) { return; }
  if (p.n_split == 1u) {
    let inv = 1.0 / l;
    let ob = p.o_out + qrow * p.ld_o + h * p.head_dim;
    write(ob, $cu * 64u + 4u * lane, o$c * inv);
  } else {
    // An empty split (l = 0, also when kbeg >= kend) adds nothing to the merge.
    let at = p.o_part + ((qrow * p.heads + h) * p.n_split + wid.z) * (p.head_dim + 2u);
    if (lane == 0u) {
      part[at] = m;
      part[at + 1u] = l;
    }
    put(at + 2u, $cu * 64u + 4u * lane, o$c);
  }
}

// Up to four partial outputs from dimension d (those inside the head).
fn put(at: u32, d: u32, x: vec4<f32>) {
  if (d < p.head_dim) { part[at + d] = x.x; }
  if (d + 1u < p.head_dim) { part[at + d + 1u] = x.y; }
  if (d + 2u < p.head_dim) { part[at + d + 2u] = x.z; }
  if (d + 3u < p.head_dim) { part[at + d + 3u] = x.w; }
}

// Up to four outputs of a row from dimension d (those inside the head).
fn write(ob: u32, d: u32, x: vec4<f32>) {
  if (d < p.head_dim) { out[ob + d] = x.x; }
  if (d + 1u < p.head_dim) { out[ob + d + 1u] = x.y; }
  if (d + 2u < p.head_dim) { out[ob + d + 2u] = x.z; }
  if (d + 3u < p.head_dim) { out[ob + d + 3u] = x.w; }
}
