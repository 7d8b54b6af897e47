//! y = x · Wᵀ straight from block-quantized weights (layouts in [`crate::quant`]), and the token-embedding
//! lookup from a quantized table.
//!
//! A [`QMatrix`] holds one weight matrix on either backend. On the CPU it keeps the host arrays and the
//! ops call [`cpu`]'s kernels; on the GPU its three component arrays are separate tensors, each split
//! across buffers at whole weight rows, so a matrix larger than one storage binding (Gemma-3's 262144 x 640
//! Q8_0 token table holds 160 MiB of quants) is split, never refused:
//!
//! ```text
//!   QMatrix, N rows x K cols (K a multiple of the block)
//!   quants : N rows x (K/4 words for Q8, K/8 for Q4)  ─┐
//!   scales : N rows x K/block f32                      ├─ each split at row multiples; `segs` lists the
//!   mins   : N rows x K/32 f32 (Q4 only)               ─┘  row ranges inside which all three lie in one
//!                                                          buffer each (one dispatch per range)
//! ```
//!
//! Numerics: the GPU kernels compute the same f32 sums as the CPU kernels (exact integer quants times f32
//! activations, each partial sum multiplied by its block's scale: once per block on the CPU, once per quant
//! word, i.e. per 4 or 8 values, on the GPU), so the two agree up to summation order.

pub mod cpu;
#[cfg(target_arch = "x86_64")]
mod cpu_avx2;
#[cfg(target_arch = "x86_64")]
mod cpu_avx512;
pub mod cpu_int;
#[cfg(target_arch = "x86_64")]
mod cpu_vnni;
pub(crate) mod gpu;
pub(crate) use gpu::{GEMM_MIN_ROWS, merge_takes};

use std::ops::Range;

use super::RowMode;
use crate::backend::{Backend, TMut, TRef, Tensor};
use crate::cpu::CpuBackend;
use crate::error::{Error, Result, shape};
use crate::gpu::{GpuBackend, GpuTensor, Operand, Segment, segments};
use crate::path::{Fault, PathId, PathSet};
use crate::quant::{Q4Matrix, Q8Matrix};

/// Which block layout a matrix uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QKind {
    /// Signed 8-bit quants, one f32 scale per `block` (16 or 32) values: [`Q8Matrix`].
    Q8 { block: usize },
    /// Unsigned 4-bit quants, f32 scale and min per 32 values: [`Q4Matrix`].
    Q4,
}

impl QKind {
    /// Values per scale.
    pub fn block(self) -> usize {
        match self {
            QKind::Q8 { block } => block,
            QKind::Q4 => 32,
        }
    }

    /// Packed quant words per row of `cols` values.
    pub fn words_per_row(self, cols: usize) -> usize {
        match self {
            QKind::Q8 { .. } => cols / 4,
            QKind::Q4 => cols / 8,
        }
    }
}

/// A matrix as the host holds it, before upload.
#[derive(Clone, Debug, PartialEq)]
pub enum QuantSource {
    Q8(Q8Matrix),
    Q4(Q4Matrix),
}

impl From<Q8Matrix> for QuantSource {
    fn from(m: Q8Matrix) -> Self {
        QuantSource::Q8(m)
    }
}

impl From<Q4Matrix> for QuantSource {
    fn from(m: Q4Matrix) -> Self {
        QuantSource::Q4(m)
    }
}

impl QuantSource {
    /// The row-major f32 matrix: every block's scale · q (+ min), the canonical path's weights.
    pub fn dequantize(&self) -> Vec<f32> {
        match self {
            QuantSource::Q8(m) => m.dequantize(),
            QuantSource::Q4(m) => m.dequantize(),
        }
    }

    /// (rows, cols, kind).
    pub fn dims(&self) -> (usize, usize, QKind) {
        match self {
            QuantSource::Q8(m) => (m.rows, m.cols, QKind::Q8 { block: m.block }),
            QuantSource::Q4(m) => (m.rows, m.cols, QKind::Q4),
        }
    }

    /// Checks that the arrays fit the shape (the CPU kernels assert it; we refuse it with an error).
    fn validate(&self) -> Result<()> {
        let (rows, cols, kind) = self.dims();
        let block = kind.block();
        if rows == 0 || cols == 0 {
            return Err(shape("qmatrix", format!("empty matrix ({rows} x {cols})")));
        }
        if !matches!(block, 16 | 32) {
            return Err(shape(
                "qmatrix",
                format!("block size {block} (must be 16 or 32)"),
            ));
        }
        if cols % block != 0 {
            return Err(shape(
                "qmatrix",
                format!("K = {cols} is not a multiple of the block size {block}"),
            ));
        }
        let blocks = rows
            .checked_mul(cols / block)
            .ok_or_else(|| shape("qmatrix", "size overflows"))?;
        let words = rows * kind.words_per_row(cols);
        let (ns, nm, nq) = match self {
            QuantSource::Q8(m) => (m.scales.len(), blocks, m.quants.len()),
            QuantSource::Q4(m) => (m.scales.len(), m.mins.len(), m.quants.len()),
        };
        if ns != blocks || nm != blocks || nq != words {
            return Err(shape(
                "qmatrix",
                format!(
                    "a {rows} x {cols} {kind:?} matrix needs {blocks} scales ({blocks} mins for Q4) and \
                     {words} quant words; got {ns} scales, {nm} mins, {nq} words"
                ),
            ));
        }
        Ok(())
    }
}

/// The GPU side of a matrix: its component tensors and the row ranges to dispatch over.
pub(crate) struct GpuParts {
    pub scales: Tensor,
    pub mins: Option<Tensor>,
    pub quants: Tensor,
    /// Row ranges of the matrix inside which scales, quants (and mins) each lie in one buffer; the places
    /// are in that order.
    pub segs: Vec<Segment>,
}

enum QStore {
    Cpu(QuantSource),
    /// Repacked for the integer-dot kernels (the CPU `int-dot` path).
    CpuInt(cpu_int::IntMatrix),
    Gpu(GpuParts),
    /// The quantized kernels have not passed their gate on this device: the canonical f32 path, the
    /// dequantized matrix (split at whole rows like any tensor).
    GpuDense(Tensor),
}

/// A block-quantized weight matrix (N = `rows` output features, K = `cols` input features) resident on
/// one backend.
pub struct QMatrix {
    rows: usize,
    cols: usize,
    kind: QKind,
    store: QStore,
}

const OP_UPLOAD: &str = "qmatrix";

impl QMatrix {
    /// Puts `src` on `be`: moved as is onto the CPU backend, copied into split tensors on the GPU — as
    /// blocks when `paths` holds the quantized kernels ([`PathId::QuantMatmul`], which the gate grants),
    /// else dequantized to f32 (the canonical path the gate compares against).
    pub fn upload(be: &Backend, src: impl Into<QuantSource>, paths: PathSet) -> Result<QMatrix> {
        let src = src.into();
        src.validate()?;
        let (rows, cols, kind) = src.dims();
        let nb = cols / kind.block();
        let words = kind.words_per_row(cols);
        let store = match be {
            Backend::Cpu(_) if paths.has(PathId::IntDot) && cpu_int::int_dot_available() => {
                let packed = match &src {
                    QuantSource::Q8(m) => cpu_int::IntMatrix::from_q8(m),
                    QuantSource::Q4(m) => cpu_int::IntMatrix::from_q4(m),
                };
                // A shape the packed layout cannot hold keeps the f32 kernels.
                packed.map_or(QStore::Cpu(src), QStore::CpuInt)
            }
            Backend::Cpu(_) => QStore::Cpu(src),
            Backend::Gpu(_) if !paths.has(PathId::QuantMatmul) => {
                QStore::GpuDense(be.from_f32(&src.dequantize(), cols)?)
            }
            Backend::Gpu(_) => {
                let (scales, mins, quants) = match &src {
                    QuantSource::Q8(m) => (
                        be.from_f32(&m.scales, nb)?,
                        None,
                        be.from_u32(&m.quants, words)?,
                    ),
                    QuantSource::Q4(m) => (
                        be.from_f32(&m.scales, nb)?,
                        Some(be.from_f32(&m.mins, nb)?),
                        be.from_u32(&m.quants, words)?,
                    ),
                };
                let segs = {
                    fn gt(t: &Tensor) -> Result<&GpuTensor> {
                        t.gpu().ok_or(Error::BackendMismatch {
                            op: OP_UPLOAD,
                            expected: "gpu",
                            found: "cpu",
                        })
                    }
                    let mut ops = vec![
                        Operand::rows(gt(&scales)?, 0, nb),
                        Operand::rows(gt(&quants)?, 0, words),
                    ];
                    if let Some(mn) = &mins {
                        ops.push(Operand::rows(gt(mn)?, 0, nb));
                    }
                    segments(OP_UPLOAD, rows, &ops)?
                };
                QStore::Gpu(GpuParts {
                    scales,
                    mins,
                    quants,
                    segs,
                })
            }
        };
        Ok(QMatrix {
            rows,
            cols,
            kind,
            store,
        })
    }

    /// N, the number of output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// K, the number of input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn kind(&self) -> QKind {
        self.kind
    }

    /// "cpu" or "gpu".
    pub fn backend_kind(&self) -> &'static str {
        match self.store {
            QStore::Cpu(_) | QStore::CpuInt(_) => "cpu",
            QStore::Gpu(_) | QStore::GpuDense(_) => "gpu",
        }
    }

    /// Number of buffers the largest component is split into on the GPU (1 on the CPU).
    pub fn num_chunks(&self) -> usize {
        match &self.store {
            QStore::Cpu(_) | QStore::CpuInt(_) => 1,
            QStore::Gpu(p) => p.quants.gpu().map_or(1, |t| t.num_chunks()),
            QStore::GpuDense(t) => t.gpu().map_or(1, |t| t.num_chunks()),
        }
    }

    /// Whether the matrix is held as blocks (false: dequantized, the quantized kernels being gated off).
    pub fn is_quantized(&self) -> bool {
        !matches!(self.store, QStore::GpuDense(_))
    }

    /// Bytes held (device memory on the GPU, host memory on the CPU), for memory reports.
    pub fn bytes(&self) -> u64 {
        match &self.store {
            QStore::Cpu(QuantSource::Q8(m)) => 4 * (m.scales.len() + m.quants.len()) as u64,
            QStore::Cpu(QuantSource::Q4(m)) => {
                4 * (m.scales.len() + m.mins.len() + m.quants.len()) as u64
            }
            QStore::CpuInt(m) => m.bytes(),
            QStore::Gpu(p) => {
                p.scales.bytes() + p.quants.bytes() + p.mins.as_ref().map_or(0, |t| t.bytes())
            }
            QStore::GpuDense(t) => t.bytes(),
        }
    }

    /// Bytes one full pass over the weights reads (quants, scales, mins), whatever the allocation rounding.
    pub fn weight_bytes(&self) -> u64 {
        let blocks = (self.rows * (self.cols / self.kind.block())) as u64;
        let words = (self.rows * self.kind.words_per_row(self.cols)) as u64;
        4 * words + 4 * blocks * if self.kind == QKind::Q4 { 2 } else { 1 }
    }

    /// Dequantized rows `rows` as row-major f32 (read back from the device on the GPU): the twin the tests
    /// check the kernels against.
    pub async fn dequantize_rows(&self, be: &Backend, rows: Range<usize>) -> Result<Vec<f32>> {
        if rows.start > rows.end || rows.end > self.rows {
            return Err(shape(
                "dequantize_rows",
                format!("rows {rows:?} are not inside 0..{}", self.rows),
            ));
        }
        let (n, k) = (rows.len(), self.cols);
        let nb = k / self.kind.block();
        let words = self.kind.words_per_row(k);
        let part = match &self.store {
            QStore::Cpu(QuantSource::Q8(m)) => QuantSource::Q8(Q8Matrix {
                rows: n,
                cols: k,
                block: m.block,
                scales: m.scales[rows.start * nb..rows.end * nb].to_vec(),
                quants: m.quants[rows.start * words..rows.end * words].to_vec(),
            }),
            QStore::Cpu(QuantSource::Q4(m)) => QuantSource::Q4(Q4Matrix {
                rows: n,
                cols: k,
                scales: m.scales[rows.start * nb..rows.end * nb].to_vec(),
                mins: m.mins[rows.start * nb..rows.end * nb].to_vec(),
                quants: m.quants[rows.start * words..rows.end * words].to_vec(),
            }),
            QStore::CpuInt(m) => {
                let mut out = vec![0f32; n * k];
                for (row, o) in rows.zip(out.chunks_exact_mut(k)) {
                    m.dequantize_row(row, o);
                }
                return Ok(out);
            }
            QStore::GpuDense(t) => return be.read_f32(t.at(rows.start * k), n * k).await,
            QStore::Gpu(p) => {
                let scales = be.read_f32(p.scales.at(rows.start * nb), n * nb).await?;
                let quants = be
                    .read_u32(p.quants.at(rows.start * words), n * words)
                    .await?;
                match (&p.mins, self.kind) {
                    (Some(mt), QKind::Q4) => QuantSource::Q4(Q4Matrix {
                        rows: n,
                        cols: k,
                        scales,
                        mins: be.read_f32(mt.at(rows.start * nb), n * nb).await?,
                        quants,
                    }),
                    (_, kind) => QuantSource::Q8(Q8Matrix {
                        rows: n,
                        cols: k,
                        block: kind.block(),
                        scales,
                        quants,
                    }),
                }
            }
        };
        Ok(part.dequantize())
    }
}

fn mismatch(op: &'static str, w: &QMatrix, be: &Backend) -> Error {
    Error::BackendMismatch {
        op,
        expected: be.kind(),
        found: w.backend_kind(),
    }
}

/// Checks that every size a kernel gets as a u32 parameter fits one.
fn fits_u32(op: &'static str, vals: &[usize]) -> Result<()> {
    if vals.iter().any(|&v| v > u32::MAX as usize) {
        return Err(shape(op, "a dimension exceeds 2^32 - 1"));
    }
    Ok(())
}

impl QMatrix {
    /// The blocks on the GPU, when it holds them so.
    pub(crate) fn gpu_parts(&self) -> Option<&GpuParts> {
        match &self.store {
            QStore::Gpu(p) => Some(p),
            _ => None,
        }
    }

    /// The dequantized f32 matrix, when the GPU holds it so (the quantized kernels not in the path set).
    pub(crate) fn dense(&self) -> Option<&Tensor> {
        match &self.store {
            QStore::GpuDense(t) => Some(t),
            _ => None,
        }
    }

    /// y[m, N] = x[m, K] · Wᵀ on the CPU backend (rows contiguous from the slices' starts); with
    /// independent rows, each row through the one-row kernel (the weights still stream once, in tiles
    /// that stay in cache while every row passes over them).
    pub(crate) fn cpu_matmul(
        &self,
        c: &CpuBackend,
        x: &[f32],
        y: &mut [f32],
        m: usize,
        rows: RowMode,
        fault: Option<Fault>,
    ) -> Result<()> {
        fits_u32("qmatmul", &[m, x.len(), y.len()])?;
        let n = self.rows;
        match &self.store {
            QStore::Cpu(src) => {
                let opts = cpu::QmmOptions {
                    alone: rows == RowMode::Independent,
                    ..cpu::QmmOptions::default()
                };
                c.install(|| match src {
                    QuantSource::Q8(q) => cpu::q8_matmul_nt_with(x, q, m, 0..n, y, n, opts),
                    QuantSource::Q4(q) => cpu::q4_matmul_nt_with(x, q, m, 0..n, y, n, opts),
                });
                Ok(())
            }
            QStore::CpuInt(w) => {
                // Every row is computed as alone whatever `rows` says (see `cpu_int`).
                let opts = cpu_int::IntOptions {
                    fault,
                    ..cpu_int::IntOptions::default()
                };
                c.install(|| cpu_int::int_matmul(x, w, y, m, opts));
                Ok(())
            }
            _ => Err(Error::BackendMismatch {
                op: "qmatmul",
                expected: "cpu",
                found: "gpu",
            }),
        }
    }

    /// y[m, N] = x[m, K] · Wᵀ from the blocks on the GPU (x and y views: tensor and element offset); with
    /// independent rows, each row as it would be computed alone; `tensor_cores`: the other rows on the
    /// tensor-core GEMM.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gpu_matmul(
        &self,
        g: &GpuBackend,
        x: (&GpuTensor, usize),
        y: (&GpuTensor, usize),
        m: usize,
        rows: RowMode,
        fault: Option<Fault>,
        tensor_cores: bool,
    ) -> Result<()> {
        let QStore::Gpu(parts) = &self.store else {
            return Err(shape(
                "qmatmul",
                "the matrix is not held as blocks on the GPU",
            ));
        };
        fits_u32("qmatmul", &[m, m * self.cols, m * self.rows])?;
        let shape = [m, self.rows, self.cols];
        gpu::qmatmul(
            g,
            x,
            y,
            parts,
            self.kind,
            shape,
            rows == RowMode::Independent,
            fault,
            tensor_cores,
        )
    }
}

/// out[i, :] = scale · (dequantized row ids[i] of `w`) for i < n: a token-embedding lookup from a quantized
/// table (Gemma multiplies by sqrt(dim)). Ids past the table's rows give zero rows. `out` is n x K from its
/// view's offset.
pub fn get_rows(
    be: &Backend,
    ids: TRef<'_>,
    w: &QMatrix,
    mut out: TMut<'_>,
    n: usize,
    scale: f32,
) -> Result<()> {
    const OP: &str = "qget_rows";
    let k = w.cols;
    let ol = n
        .checked_mul(k)
        .ok_or_else(|| shape(OP, "n x K overflows"))?;
    fits_u32(OP, &[n, ol])?;
    match (be, &w.store) {
        (Backend::Cpu(c), QStore::Cpu(src)) => {
            let ids = ids.cpu_u32(OP, "ids", n)?;
            let o = out.cpu(OP, "out", ol)?;
            cpu_get_rows(c, ids, o, w.rows, k, scale, |id, row| match src {
                QuantSource::Q8(q) => q.dequantize_row(id, row),
                QuantSource::Q4(q) => q.dequantize_row(id, row),
            });
            Ok(())
        }
        (Backend::Cpu(c), QStore::CpuInt(packed)) => {
            let ids = ids.cpu_u32(OP, "ids", n)?;
            let o = out.cpu(OP, "out", ol)?;
            cpu_get_rows(c, ids, o, w.rows, k, scale, |id, row| {
                packed.dequantize_row(id, row)
            });
            Ok(())
        }
        (Backend::Gpu(_), QStore::GpuDense(t)) => {
            let s = crate::ops::embedding::EmbedShape {
                tokens: n,
                vocab: w.rows,
                dim: k,
                scale,
            };
            crate::ops::embedding::embedding(be, ids, t.at(0), None, out, s)
        }
        (Backend::Gpu(g), QStore::Gpu(parts)) => {
            let ti = ids.gpu(OP, "ids", n)?;
            let to = out.gpu(OP, "out", ol)?;
            gpu::get_rows(
                g,
                (ti, ids.offset()),
                (to, out.offset()),
                parts,
                w.kind,
                n,
                w.rows,
                k,
                scale,
            )
        }
        _ => Err(mismatch(OP, w, be)),
    }
}

/// Rows `ids` of a CPU matrix (`deq(id, row)` writes one) times `scale` into `o`, K values a row; an id
/// past the last row gives zeros.
fn cpu_get_rows(
    c: &CpuBackend,
    ids: &[u32],
    o: &mut [f32],
    rows: usize,
    k: usize,
    scale: f32,
    deq: impl Fn(usize, &mut [f32]) + Sync,
) {
    use rayon::prelude::*;
    c.install(|| {
        o.par_chunks_mut(k)
            .zip(ids.par_iter())
            .for_each(|(row, &id)| {
                let id = id as usize;
                if id >= rows {
                    row.fill(0.0);
                    return;
                }
                deq(id, row);
                row.iter_mut().for_each(|v| *v *= scale);
            })
    });
}

/// Symmetric 8-bit quantization per block of 32 (Q8_0's rule), straight into the kernel layout (the
/// gate's test matrices).
pub fn quantize_q8_32(w: &[f32], rows: usize, cols: usize) -> Q8Matrix {
    quantize_q8(w, rows, cols, 32)
}

/// The same rule per block of `block` values (16: the layout Q6_K maps to).
pub fn quantize_q8(w: &[f32], rows: usize, cols: usize, block: usize) -> Q8Matrix {
    let mut scales = Vec::with_capacity(w.len() / block);
    let mut bytes = Vec::with_capacity(w.len());
    for b in w.chunks(block) {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        scales.push(d);
        bytes.extend(
            b.iter()
                .map(|v| (v * id).round().clamp(-128.0, 127.0) as i8 as u8),
        );
    }
    let quants = bytes
        .chunks(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Q8Matrix {
        rows,
        cols,
        block,
        scales,
        quants,
    }
}

/// Asymmetric 4-bit quantization per block of 32 (Q4_1's rule), in the kernel layout's nibble order.
pub fn quantize_q4(w: &[f32], rows: usize, cols: usize) -> Q4Matrix {
    let (mut scales, mut mins, mut quants) = (Vec::new(), Vec::new(), Vec::new());
    for b in w.chunks(32) {
        let lo = b.iter().fold(f32::MAX, |m, &v| m.min(v));
        let hi = b.iter().fold(f32::MIN, |m, &v| m.max(v));
        let d = (hi - lo) / 15.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        scales.push(d);
        mins.push(lo);
        let q: Vec<u32> = b
            .iter()
            .map(|v| (((v - lo) * id).round() as u32).min(15))
            .collect();
        let mut block = [0u8; 16];
        for j in 0..16 {
            block[j] = (q[j] | (q[j + 16] << 4)) as u8;
        }
        quants.extend(
            block
                .chunks(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
    }
    Q4Matrix {
        rows,
        cols,
        scales,
        mins,
        quants,
    }
}

#[cfg(test)]
mod tests;
