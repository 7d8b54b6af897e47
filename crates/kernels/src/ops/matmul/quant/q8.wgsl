// y[i, n] = Σ_k scale[n, k / BLOCK] · q[n, k] · x[i, k]  for R rows i of x per pass over the weights.
//
// gpu.rs prepends: WG (threads per workgroup), TPR (threads per weight row, a power of two, ≥ R),
// R (rows of x per pass), BLOCK (16 or 32 quants per scale), XT and xload(i) = x[i..i + 4] for i a
// multiple of 4 (from an f32 binding, or a vec4 binding when x's offset is 16-byte aligned). It also
// repeats every line that holds `$r` R times, with `$r` = 0 .. R-1: one accumulator per row of x, as
// plain variables (drivers keep them in registers; indexed private arrays can end up in local memory).
//
// Work split: each workgroup takes WG / TPR consecutive weight rows, TPR consecutive threads per row, and
// lane t of a row takes the row's quant words t, t + TPR, t + 2·TPR, ... (4 quants each):
//
//   lid:    0     1     2    ...  TPR-1 | TPR   ...
//   row:    r0    r0    r0   ...  r0    | r0+1  ...
//   words:  0     1     2    ...  TPR-1 |  0    ...     then TPR, TPR+1, ... on the next round
//
// so one load instruction of a row's lanes reads TPR consecutive words of quants (4·TPR bytes) and one
// contiguous span of x (16·TPR bytes): both coalesced. (Giving each lane a whole block instead makes the
// lanes' x reads 64-128 bytes apart; that measured half the bandwidth on an H200.) Each word's four
// products are summed in f32 and that sub-total is multiplied by its block's scale once; the TPR lanes of
// a row then sum their partials in workgroup memory (a tree) and lane i writes y row i.
// Workgroup z takes rows z·R .. z·R + R of x; rows past p.m repeat the last one and are not written.
//
// gpu.rs also prepends the hooks that let a decode product take in its neighbours: `prologue` (run first
// by every thread, given its workgroup's index), `xrow`/`xget` (where row $r of x starts, and x[i..i + 4]) and `store` (write or
// accumulate an output). The plain variant reads x from its binding; the staged variants fill a
// workgroup copy of the R rows first (RMSNorm of x, act(gate) · up, the merge of attention splits, or a
// post-normed output joining x before the norm), so the neighbour op needs no
// dispatch of its own. e0..e4 are the staged variants' parameters.
struct Params { n: u32, kw: u32, m: u32, k: u32, ldy: u32, o_x: u32, o_y: u32, o_s: u32, o_q: u32,
                e0: u32, e1: u32, e2: u32, e3: u32, e4: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<XT>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read> quants: array<u32>;

// Quant words per block.
const WPB: u32 = BLOCK / 4u;
var<workgroup> red: array<f32, R * WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let lane = lid % TPR;
  let row = group_index(wid, nwg) * (WG / TPR) + lid / TPR;
  let i0 = wid.z * R;
  prologue(lid, i0, group_index(wid, nwg));
  var acc$r = 0.0;
  if (row < p.n) {
    let x$r = xrow($r, i0);
    let qrow = p.o_q + row * p.kw;
    let srow = p.o_s + row * (p.kw / WPB);
    for (var w = lane; w < p.kw; w += TPR) {
      let s = scales[srow + w / WPB];
      let q = sext(quants[qrow + w]);
      acc$r = fma(s, dot(q, xget(x$r + 4u * w)), acc$r);
    }
  }
  red[$r * WG + lid] = acc$r;
  workgroupBarrier();
  for (var h = TPR / 2u; h > 0u; h = h >> 1u) {
    if (lane < h) {
      red[$r * WG + lid] = red[$r * WG + lid] + red[$r * WG + lid + h];
    }
    workgroupBarrier();
  }
  if (lane < R && row < p.n && i0 + lane < p.m) {
    store(p.o_y + (i0 + lane) * p.ldy + row, red[lane * WG + lid - lane]);
  }
}
