// out = [residual +] x * keep(i) / (1 - p), keep(i) = hash(i, seed) >= p * 2^32. The mask is a pure
// function of (seed, element index), so the backward pass recomputes it (same seed) instead of storing
// it, and the CPU twin draws the same mask bit for bit.
struct Params { n: u32, start: u32, o_r: u32, o_x: u32, o_out: u32, threshold: u32, seed: u32, scale: f32, has_residual: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> residual: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

// hash: hash.wgsl.

fn one(i: u32) {
  let keep = hash((p.start + i) ^ hash(p.seed)) >= p.threshold;
  var v = select(0.0, x[p.o_x + i] * p.scale, keep);
  if (p.has_residual != 0u) { v = v + residual[p.o_r + i]; }
  out[p.o_out + i] = v;
}

// main: ops/common.rs, FOUR_A_THREAD_MAIN (four elements a thread).
