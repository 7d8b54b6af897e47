// dst[e] = the f16 value e of src's pairs (pack_f16.wgsl's inverse), as f32.
struct Params { n: u32, start: u32, o_src: u32, o_dst: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let e = group_index(wid, nwg) * 256u + lid;
  if (e >= p.n) { return; }
  dst[p.o_dst + e] = unpack2x16float(src[p.o_src + e / 2u])[e % 2u];
}
