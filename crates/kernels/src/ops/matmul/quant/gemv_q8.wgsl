// The decode product: y[i, n] = Σ_k scale[n, k / BLOCK] · q[n, k] · x[i, k] for a few rows i of x (R per
// pass, along z), built for latency: a decode step is a chain of small products, each bound by how long
// its loads take to come back, not by bandwidth.
//
// gpu.rs prepends WG, TPR (threads per weight row), R, NI (quant vectors per lane), BLOCK, XT/xload/x1
// and the hooks (prologue, xrow, xget, store: see q8.wgsl). Lines holding `$i` repeat NI times and lines
// holding `$r` R times.
//
// Each lane loads its NI vectors of 16 quants (16 bytes, one load each: vector w of the row, w = lane,
// lane + TPR, ...) and their scales *before* the prologue, so those loads are in flight while the
// prologue stages x; then it multiplies them with x and the row's TPR lanes sum their partials (a tree in
// workgroup memory). Vector w holds values 16w .. 16w + 15, inside one block (16 or 32 values).
struct Params { n: u32, kw4: u32, m: u32, k: u32, ldy: u32, o_x: u32, o_y: u32, o_s: u32, o_q: u32,
                e0: u32, e1: u32, e2: u32, e3: u32, e4: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<XT>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read> quants: array<vec4<u32>>;

// Quant vectors per block.
const VPB: u32 = BLOCK / 16u;
var<workgroup> red: array<f32, R * WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let lane = lid % TPR;
  let row = group_index(wid, nwg) * (WG / TPR) + lid / TPR;
  let i0 = wid.z * R;
  let live = row < p.n;
  let qrow = p.o_q + row * p.kw4;
  let srow = p.o_s + row * (p.kw4 / VPB);
  let w$i = lane + $i * TPR;
  let on$i = live && w$i < p.kw4;
  var q$i = vec4<u32>(0u);
  var s$i = 0.0;
  if (on$i) { q$i = quants[qrow + w$i]; s$i = scales[srow + w$i / VPB]; }
  prologue(lid, i0, group_index(wid, nwg));
  var acc$r = 0.0;
  let x$r = xrow($r, i0);
  if (on$i) { acc$r = acc$r + q8_vector(q$i, s$i, xget(x$r + 16u * w$i), xget(x$r + 16u * w$i + 4u), xget(x$r + 16u * w$i + 8u), xget(x$r + 16u * w$i + 12u)); }
  red[$r * WG + lid] = acc$r;
  workgroupBarrier();
  for (var h = TPR / 2u; h > 0u; h = h >> 1u) {
    if (lane < h) {
      red[$r * WG + lid] = red[$r * WG + lid] + red[$r * WG + lid + h];
    }
    workgroupBarrier();
  }
  if (lane < R && live && i0 + lane < p.m) {
    store(p.o_y + (i0 + lane) * p.ldy + row, red[lane * WG + lid - lane]);
  }
}
