// The decode product for a batch of rows of x, each row given the bits the one-row kernel gives it
// (gemv_q8.wgsl: read that first; the same lane sums, summed by the same tree), with the work turned
// around. There a lane holds one weight row's quant vectors and reads R rows of x for them; here a
// workgroup takes NB consecutive weight rows and XR rows of x, TPR lanes per row of x, and each lane
// holds its NI vectors of x in registers (loaded once, up front).
//
// The weights are turned into floats once per workgroup, not once per row of x: at each of a lane's NI
// steps the workgroup's first NB · TPR threads load one quant vector each (all issued up front),
// convert its 16 bytes (exactly) into workgroup memory with its scale, and every lane then
// sums its vector of x against the NB weight rows' floats (gemv_sums.wgsl's q8_floats: q8_vector's
// arithmetic after its conversion). A lane's XR - 1 neighbours in a subgroup hold other rows of x at
// the same position (lane l of row r is thread l · XR + r), so they read the same floats: one
// broadcast each. Measured (docs/perf.md): converting each weight once for every row of x was what a
// batch's products spent their time on.
//
// gpu.rs prepends WG (= XR · TPR), TPR, XR, NB (≤ XR, and ≤ TPR: lane b writes weight row b's
// output), BLOCK, XT/xload and `store`. Lines holding `$i` repeat NI times, then lines holding `$b` NB
// times; the block between the `each step` markers is written out once per step i.
// Workgroup z takes rows z·XR .. z·XR + XR of x; rows past p.m repeat the last one and are not written.
struct Params { n: u32, kw4: u32, m: u32, k: u32, ldy: u32, o_x: u32, o_y: u32, o_s: u32, o_q: u32,
                e0: u32, e1: u32, e2: u32, e3: u32, e4: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<XT>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read> quants: array<vec4<u32>>;

// Quant vectors per block.
const VPB: u32 = BLOCK / 16u;
// One step's weights: vector (b, l) (lane l's vector of weight row b) as four vec4 from 4 · (b · TPR + l).
var<workgroup> wf: array<vec4<f32>, NB * TPR * 4>;
// The steps' scales (b · TPR + l), then the lanes' partial sums for the tree.
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
  // The vector this thread converts at each step: lane sl's vector of weight row n0 + lid / TPR (the
  // first NB · TPR threads; NB ≤ XR).
  let sl = lid % TPR;
  let srow = n0 + lid / TPR;
  let stager = lid < NB * TPR;
  let slive = stager && srow < p.n;
  let qrow = p.o_q + srow * p.kw4;
  let ssrow = p.o_s + srow * (p.kw4 / VPB);
  let sw$i = sl + $i * TPR;
  var g$i = vec4<u32>(0u);
  var gs$i = 0.0;
  if (slive && sw$i < p.kw4) { g$i = quants[qrow + sw$i]; gs$i = scales[ssrow + sw$i / VPB]; }
  let w$i = lane + $i * TPR;
  let on$i = w$i < p.kw4;
  var xa$i = vec4<f32>(0.0);
  var xb$i = vec4<f32>(0.0);
  var xc$i = vec4<f32>(0.0);
  var xd$i = vec4<f32>(0.0);
  if (on$i) { xa$i = xload(xo + 16u * w$i); xb$i = xload(xo + 16u * w$i + 4u); xc$i = xload(xo + 16u * w$i + 8u); xd$i = xload(xo + 16u * w$i + 12u); }
  var acc$b = 0.0;
  // each step {
  workgroupBarrier();
  if (stager) { let v = 4u * lid; wf[v] = sext(g$i.x); wf[v + 1u] = sext(g$i.y); wf[v + 2u] = sext(g$i.z); wf[v + 3u] = sext(g$i.w); red[lid] = gs$i; }
  workgroupBarrier();
  if (live$b && on$i) { let v = 4u * ($b * TPR + lane); acc$b = acc$b + q8_floats(wf[v], wf[v + 1u], wf[v + 2u], wf[v + 3u], red[$b * TPR + lane], xa$i, xb$i, xc$i, xd$i); }
  // } each step
  workgroupBarrier();
  // The lanes' sums through the tree, and the store: gemv_rows_tree.wgsl, which gpu.rs appends.
