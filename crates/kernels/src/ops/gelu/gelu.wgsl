// GELU forward, or BACKWARD: dx = dy * gelu'(x) (gelu_fns.wgsl).
// gelu/mod.rs prepends V: f32, or vec4<f32> where every operand's offset and the length are multiples
// of 4 (each thread then loads and stores whole vectors; units and offsets count vectors, LANES values
// each). Every value is computed as in the f32 form.
struct Params { n: u32, start: u32, o_x: u32, o_dy: u32, o_out: u32, backward: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<V>;
@group(0) @binding(2) var<storage, read> dy: array<V>;
@group(0) @binding(3) var<storage, read_write> out: array<V>;

fn one(i: u32) {
  let v = x[p.o_x / LANES + i];
  if (p.backward == 0u) {
    out[p.o_out / LANES + i] = gelu_of(v);
  } else {
    out[p.o_out / LANES + i] = gelu_grad_of(v, dy[p.o_dy / LANES + i]);
  }
}

// main: ops/common.rs, FOUR_A_THREAD_MAIN (four elements a thread).
