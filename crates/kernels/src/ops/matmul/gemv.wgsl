// y = alpha * x · Wᵀ + beta * y for up to 8 rows of x (decoding): one W row (= one output column) per
// 32-thread slice, eight slices per workgroup. Each slice strides along K (coalesced reads of W, read
// once for all x rows), then the partial sums meet in workgroup memory behind a single barrier — the
// tiled GEMM would waste most of its tile on one row and pay two barriers per k-step.
struct Params { m: u32, n: u32, k: u32, lda: u32, ldb: u32, ldc: u32, a_off: u32, b_off: u32, c_off: u32, alpha: f32, beta: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<f32>;
@group(0) @binding(3) var<storage, read_write> C: array<f32>;

var<workgroup> part: array<f32, 2048>; // [x row][thread]

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let slice = lid / 32u;
  let lane = lid % 32u;
  let col = group_index(wid, nwg) * 8u + slice;
  var acc = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
  if (col < p.n) {
    let wb = p.b_off + col * p.ldb;
    for (var k = lane; k < p.k; k = k + 32u) {
      let w = B[wb + k];
      for (var i = 0u; i < 8u; i = i + 1u) {
        if (i < p.m) { acc[i] = acc[i] + A[p.a_off + i * p.lda + k] * w; }
      }
    }
  }
  for (var i = 0u; i < 8u; i = i + 1u) { part[i * 256u + lid] = acc[i]; }
  workgroupBarrier();
  // Thread t < 64 sums the 32 lanes of (x row t / 8, slice t % 8).
  if (lid < 64u) {
    let i = lid / 8u;
    let s = lid % 8u;
    let c = group_index(wid, nwg) * 8u + s;
    if (i < p.m && c < p.n) {
      var sum = 0.0;
      for (var l = 0u; l < 32u; l = l + 1u) { sum = sum + part[i * 256u + s * 32u + l]; }
      let ci = p.c_off + i * p.ldc + c;
      var v = p.alpha * sum;
      if (p.beta != 0.0) { v = v + p.beta * C[ci]; }
      C[ci] = v;
    }
  }
}
