// out[r, c] = act(gate[r, c]) * up[r, c] for rows r of `cols` outputs, gate and up rows `ld` apart (the
// halves of a fused gate/up product's rows): one workgroup per row.
struct Params { n: u32, start: u32, o_gate: u32, o_up: u32, o_out: u32, ld: u32, cols: u32, act: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> gate: array<f32>;
@group(0) @binding(2) var<storage, read> up: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

// act(x): act.wgsl, prepended.

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let r = group_index(wid, nwg);
  if (r >= p.n) { return; }
  for (var c = lid; c < p.cols; c = c + 256u) {
    out[p.o_out + r * p.cols + c] = act(gate[p.o_gate + r * p.ld + c]).x * up[p.o_up + r * p.ld + c];
  }
}
