// The second stage of a long row's argmax: one workgroup per row reduces the (value bits, index) pairs
// argmax_partial.wgsl wrote for the row's blocks (in index order, so the same rules hold: the first of
// equal maxima; a row with nothing above -inf gives 0).
struct Params { rows: u32, blocks: u32, o_out: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let r = wid.x;
  if (r >= p.rows) { return; }
  // -inf from a variable: a constant expression of it is an error in WGSL (Tint refuses it).
  var ninf_bits = 0xff800000u;
  var bv = bitcast<f32>(ninf_bits);
  var bi = NONE;
  for (var b = lid; b < p.blocks; b += WG) {
    let v = bitcast<f32>(part[(r * p.blocks + b) * 2u]);
    let i = part[(r * p.blocks + b) * 2u + 1u];
    if (i != NONE && (bi == NONE || v > bv)) { bv = v; bi = i; }
  }
  best_tree(bv, bi, lid);
  if (lid == 0u) {
    out[p.o_out + r] = select(best_i[0], 0u, best_i[0] == NONE);
  }
}
