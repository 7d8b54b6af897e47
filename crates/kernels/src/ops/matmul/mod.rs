//! General matrix multiply: C = alpha * op(A) * op(B) + beta * C, in the three layouts training needs
//! (A·B, A·Bᵀ, Aᵀ·B, and Aᵀ·Bᵀ for completeness), any size, with a two-level batch of strided matrices
//! (attention runs one product per (sequence, head) pair straight out of the fused QKV tensor).
//!
//! Storage is row-major with leading dimensions: op(A) is M x K, stored as M x K (`lda` >= K) or, when
//! `trans_a`, as K x M (`lda` >= M); likewise op(B) is K x N, stored as K x N or N x K. C is M x N with
//! `ldc` >= N. Batch entry (z1, z2) of each operand starts `z1 * stride1 + z2 * stride2` elements after
//! its view's offset.
//!
//! Tensors split across buffers (larger than one binding) are handled by splitting the product: along M
//! (rows of A and C), N (rows of a transposed B) and K (accumulating the partial products into C).

mod cpu;
pub mod wgsl;

use crate::backend::{Backend, TMut, TRef};
use crate::error::{Error, Result};
use crate::gpu::{Access, GpuBackend, GpuTensor, PipelineOptions};
pub use cpu::gemm_reference;
pub use wgsl::GemmOpts;
pub use wgsl::Tile;
use wgsl::gemm_source;

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

/// Runs the product described by `g`.
pub fn matmul(be: &Backend, a: TRef<'_>, b: TRef<'_>, c: TMut<'_>, g: &Gemm) -> Result<()> {
    matmul_with_tile(be, a, b, c, g, None)
}

/// [`matmul`] with the GPU tile configuration forced (benchmarks compare tiles with it).
pub fn matmul_with_tile(
    be: &Backend,
    a: TRef<'_>,
    b: TRef<'_>,
    mut c: TMut<'_>,
    g: &Gemm,
    tile: Option<Tile>,
) -> Result<()> {
    g.validate()?;
    let [ea, eb, ec] = g.extents();
    match be {
        Backend::Cpu(cb) => {
            let (a, b) = (a.cpu("matmul", "A", ea)?, b.cpu("matmul", "B", eb)?);
            let c = c.cpu("matmul", "C", ec)?;
            cb.install(|| cpu::gemm(a, b, c, g));
            Ok(())
        }
        Backend::Gpu(gb) => {
            let ta = a.gpu("matmul", "A", ea)?;
            let tb = b.gpu("matmul", "B", eb)?;
            let tc = c.gpu("matmul", "C", ec)?;
            let choice = KernelChoice {
                subgroups: gb.path_active(crate::gate::PathId::Subgroups),
                ..KernelChoice::default()
            };
            gpu_matmul(
                gb,
                (ta, a.offset()),
                (tb, b.offset()),
                (tc, c.offset()),
                g,
                tile,
                choice,
            )
        }
    }
}

/// Tile configurations. Every one needs at most 8 KiB of workgroup memory and 256 threads, inside
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
/// products of training, small ones on the weight gradients (M, N ≤ 1536 with K = 16384).
fn choose_tile(g: &Gemm) -> Tile {
    let groups = |t: Tile| g.m.div_ceil(t.bm as usize) * g.n.div_ceil(t.bn as usize) * g.batches();
    let order = [TILE_LARGE, TILE_TALL, TILE_MEDIUM, TILE_SMALL];
    order
        .into_iter()
        .find(|&t| groups(t) >= 512)
        .unwrap_or_else(|| {
            order
                .into_iter()
                .max_by_key(|&t| groups(t))
                .unwrap_or(TILE_SMALL)
        })
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

/// Which kernel family a product runs on: the canonical f32 kernels, or a fast path's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct KernelChoice {
    /// B is packed f16 (offsets, strides and `ldb` in f16 elements).
    pub b_f16: bool,
    pub shader_f16: bool,
    pub subgroups: bool,
}

pub(crate) fn gpu_matmul(
    gb: &GpuBackend,
    (ta, oa): (&GpuTensor, usize),
    (tb, ob): (&GpuTensor, usize),
    (tc, oc): (&GpuTensor, usize),
    g: &Gemm,
    tile: Option<Tile>,
    choice: KernelChoice,
) -> Result<()> {
    if g.m == 0 || g.n == 0 || g.batches() == 0 {
        return Ok(());
    }
    let forced = tile.is_some();
    let tile = tile.unwrap_or_else(|| choose_tile(g));
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
    let opts = GemmOpts {
        trans_a: g.trans_a,
        trans_b: g.trans_b,
        b_f16: choice.b_f16,
        shader_f16: choice.shader_f16,
        fault: gb.planted_fault(),
    };
    let [ea, eb, ec] = g.extents();
    let max_z = gb.limits.max_compute_workgroups_per_dimension as usize;
    let single = ta.chunks.len() == 1 && tb.chunks.len() == 1 && tc.chunks.len() == 1;
    // Packed-f16 B counts f16 elements while its tensor counts u32 words: find the words, then express
    // the offset inside the buffer in f16 elements again.
    let locate =
        |t: &GpuTensor, first: usize, last: usize, what: &str| -> Result<(wgpu::Buffer, usize)> {
            if choice.b_f16 && what == "B" {
                let (b, w) = locate(t, first / 2, last / 2, what)?;
                Ok((b, 2 * w + first % 2))
            } else {
                locate(t, first, last, what)
            }
        };
    if g.k == 0 {
        // An empty sum: C = beta · C. The kernels read nothing from A and B then; a dummy buffer stands
        // in for the empty tensors (which own no element to bind at).
        let dummy = gb.scratch("dummy", 1)?;
        let (bc, lc) = locate(tc, oc, oc + ec.max(1) - 1, "C")?;
        let pipe = pipeline(
            gb,
            TILE_SMALL,
            GemmOpts {
                trans_a: g.trans_a,
                trans_b: g.trans_b,
                ..GemmOpts::default()
            },
        )?;
        let p = params(g, [0, 0, lc], g.m, g.n, 0, g.beta);
        let d = &dummy.chunks[0].buffer;
        return gb.dispatch(
            &pipe,
            &p,
            &[d, d, &bc],
            [
                g.n.div_ceil(32) as u32,
                g.m.div_ceil(32) as u32,
                g.batches() as u32,
            ],
        );
    }
    if choice.b_f16 && tb.chunks.len() != 1 {
        return Err(Error::Shape {
            op: "matmul",
            msg: "an f16-packed weight must lie in one buffer".into(),
        });
    }
    if single && g.m <= 8 && g.batches() == 1 && !g.trans_a && g.trans_b && !forced {
        let (ba, la) = locate(ta, oa, oa + ea.max(1) - 1, "A")?;
        let (bb, lb) = locate(tb, ob, ob + eb.max(1) - 1, "B")?;
        let (bc, lc) = locate(tc, oc, oc + ec.max(1) - 1, "C")?;
        let key = format!(
            "gemv_{}{}",
            opts.key(),
            if choice.subgroups { "_sg" } else { "" }
        );
        let pipe = gb.pipeline(
            &key,
            &[Access::Read, Access::Read, Access::ReadWrite],
            PipelineOptions::default(),
            || wgsl::gemv_source(opts, choice.subgroups),
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
        return gb.dispatch(&pipe, &p, &[&ba, &bb, &bc], gb.grid(g.n.div_ceil(8)));
    }
    let pipe = pipeline(gb, tile, opts)?;
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
        let (bb, lb) = locate(tb, ob, ob + eb.max(1) - 1, "B")?;
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
            let (bb, lb) = locate(tb, sb, sb + eb1.max(1) - 1, "B")?;
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
                let (bb, lb) = locate(tb, b_first, b_last, "B")?;
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
) -> Result<std::rc::Rc<crate::gpu::Pipeline>> {
    let key = format!("gemm_{}_{}", opts.key(), tile.key());
    gb.pipeline(
        &key,
        &[Access::Read, Access::Read, Access::ReadWrite],
        PipelineOptions::default(),
        || gemm_source(tile, opts),
    )
}

/// The subgroup path's gate at one shape: the decode kernel (m <= 8) reducing with `subgroupAdd`, and
/// the tiled kernel otherwise (unchanged by the path), against the CPU twin.
#[cfg(not(target_arch = "wasm32"))]
pub fn gate_evaluate_subgroups(
    be: &Backend,
    c: &crate::gate::GateCase,
    seed: u64,
) -> Result<crate::gate::CaseOutput> {
    let choice = KernelChoice {
        subgroups: true,
        ..KernelChoice::default()
    };
    crate::gate::paths::evaluate_nt(be, c, seed, false, |g, x, w, out| {
        gpu_matmul(
            g,
            (x, 0),
            (w, 0),
            (out, 0),
            &Gemm::nt(c.m, c.n, c.k),
            None,
            choice,
        )
    })
}

#[cfg(target_arch = "wasm32")]
pub fn gate_evaluate_subgroups(
    _: &Backend,
    _: &crate::gate::GateCase,
    _: u64,
) -> Result<crate::gate::CaseOutput> {
    Err(Error::Shape {
        op: "gate",
        msg: "gates run asynchronously on the web".into(),
    })
}

#[cfg(test)]
mod tests;
