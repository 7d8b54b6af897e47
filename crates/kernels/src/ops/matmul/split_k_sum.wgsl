// C[i, j] = alpha · Σ_s P[s, i, j] + beta · C[i, j] over the slices of a split-K product (P: SPLITS
// packed m x n partial products, summed in slice order); C is not read when beta = 0. SPLITS is
// prepended when the pipeline is built, so every slice's load is issued before the first addition
// (the sum's order, and so its bits, are those of a running sum over the slices).
struct Params { m: u32, n: u32, splits: u32, ldc: u32, o_c: u32, alpha: f32, beta: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let e = group_index(wid, nwg) * 256u + lid;
  let size = p.m * p.n;
  if (e >= size) { return; }
  var v: array<f32, SPLITS>;
  for (var s = 0u; s < SPLITS; s = s + 1u) { v[s] = part[s * size + e]; }
  var acc = 0.0;
  for (var s = 0u; s < SPLITS; s = s + 1u) { acc = acc + v[s]; }
  let at = p.o_c + (e / p.n) * p.ldc + e % p.n;
  var x = p.alpha * acc;
  if (p.beta != 0.0) { x = x + p.beta * c[at]; }
  c[at] = x;
}
