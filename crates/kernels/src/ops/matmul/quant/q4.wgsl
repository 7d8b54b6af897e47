// y[i, n] = Σ_k (scale[n, b] · q[n, k] + min[n, b]) · x[i, k], b = k / 32, for R rows i of x per pass over
// the weights; each lane factors its part of a block as scale · Σ q·x + min · Σ x.
//
// gpu.rs prepends WG, TPR, R, BLOCK (32), XT, xload and the hooks, and repeats `$r` lines, as for q8.wgsl; the work
// split is the same (lane t takes words t, t + TPR, ... of its row), with 8 quants per word. A block's
// 16 bytes hold two values each, in GGUF's Q4_0 order: byte j holds value j in its low nibble and value
// j + 16 in its high nibble, so word c (0..4) of a block holds values 4c..4c+3 (low nibbles) and
// 16+4c..16+4c+3 (high nibbles): two vec4 reads of x, 64 bytes apart.
struct Params { n: u32, kw: u32, m: u32, k: u32, ldy: u32, o_x: u32, o_y: u32, o_s: u32, o_q: u32, o_m: u32,
                e0: u32, e1: u32, e2: u32, e3: u32, e4: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<XT>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read> mins: array<f32>;
@group(0) @binding(5) var<storage, read> quants: array<u32>;

var<workgroup> red: array<f32, R * WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let lane = lid % TPR;
  let row = group_index(wid, nwg) * (WG / TPR) + lid / TPR;
  let i0 = wid.z * R;
  prologue(lid, i0, group_index(wid, nwg));
  var acc$r = 0.0;
  if (row < p.n) {
    let x$r = xrow($r, i0);
    let qrow = p.o_q + row * p.kw;
    let srow = row * (p.kw / 4u);
    for (var w = lane; w < p.kw; w += TPR) {
      let b = w / 4u;
      let xi = b * 32u + (w % 4u) * 4u;
      let s = scales[p.o_s + srow + b];
      let mn = mins[p.o_m + srow + b];
      // Byte j of the word in lane j; its low nibble, then its high nibble (0..15, exact in f32).
      let u = vec4<u32>(quants[qrow + w]) >> vec4<u32>(0u, 8u, 16u, 24u);
      let lo = vec4<f32>(u & vec4<u32>(15u));
      let hi = vec4<f32>((u >> vec4<u32>(4u)) & vec4<u32>(15u));
      let xa$r = xget(x$r + xi);
      let xc$r = xget(x$r + xi + 16u);
      acc$r = acc$r + (s * (dot(lo, xa$r) + dot(hi, xc$r)) + mn * dot(xa$r + xc$r, vec4<f32>(1.0)));
    }
  }
  red[$r * WG + lid] = acc$r;
  workgroupBarrier();
  for (var h = TPR / 2u; h > 0u; h = h >> 1u) {
    if (lane < h) {
      red[$r * WG + lid] = red[$r * WG + lid] + red[$r * WG + lid + h];
    }
    workgroupBarrier();
  }
  if (lane < R && row < p.n && i0 + lane < p.m) {
    store(p.o_y + (i0 + lane) * p.ldy + row, red[lane * WG + lid - lane]);
  }
}
