// The first stage of a long row's argmax: workgroup (b, r) finds the first maximum of elements
// b·SPAN .. (b + 1)·SPAN of row r and writes (value bits, index) to part[(r · blocks + b) · 2];
// argmax_final.wgsl reduces the blocks of each row. Same rules as argmax.wgsl: NaN is never the
// maximum, and of equal values the smaller index wins.
struct Params { rows: u32, cols: u32, o_x: u32, blocks: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> part: array<u32>;

const SPAN: u32 = 4096u;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let b = wid.x;
  let r = wid.y;
  if (b >= p.blocks || r >= p.rows) { return; }
  let base = p.o_x + r * p.cols;
  let end = min((b + 1u) * SPAN, p.cols);
  // -inf from a variable: a constant expression of it is an error in WGSL (Tint refuses it).
  var ninf_bits = 0xff800000u;
  var bv = bitcast<f32>(ninf_bits);
  var bi = NONE;
  for (var c = b * SPAN + lid; c < end; c += WG) {
    let v = x[base + c];
    if (v > bv) { bv = v; bi = c; }
  }
  best_tree(bv, bi, lid);
  if (lid == 0u) {
    part[(r * p.blocks + b) * 2u] = bitcast<u32>(best_v[0]);
    part[(r * p.blocks + b) * 2u + 1u] = best_i[0];
  }
}
