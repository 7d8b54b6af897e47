//! CPU quantized matmul: y = x · Wᵀ straight from the block-quantized layouts of [`crate::quant`], with
//! f32 activations.
//!
//! These are the canonical kernels: there is no activation quantization, every product is an f32 product
//! with the exact activation, so results equal f32 math on the dequantized weights up to summation order
//! (and, on the AVX-512 path, one rounding of each dequantized weight, exactly as the `dequantize()` twin
//! rounds it). The `int-dot` fast path ([`super::cpu_int`]: 15-bit activations, integer dot products)
//! changes the numbers within the gate's limits and runs only once the gate has passed it. Two exact
//! reassociations are used:
//!
//! * scale outside the block sum: y = Σ_b scale_b · Σ_{i∈b} q_i x_i (+ min_b · Σ_{i∈b} x_i for Q4, with the
//!   block sums Σx computed once per activation row) — AVX2, scalar, and AVX-512 Q8 with one row;
//! * weights dequantized in registers, w = scale·q + min, shared by up to 8 activation rows — AVX-512 Q4,
//!   and AVX-512 Q8 with several rows (see `cpu_avx512`).
//!
//! Decode (batch 1) is a stream over the weights, so the kernels read each weight byte once, widening
//! quants from memory right before the FMAs, and prefetch a few KiB ahead (`cpu_avx2::PREFETCH_BYTES`) so
//! DRAM latency overlaps the arithmetic. For m > 1 (prompt processing) up to 4 (AVX2, scalar) or 8
//! (AVX-512) activation rows share each unpacked block, and weight tiles are sized to stay in L2 while all
//! row groups pass over them.
//!
//! Paths ([`CpuIsa`], detected at run time, once): x86_64 AVX-512F, x86_64 AVX2 + FMA, and a portable path
//! written so LLVM can auto-vectorize it (the only one on wasm32 and aarch64; forced with
//! [`QmmOptions::isa`] for tests). Threads: rayon, over output rows in a few coarse tiles (2 per pool
//! thread); calls under 32 KiB of weights stay on the calling thread. Call from inside the rayon pool
//! (e.g. run the whole decode step in `ThreadPool::install`): from outside, every call pays a hand-off
//! to the pool and back, 6-12 µs (measured), which over ~200 calls per token is a large share of a step.
//!
//! Panics: the functions assert that the lengths of `x`, `y` and the matrix arrays fit the shapes —
//! these are programmer errors (the shapes come from the model, not from user input).

use std::cell::Cell;
use std::ops::Range;
use std::sync::OnceLock;

use rayon::prelude::*;

use crate::quant::{Q4Matrix, Q8Matrix};

#[cfg(target_arch = "x86_64")]
use super::cpu_avx2 as avx2;
#[cfg(target_arch = "x86_64")]
use super::cpu_avx512 as avx512;

/// The instruction set a call runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpuIsa {
    /// Portable Rust, auto-vectorized where the target allows (every target).
    Scalar,
    /// x86_64 with AVX2 and FMA.
    Avx2Fma,
    /// x86_64 with AVX-512F (and FMA).
    Avx512,
}

impl CpuIsa {
    /// The best instruction set this CPU supports; detected on first use and cached.
    pub fn detected() -> CpuIsa {
        static DETECTED: OnceLock<CpuIsa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            if CpuIsa::Avx512.is_available() {
                CpuIsa::Avx512
            } else if CpuIsa::Avx2Fma.is_available() {
                CpuIsa::Avx2Fma
            } else {
                CpuIsa::Scalar
            }
        })
    }

    /// Whether this CPU can run `self`.
    pub fn is_available(self) -> bool {
        match self {
            CpuIsa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx2Fma => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx512 => {
                is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma")
            }
            #[cfg(not(target_arch = "x86_64"))]
            CpuIsa::Avx2Fma | CpuIsa::Avx512 => false,
        }
    }
}

/// How a call runs: which instruction set, and whether it may use rayon's pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QmmOptions {
    /// Instruction set; must be available on this CPU (see [`CpuIsa::is_available`]).
    pub isa: CpuIsa,
    /// Split output rows over rayon's current pool (false: the calling thread does all the work, e.g. when
    /// the caller already runs several matmuls in parallel).
    pub parallel: bool,
    /// Most activation rows one pass over a weight tile serves (None: as many as the instruction set's
    /// registers hold). 1 computes every row exactly as it is computed alone (the kernels' rounding
    /// depends on how many rows share a pass).
    pub max_group: Option<usize>,
    /// Compute every row exactly as it is computed alone, in groups that still share the weights'
    /// decoding where the instruction set has such kernels (AVX-512 and AVX2: up to [`ALONE_GROUP`]
    /// rows; the portable path takes one row per pass).
    pub alone: bool,
}

/// Rows the AVX-512 kernels that compute each row as it is alone take per pass (four accumulators per
/// row, as the one-row kernels keep, fill 16 of the 32 vector registers at four rows).
pub const ALONE_GROUP: usize = 4;

impl Default for QmmOptions {
    fn default() -> Self {
        QmmOptions {
            isa: CpuIsa::detected(),
            parallel: true,
            max_group: None,
            alone: false,
        }
    }
}

/// y = x · Wᵀ for a Q8 matrix: `x` is m×K row-major, `y` is m×N row-major (N = `w.rows`, K = `w.cols`).
///
/// Panics if the lengths do not fit the shapes.
pub fn q8_matmul_nt(x: &[f32], w: &Q8Matrix, y: &mut [f32], m: usize) {
    assert_eq!(
        y.len(),
        m * w.rows,
        "q8_matmul_nt: y has {} elements, m×N = {m}×{}",
        y.len(),
        w.rows
    );
    q8_matmul_nt_rows(x, w, m, 0..w.rows, y, w.rows);
}

/// y = x · Wᵀ for a Q4 matrix: `x` is m×K row-major, `y` is m×N row-major (N = `w.rows`, K = `w.cols`).
///
/// Panics if the lengths do not fit the shapes.
pub fn q4_matmul_nt(x: &[f32], w: &Q4Matrix, y: &mut [f32], m: usize) {
    assert_eq!(
        y.len(),
        m * w.rows,
        "q4_matmul_nt: y has {} elements, m×N = {m}×{}",
        y.len(),
        w.rows
    );
    q4_matmul_nt_rows(x, w, m, 0..w.rows, y, w.rows);
}

/// Output rows `rows` (a range of N) of y = x · Wᵀ: `y[i * ldy + j] = Σ_k x[i, k] · W[rows.start + j, k]`
/// for i < m, j < rows.len(). Elements of `y` outside those are not touched, so a caller can fill one
/// wide output (e.g. the logits of a tied head) in chunks. Panics if the lengths do not fit the shapes.
pub fn q8_matmul_nt_rows(
    x: &[f32],
    w: &Q8Matrix,
    m: usize,
    rows: Range<usize>,
    y: &mut [f32],
    ldy: usize,
) {
    q8_matmul_nt_with(x, w, m, rows, y, ldy, QmmOptions::default());
}

/// Output rows `rows` of y = x · Wᵀ for a Q4 matrix; see [`q8_matmul_nt_rows`].
pub fn q4_matmul_nt_rows(
    x: &[f32],
    w: &Q4Matrix,
    m: usize,
    rows: Range<usize>,
    y: &mut [f32],
    ldy: usize,
) {
    q4_matmul_nt_with(x, w, m, rows, y, ldy, QmmOptions::default());
}

/// [`q8_matmul_nt_rows`] with explicit [`QmmOptions`] (tests, benchmarks, callers that parallelize
/// themselves).
pub fn q8_matmul_nt_with(
    x: &[f32],
    w: &Q8Matrix,
    m: usize,
    rows: Range<usize>,
    y: &mut [f32],
    ldy: usize,
    opts: QmmOptions,
) {
    let (n, k) = (w.rows, w.cols);
    assert!(
        w.block == 16 || w.block == 32,
        "q8_matmul_nt: block size {} (must be 16 or 32)",
        w.block
    );
    assert!(
        k % w.block == 0,
        "q8_matmul_nt: K = {k} is not a multiple of the block size {}",
        w.block
    );
    assert_eq!(
        w.scales.len(),
        n * k / w.block,
        "q8_matmul_nt: scales length for a {n}×{k} matrix"
    );
    assert_eq!(
        w.quants.len(),
        n * k / 4,
        "q8_matmul_nt: quants length for a {n}×{k} matrix"
    );
    check_xy("q8_matmul_nt", x, m, k, n, &rows, y, ldy);
    check_isa(opts.isa);
    let y = OutPtr(y.as_mut_ptr());
    if use_gemm(opts, m) {
        let nb = k / w.block;
        let q = bytemuck::cast_slice::<u32, u8>(&w.quants);
        return gemm_tiles(opts, x, m, k, n, rows, y, ldy, |r, out| {
            let b = r.start * nb..r.end * nb;
            dequant_q8(&q[r.start * k..r.end * k], &w.scales[b], w.block, out)
        });
    }
    // Bytes of one weight row: quants plus scales.
    let row_bytes = k + 4 * (k / w.block);
    let group = group_size(opts, k);
    let isa = (opts.isa, opts.alone);
    run_tiles(rows, row_bytes, m, opts.parallel, y, |n0, n1, y_tile| {
        q8_tile(isa, group, x, m, w, n0, n1, row_bytes, y_tile, ldy)
    });
}

/// [`q4_matmul_nt_rows`] with explicit [`QmmOptions`].
pub fn q4_matmul_nt_with(
    x: &[f32],
    w: &Q4Matrix,
    m: usize,
    rows: Range<usize>,
    y: &mut [f32],
    ldy: usize,
    opts: QmmOptions,
) {
    let (n, k) = (w.rows, w.cols);
    assert!(k % 32 == 0, "q4_matmul_nt: K = {k} is not a multiple of 32");
    assert_eq!(
        w.scales.len(),
        n * k / 32,
        "q4_matmul_nt: scales length for a {n}×{k} matrix"
    );
    assert_eq!(
        w.mins.len(),
        n * k / 32,
        "q4_matmul_nt: mins length for a {n}×{k} matrix"
    );
    assert_eq!(
        w.quants.len(),
        n * k / 8,
        "q4_matmul_nt: quants length for a {n}×{k} matrix"
    );
    check_xy("q4_matmul_nt", x, m, k, n, &rows, y, ldy);
    check_isa(opts.isa);
    if m == 0 || rows.is_empty() {
        return;
    }
    if use_gemm(opts, m) {
        let nb = k / 32;
        let y = OutPtr(y.as_mut_ptr());
        let q = bytemuck::cast_slice::<u32, u8>(&w.quants);
        return gemm_tiles(opts, x, m, k, n, rows, y, ldy, |r, out| {
            let b = r.start * nb..r.end * nb;
            dequant_q4(
                &q[r.start * k / 2..r.end * k / 2],
                &w.scales[b.clone()],
                &w.mins[b],
                out,
            )
        });
    }
    // The prepared activations live in a per-thread buffer that is *taken* for the call (not borrowed), so a
    // nested call on this thread (rayon may run another task here while we wait) simply finds it empty.
    let mut buf = SCRATCH.take();
    let (xs, sx) = if q4_needs_prep(opts.isa) {
        prepare_q4(x, m, k, &mut buf)
    } else {
        (x, &[][..])
    };
    let y = OutPtr(y.as_mut_ptr());
    // Bytes of one weight row: quants, scales and mins.
    let row_bytes = k / 2 + 8 * (k / 32);
    let group = group_size(opts, k);
    let isa = (opts.isa, opts.alone);
    run_tiles(rows, row_bytes, m, opts.parallel, y, |n0, n1, y_tile| {
        q4_tile(isa, group, xs, sx, m, w, n0, n1, row_bytes, y_tile, ldy)
    });
    // Keep the buffer for the next call (decode then allocates nothing), unless a long prompt grew it.
    if buf.capacity() <= SCRATCH_KEEP {
        SCRATCH.set(buf);
    }
}

#[allow(clippy::too_many_arguments)]
fn check_xy(
    op: &str,
    x: &[f32],
    m: usize,
    k: usize,
    n: usize,
    rows: &Range<usize>,
    y: &[f32],
    ldy: usize,
) {
    assert_eq!(
        x.len(),
        m * k,
        "{op}: x has {} elements, m×K = {m}×{k}",
        x.len()
    );
    assert!(
        rows.start <= rows.end && rows.end <= n,
        "{op}: output rows {rows:?} are not inside 0..{n}"
    );
    let width = rows.end - rows.start;
    assert!(
        ldy >= width,
        "{op}: ldy = {ldy} is less than the {width} output columns"
    );
    if m > 0 && width > 0 {
        let need = (m - 1) * ldy + width;
        assert!(
            y.len() >= need,
            "{op}: y has {} elements, needs {need}",
            y.len()
        );
    }
}

fn check_isa(isa: CpuIsa) {
    assert!(
        isa.is_available(),
        "quant matmul: {isa:?} was requested but this CPU does not support it"
    );
}

/// Activation rows from which a product runs as a GEMM on AVX-512: tiles of weight rows dequantized to
/// f32 (exactly the `dequantize()` twin's values) and multiplied by a kernel holding 16 rows × 24 weight
/// rows in registers, where the row kernels re-read each activation row for every weight row. Prompt
/// passes and perplexity chunks take it; decode (m = 1), batched decode steps (rows computed as alone)
/// and calls limiting their groups keep the row kernels. Measured on the SmolLM2-135M layers, 2 cores
/// (`cargo bench -p tinygpt-kernels --bench quant_matmul_cpu -- prompt`): equal to the row kernels at
/// m = 32, 1.2x at 64, 1.3-1.5x at 128-256.
pub const GEMM_MIN_ROWS_AVX512: usize = 32;
/// The same on AVX2, where the `gemm` crate multiplies the dequantized tiles: 0.75x the row kernels at
/// m = 32, 1.3x at 64, 1.3-1.5x at 128-256 (same benchmark, `QMM_ISA=avx2`).
pub const GEMM_MIN_ROWS_AVX2: usize = 64;
/// Dequantized f32 weights one `gemm` crate call takes at most (a whole tile of a thread, or a slice of
/// it).
const GEMM_TILE_BYTES: usize = 512 << 10;
/// Columns of the blocks every `gemm` crate call covers whole, counted from column 0 (see
/// [`gemm_tiles`]).
const GEMM_ALIGN: usize = 16;

/// Whether a call of m activation rows runs as a GEMM over dequantized tiles. The portable path (wasm32,
/// aarch64) keeps the row kernels, written for its auto-vectorizer.
fn use_gemm(opts: QmmOptions, m: usize) -> bool {
    let min = match opts.isa {
        CpuIsa::Avx512 => GEMM_MIN_ROWS_AVX512,
        CpuIsa::Avx2Fma => GEMM_MIN_ROWS_AVX2,
        CpuIsa::Scalar => return false,
    };
    m >= min && !opts.alone && opts.max_group.is_none()
}

thread_local! {
    /// Dequantized weight tiles of [`gemm_tiles`], reused across calls.
    static DEQUANT: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// y[:, rows] = x · W[rows]ᵀ as GEMMs over dequantized weights: output rows split across the pool by
/// [`par_tiles`], each thread dequantizing its weight rows (`deq(rows, out)` writes those rows' K values
/// each) a slice at a time and multiplying them with all m activation rows — on AVX-512 by our panel
/// kernel ([`gemm_tile_avx512`]), elsewhere by the `gemm` crate.
#[allow(clippy::too_many_arguments)]
fn gemm_tiles(
    opts: QmmOptions,
    x: &[f32],
    m: usize,
    k: usize,
    n: usize,
    rows: Range<usize>,
    y: OutPtr,
    ldy: usize,
    deq: impl Fn(Range<usize>, &mut [f32]) + Sync,
) {
    let nrows = rows.end - rows.start;
    if nrows == 0 || m == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    let xt = if opts.isa == CpuIsa::Avx512 {
        pack_panels(x, m, k)
    } else {
        Vec::new()
    };
    let tile = |n0: usize, n1: usize, y: OutPtr| {
        let mut buf = DEQUANT.take();
        #[cfg(target_arch = "x86_64")]
        if opts.isa == CpuIsa::Avx512 {
            gemm_tile_avx512(&xt, m, k, n0, n1, y, ldy, &deq, &mut buf);
            DEQUANT.set(buf);
            return;
        }
        // The `gemm` crate's rounding of a column depends on the width of the block it comes in (a
        // block narrower than its micro-kernel takes another path), so every call covers whole blocks
        // of GEMM_ALIGN columns counted from column 0 (the matrix's last block may be shorter): a
        // column gets the same bits whichever range or tile it is computed in. A tile's partial
        // blocks at its edges are computed whole into `edge` and the range's columns copied out.
        let slice = (GEMM_TILE_BYTES / (4 * k.max(1))).max(GEMM_ALIGN) / GEMM_ALIGN * GEMM_ALIGN;
        let mut s0 = n0;
        while s0 < n1 {
            // Columns s0..s1 of this tile inside the whole blocks b0..b1.
            let b0 = s0 / GEMM_ALIGN * GEMM_ALIGN;
            let s1 = (b0 + slice).min(n).min(n1);
            let b1 = s1.next_multiple_of(GEMM_ALIGN).min(n);
            let nt = b1 - b0;
            buf.resize(nt * k, 0.0);
            deq(b0..b1, &mut buf);
            let direct = (b0, b1) == (s0, s1);
            let mut edge = Vec::new();
            let (dst, ld) = if direct {
                (y.at(s0 - n0).0, ldy)
            } else {
                edge.resize(m * nt, 0.0);
                (edge.as_mut_ptr(), nt)
            };
            // SAFETY: dst covers m rows (ld apart) of nt columns: y's columns s0 - n0 .. s1 - n0 of this
            // tile (checked by `check_xy`; tiles are disjoint column ranges) or `edge`; x is m×K
            // (checked), buf is nt×K. The gemm crate computes dst = alpha·dst + beta·lhs·rhs; with
            // read_dst false dst is only written.
            unsafe {
                gemm::gemm(
                    m,
                    nt,
                    k,
                    dst,
                    1,
                    ld as isize,
                    false,
                    x.as_ptr(),
                    1,
                    k as isize,
                    buf.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            if !direct {
                for i in 0..m {
                    for j in s0..s1 {
                        // SAFETY: row i, column j - n0 of this tile's y (see above).
                        unsafe { y.write(i * ldy + j - n0, edge[i * nt + j - b0]) };
                    }
                }
            }
            s0 = s1;
        }
        if buf.capacity() * 4 <= 2 * GEMM_TILE_BYTES {
            DEQUANT.set(buf);
        }
    };
    let threads = pool_threads(opts.parallel);
    if threads <= 1 {
        return tile(rows.start, rows.end, y);
    }
    par_tiles(rows, threads, y, tile);
}

/// The activations of an AVX-512 GEMM call in panels of 16 rows, each K × 16 (`xt[k * 16 + i]` is row
/// i's value k; the last panel's missing rows are zeros).
#[cfg(target_arch = "x86_64")]
fn pack_panels(x: &[f32], m: usize, k: usize) -> Vec<f32> {
    use avx512::PANEL;
    let mut xt = vec![0f32; m.div_ceil(PANEL) * PANEL * k];
    for (p, panel) in xt.chunks_exact_mut(PANEL * k).enumerate() {
        for (i, row) in x.chunks_exact(k).skip(p * PANEL).take(PANEL).enumerate() {
            for (kk, &v) in row.iter().enumerate() {
                panel[kk * PANEL + i] = v;
            }
        }
    }
    xt
}

/// Weight rows n0..n1 against all m activation rows on AVX-512: groups of 24 weight rows are dequantized
/// and multiplied with each panel of 16 activation rows (`xt`, from [`pack_panels`]) held in registers
/// (`cpu_avx512::gemm_panel`).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn gemm_tile_avx512(
    xt: &[f32],
    m: usize,
    k: usize,
    n0: usize,
    n1: usize,
    y: OutPtr,
    ldy: usize,
    deq: &(impl Fn(Range<usize>, &mut [f32]) + Sync),
    buf: &mut Vec<f32>,
) {
    use avx512::{PANEL, PANEL_COLS};
    // Rows a cache line more than K apart: K·4 bytes is often a multiple of 4 KiB (K = 1024, 2048), and
    // 24 rows that far apart would share one set of the L1 cache, evicting each other at every k.
    let ldw = k + 16;
    buf.resize(PANEL_COLS * ldw, 0.0);
    let mut s0 = n0;
    while s0 < n1 {
        let s1 = (s0 + PANEL_COLS).min(n1);
        let c = s1 - s0;
        for (j, row) in buf.chunks_exact_mut(ldw).take(c).enumerate() {
            deq(s0 + j..s0 + j + 1, &mut row[..k]);
        }
        for (p, panel) in xt.chunks_exact(PANEL * k).enumerate() {
            let rows = (m - p * PANEL).min(PANEL);
            let (xp, wp) = (panel.as_ptr(), buf.as_ptr());
            let yp = y.at(s0 - n0 + p * PANEL * ldy).0;
            // SAFETY: AVX-512F checked by `check_isa` (opts.isa is Avx512); the panel holds K × 16
            // values, buf c dequantized rows of K (ldw apart), and y rows p·16 .. p·16 + rows of this tile's
            // columns s0 - n0 .. s1 - n0 (checked by `check_xy`; tiles are disjoint column ranges).
            unsafe {
                match c {
                    1 => avx512::gemm_panel::<1>(xp, k, wp, ldw, yp, ldy, rows),
                    2 => avx512::gemm_panel::<2>(xp, k, wp, ldw, yp, ldy, rows),
                    3 => avx512::gemm_panel::<3>(xp, k, wp, ldw, yp, ldy, rows),
                    4 => avx512::gemm_panel::<4>(xp, k, wp, ldw, yp, ldy, rows),
                    5 => avx512::gemm_panel::<5>(xp, k, wp, ldw, yp, ldy, rows),
                    6 => avx512::gemm_panel::<6>(xp, k, wp, ldw, yp, ldy, rows),
                    7 => avx512::gemm_panel::<7>(xp, k, wp, ldw, yp, ldy, rows),
                    8 => avx512::gemm_panel::<8>(xp, k, wp, ldw, yp, ldy, rows),
                    9 => avx512::gemm_panel::<9>(xp, k, wp, ldw, yp, ldy, rows),
                    10 => avx512::gemm_panel::<10>(xp, k, wp, ldw, yp, ldy, rows),
                    11 => avx512::gemm_panel::<11>(xp, k, wp, ldw, yp, ldy, rows),
                    12 => avx512::gemm_panel::<12>(xp, k, wp, ldw, yp, ldy, rows),
                    13 => avx512::gemm_panel::<13>(xp, k, wp, ldw, yp, ldy, rows),
                    14 => avx512::gemm_panel::<14>(xp, k, wp, ldw, yp, ldy, rows),
                    15 => avx512::gemm_panel::<15>(xp, k, wp, ldw, yp, ldy, rows),
                    16 => avx512::gemm_panel::<16>(xp, k, wp, ldw, yp, ldy, rows),
                    17 => avx512::gemm_panel::<17>(xp, k, wp, ldw, yp, ldy, rows),
                    18 => avx512::gemm_panel::<18>(xp, k, wp, ldw, yp, ldy, rows),
                    19 => avx512::gemm_panel::<19>(xp, k, wp, ldw, yp, ldy, rows),
                    20 => avx512::gemm_panel::<20>(xp, k, wp, ldw, yp, ldy, rows),
                    21 => avx512::gemm_panel::<21>(xp, k, wp, ldw, yp, ldy, rows),
                    22 => avx512::gemm_panel::<22>(xp, k, wp, ldw, yp, ldy, rows),
                    23 => avx512::gemm_panel::<23>(xp, k, wp, ldw, yp, ldy, rows),
                    _ => avx512::gemm_panel::<24>(xp, k, wp, ldw, yp, ldy, rows),
                }
            }
        }
        s0 = s1;
    }
}

/// Rows of a Q8 matrix as f32, `out` holding whole rows: the values of `Q8Matrix::dequantize_row`
/// (`q`: the rows' quant bytes, `s`: their scales).
fn dequant_q8(q: &[u8], s: &[f32], block: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if CpuIsa::Avx2Fma.is_available() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { dequant_q8_avx2(q, s, block, out) };
    }
    dequant_q8_plain(q, s, block, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dequant_q8_avx2(q: &[u8], s: &[f32], block: usize, out: &mut [f32]) {
    dequant_q8_plain(q, s, block, out)
}

#[inline(always)]
fn dequant_q8_plain(q: &[u8], s: &[f32], block: usize, out: &mut [f32]) {
    for ((o, q), &sc) in out
        .chunks_exact_mut(block)
        .zip(q.chunks_exact(block))
        .zip(s)
    {
        for (o, &b) in o.iter_mut().zip(q) {
            *o = sc * b as i8 as f32;
        }
    }
}

/// Rows of a Q4 matrix as f32, `out` holding whole rows: the values of `Q4Matrix::dequantize_row`
/// (`q`: the rows' quant bytes, 16 a block; `s`, `mn`: their scales and mins).
fn dequant_q4(q: &[u8], s: &[f32], mn: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if CpuIsa::Avx2Fma.is_available() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { dequant_q4_avx2(q, s, mn, out) };
    }
    dequant_q4_plain(q, s, mn, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dequant_q4_avx2(q: &[u8], s: &[f32], mn: &[f32], out: &mut [f32]) {
    dequant_q4_plain(q, s, mn, out)
}

#[inline(always)]
fn dequant_q4_plain(q: &[u8], s: &[f32], mn: &[f32], out: &mut [f32]) {
    for (((o, q), &sc), &mn) in out
        .chunks_exact_mut(32)
        .zip(q.chunks_exact(16))
        .zip(s)
        .zip(mn)
    {
        let (lo, hi) = o.split_at_mut(16);
        for ((lo, hi), &b) in lo.iter_mut().zip(hi).zip(q) {
            // Two roundings (no fused multiply-add), as the twin computes it.
            *lo = sc * (b & 15) as f32 + mn;
            *hi = sc * (b >> 4) as f32 + mn;
        }
    }
}

/// Largest prepared-activation buffer (in f32) kept between calls: 1 MiB, far above decode's needs.
const SCRATCH_KEEP: usize = 1 << 18;

thread_local! {
    /// Prepared Q4 activations, reused across calls so a decode step allocates nothing.
    static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Prepares activations for the AVX2 and scalar Q4 kernels, into `buf`: returns (xs, sx) where xs is x
/// with the second half of every block of 32 scaled by 1/16 (see `cpu_avx2::q4_block`: the kernels
/// multiply those by 16·q, saving a shift per vector) and sx[i * K/32 + b] = Σ of block b of row i (for the
/// min term). Exact: scaling by a power of two loses nothing unless x/16 is subnormal (|x| < 2^-122).
fn prepare_q4<'a>(x: &[f32], m: usize, k: usize, buf: &'a mut Vec<f32>) -> (&'a [f32], &'a [f32]) {
    buf.clear();
    buf.reserve(m * k + m * k / 32);
    // K is a multiple of 32, so flat chunks of 32 are exactly the (row, block) pairs in row-major order.
    for c in x.chunks_exact(32) {
        buf.extend_from_slice(&c[..16]);
        buf.extend(c[16..].iter().map(|v| v * 0.0625));
    }
    for c in x.chunks_exact(32) {
        buf.push(c.iter().sum());
    }
    buf.split_at(m * k)
}

/// A raw pointer to the output, shareable across the tiles: every tile writes only its own columns.
#[derive(Clone, Copy)]
pub(super) struct OutPtr(pub(super) *mut f32);
// SAFETY: the tiles handed out by `run_tiles` cover disjoint column ranges of y, so no element is written
// by two threads, and y outlives the parallel section.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer `i` elements on (a method, so closures capture the whole `Sync` wrapper).
    #[inline]
    pub(super) fn at(self, i: usize) -> OutPtr {
        OutPtr(self.0.wrapping_add(i))
    }

    /// # Safety
    /// `i` must be inside the y the pointer came from.
    #[inline]
    unsafe fn write(self, i: usize, v: f32) {
        unsafe { *self.0.add(i) = v }
    }
}

/// Weight bytes below which a call stays on the calling thread: handing half to a pool thread costs a
/// few µs, about what streaming this much weight from DRAM takes. (Measured: 32 KiB vs 128 KiB vs 512 KiB
/// on the decode shapes — the lowest was best or tied; even the 81 KiB k/v projections gain a little.)
const PAR_MIN_BYTES: usize = 32 * 1024;
/// Tiles per pool thread: a little slack so a thread slowed by someone else's work does not hold the call.
const TILES_PER_THREAD: usize = 2;
/// Weight bytes of a sub-tile that all row groups of a prompt pass over while it sits in L2.
const L2_TILE_BYTES: usize = 192 * 1024;

/// Splits output rows `rows` into tiles and runs `tile(n0, n1, y_at_n0)` for each, in parallel when it
/// pays. `y` points at output column `rows.start` of row 0 (the callers pass y itself: column j of the
/// call is at offset j).
pub(super) fn run_tiles(
    rows: Range<usize>,
    row_bytes: usize,
    m: usize,
    parallel: bool,
    y: OutPtr,
    tile: impl Fn(usize, usize, OutPtr) + Sync,
) {
    let nrows = rows.end - rows.start;
    if nrows == 0 || m == 0 {
        return;
    }
    let threads = pool_threads(parallel);
    let work = nrows * row_bytes * m.min(8);
    if threads <= 1 || work < PAR_MIN_BYTES {
        return tile(rows.start, rows.end, y);
    }
    par_tiles(rows, threads, y, tile);
}

/// Threads a call may use: the current pool's, or 1 when the caller keeps it on its own thread.
fn pool_threads(parallel: bool) -> usize {
    if parallel {
        rayon::current_num_threads()
    } else {
        1
    }
}

/// `tile(n0, n1, y_at_n0)` over `rows` split into [`TILES_PER_THREAD`] tiles per thread, in parallel.
/// Tiles are a multiple of 16 rows so neighbouring tiles do not share cache lines of y (for m = 1).
fn par_tiles(
    rows: Range<usize>,
    threads: usize,
    y: OutPtr,
    tile: impl Fn(usize, usize, OutPtr) + Sync,
) {
    let nrows = rows.end - rows.start;
    let per = nrows
        .div_ceil(threads * TILES_PER_THREAD)
        .next_multiple_of(16);
    let ntiles = nrows.div_ceil(per);
    (0..ntiles).into_par_iter().for_each(|t| {
        let j0 = t * per;
        let j1 = (j0 + per).min(nrows);
        tile(rows.start + j0, rows.start + j1, y.at(j0));
    });
}

/// Activation rows that share one pass over the weights: as many as the vector registers hold (8 with
/// AVX-512's 32), but no more than keep a group's activations (R·K f32, re-read for every weight row) in
/// about 24 KiB, within L1. Measured at m = 8, K = 2048 (AVX-512, one thread): R = 8 (64 KiB of x)
/// 46 GFLOP/s, R = 4 65 GFLOP/s; at K = 576 R = 8 gives 86.
fn max_group(isa: CpuIsa, k: usize) -> usize {
    match isa {
        CpuIsa::Avx512 => (24 * 1024 / (4 * k.max(1))).clamp(4, 8),
        CpuIsa::Avx2Fma | CpuIsa::Scalar => 4,
    }
}

/// Rows per pass for a call: the instruction set's best, or fewer when the caller asks (rows computed as
/// alone: the AVX-512 and AVX2 kernels share each unpacked block among up to [`ALONE_GROUP`] rows, the
/// portable one takes one row per pass).
fn group_size(opts: QmmOptions, k: usize) -> usize {
    let best = match (opts.alone, opts.isa) {
        // The AVX-512 kernels keep two accumulators per row as alone (one pass over the blocks per
        // pair), as many as the Q4 one keeps otherwise.
        (true, CpuIsa::Avx512) => max_group(CpuIsa::Avx512, k),
        (true, CpuIsa::Avx2Fma) => ALONE_GROUP,
        (true, CpuIsa::Scalar) => 1,
        (false, isa) => max_group(isa, k),
    };
    opts.max_group.map_or(best, |g| g.clamp(1, best))
}

/// Whether the Q4 kernels of `isa` take prepared activations (see [`prepare_q4`]); AVX-512 takes raw ones.
fn q4_needs_prep(isa: CpuIsa) -> bool {
    isa != CpuIsa::Avx512
}

/// Sub-tile height when several passes go over the weights: rows of weights that fit the L2 budget.
fn sub_rows(group: usize, m: usize, row_bytes: usize, nrows: usize) -> usize {
    if m <= group {
        nrows
    } else {
        (L2_TILE_BYTES / row_bytes.max(1)).max(16)
    }
}

/// Q8 weight rows n0..n1, all m activation rows; output (i, n) at `y[i * ldy + n - n0]`. `isa`: the
/// instruction set, and whether each row is computed as alone.
#[allow(clippy::too_many_arguments)]
fn q8_tile(
    isa: (CpuIsa, bool),
    group: usize,
    x: &[f32],
    m: usize,
    w: &Q8Matrix,
    n0: usize,
    n1: usize,
    row_bytes: usize,
    y: OutPtr,
    ldy: usize,
) {
    let k = w.cols;
    let sub = sub_rows(group, m, row_bytes, n1 - n0);
    let mut s0 = n0;
    while s0 < n1 {
        let s1 = (s0 + sub).min(n1);
        let ys = y.at(s0 - n0);
        let mut i = 0;
        while i < m {
            let r = (m - i).min(group);
            let xg = &x[i * k..];
            let yg = ys.at(i * ldy);
            match r {
                1 => q8_group::<1>(isa, xg, w, s0, s1, yg, ldy),
                2 => q8_group::<2>(isa, xg, w, s0, s1, yg, ldy),
                3 => q8_group::<3>(isa, xg, w, s0, s1, yg, ldy),
                4 => q8_group::<4>(isa, xg, w, s0, s1, yg, ldy),
                5 => q8_group::<5>(isa, xg, w, s0, s1, yg, ldy),
                6 => q8_group::<6>(isa, xg, w, s0, s1, yg, ldy),
                7 => q8_group::<7>(isa, xg, w, s0, s1, yg, ldy),
                _ => q8_group::<8>(isa, xg, w, s0, s1, yg, ldy),
            }
            i += r;
        }
        s0 = s1;
    }
}

/// R activation rows (from `x`, K apart) against Q8 weight rows n0..n1.
// `alone` only steers the x86-64 kernels.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn q8_group<const R: usize>(
    (isa, alone): (CpuIsa, bool),
    x: &[f32],
    w: &Q8Matrix,
    n0: usize,
    n1: usize,
    y: OutPtr,
    ldy: usize,
) {
    let k = w.cols;
    let nb = k / w.block;
    debug_assert!(x.len() >= R * k);
    match isa {
        #[cfg(target_arch = "x86_64")]
        CpuIsa::Avx2Fma => {
            // SAFETY: AVX2+FMA checked by `check_isa`; the quants are u32 words whose bytes, on this
            // little-endian target, are the i8 quants in order; rows n0..n1 of quants/scales and R rows
            // of x exist (lengths asserted by the entry point); y covers R rows of n1 - n0 columns.
            unsafe {
                let q = w.quants.as_ptr().cast::<u8>().add(n0 * k);
                let s = w.scales.as_ptr().add(n0 * nb);
                if w.block == 32 {
                    avx2::q8_rows::<R, 32>(x.as_ptr(), k, k, q, s, n1 - n0, y.0, ldy, alone)
                } else {
                    avx2::q8_rows::<R, 16>(x.as_ptr(), k, k, q, s, n1 - n0, y.0, ldy, alone)
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        CpuIsa::Avx512 => {
            // SAFETY: as above, with AVX-512F checked by `check_isa`.
            unsafe {
                let q = w.quants.as_ptr().cast::<u8>().add(n0 * k);
                let s = w.scales.as_ptr().add(n0 * nb);
                if w.block == 32 {
                    avx512::q8_rows::<R, 32>(x.as_ptr(), k, k, q, s, n1 - n0, y.0, ldy, alone)
                } else {
                    avx512::q8_rows::<R, 16>(x.as_ptr(), k, k, q, s, n1 - n0, y.0, ldy, alone)
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        CpuIsa::Avx2Fma | CpuIsa::Avx512 => unreachable!("refused by check_isa"),
        CpuIsa::Scalar => {
            for n in n0..n1 {
                let q = &w.quants[n * k / 4..(n + 1) * k / 4];
                let s = &w.scales[n * nb..(n + 1) * nb];
                let out = if w.block == 32 {
                    scalar::q8_row::<R, 32>(x, k, q, s)
                } else {
                    scalar::q8_row::<R, 16>(x, k, q, s)
                };
                for (r, v) in out.into_iter().enumerate() {
                    // SAFETY: (r, n - n0) is inside the tile, checked by `check_xy`.
                    unsafe { y.write(r * ldy + n - n0, v) };
                }
            }
        }
    }
}

/// Q4 weight rows n0..n1, all m prepared activation rows (`isa` as in [`q8_tile`]).
#[allow(clippy::too_many_arguments)]
fn q4_tile(
    isa: (CpuIsa, bool),
    group: usize,
    xs: &[f32],
    sx: &[f32],
    m: usize,
    w: &Q4Matrix,
    n0: usize,
    n1: usize,
    row_bytes: usize,
    y: OutPtr,
    ldy: usize,
) {
    let k = w.cols;
    let nb = k / 32;
    let sub = sub_rows(group, m, row_bytes, n1 - n0);
    let mut s0 = n0;
    while s0 < n1 {
        let s1 = (s0 + sub).min(n1);
        let ys = y.at(s0 - n0);
        let mut i = 0;
        while i < m {
            let r = (m - i).min(group);
            // sx is empty for the instruction sets that take raw activations.
            let (xg, sg) = (&xs[i * k..], sx.get(i * nb..).unwrap_or(&[]));
            let yg = ys.at(i * ldy);
            match r {
                1 => q4_group::<1>(isa, xg, sg, w, s0, s1, yg, ldy),
                2 => q4_group::<2>(isa, xg, sg, w, s0, s1, yg, ldy),
                3 => q4_group::<3>(isa, xg, sg, w, s0, s1, yg, ldy),
                4 => q4_group::<4>(isa, xg, sg, w, s0, s1, yg, ldy),
                5 => q4_group::<5>(isa, xg, sg, w, s0, s1, yg, ldy),
                6 => q4_group::<6>(isa, xg, sg, w, s0, s1, yg, ldy),
                7 => q4_group::<7>(isa, xg, sg, w, s0, s1, yg, ldy),
                _ => q4_group::<8>(isa, xg, sg, w, s0, s1, yg, ldy),
            }
            i += r;
        }
        s0 = s1;
    }
}

/// R prepared activation rows against Q4 weight rows n0..n1.
#[allow(clippy::too_many_arguments)]
// `alone` only steers the x86-64 kernels.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn q4_group<const R: usize>(
    (isa, alone): (CpuIsa, bool),
    xs: &[f32],
    sx: &[f32],
    w: &Q4Matrix,
    n0: usize,
    n1: usize,
    y: OutPtr,
    ldy: usize,
) {
    let k = w.cols;
    let nb = k / 32;
    debug_assert!(xs.len() >= R * k && (sx.len() >= R * nb || !q4_needs_prep(isa)));
    match isa {
        #[cfg(target_arch = "x86_64")]
        CpuIsa::Avx2Fma => {
            // SAFETY: as in `q8_group`; the Q4 quants of a row are k / 2 bytes.
            unsafe {
                let q = w.quants.as_ptr().cast::<u8>().add(n0 * k / 2);
                let s = w.scales.as_ptr().add(n0 * nb);
                let mn = w.mins.as_ptr().add(n0 * nb);
                avx2::q4_rows::<R>(
                    xs.as_ptr(),
                    k,
                    sx.as_ptr(),
                    nb,
                    k,
                    q,
                    s,
                    mn,
                    n1 - n0,
                    y.0,
                    ldy,
                    alone,
                )
            }
        }
        #[cfg(target_arch = "x86_64")]
        CpuIsa::Avx512 => {
            // SAFETY: as above, with AVX-512F checked by `check_isa`; `xs` is the raw x here.
            unsafe {
                let q = w.quants.as_ptr().cast::<u8>().add(n0 * k / 2);
                let s = w.scales.as_ptr().add(n0 * nb);
                let mn = w.mins.as_ptr().add(n0 * nb);
                avx512::q4_rows::<R>(xs.as_ptr(), k, k, q, s, mn, n1 - n0, y.0, ldy, alone)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        CpuIsa::Avx2Fma | CpuIsa::Avx512 => unreachable!("refused by check_isa"),
        CpuIsa::Scalar => {
            for n in n0..n1 {
                let q = &w.quants[n * k / 8..(n + 1) * k / 8];
                let s = &w.scales[n * nb..(n + 1) * nb];
                let mn = &w.mins[n * nb..(n + 1) * nb];
                let out = scalar::q4_row::<R>(xs, sx, k, q, s, mn);
                for (r, v) in out.into_iter().enumerate() {
                    // SAFETY: (r, n - n0) is inside the tile, checked by `check_xy`.
                    unsafe { y.write(r * ldy + n - n0, v) };
                }
            }
        }
    }
}

/// The portable path: per block, unpack the quants to f32, then dot with 8 independent lane sums so LLVM
/// can vectorize it (NEON, wasm simd128, SSE2) — the same factoring and nearly the same order as AVX2.
mod scalar {
    /// R activation rows (K apart in `x`) · one Q8 row (`q`: its K/4 words, `s`: its K/BLOCK scales).
    pub(super) fn q8_row<const R: usize, const BLOCK: usize>(
        x: &[f32],
        k: usize,
        q: &[u32],
        s: &[f32],
    ) -> [f32; R] {
        let mut acc = [[0f32; 8]; R];
        for (b, (qb, &sc)) in q.chunks_exact(BLOCK / 4).zip(s).enumerate() {
            let mut w = [0f32; BLOCK];
            q8_unpack(qb, &mut w);
            for (r, a) in acc.iter_mut().enumerate() {
                let xb = &x[r * k + b * BLOCK..][..BLOCK];
                let mut t = [0f32; 8];
                for (wc, xc) in w.chunks_exact(8).zip(xb.chunks_exact(8)) {
                    for l in 0..8 {
                        t[l] += wc[l] * xc[l];
                    }
                }
                for l in 0..8 {
                    a[l] += sc * t[l];
                }
            }
        }
        acc.map(|a| a.iter().sum())
    }

    /// The quants of one Q8 block as f32. Byte i of word j (numerically, i.e. little-endian) is quant
    /// 4j + i in two's complement; on little-endian targets that is plain memory order, which LLVM widens
    /// with vector instructions.
    #[inline(always)]
    fn q8_unpack<const BLOCK: usize>(qb: &[u32], w: &mut [f32; BLOCK]) {
        #[cfg(target_endian = "little")]
        {
            let b: &[u8] = bytemuck::cast_slice(qb);
            for (o, &v) in w.iter_mut().zip(b) {
                *o = v as i8 as f32;
            }
        }
        #[cfg(target_endian = "big")]
        for (j, &word) in qb.iter().enumerate() {
            for (i, v) in word.to_le_bytes().into_iter().enumerate() {
                w[4 * j + i] = v as i8 as f32;
            }
        }
    }

    /// R prepared activation rows · one Q4 row (`q`: its K/8 words; `s`, `mn`: its K/32 scales and mins;
    /// `sx`: per-block activation sums, K/32 apart).
    pub(super) fn q4_row<const R: usize>(
        xs: &[f32],
        sx: &[f32],
        k: usize,
        q: &[u32],
        s: &[f32],
        mn: &[f32],
    ) -> [f32; R] {
        let nb = k / 32;
        let mut acc = [[0f32; 8]; R];
        for (b, (qb, &sc)) in q.chunks_exact(4).zip(s).enumerate() {
            let mut w = [0f32; 32];
            for (j, &word) in qb.iter().enumerate() {
                for (i, byte) in word.to_le_bytes().into_iter().enumerate() {
                    // Byte 4j + i holds quant 4j + i (low nibble) and quant 16 + 4j + i (high nibble); the
                    // high one stays ×16, cancelled by the 1/16 in the prepared activations.
                    w[4 * j + i] = (byte & 0x0f) as f32;
                    w[16 + 4 * j + i] = (byte & 0xf0) as f32;
                }
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let xb = &xs[r * k + b * 32..][..32];
                let mut t = [0f32; 8];
                for (wc, xc) in w.chunks_exact(8).zip(xb.chunks_exact(8)) {
                    for l in 0..8 {
                        t[l] += wc[l] * xc[l];
                    }
                }
                for l in 0..8 {
                    a[l] += sc * t[l];
                }
            }
        }
        let mut out = acc.map(|a| a.iter().sum::<f32>());
        for (r, o) in out.iter_mut().enumerate() {
            let sxr = &sx[r * nb..][..nb];
            *o += mn.iter().zip(sxr).map(|(m, s)| m * s).sum::<f32>();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// f32 unit roundoff.
    const U: f64 = f32::EPSILON as f64 / 2.0;

    /// Every instruction set this CPU can run.
    fn isas() -> Vec<CpuIsa> {
        [CpuIsa::Scalar, CpuIsa::Avx2Fma, CpuIsa::Avx512]
            .into_iter()
            .filter(|i| i.is_available())
            .collect()
    }

    fn opts(isa: CpuIsa, parallel: bool) -> QmmOptions {
        QmmOptions {
            isa,
            parallel,
            max_group: None,
            alone: false,
        }
    }

    /// y = x · Wᵀ for m rows of x into y.
    type Product<'a> = dyn Fn(&[f32], &mut [f32], usize) + 'a;

    /// With `alone`, every row of a batch comes out bit for bit as it does in a call of its own, on every
    /// instruction set this CPU runs (AVX-512 shares the weights' decoding between up to eight rows), for
    /// every layout, an even and an odd count of blocks, and a batch of every size up to past two groups.
    #[test]
    fn rows_computed_alone_match_one_row_calls() {
        let mut rng = ChaCha8Rng::seed_from_u64(31);
        for (n, k) in [(37, 576), (21, 544)] {
            let (w8, w16, w4) = (
                q8(&mut rng, n, k, 32, -8, -4),
                q8(&mut rng, n, k, 16, -8, -4),
                q4(&mut rng, n, k, -8, -4),
            );
            for isa in [CpuIsa::Scalar, CpuIsa::Avx2Fma, CpuIsa::Avx512]
                .into_iter()
                .filter(|i| i.is_available())
            {
                for m in 1..=17 {
                    let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                    let o = QmmOptions {
                        alone: true,
                        ..opts(isa, true)
                    };
                    let run = |f: &Product| {
                        let mut batch = vec![0.0; m * n];
                        f(&x, &mut batch, m);
                        let mut one = vec![0.0; m * n];
                        for i in 0..m {
                            f(&x[i * k..(i + 1) * k], &mut one[i * n..(i + 1) * n], 1);
                        }
                        (batch, one)
                    };
                    for (name, (batch, one)) in [
                        (
                            "q8/32",
                            run(&|x, y, m| q8_matmul_nt_with(x, &w8, m, 0..n, y, n, o)),
                        ),
                        (
                            "q8/16",
                            run(&|x, y, m| q8_matmul_nt_with(x, &w16, m, 0..n, y, n, o)),
                        ),
                        (
                            "q4",
                            run(&|x, y, m| q4_matmul_nt_with(x, &w4, m, 0..n, y, n, o)),
                        ),
                    ] {
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&batch), bits(&one), "{isa:?} {name} {n}x{k} m={m}");
                    }
                }
            }
        }
    }

    /// A random scale of either sign whose magnitude spans 2^lo..2^hi (log-uniform).
    fn scale(rng: &mut ChaCha8Rng, lo: i32, hi: i32) -> f32 {
        let mag = 2f32.powf(rng.random_range(lo as f32..hi as f32));
        if rng.random::<bool>() { mag } else { -mag }
    }

    fn q8(rng: &mut ChaCha8Rng, n: usize, k: usize, block: usize, lo: i32, hi: i32) -> Q8Matrix {
        Q8Matrix {
            rows: n,
            cols: k,
            block,
            scales: (0..n * k / block).map(|_| scale(rng, lo, hi)).collect(),
            quants: (0..n * k / 4).map(|_| rng.random()).collect(),
        }
    }

    fn q4(rng: &mut ChaCha8Rng, n: usize, k: usize, lo: i32, hi: i32) -> Q4Matrix {
        Q4Matrix {
            rows: n,
            cols: k,
            scales: (0..n * k / 32).map(|_| scale(rng, lo, hi)).collect(),
            mins: (0..n * k / 32)
                .map(|_| scale(rng, lo, hi) * rng.random_range(0.0..8.0))
                .collect(),
            quants: (0..n * k / 8).map(|_| rng.random()).collect(),
        }
    }

    fn acts(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
        // A common offset as well as noise: post-activation vectors are not zero-mean, and the offset makes
        // the Q4 min term (min · Σx) large, which is where the factored form could lose accuracy.
        (0..len)
            .map(|_| rng.random_range(-1.0f32..1.0) + 0.3)
            .collect()
    }

    /// Exact-ish reference: the f32 dequantized weights, dot products accumulated in f64. Also returns, per
    /// output, S = Σ_b |scale_b|·Σ|q·x| + |min_b|·Σ|x| (the magnitude the factored f32 sum works with).
    fn reference(
        x: &[f32],
        deq: &[f32],
        terms: impl Fn(usize, usize) -> f64,
        m: usize,
        n: usize,
        k: usize,
    ) -> (Vec<f64>, Vec<f64>) {
        let mut out = vec![0.0; m * n];
        let mut mag = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let xr = &x[i * k..(i + 1) * k];
                let wr = &deq[j * k..(j + 1) * k];
                out[i * n + j] = xr.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum();
                mag[i * n + j] = terms(i, j);
            }
        }
        (out, mag)
    }

    fn q8_mag(x: &[f32], w: &Q8Matrix) -> impl Fn(usize, usize) -> f64 {
        move |i, j| {
            let k = w.cols;
            (0..k)
                .map(|c| {
                    let f = j * k + c;
                    let q = crate::quant::unpack_i8(w.quants[f / 4], f % 4) as f64;
                    (w.scales[f / w.block] as f64 * q * x[i * k + c] as f64).abs()
                })
                .sum()
        }
    }

    fn q4_mag(x: &[f32], w: &Q4Matrix) -> impl Fn(usize, usize) -> f64 {
        move |i, j| {
            let k = w.cols;
            (0..k)
                .map(|c| {
                    let f = j * k + c;
                    let xv = x[i * k + c] as f64;
                    (w.scales[f / 32] as f64 * w.quant(f) as f64 * xv).abs()
                        + (w.mins[f / 32] as f64 * xv).abs()
                })
                .sum()
        }
    }

    /// Checks `got` against the reference.
    ///
    /// Element-wise, a rigorous first-order bound: every term of the f32 sum passes through at most
    /// D roundings, so |error| ≤ D·u·S. Our summation tree has depth ≤ 4 (within a block) + 2 (scale) +
    /// K/16 (the block chain) + 1 + 7 (lanes) for the products, and for the Q4 min term ≤ 31 (Σx of a
    /// block) + 1 + K/32 + 1; the f32 dequantization of the reference adds ≤ 2 more. D = K/16 + 48
    /// covers every path (both instruction sets). Overall, NMSE = Σ(a−b)²/Σb² ≤ `nmse_max`.
    fn check(what: &str, got: &[f32], reference: &[f64], mag: &[f64], k: usize, nmse_max: f64) {
        let depth = (k / 16 + 48) as f64;
        let (mut num, mut den) = (0.0, 0.0);
        for (i, ((&g, &r), &s)) in got.iter().zip(reference).zip(mag).enumerate() {
            let g = g as f64;
            assert!(g.is_finite(), "{what}: y[{i}] = {g} (not written?)");
            let tol = depth * U * s + f64::from(f32::MIN_POSITIVE);
            assert!(
                (g - r).abs() <= tol,
                "{what}: y[{i}] = {g}, reference {r}, |diff| {} > bound {tol}",
                (g - r).abs()
            );
            num += (g - r) * (g - r);
            den += r * r;
        }
        let nmse = if den > 0.0 { num / den } else { num };
        assert!(nmse <= nmse_max, "{what}: NMSE {nmse:e} > {nmse_max:e}");
    }

    const SHAPES: &[(usize, usize)] = &[(1, 32), (5, 64), (37, 96), (300, 576), (1000, 224)];
    /// Row counts of the row kernels' groups and of the GEMM paths (from 32 rows on AVX-512, 64 on AVX2;
    /// 70 leaves a panel of 6 rows after four of 16).
    const MS: &[usize] = &[1, 2, 3, 4, 7, 9, 32, 33, 70];

    #[test]
    fn q8_matches_f32_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(8);
        for &block in &[16, 32] {
            for &(n, k) in SHAPES {
                let w = q8(&mut rng, n, k, block, -8, 2);
                let deq = w.dequantize();
                for &m in MS {
                    let x = acts(&mut rng, m * k);
                    let (r, mag) = reference(&x, &deq, q8_mag(&x, &w), m, n, k);
                    for isa in isas() {
                        for par in [false, true] {
                            let mut y = vec![f32::NAN; m * n];
                            q8_matmul_nt_with(&x, &w, m, 0..n, &mut y, n, opts(isa, par));
                            let what =
                                format!("q8 block {block} {n}x{k} m={m} {isa:?} parallel={par}");
                            check(&what, &y, &r, &mag, k, 1e-11);
                        }
                    }
                    let mut y = vec![f32::NAN; m * n];
                    q8_matmul_nt(&x, &w, &mut y, m);
                    check("q8_matmul_nt", &y, &r, &mag, k, 1e-11);
                }
            }
        }
    }

    #[test]
    fn q4_matches_f32_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        for &(n, k) in SHAPES {
            let w = q4(&mut rng, n, k, -8, 2);
            let deq = w.dequantize();
            for &m in MS {
                let x = acts(&mut rng, m * k);
                let (r, mag) = reference(&x, &deq, q4_mag(&x, &w), m, n, k);
                for isa in isas() {
                    for par in [false, true] {
                        let mut y = vec![f32::NAN; m * n];
                        q4_matmul_nt_with(&x, &w, m, 0..n, &mut y, n, opts(isa, par));
                        let what = format!("q4 {n}x{k} m={m} {isa:?} parallel={par}");
                        check(&what, &y, &r, &mag, k, 1e-11);
                    }
                }
                let mut y = vec![f32::NAN; m * n];
                q4_matmul_nt(&x, &w, &mut y, m);
                check("q4_matmul_nt", &y, &r, &mag, k, 1e-11);
            }
        }
    }

    /// Scales over 2^-60..2^60 inside one matrix (and activations over 2^±20): the element-wise bound is
    /// relative to each output's own magnitude, so small rows are checked as tightly as large ones.
    #[test]
    fn extreme_scales() {
        let mut rng = ChaCha8Rng::seed_from_u64(60);
        let (n, k) = (67, 160);
        for m in [1, 3, 6] {
            let x: Vec<f32> = (0..m * k).map(|_| scale(&mut rng, -20, 20)).collect();
            for &block in &[16, 32] {
                let w = q8(&mut rng, n, k, block, -60, 60);
                let (r, mag) = reference(&x, &w.dequantize(), q8_mag(&x, &w), m, n, k);
                for isa in isas() {
                    let mut y = vec![f32::NAN; m * n];
                    q8_matmul_nt_with(&x, &w, m, 0..n, &mut y, n, opts(isa, true));
                    check(
                        &format!("q8 extreme block {block} m={m} {isa:?}"),
                        &y,
                        &r,
                        &mag,
                        k,
                        1e-6,
                    );
                }
            }
            let w = q4(&mut rng, n, k, -60, 60);
            let (r, mag) = reference(&x, &w.dequantize(), q4_mag(&x, &w), m, n, k);
            for isa in isas() {
                let mut y = vec![f32::NAN; m * n];
                q4_matmul_nt_with(&x, &w, m, 0..n, &mut y, n, opts(isa, true));
                check(&format!("q4 extreme m={m} {isa:?}"), &y, &r, &mag, k, 1e-6);
            }
        }
    }

    /// Small-integer activations, power-of-two scales and mins of −8·scale (GGUF Q4_0): every product and
    /// every partial sum is a multiple of 1/4 below 2^21, exact in f32, so any summation order must give
    /// exactly the reference. This catches any indexing slip bit for bit.
    #[test]
    fn exact_when_every_sum_is_exact() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let (n, k) = (150, 2048);
        let pow2 = |rng: &mut ChaCha8Rng| {
            2f32.powi(rng.random_range(-2..=1)) * if rng.random() { 1.0 } else { -1.0 }
        };
        for m in [1, 2, 5] {
            let x: Vec<f32> = (0..m * k)
                .map(|_| rng.random_range(-2..=2) as f32)
                .collect();
            for &block in &[16, 32] {
                let mut w = q8(&mut rng, n, k, block, 0, 1);
                w.scales.iter_mut().for_each(|s| *s = pow2(&mut rng));
                let (r, _) = reference(&x, &w.dequantize(), |_, _| 0.0, m, n, k);
                for isa in isas() {
                    let mut y = vec![f32::NAN; m * n];
                    q8_matmul_nt_with(&x, &w, m, 0..n, &mut y, n, opts(isa, true));
                    for (a, b) in y.iter().zip(&r) {
                        assert_eq!(*a as f64, *b, "q8 block {block} m={m} {isa:?}");
                    }
                }
            }
            let mut w = q4(&mut rng, n, k, 0, 1);
            w.scales.iter_mut().for_each(|s| *s = pow2(&mut rng));
            w.mins = w.scales.iter().map(|s| -8.0 * s).collect();
            let (r, _) = reference(&x, &w.dequantize(), |_, _| 0.0, m, n, k);
            for isa in isas() {
                let mut y = vec![f32::NAN; m * n];
                q4_matmul_nt_with(&x, &w, m, 0..n, &mut y, n, opts(isa, true));
                for (a, b) in y.iter().zip(&r) {
                    assert_eq!(*a as f64, *b, "q4 m={m} {isa:?}");
                }
            }
        }
    }

    /// The SIMD path against the scalar path, both forced, on the real decode shapes.
    #[test]
    fn simd_matches_scalar() {
        let simd: Vec<CpuIsa> = isas()
            .into_iter()
            .filter(|&i| i != CpuIsa::Scalar)
            .collect();
        if simd.is_empty() {
            eprintln!("simd_matches_scalar: no SIMD instruction set on this CPU; skipped");
            return;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        for (n, k) in [(192, 576), (1536, 576), (576, 1536), (256, 640)] {
            for m in [1, 2, 3, 7, 8, 13] {
                let x = acts(&mut rng, m * k);
                let w8 = [16, 32].map(|b| q8(&mut rng, n, k, b, -8, 0));
                let w4 = q4(&mut rng, n, k, -8, 0);
                // (label, magnitudes S for the bound, the call with a given instruction set)
                type Case<'a> = (String, Vec<f64>, Box<dyn Fn(CpuIsa) -> Vec<f32> + 'a>);
                let mut cases: Vec<Case> = Vec::new();
                for w in &w8 {
                    let mag = reference(&x, &w.dequantize(), q8_mag(&x, w), m, n, k).1;
                    let x = &x;
                    cases.push((
                        format!("q8 block {}", w.block),
                        mag,
                        Box::new(move |isa| {
                            let mut y = vec![f32::NAN; m * n];
                            q8_matmul_nt_with(x, w, m, 0..n, &mut y, n, opts(isa, true));
                            y
                        }),
                    ));
                }
                let mag = reference(&x, &w4.dequantize(), q4_mag(&x, &w4), m, n, k).1;
                cases.push((
                    "q4".into(),
                    mag,
                    Box::new(|isa| {
                        let mut y = vec![f32::NAN; m * n];
                        q4_matmul_nt_with(&x, &w4, m, 0..n, &mut y, n, opts(isa, true));
                        y
                    }),
                ));
                for (what, mag, run) in cases {
                    let scalar: Vec<f64> = run(CpuIsa::Scalar).iter().map(|&v| v as f64).collect();
                    // Both paths err by ≤ D·u·S from the exact value, so they differ by ≤ 2·D·u·S: check with
                    // the bound of `check` taken twice.
                    let mag2: Vec<f64> = mag.iter().map(|s| 2.0 * s).collect();
                    for &isa in &simd {
                        let got = run(isa);
                        check(
                            &format!("{what} {n}x{k} m={m} {isa:?} vs scalar"),
                            &got,
                            &scalar,
                            &mag2,
                            k,
                            1e-11,
                        );
                    }
                }
            }
        }
    }

    /// A row range written into a wider y: only its columns change, all of them are written, with the
    /// bits of the whole product, whatever the number of threads splitting the columns (the tiles of a
    /// 16-thread pool cut the range in other places than a 2-thread one's).
    #[test]
    fn row_range_writes_only_its_columns() {
        for threads in [1, 3, 16] {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(row_range_case);
        }
    }

    fn row_range_case() {
        const UNTOUCHED: f32 = 12345.0;
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (n, k) = (257, 96);
        let (r0, r1) = (37, 200);
        let width = r1 - r0;
        let ldy = width + 5;
        let w8 = q8(&mut rng, n, k, 32, -4, 0);
        let w4 = q4(&mut rng, n, k, -4, 0);
        for m in [1, 3, 6, 40, 70] {
            let x = acts(&mut rng, m * k);
            for isa in isas() {
                for par in [false, true] {
                    // The whole product with the same options: a range must match it bit for bit, as each
                    // output's summation order depends only on m, not on the tiling.
                    let mut full8 = vec![f32::NAN; m * n];
                    let mut full4 = vec![f32::NAN; m * n];
                    q8_matmul_nt_with(&x, &w8, m, 0..n, &mut full8, n, opts(isa, par));
                    q4_matmul_nt_with(&x, &w4, m, 0..n, &mut full4, n, opts(isa, par));
                    for (which, full) in [(8, &full8), (4, &full4)] {
                        // y: m rows of ldy, plus a tail: the range's columns start NaN, the rest is a sentinel.
                        let mut y = vec![UNTOUCHED; m * ldy + 3];
                        for i in 0..m {
                            y[i * ldy..i * ldy + width].fill(f32::NAN);
                        }
                        if which == 8 {
                            q8_matmul_nt_with(&x, &w8, m, r0..r1, &mut y, ldy, opts(isa, par));
                        } else {
                            q4_matmul_nt_with(&x, &w4, m, r0..r1, &mut y, ldy, opts(isa, par));
                        }
                        for (idx, &v) in y.iter().enumerate() {
                            let (i, j) = (idx / ldy, idx % ldy);
                            if i < m && j < width {
                                let want = full[i * n + r0 + j];
                                assert_eq!(v, want, "q{which} {isa:?} par={par} m={m}: y[{i},{j}]");
                            } else {
                                assert_eq!(
                                    v, UNTOUCHED,
                                    "q{which} {isa:?} par={par} m={m}: wrote outside the range at {idx}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Many calls at once from rayon tasks (the per-thread Q4 scratch must survive nesting) agree with the
    /// same calls made one by one.
    #[test]
    fn concurrent_calls_agree() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (n, k) = (600, 256);
        let w = q4(&mut rng, n, k, -4, 0);
        let xs: Vec<Vec<f32>> = (0..16).map(|_| acts(&mut rng, 2 * k)).collect();
        let serial: Vec<Vec<f32>> = xs
            .iter()
            .map(|x| {
                let mut y = vec![f32::NAN; 2 * n];
                q4_matmul_nt_with(x, &w, 2, 0..n, &mut y, n, opts(CpuIsa::detected(), false));
                y
            })
            .collect();
        let parallel: Vec<Vec<f32>> = xs
            .par_iter()
            .map(|x| {
                let mut y = vec![f32::NAN; 2 * n];
                q4_matmul_nt(x, &w, &mut y, 2);
                y
            })
            .collect();
        // Same instruction set and tile-independent per-output order: bit-identical.
        assert_eq!(serial, parallel);
    }

    #[test]
    fn empty_shapes_are_fine() {
        let mut rng = ChaCha8Rng::seed_from_u64(6);
        let w = q8(&mut rng, 4, 32, 32, 0, 1);
        let mut y: Vec<f32> = vec![];
        q8_matmul_nt(&[], &w, &mut y, 0);
        let x = acts(&mut rng, 32);
        let mut y = vec![7.0; 4];
        q8_matmul_nt_rows(&x, &w, 1, 2..2, &mut y, 0);
        assert_eq!(y, vec![7.0; 4]);
        let w4 = q4(&mut rng, 0, 32, 0, 1);
        q4_matmul_nt(&x, &w4, &mut [], 1);
    }

    #[test]
    #[should_panic(expected = "x has 31 elements")]
    fn short_x_panics() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let w = q8(&mut rng, 4, 32, 32, 0, 1);
        q8_matmul_nt(&[0.0; 31], &w, &mut [0.0; 4], 1);
    }

    #[test]
    #[should_panic(expected = "y has 9 elements, needs 10")]
    fn short_y_panics() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let w = q4(&mut rng, 8, 32, 0, 1);
        q4_matmul_nt_rows(&[0.0; 64], &w, 2, 0..5, &mut [0.0; 9], 5);
    }
}
