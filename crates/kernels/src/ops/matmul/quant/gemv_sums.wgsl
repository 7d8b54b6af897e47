// One lane's sum over one 16-byte quant vector, for the one-row kernels (gemv_q8.wgsl, gemv_q4.wgsl)
// and the batch kernels (gemv_rows_q8.wgsl, gemv_rows_q4.wgsl) alike, so a batch's rows get the bits of
// the rows alone. gpu.rs puts this in front of the gemv family's kernels (after sext.wgsl).

// s · Σ q · x over an 8-bit vector's 16 values, x given as four vec4 (values 16w .. 16w + 15): each
// word's four products summed in f32, the sub-total scaled once.
fn q8_vector(q: vec4<u32>, s: f32, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>) -> f32 {
  return s * (dot(sext(q.x), x0) + dot(sext(q.y), x1) + dot(sext(q.z), x2) + dot(sext(q.w), x3));
}

// Σ over one word's 8 values of q · x: low nibbles against xa (values 4c..), high against xc (16 + 4c..).
fn word(w: u32, xa: vec4<f32>, xc: vec4<f32>) -> f32 {
  let u = vec4<u32>(w) >> vec4<u32>(0u, 8u, 16u, 24u);
  return dot(vec4<f32>(u & vec4<u32>(15u)), xa) + dot(vec4<f32>((u >> vec4<u32>(4u)) & vec4<u32>(15u)), xc);
}

// Σ (scale · q + min) · x over a 4-bit block of 32 values (x0 .. x7: values 0..3, 4..7, ...), factored
// as scale · Σ q·x + min · Σ x. Word c holds values 4c..4c+3 in its low nibbles and 16+4c..16+4c+3 in
// its high nibbles (GGUF's Q4_0 order, see q4.wgsl).
fn q4_block(q: vec4<u32>, s: f32, mn: f32, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>,
            x4: vec4<f32>, x5: vec4<f32>, x6: vec4<f32>, x7: vec4<f32>) -> f32 {
  let qx = word(q.x, x0, x4) + word(q.y, x1, x5) + word(q.z, x2, x6) + word(q.w, x3, x7);
  return s * qx + mn * dot(x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7, vec4<f32>(1.0));
}
