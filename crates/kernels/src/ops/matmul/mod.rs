//! Matrix products, all of them: C = alpha · op(A) · op(B) + beta · C in the four layouts (A·B, A·Bᵀ,
//! Aᵀ·B, Aᵀ·Bᵀ), any size, with a two-level batch of strided matrices, and B in one of three storage
//! formats ([`Weights`]): f32, f16 pairs, or block-quantized. This folder holds every kernel of the family
//! and its CPU twin; [`choose`] is the one function that picks the kernel of a product, from its shape,
//! B's format, the device and the [`PathSet`] the caller holds.
//!
//! ```text
//!   cpu.rs        the CPU twin (the `gemm` crate) and the f64 reference the tests hold both against
//!   tiled.rs      the tiled GEMM (f32, or f16 weights, optionally f16 operands)        every layout
//!   gemv.rs       the decode kernel (m <= 8 rows of x · Wᵀ), optionally with subgroups
//!   f16.rs        packing weights into f16 pairs (the f16-storage path's format)
//!   coop.rs       x · Wᵀ on the tensor cores (cooperative matrices, f16 weights)
//!   quant/        x · Wᵀ from block-quantized weights: CPU (AVX-512, AVX2, portable) and WGSL kernels
//! ```
//!
//! Storage is row-major with leading dimensions: op(A) is M x K, stored as M x K (`lda` >= K) or, when
//! `trans_a`, as K x M (`lda` >= M); likewise op(B) is K x N, stored as K x N or N x K. C is M x N with
//! `ldc` >= N. Batch entry (z1, z2) of each operand starts `z1 * stride1 + z2 * stride2` elements after
//! its view's offset.
//!
//! Tensors split across buffers (larger than one binding) are handled by splitting the product: along M
//! (rows of A and C), N (rows of a transposed B) and K (accumulating the partial products into C).

mod coop;
mod cpu;
mod f16;
pub mod fused;
mod gemv;
pub mod quant;
mod tiled;

use crate::backend::{Backend, TMut, TRef, Tensor};
use crate::error::{self, Error, Result};
use crate::gpu::{Access, GpuBackend, GpuTensor};
use crate::path::{Fault, PathId, PathSet};
use coop::EpilogueArgs;
pub(crate) use coop::mixed_tiles;
pub use coop::{Epilogue, MixedTile, Operands, Storage, f16_operands_suit};
pub use cpu::gemm_reference;
pub use f16::{pack_f16, packed_len, unpack_f16, unpack_f16_to};
pub(crate) use f16::{pack_f16_of, pairs_in_one_pass};
pub use quant::{QKind, QMatrix, QuantSource, get_rows};
pub use tiled::Tile;
use tiled::{GemmOpts, gemm_source};

/// Shape and layout of one (batched) product.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    /// Batch counts (outer, inner); `[1, 1]` for a single product.
    pub batch: [usize; 2],
    pub stride_a: [usize; 2],
    pub stride_b: [usize; 2],
    pub stride_c: [usize; 2],
    pub alpha: f32,
    /// 0 overwrites C, 1 accumulates into it.
    pub beta: f32,
    /// Whether rows may share work (see [`RowMode`]).
    pub rows: RowMode,
    /// A causal structure the kernels may skip work by (see [`Causal`]).
    pub causal: Causal,
}

/// Where a product of causal attention has nothing to compute, within each matrix of a batch (row i,
/// column j or step kk of the sum). A kernel may skip that work or do it: the values it writes are the
/// same either way, as the skipped terms are exact zeros (attention's masked probabilities and their
/// gradients). The f32 and tensor-core tiled kernels skip whole tiles and k-steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Causal {
    #[default]
    None,
    /// Only C's lower triangle (j ≤ i) is wanted: the rest may be left unwritten (the scores Q·Kᵀ and
    /// their gradient dY·Vᵀ, which the causal softmax never reads above the diagonal).
    Output,
    /// op(A) is lower-triangular, zero where kk > i (P·V, dS·K).
    ALower,
    /// op(A) is upper-triangular, zero where kk < i (Pᵀ·dY, dSᵀ·Q).
    AUpper,
}

/// How the rows of a product relate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RowMode {
    /// Rows may share work: the fastest kernels for the shape (weights unpacked once for several rows,
    /// tiles), whose per-row rounding can depend on how many rows there are.
    #[default]
    Shared,
    /// Every row of C is computed exactly as it would be alone (m = 1), bit for bit, whatever the other
    /// rows: what a server's batched decode needs, so a request's text does not depend on its
    /// neighbours. Weights are still read from memory once for all rows.
    Independent,
}

impl Gemm {
    fn new(m: usize, n: usize, k: usize, trans_a: bool, trans_b: bool) -> Self {
        Gemm {
            m,
            n,
            k,
            trans_a,
            trans_b,
            lda: if trans_a { m } else { k },
            ldb: if trans_b { k } else { n },
            ldc: n,
            batch: [1, 1],
            stride_a: [0, 0],
            stride_b: [0, 0],
            stride_c: [0, 0],
            alpha: 1.0,
            beta: 0.0,
            rows: RowMode::Shared,
            causal: Causal::None,
        }
    }
    /// C[M,N] = A[M,K] · B[K,N].
    pub fn nn(m: usize, n: usize, k: usize) -> Self {
        Self::new(m, n, k, false, false)
    }
    /// C[M,N] = A[M,K] · B[N,K]ᵀ (a linear layer's forward pass, y = x·Wᵀ).
    pub fn nt(m: usize, n: usize, k: usize) -> Self {
        Self::new(m, n, k, false, true)
    }
    /// C[M,N] = A[K,M]ᵀ · B[K,N] (a weight gradient, dW = dYᵀ·X).
    pub fn tn(m: usize, n: usize, k: usize) -> Self {
        Self::new(m, n, k, true, false)
    }
    /// C[M,N] = A[K,M]ᵀ · B[N,K]ᵀ.
    pub fn tt(m: usize, n: usize, k: usize) -> Self {
        Self::new(m, n, k, true, true)
    }
    pub fn lda(mut self, v: usize) -> Self {
        self.lda = v;
        self
    }
    pub fn ldb(mut self, v: usize) -> Self {
        self.ldb = v;
        self
    }
    pub fn ldc(mut self, v: usize) -> Self {
        self.ldc = v;
        self
    }
    pub fn alpha(mut self, v: f32) -> Self {
        self.alpha = v;
        self
    }
    /// Computes every row exactly as it would be computed alone ([`RowMode::Independent`]).
    pub fn independent_rows(mut self) -> Self {
        self.rows = RowMode::Independent;
        self
    }
    /// Declares the product's causal structure (see [`Causal`]).
    pub fn causal(mut self, c: Causal) -> Self {
        self.causal = c;
        self
    }
    /// Adds the product to C instead of overwriting it.
    pub fn accumulate(mut self) -> Self {
        self.beta = 1.0;
        self
    }
    /// A batch of `counts[0] x counts[1]` products with the given per-operand strides.
    pub fn batched(
        mut self,
        counts: [usize; 2],
        stride_a: [usize; 2],
        stride_b: [usize; 2],
        stride_c: [usize; 2],
    ) -> Self {
        self.batch = counts;
        self.stride_a = stride_a;
        self.stride_b = stride_b;
        self.stride_c = stride_c;
        self
    }

    pub(crate) fn batches(&self) -> usize {
        self.batch[0] * self.batch[1]
    }

    /// Elements of A, B and C the product touches, counted from each view's offset (last index + 1).
    pub fn extents(&self) -> [usize; 3] {
        let last = |rows: usize, cols: usize, ld: usize, s: [usize; 2]| {
            if rows == 0 || cols == 0 || self.batches() == 0 {
                0
            } else {
                (self.batch[0] - 1) * s[0] + (self.batch[1] - 1) * s[1] + (rows - 1) * ld + cols
            }
        };
        let (ar, ac) = if self.trans_a {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        };
        let (br, bc) = if self.trans_b {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        };
        [
            last(ar, ac, self.lda, self.stride_a),
            last(br, bc, self.ldb, self.stride_b),
            last(self.m, self.n, self.ldc, self.stride_c),
        ]
    }

    /// Products of f16 or quantized weights: f16 rows of even length; quantized weights with
    /// contiguous rows and the matrix's own shape. With `nt` (quantized weights, and the kernels that
    /// take f16 weights in x·Wᵀ only), x·Wᵀ products (Gemm::nt), unbatched.
    fn validate_weights(&self, b: &Weights<'_>, nt: bool) -> Result<()> {
        let bad = |msg: String| Err(Error::Shape { op: "matmul", msg });
        if nt && (self.trans_a || !self.trans_b || self.batches() != 1) {
            return bad(
                "f16 and quantized weights serve x·Wᵀ products (Gemm::nt), unbatched".into(),
            );
        }
        match b {
            Weights::F16(_) if !self.ldb.is_multiple_of(2) => {
                bad("f16 weights need an even row length (ldb)".into())
            }
            Weights::Quant(q)
                if self.n != q.rows()
                    || self.k != q.cols()
                    || self.lda != self.k
                    || self.ldc != self.n
                    || self.alpha != 1.0
                    || self.beta != 0.0 =>
            {
                bad(format!(
                    "a {} x {} quantized matrix multiplies x[m, {}] into y[m, {}] with contiguous rows \
                     (got n {}, k {}, lda {}, ldc {}, alpha {}, beta {})",
                    q.rows(),
                    q.cols(),
                    q.cols(),
                    q.rows(),
                    self.n,
                    self.k,
                    self.lda,
                    self.ldc,
                    self.alpha,
                    self.beta
                ))
            }
            _ => Ok(()),
        }
    }

    fn validate(&self) -> Result<()> {
        let (ac, bc) = (
            if self.trans_a { self.m } else { self.k },
            if self.trans_b { self.k } else { self.n },
        );
        let bad = |msg: String| Err(Error::Shape { op: "matmul", msg });
        if self.lda < ac || self.ldb < bc || self.ldc < self.n {
            return bad(format!(
                "leading dimensions too small: lda {} (needs >= {ac}), ldb {} (needs >= {bc}), ldc {} (needs >= {})",
                self.lda, self.ldb, self.ldc, self.n
            ));
        }
        if !self.alpha.is_finite() || !self.beta.is_finite() {
            return bad("alpha and beta must be finite".into());
        }
        Ok(())
    }
}

/// The CPU twin on host slices, C = alpha · op(A) op(B) + beta · C: the canonical f32 result (each
/// slice from its view's offset).
pub fn cpu_gemm(a: &[f32], b: &[f32], c: &mut [f32], g: &Gemm) {
    cpu::gemm(a, b, c, g)
}

/// The right-hand operand B of a product, in one of its storage formats.
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    /// f32 elements, in any layout the [`Gemm`] describes.
    F32(TRef<'a>),
    /// f16 values packed two per u32 word ([`pack_f16`]): the view starts at a word, and `ldb` and
    /// B's batch strides count f16 elements (even). The decode and inference tensor-core kernels take
    /// them in x · Wᵀ products only; the tiled and training kernels and the CPU twin in any layout.
    F16(TRef<'a>),
    /// A block-quantized matrix, for x · Wᵀ with contiguous rows (`Gemm::nt(m, rows, cols)`).
    Quant(&'a QMatrix),
}

impl<'a> From<TRef<'a>> for Weights<'a> {
    fn from(t: TRef<'a>) -> Self {
        Weights::F32(t)
    }
}

impl<'a> From<&'a Tensor> for Weights<'a> {
    fn from(t: &'a Tensor) -> Self {
        Weights::F32(t.into())
    }
}

impl<'a> From<&'a QMatrix> for Weights<'a> {
    fn from(m: &'a QMatrix) -> Self {
        Weights::Quant(m)
    }
}

/// The kernel one product runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// The CPU twin (on the CPU backend, for every format).
    Cpu,
    /// C = beta · C: an empty sum (K = 0).
    Scale,
    /// The decode kernel: up to 8 rows of x · Wᵀ, every operand in one buffer.
    Gemv { shader_f16: bool, subgroups: bool },
    /// The tiled kernel (every layout, split tensors); `direct`: its barrier-free form, for CPU-type
    /// adapters (the same sums, see [`GemmOpts::direct`]).
    Tiled {
        tile: Tile,
        shader_f16: bool,
        direct: bool,
    },
    /// The tiled kernel over `splits` slices of K at once (a product whose few output tiles would
    /// leave most of the device idle through a long K: training's weight gradients), then one kernel
    /// adding the slices: f32 data, every operand in one buffer.
    SplitK { splits: usize, mixed: bool },
    /// Tensor cores: x · Wᵀ with f16 weights, every operand in one buffer.
    Coop,
    /// Tensor cores with f32 operands rounded to f16 in workgroup memory (or f16 weights staged as they
    /// are), f32 accumulation: any layout, batched, every operand in one buffer (the tensor-core
    /// training path), on one tile shape.
    CoopMixed(MixedTile),
    /// Straight from the quantized blocks.
    Quant,
    /// Straight from the quantized blocks, every row that is not computed alone on the tensor cores
    /// (f16-rounded operands, f32 accumulation: the `tc-prompt` path).
    QuantCoop,
}

/// A kernel and, in tests, the planted fault it is built with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    pub kernel: Kernel,
    fault: Option<Fault>,
}

impl Choice {
    /// `kernel`, built with the planted fault of `paths` if it has one (the gates force kernels this way).
    pub fn forced(kernel: Kernel, paths: PathSet) -> Self {
        Choice {
            kernel,
            fault: paths.fault(),
        }
    }
}

/// Picks the kernel of the product `g` with B = `b`: the one function that decides, from the shape, B's
/// format, the device and the fast paths the caller holds. With [`PathSet::F32`] it is always a canonical
/// f32 kernel (the CPU twin, the tiled or decode kernel on f32 data, or the scale-only kernel).
pub fn choose(
    be: &Backend,
    a: TRef<'_>,
    b: Weights<'_>,
    c: &TMut<'_>,
    g: &Gemm,
    paths: PathSet,
) -> Choice {
    let kernel = match be {
        Backend::Cpu(_) => Kernel::Cpu,
        Backend::Gpu(gb) => {
            let (bt, f16) = match b {
                Weights::F32(t) => (t.tensor(), false),
                Weights::F16(t) => (t.tensor(), true),
                Weights::Quant(q) => match q.dense() {
                    None if paths.has(PathId::CoopQuant)
                        && g.m >= quant::GEMM_MIN_ROWS
                        && g.rows != RowMode::Independent =>
                    {
                        return Choice::forced(Kernel::QuantCoop, paths);
                    }
                    None => return Choice::forced(Kernel::Quant, paths),
                    Some(t) => (t, false),
                },
            };
            let single = [a.tensor(), bt, c.tensor()]
                .iter()
                .all(|t| t.gpu().is_some_and(|g| g.num_chunks() == 1));
            let shader_f16 = f16 && paths.has(PathId::ShaderF16);
            if g.k == 0 {
                Kernel::Scale
            } else if f16 && single && paths.has(PathId::CoopMatrix) && coop::suits(g) {
                Kernel::Coop
            } else if single
                && (g.m <= 8 || g.rows == RowMode::Independent)
                && g.batches() == 1
                && !g.trans_a
                && g.trans_b
            {
                // The decode kernel computes each row alone; independent rows take it in groups of 8.
                Kernel::Gemv {
                    shader_f16,
                    subgroups: paths.has(PathId::Subgroups),
                }
            } else if single && paths.has(PathId::MixedTraining) {
                // Training's products with f16 operands: on the tensor cores where the adapter has
                // them (the path's gate requires it outside tests), else the tiled kernel's f16-operand
                // form; long-K products (weight gradients) split over slices of K either way. f16
                // operands (weights packed once a step, activations written as f16) are staged as they
                // are stored.
                let operands = Operands::of(Storage::F32, Storage::of(f16));
                let coop = gb.has_feature(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
                    && coop::mixed_suits(g)
                    && operands.suit(g);
                match training_splits(gb, g, operands) {
                    Some(splits) => Kernel::SplitK {
                        splits,
                        mixed: true,
                    },
                    None if coop => Kernel::CoopMixed(coop::mixed_tile(gb, g)),
                    None => Kernel::Tiled {
                        tile: choose_tile(g),
                        shader_f16: true,
                        direct: false,
                    },
                }
            } else if let (true, false, Some(splits)) = (single, f16, split_k(gb, g)) {
                Kernel::SplitK {
                    splits,
                    mixed: false,
                }
            } else if gb.is_software() && !shader_f16 {
                // A software adapter: the barrier-free form, on small tiles (it has few cores to fill).
                Kernel::Tiled {
                    tile: TILE_SMALL,
                    shader_f16,
                    direct: true,
                }
            } else {
                Kernel::Tiled {
                    tile: choose_tile(g),
                    shader_f16,
                    direct: false,
                }
            }
        }
    };
    Choice::forced(kernel, paths)
}

/// C = alpha · A · op(B) + beta · C on the kernel [`choose`] picks for `paths`.
pub fn matmul<'a>(
    be: &Backend,
    paths: PathSet,
    a: TRef<'_>,
    b: impl Into<Weights<'a>>,
    c: TMut<'_>,
    g: &Gemm,
) -> Result<()> {
    let b = b.into();
    let choice = choose(be, a, b, &c, g, paths);
    run(be, choice, a, b, c, g)
}

/// C = alpha · op(A) op(B) + beta · C with both operands f16, packed two per u32 word ([`pack_f16`];
/// each view starts at a word, `g`'s extents, leading dimensions and batch strides count f16 elements
/// and are even: [`f16_operands_suit`]), summed in f32: on the tensor-core training kernel (`tile`, or the one
/// [`MixedTile`] the product would take), or the CPU twin. The values are those the f32-operand
/// tensor-core kernel stages from f32 operands that round to them.
pub fn matmul_f16_operands(
    be: &Backend,
    a: TRef<'_>,
    b: TRef<'_>,
    mut c: TMut<'_>,
    g: &Gemm,
    tile: Option<MixedTile>,
) -> Result<()> {
    g.validate()?;
    let [ea, eb, ec] = g.extents();
    if !f16_operands_suit(g) {
        return Err(error::shape(
            "matmul_f16_operands",
            "f16 operands need even extents, leading dimensions and batch strides",
        ));
    }
    match be {
        Backend::Cpu(cb) => {
            let av = unpack_f16(a.cpu_u32("matmul", "A", packed_len(ea))?, ea);
            let bv = unpack_f16(b.cpu_u32("matmul", "B", packed_len(eb))?, eb);
            let c = c.cpu("matmul", "C", ec)?;
            cb.install(|| cpu::gemm_rows(&av, &bv, c, g));
            Ok(())
        }
        Backend::Gpu(gb) => {
            if !gb.has_feature(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
                || !coop::mixed_suits(g)
            {
                return Err(error::shape(
                    "matmul_f16_operands",
                    "f16 operands run on the tensor cores: this adapter has no cooperative \
                     matrices, or the product is smaller than one fragment",
                ));
            }
            let ta = a.gpu("matmul", "A", packed_len(ea))?;
            let tb = b.gpu("matmul", "B", packed_len(eb))?;
            let tc = c.gpu("matmul", "C", ec)?;
            let tile = tile.unwrap_or_else(|| coop::mixed_tile(gb, g));
            coop::matmul_coop_mixed(
                gb,
                (ta, 2 * a.offset()),
                (tb, 2 * b.offset()),
                (tc, c.offset()),
                g,
                tile,
                coop::Operands::F16,
                None,
            )
        }
    }
}

/// The fault a planted fault of the path set becomes in the product `g`.
fn product_fault(fault: Option<Fault>, g: &Gemm) -> Option<Fault> {
    match fault {
        // Planted in weight gradients (Aᵀ·B) only, where it becomes f16 accumulators.
        Some(Fault::WeightGradF16Accumulation) => g.trans_a.then_some(Fault::F16Accumulation),
        // Not a product's fault.
        Some(Fault::CausalMaskPast128) => None,
        f => f,
    }
}

/// C = alpha · op(A) op(B) + beta · C with A stored as f16 pairs ([`pack_f16`]; its view starts at a
/// word, and `g`'s extents, lda and batch strides count f16 elements) and B in either f32 or f16:
/// training's products whose input a producer wrote as f16 for the tensor cores (the norms' and the
/// MLP's activations, the gradients at the products' outputs). With the tensor-core training path on
/// an adapter with cooperative matrices the training kernel stages both operands as they are stored
/// (long-K products split over slices of K as [`matmul`] splits them, where each slice's K is even);
/// elsewhere A's values are unpacked into scratch and the product runs as [`matmul`] runs it. The
/// values are the same either way.
pub fn matmul_f16_a<'a>(
    be: &Backend,
    paths: PathSet,
    a: TRef<'_>,
    b: impl Into<Weights<'a>>,
    c: TMut<'_>,
    g: &Gemm,
) -> Result<()> {
    g.validate()?;
    let b = b.into();
    if coop_f16_a(be, paths, a, b, &c, g, Storage::F32, None)? {
        return Ok(());
    }
    let ea = g.extents()[0];
    // Elsewhere: A's values as f32, then the product as `matmul` picks it.
    let mut wide = be.scratch("matmul_f16_a", ea, 1)?;
    unpack_f16_to(be, a, (&mut wide).into(), ea)?;
    matmul(be, paths, (&wide).into(), b, c, g)
}

/// [`matmul_f16_a`] with C written as f16 pairs: `c` views packed words, and `g`'s ldc and batch
/// strides count f16 values from the view's first word. Each value is the f32 one [`matmul_f16_a`]
/// writes, rounded as [`pack_f16`] rounds it: for a C that only the tensor-core training products
/// read (they stage those same values), in half the bytes. `g.beta` must be 0 on the tensor cores;
/// elsewhere (and where the layout does not suit them) C's pairs are unpacked, the product runs as
/// [`matmul_f16_a`] runs it, and the pairs are packed again (values outside the product's matrices
/// keep theirs).
pub fn matmul_f16_a_to_pairs<'a>(
    be: &Backend,
    paths: PathSet,
    a: TRef<'_>,
    b: impl Into<Weights<'a>>,
    c: TMut<'_>,
    g: &Gemm,
) -> Result<()> {
    g.validate()?;
    let b = b.into();
    if coop_f16_a(be, paths, a, b, &c, g, Storage::F16, None)? {
        return Ok(());
    }
    let ec = g.extents()[2];
    let mut wide = be.scratch("matmul_f16_c", ec, 1)?;
    unpack_f16_to(be, c.as_ref(), (&mut wide).into(), ec)?;
    matmul_f16_a(be, paths, a, b, (&mut wide).into(), g)?;
    pack_f16(be, (&wide).into(), c, ec)
}

/// The MLP's c_fc product and its GELU in one, for the tensor-core training path: `pre` = A · op(B)
/// (f32, the values [`matmul_f16_a`] writes) and `act` = GELU(pre) as f16 pairs (the values
/// [`gelu_f16`](crate::ops::gelu::gelu_f16) writes from them), A stored as f16 pairs. C is dense
/// (ldc = n) and unbatched; `act` holds pairs laid out as `pre`. On the tensor cores one product
/// writes both ([`Epilogue::Gelu`]: `pre` is not read back), where the path is held, the adapter has
/// cooperative matrices and the layout suits the kernel; elsewhere the product, then the GELU.
pub fn matmul_f16_a_gelu<'a>(
    be: &Backend,
    paths: PathSet,
    a: TRef<'_>,
    b: impl Into<Weights<'a>>,
    mut pre: TMut<'_>,
    act: TMut<'_>,
    g: &Gemm,
) -> Result<()> {
    let n = dense_extent(g, "matmul_f16_a_gelu")?;
    let b = b.into();
    let e = epilogue_args(be, Epilogue::Gelu, act.as_ref(), n, [0; 3])?;
    if coop_f16_a(be, paths, a, b, &pre, g, Storage::F32, e)? {
        return Ok(());
    }
    matmul_f16_a(be, paths, a, b, pre.reborrow(), g)?;
    crate::ops::gelu::gelu_f16(be, pre.as_ref(), act, n)
}

/// The gradient at c_fc's output from mlp_proj's dX product, for the tensor-core training path:
/// `dpre` = (A · op(B)) · GELU'(`pre`) as f16 pairs, the values
/// [`gelu_backward_f16`](crate::ops::gelu::gelu_backward_f16) writes from the f32 product
/// [`matmul_f16_a`] writes, A stored as f16 pairs. C is dense (ldc = n) and unbatched; `pre` (f32)
/// and `dpre` (pairs) are laid out as C. On the tensor cores one product ([`Epilogue::GeluGrad`]);
/// elsewhere the product into scratch, then the GELU's backward.
pub fn matmul_f16_a_gelu_backward<'a>(
    be: &Backend,
    paths: PathSet,
    a: TRef<'_>,
    b: impl Into<Weights<'a>>,
    pre: TRef<'_>,
    dpre: TMut<'_>,
    g: &Gemm,
) -> Result<()> {
    let n = dense_extent(g, "matmul_f16_a_gelu_backward")?;
    let b = b.into();
    let e = epilogue_args(be, Epilogue::GeluGrad, pre, n, [0; 3])?;
    if coop_f16_a(be, paths, a, b, &dpre, g, Storage::F16, e)? {
        return Ok(());
    }
    let mut wide = be.scratch("matmul_gelu", n, 1)?;
    matmul_f16_a(be, paths, a, b, (&mut wide).into(), g)?;
    crate::ops::gelu::gelu_backward_f16(be, pre, (&wide).into(), dpre, n)
}

/// A projection's branch joining the residual stream, for the tensor-core training path: `out` =
/// `residual` + dropout(A · op(B)) with drop probability `p` under `seed` (the values
/// [`dropout_add`](crate::ops::dropout::dropout_add) writes from the f32 product [`matmul_f16_a`]
/// writes, its mask drawn over C's m · n elements), A stored as f16 pairs. C is dense (ldc = n) and
/// unbatched; `residual` is laid out as C. On the tensor cores one product
/// ([`Epilogue::DropoutAdd`]); elsewhere the product into scratch, then the dropout and the sum.
#[allow(clippy::too_many_arguments)]
pub fn matmul_f16_a_dropout_add<'a>(
    be: &Backend,
    paths: PathSet,
    a: TRef<'_>,
    b: impl Into<Weights<'a>>,
    residual: TRef<'_>,
    out: TMut<'_>,
    g: &Gemm,
    (p, seed): (f32, u32),
) -> Result<()> {
    let n = dense_extent(g, "matmul_f16_a_dropout_add")?;
    crate::ops::dropout::check_probability("matmul_f16_a_dropout_add", p)?;
    let b = b.into();
    let e = epilogue_args(
        be,
        Epilogue::DropoutAdd,
        residual,
        n,
        crate::ops::dropout::mask_params(p, seed),
    )?;
    if coop_f16_a(be, paths, a, b, &out, g, Storage::F32, e)? {
        return Ok(());
    }
    let mut wide = be.scratch("matmul_dropout", n, 1)?;
    matmul_f16_a(be, paths, a, b, (&mut wide).into(), g)?;
    crate::ops::dropout::dropout_add(be, residual, (&wide).into(), out, n, p, seed)
}

/// The epilogue `epi` on E (`n` values as stored: f16 pairs or f32, [`Epilogue::e_pairs`]) on a GPU
/// backend; `None` elsewhere, where the fused ops' fallback runs. `dropout`: the dropout epilogue's
/// mask parameters (zeros for the others).
fn epilogue_args<'t>(
    be: &Backend,
    epi: Epilogue,
    e: TRef<'t>,
    n: usize,
    dropout: [u32; 3],
) -> Result<Option<EpilogueArgs<'t>>> {
    let Backend::Gpu(_) = be else {
        return Ok(None);
    };
    let (len, offset) = match epi.e_pairs() {
        true => (packed_len(n), 2 * e.offset()),
        false => (n, e.offset()),
    };
    Ok(Some(EpilogueArgs {
        epi,
        e: e.gpu("matmul", "E", len)?,
        offset,
        dropout,
    }))
}

/// The elements of `g`'s C where it is dense (ldc = n) and unbatched, as the fused products'
/// element-wise halves take it (validated).
fn dense_extent(g: &Gemm, op: &'static str) -> Result<usize> {
    g.validate()?;
    if g.ldc != g.n || g.batches() != 1 {
        return Err(Error::Shape {
            op,
            msg: "the product's C must be dense (ldc = n) and unbatched".into(),
        });
    }
    Ok(g.m * g.n)
}

/// [`matmul_f16_a`]'s and [`matmul_f16_a_to_pairs`]'s product on the tensor-core training kernel (C
/// stored as `c_store`), where the path is held, the adapter has cooperative matrices and the layout
/// suits the kernel: long-K products with an f32 C split over slices of K as [`matmul`] splits them.
/// With `e` the product ends with its [`Epilogue`], in one product. `Ok(false)`: not run here (the
/// caller's fallback runs it).
#[allow(clippy::too_many_arguments)]
fn coop_f16_a(
    be: &Backend,
    paths: PathSet,
    a: TRef<'_>,
    b: Weights<'_>,
    c: &TMut<'_>,
    g: &Gemm,
    c_store: Storage,
    e: Option<EpilogueArgs<'_>>,
) -> Result<bool> {
    let (Backend::Gpu(gb), Weights::F32(bv) | Weights::F16(bv)) = (be, b) else {
        return Ok(false);
    };
    let [ea, eb, ec] = g.extents();
    let b_f16 = matches!(b, Weights::F16(_));
    let operands = Operands {
        c: c_store,
        ..Operands::of(Storage::F16, Storage::of(b_f16))
    };
    let c_f16 = c_store == Storage::F16;
    let oc = if c_f16 { 2 * c.offset() } else { c.offset() };
    let epi_fits = e.is_none_or(|e| e.fits(g, oc, c_store));
    let coop = paths.has(PathId::MixedTraining)
        && gb.has_feature(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
        && coop::mixed_suits(g)
        && operands.suit(g)
        && epi_fits;
    let ta = a.gpu("matmul", "A", packed_len(ea))?;
    let tb = bv.gpu("matmul", "B", if b_f16 { packed_len(eb) } else { eb })?;
    let tc = c.gpu("matmul", "C", if c_f16 { packed_len(ec) } else { ec })?;
    if !coop || [ta, tb, tc].iter().any(|t| t.num_chunks() != 1) {
        return Ok(false);
    }
    let ob = if b_f16 { 2 * bv.offset() } else { bv.offset() };
    let (a, b, c) = ((ta, 2 * a.offset()), (tb, ob), (tc, oc));
    let fault = product_fault(paths.fault(), g);
    // Slices of K sum in f32 scratch, so a C of pairs, or an epilogue, takes the whole of K in one
    // product.
    let whole_k = c_f16 || e.is_some();
    if let (false, Some(splits)) = (whole_k, training_splits(gb, g, operands)) {
        gpu_split_k(gb, a, b, c, g, splits, true, operands, fault)?;
    } else {
        let tile = coop::mixed_tile(gb, g);
        coop::matmul_coop_epilogue(gb, a, b, c, e, g, tile, operands, fault)?;
    }
    Ok(true)
}

/// Runs the product on the kernel `choice` names (benchmarks compare tiles this way; gates force the
/// kernel of the path they check). The kernel must suit the backend and B's format.
pub fn run(
    be: &Backend,
    choice: Choice,
    a: TRef<'_>,
    b: Weights<'_>,
    mut c: TMut<'_>,
    g: &Gemm,
) -> Result<()> {
    g.validate()?;
    let [ea, eb, ec] = g.extents();
    // The decode and inference tensor-core kernels take f16 weights in x·Wᵀ products only; the tiled
    // kernel, the training kernel and the CPU twin take them in any layout.
    let nt = matches!(b, Weights::Quant(_))
        || matches!(choice.kernel, Kernel::Gemv { .. } | Kernel::Coop);
    if !matches!(b, Weights::F32(_)) {
        g.validate_weights(&b, nt)?;
    }
    let fault = product_fault(choice.fault, g);
    match (be, b, choice.kernel) {
        (Backend::Cpu(cb), b, Kernel::Cpu) => {
            let a = a.cpu("matmul", "A", ea)?;
            let c = c.cpu("matmul", "C", ec)?;
            match b {
                Weights::F32(b) => {
                    let b = b.cpu("matmul", "B", eb)?;
                    cb.install(|| cpu::gemm_rows(a, b, c, g));
                }
                Weights::F16(b) => {
                    let w = unpack_f16(b.cpu_u32("matmul", "B", packed_len(eb))?, eb);
                    cb.install(|| cpu::gemm_rows(a, &w, c, g));
                }
                Weights::Quant(q) => q.cpu_matmul(cb, a, c, g.m, g.rows, fault)?,
            }
            Ok(())
        }
        (Backend::Gpu(gb), Weights::Quant(q), k @ (Kernel::Quant | Kernel::QuantCoop)) => {
            let tx = a.gpu("matmul", "A", ea)?;
            let ty = c.gpu("matmul", "C", ec)?;
            let (x, y) = ((tx, a.offset()), (ty, c.offset()));
            q.gpu_matmul(gb, x, y, g.m, g.rows, fault, k == Kernel::QuantCoop)
        }
        (Backend::Gpu(_), Weights::Quant(q), k) => match q.dense() {
            Some(t) => run(be, Choice { kernel: k, fault }, a, t.into(), c, g),
            None => Err(Error::Shape {
                op: "matmul",
                msg: format!("kernel {k:?} cannot read a matrix held as quantized blocks"),
            }),
        },
        (Backend::Gpu(gb), b, k) => {
            let (bv, f16) = match b {
                Weights::F32(t) => (t, false),
                Weights::F16(t) => (t, true),
                Weights::Quant(_) => unreachable!("handled above"),
            };
            let ta = a.gpu("matmul", "A", ea)?;
            let tb = bv.gpu("matmul", "B", if f16 { packed_len(eb) } else { eb })?;
            let tc = c.gpu("matmul", "C", ec)?;
            // Packed B counts f16 elements from the view's first word.
            let ob = if f16 { 2 * bv.offset() } else { bv.offset() };
            let (a, b, c) = ((ta, a.offset()), (tb, ob), (tc, c.offset()));
            let operands = Operands::of(Storage::F32, Storage::of(f16));
            match k {
                Kernel::Coop if f16 => coop::matmul_coop(gb, a, b, c, g, fault),
                Kernel::Coop => Err(Error::Shape {
                    op: "matmul",
                    msg: "the cooperative-matrix kernel reads f16 weights".into(),
                }),
                Kernel::Scale => gpu_scale(gb, c, g),
                Kernel::CoopMixed(tile) => {
                    coop::matmul_coop_mixed(gb, a, b, c, g, tile, operands, fault)
                }
                Kernel::SplitK { splits, mixed } => {
                    gpu_split_k(gb, a, b, c, g, splits, mixed, operands, fault)
                }
                Kernel::Gemv {
                    shader_f16,
                    subgroups,
                } => {
                    let opts = GemmOpts {
                        trans_a: g.trans_a,
                        trans_b: g.trans_b,
                        b_f16: f16,
                        shader_f16,
                        direct: false,
                        causal: Causal::None,
                    };
                    gpu_gemv(gb, a, b, c, g, opts, subgroups, fault)
                }
                Kernel::Tiled {
                    tile,
                    shader_f16,
                    direct,
                } => {
                    let opts = GemmOpts {
                        trans_a: g.trans_a,
                        trans_b: g.trans_b,
                        b_f16: f16,
                        shader_f16,
                        direct,
                        causal: g.causal,
                    };
                    gpu_tiled(gb, a, b, c, g, tile, opts, fault)
                }
                Kernel::Cpu | Kernel::Quant | Kernel::QuantCoop => Err(Error::Shape {
                    op: "matmul",
                    msg: format!("kernel {k:?} does not run on a GPU with these weights"),
                }),
            }
        }
        (Backend::Cpu(_), _, k) => Err(Error::Shape {
            op: "matmul",
            msg: format!("kernel {k:?} does not run on the CPU backend"),
        }),
    }
}

/// Tile configurations. Every one needs at most 9 KiB of workgroup memory and 256 threads, inside
/// WebGPU's defaults (16 KiB, 256), so every adapter can run every variant.
pub const TILE_LARGE: Tile = Tile {
    bm: 128,
    bn: 128,
    bk: 8,
    tm: 8,
    tn: 8,
};
pub const TILE_TALL: Tile = Tile {
    bm: 128,
    bn: 64,
    bk: 8,
    tm: 8,
    tn: 8,
};
pub const TILE_MEDIUM: Tile = Tile {
    bm: 64,
    bn: 64,
    bk: 16,
    tm: 4,
    tn: 4,
};
pub const TILE_SMALL: Tile = Tile {
    bm: 32,
    bn: 32,
    bk: 16,
    tm: 4,
    tn: 4,
};

/// The largest tile that still gives every compute unit of a big GPU a few workgroups (512 covers the
/// H200's 132 multiprocessors four times over); products too small for that take the tile with the
/// most workgroups. Measured on the H200 (docs/perf.md): big tiles win on 4096³ and on the forward
/// products of training, small ones on the weight gradients (M, N ≤ 1536 with K = 16384). A tile
/// wider or taller than C (rounded up to 32) is passed over while another gives as many workgroups.
fn choose_tile(g: &Gemm) -> Tile {
    let groups = |t: Tile| g.m.div_ceil(t.bm as usize) * g.n.div_ceil(t.bn as usize) * g.batches();
    // A tile much wider or taller than C spends its threads on nothing (attention's 256 x 64 products
    // on 128 x 128 tiles: half of each).
    let fits = |t: Tile| {
        t.bm as usize <= g.m.next_multiple_of(32) && t.bn as usize <= g.n.next_multiple_of(32)
    };
    let order = [TILE_LARGE, TILE_TALL, TILE_MEDIUM, TILE_SMALL];
    order
        .into_iter()
        .find(|&t| groups(t) >= 512 && fits(t))
        .or_else(|| order.into_iter().find(|&t| groups(t) >= 512))
        .unwrap_or_else(|| {
            order
                .into_iter()
                .max_by_key(|&t| groups(t))
                .unwrap_or(TILE_SMALL)
        })
}

/// Slices of K for [`Kernel::SplitK`]: when the largest tile leaves fewer than 256 workgroups over a K
/// of 4096 or more, the fewest (a power of two) that give 512, each slice still at least 512 long and
/// all slices' partial products within 64 MiB and one binding. Not on CPU-type adapters (few cores).
fn split_k(gb: &GpuBackend, g: &Gemm) -> Option<usize> {
    if gb.is_software() {
        return None;
    }
    split_slices(g, ((gb.max_chunk_bytes() / 4) as usize).min(16 << 20))
}

/// [`split_k`] for training's products on operands stored as `operands`: f16 operands split only into
/// slices of even K (each slice's pairs whole; a slice of odd K could not stage them on the tensor
/// cores).
fn training_splits(gb: &GpuBackend, g: &Gemm, operands: Operands) -> Option<usize> {
    split_k(gb, g).filter(|&s| operands == Operands::F32 || g.k.is_multiple_of(2 * s))
}

/// [`split_k`]'s rule, with at most `max` elements of partial products.
fn split_slices(g: &Gemm, max: usize) -> Option<usize> {
    if g.batches() != 1 || g.k < 4096 {
        return None;
    }
    let tiles = g.m.div_ceil(TILE_LARGE.bm as usize) * g.n.div_ceil(TILE_LARGE.bn as usize);
    if tiles >= 256 {
        return None;
    }
    let mut s = 1;
    while tiles * s < 512 && g.k / (2 * s) >= 512 && 2 * s * g.m * g.n <= max {
        s *= 2;
    }
    (s > 1).then_some(s)
}

/// C = alpha · A · op(B) + beta · C as `splits` products over slices of K, written side by side into a
/// scratch tensor by one batched dispatch of the tiled kernel, then summed slice by slice into C.
#[allow(clippy::too_many_arguments)]
fn gpu_split_k(
    gb: &GpuBackend,
    (ta, oa): (&GpuTensor, usize),
    (tb, ob): (&GpuTensor, usize),
    (tc, oc): (&GpuTensor, usize),
    g: &Gemm,
    splits: usize,
    mixed: bool,
    operands: coop::Operands,
    fault: Option<Fault>,
) -> Result<()> {
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    // One slice product: on the tensor cores (mixed precision, where the adapter has them), on the
    // tiled kernel with f16 operands (mixed, elsewhere), or on the f32 tiled kernel. B may be f16
    // pairs, and on the tensor cores A too (their offsets and strides count f16 elements).
    let coop = mixed && gb.has_feature(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);
    let slice =
        |a: (&GpuTensor, usize), b: (&GpuTensor, usize), c: (&GpuTensor, usize), sg: &Gemm| {
            if coop && coop::mixed_suits(sg) && operands.suit(sg) {
                let tile = coop::mixed_tile(gb, sg);
                return coop::matmul_coop_mixed(gb, a, b, c, sg, tile, operands, fault);
            }
            if operands.a == Storage::F16 {
                return Err(Error::Shape {
                    op: "matmul",
                    msg: "an f16 A is read by the tensor-core kernel only, on slices of even K"
                        .into(),
                });
            }
            let opts = GemmOpts {
                trans_a: g.trans_a,
                trans_b: g.trans_b,
                b_f16: operands.b == Storage::F16,
                shader_f16: mixed,
                ..GemmOpts::default()
            };
            gpu_tiled(gb, a, b, c, sg, choose_tile(sg), opts, fault)
        };
    if splits == 0 || splits > g.k || g.batches() != 1 {
        return Err(Error::Shape {
            op: "matmul",
            msg: format!("{splits} slices of K = {} for a single product", g.k),
        });
    }
    let part = g.m * g.n;
    let scratch = gb.scratch("matmul_split_k", splits * part)?;
    // Slice s covers k in [s·len, (s + 1)·len); the last takes the remainder through a second product.
    let len = g.k / splits;
    let (step_a, step_b) = (
        if g.trans_a { len * g.lda } else { len },
        if g.trans_b { len } else { len * g.ldb },
    );
    let sliced = Gemm {
        k: len,
        alpha: 1.0,
        beta: 0.0,
        ldc: g.n,
        causal: Causal::None,
        ..*g
    }
    .batched([1, splits], [0, step_a], [0, step_b], [0, part]);
    let ts = &scratch;
    slice((ta, oa), (tb, ob), (ts, 0), &sliced)?;
    let rest = g.k - len * splits;
    if rest > 0 {
        // The remainder of K adds into the last slice.
        let tail = Gemm {
            k: rest,
            alpha: 1.0,
            beta: 1.0,
            ldc: g.n,
            causal: Causal::None,
            ..*g
        };
        let (ra, rb) = (oa + splits * step_a, ob + splits * step_b);
        let last = (splits - 1) * part;
        slice((ta, ra), (tb, rb), (ts, last), &tail)?;
    }
    let pipe = crate::ops::common::kernel(
        gb,
        "split_k_sum",
        include_str!("split_k_sum.wgsl"),
        &[Access::Read, Access::ReadWrite],
    )?;
    let [_, _, ec] = g.extents();
    let (bc, lc) = locate(tc, oc, oc + ec.max(1) - 1, "C")?;
    let p = [
        g.m as u32,
        g.n as u32,
        splits as u32,
        g.ldc as u32,
        lc as u32,
        g.alpha.to_bits(),
        g.beta.to_bits(),
    ];
    gb.dispatch(
        &pipe,
        &p,
        &[&scratch.chunks[0].buffer, &bc],
        gb.grid(part.div_ceil(256)),
    )
}

fn params(g: &Gemm, offs: [usize; 3], m: usize, n: usize, k: usize, beta: f32) -> Vec<u32> {
    vec![
        m as u32,
        n as u32,
        k as u32,
        g.lda as u32,
        g.ldb as u32,
        g.ldc as u32,
        offs[0] as u32,
        offs[1] as u32,
        offs[2] as u32,
        g.batch[1] as u32,
        g.stride_a[0] as u32,
        g.stride_a[1] as u32,
        g.stride_b[0] as u32,
        g.stride_b[1] as u32,
        g.stride_c[0] as u32,
        g.stride_c[1] as u32,
        g.alpha.to_bits(),
        beta.to_bits(),
    ]
}

/// Finds the chunk holding elements `first..=last` of `t`.
fn locate(t: &GpuTensor, first: usize, last: usize, what: &str) -> Result<(wgpu::Buffer, usize)> {
    let ci = t.chunk_of(first).ok_or_else(|| Error::Shape {
        op: "matmul",
        msg: format!("{what}: element {first} is out of range"),
    })?;
    let c = &t.chunks[ci];
    if last >= c.start + c.len {
        return Err(Error::Shape {
            op: "matmul",
            msg: format!(
                "{what}: one block of the product spans two buffers; allocate the tensor with a split \
                 unit that is a multiple of its row length"
            ),
        });
    }
    Ok((c.buffer.clone(), first - c.start))
}

/// Cut points of `0..len` where a tensor stored as rows of `ld` elements from `off` changes buffer.
fn cuts(t: &GpuTensor, off: usize, ld: usize, len: usize, out: &mut Vec<usize>) {
    for c in &t.chunks[1..] {
        if c.start > off {
            let r = (c.start - off).div_ceil(ld);
            if r < len {
                out.push(r);
            }
        }
    }
}

fn ranges(mut cut: Vec<usize>, len: usize) -> Vec<(usize, usize)> {
    cut.push(0);
    cut.push(len);
    cut.sort_unstable();
    cut.dedup();
    cut.windows(2).map(|w| (w[0], w[1])).collect()
}

/// C = beta · C for an empty sum (K = 0). The kernels read nothing from A and B then; a dummy buffer
/// stands in for the empty tensors (which own no element to bind at).
fn gpu_scale(gb: &GpuBackend, (tc, oc): (&GpuTensor, usize), g: &Gemm) -> Result<()> {
    if g.m == 0 || g.n == 0 || g.batches() == 0 {
        return Ok(());
    }
    let [_, _, ec] = g.extents();
    let dummy = gb.scratch("dummy", 1)?;
    let (bc, lc) = locate(tc, oc, oc + ec.max(1) - 1, "C")?;
    let opts = GemmOpts {
        trans_a: g.trans_a,
        trans_b: g.trans_b,
        ..GemmOpts::default()
    };
    let pipe = pipeline(gb, TILE_SMALL, opts, None)?;
    let p = params(g, [0, 0, lc], g.m, g.n, 0, g.beta);
    let d = &dummy.chunks[0].buffer;
    gb.dispatch(
        &pipe,
        &p,
        &[d, d, &bc],
        [
            g.n.div_ceil(32) as u32,
            g.m.div_ceil(32) as u32,
            g.batches() as u32,
        ],
    )
}

/// Finds the chunk holding elements `first..=last` of B; packed-f16 B counts f16 elements while its
/// tensor counts u32 words, so the words are found and the offset expressed in f16 elements again.
fn locate_b(t: &GpuTensor, first: usize, last: usize, f16: bool) -> Result<(wgpu::Buffer, usize)> {
    if f16 {
        let (b, w) = locate(t, first / 2, last / 2, "B")?;
        Ok((b, 2 * w + first % 2))
    } else {
        locate(t, first, last, "B")
    }
}

#[allow(clippy::too_many_arguments)]
fn gpu_gemv(
    gb: &GpuBackend,
    (ta, oa): (&GpuTensor, usize),
    (tb, ob): (&GpuTensor, usize),
    (tc, oc): (&GpuTensor, usize),
    g: &Gemm,
    opts: GemmOpts,
    subgroups: bool,
    fault: Option<Fault>,
) -> Result<()> {
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    if g.batches() != 1 || g.trans_a || !g.trans_b {
        return Err(Error::Shape {
            op: "matmul",
            msg: "the decode kernel takes rows of an unbatched x · Wᵀ".into(),
        });
    }
    if g.m > 8 {
        // Groups of 8 rows, each computed as the kernel computes any row.
        for r0 in (0..g.m).step_by(8) {
            let part = Gemm {
                m: (g.m - r0).min(8),
                ..*g
            };
            let (a, c) = ((ta, oa + r0 * g.lda), (tc, oc + r0 * g.ldc));
            gpu_gemv(gb, a, (tb, ob), c, &part, opts, subgroups, fault)?;
        }
        return Ok(());
    }
    let [ea, eb, ec] = g.extents();
    let (ba, la) = locate(ta, oa, oa + ea.max(1) - 1, "A")?;
    let (bb, lb) = locate_b(tb, ob, ob + eb.max(1) - 1, opts.b_f16)?;
    let (bc, lc) = locate(tc, oc, oc + ec.max(1) - 1, "C")?;
    let key = format!(
        "gemv_{}_r{}{}{}",
        opts.key(),
        g.m,
        if subgroups { "_sg" } else { "" },
        fault.map_or_else(String::new, |f| format!("_fault{f:?}"))
    );
    let pipe = gb.pipeline(
        &key,
        &[Access::Read, Access::Read, Access::ReadWrite],
        || gemv::gemv_source(opts, g.m, subgroups, fault),
    )?;
    let p = [
        g.m as u32,
        g.n as u32,
        g.k as u32,
        g.lda as u32,
        g.ldb as u32,
        g.ldc as u32,
        la as u32,
        lb as u32,
        lc as u32,
        g.alpha.to_bits(),
        g.beta.to_bits(),
    ];
    gb.dispatch(&pipe, &p, &[&ba, &bb, &bc], gb.grid(g.n.div_ceil(8)))
}

#[allow(clippy::too_many_arguments)]
fn gpu_tiled(
    gb: &GpuBackend,
    (ta, oa): (&GpuTensor, usize),
    (tb, ob): (&GpuTensor, usize),
    (tc, oc): (&GpuTensor, usize),
    g: &Gemm,
    tile: Tile,
    opts: GemmOpts,
    fault: Option<Fault>,
) -> Result<()> {
    if g.m == 0 || g.n == 0 || g.batches() == 0 {
        return Ok(());
    }
    if g.k == 0 {
        return gpu_scale(gb, (tc, oc), g);
    }
    if tile.shared_bytes() > gb.limits.max_compute_workgroup_storage_size
        || tile.threads() > gb.limits.max_compute_invocations_per_workgroup
    {
        return Err(Error::Limits(format!(
            "GEMM tile {} needs {} bytes of workgroup memory and {} threads; the device allows {} and {}",
            tile.key(),
            tile.shared_bytes(),
            tile.threads(),
            gb.limits.max_compute_workgroup_storage_size,
            gb.limits.max_compute_invocations_per_workgroup
        )));
    }
    if opts.b_f16 && tb.chunks.len() != 1 {
        return Err(Error::Shape {
            op: "matmul",
            msg: "an f16-packed weight must lie in one buffer".into(),
        });
    }
    let [ea, eb, ec] = g.extents();
    let max_z = gb.limits.max_compute_workgroups_per_dimension as usize;
    let single = ta.chunks.len() == 1 && tb.chunks.len() == 1 && tc.chunks.len() == 1;
    let f16 = opts.b_f16;
    // A single product over split tensors is cut into sub-products whose rows and columns no longer
    // count from the matrix's corner, and the direct form has no tiles to skip: those compute
    // everything.
    let whole = (single && g.batches() <= max_z) || g.batches() > 1;
    let opts = if whole && !opts.direct {
        opts
    } else {
        GemmOpts {
            causal: Causal::None,
            ..opts
        }
    };
    let pipe = pipeline(gb, tile, opts, fault)?;
    let dispatch = |bufs: [&wgpu::Buffer; 3],
                    offs: [usize; 3],
                    m: usize,
                    n: usize,
                    k: usize,
                    beta: f32,
                    zs: usize| {
        let p = params(g, offs, m, n, k, beta);
        gb.dispatch(
            &pipe,
            &p,
            &bufs,
            [
                n.div_ceil(tile.bn as usize) as u32,
                m.div_ceil(tile.bm as usize) as u32,
                zs as u32,
            ],
        )
    };
    if single && g.batches() <= max_z {
        let (ba, la) = locate(ta, oa, oa + ea.max(1) - 1, "A")?;
        let (bb, lb) = locate_b(tb, ob, ob + eb.max(1) - 1, f16)?;
        let (bc, lc) = locate(tc, oc, oc + ec.max(1) - 1, "C")?;
        return dispatch(
            [&ba, &bb, &bc],
            [la, lb, lc],
            g.m,
            g.n,
            g.k,
            g.beta,
            g.batches(),
        );
    }
    if g.batches() > 1 {
        // One outer batch entry at a time; each must lie in one buffer per operand.
        let one = Gemm {
            batch: [1, g.batch[1]],
            ..*g
        };
        let [ea1, eb1, ec1] = one.extents();
        let per = (max_z / g.batch[1].max(1)).max(1);
        for z1 in 0..g.batch[0] {
            let (sa, sb, sc) = (
                oa + z1 * g.stride_a[0],
                ob + z1 * g.stride_b[0],
                oc + z1 * g.stride_c[0],
            );
            let (ba, la) = locate(ta, sa, sa + ea1.max(1) - 1, "A")?;
            let (bb, lb) = locate_b(tb, sb, sb + eb1.max(1) - 1, f16)?;
            let (bc, lc) = locate(tc, sc, sc + ec1.max(1) - 1, "C")?;
            if g.batch[1] > per {
                return Err(Error::Limits(format!(
                    "matmul: inner batch of {} exceeds the device's {max_z} workgroups per dimension",
                    g.batch[1]
                )));
            }
            dispatch(
                [&ba, &bb, &bc],
                [la, lb, lc],
                g.m,
                g.n,
                g.k,
                g.beta,
                g.batch[1],
            )?;
        }
        return Ok(());
    }
    // A single product over split tensors: cut M, N and K where any operand changes buffer.
    let (mut mc, mut nc, mut kc) = (Vec::new(), Vec::new(), Vec::new());
    if g.trans_a {
        cuts(ta, oa, g.lda, g.k, &mut kc);
    } else {
        cuts(ta, oa, g.lda, g.m, &mut mc);
    }
    if g.trans_b {
        cuts(tb, ob, g.ldb, g.n, &mut nc);
    } else {
        cuts(tb, ob, g.ldb, g.k, &mut kc);
    }
    cuts(tc, oc, g.ldc, g.m, &mut mc);
    let k_ranges = if g.k == 0 {
        vec![(0, 0)]
    } else {
        ranges(kc, g.k)
    };
    let n_ranges = ranges(nc, g.n);
    for &(m0, m1) in &ranges(mc, g.m) {
        for &(n0, n1) in &n_ranges {
            for (ki, &(k0, k1)) in k_ranges.iter().enumerate() {
                let (m, n, k) = (m1 - m0, n1 - n0, k1 - k0);
                let (a_first, a_last) = if g.trans_a {
                    (
                        oa + k0 * g.lda + m0,
                        oa + (k1.max(k0 + 1) - 1) * g.lda + m1 - 1,
                    )
                } else {
                    (
                        oa + m0 * g.lda + k0,
                        oa + (m1 - 1) * g.lda + k1.max(k0 + 1) - 1,
                    )
                };
                let (b_first, b_last) = if g.trans_b {
                    (
                        ob + n0 * g.ldb + k0,
                        ob + (n1 - 1) * g.ldb + k1.max(k0 + 1) - 1,
                    )
                } else {
                    (
                        ob + k0 * g.ldb + n0,
                        ob + (k1.max(k0 + 1) - 1) * g.ldb + n1 - 1,
                    )
                };
                let c_first = oc + m0 * g.ldc + n0;
                let c_last = oc + (m1 - 1) * g.ldc + n1 - 1;
                let (ba, la) = locate(ta, a_first, a_last, "A")?;
                let (bb, lb) = locate_b(tb, b_first, b_last, f16)?;
                let (bc, lc) = locate(tc, c_first, c_last, "C")?;
                let beta = if ki == 0 { g.beta } else { 1.0 };
                dispatch([&ba, &bb, &bc], [la, lb, lc], m, n, k, beta, 1)?;
            }
        }
    }
    Ok(())
}

fn pipeline(
    gb: &GpuBackend,
    tile: Tile,
    opts: GemmOpts,
    fault: Option<Fault>,
) -> Result<std::rc::Rc<crate::gpu::Pipeline>> {
    let key = format!(
        "gemm_{}_{}{}",
        opts.key(),
        tile.key(),
        fault.map_or_else(String::new, |f| format!("_fault{f:?}"))
    );
    gb.pipeline(
        &key,
        &[Access::Read, Access::Read, Access::ReadWrite],
        || gemm_source(tile, opts, fault),
    )
}

#[cfg(test)]
mod tests;
