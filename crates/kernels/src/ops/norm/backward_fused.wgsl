// Input and weight gradients of LayerNorm / RMSNorm in one pass over x and dy. With xh = (x - mean) *
// rstd and g = dy * w:  LN: dx = rstd * (g - mean(g) - xh * mean(g * xh));  RMS: dx = rstd * (g - xh *
// mean(g * xh)). Each workgroup takes RB rows, four at a time (ROWS4: 64 threads a row), and writes
// their dx (ACCUMULATE adds into dx, the residual stream's gradient); each thread also sums dy * xh
// over the rows it takes for each of its columns (lane + 64 j, j < CPL), and the workgroup's four row
// slots add theirs into part[c * blocks + block]: the weight gradient's partial sums, which
// backward_dw_final.wgsl adds up.
struct Params { n: u32, start: u32, o_x: u32, o_w: u32, o_dy: u32, o_mean: u32, o_rstd: u32, o_dx: u32, cols: u32, rms: u32, accumulate: u32, blocks: u32, block0: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> dy: array<f32>;
@group(0) @binding(4) var<storage, read> mean_in: array<f32>;
@group(0) @binding(5) var<storage, read> rstd_in: array<f32>;
@group(0) @binding(6) var<storage, read_write> dx: array<f32>;
@group(0) @binding(7) var<storage, read_write> part: array<f32>;

const RB: u32 = 16u; // rows per workgroup, as FUSED_ROWS in mod.rs

// row_sum, TPR and ROWS: ops/common.rs, ROWS4; CPL (columns per lane, ceil(cols / 64)) is prepended.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let blk = group_index(wid, nwg);
  // A workgroup of the grid's rounding past the segment's last block (uniform: it leaves whole).
  if (blk * RB >= p.n) { return; }
  let lane = lid % TPR;
  let inv = 1.0 / f32(p.cols);
  var acc: array<f32, CPL>;
  for (var r0 = blk * RB; r0 < blk * RB + RB; r0 = r0 + ROWS) {
    let row = r0 + lid / TPR;
    // A thread past the last row still takes part in the reductions' barriers, over no columns.
    let live = row < p.n;
    let cols = select(0u, p.cols, live);
    let xb = p.o_x + row * p.cols;
    let db = p.o_dy + row * p.cols;
    var mean = 0.0;
    var rstd = 0.0;
    if (live) {
      mean = mean_in[p.o_mean + row];
      rstd = rstd_in[p.o_rstd + row];
    }
    var sg = 0.0;
    var sgx = 0.0;
    for (var c = lane; c < cols; c = c + TPR) {
      let g = dy[db + c] * w[p.o_w + c];
      sg = sg + g;
      sgx = sgx + g * (x[xb + c] - mean) * rstd;
    }
    var mg = row_sum(sg, lid) * inv;
    let mgx = row_sum(sgx, lid) * inv;
    if (p.rms != 0u) { mg = 0.0; }
    let ob = p.o_dx + row * p.cols;
    for (var j = 0u; j < CPL; j = j + 1u) {
      let c = lane + j * TPR;
      if (c < cols) {
        let d = dy[db + c];
        let g = d * w[p.o_w + c];
        let xh = (x[xb + c] - mean) * rstd;
        var v = rstd * (g - mg - xh * mgx);
        if (p.accumulate != 0u) { v = v + dx[ob + c]; }
        dx[ob + c] = v;
        acc[j] = acc[j] + d * xh;
      }
    }
  }
  for (var j = 0u; j < CPL; j = j + 1u) {
    red[lid] = acc[j];
    workgroupBarrier();
    let c = lane + j * TPR;
    if (lid < TPR && c < p.cols) {
      part[c * p.blocks + p.block0 + blk] = red[lid] + red[lid + 64u] + red[lid + 128u] + red[lid + 192u];
    }
    workgroupBarrier();
  }
}
