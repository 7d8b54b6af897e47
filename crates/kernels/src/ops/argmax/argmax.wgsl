// out[o_out + r] = the index of the first maximum of row r of x (`cols` elements), for each of the rows
// of this segment: one workgroup per row. NaN is never the maximum; a row with no element above -inf
// gives 0 (the host's `argmax` does the same).
//
// Thread t scans elements t, t + WG, t + 2·WG, ... keeping the first of its largest (indices rise, so a
// strictly larger value is the only thing that replaces it); `best_tree` (mod.rs) then keeps the first
// maximum of the row.
struct Params { rows: u32, first: u32, o_x: u32, o_out: u32, cols: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let r = group_index(wid, nwg);
  if (r >= p.rows) { return; }
  let base = p.o_x + r * p.cols;
  // -inf from a variable: a constant expression of it is an error in WGSL (Tint refuses it).
  var ninf_bits = 0xff800000u;
  var bv = bitcast<f32>(ninf_bits);
  var bi = NONE;
  for (var c = lid; c < p.cols; c += WG) {
    let v = x[base + c];
    if (v > bv) { bv = v; bi = c; }
  }
  best_tree(bv, bi, lid);
  if (lid == 0u) {
    out[p.o_out + r] = select(best_i[0], 0u, best_i[0] == NONE);
  }
}
