// out[o_out + r] = the index of the first maximum of row r of x (`cols` elements), for each of the rows
// of this segment: one workgroup per row. NaN is never the maximum; a row with no element above -inf
// gives 0 (the host's `argmax` does the same).
//
// Thread t scans elements t, t + WG, t + 2·WG, ... keeping the first of its largest (indices rise, so a
// strictly larger value is the only thing that replaces it); the tree then keeps, of two candidates,
// the larger value, and of equal values the smaller index: the first maximum of the row.
struct Params { rows: u32, first: u32, o_x: u32, o_out: u32, cols: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

const WG: u32 = 256u;
const NONE: u32 = 0xffffffffu;
var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let r = group_index(wid, nwg);
  if (r >= p.rows) { return; }
  let base = p.o_x + r * p.cols;
  var bv = bitcast<f32>(0xff800000u);
  var bi = NONE;
  for (var c = lid; c < p.cols; c += WG) {
    let v = x[base + c];
    if (v > bv) { bv = v; bi = c; }
  }
  best_v[lid] = bv;
  best_i[lid] = bi;
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s = s >> 1u) {
    if (lid < s) {
      let ov = best_v[lid + s];
      let oi = best_i[lid + s];
      let mv = best_v[lid];
      let mi = best_i[lid];
      if (oi != NONE && (mi == NONE || ov > mv || (ov == mv && oi < mi))) {
        best_v[lid] = ov;
        best_i[lid] = oi;
      }
    }
    workgroupBarrier();
  }
  if (lid == 0u) {
    out[p.o_out + r] = select(best_i[0], 0u, best_i[0] == NONE);
  }
}
