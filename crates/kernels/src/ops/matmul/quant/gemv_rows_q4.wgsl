// gemv_q4.wgsl's product for a batch of rows of x, turned around as gemv_rows_q8.wgsl is (read both
// first): XR rows of x and NB weight rows per workgroup, each lane holding its NI blocks of x (32 values
// each) in registers; at each step the workgroup's first NB · TPR threads turn one block each into
// floats in workgroup memory (eight nibble vectors, scale and min), and every lane sums its block of x
// against the NB weight rows' (gemv_sums.wgsl's q4_floats: q4_block's arithmetic after its
// conversion). The lanes' partials go through the same tree, so every row gets the bits it gets alone.
struct Params { n: u32, kw4: u32, m: u32, k: u32, ldy: u32, o_x: u32, o_y: u32, o_s: u32, o_q: u32, o_m: u32,
                e0: u32, e1: u32, e2: u32, e3: u32, e4: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<XT>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read> mins: array<f32>;
@group(0) @binding(5) var<storage, read> quants: array<vec4<u32>>;

// One step's weights: block (b, l) as eight vec4 (low, high nibbles of words x, y, z, w) from 8 · (b · TPR + l).
var<workgroup> wf: array<vec4<f32>, NB * TPR * 8>;
// The steps' scales (b · TPR + l) and mins (NB · TPR + b · TPR + l), then the lanes' partial sums.
var<workgroup> red: array<f32, NB * WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let lane = lid / XR;
  let r = lid % XR;
  let xi = wid.z * XR + r;
  let xo = p.o_x + min(xi, p.m - 1u) * p.k;
  let n0 = group_index(wid, nwg) * NB;
  let row$b = n0 + $b;
  let live$b = row$b < p.n;
  // The block this thread converts at each step (the first NB · TPR threads; NB ≤ XR).
  let sl = lid % TPR;
  let srow = n0 + lid / TPR;
  let stager = lid < NB * TPR;
  let slive = stager && srow < p.n;
  let qrow = p.o_q + srow * p.kw4;
  let ssrow = srow * p.kw4;
  let sw$i = sl + $i * TPR;
  var g$i = vec4<u32>(0u);
  var gs$i = 0.0;
  var gm$i = 0.0;
  if (slive && sw$i < p.kw4) { g$i = quants[qrow + sw$i]; gs$i = scales[p.o_s + ssrow + sw$i]; gm$i = mins[p.o_m + ssrow + sw$i]; }
  let w$i = lane + $i * TPR;
  let on$i = w$i < p.kw4;
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
  // each step {
  workgroupBarrier();
  if (stager) { let v = 8u * lid; wf[v] = low_nibbles(g$i.x); wf[v + 1u] = high_nibbles(g$i.x); wf[v + 2u] = low_nibbles(g$i.y); wf[v + 3u] = high_nibbles(g$i.y); wf[v + 4u] = low_nibbles(g$i.z); wf[v + 5u] = high_nibbles(g$i.z); wf[v + 6u] = low_nibbles(g$i.w); wf[v + 7u] = high_nibbles(g$i.w); red[lid] = gs$i; red[NB * TPR + lid] = gm$i; }
  workgroupBarrier();
  if (live$b && on$i) { let t = $b * TPR + lane; let v = 8u * t; acc$b = acc$b + q4_floats(wf[v], wf[v + 1u], wf[v + 2u], wf[v + 3u], wf[v + 4u], wf[v + 5u], wf[v + 6u], wf[v + 7u], red[t], red[NB * TPR + t], x0_$i, x1_$i, x2_$i, x3_$i, x4_$i, x5_$i, x6_$i, x7_$i); }
  // } each step
  workgroupBarrier();
  // The lanes' sums through the tree, and the store: gemv_rows_tree.wgsl, which gpu.rs appends.
