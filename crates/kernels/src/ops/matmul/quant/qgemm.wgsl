// y[i, n] = Σ_k w[n, k] · x[i, k] for prompts: a tiled GEMM over BM (32 or 64) rows of x by 64 weight
// rows per workgroup of 4·BM threads, walking K one block of 32 at a time. Each step dequantises the tile's weights into
// workgroup memory once (the same f32 values as the CPU twin's dequantize_row: scale · q, or
// scale · q + min) and stages the x tile beside them, both row-major in vec4s along k:
//
//   xs[i][c], ws[n][c]  (8 vec4 = the block's 32 values per row; vec4 c of row r is stored at
//                        r·8 + (c ^ (r / 4 % 8)), so the 16 weight rows 4 apart that a step reads
//                        fall on different banks)
//
// Thread (ty, tx) = (lid / 16, lid % 16) holds the 4 x 4 outputs of rows 4·ty.. and columns 4·tx..:
// per 4 values of k, four vec4 of xs and four of ws for 16 dot products. Each thread stores its loads
// as whole vec4s. The next block's quant words and x
// values are loaded into registers before the current block is consumed, so their latency hides behind
// the arithmetic. Rows of x past m and weight rows past n read clamped rows and are not written. A
// smaller BM gives a short prompt's products more workgroups.
//
// gpu.rs prepends BM, BLOCK (quants per scale), XT and xload(i) = x[i..i + 4] (i a multiple of 4), and
// the weight layout: Q8 (wfetch: two words, 8 consecutive quants) or Q4 (one word: 4 low and 4 high
// nibbles, 16 apart; its binding of mins); it repeats the lines that name a weight row (w) once per
// weight row each thread loads (64 / BM).
struct Params { n: u32, kw: u32, m: u32, k: u32, ldy: u32, o_x: u32, o_y: u32, o_s: u32, o_q: u32, o_m: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<XT>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;

var<workgroup> xs: array<vec4<f32>, 8u * BM>;  // BM rows of x x 8 vec4
var<workgroup> ws: array<vec4<f32>, 512>;     // 64 weight rows x 8 vec4

// Where vec4 c of row r lies.
fn at(r: u32, c: u32) -> u32 { return r * 8u + (c ^ ((r / 4u) % 8u)); }

// Row i of y, columns c .. c + 3 (those inside the product), through `put` (gpu.rs: y = v, or y += v).
fn store(i: u32, c: u32, v: vec4<f32>) {
  if (i >= p.m) { return; }
  let at = p.o_y + i * p.ldy + c;
  if (c < p.n) { put(at, v.x); }
  if (c + 1u < p.n) { put(at + 1u, v.y); }
  if (c + 2u < p.n) { put(at + 2u, v.z); }
  if (c + 3u < p.n) { put(at + 3u, v.w); }
}

@compute @workgroup_size(4u * BM)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let n0 = wid.x * 64u;
  let i0 = wid.y * BM;
  let ty = lid / 16u;
  let tx = lid % 16u;
  // Loads: thread t takes row t / 4 of the x tile and rows t / 4 + BM·w of the weight tile, its
  // quarter t % 4 of the block's 32 values.
  let lr = lid / 4u;
  let lq = lid % 4u;
  let xrow = p.o_x + min(i0 + lr, p.m - 1u) * p.k;
  let wrow$w = min(n0 + lr + BM * $wu, p.n - 1u);
  let nb = p.k / 32u;

  var acc0 = vec4<f32>(0.0);
  var acc1 = vec4<f32>(0.0);
  var acc2 = vec4<f32>(0.0);
  var acc3 = vec4<f32>(0.0);
  // This thread's share of block 0: x values 8·lq .. 8·lq + 7, and the weights' raw words.
  var xa = xload(xrow + 8u * lq);
  var xb = xload(xrow + 8u * lq + 4u);
  var wr$w = wfetch(wrow$w, 0u, lq);
  for (var b = 0u; b < nb; b = b + 1u) {
    let wv$w = wvalues(wr$w);
    workgroupBarrier();
    // x: vec4s 2·lq and 2·lq + 1 of row lr; w: the two vec4s wkat() places, of weight row lr + BM·w.
    xs[at(lr, 2u * lq)] = xa;
    xs[at(lr, 2u * lq + 1u)] = xb;
    ws[at(lr + BM * $wu, wkat(lq, 0u) / 4u)] = wv$w[0];
    ws[at(lr + BM * $wu, wkat(lq, 1u) / 4u)] = wv$w[1];
    workgroupBarrier();
    if (b + 1u < nb) {
      xa = xload(xrow + (b + 1u) * 32u + 8u * lq);
      xb = xload(xrow + (b + 1u) * 32u + 8u * lq + 4u);
      wr$w = wfetch(wrow$w, b + 1u, lq);
    }
    for (var c = 0u; c < 8u; c = c + 1u) {
      let xc = c ^ (ty % 8u);
      let wc = c ^ (tx % 8u);
      let a0 = xs[(4u * ty) * 8u + xc];
      let a1 = xs[(4u * ty + 1u) * 8u + xc];
      let a2 = xs[(4u * ty + 2u) * 8u + xc];
      let a3 = xs[(4u * ty + 3u) * 8u + xc];
      let w0 = ws[(4u * tx) * 8u + wc];
      let w1 = ws[(4u * tx + 1u) * 8u + wc];
      let w2 = ws[(4u * tx + 2u) * 8u + wc];
      let w3 = ws[(4u * tx + 3u) * 8u + wc];
      acc0 = acc0 + vec4<f32>(dot(a0, w0), dot(a0, w1), dot(a0, w2), dot(a0, w3));
      acc1 = acc1 + vec4<f32>(dot(a1, w0), dot(a1, w1), dot(a1, w2), dot(a1, w3));
      acc2 = acc2 + vec4<f32>(dot(a2, w0), dot(a2, w1), dot(a2, w2), dot(a2, w3));
      acc3 = acc3 + vec4<f32>(dot(a3, w0), dot(a3, w1), dot(a3, w2), dot(a3, w3));
    }
  }
  let c = n0 + 4u * tx;
  store(i0 + 4u * ty, c, acc0);
  store(i0 + 4u * ty + 1u, c, acc1);
  store(i0 + 4u * ty + 2u, c, acc2);
  store(i0 + 4u * ty + 3u, c, acc3);
}
