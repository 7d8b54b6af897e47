// The second stage: one workgroup per row merges the candidates sample_partial.wgsl wrote for the row's
// blocks into its K best (the same order), then its first thread draws the token:
//   greedy row (temperature 0): the best candidate (the first maximum, as the argmax picks);
//   else: p_j ∝ exp((l_j − l_0) / T) over the K best, cut to the shortest prefix whose sum reaches
//   top_p, renormalised, and the token where the cumulative sum first passes u = draw(seed, counter).
// A row with no candidate gives token 0. Row parameters (8 words): temperature bits, top_k, top_p bits,
// seed low, seed high, counter, 0, 0.
struct Params { rows: u32, blocks: u32, o_out: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<u32>;
@group(0) @binding(2) var<storage, read> rp: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<u32>;

var<workgroup> wk: u32;
var<workgroup> top_v: array<f32, KMAX>;
var<workgroup> top_i: array<u32, KMAX>;

// lowbias32 (a 32-bit integer hash); draw() hashes the seed's two words and the counter.
fn mix(a: u32) -> u32 {
  var x = a;
  x ^= x >> 16u;
  x *= 0x7feb352du;
  x ^= x >> 15u;
  x *= 0x846ca68bu;
  x ^= x >> 16u;
  return x;
}

fn draw(lo: u32, hi: u32, counter: u32) -> f32 {
  let h = mix(lo ^ mix(hi ^ mix(counter + 0x9e3779b9u)));
  return f32(h >> 8u) * (1.0 / 16777216.0);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let r = wid.x;
  if (r >= p.rows) { return; }
  let t = bitcast<f32>(rp[r * 8u]);
  if (lid == 0u) { wk = select(min(rp[r * 8u + 1u], KMAX), 1u, t == 0.0); }
  let k = workgroupUniformLoad(&wk);
  let total = p.blocks * KMAX;
  var pv = 0.0;
  var pi = NONE;
  var n = 0u;
  for (var j = 0u; j < k; j++) {
    var bv = 0.0;
    var bi = NONE;
    for (var s = lid; s < total; s += WG) {
      let at = (r * total + s) * 2u;
      let c = part[at + 1u];
      let cv = bitcast<f32>(part[at]);
      if (c != NONE && after(cv, c, pv, pi) && (bi == NONE || cv > bv || (cv == bv && c < bi))) { bv = cv; bi = c; }
    }
    best_tree(bv, bi, lid);
    pv = best_v[0];
    pi = workgroupUniformLoad(&best_i[0]);
    workgroupBarrier();
    if (pi == NONE) { break; }
    if (lid == 0u) {
      top_v[j] = pv;
      top_i[j] = pi;
    }
    n = j + 1u;
  }
  if (lid != 0u) { return; }
  if (n == 0u) {
    out[p.o_out + r] = 0u;
    return;
  }
  if (t == 0.0) {
    out[p.o_out + r] = top_i[0];
    return;
  }
  let top_p = bitcast<f32>(rp[r * 8u + 2u]);
  let v0 = top_v[0];
  var sum = 0.0;
  for (var j = 0u; j < n; j++) {
    let e = exp((top_v[j] - v0) / t);
    top_v[j] = e;
    sum += e;
  }
  // The nucleus: the shortest prefix whose probability reaches top_p (all of it when top_p is 1).
  var keep = n;
  if (top_p < 1.0) {
    var acc = 0.0;
    for (var j = 0u; j < n; j++) {
      acc += top_v[j] / sum;
      if (acc >= top_p) {
        keep = j + 1u;
        break;
      }
    }
  }
  var kept = 0.0;
  for (var j = 0u; j < keep; j++) { kept += top_v[j]; }
  let u = draw(rp[r * 8u + 3u], rp[r * 8u + 4u], rp[r * 8u + 5u]) * kept;
  var acc = 0.0;
  var pick = top_i[keep - 1u];
  for (var j = 0u; j < keep; j++) {
    acc += top_v[j];
    if (u < acc) {
      pick = top_i[j];
      break;
    }
  }
  out[p.o_out + r] = pick;
}
