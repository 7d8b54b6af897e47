// out[i] = value for i in 0..n (value as raw bits, so u32 tensors and NaN poison fill alike).
struct Params { n: u32, start: u32, o_out: u32, bits: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_index(wid, nwg) * 256u + lid;
  if (i < p.n) { out[p.o_out + i] = p.bits; }
}
