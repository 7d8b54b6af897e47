// Weight gradient, stage 2: dw[c] (+)= sum over blocks of partial[block, c]. A workgroup takes 64
// columns; 4 lanes of 64 threads split the blocks.
struct Params { n: u32, start: u32, o_part: u32, o_dw: u32, blocks: u32, accumulate: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> dw: array<f32>;

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let c = group_index(wid, nwg) * 64u + (lid % 64u);
  let lane = lid / 64u;
  var s = 0.0;
  if (c < p.n) {
    for (var b = lane; b < p.blocks; b = b + 4u) { s = s + part[p.o_part + b * p.n + c]; }
  }
  red[lid] = s;
  workgroupBarrier();
  if (lane == 0u && c < p.n) {
    var t = red[lid] + red[lid + 64u] + red[lid + 128u] + red[lid + 192u];
    if (p.accumulate != 0u) { t = t + dw[p.o_dw + c]; }
    dw[p.o_dw + c] = t;
  }
}
