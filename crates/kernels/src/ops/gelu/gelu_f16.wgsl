// GELU forward or backward (gelu_fns.wgsl, on vec4<f32>) with its output rounded to f16 pairs: four
// values a thread, stored as two u32 words (`pack2x16float`, as pack_f16.wgsl rounds). For a tensor
// only the tensor-core training products read, which stage exactly those f16 values: the MLP's
// activation (forward) and the gradient at c_fc's output (backward).
struct Params { n: u32, start: u32, o_x: u32, o_dy: u32, o_out: u32, backward: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> dy: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<vec2<u32>>;

fn one(i: u32) {
  let v = x[p.o_x / 4u + i];
  var r: vec4<f32>;
  if (p.backward == 0u) {
    r = gelu_of(v);
  } else {
    r = gelu_grad_of(v, dy[p.o_dy / 4u + i]);
  }
  out[p.o_out / 2u + i] = vec2<u32>(pack2x16float(r.xy), pack2x16float(r.zw));
}

// main: ops/common.rs, FOUR_A_THREAD_MAIN (four elements a thread).
