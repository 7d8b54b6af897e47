// One lane's sum over one 16-byte quant vector, for the one-row kernels (gemv_q8.wgsl, gemv_q4.wgsl)
// and the batch kernels alike, so a batch's rows get the bits of the rows alone: the `_floats` forms
// take the quants already converted (exactly) to floats, and the rest convert, then call them; the
// batch kernels that convert a workgroup's weights once (gemv_rows_q8.wgsl, gemv_rows_q4.wgsl) call
// them on the converted vectors. gpu.rs puts this in front of the gemv family's kernels (after
// sext.wgsl).

// s · Σ q · x over an 8-bit vector's 16 values, x given as four vec4 (values 16w .. 16w + 15): each
// word's four products summed in f32, the sub-total scaled once.
fn q8_vector(q: vec4<u32>, s: f32, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>) -> f32 {
  return q8_floats(sext(q.x), sext(q.y), sext(q.z), sext(q.w), s, x0, x1, x2, x3);
}

// q8_vector's sum with the quants already turned into floats (a, b, c, d: words x, y, z, w; the batch
// kernels convert each vector once in workgroup memory for all their rows of x). The conversion is
// exact, so both give the same values from the same arithmetic.
fn q8_floats(a: vec4<f32>, b: vec4<f32>, c: vec4<f32>, d: vec4<f32>, s: f32,
             x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>) -> f32 {
  return s * (dot(a, x0) + dot(b, x1) + dot(c, x2) + dot(d, x3));
}

// A word's low and high nibbles (values 4c.. and 16 + 4c.. of its block) as floats, exact.
fn low_nibbles(w: u32) -> vec4<f32> {
  return vec4<f32>((vec4<u32>(w) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(15u));
}
fn high_nibbles(w: u32) -> vec4<f32> {
  return vec4<f32>((vec4<u32>(w) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(15u));
}

// Σ over one word's 8 values of q · x: low nibbles against xa (values 4c..), high against xc (16 + 4c..).
fn word_floats(lo: vec4<f32>, hi: vec4<f32>, xa: vec4<f32>, xc: vec4<f32>) -> f32 {
  return dot(lo, xa) + dot(hi, xc);
}

// Σ (scale · q + min) · x over a 4-bit block of 32 values (x0 .. x7: values 0..3, 4..7, ...), factored
// as scale · Σ q·x + min · Σ x. Word c holds values 4c..4c+3 in its low nibbles and 16+4c..16+4c+3 in
// its high nibbles (GGUF's Q4_0 order, see q4.wgsl).
fn q4_block(q: vec4<u32>, s: f32, mn: f32, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>,
            x4: vec4<f32>, x5: vec4<f32>, x6: vec4<f32>, x7: vec4<f32>) -> f32 {
  return q4_floats(low_nibbles(q.x), high_nibbles(q.x), low_nibbles(q.y), high_nibbles(q.y), low_nibbles(q.z),
                   high_nibbles(q.z), low_nibbles(q.w), high_nibbles(q.w), s, mn, x0, x1, x2, x3, x4, x5, x6, x7);
}

// q4_block's sum with the nibbles already floats (l0/h0 the low/high nibbles of word x, l1/h1 of y, ...;
// the batch kernels convert each block once in workgroup memory for all their rows of x).
fn q4_floats(l0: vec4<f32>, h0: vec4<f32>, l1: vec4<f32>, h1: vec4<f32>, l2: vec4<f32>, h2: vec4<f32>,
             l3: vec4<f32>, h3: vec4<f32>, s: f32, mn: f32, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>,
             x3: vec4<f32>, x4: vec4<f32>, x5: vec4<f32>, x6: vec4<f32>, x7: vec4<f32>) -> f32 {
  let qx = word_floats(l0, h0, x0, x4) + word_floats(l1, h1, x1, x5) + word_floats(l2, h2, x2, x6)
    + word_floats(l3, h3, x3, x7);
  return s * qx + mn * dot(x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7, vec4<f32>(1.0));
}
