// dropout.wgsl without a residual, its output rounded to f16 pairs: four elements a thread (one
// vec4 of x, two u32 words of out, `pack2x16float` as pack_f16.wgsl rounds), each element's mask and
// value as dropout.wgsl forms them. Units count vectors; offsets count f32 elements (x) and words
// (out). For a tensor only the tensor-core training products read (the gradient at a product's output).
struct Params { n: u32, start: u32, o_x: u32, o_out: u32, threshold: u32, seed: u32, scale: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> out: array<vec2<u32>>;

// hash: hash.wgsl.

fn one(i: u32) {
  let e = 4u * (p.start + i);
  let hs = hash(p.seed);
  let keep = vec4<bool>(hash(e ^ hs) >= p.threshold, hash((e + 1u) ^ hs) >= p.threshold,
                        hash((e + 2u) ^ hs) >= p.threshold, hash((e + 3u) ^ hs) >= p.threshold);
  let v = select(vec4<f32>(0.0), x[p.o_x / 4u + i] * p.scale, keep);
  out[p.o_out / 2u + i] = vec2<u32>(pack2x16float(v.xy), pack2x16float(v.zw));
}

// main: ops/common.rs, FOUR_A_THREAD_MAIN (four vectors a thread).
