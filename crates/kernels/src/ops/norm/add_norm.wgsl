// x += RMSNorm(d) · w per row, one workgroup per row: Gemma 3's post-norms, where a sublayer's output is
// normed before it joins the residual stream. The norm is the forward kernel's (same sums, same order),
// so the result equals that kernel followed by add_assign.
struct Params { n: u32, start: u32, o_x: u32, o_d: u32, o_w: u32, cols: u32, eps: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> d: array<f32>;
@group(0) @binding(3) var<storage, read> w: array<f32>;

// reduce_sum and WG: ops/common.rs, ROW_REDUCE.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let row = group_index(wid, nwg);
  if (row >= p.n) { return; }
  let inv = 1.0 / f32(p.cols);
  let db = p.o_d + row * p.cols;
  var q = 0.0;
  for (var c = lid; c < p.cols; c = c + WG) { let v = d[db + c]; q = q + v * v; }
  let rstd = 1.0 / sqrt(reduce_sum(q, lid) * inv + p.eps);
  let xb = p.o_x + row * p.cols;
  for (var c = lid; c < p.cols; c = c + WG) {
    x[xb + c] = x[xb + c] + d[db + c] * rstd * w[p.o_w + c];
  }
}
