//! Decode products with their neighbours folded in.
//!
//! A decode step is bound by how many dispatches it records (each costs microseconds on the fastest GPUs,
//! whatever its size), so the small ops around a projection ride inside it: the RMSNorm before a
//! projection, the GLU before the down projection, the merge of a lone row's attention splits before
//! the output projection, the residual addition after the output and down projections.
//! [`matmul_fused`] computes exactly what the separate ops compute, in their order (norm, then product,
//! then addition); where no fused kernel applies — the CPU backend, f32 weights (the canonical path),
//! rows too long for workgroup memory, tensors split across buffers — it runs those ops one by one.
//!
//! ```text
//!   input:  Rows(x)                 x
//!           RmsNorm { x, w, eps }   x / rms(x) · w           (per row, as ops::norm computes it)
//!           Glu { act, gate, up }   act(gate) · up           (as ops::glu computes it)
//!           Merge { part, .. }      one row's attention splits merged (as attention::merge_splits does)
//!   output: Store                   y  = input · Wᵀ
//!           Accumulate              y += input · Wᵀ          (as ops::add::add_assign adds)
//! ```

use super::quant::gpu::{Stage, qmatmul_staged, staged_fits};
use super::{Gemm, RowMode, Weights, matmul};
use crate::backend::{Backend, TMut, TRef};
use crate::error::{Result, shape};
use crate::ops::add::add_assign;
use crate::ops::glu::{Activation, glu, glu_rows};
use crate::ops::norm::{NormKind, NormShape, add_rms_norm, norm_forward};
use crate::path::{PathId, PathSet};

pub use super::quant::gpu::Output;

/// What a fused product multiplies: m rows of k.
#[derive(Clone, Copy)]
pub enum Input<'a> {
    /// x as it is, rows contiguous.
    Rows(TRef<'a>),
    /// RMSNorm(x) · w per row (x's rows contiguous, w of k elements).
    RmsNorm { x: TRef<'a>, w: TRef<'a>, eps: f32 },
    /// act(gate) · up, element by element; row i of gate (and of up) starts `ld` elements after row i − 1.
    Glu {
        act: Activation,
        gate: TRef<'a>,
        up: TRef<'a>,
        ld: usize,
    },
    /// One row (m = 1): the merge of an attention's `n_split` splits per head
    /// ([`crate::ops::attention::Attended::Splits`]); k = heads · head_dim.
    Merge {
        part: TRef<'a>,
        heads: usize,
        head_dim: usize,
        n_split: usize,
    },
}

/// y (+)= input · Wᵀ: `m` rows of `k` through the N x K matrix `w` into `m` contiguous rows of y, with
/// the ops around it fused into the product where a fused kernel applies. With [`RowMode::Independent`]
/// each row is computed as it would be alone (the fused kernels always do).
#[allow(clippy::too_many_arguments)]
pub fn matmul_fused<'w>(
    be: &Backend,
    paths: PathSet,
    mode: RowMode,
    input: Input<'_>,
    w: impl Into<Weights<'w>>,
    mut y: TMut<'_>,
    [m, n, k]: [usize; 3],
    out: Output,
) -> Result<()> {
    let w = w.into();
    if m == 0 {
        return Ok(());
    }
    if let Input::Glu { ld, .. } = input
        && m > 1
        && ld < k
    {
        return Err(shape(
            "matmul_fused",
            format!("GLU rows {ld} apart overlap rows of {k}"),
        ));
    }
    if let Input::Merge {
        heads, head_dim, ..
    } = input
        && (m != 1 || heads * head_dim != k)
    {
        return Err(shape(
            "matmul_fused",
            format!(
                "a merged input is one row of heads x head_dim = {k}, not {m} rows of {heads} x {head_dim}"
            ),
        ));
    }
    // Rows of a decode batch take the norm and the GLU as dispatches of their own: a staged kernel
    // computes its rows' norm or GLU again in every workgroup, which for 8 rows cost more than the
    // product (H200, a 16-row pass of the SmolLM2-135M shape: the normed products 27 µs per 8 rows
    // against 11 µs for one row; the GLU's down projection 46 µs for 16 rows, 4 per workgroup).
    // The norm and GLU kernels compute what the stages compute (`Stage::RmsNorm`, `Stage::Glu`), so
    // each row's numbers are those of one row alone. A software adapter takes them apart for every
    // product ([`stages_pay`]), with the same numbers.
    let apart = matches!(input, Input::RmsNorm { .. } | Input::Glu { .. })
        && ((mode == RowMode::Independent && m > 1) || !stages_pay(be));
    if !apart && let Some(done) = try_staged(be, paths, mode, input, w, &mut y, [m, n, k], out) {
        return done;
    }
    // The ops one by one, through scratch tensors.
    let staged_x;
    let x = match input {
        Input::Rows(x) => x,
        Input::RmsNorm { x, w: nw, eps } => {
            let mut t = be.scratch("fused_in", m * k, k)?;
            let mut stats = be.scratch("fused_stats", 2 * m, 1)?;
            let shape = NormShape {
                rows: m,
                cols: k,
                eps,
            };
            norm_forward(
                be,
                NormKind::Rms,
                x,
                nw,
                t.at_mut(0),
                stats.at_mut(0),
                shape,
            )?;
            staged_x = t;
            staged_x.at(0)
        }
        Input::Glu { act, gate, up, ld } => {
            let mut t = be.scratch("fused_in", m * k, k)?;
            // One dispatch for all rows, unless a tensor split across buffers cuts a row of gate or
            // up (its chunks split at its own unit, which need not be `ld` from these offsets).
            let whole = |t: TRef<'_>| t.tensor().gpu().is_none_or(|g| g.num_chunks() == 1);
            if m == 1 || ld == k {
                glu(be, act, gate, up, t.at_mut(0), m * k)?;
            } else if whole(gate) && whole(up) {
                glu_rows(be, act, gate, up, ld, t.at_mut(0), m, k)?;
            } else {
                for i in 0..m {
                    glu(
                        be,
                        act,
                        gate.shift(i * ld),
                        up.shift(i * ld),
                        t.at_mut(i * k),
                        k,
                    )?;
                }
            }
            staged_x = t;
            staged_x.at(0)
        }
        Input::Merge {
            part,
            heads,
            head_dim,
            n_split,
        } => {
            let mut t = be.scratch("fused_in", k, k)?;
            crate::ops::attention::merge_splits(be, part, t.at_mut(0), heads, head_dim, n_split)?;
            staged_x = t;
            staged_x.at(0)
        }
    };
    let g = Gemm {
        rows: mode,
        ..Gemm::nt(m, n, k)
    };
    match out {
        Output::Store => matmul(be, paths, x, w, y, &g),
        Output::Accumulate => {
            // The plain product adds to y itself where the quantized kernel takes it.
            if let Some(done) =
                try_staged(be, paths, mode, Input::Rows(x), w, &mut y, [m, n, k], out)
            {
                return done;
            }
            let mut t = be.scratch("fused_out", m * n, n)?;
            matmul(be, paths, x, w, t.at_mut(0), &g)?;
            add_assign(be, y, t.at(0), m * n, 1.0)
        }
    }
}

/// Where [`matmul_residual_norm`] left the new residual stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residual {
    /// In `next` (x is unchanged): the product took the addition in.
    Moved,
    /// In x (the ops ran one by one).
    InPlace,
}

/// Whether a product should compute its input's norm or GLU in every workgroup (`Stage::RmsNorm`,
/// `Stage::Glu`) rather than take it from a dispatch of its own: where a post-norm rides in the next
/// product too ([`residual_norm_pays`]: on a GPU, not on a software adapter, whose repeated sums and
/// barrier steps are CPU time: lavapipe, Gemma-3-270M's low-end decode, its 262,144-row head took 194 ms
/// of a 407 ms token with the norm inside, the same product without it 108 ms; SmolLM2-135M decoded
/// 5.1-5.7 tok/s with the stages, 7.5-8.0 without). This crate's tests keep the stages everywhere, so
/// the staged kernels GPUs run are checked on lavapipe.
fn stages_pay(be: &Backend) -> bool {
    cfg!(test) || residual_norm_pays(be)
}

/// Whether a post-normed output should wait for the next product to take it in
/// ([`matmul_residual_norm`]) rather than join x by a dispatch of its own: on a GPU, yes; on a software
/// adapter (lavapipe) no, since every workgroup's repeated norms cost CPU time there (Gemma-3-270M's
/// low-end decode on lavapipe fell from 1.2 to 0.8 tok/s with them), and on the CPU backend there is
/// nothing to fuse. The one rule for the stages of the decode products ([`stages_pay`]).
pub fn residual_norm_pays(be: &Backend) -> bool {
    be.as_gpu().is_some_and(|g| !g.is_software())
}

/// y (+)= RMSNorm(x') · w_norm · Wᵀ with x' = x + RMSNorm(d) · post: a post-normed sublayer output
/// joining the residual stream (Gemma 3), then the next sublayer's norm and its first product. For one
/// row with the fused kernel at hand, in one dispatch that writes x' to `next` (x must not be read after
/// it: the caller swaps the two); otherwise `add_rms_norm` into x, then [`matmul_fused`] with the norm.
/// Either way the numbers are those of the ops one by one.
#[allow(clippy::too_many_arguments)]
pub fn matmul_residual_norm<'w>(
    be: &Backend,
    paths: PathSet,
    mode: RowMode,
    (mut x, next): (TMut<'_>, TMut<'_>),
    d: TRef<'_>,
    (post, w_norm, eps): (TRef<'_>, TRef<'_>, f32),
    w: impl Into<Weights<'w>>,
    mut y: TMut<'_>,
    [m, n, k]: [usize; 3],
    out: Output,
) -> Result<Residual> {
    let w = w.into();
    if m == 0 {
        return Ok(Residual::InPlace);
    }
    if m == 1
        && let (Backend::Gpu(g), Weights::Quant(q)) = (be, w)
        && let Some(parts) = q.gpu_parts()
        && paths.has(PathId::QuantMatmul)
        && q.rows() == n
        && q.cols() == k
        && staged_fits(g, q.kind(), [m, n, k], Stage::ResidualNorm { eps })
    {
        fn span(
            t: &crate::backend::Tensor,
            at: usize,
            len: usize,
        ) -> Option<(&wgpu::Buffer, usize)> {
            t.gpu().and_then(|g| g.span(at, len))
        }
        let places = (
            span(x.tensor(), x.offset(), k),
            span(d.tensor(), d.offset(), k),
            span(post.tensor(), post.offset(), k),
            span(w_norm.tensor(), w_norm.offset(), k),
            span(next.tensor(), next.offset(), k),
            span(y.tensor(), y.offset(), n),
        );
        if let (Some(xp), Some(dp), Some(pp), Some(wp), Some(np), Some(yp)) = places {
            if std::ptr::eq(xp.0, np.0) && xp.1.abs_diff(np.1) < k {
                return Err(shape(
                    "matmul_residual_norm",
                    "the new residual stream overlaps the one it is computed from",
                ));
            }
            qmatmul_staged(
                g,
                xp,
                yp,
                &[wp, dp, pp, np],
                parts,
                q.kind(),
                Stage::ResidualNorm { eps },
                out,
                [m, n, k, n],
                mode == RowMode::Independent,
                paths.fault(),
                paths.has(PathId::CoopQuant),
            )?;
            return Ok(Residual::Moved);
        }
    }
    let s = NormShape {
        rows: m,
        cols: k,
        eps,
    };
    add_rms_norm(be, x.reborrow(), d, post, s)?;
    let input = Input::RmsNorm {
        x: x.as_ref(),
        w: w_norm,
        eps,
    };
    matmul_fused(be, paths, mode, input, w, y.reborrow(), [m, n, k], out)?;
    Ok(Residual::InPlace)
}

/// The fused kernel, when one applies: quantized blocks on the GPU with the quantized path held, rows
/// that fit workgroup memory (or a prompt's rows added to y: the GEMM adds them), every operand in one
/// buffer. None: run the ops one by one.
#[allow(clippy::too_many_arguments)]
fn try_staged(
    be: &Backend,
    paths: PathSet,
    mode: RowMode,
    input: Input<'_>,
    w: Weights<'_>,
    y: &mut TMut<'_>,
    [m, n, k]: [usize; 3],
    out: Output,
) -> Option<Result<()>> {
    let (Backend::Gpu(g), Weights::Quant(q)) = (be, w) else {
        return None;
    };
    let parts = q.gpu_parts()?;
    if !paths.has(PathId::QuantMatmul) || q.rows() != n || q.cols() != k {
        return None;
    }
    let yb = y
        .gpu("matmul_fused", "y", m * n)
        .ok()?
        .span(y.offset(), m * n)?;
    let (x, norm_w, stage) = match input {
        // A plain product is already one dispatch; only the output may differ.
        Input::Rows(x) => (
            x.gpu("matmul_fused", "x", m * k)
                .ok()?
                .span(x.offset(), m * k)?,
            None,
            Stage::Plain,
        ),
        Input::RmsNorm { x, w: nw, eps } => (
            x.gpu("matmul_fused", "x", m * k)
                .ok()?
                .span(x.offset(), m * k)?,
            Some(nw.gpu("matmul_fused", "w", k).ok()?.span(nw.offset(), k)?),
            Stage::RmsNorm { eps },
        ),
        Input::Glu { act, gate, up, ld } => {
            // gate and up in one buffer: the kernel reads both through x's binding.
            let span = |t: TRef<'_>| (m - 1) * ld + k + t.offset();
            let (lo, hi) = (gate.offset().min(up.offset()), span(gate).max(span(up)));
            if !std::ptr::eq(gate.tensor(), up.tensor()) {
                return None;
            }
            let (buf, at) = gate.tensor().gpu()?.span(lo, hi - lo)?;
            let base = |t: TRef<'_>| at + t.offset() - lo;
            (
                (buf, base(gate)),
                None,
                Stage::Glu {
                    act,
                    up: base(up),
                    ld,
                },
            )
        }
        Input::Merge {
            part,
            heads,
            head_dim,
            n_split,
        } => {
            let len = crate::ops::attention::split_len(1, heads, head_dim, n_split);
            (
                part.gpu("matmul_fused", "part", len)
                    .ok()?
                    .span(part.offset(), len)?,
                None,
                Stage::Merge {
                    heads,
                    head_dim,
                    n_split,
                },
            )
        }
    };
    if (stage == Stage::Plain && out == Output::Store)
        || !staged_fits(g, q.kind(), [m, n, k], stage)
    {
        return None;
    }
    let extra: Vec<(&wgpu::Buffer, usize)> = norm_w.into_iter().collect();
    Some(qmatmul_staged(
        g,
        x,
        yb,
        &extra,
        parts,
        q.kind(),
        stage,
        out,
        [m, n, k, n],
        mode == RowMode::Independent,
        paths.fault(),
        paths.has(PathId::CoopQuant),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Tensor;
    use crate::ops::matmul::quant::{QMatrix, quantize_q4, quantize_q8_32};
    use crate::quant::Q8Matrix;
    use crate::testing::{Arg, SeedRng, assert_nmse, check_twin, gpu_backend};

    /// The three block layouts of one random matrix.
    fn matrices(rng: &mut SeedRng, n: usize, k: usize) -> Vec<crate::ops::matmul::QuantSource> {
        let w = rng.normal_vec(n * k, 0.05);
        let q8 = quantize_q8_32(&w, n, k);
        // Q6_K's layout: 16-value blocks.
        let q16 = Q8Matrix {
            block: 16,
            scales: (0..n * k / 16).map(|i| q8.scales[i / 2] * 0.5).collect(),
            ..q8.clone()
        };
        vec![q8.into(), q16.into(), quantize_q4(&w, n, k).into()]
    }

    fn inputs(act: usize) -> Activation {
        [Activation::Silu, Activation::Gelu][act]
    }

    /// Tensor order of every case: x (for GLU: [gate | up] rows), norm weight, y.
    #[allow(clippy::too_many_arguments)]
    fn run_case(
        be: &Backend,
        t: &mut [Tensor],
        w: &QMatrix,
        which: usize,
        out: Output,
        m: usize,
        one_by_one: bool,
        mode: RowMode,
    ) -> Result<()> {
        let (n, k) = (w.rows(), w.cols());
        let paths = PathSet::of(&[PathId::QuantMatmul]);
        let [x, nw, y] = t else { unreachable!() };
        let input = match which {
            0 => Input::Rows(x.at(0)),
            1 => Input::RmsNorm {
                x: x.at(0),
                w: nw.at(0),
                eps: 1e-6,
            },
            a => Input::Glu {
                act: inputs(a - 2),
                gate: x.at(1),
                up: x.at(1 + k),
                ld: 2 * k + 3,
            },
        };
        if !one_by_one {
            return matmul_fused(be, paths, mode, input, w, y.at_mut(0), [m, n, k], out);
        }
        // The ops one by one, as the model ran them before they were fused.
        let mut xin = be.zeros(m * k, k)?;
        let mut stats = be.zeros(2 * m, 1)?;
        match input {
            Input::Rows(x) => crate::ops::fill::copy(be, x, xin.at_mut(0), m * k)?,
            Input::RmsNorm { x, w: nw, eps } => {
                let shape = NormShape {
                    rows: m,
                    cols: k,
                    eps,
                };
                norm_forward(
                    be,
                    NormKind::Rms,
                    x,
                    nw,
                    xin.at_mut(0),
                    stats.at_mut(0),
                    shape,
                )?
            }
            Input::Glu { act, gate, up, ld } => {
                for i in 0..m {
                    glu(
                        be,
                        act,
                        gate.shift(i * ld),
                        up.shift(i * ld),
                        xin.at_mut(i * k),
                        k,
                    )?;
                }
            }
            Input::Merge { .. } => unreachable!("run_case builds no merged input"),
        }
        let mut prod = be.zeros(m * n, n)?;
        let g = Gemm {
            rows: mode,
            ..Gemm::nt(m, n, k)
        };
        matmul(be, paths, xin.at(0), w, prod.at_mut(0), &g)?;
        match out {
            Output::Store => crate::ops::fill::copy(be, prod.at(0), y.at_mut(0), m * n),
            Output::Accumulate => add_assign(be, y.at_mut(0), prod.at(0), m * n, 1.0),
        }
    }

    /// Every input, output and layout, fused on the GPU against the CPU twin (itself the ops one by one)
    /// and, on the same GPU, against the ops one by one; with split tensors the ops run one by one.
    #[test]
    fn fused_products_match_the_ops_one_by_one() {
        let mut rng = SeedRng::new(41);
        // One device for every case (one opened per case exhausted an H100's driver).
        let gpu = gpu_backend(None);
        for (n, k) in [(33, 576), (65, 640), (40, 1536), (9, 4096)] {
            let srcs = matrices(&mut rng, n, k);
            for which in 0..4 {
                for out in [Output::Store, Output::Accumulate] {
                    // 40 rows: a prompt's plain product added to y takes the GEMM with the
                    // addition in its store (a decode batch's rows stay on the gemv kernels).
                    let ms: &[usize] = if which == 0 {
                        &[1, 3, 8, 17, 40]
                    } else {
                        &[1, 3, 8, 17]
                    };
                    for &m in ms {
                        let x_len = if which >= 2 {
                            m * (2 * k + 3) + 1
                        } else {
                            m * k
                        };
                        let x = rng.normal_vec(x_len, 1.0);
                        let nw = rng.vec(k, 0.5, 1.5);
                        let y = rng.vec(m * n, -1.0, 1.0);
                        let args = [
                            Arg::data(x, if which >= 2 { 1 } else { k }),
                            Arg::data(nw, k),
                            Arg::data(y, n),
                        ];
                        let name = format!("fused n={n} k={k} input {which} {out:?} m={m}");
                        let unit = Some((k as u64) * 8);
                        let want = check_twin(&name, 1e-11, &args, unit, |be, t| {
                            for src in &srcs {
                                let w = QMatrix::upload(
                                    be,
                                    src.clone(),
                                    PathSet::of(&[PathId::QuantMatmul]),
                                )?;
                                run_case(be, t, &w, which, out, m, false, RowMode::Shared)?;
                            }
                            Ok(())
                        });
                        // On the GPU: fused against one by one, rows sharing a pass and rows of a
                        // decode batch (whose norm and GLU run apart), on the quantized kernels.
                        let Some(g) = gpu.as_ref() else { continue };
                        let mut got = Vec::new();
                        for (one, mode) in [
                            (false, RowMode::Shared),
                            (true, RowMode::Shared),
                            (false, RowMode::Independent),
                            (true, RowMode::Independent),
                        ] {
                            let mut t: Vec<Tensor> = args
                                .iter()
                                .map(|a| g.from_f32(a.data.as_ref().unwrap(), a.unit).unwrap())
                                .collect();
                            for src in &srcs {
                                let w = QMatrix::upload(
                                    g,
                                    src.clone(),
                                    PathSet::of(&[PathId::QuantMatmul]),
                                )
                                .unwrap();
                                run_case(g, &mut t, &w, which, out, m, one, mode).unwrap();
                            }
                            got.push(g.to_vec(&t[2]).unwrap());
                        }
                        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                        // 9 to 31 rows sharing a pass may take the tiled kernel (its own order of
                        // sums); rows of a decode batch always take the one-row kernel's.
                        let tiled = 8 < m && m < 32;
                        if !tiled {
                            assert_eq!(bits(&got[1]), bits(&got[0]), "{name}: fused vs one by one");
                        }
                        assert_eq!(
                            bits(&got[3]),
                            bits(&got[2]),
                            "{name}: a decode batch, fused vs one by one"
                        );
                        if m <= 8 {
                            assert_eq!(
                                bits(&got[2]),
                                bits(&got[0]),
                                "{name}: a decode batch's rows vs fused"
                            );
                        }
                        assert_nmse(
                            &format!("{name}: batch rows vs cpu"),
                            &want[2],
                            &got[2],
                            1e-11,
                        );
                        assert_nmse(&format!("{name}: gpu vs cpu"), &want[2], &got[0], 1e-11);
                    }
                }
            }
        }
    }

    /// A decode row's attention splits merged on the product's way in (`Input::Merge`) against the
    /// CPU twin and, on the GPU, bit for bit against the merge kernel then the product: heads of 64,
    /// 256 and 32 dimensions, 2 to 20 splits with empty ones among them (their maxima, larger than
    /// every other, must not count), and more (head, split) pairs than the stage holds (the merge
    /// kernel then runs first).
    #[test]
    fn merged_input_matches_the_merge_then_the_product() {
        use crate::ops::attention::merge_splits;
        let mut rng = SeedRng::new(42);
        let paths = PathSet::of(&[PathId::QuantMatmul]);
        let gpu = gpu_backend(None);
        for (heads, hd, n_split) in [
            (9, 64, 2),
            (9, 64, 20),
            (4, 256, 7),
            (2, 32, 3),
            (9, 64, 60),
        ] {
            let (k, n) = (heads * hd, 40);
            let stride = hd + 2;
            let mut part = rng.normal_vec(heads * n_split * stride, 1.0);
            for h in 0..heads {
                for sp in 0..n_split {
                    let at = (h * n_split + sp) * stride;
                    // Every third split of a head past its first is empty.
                    let empty = sp > 0 && (sp + h) % 3 == 0;
                    part[at] = if empty {
                        100.0
                    } else {
                        rng.vec(1, -3.0, 3.0)[0]
                    };
                    part[at + 1] = if empty { 0.0 } else { rng.vec(1, 0.5, 5.0)[0] };
                }
            }
            let w = rng.normal_vec(n * k, 0.05);
            let src: crate::ops::matmul::QuantSource = quantize_q8_32(&w, n, k).into();
            for out in [Output::Store, Output::Accumulate] {
                let args = [
                    Arg::data(part.clone(), part.len()),
                    Arg::data(rng.vec(n, -1.0, 1.0), n),
                ];
                let name = format!("merged {heads}x{hd}, {n_split} splits, {out:?}");
                let run = |be: &Backend, t: &mut [Tensor], one: bool| -> Result<()> {
                    let [p, y] = t else { unreachable!() };
                    let w = QMatrix::upload(be, src.clone(), paths)?;
                    let input = if one {
                        let mut x = be.zeros(k, k)?;
                        merge_splits(be, p.at(0), x.at_mut(0), heads, hd, n_split)?;
                        let done = matmul_fused(
                            be,
                            paths,
                            RowMode::Shared,
                            Input::Rows(x.at(0)),
                            &w,
                            y.at_mut(0),
                            [1, n, k],
                            out,
                        );
                        return done;
                    } else {
                        Input::Merge {
                            part: p.at(0),
                            heads,
                            head_dim: hd,
                            n_split,
                        }
                    };
                    matmul_fused(
                        be,
                        paths,
                        RowMode::Shared,
                        input,
                        &w,
                        y.at_mut(0),
                        [1, n, k],
                        out,
                    )
                };
                check_twin(&name, 1e-11, &args, None, |be, t| run(be, t, false));
                let Some(g) = gpu.as_ref() else { continue };
                let got: Vec<Vec<u32>> = [false, true]
                    .iter()
                    .map(|&one| {
                        let mut t: Vec<Tensor> = args
                            .iter()
                            .map(|a| g.from_f32(a.data.as_ref().unwrap(), a.unit).unwrap())
                            .collect();
                        run(g, &mut t, one).unwrap();
                        g.to_vec(&t[1])
                            .unwrap()
                            .iter()
                            .map(|v| v.to_bits())
                            .collect()
                    })
                    .collect();
                assert_eq!(
                    got[0], got[1],
                    "{name}: merged in the product vs merge then product"
                );
            }
        }
    }

    /// A post-normed output joining the residual stream, the next norm and the product in one
    /// dispatch (one row, x' into a tensor of its own) against add_rms_norm then the normed product on
    /// the same backend, bit for bit; rows of a batch take the ops; the GPU against the CPU twin.
    #[test]
    fn residual_norm_product_matches_the_ops_one_by_one() {
        use crate::ops::matmul::quant::QKind;
        use crate::testing::{cpu_backend, poisoned};
        let mut rng = SeedRng::new(43);
        let paths = PathSet::of(&[PathId::QuantMatmul]);
        let gpu = gpu_backend(None);
        for (n, k, m) in [(96, 640, 1), (33, 576, 1), (40, 1536, 2), (17, 2048, 1)] {
            let x = rng.normal_vec(m * k, 1.0);
            let d = rng.normal_vec(m * k, 3.0);
            let post = rng.vec(k, 0.5, 1.5);
            let nw = rng.vec(k, 0.5, 1.5);
            for src in matrices(&mut rng, n, k) {
                for out in [Output::Store, Output::Accumulate] {
                    let y0 = rng.vec(m * n, -1.0, 1.0);
                    let mut results = Vec::new();
                    for be in gpu.iter().chain([&cpu_backend()]) {
                        let w = QMatrix::upload(be, src.clone(), paths).unwrap();
                        let mut tx = be.from_f32(&x, k).unwrap();
                        let mut tn = poisoned(be, m * k, k).unwrap();
                        let (td, tp, tw) = (
                            be.from_f32(&d, k).unwrap(),
                            be.from_f32(&post, k).unwrap(),
                            be.from_f32(&nw, k).unwrap(),
                        );
                        let mut ty = be.from_f32(&y0, n).unwrap();
                        let how = matmul_residual_norm(
                            be,
                            paths,
                            RowMode::Independent,
                            (tx.at_mut(0), tn.at_mut(0)),
                            td.at(0),
                            (tp.at(0), tw.at(0), 1e-6),
                            &w,
                            ty.at_mut(0),
                            [m, n, k],
                            out,
                        )
                        .unwrap();
                        let what =
                            format!("n={n} k={k} m={m} {:?} {out:?} on {}", w.kind(), be.kind());
                        // Q4 takes nine storage bindings: past WebGPU's default eight.
                        let fused = m == 1
                            && match be {
                                Backend::Gpu(g) => {
                                    w.kind() != QKind::Q4
                                        || g.limits.max_storage_buffers_per_shader_stage >= 9
                                }
                                Backend::Cpu(_) => false,
                            };
                        assert_eq!(how == Residual::Moved, fused, "{what}: where x' went");
                        let x1 = be.to_vec(if fused { &tn } else { &tx }).unwrap();
                        if fused {
                            assert_eq!(
                                be.to_vec(&tx).unwrap(),
                                x,
                                "{what}: x is read, not written"
                            );
                        }
                        // The ops one by one on the same backend.
                        let mut rx = be.from_f32(&x, k).unwrap();
                        let mut ry = be.from_f32(&y0, n).unwrap();
                        let shape = NormShape {
                            rows: m,
                            cols: k,
                            eps: 1e-6,
                        };
                        add_rms_norm(be, rx.at_mut(0), td.at(0), tp.at(0), shape).unwrap();
                        let input = Input::RmsNorm {
                            x: rx.at(0),
                            w: tw.at(0),
                            eps: 1e-6,
                        };
                        let mode = RowMode::Independent;
                        matmul_fused(be, paths, mode, input, &w, ry.at_mut(0), [m, n, k], out)
                            .unwrap();
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        let y1 = be.to_vec(&ty).unwrap();
                        assert_eq!(bits(&x1), bits(&be.to_vec(&rx).unwrap()), "{what}: x'");
                        assert_eq!(bits(&y1), bits(&be.to_vec(&ry).unwrap()), "{what}: y");
                        results.push((x1, y1));
                    }
                    if let [(gx, gy), (cx, cy)] = &results[..] {
                        assert_nmse("x' GPU vs CPU", cx, gx, 1e-11);
                        assert_nmse("y GPU vs CPU", cy, gy, 1e-9);
                    }
                }
            }
        }
    }
}
