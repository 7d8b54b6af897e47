// dpos[q, c] = sum over tokens i with i % period == q of dout[i, c], one thread per (q, c).
struct Params { n: u32, start: u32, o_dout: u32, o_dpos: u32, dim: u32, tokens: u32, period: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> dout: array<f32>;
@group(0) @binding(2) var<storage, read_write> dpos: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let e = group_index(wid, nwg) * 256u + lid;
  if (e >= p.n) { return; }
  let q = e / p.dim;
  let c = e % p.dim;
  var s = 0.0;
  for (var i = q; i < p.tokens; i = i + p.period) { s = s + dout[p.o_dout + i * p.dim + c]; }
  dpos[p.o_dpos + e] = s;
}
