// out[i] = scale * table[ids[i]] (+ pos[(start + i) % period + pos0]) for the rows of this table chunk
// (ids in [r0, r1)); ids >= vocab give zero rows, written by the dispatch of the first chunk.
struct Params { n: u32, start: u32, o_ids: u32, o_out: u32, o_tab: u32, o_pos: u32,
                dim: u32, r0: u32, r1: u32, vocab: u32, first: u32, scale: f32, has_pos: u32, period: u32, pos0: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<storage, read> tab: array<f32>;
@group(0) @binding(4) var<storage, read> pos: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_index(wid, nwg);
  if (i >= p.n) { return; }
  let id = ids[p.o_ids + i];
  let inside = id >= p.r0 && id < p.r1;
  let invalid = id >= p.vocab;
  if (!inside && !(invalid && p.first != 0u)) { return; }
  let ob = p.o_out + i * p.dim;
  var pb = 0u;
  if (p.has_pos != 0u) { pb = p.o_pos + ((p.start + i) % p.period + p.pos0) * p.dim; }
  for (var c = lid; c < p.dim; c = c + 256u) {
    var v = 0.0;
    if (inside) { v = p.scale * tab[p.o_tab + (id - p.r0) * p.dim + c]; }
    if (p.has_pos != 0u) { v = v + pos[pb + c]; }
    out[ob + c] = v;
  }
}
