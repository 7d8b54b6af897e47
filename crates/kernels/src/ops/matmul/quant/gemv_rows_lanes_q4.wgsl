// gemv_q4.wgsl's product for a batch of rows of x on software adapters, turned around as
// gemv_rows_lanes_q8.wgsl is (read both first): XR rows of x and NB weight rows per workgroup, each lane
// holding its NI blocks of x (32 values each) in registers and walking the NB weight rows' blocks; each
// block's sum is gemv_sums.wgsl's `q4_block`, and the lanes' partials go through the same tree, so every
// row gets the bits it gets alone.
struct Params { n: u32, kw4: u32, m: u32, k: u32, ldy: u32, o_x: u32, o_y: u32, o_s: u32, o_q: u32, o_m: u32,
                e0: u32, e1: u32, e2: u32, e3: u32, e4: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<XT>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read> mins: array<f32>;
@group(0) @binding(5) var<storage, read> quants: array<vec4<u32>>;

var<workgroup> red: array<f32, NB * WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let lane = lid % TPR;
  let xi = wid.z * XR + lid / TPR;
  let xo = p.o_x + min(xi, p.m - 1u) * p.k;
  let n0 = group_index(wid, nwg) * NB;
  let row$b = n0 + $b;
  let live$b = row$b < p.n;
  let qrow$b = p.o_q + row$b * p.kw4;
  let srow$b = row$b * p.kw4;
  let w$i = lane + $i * TPR;
  let on$i = w$i < p.kw4;
  var q$b_$i = vec4<u32>(0u);
  var s$b_$i = 0.0;
  var m$b_$i = 0.0;
  if (live$b && on$i) { q$b_$i = quants[qrow$b + w$i]; s$b_$i = scales[p.o_s + srow$b + w$i]; m$b_$i = mins[p.o_m + srow$b + w$i]; }
  var x0_$i = vec4<f32>(0.0);
  var x1_$i = vec4<f32>(0.0);
  var x2_$i = vec4<f32>(0.0);
  var x3_$i = vec4<f32>(0.0);
  var x4_$i = vec4<f32>(0.0);
  var x5_$i = vec4<f32>(0.0);
  var x6_$i = vec4<f32>(0.0);
  var x7_$i = vec4<f32>(0.0);
  if (on$i) { x0_$i = xload(xo + 32u * w$i); x1_$i = xload(xo + 32u * w$i + 4u); x2_$i = xload(xo + 32u * w$i + 8u); x3_$i = xload(xo + 32u * w$i + 12u); }
  if (on$i) { x4_$i = xload(xo + 32u * w$i + 16u); x5_$i = xload(xo + 32u * w$i + 20u); x6_$i = xload(xo + 32u * w$i + 24u); x7_$i = xload(xo + 32u * w$i + 28u); }
  var acc$b = 0.0;
  if (live$b && on$i) { acc$b = acc$b + q4_block(q$b_$i, s$b_$i, m$b_$i, x0_$i, x1_$i, x2_$i, x3_$i, x4_$i, x5_$i, x6_$i, x7_$i); }
  // The lanes' sums through the tree, and the store: gemv_rows_tree.wgsl, which gpu.rs appends.
