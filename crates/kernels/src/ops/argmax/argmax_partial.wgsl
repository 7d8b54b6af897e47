// The first stage of a long row's argmax: workgroup (b, r) finds the first maximum of elements
// b·SPAN .. (b + 1)·SPAN of row r and writes (value bits, index) to part[(r · blocks + b) · 2]; argmax.wgsl's
// second-stage form reduces the blocks of each row. Same rules as argmax.wgsl: NaN is never the maximum,
// and of equal values the smaller index wins.
struct Params { rows: u32, cols: u32, o_x: u32, blocks: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> part: array<u32>;

const WG: u32 = 256u;
const SPAN: u32 = 4096u;
const NONE: u32 = 0xffffffffu;
var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let b = wid.x;
  let r = wid.y;
  if (b >= p.blocks || r >= p.rows) { return; }
  let base = p.o_x + r * p.cols;
  let end = min((b + 1u) * SPAN, p.cols);
  var bv = bitcast<f32>(0xff800000u);
  var bi = NONE;
  for (var c = b * SPAN + lid; c < end; c += WG) {
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
    part[(r * p.blocks + b) * 2u] = bitcast<u32>(best_v[0]);
    part[(r * p.blocks + b) * 2u + 1u] = best_i[0];
  }
}
