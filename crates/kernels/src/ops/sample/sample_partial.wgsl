// The first stage of sampling a row of logits: workgroup (b, r) takes elements b·SPAN .. (b + 1)·SPAN of
// row r and writes its K best candidates, best first, to part[((r · blocks + b) · KMAX + j) · 2] as
// (value bits, index) — NONE past the last. Best: the larger logit, of equal logits the smaller index.
// K is the row's top-k (1 for greedy rows). Candidates: finite logits; a greedy row (temperature 0)
// also takes ±inf, as the argmax does (NaN never).
struct Params { rows: u32, cols: u32, o_x: u32, blocks: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> rp: array<u32>;
@group(0) @binding(3) var<storage, read_write> part: array<u32>;

var<workgroup> wk: u32;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let b = wid.x;
  let r = wid.y;
  if (b >= p.blocks || r >= p.rows) { return; }
  let greedy = bitcast<f32>(rp[r * 8u]) == 0.0;
  if (lid == 0u) { wk = select(min(rp[r * 8u + 1u], KMAX), 1u, greedy); }
  // Every thread runs the same rounds (they hold barriers).
  let k = workgroupUniformLoad(&wk);
  let base = p.o_x + r * p.cols;
  let c0 = b * SPAN;
  // This thread's elements c0 + lid + WG·e, held for every round.
  var v: array<f32, PER>;
  var ok: array<bool, PER>;
  for (var e = 0u; e < PER; e++) {
    let c = c0 + lid + e * WG;
    var val = 0.0;
    var good = false;
    if (c < p.cols) {
      val = x[base + c];
      good = val == val && (greedy || abs(val) <= 3.4028234663852886e38);
    }
    v[e] = val;
    ok[e] = good;
  }
  // Round j finds the best candidate after the previous round's pick in the order (`after`).
  var pv = 0.0;
  var pi = NONE;
  var n = 0u;
  for (var j = 0u; j < k; j++) {
    var bv = 0.0;
    var bi = NONE;
    for (var e = 0u; e < PER; e++) {
      let c = c0 + lid + e * WG;
      if (ok[e] && after(v[e], c, pv, pi) && (bi == NONE || v[e] > bv)) { bv = v[e]; bi = c; }
    }
    best_tree(bv, bi, lid);
    pv = best_v[0];
    pi = workgroupUniformLoad(&best_i[0]);
    // Everyone has read the pick before the next round's tree overwrites it.
    workgroupBarrier();
    if (lid == 0u) {
      let at = ((r * p.blocks + b) * KMAX + j) * 2u;
      part[at] = bitcast<u32>(pv);
      part[at + 1u] = pi;
    }
    n = j + 1u;
    if (pi == NONE) { break; }
  }
  // Slots after the last candidate say so.
  if (lid == 0u) {
    for (var j = n; j < KMAX; j++) {
      part[((r * p.blocks + b) * KMAX + j) * 2u + 1u] = NONE;
    }
  }
}
