// GELU forward or backward (gelu.wgsl's vec4 form, the same expressions) with its output rounded to
// f16 pairs: four values a thread, stored as two u32 words (`pack2x16float`, as pack_f16.wgsl rounds).
// For a tensor only the tensor-core training products read, which stage exactly those f16 values: the
// MLP's activation (forward) and the gradient at c_fc's output (backward).
struct Params { n: u32, start: u32, o_x: u32, o_dy: u32, o_out: u32, backward: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> dy: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<vec2<u32>>;

const S2PI: f32 = 0.7978845608028654;
const K: f32 = 0.044715;

fn one(i: u32) {
  let v = x[p.o_x / 4u + i];
  let u = clamp(S2PI * (v + K * v * v * v), vec4<f32>(-15.0), vec4<f32>(15.0));
  let t = tanh(u);
  var r: vec4<f32>;
  if (p.backward == 0u) {
    r = 0.5 * v * (1.0 + t);
  } else {
    let d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * S2PI * (1.0 + 3.0 * K * v * v);
    r = dy[p.o_dy / 4u + i] * d;
  }
  out[p.o_out / 2u + i] = vec2<u32>(pack2x16float(r.xy), pack2x16float(r.zw));
}

// main: ops/common.rs, FOUR_A_THREAD_MAIN (four elements a thread).
