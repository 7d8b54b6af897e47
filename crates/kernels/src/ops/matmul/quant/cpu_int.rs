//! CPU products with integer dot products: the kernels of the `int-dot` fast path (gated like every fast
//! path: `gate::registry`).
//!
//! **Activations.** Each block of 32 activations is quantized to 15-bit integers, x ≈ sx · xi with
//! sx = max|x| / 16383 and |xi| ≤ 16383, and each xi is split into two bytes, xi = 128·xh + xl (xh in
//! −128..=127, xl in 0..=127). AVX-512 VNNI's `vpdpbusd` (four unsigned-byte × signed-byte products
//! summed into each 32-bit lane) then gives the *exact* integer sums H = Σ q·xh and L = Σ q·xl of a block,
//! and Σ q·xi = 128·H + L. A block adds scale · sx · (128·H + L) to its output (plus min · Σx for Q4,
//! with Σx the f32 sum of the block's own activations). The one approximation is the rounding of xi,
//! at most sx/2 per value (2^-15 of the block's largest activation): far inside the gate's limits, which
//! is what the gate checks before the path is used. Eight-bit activations (llama.cpp's choice) are 128
//! times coarser and fail the gate; a planted fault ([`Fault::EightBitActivations`]) proves it.
//!
//! **Weights** are repacked once, at load, into groups of 16 output rows ([`IntMatrix`]). A record
//! (group, block) holds the 16 rows' quant bytes four at a time: 64 bytes are four consecutive values of
//! 16 rows, so one `vpdpbusd` against four broadcast activation bytes advances 16 outputs at once, and a
//! group's 16 outputs come out as one vector, with no horizontal sums. Q8 quants are stored + 128
//! (unsigned) and the kernel subtracts 128·Σxi of the block. Scales (and Q4 mins) follow the quants
//! of their record, so decode streams the matrix front to back.
//!
//! ```text
//!   record (group g, block b):  Q4       4 lines of quants | 16 scales | 16 mins        (384 bytes)
//!                               Q8 b=32  8 lines of quants | 16 scales                  (576 bytes)
//!                               Q8 b=16  4 lines of quants | 16 scales                  (320 bytes)
//!   line t of quants, lane r:   bytes 4t..4t+4 of row 16g + r's block b
//! ```
//!
//! The packed matrix holds every bit of the original (rows past the last are zeros):
//! [`IntMatrix::dequantize_row`] gives the `dequantize()` twin's values exactly.
//!
//! **Rows.** Every output is accumulated by one lane over the blocks in order, whatever the other
//! activation rows are, so a row gives the same bits alone or in a batch of any size (what a server's
//! batched decode needs), and the SIMD kernel and the portable twin here ([`int_matmul`] with
//! `simd: false`) give the same bits: the integer sums are exact and the float steps are the same
//! operations in the same order.

use std::cell::Cell;

use super::QKind;
use super::cpu::{OutPtr, run_tiles};
use crate::path::Fault;
use crate::quant::{Q4Matrix, Q8Matrix};

/// Output rows a record packs together (one 16-lane vector of outputs).
pub const GROUP: usize = 16;
/// Largest |xi|: activations are 15-bit integers.
const XI_MAX: f32 = 16383.0;

/// One cache line of packed weights.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A Q4 or Q8 matrix repacked for the integer kernels (see the module docs).
#[derive(Clone)]
pub struct IntMatrix {
    rows: usize,
    cols: usize,
    kind: QKind,
    lines: Vec<Line>,
}

impl std::fmt::Debug for IntMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "IntMatrix {{ {} x {}, {:?} }}",
            self.rows, self.cols, self.kind
        )
    }
}

/// Whether this CPU runs the integer kernels: x86-64 with AVX-512 F, BW and VNNI.
pub fn int_dot_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// What the packed layout lacks, if `kind` at `cols` cannot be packed (K must be a multiple of 32, the
/// activations' block).
pub fn packable(kind: QKind, cols: usize) -> std::result::Result<(), String> {
    if !cols.is_multiple_of(32) {
        return Err(format!("K = {cols} is not a multiple of 32"));
    }
    match kind {
        QKind::Q4 | QKind::Q8 { block: 16 | 32 } => Ok(()),
        QKind::Q8 { block } => Err(format!("Q8 blocks of {block}")),
    }
}

impl IntMatrix {
    /// Repacks a Q4 matrix; None when it cannot be packed (see [`packable`]).
    pub fn from_q4(w: &Q4Matrix) -> Option<IntMatrix> {
        packable(QKind::Q4, w.cols).ok()?;
        let (n, k) = (w.rows, w.cols);
        let nb = k / 32;
        let q = bytemuck::cast_slice::<u32, u8>(&w.quants);
        Some(IntMatrix::packed(n, k, QKind::Q4, |r, b, lane, rec| {
            let src = &q[(r * nb + b) * 16..][..16];
            for t in 0..4 {
                rec[t].0[lane * 4..lane * 4 + 4].copy_from_slice(&src[4 * t..4 * t + 4]);
            }
            put_f32(&mut rec[4], lane, w.scales[r * nb + b]);
            put_f32(&mut rec[5], lane, w.mins[r * nb + b]);
        }))
    }

    /// Repacks a Q8 matrix (blocks of 16 or 32); None when it cannot be packed.
    pub fn from_q8(w: &Q8Matrix) -> Option<IntMatrix> {
        let kind = QKind::Q8 { block: w.block };
        packable(kind, w.cols).ok()?;
        let (n, k, bl) = (w.rows, w.cols, w.block);
        let nb = k / bl;
        let q = bytemuck::cast_slice::<u32, u8>(&w.quants);
        Some(IntMatrix::packed(n, k, kind, |r, b, lane, rec| {
            let src = &q[r * k + b * bl..][..bl];
            for t in 0..bl / 4 {
                for (d, &s) in rec[t].0[lane * 4..lane * 4 + 4]
                    .iter_mut()
                    .zip(&src[4 * t..4 * t + 4])
                {
                    *d = s ^ 0x80;
                }
            }
            put_f32(&mut rec[bl / 4], lane, w.scales[r * nb + b]);
        }))
    }

    /// A packed matrix whose records are filled by `fill(row, block, lane, record)` for every row and
    /// block (rows past the last stay zeros); groups are filled in parallel (a large model packs in a
    /// fraction of its load time).
    fn packed(
        rows: usize,
        cols: usize,
        kind: QKind,
        fill: impl Fn(usize, usize, usize, &mut [Line]) + Sync,
    ) -> IntMatrix {
        use rayon::prelude::*;
        let mut m = IntMatrix::zeroed(rows, cols, kind);
        let (nb, rl) = (cols / kind.block(), record_lines(kind));
        if nb > 0 {
            m.lines
                .par_chunks_mut(nb * rl)
                .enumerate()
                .for_each(|(g, group)| {
                    for r in g * GROUP..((g + 1) * GROUP).min(rows) {
                        for (b, rec) in group.chunks_exact_mut(rl).enumerate() {
                            fill(r, b, r % GROUP, rec);
                        }
                    }
                });
        }
        m
    }

    fn zeroed(rows: usize, cols: usize, kind: QKind) -> IntMatrix {
        let groups = rows.div_ceil(GROUP);
        let lines = groups * (cols / kind.block()) * record_lines(kind);
        IntMatrix {
            rows,
            cols,
            kind,
            lines: vec![Line([0; 64]); lines],
        }
    }

    fn record(&self, g: usize, b: usize) -> &[Line] {
        let rl = record_lines(self.kind);
        let nb = self.cols / self.kind.block();
        &self.lines[(g * nb + b) * rl..][..rl]
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn kind(&self) -> QKind {
        self.kind
    }

    /// Bytes held (the last group padded to 16 rows).
    pub fn bytes(&self) -> u64 {
        (self.lines.len() * 64) as u64
    }

    /// The quant of row `r`, value `k`: 0..=15 for Q4, −128..=127 for Q8.
    fn quant(&self, r: usize, k: usize) -> i32 {
        let bl = self.kind.block();
        let rec = self.record(r / GROUP, k / bl);
        let j = k % bl;
        let lane = r % GROUP;
        match self.kind {
            QKind::Q4 => {
                let byte = rec[(j % 16) / 4].0[lane * 4 + j % 4];
                (if j < 16 { byte & 15 } else { byte >> 4 }) as i32
            }
            QKind::Q8 { .. } => (rec[j / 4].0[lane * 4 + j % 4] ^ 0x80) as i8 as i32,
        }
    }

    /// (scale, min) of row `r`'s block `b` (min 0 for Q8).
    fn scale_min(&self, r: usize, b: usize) -> (f32, f32) {
        let rec = self.record(r / GROUP, b);
        let lane = r % GROUP;
        match self.kind {
            QKind::Q4 => (get_f32(&rec[4], lane), get_f32(&rec[5], lane)),
            QKind::Q8 { block } => (get_f32(&rec[block / 4], lane), 0.0),
        }
    }

    /// Row `r` as f32 into `out` (length `cols`): exactly the `dequantize_row` of the matrix it was
    /// packed from.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        assert!(r < self.rows, "row {r} of {}", self.rows);
        let bl = self.kind.block();
        for (k, o) in out.iter_mut().enumerate() {
            let (s, mn) = self.scale_min(r, k / bl);
            let q = self.quant(r, k) as f32;
            *o = match self.kind {
                QKind::Q4 => s * q + mn,
                QKind::Q8 { .. } => s * q,
            };
        }
    }
}

fn record_lines(kind: QKind) -> usize {
    match kind {
        QKind::Q4 => 6,
        QKind::Q8 { block } => block / 4 + 1,
    }
}

fn put_f32(line: &mut Line, lane: usize, v: f32) {
    line.0[lane * 4..lane * 4 + 4].copy_from_slice(&v.to_le_bytes());
}

fn get_f32(line: &Line, lane: usize) -> f32 {
    f32::from_le_bytes(line.0[lane * 4..lane * 4 + 4].try_into().unwrap())
}

/// How [`int_matmul`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntOptions {
    /// The AVX-512 VNNI kernel (it must be available: [`int_dot_available`]); false runs the portable
    /// twin, which gives the same bits.
    pub simd: bool,
    /// Split output rows over rayon's current pool.
    pub parallel: bool,
    /// A planted fault (tests of the gate).
    pub fault: Option<Fault>,
}

impl Default for IntOptions {
    fn default() -> Self {
        IntOptions {
            simd: int_dot_available(),
            parallel: true,
            fault: None,
        }
    }
}

/// Activations prepared for the integer kernels (see the module docs), for m rows of K.
#[derive(Default)]
pub(super) struct Acts {
    /// m·K high bytes xh and m·K low bytes xl (xi = 128·xh + xl).
    xh: Vec<i8>,
    xl: Vec<i8>,
    /// Per block of 32: the scale sx, and the f32 sum of the block's activations (Q4's min term).
    sx: Vec<f32>,
    sumx: Vec<f32>,
    /// 128·Σxi per 16 values (Q8's +128 offset; a block of 32 takes two).
    corr16: Vec<i32>,
}

thread_local! {
    static ACTS: Cell<Acts> = Cell::new(Acts::default());
}

/// Activation values prepared at most between calls before the buffers are let go (a long prompt).
const ACTS_KEEP: usize = 1 << 18;

impl Acts {
    fn prepare(&mut self, x: &[f32], eight_bit: bool, simd: bool) {
        let n = x.len();
        let nb = n / 32;
        self.xh.resize(n, 0);
        self.xl.resize(n, 0);
        self.sx.resize(nb, 0.0);
        self.sumx.resize(nb, 0.0);
        self.corr16.resize(2 * nb, 0);
        let top = if eight_bit { 127.0 } else { XI_MAX };
        for (b, blk) in x.chunks_exact(32).enumerate() {
            let (xh, xl) = (&mut self.xh[32 * b..][..32], &mut self.xl[32 * b..][..32]);
            #[cfg(target_arch = "x86_64")]
            let (sx, sumx, half) = if simd {
                // SAFETY: `simd` is only set where the instructions exist (checked by `int_matmul`);
                // the block and both byte rows hold 32 values.
                unsafe {
                    super::cpu_vnni::prepare_block(
                        blk.as_ptr(),
                        xh.as_mut_ptr(),
                        xl.as_mut_ptr(),
                        top,
                        eight_bit,
                    )
                }
            } else {
                prepare_block(blk, xh, xl, top, eight_bit)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let (sx, sumx, half) = {
                let _ = simd;
                prepare_block(blk, xh, xl, top, eight_bit)
            };
            self.sx[b] = if eight_bit { sx / 128.0 } else { sx };
            self.sumx[b] = sumx;
            self.corr16[2 * b] = 128 * half[0];
            self.corr16[2 * b + 1] = 128 * half[1];
        }
    }

    /// xi of flat index i.
    fn xi(&self, i: usize) -> i32 {
        128 * self.xh[i] as i32 + self.xl[i] as i32
    }
}

/// The scale of a block whose largest |value| is `amax` (`nan`: it holds a NaN), and its inverse: a
/// non-finite block gets a NaN scale, so its outputs are NaN as the f32 product's would be.
pub(super) fn block_scale(amax: f32, nan: bool, top: f32) -> (f32, f32) {
    if nan || !amax.is_finite() {
        (f32::NAN, 0.0)
    } else if amax > 0.0 {
        (amax / top, top / amax)
    } else {
        (0.0, 0.0)
    }
}

/// One block of 32 activations: xi = round(x / sx) split into xh and xl; returns (sx, Σx, Σxi of each
/// half). Σx is summed in a fixed tree (halves lane by lane, then halving), the order of the SIMD twin.
fn prepare_block(
    blk: &[f32],
    xh: &mut [i8],
    xl: &mut [i8],
    top: f32,
    eight_bit: bool,
) -> (f32, f32, [i32; 2]) {
    let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
    let (sx, inv) = block_scale(amax, blk.iter().any(|v| v.is_nan()), top);
    let mut half = [0i32; 2];
    for (j, &v) in blk.iter().enumerate() {
        let q = ((v * inv).round_ties_even().clamp(-top, top)) as i32;
        let xi = if eight_bit { 128 * q } else { q };
        xh[j] = (xi >> 7) as i8;
        xl[j] = (xi & 127) as i8;
        half[j / 16] += xi;
    }
    let mut t: [f32; 16] = std::array::from_fn(|i| blk[i] + blk[i + 16]);
    for w in [8, 4, 2, 1] {
        for i in 0..w {
            t[i] += t[i + w];
        }
    }
    (sx, t[0], half)
}

/// y = x · Wᵀ on the packed matrix: `x` is m×K row-major, `y` m×N row-major.
///
/// Panics if the lengths do not fit the shapes, or if `opts.simd` is set on a CPU without the
/// instructions (programmer errors).
pub fn int_matmul(x: &[f32], w: &IntMatrix, y: &mut [f32], m: usize, opts: IntOptions) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(
        x.len(),
        m * k,
        "int_matmul: x has {} elements, m×K = {m}×{k}",
        x.len()
    );
    assert_eq!(
        y.len(),
        m * n,
        "int_matmul: y has {} elements, m×N = {m}×{n}",
        y.len()
    );
    assert!(
        !opts.simd || int_dot_available(),
        "int_matmul: the SIMD kernel was requested but this CPU lacks AVX-512 VNNI"
    );
    if m == 0 || n == 0 {
        return;
    }
    let mut acts = ACTS.take();
    acts.prepare(x, opts.fault == Some(Fault::EightBitActivations), opts.simd);
    let yp = OutPtr(y.as_mut_ptr());
    let row_bytes = w.bytes() as usize / n.div_ceil(GROUP) / GROUP;
    let a = &acts;
    run_tiles(0..n, row_bytes, m, opts.parallel, yp, |n0, n1, yt| {
        debug_assert_eq!(n0 % GROUP, 0);
        #[cfg(target_arch = "x86_64")]
        if opts.simd {
            // SAFETY: the instructions are available (asserted above); x, y and the packed matrix
            // have the shapes checked above, and the tile's columns n0..n1 are its own.
            return unsafe { super::cpu_vnni::tile(a, w, m, n0, n1, yt, n) };
        }
        scalar_tile(a, w, m, n0, n1, yt, n)
    });
    if acts.xh.capacity() <= ACTS_KEEP {
        ACTS.set(acts);
    }
}

/// The portable twin: output columns n0..n1 (y at column n0), every row.
fn scalar_tile(a: &Acts, w: &IntMatrix, m: usize, n0: usize, n1: usize, y: OutPtr, ldy: usize) {
    let (k, bl) = (w.cols, w.kind.block());
    for i in 0..m {
        for r in n0..n1 {
            let mut acc = 0f32;
            for b in 0..k / bl {
                let k0 = b * bl;
                let mut dot = 0i32;
                for j in k0..k0 + bl {
                    dot += w.quant(r, j) * a.xi(i * k + j);
                }
                let (s, mn) = w.scale_min(r, b);
                let ab = (i * k + k0) / 32;
                acc = (dot as f32).mul_add(s * a.sx[ab], acc);
                if w.kind == QKind::Q4 {
                    acc = mn.mul_add(a.sumx[ab], acc);
                }
            }
            // SAFETY: row i, column r - n0 of this tile lies inside y (m×N, checked by the caller).
            unsafe { y.at(i * ldy + r - n0).0.write(acc) };
        }
    }
}

/// Raw views of the prepared activations for the SIMD kernel.
#[cfg(target_arch = "x86_64")]
pub(super) struct ActPtrs {
    pub xh: *const i8,
    pub xl: *const i8,
    pub sx: *const f32,
    pub sumx: *const f32,
    pub corr16: *const i32,
}

#[cfg(target_arch = "x86_64")]
impl Acts {
    pub(super) fn ptrs(&self) -> ActPtrs {
        ActPtrs {
            xh: self.xh.as_ptr(),
            xl: self.xl.as_ptr(),
            sx: self.sx.as_ptr(),
            sumx: self.sumx.as_ptr(),
            corr16: self.corr16.as_ptr(),
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl IntMatrix {
    /// Start of group g's records.
    pub(super) fn group_ptr(&self, g: usize) -> *const u8 {
        let nb = self.cols / self.kind.block();
        self.lines[g * nb * record_lines(self.kind)..]
            .as_ptr()
            .cast()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::matmul::quant::{quantize_q4, quantize_q8};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// The three layouts of one random matrix: Q4, Q8 blocks of 32 and of 16.
    fn matrices(rng: &mut ChaCha8Rng, n: usize, k: usize) -> Vec<(String, IntMatrix, Vec<f32>)> {
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let q4 = quantize_q4(&w, n, k);
        let q8 = quantize_q8(&w, n, k, 32);
        let q16 = quantize_q8(&w, n, k, 16);
        vec![
            (
                "q4".into(),
                IntMatrix::from_q4(&q4).unwrap(),
                q4.dequantize(),
            ),
            (
                "q8b32".into(),
                IntMatrix::from_q8(&q8).unwrap(),
                q8.dequantize(),
            ),
            (
                "q8b16".into(),
                IntMatrix::from_q8(&q16).unwrap(),
                q16.dequantize(),
            ),
        ]
    }

    /// Activations spread over several orders of magnitude, with a few outliers (as real hidden states).
    fn acts(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let v: f32 = rng.random_range(-1.0..1.0) * 10f32.powi(rng.random_range(-3..1));
                if i % 97 == 5 { v * 300.0 } else { v }
            })
            .collect()
    }

    fn run(x: &[f32], w: &IntMatrix, m: usize, simd: bool, parallel: bool) -> Vec<f32> {
        let mut y = vec![f32::NAN; m * w.rows()];
        let opts = IntOptions {
            simd,
            parallel,
            fault: None,
        };
        int_matmul(x, w, &mut y, m, opts);
        y
    }

    const SHAPES: &[(usize, usize)] = &[(16, 32), (37, 64), (5, 96), (300, 576), (64, 1536)];
    const MS: &[usize] = &[1, 2, 3, 5, 8, 9, 16, 17];

    /// The packed layout keeps every weight: its rows dequantize to the source's values exactly.
    #[test]
    fn packed_rows_dequantize_exactly() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for &(n, k) in SHAPES {
            for (what, w, dense) in matrices(&mut rng, n, k) {
                let mut row = vec![0f32; k];
                for r in 0..n {
                    w.dequantize_row(r, &mut row);
                    assert_eq!(row, dense[r * k..(r + 1) * k], "{what} {n}x{k} row {r}");
                }
            }
        }
    }

    /// The SIMD kernel and the portable twin give the same bits (exact integer sums, the same float
    /// steps), at every row count, with and without threads.
    #[test]
    fn simd_and_twin_agree_bit_for_bit() {
        if !int_dot_available() {
            eprintln!("no AVX-512 VNNI on this CPU: only the twin runs (the other tests)");
            return;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        for &(n, k) in SHAPES {
            for (what, w, _) in matrices(&mut rng, n, k) {
                for &m in MS {
                    let x = acts(&mut rng, m * k);
                    let twin = run(&x, &w, m, false, false);
                    for par in [false, true] {
                        let simd = run(&x, &w, m, true, par);
                        let same = simd
                            .iter()
                            .zip(&twin)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{what} {n}x{k} m={m} parallel={par}");
                    }
                }
            }
        }
    }

    /// Every row of a batch has the bits it has alone (what a server's batched decode relies on).
    #[test]
    fn rows_are_computed_as_alone() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (n, k, m) = (80, 576, 13);
        for (what, w, _) in matrices(&mut rng, n, k) {
            let x = acts(&mut rng, m * k);
            for simd in [false, int_dot_available()] {
                let all = run(&x, &w, m, simd, true);
                for i in 0..m {
                    let alone = run(&x[i * k..(i + 1) * k], &w, 1, simd, true);
                    assert_eq!(alone, all[i * n..(i + 1) * n], "{what} row {i} simd={simd}");
                }
            }
        }
    }

    /// Against exact (f64) math on the same dequantized weights: each output errs by at most what the
    /// rounding of the activations allows, Σ_b Σ_j |scale_b·q_j| · sx_b / 2 (Q4's min term uses the
    /// exact block sums), plus f32 rounding.
    #[test]
    fn error_is_bounded_by_the_activation_rounding() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        for &(n, k) in SHAPES {
            for (what, w, dense) in matrices(&mut rng, n, k) {
                let m = 3;
                let x = acts(&mut rng, m * k);
                let y = run(&x, &w, m, int_dot_available(), true);
                for i in 0..m {
                    let xr = &x[i * k..(i + 1) * k];
                    let sx: Vec<f64> = xr
                        .chunks(32)
                        .map(|b| b.iter().fold(0f64, |a, v| a.max(v.abs() as f64)) / 16383.0)
                        .collect();
                    for r in 0..n {
                        let wr = &dense[r * k..(r + 1) * k];
                        let exact: f64 =
                            wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let mag: f64 = wr
                            .iter()
                            .zip(xr)
                            .map(|(a, b)| (*a as f64 * *b as f64).abs())
                            .sum();
                        let bl = w.kind().block();
                        let mut bound = 0.0;
                        for j in 0..k {
                            let (s, _) = w.scale_min(r, j / bl);
                            bound += (s as f64 * w.quant(r, j) as f64).abs() * sx[j / 32] / 2.0;
                        }
                        let tol =
                            bound * 1.001 + (k as f64 / 16.0 + 64.0) * f32::EPSILON as f64 * mag;
                        let got = y[i * n + r] as f64;
                        assert!(
                            (got - exact).abs() <= tol,
                            "{what} {n}x{k} row {i} out {r}: {got} vs {exact} (bound {tol})"
                        );
                    }
                }
            }
        }
    }

    /// Eight-bit activations (the planted fault) err about 128 times more than the path's own.
    #[test]
    fn eight_bit_activations_are_much_coarser() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (n, k, m) = (64, 576, 2);
        for (what, w, dense) in matrices(&mut rng, n, k) {
            let x = acts(&mut rng, m * k);
            let err = |fault: Option<Fault>| {
                let mut y = vec![f32::NAN; m * n];
                let opts = IntOptions {
                    simd: int_dot_available(),
                    parallel: true,
                    fault,
                };
                int_matmul(&x, &w, &mut y, m, opts);
                let mut e = 0.0;
                for i in 0..m {
                    for r in 0..n {
                        let exact: f64 = (0..k)
                            .map(|j| dense[r * k + j] as f64 * x[i * k + j] as f64)
                            .sum();
                        e += (y[i * n + r] as f64 - exact).abs();
                    }
                }
                e
            };
            let (fine, coarse) = (err(None), err(Some(Fault::EightBitActivations)));
            assert!(
                coarse > 30.0 * fine,
                "{what}: 15-bit error {fine}, 8-bit {coarse}"
            );
        }
    }

    /// A NaN or an infinity in a row makes that row's outputs NaN (as the f32 product's would be non-
    /// finite), and leaves the other rows alone.
    #[test]
    fn non_finite_activations_poison_only_their_row() {
        let mut rng = ChaCha8Rng::seed_from_u64(6);
        let (n, k) = (32, 64);
        for bad in [f32::NAN, f32::INFINITY] {
            for (what, w, _) in matrices(&mut rng, n, k) {
                let mut x = acts(&mut rng, 2 * k);
                x[40] = bad;
                for simd in [false, int_dot_available()] {
                    let y = run(&x, &w, 2, simd, false);
                    assert!(
                        y[..n].iter().all(|v| v.is_nan()),
                        "{what} {bad} simd={simd}"
                    );
                    assert!(
                        y[n..].iter().all(|v| v.is_finite()),
                        "{what} {bad} simd={simd}"
                    );
                }
            }
        }
    }

    #[test]
    fn shapes_the_layout_cannot_hold_are_refused() {
        assert!(packable(QKind::Q4, 48).is_err());
        assert!(packable(QKind::Q8 { block: 16 }, 16).is_err());
        assert!(packable(QKind::Q8 { block: 16 }, 64).is_ok());
        let w = quantize_q8(&[0.5; 16 * 16], 16, 16, 16);
        assert!(IntMatrix::from_q8(&w).is_none());
    }
}
