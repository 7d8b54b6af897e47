// Stage 2: out = scale * sum(partial[0..blocks]) (+ out when accumulating), one workgroup.
struct Params { n: u32, start: u32, o_part: u32, o_out: u32, scale: f32, accumulate: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

const WG: u32 = 256u;
var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32) {
  var s = 0.0;
  for (var i = lid; i < p.n; i = i + WG) { s = s + part[p.o_part + i]; }
  red[lid] = s;
  workgroupBarrier();
  for (var k = WG / 2u; k > 0u; k = k >> 1u) {
    if (lid < k) { red[lid] = red[lid] + red[lid + k]; }
    workgroupBarrier();
  }
  if (lid == 0u) {
    var v = p.scale * red[0];
    if (p.accumulate != 0u) { v = v + out[p.o_out]; }
    out[p.o_out] = v;
  }
}
