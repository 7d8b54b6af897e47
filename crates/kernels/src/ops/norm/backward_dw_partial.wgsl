// Weight gradient of LayerNorm / RMSNorm, stage 1: partial[block, c] = sum over the block's rows of
// dy * xh. Workgroup (x: tile of 64 columns, y: block of RB rows); 4 lanes of 64 threads split the rows.
struct Params { n: u32, start: u32, o_x: u32, o_dy: u32, o_mean: u32, o_rstd: u32, o_part: u32, cols: u32, block0: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> dy: array<f32>;
@group(0) @binding(3) var<storage, read> mean_in: array<f32>;
@group(0) @binding(4) var<storage, read> rstd_in: array<f32>;
@group(0) @binding(5) var<storage, read_write> part: array<f32>;

const RB: u32 = 256u; // as RB in mod.rs
var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let c = wid.x * 64u + (lid % 64u);
  let lane = lid / 64u;
  let r0 = wid.y * RB;
  var s = 0.0;
  if (c < p.cols) {
    for (var r = r0 + lane; r < min(r0 + RB, p.n); r = r + 4u) {
      let xh = (x[p.o_x + r * p.cols + c] - mean_in[p.o_mean + r]) * rstd_in[p.o_rstd + r];
      s = s + dy[p.o_dy + r * p.cols + c] * xh;
    }
  }
  red[lid] = s;
  workgroupBarrier();
  if (lane == 0u && c < p.cols) {
    let t = red[lid] + red[lid + 64u] + red[lid + 128u] + red[lid + 192u];
    part[p.o_part + (p.block0 + wid.y) * p.cols + c] = t;
  }
}
