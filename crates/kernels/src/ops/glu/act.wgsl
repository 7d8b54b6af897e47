// The gate's activation and its derivative, (act(x), act'(x)): SiLU (p.act = 0: SwiGLU, llama) or
// tanh-GELU (1: GeGLU, Gemma). Prepended to the GLU kernels, whose parameters hold `act`.
const S2PI: f32 = 0.7978845608028654;
const K: f32 = 0.044715;

fn act(x: f32) -> vec2<f32> {
  if (p.act == 0u) {
    let s = 1.0 / (1.0 + exp(-x));
    return vec2<f32>(x * s, s * (1.0 + x * (1.0 - s)));
  }
  let t = tanh(clamp(S2PI * (x + K * x * x * x), -15.0, 15.0));
  return vec2<f32>(0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * S2PI * (1.0 + 3.0 * K * x * x));
}
