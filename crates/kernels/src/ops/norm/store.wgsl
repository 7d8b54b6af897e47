// How the norm's forward kernels write a row's outputs: columns first, first + step, ... of row `row`
// (its x at `base`), as f32 (store_f16.wgsl: as f16 pairs).
fn store_row(row: u32, base: u32, mean: f32, rstd: f32, first: u32, step: u32) {
  let ybase = p.o_y + row * p.cols;
  for (var c = first; c < p.cols; c = c + step) {
    y[ybase + c] = (x[base + c] - mean) * rstd * w[p.o_w + c];
  }
}
