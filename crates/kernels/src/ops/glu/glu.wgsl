// Gated linear units: out = act(gate) * up, act = SiLU (SwiGLU, llama) or tanh-GELU (GeGLU, Gemma).
// BACKWARD: dgate = dout * up * act'(gate), dup = dout * act(gate) (written to out and out2).
struct Params { n: u32, start: u32, o_gate: u32, o_up: u32, o_dout: u32, o_out: u32, o_out2: u32, act: u32, backward: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> gate: array<f32>;
@group(0) @binding(2) var<storage, read> up: array<f32>;
@group(0) @binding(3) var<storage, read> dout: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> out2: array<f32>;

// act(x): act.wgsl, prepended.

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_index(wid, nwg) * 256u + lid;
  if (i >= p.n) { return; }
  let g = gate[p.o_gate + i];
  let u = up[p.o_up + i];
  let a = act(g);
  if (p.backward == 0u) {
    out[p.o_out + i] = a.x * u;
  } else {
    let d = dout[p.o_dout + i];
    out[p.o_out + i] = d * u * a.y;
    out2[p.o_out2 + i] = d * a.x;
  }
}
