// The batch product for software adapters (gemv_rows_q8.wgsl converts each weight vector once per
// workgroup; on a CPU its barriers cost more than the conversions it saves: lavapipe, 16 sequences of
// SmolLM2-135M 14-15 -> 10 tok/s). Each row given the bits the one-row kernel gives it (gemv_q8.wgsl:
// the same lane sums, summed by the same tree), with the work turned around: a workgroup takes NB
// consecutive weight rows and XR rows of x, TPR lanes per row of x; a lane loads its NI vectors of x
// once (registers) and its NB weight rows' quant vectors (the rows of x share them through the cache)
// and converts them itself.
//
// gpu.rs prepends WG (= XR · TPR), TPR, XR, NB (≤ TPR: lane b writes weight row b's output), BLOCK,
// XT/xload and `store`. Lines holding `$i` repeat NI times, then lines holding `$b` NB times.
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
  let srow$b = p.o_s + row$b * (p.kw4 / VPB);
  let w$i = lane + $i * TPR;
  let on$i = w$i < p.kw4;
  var q$b_$i = vec4<u32>(0u);
  var s$b_$i = 0.0;
  if (live$b && on$i) { q$b_$i = quants[qrow$b + w$i]; s$b_$i = scales[srow$b + w$i / VPB]; }
  var xa$i = vec4<f32>(0.0);
  var xb$i = vec4<f32>(0.0);
  var xc$i = vec4<f32>(0.0);
  var xd$i = vec4<f32>(0.0);
  if (on$i) { xa$i = xload(xo + 16u * w$i); xb$i = xload(xo + 16u * w$i + 4u); xc$i = xload(xo + 16u * w$i + 8u); xd$i = xload(xo + 16u * w$i + 12u); }
  var acc$b = 0.0;
  if (live$b && on$i) { acc$b = acc$b + q8_vector(q$b_$i, s$b_$i, xa$i, xb$i, xc$i, xd$i); }
  // The lanes' sums through the tree, and the store: gemv_rows_tree.wgsl, which gpu.rs appends.
