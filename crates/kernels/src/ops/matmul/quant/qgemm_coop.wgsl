// y[i, n] = Σ_k w[n, k] · x[i, k] for prompts on the tensor cores (the `tc-prompt` path): qgemm.wgsl's
// walk over K with the products on 16x16x16 cooperative matrices. Each step takes S blocks of 32 along
// K: it dequantises the tile's 64 weight rows (the twin's f32 values: scale · q, or scale · q + min)
// and stages them beside the BM rows of x, both rounded to f16, into workgroup memory:
//
//   xs[r · SK + k], ws[r · SK + k]  (a row's 32 · S values along k, then 8 of padding)
//
// four values to a vec4<f16> (one 8-byte store where four 2-byte ones measured 12% slower prompts on an
// H100); the fragments load from element index / 4 with stride SK / 4.
//
// A workgroup is four 32-lane subgroups in a grid of (4 / SGC) x SGC; each computes its block of the
// BM x 64 tile as FM x FN fragments accumulating in f32. Loads follow qgemm.wgsl: thread t takes rows
// t / 4 (+ 32) of x and of the weights, quarter t % 4 of each block's 32 values, and the next step's
// words are loaded into registers before the current step is multiplied. Rows of x past m and weight
// rows past n read clamped rows and are not written; a block past K's last (when S does not divide
// the blocks) is staged as zeros. Fragments go out through workgroup memory (`cs`, one 16x16 fragment
// per subgroup) to `put`.
//
// gpu.rs prepends the enables, BM, S, SGC, BLOCK, XT, xload, `put` and the weight layout (qgemm.wgsl's),
// and repeats each line that names a fragment row (FM of them), a fragment column (FN), a row of x
// (BM / 32 per thread, at least 1), a weight row (2 per thread) or a block of the step (S) once per
// index. naga's SPIR-V writer needs every cooperative load's index and stride as a `let` of its own,
// and cooperative loads from workgroup arrays only.
struct Params { n: u32, kw: u32, m: u32, k: u32, ldy: u32, o_x: u32, o_y: u32, o_s: u32, o_q: u32, o_m: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<XT>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;

const SK: u32 = 32u * S + 8u;
var<workgroup> xs: array<vec4<f16>, BM * SK / 4u>;
var<workgroup> ws: array<vec4<f16>, 64u * SK / 4u>;
var<workgroup> cs: array<f32, 1024>;  // one 16x16 fragment per subgroup

// Four consecutive values of a tile row (`at` a multiple of 4), rounded to f16 (zeros for a block past
// the last), in one store.
fn put_x(at: u32, v: vec4<f32>, valid: bool) {
  let h = select(vec4<f32>(0.0), v, valid);
  xs[at / 4u] = vec4<f16>(h);
}
fn put_w(at: u32, v: vec4<f32>, valid: bool) {
  let h = select(vec4<f32>(0.0), v, valid);
  ws[at / 4u] = vec4<f16>(h);
}

@compute @workgroup_size(128)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let n0 = wid.x * 64u;
  let i0 = wid.y * BM;
  let sg = lid / 32u;
  let lane = lid % 32u;
  let fm = (sg / SGC) * (BM * SGC / 4u);
  let fn0 = (sg % SGC) * (64u / SGC);
  let lr = lid / 4u;
  let lq = lid % 4u;
  let xrow$x = p.o_x + min(i0 + lr + 32u * $xu, p.m - 1u) * p.k;
  let wrow$w = min(n0 + lr + 32u * $wu, p.n - 1u);
  let nb = p.k / 32u;
  let last = nb - 1u;
  let sk = SK / 4u;
  var c$a$b = coop_mat16x16<f32, C>();
  var xa$x$s = xload(xrow$x + min($su, last) * 32u + 8u * lq);
  var xb$x$s = xload(xrow$x + min($su, last) * 32u + 8u * lq + 4u);
  var wr$w$s = wfetch(wrow$w, min($su, last), lq);
  for (var b = 0u; b < nb; b = b + S) {
    let wv$w$s = wvalues(wr$w$s);
    workgroupBarrier();
    if (lr + 32u * $xu < BM) { put_x((lr + 32u * $xu) * SK + 32u * $su + 8u * lq, xa$x$s, b + $su < nb); put_x((lr + 32u * $xu) * SK + 32u * $su + 8u * lq + 4u, xb$x$s, b + $su < nb); }
    put_w((lr + 32u * $wu) * SK + 32u * $su + wkat(lq, 0u), wv$w$s[0], b + $su < nb);
    put_w((lr + 32u * $wu) * SK + 32u * $su + wkat(lq, 1u), wv$w$s[1], b + $su < nb);
    workgroupBarrier();
    if (b + S < nb) {
      xa$x$s = xload(xrow$x + min(b + S + $su, last) * 32u + 8u * lq);
      xb$x$s = xload(xrow$x + min(b + S + $su, last) * 32u + 8u * lq + 4u);
      wr$w$s = wfetch(wrow$w, min(b + S + $su, last), lq);
    }
    for (var kk = 0u; kk < 32u * S; kk = kk + 16u) {
      let ia$a = (fm + 16u * $au) * SK + kk;
      let a$a = coopLoadT<coop_mat16x16<f16, A>>(&xs[ia$a / 4u], sk);
      let ib$b = (fn0 + 16u * $bu) * SK + kk;
      let b$b = coopLoad<coop_mat16x16<f16, B>>(&ws[ib$b / 4u], sk);
      c$a$b = coopMultiplyAdd(a$a, b$b, c$a$b);
    }
  }
  let cbase = sg * 256u;
  let s16 = 16u;
  coopStoreT(c$a$b, &cs[cbase], s16); workgroupBarrier(); for (var j = 0u; j < 8u; j = j + 1u) { let e = j * 32u + lane; let r = i0 + fm + 16u * $au + e / 16u; let c = n0 + fn0 + 16u * $bu + e % 16u; if (r < p.m && c < p.n) { put(p.o_y + r * p.ldy + c, cs[cbase + e]); } } workgroupBarrier();
}
