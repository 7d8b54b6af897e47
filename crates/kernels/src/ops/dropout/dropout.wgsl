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

// Four elements a thread, 256 apart (each access stays coalesced), so a thread has four loads in flight.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_index(wid, nwg) * 1024u + lid;
  if (i + 768u < p.n) {
    one(i);
    one(i + 256u);
    one(i + 512u);
    one(i + 768u);
  } else {
    for (var j = 0u; j < 4u; j = j + 1u) {
      if (i + 256u * j < p.n) { one(i + 256u * j); }
    }
  }
}
