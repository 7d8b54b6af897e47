// LayerNorm (no bias) or RMSNorm of each row, one workgroup per row:
//   LN:  y = (x - mean) * rstd * w,  rstd = 1 / sqrt(mean((x - mean)^2) + eps)
//   RMS: y = x * rstd * w,           rstd = 1 / sqrt(mean(x^2) + eps)
// mean and rstd are saved per row for the backward pass (mean = 0 for RMS).
// Params and bindings: forward_params.wgsl; store_row: store.wgsl or store_f16.wgsl.

// reduce_sum / reduce_max and WG: ops/common.rs, ROW_REDUCE.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let row = group_index(wid, nwg);
  if (row >= p.n) { return; }
  let base = p.o_x + row * p.cols;
  let inv = 1.0 / f32(p.cols);
  var mean = 0.0;
  if (p.rms == 0u) {
    var s = 0.0;
    for (var c = lid; c < p.cols; c = c + WG) { s = s + x[base + c]; }
    mean = reduce_sum(s, lid) * inv;
  }
  var q = 0.0;
  for (var c = lid; c < p.cols; c = c + WG) { let d = x[base + c] - mean; q = q + d * d; }
  let rstd = 1.0 / sqrt(reduce_sum(q, lid) * inv + p.eps);
  store_row(row, base, mean, rstd, lid, WG);
  if (lid == 0u) {
    mean_out[p.o_mean + row] = mean;
    rstd_out[p.o_rstd + row] = rstd;
  }
}
