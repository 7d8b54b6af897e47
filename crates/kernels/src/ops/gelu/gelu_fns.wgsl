// GELU in its tanh form (as GPT-2) and its derivative, on GeluV (an alias gelu/mod.rs's `wgsl_fns`
// declares: f32 or a vector of f32), written once for every kernel that computes them (gelu.wgsl,
// gelu_f16.wgsl, and the tensor-core training product's epilogue), so each gives the same values.
//   gelu(x)  = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   gelu'(x) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// u is clamped to +-15 (tanh is 1 to f32 precision there) because some drivers compute tanh through
// exp and return NaN for large arguments.
const GELU_S2PI: f32 = 0.7978845608028654;
const GELU_K: f32 = 0.044715;

fn gelu_tanh(v: GeluV) -> GeluV {
  return tanh(clamp(GELU_S2PI * (v + GELU_K * v * v * v), GeluV(-15.0), GeluV(15.0)));
}

fn gelu_of(v: GeluV) -> GeluV {
  let t = gelu_tanh(v);
  return 0.5 * v * (1.0 + t);
}

// dy * gelu'(v).
fn gelu_grad_of(v: GeluV, dy: GeluV) -> GeluV {
  let t = gelu_tanh(v);
  let d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * GELU_S2PI * (1.0 + 3.0 * GELU_K * v * v);
  return dy * d;
}
