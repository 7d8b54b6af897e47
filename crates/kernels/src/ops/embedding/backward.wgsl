// dtable[uniq[u]] (+)= scale * sum over the tokens j in order[offsets[u]..offsets[u+1]] of dout[j],
// one workgroup per distinct id, tokens summed in a fixed order (deterministic, no atomics).
struct Params { n: u32, start: u32, o_uniq: u32, o_offs: u32, o_order: u32, o_dout: u32, o_tab: u32,
                dim: u32, u0: u32, r0: u32, accumulate: u32, scale: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> uniq: array<u32>;
@group(0) @binding(2) var<storage, read> offs: array<u32>;
@group(0) @binding(3) var<storage, read> order: array<u32>;
@group(0) @binding(4) var<storage, read> dout: array<f32>;
@group(0) @binding(5) var<storage, read_write> dtab: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let g = group_index(wid, nwg);
  if (g >= p.n) { return; }
  let u = p.u0 + g;
  let row = uniq[p.o_uniq + u] - p.r0;
  let j0 = offs[p.o_offs + u];
  let j1 = offs[p.o_offs + u + 1u];
  for (var c = lid; c < p.dim; c = c + 256u) {
    var s = 0.0;
    for (var j = j0; j < j1; j = j + 1u) { s = s + dout[p.o_dout + order[p.o_order + j] * p.dim + c]; }
    let ti = p.o_tab + row * p.dim + c;
    var v = p.scale * s;
    if (p.accumulate != 0u) { v = v + dtab[ti]; }
    dtab[ti] = v;
  }
}
