// y[i, n] = Σ_b scale[n, b] · Σ_{k in block b} q[n, k] · x[i, k]  for R rows i of x per pass over the weights.
//
// gpu.rs prepends: WG (threads per workgroup), TPR (threads per weight row, a power of two, ≥ R),
// R (rows of x per pass), BLOCK (16 or 32 quants per scale), XT and xload(i) = x[i..i + 4] for i a
// multiple of 4 (from an f32 binding, or a vec4 binding when x's offset is 16-byte aligned).
//
// Work split: each workgroup takes WG / TPR consecutive weight rows, TPR consecutive threads per row:
//
//   lid:   0 .. TPR-1 | TPR .. 2·TPR-1 | ...
//   row:   r0         | r0 + 1         | ...
//   lane t of a row takes its blocks t, t + TPR, t + 2·TPR, ...: BLOCK/16 loads of 16 bytes each
//   (vec4<u32>) and one f32 scale per block; lanes side by side read one contiguous span of the row.
//
// Each block's four-wide sub-total Σ q·x is f32, multiplied by the block's scale once; lanes then sum
// their R partials in workgroup memory (a tree over the TPR lanes of a row) and lane i writes y row i.
// Workgroup z takes rows z·R .. z·R + R of x; rows past p.m repeat the last one and are not written.
struct Params { n: u32, nb: u32, m: u32, k: u32, ldy: u32, o_x: u32, o_y: u32, o_s: u32, o_q: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<XT>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read> quants: array<vec4<u32>>;

// 16-byte loads per block.
const VPB: u32 = BLOCK / 16u;
var<workgroup> red: array<f32, R * WG>;

// The four signed bytes of a little-endian word as f32. Byte j is shifted to the top of the i32, then back
// down arithmetically, which copies its sign bit over the upper 24 bits (two's-complement sign extension);
// every value in -128..=127 is exact in f32.
fn sext(w: u32) -> vec4<f32> {
  return vec4<f32>((vec4<i32>(bitcast<i32>(w)) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let lane = lid % TPR;
  let row = group_index(wid, nwg) * (WG / TPR) + lid / TPR;
  let i0 = wid.z * R;
  var acc: array<f32, R>;
  for (var r = 0u; r < R; r++) { acc[r] = 0.0; }
  if (row < p.n) {
    var xr: array<u32, R>;
    for (var r = 0u; r < R; r++) { xr[r] = p.o_x + min(i0 + r, p.m - 1u) * p.k; }
    // o_q is a word offset at a row start, and rows are K/4 words with K a multiple of 16: a vec4 index.
    let qrow = p.o_q / 4u + row * p.nb * VPB;
    let srow = p.o_s + row * p.nb;
    for (var b = lane; b < p.nb; b += TPR) {
      let s = scales[srow + b];
      var w: array<vec4<f32>, 4u * VPB>;
      for (var v = 0u; v < VPB; v++) {
        let q = quants[qrow + b * VPB + v];
        w[4u * v] = sext(q.x);
        w[4u * v + 1u] = sext(q.y);
        w[4u * v + 2u] = sext(q.z);
        w[4u * v + 3u] = sext(q.w);
      }
      for (var r = 0u; r < R; r++) {
        let xb = xr[r] + b * BLOCK;
        var t = vec4<f32>(0.0);
        for (var j = 0u; j < 4u * VPB; j++) { t = fma(w[j], xload(xb + 4u * j), t); }
        acc[r] = fma(s, (t.x + t.y) + (t.z + t.w), acc[r]);
      }
    }
  }
  for (var r = 0u; r < R; r++) { red[r * WG + lid] = acc[r]; }
  workgroupBarrier();
  for (var h = TPR / 2u; h > 0u; h = h >> 1u) {
    if (lane < h) {
      for (var r = 0u; r < R; r++) { red[r * WG + lid] = red[r * WG + lid] + red[r * WG + lid + h]; }
    }
    workgroupBarrier();
  }
  if (lane < R && row < p.n && i0 + lane < p.m) {
    y[p.o_y + (i0 + lane) * p.ldy + row] = red[lane * WG + lid - lane];
  }
}
