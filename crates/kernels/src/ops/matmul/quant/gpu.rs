//! Dispatch of the WGSL quantized kernels: variant choice, the split-buffer loops, parameter blocks.
//!
//! Three kernel families serve x · Wᵀ:
//!
//! - **gemv** (gemv_q8.wgsl, gemv_q4.wgsl): a few rows of x, built for latency (each lane loads 16-byte
//!   quant vectors ahead of everything else). Decode passes run on it, with the ops around a product
//!   folded in ([`Stage`], [`Output`]); it computes every row alone, so batched decoding gives each
//!   sequence the numbers it would get alone. Five rows of plain x or more (a decode batch's products)
//!   take its batch kernel (gemv_rows_q8.wgsl, gemv_rows_q4.wgsl): the same lane sums and tree, each
//!   lane holding its share of one row of x and walking a few weight rows.
//! - **tiled rows** (q8.wgsl, q4.wgsl): up to 8 rows of x per pass over the weights, for short prompts.
//! - **GEMM** (qgemm.wgsl): 64 x 64 output tiles, the weights dequantised into workgroup memory one
//!   block of K at a time, for prompts of [`GEMM_MIN_ROWS`] rows or more; where the `tc-prompt` path
//!   passed its gate, the same walk on the tensor cores (qgemm_coop.wgsl: x and the dequantised
//!   weights rounded to f16 in workgroup memory, 16x16x16 cooperative matrices, f32 sums).
//!
//! One product is one dispatch in the usual case (x, y and the weights each in one buffer). Split
//! tensors multiply it: x/y are cut by rows of x where either changes buffer, the weights by the row
//! ranges stored with the matrix, and every pair of pieces is one dispatch writing its block of y (y's
//! leading dimension stays N; the piece's first column goes into y's offset).

use std::rc::Rc;

use super::{GpuParts, QKind};
use crate::error::{Result, shape};
use crate::gpu::{Access, GpuBackend, GpuTensor, Operand, Pipeline, segments};
use crate::ops::attention::split_len;
use crate::ops::common::{PRELUDE, form_lines, hoist_loads, repeat_lines};
use crate::ops::glu::Activation;
use crate::path::Fault;

/// The sign extension of 8-bit quants (sext.wgsl), in front of every quantized kernel.
const SEXT: &str = include_str!("sext.wgsl");
/// A lane's sum over one quant vector (gemv_sums.wgsl), in front of the gemv family's kernels: the one
/// definition the one-row and batch kernels share.
const GEMV_SUMS: &str = include_str!("gemv_sums.wgsl");

/// Threads per workgroup of the matmul kernels. With WORDS_PER_LANE = 16, 128 was the fastest of the
/// configurations tried on an H200 (64, 128, 256 threads; 4, 8, 16 words per lane) for the large
/// matrices, and within noise for the small ones; the reduction buffer (R · WG floats) stays at 4 KiB.
const WG: usize = 128;
/// Most rows of x one pass over the weights serves.
const MAX_R: usize = 8;
/// Quant words each lane aims to take per row: fewer lanes per row mean shorter reductions and more rows
/// per workgroup, more words per lane more loads in flight per lane.
const WORDS_PER_LANE: usize = 16;
/// Quant vectors (16 bytes) each gemv lane aims to load: enough loads in flight per lane, few lanes to
/// sum per row.
const GEMV_VECTORS_PER_LANE: usize = 3;
/// On a GPU a lane of 4-bit blocks takes as many values as a lane of 8-bit ones (48), not as many
/// vectors (a vector of 4-bit quants holds 32 values, one of 8-bit 16): three blocks a lane were twice
/// the unpacking and summing of an 8-bit lane's, and a decode step waits for its slowest lanes. H100,
/// random files of the real layouts, decode after 128 positions: SmolLM2-135M Q4_1 902-906 -> 938-939
/// tok/s, Gemma-3-270M Q4_K_M 1,170-1,175 -> 1,181-1,183 (docs/perf.md). A software adapter keeps three
/// vectors a lane: its invocations are SIMD lanes of one CPU thread, where more lanes per row are
/// more steps of the sums' tree, each a barrier (lavapipe, SmolLM2's low-end decode: 1.1 -> 1.0 tok/s
/// with the GPU's rule). This crate's tests take the GPU's rule everywhere.
const GEMV_VALUES_PER_LANE: usize = 48;
/// Most quant vectors one gemv lane holds (longer rows take the tiled kernel).
const GEMV_MAX_VECTORS: usize = 8;
/// Most threads per workgroup of the batch kernels (gemv_rows_*.wgsl: XR rows of x × TPR lanes).
const ROWS_WG: usize = 256;

/// Weight rows per workgroup of the batch kernels for `tpr` threads per row of x and `xr` rows of x: at
/// most the fewest threads per row (MAX_R = 8: lane b of a row of x writes weight row b's output; Q4
/// lanes hold twice the x, so half that). The once form takes as many as a step's converted
/// weights (NB · TPR vectors of 16 floats, 32 for Q4) and the reduction's NB · WG floats leave room for
/// in the adapter's workgroup memory, and at most `xr` (its first NB · TPR threads convert a vector
/// each): more weight rows a workgroup means fewer workgroups reading the same rows of x. Each row's sums
/// are the same for any NB.
fn rows_nb(g: &GpuBackend, kind: QKind, tpr: usize, xr: usize) -> usize {
    let (bytes_per_vector, most) = match kind {
        QKind::Q8 { .. } => (64, MAX_R),
        QKind::Q4 => (128, MAX_R / 2),
    };
    if !convert_once(g, xr) {
        return most;
    }
    let room = g.limits.max_compute_workgroup_storage_size as usize;
    let per_row = tpr * bytes_per_vector + xr * tpr * 4;
    let nb = most.min(xr).min(room / per_row).max(1);
    1 << nb.ilog2()
}

#[cfg(test)]
thread_local! {
    /// Tests of the batch kernels set this to run one form wherever it can run (Some(true): the
    /// once form, Some(false): the lanes form).
    pub(super) static CONVERT_ONCE: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Whether a batch kernel of `xr` rows of x a workgroup converts each weight vector once for them all
/// or each lane its own (the once and lanes forms of gemv_rows_q8.wgsl and gemv_rows_q4.wgsl). Once,
/// on GPUs, where integer-to-float conversion is slow and a batch repeated it for every row (H100: a
/// 16-row product of the SmolLM2-135M shape 26.0 → 20.9 µs), when 8 rows of x or more share it: with
/// 4 (64 threads a row) its steps' barriers cost more than they save (Gemma-3's down projection 21.1 →
/// 23.2-24.7 µs). Each lane, on software adapters, where conversions are cheap vector code and barriers
/// are not (lavapipe, 16 sequences of SmolLM2-135M: 14-15 → 10 tok/s). Both give every row the
/// one-row kernel's bits.
fn convert_once(g: &GpuBackend, xr: usize) -> bool {
    let shared = xr >= 8;
    #[cfg(test)]
    if let Some(once) = CONVERT_ONCE.with(|f| f.get()) {
        return once && shared;
    }
    !g.is_software() && shared
}

/// Rows of x from which a gemv-family product takes the batch kernel. Below it the one-row kernel's
/// lanes take every row (H100, a pass of the SmolLM2-135M shape: its normed products 12.7 / 15.6 µs for
/// 2 / 4 rows, the batch kernel's 17.9 / 18.5 with its workgroups of 2 or 4 rows; from 8 rows the batch
/// kernel is ahead, 19.9 against 21.3 µs).
const BATCH_MIN_ROWS: usize = 5;

/// Rows of x per workgroup of the batch kernel for `m` rows at `tpr` threads per row.
fn rows_xr(m: usize, tpr: usize) -> usize {
    (ROWS_WG / tpr).min(m.next_power_of_two())
}

/// Rows of x from which a product takes the GEMM kernel (its tiles hold 64), and the tensor-core one
/// where the `tc-prompt` path is held.
pub(crate) const GEMM_MIN_ROWS: usize = 32;
/// Threads per workgroup of the row-lookup kernels (one workgroup per token).
const GET_ROWS_WG: usize = 64;

/// Threads per weight row for rows of `kw` quant words: a power of two in 8..=64 (8 ≥ MAX_R, so the
/// lanes that write the R results exist; ≤ WG).
fn threads_per_row(kw: usize) -> usize {
    kw.div_ceil(WORDS_PER_LANE)
        .next_power_of_two()
        .clamp(MAX_R, 64)
}

/// The gemv shape of rows of `k` values: (vectors per row, threads per row, vectors per lane), when the
/// gemv kernel takes it (whole 16-byte vectors per row, at most GEMV_MAX_VECTORS per lane).
fn gemv_shape(g: &GpuBackend, kind: QKind, k: usize) -> Option<(usize, usize, usize)> {
    let per_vector = match kind {
        QKind::Q8 { .. } => 16,
        QKind::Q4 => 32,
    };
    if k == 0 || !k.is_multiple_of(per_vector) {
        return None;
    }
    let kw4 = k / per_vector;
    let per_lane = if cfg!(test) || !g.is_software() {
        GEMV_VALUES_PER_LANE
    } else {
        GEMV_VECTORS_PER_LANE * per_vector
    };
    let tpr = k.div_ceil(per_lane).next_power_of_two().clamp(MAX_R, 64);
    let ni = kw4.div_ceil(tpr);
    (ni <= GEMV_MAX_VECTORS).then_some((kw4, tpr, ni))
}

/// What a product takes in before it multiplies (see the hooks in q8.wgsl): x as it is, or a workgroup
/// copy of the pass's rows computed from other tensors, so that op needs no dispatch of its own.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Stage {
    /// x read from its binding.
    Plain,
    /// x = RMSNorm(src) · w, computed as the norm kernel computes it (the same sums in the same order),
    /// so the product equals norm then product bit for bit on adapters that round alike.
    RmsNorm { eps: f32 },
    /// x = act(gate) · up, gate and up rows `ld` apart in x's binding (up from element `up`).
    Glu {
        act: Activation,
        up: usize,
        ld: usize,
    },
    /// x = the merge of one row's attention splits in x's binding (per head, per split: its maximum,
    /// its sum of exponentials, its unnormalised output of `head_dim`), computed as
    /// attend_combine.wgsl merges them (the same values in the same order), so a decode step's output
    /// product takes its attention's splits without the merge's dispatch. One row of x (R = 1).
    Merge {
        heads: usize,
        head_dim: usize,
        n_split: usize,
    },
    /// x' = x + RMSNorm(d) · pw (a post-normed sublayer output joining the residual stream, as
    /// add_norm.wgsl adds it), written to a buffer of its own by each pass's first workgroup; then
    /// x = RMSNorm(x') · w as [`Stage::RmsNorm`] computes it. Its own bindings: w, d, pw, x'.
    ResidualNorm { eps: f32 },
}

/// Most heads, and most (head, split) pairs, a merging stage takes (their statistics live in workgroup
/// memory).
const MERGE_MAX_HEADS: usize = 64;
const MERGE_MAX_PAIRS: usize = 512;

/// Whether a merging stage holds the statistics of `heads` heads of `n_split` splits.
pub(crate) fn merge_takes(heads: usize, n_split: usize) -> bool {
    heads <= MERGE_MAX_HEADS && heads * n_split <= MERGE_MAX_PAIRS
}

impl Stage {
    /// The stage's own storage bindings, after the kernel's (see the hooks).
    fn bindings(self) -> &'static [Access] {
        match self {
            Stage::RmsNorm { .. } => &[Access::Read],
            Stage::ResidualNorm { .. } => {
                &[Access::Read, Access::Read, Access::Read, Access::ReadWrite]
            }
            Stage::Plain | Stage::Glu { .. } | Stage::Merge { .. } => &[],
        }
    }

    fn key(self) -> String {
        match self {
            Stage::Plain => String::new(),
            Stage::RmsNorm { .. } => "_rms".into(),
            Stage::Glu { act, .. } => format!("_glu{act:?}"),
            Stage::Merge { .. } => "_merge".into(),
            Stage::ResidualNorm { .. } => "_resnorm".into(),
        }
    }
}

/// Whether the product writes its outputs or adds them to what y holds (a residual connection).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Output {
    Store,
    Accumulate,
}

/// The `store` hook: write an output, or add it to y.
fn store_hook(out: Output) -> &'static str {
    match out {
        Output::Store => "fn store(i: u32, v: f32) { y[i] = v; }",
        Output::Accumulate => "fn store(i: u32, v: f32) { y[i] = y[i] + v; }",
    }
}

/// The storage bindings of every quantized kernel, in order: x (or the ids), y, the scales, Q4's
/// minimums, the quant words (a stage's own follow).
fn quant_bindings(kind: QKind) -> &'static [Access] {
    match kind {
        QKind::Q8 { .. } => &[Access::Read, Access::ReadWrite, Access::Read, Access::Read],
        QKind::Q4 => &[
            Access::Read,
            Access::ReadWrite,
            Access::Read,
            Access::Read,
            Access::Read,
        ],
    }
}

/// The end of a quantized pipeline's cache key: whether it adds to y, and its planted fault.
fn key_tail(acc: bool, fault: Option<Fault>) -> String {
    format!(
        "{}{}",
        if acc { "_acc" } else { "" },
        fault.map_or(String::new(), |f| format!("_fault{f:?}"))
    )
}

/// The hooks q8.wgsl and q4.wgsl call (see there). `k`: the row length (sizes the staged copy); `nw`:
/// the binding of the norm weight.
fn hooks(stage: Stage, out: Output, r: usize, k: usize, nw: usize, hoist: bool) -> String {
    let store = store_hook(out);
    let body = match stage {
        Stage::Plain => "fn prologue(lid: u32, i0: u32, wg: u32) {}\n\
             fn xrow(r: u32, i0: u32) -> u32 { return p.o_x + min(i0 + r, p.m - 1u) * p.k; }\n\
             fn xget(i: u32) -> vec4<f32> { return xload(i); }"
            .to_string(),
        Stage::RmsNorm { .. } => rms_hooks(r, k, nw, hoist),
        Stage::ResidualNorm { .. } => residual_hooks(r, k, nw, hoist),
        Stage::Glu { act, .. } => format!(
            "var<workgroup> xs: array<vec4<f32>, {xs}>;\n\
             fn xrow(r: u32, i0: u32) -> u32 {{ return r * p.k; }}\n\
             fn xget(i: u32) -> vec4<f32> {{ return xs[i >> 2u]; }}\n\
             // The activation as the GLU kernel computes it.\n\
             fn act(x: f32) -> f32 {{ {act} }}\n\
             // act(gate) · up for the R rows; gate row i from p.o_x + i · e1, up row i from e0 + i · e1.\n\
             fn prologue(lid: u32, i0: u32, wg: u32) {{\n\
               let k4 = p.k / 4u;\n\
               for (var i = lid; i < R * k4; i = i + WG) {{\n\
                 let row = min(i0 + i / k4, p.m - 1u);\n\
                 let c = 4u * (i % k4);\n\
                 let g = p.o_x + row * p.e1 + c;\n\
                 let u = p.e0 + row * p.e1 + c;\n\
                 xs[i] = vec4<f32>(act(x1(g)) * x1(u), act(x1(g + 1u)) * x1(u + 1u),\n\
                                   act(x1(g + 2u)) * x1(u + 2u), act(x1(g + 3u)) * x1(u + 3u));\n\
               }}\n\
               workgroupBarrier();\n\
             }}",
            xs = r * k / 4,
            act = match act {
                Activation::Silu => "let s = 1.0 / (1.0 + exp(-x)); return x * s;",
                Activation::Gelu => {
                    "let t = tanh(clamp(0.7978845608028654 * (x + 0.044715 * x * x * x), -15.0, 15.0)); \
                     return 0.5 * x * (1.0 + t);"
                }
            }
        ),
        Stage::Merge { .. } => format!(
            "var<workgroup> xs: array<vec4<f32>, {xs}>;\n\
             var<workgroup> mm: array<f32, {MERGE_MAX_PAIRS}>;\n\
             var<workgroup> ll: array<f32, {MERGE_MAX_PAIRS}>;\n\
             var<workgroup> dn: array<f32, {MERGE_MAX_HEADS}>;\n\
             fn xrow(r: u32, i0: u32) -> u32 {{ return r * p.k; }}\n\
             fn xget(i: u32) -> vec4<f32> {{ return xs[i >> 2u]; }}\n\
             // The merge of row i0's splits (e0 splits, e1 heads, e2 head_dim; head h's split s at\n\
             // p.o_x + ((i0 · e1 + h) · e0 + s) · (e2 + 2): max, sum, output) as attend_combine.wgsl\n\
             // merges them: M the largest maximum of a non-empty split, weights e^(m_s − M) (0 for an\n\
             // empty split), Σ_s w_s o_s / Σ_s w_s l_s, each sum in split order. The pairs' statistics\n\
             // are loaded at once, one thread per head weighs its splits, then every output.\n\
             fn prologue(lid: u32, i0: u32, wg: u32) {{\n\
               let ns = p.e0;\n\
               let nh = p.e1;\n\
               let hd = p.e2;\n\
               let stride = hd + 2u;\n\
               let b = p.o_x + i0 * nh * ns * stride;\n\
               for (var i = lid; i < nh * ns; i = i + WG) {{\n\
                 mm[i] = x1(b + i * stride);\n\
                 ll[i] = x1(b + i * stride + 1u);\n\
               }}\n\
               workgroupBarrier();\n\
               for (var h = lid; h < nh; h = h + WG) {{\n\
                 var ninf_bits = 0xff800000u;\n\
                 var mx = bitcast<f32>(ninf_bits);\n\
                 for (var s = 0u; s < ns; s = s + 1u) {{\n\
                   if (ll[h * ns + s] > 0.0) {{ mx = max(mx, mm[h * ns + s]); }}\n\
                 }}\n\
                 var den = 0.0;\n\
                 for (var s = 0u; s < ns; s = s + 1u) {{\n\
                   let j = h * ns + s;\n\
                   let l = ll[j];\n\
                   let w = select(0.0, exp(mm[j] - mx), l > 0.0);\n\
                   mm[j] = w;\n\
                   if (l > 0.0) {{ den = den + w * l; }}\n\
                 }}\n\
                 dn[h] = den;\n\
               }}\n\
               workgroupBarrier();\n\
               for (var i = lid; i < p.k / 4u; i = i + WG) {{\n\
                 let h = (4u * i) / hd;\n\
                 let o = b + h * ns * stride + 2u + (4u * i) % hd;\n\
                 var acc = vec4<f32>(0.0);\n\
                 var s = 0u;\n\
                 {four}\
                 for (; s < ns; s = s + 1u) {{\n\
                   let j = h * ns + s;\n\
                   if (ll[j] > 0.0) {{\n\
                     let at = o + s * stride;\n\
                     acc = acc + mm[j] * vec4<f32>(x1(at), x1(at + 1u), x1(at + 2u), x1(at + 3u));\n\
                   }}\n\
                 }}\n\
                 xs[i] = acc / dn[h];\n\
               }}\n\
               workgroupBarrier();\n\
             }}",
            xs = r * k / 4,
            four = if hoist { MERGE_FOUR } else { "" },
        ),
    };
    format!("{body}\n{store}\n")
}

/// The merging stage's outputs four splits at a time, loaded at once and then added in split order (what
/// the one-split loop after it adds, with the loads of four in flight together).
const MERGE_FOUR: &str = "for (; s + 4u <= ns; s = s + 4u) {
  let j = h * ns + s;
  let a = o + s * stride;
  let v0 = vec4<f32>(x1(a), x1(a + 1u), x1(a + 2u), x1(a + 3u));
  let a1 = a + stride;
  let v1 = vec4<f32>(x1(a1), x1(a1 + 1u), x1(a1 + 2u), x1(a1 + 3u));
  let a2 = a1 + stride;
  let v2 = vec4<f32>(x1(a2), x1(a2 + 1u), x1(a2 + 2u), x1(a2 + 3u));
  let a3 = a2 + stride;
  let v3 = vec4<f32>(x1(a3), x1(a3 + 1u), x1(a3 + 2u), x1(a3 + 3u));
  if (ll[j] > 0.0) { acc = acc + mm[j] * v0; }
  if (ll[j + 1u] > 0.0) { acc = acc + mm[j + 1u] * v1; }
  if (ll[j + 2u] > 0.0) { acc = acc + mm[j + 2u] * v2; }
  if (ll[j + 3u] > 0.0) { acc = acc + mm[j + 3u] * v3; }
}
";

/// WGSL for the vec4 of `array` from element `at` on (four scalar loads: the arrays are f32).
fn vec4_at(array: &str, at: &str) -> String {
    format!("vec4<f32>({array}[{at}], {array}[{at} + 1u], {array}[{at} + 2u], {array}[{at} + 3u])")
}

/// Most values one thread loads up front in the norm prologues (beyond it they loop, loading as they go).
const HOIST_MAX: usize = 16;

/// WGSL lines summing the squares of a row of `k` values as the norm kernels' 256 partials do, two per
/// thread (columns lid, lid + 256, ... into qa, lid + 128, lid + 384, ... into qb, in that order), with
/// every load issued before the first addition (`load(i)`: the value at column expression i), so their
/// latencies overlap; a loop that loads as it goes when a row needs more than [`HOIST_MAX`] per thread.
fn square_sums(k: usize, hoist: bool, load: impl Fn(&str) -> String) -> String {
    let per_thread = k.div_ceil(128);
    if !hoist || per_thread > HOIST_MAX {
        return format!(
            "var qa = 0.0;\n\
             var qb = 0.0;\n\
             for (var c = lid; c < {k}u; c = c + 256u) {{ let d = {}; qa = qa + d * d; }}\n\
             for (var c = lid + 128u; c < {k}u; c = c + 256u) {{ let d = {}; qb = qb + d * d; }}\n",
            load("c"),
            load("c")
        );
    }
    let mut out = String::new();
    for j in 0..per_thread {
        let at = format!("min(lid + {}u, {}u)", 128 * j, k - 1);
        out += &format!("let d{j} = {};\n", load(&at));
    }
    out += "var qa = 0.0;\nvar qb = 0.0;\n";
    for parity in [0, 1] {
        let q = if parity == 0 { "qa" } else { "qb" };
        for j in (parity..per_thread).step_by(2) {
            out += &format!(
                "if (lid + {}u < {k}u) {{ {q} = {q} + d{j} * d{j}; }}\n",
                128 * j
            );
        }
    }
    out
}

/// The RMSNorm stage's hooks (see [`Stage::RmsNorm`]): binding nw (the norm's weight); e0: its offset,
/// e1: eps bits. Each row's norm as the norm kernel computes it: 256 partial sums of squares (thread t
/// takes columns t, t + 256, ...) reduced by a tree; with 128 threads, thread t holds partials t and
/// t + 128, whose sum is the tree's first level. The R rows' trees run side by side (red holds R x WG),
/// so R rows cost one tree's barriers. Every load of x and of the weight is issued at the start (the
/// prologue is a chain of latencies, not work), unless a thread would hold more than [`HOIST_MAX`].
fn rms_hooks(r: usize, k: usize, nw: usize, hoist: bool) -> String {
    let k4 = k / 4;
    let slots = (r * k4).div_ceil(WG);
    let hoist = hoist && slots <= HOIST_MAX / 4;
    let mut pre = String::new();
    let mut stage = String::new();
    if hoist {
        for j in 0..slots {
            pre += &format!(
                "let e{j} = min(lid + {at}u, {last}u);\n\
                 let c{j} = e{j} % {k4}u;\n\
                 let w{j} = {w};\n\
                 let xv{j} = xload(p.o_x + min(i0 + e{j} / {k4}u, p.m - 1u) * p.k + 4u * c{j});\n",
                at = j * WG,
                last = r * k4 - 1,
                w = vec4_at("nw", &format!("p.e0 + 4u * c{j}"))
            );
            stage += &format!(
                "if (lid + {at}u < {n}u) {{\n\
                   let rstd = 1.0 / sqrt(red[(e{j} / {k4}u) * WG] * inv + bitcast<f32>(p.e1));\n\
                   xs[e{j}] = xv{j} * rstd * w{j};\n\
                 }}\n",
                at = j * WG,
                n = r * k4
            );
        }
    } else {
        stage = format!(
            "for (var i = lid; i < {n}u; i = i + WG) {{\n\
               let r = i / {k4}u;\n\
               let c = i % {k4}u;\n\
               let b = p.o_x + min(i0 + r, p.m - 1u) * p.k;\n\
               let rstd = 1.0 / sqrt(red[r * WG] * inv + bitcast<f32>(p.e1));\n\
               let w = {w};\n\
               xs[i] = xload(b + 4u * c) * rstd * w;\n\
             }}\n",
            n = r * k4,
            w = vec4_at("nw", "p.e0 + 4u * c")
        );
    }
    format!(
        "@group(0) @binding({nw}) var<storage, read> nw: array<f32>;\n\
         var<workgroup> xs: array<vec4<f32>, {xs}>;\n\
         fn xrow(r: u32, i0: u32) -> u32 {{ return r * p.k; }}\n\
         fn xget(i: u32) -> vec4<f32> {{ return xs[i >> 2u]; }}\n\
         fn prologue(lid: u32, i0: u32, wg: u32) {{\n\
           let inv = 1.0 / f32(p.k);\n\
           {pre}\
           for (var r = 0u; r < R; r = r + 1u) {{\n\
             let b = p.o_x + min(i0 + r, p.m - 1u) * p.k;\n\
             {sums}\
             red[r * WG + lid] = qa + qb;\n\
           }}\n\
           workgroupBarrier();\n\
           for (var s = 64u; s > 0u; s = s >> 1u) {{\n\
             if (lid < s) {{\n\
               for (var r = 0u; r < R; r = r + 1u) {{ red[r * WG + lid] = red[r * WG + lid] + red[r * WG + lid + s]; }}\n\
             }}\n\
             workgroupBarrier();\n\
           }}\n\
           {stage}\
           workgroupBarrier();\n\
         }}",
        xs = r * k4,
        sums = square_sums(k, hoist, |c| format!("x1(b + {c})")),
    )
}

/// The residual-norm stage's hooks (see [`Stage::ResidualNorm`]): bindings nw (the next norm's weight),
/// dd (the sublayer output), pw (its post-norm weight), xn (x'); e0: nw's offset, e1: eps bits, e2: d's
/// offset, e3: pw's offset, e4: x''s offset (rows of k). Both norms take add_norm.wgsl's and
/// norm_forward's sums in their order (256 partials, thread t holding t and t + 128, then a tree), and
/// x' + the norm's arithmetic is theirs, so the product equals add_rms_norm, then the normed product, bit
/// for bit on adapters that round alike.
fn residual_hooks(r: usize, k: usize, nw: usize, hoist: bool) -> String {
    let k4 = k / 4;
    let slots = k4.div_ceil(WG);
    let hoist = hoist && slots <= HOIST_MAX / 4;
    // The weights' loads (one row each) first, then each row's d and x; their staging after the sums.
    let (mut pre, mut loads, mut join, mut norm) =
        (String::new(), String::new(), String::new(), String::new());
    if hoist {
        for j in 0..slots {
            let at = j * WG;
            pre += &format!(
                "let c{j} = min(lid + {at}u, {last}u);\n\
                 let pw{j} = {pw};\n\
                 let nw{j} = {nw};\n",
                last = k4 - 1,
                pw = vec4_at("pw", &format!("p.e3 + 4u * c{j}")),
                nw = vec4_at("nw", &format!("p.e0 + 4u * c{j}"))
            );
            loads += &format!(
                "let xv{j} = xload(b + 4u * c{j});\n\
                 let dv{j} = {dv};\n",
                dv = vec4_at("dd", &format!("db + 4u * c{j}"))
            );
            join += &format!(
                "if (lid + {at}u < {k4}u) {{ xs[r * {k4}u + c{j}] = xv{j} + dv{j} * r1 * pw{j}; }}\n"
            );
            norm += &format!(
                "if (lid + {at}u < {k4}u) {{ xs[r * {k4}u + c{j}] = xs[r * {k4}u + c{j}] * r2 * nw{j}; }}\n"
            );
        }
    } else {
        join = format!(
            "for (var c = lid; c < {k4}u; c = c + WG) {{\n\
               let dv = {dv};\n\
               let w = {pw};\n\
               xs[r * {k4}u + c] = xload(b + 4u * c) + dv * r1 * w;\n\
             }}\n",
            dv = vec4_at("dd", "db + 4u * c"),
            pw = vec4_at("pw", "p.e3 + 4u * c")
        );
        norm = format!(
            "for (var c = lid; c < {k4}u; c = c + WG) {{\n\
               let w = {nw};\n\
               xs[r * {k4}u + c] = xs[r * {k4}u + c] * r2 * w;\n\
             }}\n",
            nw = vec4_at("nw", "p.e0 + 4u * c")
        );
    }
    format!(
        "@group(0) @binding({nw}) var<storage, read> nw: array<f32>;\n\
         @group(0) @binding({b1}) var<storage, read> dd: array<f32>;\n\
         @group(0) @binding({b2}) var<storage, read> pw: array<f32>;\n\
         @group(0) @binding({b3}) var<storage, read_write> xn: array<f32>;\n\
         var<workgroup> xs: array<vec4<f32>, {xs}>;\n\
         fn xrow(r: u32, i0: u32) -> u32 {{ return r * p.k; }}\n\
         fn xget(i: u32) -> vec4<f32> {{ return xs[i >> 2u]; }}\n\
         fn tree(qa: f32, qb: f32, lid: u32) -> f32 {{\n\
           red[lid] = qa + qb;\n\
           workgroupBarrier();\n\
           for (var s = 64u; s > 0u; s = s >> 1u) {{\n\
             if (lid < s) {{ red[lid] = red[lid] + red[lid + s]; }}\n\
             workgroupBarrier();\n\
           }}\n\
           let t = red[0];\n\
           workgroupBarrier();\n\
           return t;\n\
         }}\n\
         fn staged(r: u32, c: u32) -> f32 {{ return xs[r * {k4}u + c / 4u][c % 4u]; }}\n\
         fn prologue(lid: u32, i0: u32, wg: u32) {{\n\
           let inv = 1.0 / f32(p.k);\n\
           let eps = bitcast<f32>(p.e1);\n\
           {pre}\
           for (var r = 0u; r < R; r = r + 1u) {{\n\
             let row = min(i0 + r, p.m - 1u);\n\
             let b = p.o_x + row * p.k;\n\
             let db = p.e2 + row * p.k;\n\
             {loads}\
             var r1 = 0.0;\n\
             {{\n\
               {sums_d}\
               r1 = 1.0 / sqrt(tree(qa, qb, lid) * inv + eps);\n\
             }}\n\
             {join}\
             workgroupBarrier();\n\
             if (wg == 0u && i0 + r < p.m) {{\n\
               for (var c = lid; c < p.k; c = c + WG) {{ xn[p.e4 + row * p.k + c] = staged(r, c); }}\n\
             }}\n\
             var r2 = 0.0;\n\
             {{\n\
               {sums_t}\
               r2 = 1.0 / sqrt(tree(qa, qb, lid) * inv + eps);\n\
             }}\n\
             {norm}\
             workgroupBarrier();\n\
           }}\n\
         }}",
        xs = r * k4,
        b1 = nw + 1,
        b2 = nw + 2,
        b3 = nw + 3,
        sums_d = square_sums(k, hoist, |c| format!("dd[db + {c}]")),
        sums_t = square_sums(k, hoist, |c| format!("staged(r, {c})")),
    )
}

/// The matmul pipeline for one variant; the WGSL file gets its constants, `xload` and the hooks prepended.
/// `ni`: vectors per lane of the gemv family (None: the tiled family).
#[allow(clippy::too_many_arguments)]
fn matmul_pipeline(
    g: &GpuBackend,
    kind: QKind,
    tpr: usize,
    r: usize,
    ni: Option<usize>,
    xvec: bool,
    stage: Stage,
    out: Output,
    k: usize,
    fault: Option<Fault>,
) -> Result<Rc<Pipeline>> {
    let (name, body): (String, &str) = match (kind, ni) {
        (QKind::Q8 { block }, Some(ni)) => (
            format!("gemv_q8b{block}_i{ni}"),
            include_str!("gemv_q8.wgsl"),
        ),
        (QKind::Q4, Some(ni)) => (format!("gemv_q4_i{ni}"), include_str!("gemv_q4.wgsl")),
        (QKind::Q8 { block }, None) => (format!("qmm_q8b{block}"), include_str!("q8.wgsl")),
        (QKind::Q4, None) => ("qmm_q4".to_string(), include_str!("q4.wgsl")),
    };
    let mut bindings = quant_bindings(kind).to_vec();
    let staged = stage != Stage::Plain;
    // The stage's own bindings follow the kernel's (storage bindings are numbered from 1).
    let nw = bindings.len() + 1;
    bindings.extend_from_slice(stage.bindings());
    let key = format!(
        "{name}_t{tpr}_r{r}_{}{}{}{}",
        if xvec { "xv4" } else { "xf32" },
        stage.key(),
        if staged {
            format!("_k{k}")
        } else {
            String::new()
        },
        key_tail(out == Output::Accumulate, fault)
    );
    g.pipeline(&key, &bindings, || {
        let (xt, xload, x1) = x_access(xvec);
        // The K = 2048 fault of the gemv family (see `plant`), before its lines are repeated.
        let body = match fault {
            Some(Fault::BlockIndexAtK2048) => body.replace(
                "scales[srow + w$i / VPB]",
                "scales[srow + (w$i / VPB) % 64u]",
            ),
            _ => body.to_string(),
        };
        let sums = if ni.is_some() { GEMV_SUMS } else { "" };
        let src = format!(
            "{PRELUDE}{SEXT}{sums}\nconst WG: u32 = {WG}u;\nconst TPR: u32 = {tpr}u;\nconst R: u32 = {r}u;\n\
             const BLOCK: u32 = {}u;\nalias XT = {xt};\nfn xload(i: u32) -> vec4<f32> {{ {xload} }}\n\
             fn x1(i: u32) -> f32 {{ {x1} }}\n{}\n{}",
            kind.block(),
            hooks(stage, out, r, k, nw, hoist_loads(g)),
            repeat_lines(&repeat_lines(&body, "$i", ni.unwrap_or(1)), "$r", r)
        );
        plant(src, fault)
    })
}

/// x's element type and the bodies of `xload(i)` (x[i..i + 4] for i a multiple of 4) and `x1(i)`: one
/// 16-byte load when the view is 16-byte aligned (`xvec`), else four.
fn x_access(xvec: bool) -> (&'static str, &'static str, &'static str) {
    if xvec {
        (
            "vec4<f32>",
            "return x[i >> 2u];",
            "return x[i >> 2u][i & 3u];",
        )
    } else {
        (
            "f32",
            "return vec4<f32>(x[i], x[i + 1u], x[i + 2u], x[i + 3u]);",
            "return x[i];",
        )
    }
}

/// The batch kernel (gemv_rows_q8.wgsl, gemv_rows_q4.wgsl) for `xr` rows of x per workgroup.
#[allow(clippy::too_many_arguments)]
fn rows_pipeline(
    g: &GpuBackend,
    kind: QKind,
    tpr: usize,
    xr: usize,
    ni: usize,
    xvec: bool,
    out: Output,
    fault: Option<Fault>,
) -> Result<Rc<Pipeline>> {
    let once = convert_once(g, xr);
    let form = if once { "" } else { "lanes_" };
    let (name, body) = match kind {
        QKind::Q8 { block } => (
            format!("gemv_rows_{form}q8b{block}_i{ni}"),
            include_str!("gemv_rows_q8.wgsl"),
        ),
        QKind::Q4 => (
            format!("gemv_rows_{form}q4_i{ni}"),
            include_str!("gemv_rows_q4.wgsl"),
        ),
    };
    let nb = rows_nb(g, kind, tpr, xr);
    let key = format!(
        "{name}_t{tpr}_x{xr}_{}{}",
        if xvec { "xv4" } else { "xf32" },
        key_tail(out == Output::Accumulate, fault)
    );
    g.pipeline(&key, quant_bindings(kind), || {
        let (xt, xload, _) = x_access(xvec);
        let store = store_hook(out);
        let body = form_lines(body, if once { "#once " } else { "#lanes " });
        let body = match fault {
            // The once form, then the lanes form.
            Some(Fault::BlockIndexAtK2048) => body
                .replace(
                    "scales[ssrow + sw$i / VPB]",
                    "scales[ssrow + (sw$i / VPB) % 64u]",
                )
                .replace(
                    "scales[srow$b + w$i / VPB]",
                    "scales[srow$b + (w$i / VPB) % 64u]",
                ),
            _ => body,
        } + include_str!("gemv_rows_tree.wgsl");
        let lane_stride = if once { xr } else { 1 };
        let src = format!(
            "{PRELUDE}{SEXT}{GEMV_SUMS}\nconst WG: u32 = {}u;\nconst TPR: u32 = {tpr}u;\nconst XR: u32 = {xr}u;\n\
             const NB: u32 = {nb}u;\nconst BLOCK: u32 = {}u;\nconst LANE_STRIDE: u32 = {lane_stride}u;\n\
             alias XT = {xt};\nfn xload(i: u32) -> vec4<f32> {{ {xload} }}\n{store}\n{}",
            xr * tpr,
            kind.block(),
            rows_steps(&body, ni, nb)
        );
        plant(src, fault)
    })
}

/// A batch kernel's source with its lines repeated: `$i` lines NI times, then `$b` lines NB times, and
/// the block between the `each step` markers written out once per step i (its `$b` lines NB times), so
/// each step converts its weights, then sums them for every weight row.
fn rows_steps(body: &str, ni: usize, nb: usize) -> String {
    let expand = |s: &str| repeat_lines(&repeat_lines(s, "$i", ni), "$b", nb);
    let Some((head, rest)) = body.split_once("  // each step {\n") else {
        return expand(body);
    };
    let (step, tail) = rest.split_once("  // } each step\n").unwrap_or((rest, ""));
    let mut src = expand(head);
    for i in 0..ni {
        src.push_str(&repeat_lines(&step.replace("$i", &i.to_string()), "$b", nb));
    }
    src.push_str(&expand(tail));
    src
}

/// Rewrites a matmul kernel's source into a planted fault's broken variant (tests of the gate only).
fn plant(src: String, fault: Option<Fault>) -> String {
    let tail = |src: String, code: &str| match src.rfind('}') {
        Some(i) => format!("{}{code}\n}}\n", &src[..i]),
        None => src,
    };
    match fault {
        None
        | Some(
            Fault::F16Accumulation
            | Fault::RopePast500
            | Fault::PositionsPast200
            | Fault::WeightGradF16Accumulation
            | Fault::CausalMaskPast128
            | Fault::EightBitActivations,
        ) => src,
        // Zero-extends the bytes: negative quants become 128..255.
        Some(Fault::SignExtensionDropped) => src.replace(
            "vec4<f32>((vec4<i32>(bitcast<i32>(w)) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u))",
            "vec4<f32>((vec4<u32>(w) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u))",
        ),
        // The scale index wraps after 64 blocks, i.e. from K = 2048 on (block 32).
        Some(Fault::BlockIndexAtK2048) => src
            .replace("scales[srow + w / WPB]", "scales[srow + (w / WPB) % 64u]")
            .replace("let blk = (b * 32u + 8u * lq) / BLOCK;", "let blk = ((b * 32u + 8u * lq) / BLOCK) % 64u;")
            .replace("let blk = b;", "let blk = b % 64u;"),
        Some(Fault::OutOfBoundsWrite) => tail(
            src,
            "  if (lid == 0u && group_index(wid, nwg) == 0u && wid.z == 0u) { y[p.o_y + p.m * p.ldy] = 1.0; }",
        ),
        Some(Fault::NanOutput) => tail(
            src,
            "  workgroupBarrier();\n  if (lid == 0u && group_index(wid, nwg) == 0u && wid.z == 0u) { y[p.o_y] = bitcast<f32>(0x7fc00000u); }",
        ),
    }
}

/// A grid of `n` workgroups folded into x and y with as few spare groups as possible (`GpuBackend::grid`
/// fills x to the limit first, which can nearly double the groups launched past 65535).
fn fold(g: &GpuBackend, n: usize) -> [u32; 3] {
    let max = g.limits.max_compute_workgroups_per_dimension as usize;
    let ny = n.div_ceil(max).max(1);
    [n.div_ceil(ny) as u32, ny as u32, 1]
}

/// y = x · Wᵀ for `m` rows: the gemv family for a few rows (decode), and for every row of a batch whose
/// rows must not share work (`independent`); the tiled family for prompts. `tensor_cores`: every row
/// that is not `independent` on the tensor-core GEMM (the `tc-prompt` path), whatever their number.
#[allow(clippy::too_many_arguments)]
pub(super) fn qmatmul(
    g: &GpuBackend,
    (tx, ox): (&GpuTensor, usize),
    (ty, oy): (&GpuTensor, usize),
    w: &GpuParts,
    kind: QKind,
    [m, n, k]: [usize; 3],
    independent: bool,
    fault: Option<Fault>,
    tensor_cores: bool,
) -> Result<()> {
    const OP: &str = "qmatmul";
    if m == 0 {
        return Ok(());
    }
    let max_z = g.limits.max_compute_workgroups_per_dimension as usize;
    let xy = segments(OP, m, &[Operand::rows(tx, ox, k), Operand::rows(ty, oy, n)])?;
    for xs in &xy {
        let (xb, yb) = (&xs.places[0].buffer, &xs.places[1].buffer);
        let (x0, y0) = (xs.places[0].offset, xs.places[1].offset);
        let rows = xs.len();
        if tensor_cores && !independent {
            let (shape, tile) = ([rows, n, k], Some(tc_tile(g, rows, n)));
            qgemm(
                g,
                (xb, x0),
                (yb, y0),
                w,
                kind,
                shape,
                Output::Store,
                fault,
                tile,
            )?;
            continue;
        }
        if let Some((_, tpr, ni)) = gemv_shape(g, kind, k).filter(|_| rows <= MAX_R || independent)
        {
            // Enough rows: the batch kernel (each row's bits those of the one-row kernel).
            let batch = rows >= BATCH_MIN_ROWS;
            let r = if batch {
                rows_xr(rows, tpr)
            } else {
                rows.next_power_of_two().min(MAX_R)
            };
            let v = Variant {
                kind,
                r,
                ni: Some(ni),
                stage: Stage::Plain,
                out: Output::Store,
                fault,
                batch,
            };
            for (i0, z) in passes(rows, r, max_z) {
                let part = (rows - i0).min(z * r);
                dispatch(
                    g,
                    &v,
                    (xb, x0 + i0 * k),
                    (yb, y0 + i0 * n),
                    &[],
                    w,
                    [part, n, k, n],
                    z,
                )?;
            }
            continue;
        }
        if rows >= GEMM_MIN_ROWS {
            qgemm(
                g,
                (xb, x0),
                (yb, y0),
                w,
                kind,
                [rows, n, k],
                Output::Store,
                fault,
                None,
            )?;
            continue;
        }
        // Tiled passes: full groups of MAX_R rows of x (several per dispatch, along z), then the
        // remainder with the smallest power-of-two R that holds it (its extra rows repeat the last one,
        // unwritten).
        let full = if rows <= MAX_R {
            0
        } else {
            rows / MAX_R * MAX_R
        };
        let mut groups: Vec<(usize, usize, usize)> = passes(full, MAX_R, max_z)
            .map(|(i0, z)| (i0, z * MAX_R, MAX_R))
            .collect();
        if rows > full {
            groups.push((full, rows - full, (rows - full).next_power_of_two()));
        }
        for (i0, part, r) in groups {
            let v = Variant {
                kind,
                r,
                ni: None,
                stage: Stage::Plain,
                out: Output::Store,
                fault,
                batch: false,
            };
            let z = part.div_ceil(r);
            dispatch(
                g,
                &v,
                (xb, x0 + i0 * k),
                (yb, y0 + i0 * n),
                &[],
                w,
                [part, n, k, n],
                z,
            )?;
        }
    }
    Ok(())
}

/// Dispatches of `rows` rows, R per workgroup along z, at most `max_z` groups each: (first row, groups).
fn passes(rows: usize, r: usize, max_z: usize) -> impl Iterator<Item = (usize, usize)> {
    let step = r * max_z;
    (0..rows)
        .step_by(step.max(1))
        .map(move |i0| (i0, (rows - i0).min(step).div_ceil(r)))
}

/// Rows of x per gemv pass for `m` rows of `k` with a staged input: the most (a power of two, at most
/// MAX_R) whose workgroup copy, with the reduction buffer, fits the device's workgroup memory.
/// (A plain product copies nothing: only its reduction buffer counts.)
fn staged_rows(g: &GpuBackend, m: usize, k: usize, stage: Stage) -> Option<usize> {
    let limit = g.limits.max_compute_workgroup_storage_size as usize;
    let copy = if stage == Stage::Plain { 0 } else { k };
    if let Stage::Merge {
        heads,
        head_dim,
        n_split,
    } = stage
    {
        // One row; its heads' splits' statistics beside the copy.
        let fits = m == 1
            && merge_takes(heads, n_split)
            && heads * head_dim == k
            && head_dim.is_multiple_of(4);
        let bytes = (k + WG + 2 * MERGE_MAX_PAIRS + MERGE_MAX_HEADS) * 4;
        return (fits && bytes <= limit).then_some(1);
    }
    let mut r = m.next_power_of_two().min(MAX_R);
    while r >= 1 {
        // The copy of x and the reduction buffer.
        if (r * copy + r * WG) * 4 <= limit {
            return Some(r);
        }
        r /= 2;
    }
    None
}

/// Most workgroups a staged product repeats its input's stage in (the norm, the GLU, the merge, each
/// computed again by every workgroup). A product that few workgroups share hides the stage in the time
/// its loads take; a model's head of a large vocabulary fills the GPU many times over, and there every
/// workgroup's copy is work of its own. H100, Gemma-3-270M's shape: its 262,144-row head in 32,768
/// workgroups decoded 1,085-1,088 tok/s with the post-norm and the final norm inside, 1,182-1,184 with
/// both as dispatches of their own before the plain product (the head 198 µs of device time with them
/// inside; 111-114 µs without, the two norms 22-24 µs); SmolLM2-135M's 49,152-row head (6,144
/// workgroups) within noise either way.
const STAGE_MAX_GROUPS: usize = 16_384;

/// Whether [`qmatmul_staged`] can run `m` rows of `k` of this layout into `n` outputs: the gemv family
/// takes the rows, at least one row's workgroup copy fits, and a stage is repeated in at most
/// [`STAGE_MAX_GROUPS`] workgroups.
pub(crate) fn staged_fits(
    g: &GpuBackend,
    kind: QKind,
    [m, n, k]: [usize; 3],
    stage: Stage,
) -> bool {
    let bindings = quant_bindings(kind).len() + stage.bindings().len();
    let Some((_, tpr, _)) = gemv_shape(g, kind, k) else {
        return false;
    };
    m > 0
        && k.is_multiple_of(4)
        && staged_rows(g, m, k, stage).is_some()
        && (stage == Stage::Plain || n.div_ceil(WG / tpr) <= STAGE_MAX_GROUPS)
        && bindings <= g.limits.max_storage_buffers_per_shader_stage as usize
}

/// y (+)= stage(x) · Wᵀ for `m` rows on the gemv family ([`staged_fits`] must hold; plain rows added
/// to y that are not `independent` take the GEMM from [`GEMM_MIN_ROWS`] on): x, y and the stage's own
/// bindings (`extra`: an RMSNorm's weight; a residual norm's w, d, pw and x', the last three advancing
/// by rows as x does) each in one buffer (views: buffer and element offset), y rows
/// `ldy` apart.
#[allow(clippy::too_many_arguments)]
pub(crate) fn qmatmul_staged(
    g: &GpuBackend,
    (xb, x0): (&wgpu::Buffer, usize),
    (yb, y0): (&wgpu::Buffer, usize),
    extra: &[(&wgpu::Buffer, usize)],
    w: &GpuParts,
    kind: QKind,
    stage: Stage,
    out: Output,
    [m, n, k, ldy]: [usize; 4],
    independent: bool,
    fault: Option<Fault>,
    tensor_cores: bool,
) -> Result<()> {
    // A prompt's rows added to y: the GEMM with the addition in its store (a decode batch's rows stay
    // on the gemv family, which computes each row as it is computed alone).
    if stage == Stage::Plain
        && out == Output::Accumulate
        && !independent
        && m >= GEMM_MIN_ROWS
        && ldy == n
    {
        let (shape, tile) = ([m, n, k], tensor_cores.then(|| tc_tile(g, m, n)));
        return qgemm(g, (xb, x0), (yb, y0), w, kind, shape, out, fault, tile);
    }
    // Enough plain rows (a decode batch's output and down products): the batch kernel.
    let batch = stage == Stage::Plain && m >= BATCH_MIN_ROWS;
    let fit = gemv_shape(g, kind, k).and_then(|(_, tpr, ni)| {
        let r = if batch {
            Some(rows_xr(m, tpr))
        } else {
            staged_rows(g, m, k, stage)
        };
        r.map(|r| (r, ni))
    });
    let Some((r, ni)) = fit else {
        return Err(shape(
            "qmatmul",
            format!("{m} rows of {k} do not fit a staged product"),
        ));
    };
    let v = Variant {
        kind,
        r,
        ni: Some(ni),
        stage,
        out,
        fault,
        batch,
    };
    // A GLU input's rows are `ld` apart, a normed one's k, a merged one's its splits; y's ldy apart.
    let x_rows = match stage {
        Stage::Glu { ld, .. } => ld,
        Stage::Merge {
            heads,
            head_dim,
            n_split,
        } => split_len(1, heads, head_dim, n_split),
        _ => k,
    };
    let max_z = g.limits.max_compute_workgroups_per_dimension as usize;
    for (i0, z) in passes(m, r, max_z) {
        let part = (m - i0).min(z * r);
        let v = match stage {
            Stage::Glu { act, up, ld } => Variant {
                stage: Stage::Glu {
                    act,
                    up: up + i0 * ld,
                    ld,
                },
                ..v
            },
            _ => Variant { ..v },
        };
        let mut ex: Vec<(&wgpu::Buffer, usize)> = extra.to_vec();
        if let Stage::ResidualNorm { .. } = stage {
            // d and x' advance by rows as x does; w and pw are one row each.
            for i in [1, 3] {
                if let Some(e) = ex.get_mut(i) {
                    e.1 += i0 * k;
                }
            }
        }
        let (x, y) = ((xb, x0 + i0 * x_rows), (yb, y0 + i0 * ldy));
        dispatch(g, &v, x, y, &ex, w, [part, n, k, ldy], z)?;
    }
    Ok(())
}

/// One kernel variant; `ni`: vectors per lane of the gemv family (None: the tiled family); `batch`:
/// the gemv family's batch kernel (gemv_rows_*.wgsl, plain x only), `r` its rows of x per workgroup.
#[derive(Clone, Copy)]
struct Variant {
    kind: QKind,
    r: usize,
    ni: Option<usize>,
    stage: Stage,
    out: Output,
    fault: Option<Fault>,
    batch: bool,
}

/// Records the product of `rows` rows of x (R per workgroup, `z` groups of R along z) with every weight
/// segment: one dispatch per segment, each writing its columns of y.
#[allow(clippy::too_many_arguments)]
fn dispatch(
    g: &GpuBackend,
    v: &Variant,
    (xb, x_off): (&wgpu::Buffer, usize),
    (yb, y_off): (&wgpu::Buffer, usize),
    extra: &[(&wgpu::Buffer, usize)],
    w: &GpuParts,
    [rows, _n, k, ldy]: [usize; 4],
    z: usize,
) -> Result<()> {
    // The gemv family counts quant vectors (4 words) per row and addresses quants by vector.
    let (words, tpr, qunit) = match v.ni.and(gemv_shape(g, v.kind, k)) {
        Some((kw4, tpr, _)) => (kw4, tpr, 4),
        None => {
            let kw = v.kind.words_per_row(k);
            (kw, threads_per_row(kw), 1)
        }
    };
    let xvec = x_off.is_multiple_of(4)
        && match v.stage {
            Stage::Glu { up, ld, .. } => up.is_multiple_of(4) && ld.is_multiple_of(4),
            _ => true,
        };
    // Weight rows per workgroup.
    let (pipe, rows_per_wg) = match v.ni.filter(|_| v.batch) {
        Some(ni) => (
            rows_pipeline(g, v.kind, tpr, v.r, ni, xvec, v.out, v.fault)?,
            rows_nb(g, v.kind, tpr, v.r),
        ),
        None => (
            matmul_pipeline(g, v.kind, tpr, v.r, v.ni, xvec, v.stage, v.out, k, v.fault)?,
            WG / tpr,
        ),
    };
    let off = |i: usize| extra.get(i).map_or(0, |e| e.1 as u32);
    let params_extra = match v.stage {
        Stage::Plain => [0; 5],
        Stage::RmsNorm { eps } => [off(0), eps.to_bits(), 0, 0, 0],
        Stage::ResidualNorm { eps } => [off(0), eps.to_bits(), off(1), off(2), off(3)],
        Stage::Glu { up, ld, .. } => [up as u32, ld as u32, 0, 0, 0],
        Stage::Merge {
            heads,
            head_dim,
            n_split,
        } => [n_split as u32, heads as u32, head_dim as u32, 0, 0],
    };
    for ws in &w.segs {
        let nseg = ws.len();
        let mut grid = fold(g, nseg.div_ceil(rows_per_wg));
        grid[2] = z as u32;
        let (sp, qp) = (&ws.places[0], &ws.places[1]);
        if !qp.offset.is_multiple_of(qunit) {
            return Err(shape(
                "qmatmul",
                "quant vectors must start at 16-byte boundaries",
            ));
        }
        let mut params = vec![
            nseg as u32,
            words as u32,
            rows as u32,
            k as u32,
            ldy as u32,
            x_off as u32,
            (y_off + ws.start) as u32,
            sp.offset as u32,
            (qp.offset / qunit) as u32,
        ];
        let mut bufs = vec![xb, yb, &sp.buffer];
        if let Some(mp) = ws.places.get(2) {
            params.push(mp.offset as u32);
            bufs.push(&mp.buffer);
        }
        bufs.push(&qp.buffer);
        params.extend_from_slice(&params_extra);
        bufs.extend(extra.iter().map(|(b, _)| *b));
        g.dispatch(&pipe, &params, &bufs, grid)?;
    }
    Ok(())
}

/// The weight layout of qgemm.wgsl: `wfetch` loads thread quarter `lq`'s raw share of block `b` of a
/// weight row (quant words and the scales they need), `wvalues` dequantises it into two vec4, and
/// `wkat(lq, h)` says at which k of the block vec4 h starts.
fn qgemm_layout(kind: QKind) -> &'static str {
    match kind {
        // Words 2·lq and 2·lq + 1 of the block's 8: quants 8·lq .. 8·lq + 7, under one scale (blocks
        // of 32) or two (blocks of 16: the second word's is the next).
        QKind::Q8 { .. } => {
            "@group(0) @binding(4) var<storage, read> quants: array<u32>;
struct WRaw { w: vec2<u32>, s: vec2<f32> }
fn wfetch(row: u32, b: u32, lq: u32) -> WRaw {
  let at = p.o_q + row * p.kw + b * 8u + 2u * lq;
  let srow = p.o_s + row * (p.k / BLOCK);
  let blk = (b * 32u + 8u * lq) / BLOCK;
  let second = (b * 32u + 8u * lq + 4u) / BLOCK - (b * 32u + 8u * lq) / BLOCK;
  return WRaw(vec2<u32>(quants[at], quants[at + 1u]), vec2<f32>(scales[srow + blk], scales[srow + blk + second]));
}
fn wkat(lq: u32, h: u32) -> u32 { return 8u * lq + 4u * h; }
fn wvalues(r: WRaw) -> array<vec4<f32>, 2> {
  return array<vec4<f32>, 2>(sext(r.w.x) * r.s.x, sext(r.w.y) * r.s.y);
}
"
        }
        // Word lq of the block's 4: the low nibbles are quants 4·lq .., the high ones 16 + 4·lq ...
        QKind::Q4 => {
            "@group(0) @binding(4) var<storage, read> mins: array<f32>;
@group(0) @binding(5) var<storage, read> quants: array<u32>;
struct WRaw { w: u32, s: f32, mn: f32 }
fn wfetch(row: u32, b: u32, lq: u32) -> WRaw {
  let blk = b;
  let srow = row * (p.k / 32u);
  return WRaw(quants[p.o_q + row * p.kw + b * 4u + lq], scales[p.o_s + srow + blk], mins[p.o_m + srow + blk]);
}
fn wkat(lq: u32, h: u32) -> u32 { return 4u * lq + 16u * h; }
fn wvalues(r: WRaw) -> array<vec4<f32>, 2> {
  let u = vec4<u32>(r.w) >> vec4<u32>(0u, 8u, 16u, 24u);
  let lo = vec4<f32>(u & vec4<u32>(15u));
  let hi = vec4<f32>((u >> vec4<u32>(4u)) & vec4<u32>(15u));
  return array<vec4<f32>, 2>(lo * r.s + r.mn, hi * r.s + r.mn);
}
"
        }
    }
}

/// y = x · Wᵀ (or y += x · Wᵀ, `out`) for `m` ≥ [`GEMM_MIN_ROWS`] rows of x (x and y each in one
/// buffer) with qgemm.wgsl: one dispatch per weight segment (and per BM · 65535 rows of x), BM x 64
/// output tiles. The addition is the one `add_assign` makes: y + the product's f32 value.
#[allow(clippy::too_many_arguments)]
fn qgemm(
    g: &GpuBackend,
    (xb, x_off): (&wgpu::Buffer, usize),
    (yb, y_off): (&wgpu::Buffer, usize),
    w: &GpuParts,
    kind: QKind,
    [m, n, k]: [usize; 3],
    out: Output,
    fault: Option<Fault>,
    tensor_cores: Option<TcTile>,
) -> Result<()> {
    if !k.is_multiple_of(32) {
        return Err(shape("qmatmul", format!("K = {k} is not a multiple of 32")));
    }
    let xvec = x_off.is_multiple_of(4);
    // Rows of x per tile: 32 when 64 would leave fewer than two workgroups per compute unit of a big
    // GPU (264 covers the H200's 132).
    let tile = tensor_cores.unwrap_or_else(|| {
        let bm = if n.div_ceil(64) * m.div_ceil(64) < 264 {
            32
        } else {
            64
        };
        TcTile { bm, steps: 1 }
    });
    let bm = tile.bm;
    let tensor_cores = tensor_cores.is_some();
    let acc = out == Output::Accumulate;
    let key = format!(
        "qgemm{}_bm{bm}_{}_{}{}",
        if tensor_cores {
            format!("_tc_s{}", tile.steps)
        } else {
            String::new()
        },
        match kind {
            QKind::Q8 { block } => format!("q8b{block}"),
            QKind::Q4 => "q4".into(),
        },
        if xvec { "xv4" } else { "xf32" },
        key_tail(acc, fault)
    );
    let pipe = g.pipeline(&key, quant_bindings(kind), || {
        qgemm_source(kind, tile, xvec, acc, tensor_cores, fault)
    })?;
    let max = g.limits.max_compute_workgroups_per_dimension as usize;
    for i0 in (0..m).step_by(bm * max) {
        let rows = (m - i0).min(bm * max);
        for ws in &w.segs {
            let nseg = ws.len();
            if nseg.div_ceil(64) > max {
                return Err(shape(
                    "qmatmul",
                    format!("{nseg} weight rows exceed the dispatch grid"),
                ));
            }
            let (sp, qp) = (&ws.places[0], &ws.places[1]);
            let mut params = vec![
                nseg as u32,
                kind.words_per_row(k) as u32,
                rows as u32,
                k as u32,
                n as u32,
                (x_off + i0 * k) as u32,
                (y_off + i0 * n + ws.start) as u32,
                sp.offset as u32,
                qp.offset as u32,
            ];
            let mut bufs = vec![xb, yb, &sp.buffer];
            match ws.places.get(2) {
                Some(mp) => {
                    params.push(mp.offset as u32);
                    bufs.push(&mp.buffer);
                }
                None => params.push(0),
            }
            bufs.push(&qp.buffer);
            let grid = [nseg.div_ceil(64) as u32, rows.div_ceil(bm) as u32, 1];
            g.dispatch(&pipe, &params, &bufs, grid)?;
        }
    }
    Ok(())
}

/// A GEMM tile: `bm` rows of x (by 64 weight rows), `steps` blocks of K staged per step (the
/// tensor-core kernel; the SIMT one takes 1).
#[derive(Clone, Copy, Debug)]
struct TcTile {
    bm: usize,
    steps: usize,
}

/// Fewest rows of x per tensor-core tile (16, 32 or 64).
const TC_MIN_BM: usize = 32;
/// Blocks of K the tensor-core GEMM stages per step (1 or 2) where workgroup memory holds them.
const TC_STEPS: usize = 1;

/// The tensor-core GEMM's tile for `m` x `n` outputs: the most rows per tile (down to [`TC_MIN_BM`])
/// that still give every compute unit of a big GPU two workgroups (264 covers the H200's 132);
/// [`TC_STEPS`] blocks of K per step where workgroup memory holds both tiles at that width.
fn tc_tile(g: &GpuBackend, m: usize, n: usize) -> TcTile {
    let tiles = |bm: usize| n.div_ceil(64) * m.div_ceil(bm);
    let bm = [64, 32, 16]
        .into_iter()
        .find(|&bm| bm == TC_MIN_BM || tiles(bm) >= 264)
        .unwrap_or(TC_MIN_BM);
    let bytes = |steps: usize| 2 * (bm + 64) * (32 * steps + 8) + 4096;
    let limit = g.limits.max_compute_workgroup_storage_size as usize;
    let steps = if bytes(TC_STEPS) <= limit {
        TC_STEPS
    } else {
        1
    };
    TcTile { bm, steps }
}

/// The source of qgemm.wgsl (or, with `tensor_cores`, qgemm_coop.wgsl) for BM = `bm` rows of x per
/// tile: x read as vec4s (`xvec`) or values, y stored or added to (`acc`).
fn qgemm_source(
    kind: QKind,
    TcTile { bm, steps }: TcTile,
    xvec: bool,
    acc: bool,
    tensor_cores: bool,
    fault: Option<Fault>,
) -> String {
    let (xt, xload, _) = x_access(xvec);
    let put = if acc {
        "fn put(at: u32, v: f32) { y[at] = y[at] + v; }"
    } else {
        "fn put(at: u32, v: f32) { y[at] = v; }"
    };
    let (enables, body) = if tensor_cores {
        // Subgroup columns: 4 side by side for 16-row tiles, else 2 x 2.
        let sgc = if bm == 16 { 4 } else { 2 };
        let marks = [
            ("$a", bm * sgc / 64),
            ("$b", 4 / sgc),
            ("$x", bm.div_ceil(32)),
            ("$w", 2),
            ("$s", steps),
        ];
        let body = marks
            .iter()
            .fold(include_str!("qgemm_coop.wgsl").to_string(), |b, (v, n)| {
                repeat_lines(&b, v, *n)
            });
        let consts = format!("const S: u32 = {steps}u;\nconst SGC: u32 = {sgc}u;\n");
        (
            "enable f16;\nenable wgpu_cooperative_matrix;\n",
            consts + &body,
        )
    } else {
        ("", repeat_lines(include_str!("qgemm.wgsl"), "$w", 64 / bm))
    };
    // The kernel's body last: a planted fault's lines go before its final brace.
    let src = format!(
        "{enables}{PRELUDE}{SEXT}\nconst BM: u32 = {bm}u;\nconst BLOCK: u32 = {}u;\nalias XT = {xt};\nfn xload(i: u32) -> vec4<f32> {{ {xload} }}\n{put}\n{}\n{body}",
        kind.block(),
        qgemm_layout(kind)
    );
    plant(src, fault)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn get_rows(
    g: &GpuBackend,
    (ti, oi): (&GpuTensor, usize),
    (to, oo): (&GpuTensor, usize),
    w: &GpuParts,
    kind: QKind,
    n: usize,
    rows: usize,
    k: usize,
    scale: f32,
) -> Result<()> {
    const OP: &str = "qget_rows";
    if !scale.is_finite() {
        return Err(shape(OP, format!("scale {scale} is not finite")));
    }
    let (name, body) = match kind {
        QKind::Q8 { .. } => ("qget_rows_q8", include_str!("get_rows_q8.wgsl")),
        QKind::Q4 => ("qget_rows_q4", include_str!("get_rows_q4.wgsl")),
    };
    let pipe = g.pipeline(name, quant_bindings(kind), || {
        format!("{PRELUDE}{SEXT}\nconst WG: u32 = {GET_ROWS_WG}u;\n{body}")
    })?;
    let nb = k / kind.block();
    let words = kind.words_per_row(k);
    for ts in segments(OP, n, &[Operand::rows(ti, oi, 1), Operand::rows(to, oo, k)])? {
        for (first, ws) in w.segs.iter().enumerate() {
            let (sp, qp) = (&ws.places[0], &ws.places[1]);
            let mut params = vec![
                ts.len() as u32,
                ts.places[0].offset as u32,
                ts.places[1].offset as u32,
                words as u32,
                nb as u32,
                kind.block() as u32,
                ws.start as u32,
                ws.end as u32,
                rows as u32,
                (first == 0) as u32,
                scale.to_bits(),
                sp.offset as u32,
                qp.offset as u32,
            ];
            let mut bufs = vec![&ts.places[0].buffer, &ts.places[1].buffer, &sp.buffer];
            if let Some(mp) = ws.places.get(2) {
                params.push(mp.offset as u32);
                bufs.push(&mp.buffer);
            }
            bufs.push(&qp.buffer);
            g.dispatch(&pipe, &params, &bufs, g.grid(ts.len()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every GEMM source, the tensor-core one included, is valid WGSL for naga's front end and
    /// validator and becomes SPIR-V, healthy and with each planted fault (the tensor-core kernel runs
    /// only where the adapter has cooperative matrices; its gate then decides).
    #[test]
    fn gemm_kernels_parse_and_validate() {
        let faults = std::iter::once(None).chain(Fault::ALL.map(Some));
        for fault in faults {
            for kind in [QKind::Q8 { block: 32 }, QKind::Q8 { block: 16 }, QKind::Q4] {
                for (bm, steps, xvec, acc, tc) in [
                    (16, 1, true, false, true),
                    (16, 2, true, true, true),
                    (32, 1, true, false, true),
                    (32, 2, false, false, true),
                    (64, 1, false, true, true),
                    (64, 2, true, true, true),
                    (32, 1, false, false, false),
                    (64, 1, true, true, false),
                ] {
                    let tile = TcTile { bm, steps };
                    let src = qgemm_source(kind, tile, xvec, acc, tc, fault);
                    let module = naga::front::wgsl::parse_str(&src)
                        .unwrap_or_else(|e| panic!("{}", e.emit_to_string(&src)));
                    let mut v = naga::valid::Validator::new(
                        naga::valid::ValidationFlags::all(),
                        naga::valid::Capabilities::all(),
                    );
                    let info = v
                        .validate(&module)
                        .unwrap_or_else(|e| panic!("{fault:?} {kind:?} bm {bm} tc {tc}: {e:?}"));
                    // Vulkan adapters get it through naga's SPIR-V writer, which has panicked on
                    // cooperative loads it could not express.
                    let opts = naga::back::spv::Options::default();
                    naga::back::spv::write_vec(&module, &info, &opts, None)
                        .unwrap_or_else(|e| panic!("{fault:?} {kind:?} bm {bm} tc {tc}: {e:?}"));
                    if let Some(Fault::OutOfBoundsWrite | Fault::NanOutput) = fault {
                        // The planted lines land in the kernel's entry point.
                        let main = src.rfind("fn main").expect("entry point");
                        assert!(src[main..].contains("group_index(wid, nwg)"));
                    }
                }
            }
        }
    }

    /// The tensor-core GEMM (`tc-prompt`) against f64 math on the dequantized weights, every block
    /// layout, stored and added to y, every tile (16, 32, 64 rows; one or two blocks of K a step, K of
    /// an odd number of blocks), from one row (a mostly-empty tile) to several tiles, with odd N.
    /// Only adapters with cooperative matrices run it (elsewhere the path is never gated). Bound: x and
    /// the weights are rounded to f16 (relative error ≤ 2⁻¹¹ each), so with random signs the NMSE is of
    /// order (2⁻¹¹)² · 2 / 3 ≈ 1.6e-7; 1e-6 still catches one wrong block or fragment.
    #[test]
    fn tensor_core_gemm_matches_reference() {
        use crate::backend::Backend;
        use crate::ops::matmul::quant::{quantize_q4, quantize_q8};
        use crate::path::PathId;
        use crate::rng::SeedRng;
        use crate::testing::{assert_nmse, gpu_backend};
        let Some(be) = gpu_backend(None) else {
            return;
        };
        if let Err(why) = (crate::gate::registry::def(PathId::CoopQuant).detect)(&be) {
            eprintln!("tensor-core GEMM not run: {why}");
            return;
        }
        let Backend::Gpu(g) = &be else { unreachable!() };
        let paths = crate::path::PathSet::of(&[PathId::QuantMatmul]);
        let mut rng = SeedRng::new(77);
        let tiles = [16, 32, 64]
            .into_iter()
            .flat_map(|bm| [1, 2].map(|steps| TcTile { bm, steps }));
        let shapes = [
            (1, 70, 64),
            (33, 200, 576),
            (100, 1100, 1536),
            (300, 330, 96),
        ];
        let cases = shapes
            .into_iter()
            .flat_map(|s| tiles.clone().map(move |t| (s, t)));
        for ((m, n, k), tile) in cases {
            let w = rng.vec(n * k, -0.5, 0.5);
            let x = rng.normal_vec(m * k, 1.0);
            let y0 = rng.vec(m * n, -1.0, 1.0);
            let sources = [
                super::super::QuantSource::Q8(quantize_q8(&w, n, k, 32)),
                super::super::QuantSource::Q8(quantize_q8(&w, n, k, 16)),
                super::super::QuantSource::Q4(quantize_q4(&w, n, k)),
            ];
            for src in sources {
                let kind = src.dims().2;
                let want = super::super::tests::reference(&x, &src.dequantize(), m, n, k);
                let wm = super::super::QMatrix::upload(&be, src, paths).unwrap();
                let parts = wm.gpu_parts().expect("held as blocks");
                let tx = be.from_f32(&x, k).unwrap();
                for out in [Output::Store, Output::Accumulate] {
                    let ty = be.from_f32(&y0, n).unwrap();
                    let (xb, yb) = (
                        &tx.gpu().unwrap().chunks[0].buffer,
                        &ty.gpu().unwrap().chunks[0].buffer,
                    );
                    let tile = Some(tile);
                    qgemm(g, (xb, 0), (yb, 0), parts, kind, [m, n, k], out, None, tile).unwrap();
                    let got = be.to_vec(&ty).unwrap();
                    let want: Vec<f32> = match out {
                        Output::Store => want.clone(),
                        Output::Accumulate => want.iter().zip(&y0).map(|(a, b)| a + b).collect(),
                    };
                    assert_nmse(
                        &format!("{kind:?} m={m} n={n} k={k} {out:?} {tile:?}"),
                        &want,
                        &got,
                        1e-6,
                    );
                }
            }
        }
    }
}
