// Stage 1 of a sum (or sum of squares): each workgroup sums its 4096-element block into partial[block].
struct Params { n: u32, start: u32, o_x: u32, o_part: u32, squares: u32, block0: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> part: array<f32>;

const WG: u32 = 256u;
const BLOCK: u32 = 4096u;
var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let b = group_index(wid, nwg);
  let i0 = b * BLOCK;
  if (i0 >= p.n) { return; }
  var s = 0.0;
  for (var i = i0 + lid; i < min(i0 + BLOCK, p.n); i = i + WG) {
    let v = x[p.o_x + i];
    s = s + select(v, v * v, p.squares != 0u);
  }
  red[lid] = s;
  workgroupBarrier();
  for (var k = WG / 2u; k > 0u; k = k >> 1u) {
    if (lid < k) { red[lid] = red[lid] + red[lid + k]; }
    workgroupBarrier();
  }
  if (lid == 0u) { part[p.o_part + p.block0 + b] = red[0]; }
}
