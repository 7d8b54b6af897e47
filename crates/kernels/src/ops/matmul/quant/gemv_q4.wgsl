// The decode product of 4-bit blocks: y[i, n] = Σ_k (scale[n, b] · q[n, k] + min[n, b]) · x[i, k],
// b = k / 32, built like gemv_q8.wgsl (read that first): each lane loads its NI blocks (16 bytes of
// quants, one load; the block's scale and min) before the prologue, then factors each block as
// scale · Σ q·x + min · Σ x. A block's word c holds values 4c..4c+3 in its low nibbles and 16+4c..16+4c+3
// in its high nibbles (GGUF's Q4_0 order, see q4.wgsl).
struct Params { n: u32, kw4: u32, m: u32, k: u32, ldy: u32, o_x: u32, o_y: u32, o_s: u32, o_q: u32, o_m: u32,
                e0: u32, e1: u32, e2: u32, e3: u32, e4: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<XT>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read> mins: array<f32>;
@group(0) @binding(5) var<storage, read> quants: array<vec4<u32>>;

var<workgroup> red: array<f32, R * WG>;

// gemv_sums.wgsl's q4_block with the block's x from the hooks.
fn block(q: vec4<u32>, s: f32, mn: f32, b: u32) -> f32 {
  return q4_block(q, s, mn, xget(b), xget(b + 4u), xget(b + 8u), xget(b + 12u), xget(b + 16u), xget(b + 20u),
                  xget(b + 24u), xget(b + 28u));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let lane = lid % TPR;
  let row = group_index(wid, nwg) * (WG / TPR) + lid / TPR;
  let i0 = wid.z * R;
  let live = row < p.n;
  let qrow = p.o_q + row * p.kw4;
  let srow = row * p.kw4;
  let w$i = lane + $i * TPR;
  let on$i = live && w$i < p.kw4;
  var q$i = vec4<u32>(0u);
  var s$i = 0.0;
  var m$i = 0.0;
  if (on$i) { q$i = quants[qrow + w$i]; s$i = scales[p.o_s + srow + w$i]; m$i = mins[p.o_m + srow + w$i]; }
  prologue(lid, i0, group_index(wid, nwg));
  var acc$r = 0.0;
  let x$r = xrow($r, i0);
  if (on$i) { acc$r = acc$r + block(q$i, s$i, m$i, x$r + 32u * w$i); }
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
