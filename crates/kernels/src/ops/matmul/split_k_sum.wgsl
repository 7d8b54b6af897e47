// C[i, j] = alpha · Σ_s P[s, i, j] + beta · C[i, j] over the slices of a split-K product (P: `splits`
// packed m x n partial products, summed in slice order); C is not read when beta = 0. Four slices'
// loads are issued before their four additions (the same running sum, so the same bits as one load
// and one addition at a time).
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
  var acc = 0.0;
  var s = 0u;
  for (; s + 3u < p.splits; s = s + 4u) {
    let v0 = part[s * size + e];
    let v1 = part[(s + 1u) * size + e];
    let v2 = part[(s + 2u) * size + e];
    let v3 = part[(s + 3u) * size + e];
    acc = acc + v0;
    acc = acc + v1;
    acc = acc + v2;
    acc = acc + v3;
  }
  for (; s < p.splits; s = s + 1u) { acc = acc + part[s * size + e]; }
  let at = p.o_c + (e / p.n) * p.ldc + e % p.n;
  var x = p.alpha * acc;
  if (p.beta != 0.0) { x = x + p.beta * c[at]; }
  c[at] = x;
}
