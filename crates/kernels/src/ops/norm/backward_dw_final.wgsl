// Weight gradient, stage 2: dw[c] (+)= the sum over blocks of part[c * blocks + block] (the partial sums
// of backward_fused.wgsl). A workgroup takes 8 columns, 32 threads a column splitting the blocks.
struct Params { n: u32, start: u32, o_part: u32, o_dw: u32, blocks: u32, accumulate: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> dw: array<f32>;

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let c = group_index(wid, nwg) * 8u + lid / 32u;
  let lane = lid % 32u;
  // The thread's blocks lane, lane + 32, ... added in that order; four loads are issued before their
  // four additions (the same running sum, so the same bits as one load and one addition at a time).
  var s = 0.0;
  if (c < p.n) {
    let base = p.o_part + c * p.blocks;
    var b = lane;
    for (; b + 96u < p.blocks; b = b + 128u) {
      let v0 = part[base + b];
      let v1 = part[base + b + 32u];
      let v2 = part[base + b + 64u];
      let v3 = part[base + b + 96u];
      s = s + v0;
      s = s + v1;
      s = s + v2;
      s = s + v3;
    }
    for (; b < p.blocks; b = b + 32u) { s = s + part[base + b]; }
  }
  red[lid] = s;
  workgroupBarrier();
  for (var h = 16u; h > 0u; h = h >> 1u) {
    if (lane < h) { red[lid] = red[lid] + red[lid + h]; }
    workgroupBarrier();
  }
  if (lane == 0u && c < p.n) {
    var t = red[lid];
    if (p.accumulate != 0u) { t = t + dw[p.o_dw + c]; }
    dw[p.o_dw + c] = t;
  }
}
