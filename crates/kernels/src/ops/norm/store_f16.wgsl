// The norm's forward outputs as f16 pairs (norm_forward_f16): y is an array of u32 words, two columns
// a word (p.cols even; p.o_y in words). Each value is forward_params.wgsl's store_row's, rounded by
// pack2x16float as pack_f16.wgsl rounds; the thread writing columns c, c + step, ... in that form
// writes the pairs 2c, 2c + 2 step, ... here.
fn store_row(row: u32, base: u32, mean: f32, rstd: f32, first: u32, step: u32) {
  let ybase = p.o_y + row * (p.cols / 2u);
  for (var c = 2u * first; c < p.cols; c = c + 2u * step) {
    let y0 = (x[base + c] - mean) * rstd * w[p.o_w + c];
    let y1 = (x[base + c + 1u] - mean) * rstd * w[p.o_w + c + 1u];
    y[ybase + c / 2u] = pack2x16float(vec2<f32>(y0, y1));
  }
}
