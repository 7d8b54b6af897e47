// dst[i] = pack2x16float(src[2i], src[2i + 1]) (the last word of an odd count pads with 0).
struct Params { n: u32, start: u32, o_src: u32, o_dst: u32, count: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_index(wid, nwg) * 256u + lid;
  if (i >= p.n) { return; }
  let e = 2u * i;
  var hi = 0.0;
  if (e + 1u < p.count) { hi = src[p.o_src + e + 1u]; }
  dst[p.o_dst + i] = pack2x16float(vec2<f32>(src[p.o_src + e], hi));
}
