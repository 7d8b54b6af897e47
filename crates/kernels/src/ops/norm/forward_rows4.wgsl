// forward.wgsl four rows a workgroup (64 threads a row), with forward.wgsl's bits: every sum is formed
// in the order forward.wgsl's 256 threads and its tree form it. Lane l of a row stands for that
// kernel's threads l, l + 64, l + 128 and l + 192: it forms their four partial sums as they do, adds
// them as the tree's first two levels do (128 apart, then 64), and row_sum takes the levels below.
// Four rows share the workgroup's launch and its barriers, which forward.wgsl spends on each row.
// Params and bindings: forward_params.wgsl; store_row: store.wgsl or store_f16.wgsl.

// WG (256) and red: ops/common.rs, ROW_REDUCE; TPR (64), ROWS and row_sum: ROWS4.
const_assert WG == 4u * TPR;

// What forward.wgsl's thread t sums for the mean: columns t, t + WG, ...
fn part_x(base: u32, t: u32) -> f32 {
  var s = 0.0;
  for (var c = t; c < p.cols; c = c + WG) { s = s + x[base + c]; }
  return s;
}

// ... and for the variance.
fn part_q(base: u32, t: u32, mean: f32) -> f32 {
  var q = 0.0;
  for (var c = t; c < p.cols; c = c + WG) { let d = x[base + c] - mean; q = q + d * d; }
  return q;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let lane = lid % TPR;
  let row = group_index(wid, nwg) * ROWS + lid / TPR;
  // Rows past the end compute the last row's numbers (every thread reaches every barrier) and write
  // nothing.
  let live = row < p.n;
  let base = p.o_x + min(row, p.n - 1u) * p.cols;
  let inv = 1.0 / f32(p.cols);
  var mean = 0.0;
  if (p.rms == 0u) {
    let s = (part_x(base, lane) + part_x(base, lane + 2u * TPR)) + (part_x(base, lane + TPR) + part_x(base, lane + 3u * TPR));
    mean = row_sum(s, lid) * inv;
  }
  let q = (part_q(base, lane, mean) + part_q(base, lane + 2u * TPR, mean)) + (part_q(base, lane + TPR, mean) + part_q(base, lane + 3u * TPR, mean));
  let rstd = 1.0 / sqrt(row_sum(q, lid) * inv + p.eps);
  if (!live) { return; }
  store_row(row, base, mean, rstd, lane, TPR);
  if (lane == 0u) {
    mean_out[p.o_mean + row] = mean;
    rstd_out[p.o_rstd + row] = rstd;
  }
}
