// gemv_q4.wgsl's product for a batch of rows of x, turned around as gemv_rows_q8.wgsl is (read both
// first; the same two forms, the same tags): XR rows of x and NB weight rows per workgroup, each lane
// holding its NI blocks of x (32 values each) in registers. In the once form, at each step the
// workgroup's first NB · TPR threads turn one block each into floats in workgroup memory (eight nibble
// vectors, scale and min), and every lane sums its block of x against the NB weight rows'
// (gemv_sums.wgsl's q4_floats: q4_block's arithmetic after its conversion); in the lanes form each lane
// walks the NB weight rows' blocks itself (q4_block). The lanes' partials go through the same tree, so
// every row gets the bits it gets alone.
struct Params { n: u32, kw4: u32, m: u32, k: u32, ldy: u32, o_x: u32, o_y: u32, o_s: u32, o_q: u32, o_m: u32,
                e0: u32, e1: u32, e2: u32, e3: u32, e4: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<XT>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read> mins: array<f32>;
@group(0) @binding(5) var<storage, read> quants: array<vec4<u32>>;

// One step's weights: block (b, l) as eight vec4 (low, high nibbles of words x, y, z, w) from 8 · (b · TPR + l).
#once var<workgroup> wf: array<vec4<f32>, NB * TPR * 8>;
// The lanes' partial sums (in the once form, first the steps' scales, b · TPR + l, and mins, NB · TPR + b · TPR + l).
var<workgroup> red: array<f32, NB * WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
#once   let lane = lid / XR;
#once   let xi = wid.z * XR + lid % XR;
#lanes   let lane = lid % TPR;
#lanes   let xi = wid.z * XR + lid / TPR;
  let xo = p.o_x + min(xi, p.m - 1u) * p.k;
  let n0 = group_index(wid, nwg) * NB;
  let row$b = n0 + $b;
  let live$b = row$b < p.n;
  let w$i = lane + $i * TPR;
  let on$i = w$i < p.kw4;
  // The once form: the block this thread converts at each step (the first NB · TPR threads).
#once   let sl = lid % TPR;
#once   let srow = n0 + lid / TPR;
#once   let stager = lid < NB * TPR;
#once   let slive = stager && srow < p.n;
#once   let qrow = p.o_q + srow * p.kw4;
#once   let ssrow = srow * p.kw4;
#once   let sw$i = sl + $i * TPR;
#once   var g$i = vec4<u32>(0u);
#once   var gs$i = 0.0;
#once   var gm$i = 0.0;
#once   if (slive && sw$i < p.kw4) { g$i = quants[qrow + sw$i]; gs$i = scales[p.o_s + ssrow + sw$i]; gm$i = mins[p.o_m + ssrow + sw$i]; }
  // The lanes form: each lane's own blocks of the NB weight rows.
#lanes   let qrow$b = p.o_q + row$b * p.kw4;
#lanes   let srow$b = row$b * p.kw4;
#lanes   var q$b_$i = vec4<u32>(0u);
#lanes   var s$b_$i = 0.0;
#lanes   var m$b_$i = 0.0;
#lanes   if (live$b && on$i) { q$b_$i = quants[qrow$b + w$i]; s$b_$i = scales[p.o_s + srow$b + w$i]; m$b_$i = mins[p.o_m + srow$b + w$i]; }
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
#lanes   if (live$b && on$i) { acc$b = acc$b + q4_block(q$b_$i, s$b_$i, m$b_$i, x0_$i, x1_$i, x2_$i, x3_$i, x4_$i, x5_$i, x6_$i, x7_$i); }
#once   // each step {
#once   workgroupBarrier();
#once   if (stager) { let v = 8u * lid; wf[v] = low_nibbles(g$i.x); wf[v + 1u] = high_nibbles(g$i.x); wf[v + 2u] = low_nibbles(g$i.y); wf[v + 3u] = high_nibbles(g$i.y); wf[v + 4u] = low_nibbles(g$i.z); wf[v + 5u] = high_nibbles(g$i.z); wf[v + 6u] = low_nibbles(g$i.w); wf[v + 7u] = high_nibbles(g$i.w); red[lid] = gs$i; red[NB * TPR + lid] = gm$i; }
#once   workgroupBarrier();
#once   if (live$b && on$i) { let t = $b * TPR + lane; let v = 8u * t; acc$b = acc$b + q4_floats(wf[v], wf[v + 1u], wf[v + 2u], wf[v + 3u], wf[v + 4u], wf[v + 5u], wf[v + 6u], wf[v + 7u], red[t], red[NB * TPR + t], x0_$i, x1_$i, x2_$i, x3_$i, x4_$i, x5_$i, x6_$i, x7_$i); }
#once   // } each step
#once   workgroupBarrier();
  // The lanes' sums through the tree, and the store: gemv_rows_tree.wgsl, which gpu.rs appends.
