// The decode product for a batch of rows of x, each row given the bits the one-row kernel gives it
// (gemv_q8.wgsl: read that first; the same lane sums, summed by the same tree), with the work turned
// around. There a lane holds one weight row's quant vectors and reads R rows of x for them; here a
// workgroup takes NB consecutive weight rows and XR rows of x, TPR lanes per row of x, and each lane
// holds its NI vectors of x in registers (loaded once, up front).
//
// Two forms (gpu.rs's `convert_once` picks one; lines tagged `#once` or `#lanes` belong to one form):
// - once: the weights are turned into floats once per workgroup, not once per row of x. At each of a
//   lane's NI steps the workgroup's first NB · TPR threads load one quant vector each (all issued up
//   front), convert its 16 bytes (exactly) into workgroup memory with its scale, and every lane then
//   sums its vector of x against the NB weight rows' floats (gemv_sums.wgsl's q8_floats: q8_vector's
//   arithmetic after its conversion). A lane's XR - 1 neighbours in a subgroup hold other rows of x at
//   the same position (lane l of row r is thread l · XR + r), so they read the same floats: one
//   broadcast each. Measured (docs/perf.md): converting each weight once for every row of x was what
//   a batch's products spent their time on, on GPUs.
// - lanes: each lane loads its NB weight rows' quant vectors (the rows of x share them through the
//   cache) and converts them itself (lane l of row r is thread r · TPR + l): software adapters, where
//   conversions are cheap vector code and barriers are not, and workgroups of fewer than 8 rows of x.
//
// gpu.rs prepends WG (= XR · TPR), TPR, XR, NB (≤ TPR: lane b writes weight row b's output; ≤ XR in
// the once form), BLOCK, XT/xload and `store`, and appends gemv_rows_tree.wgsl. Lines holding `$i`
// repeat NI times, then lines holding `$b` NB times; the block between the `each step` markers is
// written out once per step i.
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
#once var<workgroup> wf: array<vec4<f32>, NB * TPR * 4>;
// The lanes' partial sums for the tree (in the once form, first the steps' scales, b · TPR + l).
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
  // The once form: the vector this thread converts at each step, lane sl's vector of weight row
  // n0 + lid / TPR (the first NB · TPR threads).
#once   let sl = lid % TPR;
#once   let srow = n0 + lid / TPR;
#once   let stager = lid < NB * TPR;
#once   let slive = stager && srow < p.n;
#once   let qrow = p.o_q + srow * p.kw4;
#once   let ssrow = p.o_s + srow * (p.kw4 / VPB);
#once   let sw$i = sl + $i * TPR;
#once   var g$i = vec4<u32>(0u);
#once   var gs$i = 0.0;
#once   if (slive && sw$i < p.kw4) { g$i = quants[qrow + sw$i]; gs$i = scales[ssrow + sw$i / VPB]; }
  // The lanes form: each lane's own vectors of the NB weight rows.
#lanes   let qrow$b = p.o_q + row$b * p.kw4;
#lanes   let srow$b = p.o_s + row$b * (p.kw4 / VPB);
#lanes   var q$b_$i = vec4<u32>(0u);
#lanes   var s$b_$i = 0.0;
#lanes   if (live$b && on$i) { q$b_$i = quants[qrow$b + w$i]; s$b_$i = scales[srow$b + w$i / VPB]; }
  var xa$i = vec4<f32>(0.0);
  var xb$i = vec4<f32>(0.0);
  var xc$i = vec4<f32>(0.0);
  var xd$i = vec4<f32>(0.0);
  if (on$i) { xa$i = xload(xo + 16u * w$i); xb$i = xload(xo + 16u * w$i + 4u); xc$i = xload(xo + 16u * w$i + 8u); xd$i = xload(xo + 16u * w$i + 12u); }
  var acc$b = 0.0;
#lanes   if (live$b && on$i) { acc$b = acc$b + q8_vector(q$b_$i, s$b_$i, xa$i, xb$i, xc$i, xd$i); }
#once   // each step {
#once   workgroupBarrier();
#once   if (stager) { let v = 4u * lid; wf[v] = sext(g$i.x); wf[v + 1u] = sext(g$i.y); wf[v + 2u] = sext(g$i.z); wf[v + 3u] = sext(g$i.w); red[lid] = gs$i; }
#once   workgroupBarrier();
#once   if (live$b && on$i) { let v = 4u * ($b * TPR + lane); acc$b = acc$b + q8_floats(wf[v], wf[v + 1u], wf[v + 2u], wf[v + 3u], red[$b * TPR + lane], xa$i, xb$i, xc$i, xd$i); }
#once   // } each step
#once   workgroupBarrier();
  // The lanes' sums through the tree, and the store: gemv_rows_tree.wgsl, which gpu.rs appends.
