// Weight gradient, stage 2: dw[c] (+)= sum over blocks of partial[block, c].
struct Params { n: u32, start: u32, o_part: u32, o_dw: u32, blocks: u32, accumulate: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> dw: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let c = group_index(wid, nwg) * 256u + lid;
  if (c >= p.n) { return; }
  var s = 0.0;
  for (var b = 0u; b < p.blocks; b = b + 1u) { s = s + part[p.o_part + b * p.n + c]; }
  if (p.accumulate != 0u) { s = s + dw[p.o_dw + c]; }
  dw[p.o_dw + c] = s;
}
