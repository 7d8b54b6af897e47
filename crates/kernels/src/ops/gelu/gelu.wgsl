// GELU, tanh form (as GPT-2): y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
// BACKWARD: dx = dy * gelu'(x). The tanh argument is clamped to +-15 (tanh is 1 to f32 precision there)
// because some drivers compute tanh through exp and return NaN for large arguments.
// gelu/mod.rs prepends V: f32, or vec4<f32> where every operand's offset and the length are multiples
// of 4 (each thread then loads and stores whole vectors; units and offsets count vectors, LANES values
// each). Every value is computed as in the f32 form.
struct Params { n: u32, start: u32, o_x: u32, o_dy: u32, o_out: u32, backward: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<V>;
@group(0) @binding(2) var<storage, read> dy: array<V>;
@group(0) @binding(3) var<storage, read_write> out: array<V>;

const S2PI: f32 = 0.7978845608028654;
const K: f32 = 0.044715;

fn one(i: u32) {
  let v = x[p.o_x / LANES + i];
  let u = clamp(S2PI * (v + K * v * v * v), V(-15.0), V(15.0));
  let t = tanh(u);
  if (p.backward == 0u) {
    out[p.o_out / LANES + i] = 0.5 * v * (1.0 + t);
  } else {
    let d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * S2PI * (1.0 + 3.0 * K * v * v);
    out[p.o_out / LANES + i] = dy[p.o_dy / LANES + i] * d;
  }
}

// main: ops/common.rs, FOUR_A_THREAD_MAIN (four elements a thread).
