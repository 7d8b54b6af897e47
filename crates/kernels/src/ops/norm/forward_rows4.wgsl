// forward.wgsl four rows a workgroup (64 threads a row), with forward.wgsl's bits: every sum is formed
// in the order forward.wgsl's 256 threads and its tree form it. Lane l of a row holds the row's
// columns l, l + 64, l + 128, ... in registers (COLS columns, CPL = ceil(COLS / 64) a lane, both
// prepended when the pipeline is built), every load issued before the first sum; the row is read
// once. forward.wgsl's thread l + 64 j sums columns l + 64 j + 256 i, i = 0, 1, ...: register
// j + 4 i, so s[j] below is that thread's partial sum; the lane adds the four as the tree's first two
// levels do (128 apart, then 64), and row_sum takes the levels below. Four rows share the workgroup's
// launch and its barriers, which forward.wgsl spends on each row.
// Params and bindings: forward_params.wgsl.

// WG (256) and red: ops/common.rs, ROW_REDUCE; TPR (64), ROWS and row_sum: ROWS4.
const_assert WG == 4u * TPR;
const_assert CPL * TPR >= COLS;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let lane = lid % TPR;
  let row = group_index(wid, nwg) * ROWS + lid / TPR;
  // Rows past the end compute the last row's numbers (every thread reaches every barrier) and write
  // nothing.
  let live = row < p.n;
  let base = p.o_x + min(row, p.n - 1u) * COLS;
  var xs: array<f32, CPL>;
  for (var m = 0u; m < CPL; m = m + 1u) {
    xs[m] = 0.0;
    if (lane + m * TPR < COLS) { xs[m] = x[base + lane + m * TPR]; }
  }
  let inv = 1.0 / f32(COLS);
  var mean = 0.0;
  if (p.rms == 0u) {
    var s = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    for (var m = 0u; m < CPL; m = m + 1u) {
      if (lane + m * TPR < COLS) { s[m % 4u] = s[m % 4u] + xs[m]; }
    }
    mean = row_sum((s[0] + s[2]) + (s[1] + s[3]), lid) * inv;
  }
  var q = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
  for (var m = 0u; m < CPL; m = m + 1u) {
    if (lane + m * TPR < COLS) { let d = xs[m] - mean; q[m % 4u] = q[m % 4u] + d * d; }
  }
  let rstd = 1.0 / sqrt(row_sum((q[0] + q[2]) + (q[1] + q[3]), lid) * inv + p.eps);
  if (!live) { return; }
  let ybase = p.o_y + row * COLS;
  for (var m = 0u; m < CPL; m = m + 1u) {
    let c = lane + m * TPR;
    if (c < COLS) { y[ybase + c] = (xs[m] - mean) * rstd * w[p.o_w + c]; }
  }
  if (lane == 0u) {
    mean_out[p.o_mean + row] = mean;
    rstd_out[p.o_rstd + row] = rstd;
  }
}
