// y[i, n] = Σ_b (scale[n, b] · Σ_{k in b} q[n, k] · x[i, k] + min[n, b] · Σ_{k in b} x[i, k])  for R rows i
// of x per pass over the weights: value = scale · q + min, with the min factored out of each block.
//
// gpu.rs prepends WG, TPR, R, BLOCK (32), XT and xload as for q8.wgsl; the work split is the same, with one
// 16-byte load (32 quants), one scale and one min per block. A block's bytes hold two values each, in
// GGUF's Q4_0 order: byte j (0..16) holds value j in its low nibble and value j + 16 in its high nibble, so
// word c (0..4) of the block gives values 4c..4c+3 (low nibbles) and 16+4c..16+4c+3 (high nibbles).
struct Params { n: u32, nb: u32, m: u32, k: u32, ldy: u32, o_x: u32, o_y: u32, o_s: u32, o_q: u32, o_m: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<XT>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read> mins: array<f32>;
@group(0) @binding(5) var<storage, read> quants: array<vec4<u32>>;

var<workgroup> red: array<f32, R * WG>;

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
    // o_q is a word offset at a row start; rows are K/8 words with K a multiple of 32: a vec4 index.
    let qrow = p.o_q / 4u + row * p.nb;
    let srow = row * p.nb;
    for (var b = lane; b < p.nb; b += TPR) {
      let q = quants[qrow + b];
      let s = scales[p.o_s + srow + b];
      let mn = mins[p.o_m + srow + b];
      var lo: array<vec4<f32>, 4>;
      var hi: array<vec4<f32>, 4>;
      for (var c = 0u; c < 4u; c++) {
        let bytes = vec4<u32>(q[c]) >> vec4<u32>(0u, 8u, 16u, 24u);
        lo[c] = vec4<f32>(bytes & vec4<u32>(15u));
        hi[c] = vec4<f32>((bytes >> vec4<u32>(4u)) & vec4<u32>(15u));
      }
      for (var r = 0u; r < R; r++) {
        let xb = xr[r] + b * 32u;
        var t = vec4<f32>(0.0);
        var sx = vec4<f32>(0.0);
        for (var c = 0u; c < 4u; c++) {
          let xa = xload(xb + 4u * c);
          let xc = xload(xb + 16u + 4u * c);
          t = fma(lo[c], xa, t);
          t = fma(hi[c], xc, t);
          sx = sx + (xa + xc);
        }
        acc[r] = acc[r] + (s * ((t.x + t.y) + (t.z + t.w)) + mn * ((sx.x + sx.y) + (sx.z + sx.w)));
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
