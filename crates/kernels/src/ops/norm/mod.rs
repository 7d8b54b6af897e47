//! LayerNorm (without bias, as TinyGPT's GPT uses it) and RMSNorm (llama, Gemma), forward and backward.
//!
//! Row statistics live in one `stats` tensor of `2 * rows` elements: the rows' means (zero for RMSNorm)
//! followed by their reciprocal standard deviations, saved by the forward pass for the backward pass.

use super::Grad;
use super::common::{Grid, PRELUDE, ROW_REDUCE, ROWS4, kernel, kernel_parts, row_kernel, run};
use super::fastmath;
use crate::backend::{Backend, TMut, TRef};
use crate::error::{Error, Result};
use crate::gpu::{Access, GpuBackend, Operand, segments};
use crate::ops::matmul::pack_f16_of;
use rayon::prelude::*;

/// The forward kernels' parameters and bindings, the kernels (one row and four rows a workgroup), and
/// the declaration of the second statistics binding (dropped when the means and rstds share a buffer).
const FORWARD_PARAMS: &str = include_str!("forward_params.wgsl");
const FORWARD: &str = include_str!("forward.wgsl");
const FORWARD_ROWS4: &str = include_str!("forward_rows4.wgsl");
const STORE: &str = include_str!("store.wgsl");
const STORE_F16: &str = include_str!("store_f16.wgsl");
const SECOND_STATS: &str = "@group(0) @binding(5) var<storage, read_write> rstd_out: array<f32>;";

/// Which normalisation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// (x − mean) / std · w.
    Layer,
    /// x / rms · w.
    Rms,
}

/// Rows of `cols` elements.
#[derive(Clone, Copy, Debug)]
pub struct NormShape {
    pub rows: usize,
    pub cols: usize,
    pub eps: f32,
}

fn check(s: &NormShape) -> Result<()> {
    if s.cols == 0 || s.eps.is_nan() || s.eps < 0.0 {
        return Err(Error::Shape {
            op: "norm",
            msg: format!(
                "needs cols > 0 and eps >= 0, got cols {} eps {}",
                s.cols, s.eps
            ),
        });
    }
    Ok(())
}

/// CPU twin of one row's statistics: (mean, rstd).
#[inline(always)]
fn row_stats(kind: NormKind, x: &[f32], eps: f32) -> (f32, f32) {
    let inv = 1.0 / x.len() as f32;
    let mean = match kind {
        NormKind::Layer => fastmath::sum(x) * inv,
        NormKind::Rms => 0.0,
    };
    let q = fastmath::sum_by(x, |v| (v - mean) * (v - mean));
    (mean, 1.0 / (q * inv + eps).sqrt())
}

/// y = norm(x) · w per row; saves the row statistics into `stats`.
pub fn norm_forward(
    be: &Backend,
    kind: NormKind,
    x: TRef<'_>,
    w: TRef<'_>,
    mut y: TMut<'_>,
    mut stats: TMut<'_>,
    s: NormShape,
) -> Result<()> {
    check(&s)?;
    let (rows, cols) = (s.rows, s.cols);
    let n = rows * cols;
    match be {
        Backend::Cpu(c) => {
            let xs = x.cpu("norm", "x", n)?;
            let ws = w.cpu("norm", "w", cols)?;
            let ys = y.cpu("norm", "y", n)?;
            let st = stats.cpu("norm", "stats", 2 * rows)?;
            let (means, rstds) = st.split_at_mut(rows);
            c.install(|| {
                ys.par_chunks_mut(cols)
                    .zip(xs.par_chunks(cols))
                    .zip(means.par_iter_mut().zip(rstds.par_iter_mut()))
                    .for_each(|((yr, xr), (m, r))| {
                        let (mean, rstd) = row_stats(kind, xr, s.eps);
                        for ((yv, &xv), &wv) in yr.iter_mut().zip(xr).zip(ws) {
                            *yv = (xv - mean) * rstd * wv;
                        }
                        (*m, *r) = (mean, rstd);
                    })
            });
            Ok(())
        }
        Backend::Gpu(g) => {
            gpu_forward(g, kind, x, w, y, stats, s, rows >= FOUR_ROWS_FROM, Out::F32)
        }
    }
}

/// [`norm_forward`] with y rounded to f16 pairs: `rows · cols` values into `packed_len(rows · cols)`
/// words (the values [`norm_forward`] computes, each rounded as [`pack_f16`] rounds), for a tensor
/// only the tensor-core training products read (the block's normed inputs on that path). On the GPU,
/// rows of even length are written as pairs by the norm's own kernels; rows of odd length (pairs that
/// straddle rows) and the CPU twin form the f32 values in scratch, then pack them.
pub fn norm_forward_f16(
    be: &Backend,
    kind: NormKind,
    x: TRef<'_>,
    w: TRef<'_>,
    y: TMut<'_>,
    stats: TMut<'_>,
    s: NormShape,
) -> Result<()> {
    check(&s)?;
    let n = s.rows * s.cols;
    if let (Backend::Gpu(g), true) = (be, s.cols.is_multiple_of(2)) {
        let four_rows = s.rows >= FOUR_ROWS_FROM;
        return gpu_forward(g, kind, x, w, y, stats, s, four_rows, Out::F16);
    }
    pack_f16_of(be, "norm_forward_f16", (n, s.cols), y, |wide| {
        norm_forward(be, kind, x, w, wide, stats, s)
    })
}

/// How a forward kernel writes y: f32, or f16 pairs ([`norm_forward_f16`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Out {
    F32,
    F16,
}

/// Batches of at least this many rows take the four-rows-a-workgroup kernel (the same bits). Fewer rows
/// keep a workgroup each: on an H100 the four-row kernel's quarter as many workgroups made a decode
/// batch's norms (16 rows) 10.9 → 14.9 µs each and a 512-token prompt's 11.4 → 14.3 µs, where a training
/// step's (16,384 rows) took 975 → 559 µs in all.
const FOUR_ROWS_FROM: usize = 1024;

/// [`norm_forward`] on the GPU: one row per workgroup (forward.wgsl), or four (forward_rows4.wgsl,
/// which forms every sum in forward.wgsl's order). The fused decode kernels (matmul/fused.rs,
/// rope/cache.rs) stage the norm in that order too, and give the same bits.
#[allow(clippy::too_many_arguments)]
fn gpu_forward(
    g: &GpuBackend,
    kind: NormKind,
    x: TRef<'_>,
    w: TRef<'_>,
    y: TMut<'_>,
    stats: TMut<'_>,
    s: NormShape,
    four_rows: bool,
    out: Out,
) -> Result<()> {
    let (rows, cols) = (s.rows, s.cols);
    let n = rows * cols;
    let ts = stats.gpu("norm", "stats", 2 * rows)?;
    let y_row = if out == Out::F16 { cols / 2 } else { cols };
    let ops = [
        Operand::rows(x.gpu("norm", "x", n)?, x.offset(), cols),
        Operand::whole(w.gpu("norm", "w", cols)?, w.offset(), cols),
        Operand::rows(y.gpu("norm", "y", rows * y_row)?, y.offset(), y_row),
        Operand::rows(ts, stats.offset(), 1),
        Operand::rows(ts, stats.offset() + rows, 1),
    ];
    let extra = [cols as u32, s.eps.to_bits(), (kind == NormKind::Rms) as u32];
    let (name, body, rows4) = if four_rows {
        ("norm_forward_rows4", FORWARD_ROWS4, ROWS4)
    } else {
        ("norm_forward", FORWARD, "")
    };
    let (name, store) = match out {
        Out::F32 => (name.to_string(), STORE),
        Out::F16 => (format!("{name}_f16"), STORE_F16),
    };
    for seg in segments("norm_forward", rows, &ops)? {
        // WebGPU forbids two bindings of one buffer when either is written: when the means and
        // the rstds share a buffer (the usual case), the kernel writes both through one binding.
        let shared = seg.places[3].buffer == seg.places[4].buffer;
        let (key, nb) = if shared {
            (format!("{name}_shared"), 4)
        } else {
            (name.clone(), 5)
        };
        let mut access = vec![Access::Read, Access::Read];
        access.extend(std::iter::repeat_n(Access::ReadWrite, nb - 2));
        let pipe = g.pipeline(&key, &access, || {
            let params = match out {
                Out::F32 => FORWARD_PARAMS.to_string(),
                Out::F16 => FORWARD_PARAMS.replace("y: array<f32>", "y: array<u32>"),
            };
            let src = format!("{PRELUDE}\n{ROW_REDUCE}\n{rows4}\n{params}{store}\n{body}");
            if shared {
                src.replace(SECOND_STATS, "")
                    .replace("rstd_out[", "mean_out[")
            } else {
                src
            }
        })?;
        let mut p = vec![seg.len() as u32, seg.start as u32];
        p.extend(seg.places.iter().map(|pl| pl.offset as u32));
        p.extend_from_slice(&extra);
        let bufs: Vec<&wgpu::Buffer> = seg.places[..nb].iter().map(|pl| &pl.buffer).collect();
        let groups = if four_rows {
            seg.len().div_ceil(4)
        } else {
            seg.len()
        };
        g.dispatch(&pipe, &p, &bufs, g.grid(groups))?;
    }
    Ok(())
}

/// x += RMSNorm(d) · w per row of `cols` (Gemma 3's post-norms): [`norm_forward`] then
/// [`crate::ops::add::add_assign`] in one dispatch, with the same result (to the bit on a software
/// adapter; an H100 gave last-bit differences, most likely a multiply-add fused in one kernel only).
pub fn add_rms_norm(
    be: &Backend,
    mut x: TMut<'_>,
    d: TRef<'_>,
    w: TRef<'_>,
    s: NormShape,
) -> Result<()> {
    check(&s)?;
    let (rows, cols) = (s.rows, s.cols);
    let n = rows * cols;
    match be {
        Backend::Cpu(c) => {
            let ds = d.cpu("add_rms_norm", "d", n)?;
            let ws = w.cpu("add_rms_norm", "w", cols)?;
            let xs = x.cpu("add_rms_norm", "x", n)?;
            c.install(|| {
                xs.par_chunks_mut(cols)
                    .zip(ds.par_chunks(cols))
                    .for_each(|(xr, dr)| {
                        let (_, rstd) = row_stats(NormKind::Rms, dr, s.eps);
                        for ((xv, &dv), &wv) in xr.iter_mut().zip(dr).zip(ws) {
                            *xv += (dv - 0.0) * rstd * wv;
                        }
                    })
            });
            Ok(())
        }
        Backend::Gpu(g) => {
            let ops = [
                Operand::rows(x.gpu("add_rms_norm", "x", n)?, x.offset(), cols),
                Operand::rows(d.gpu("add_rms_norm", "d", n)?, d.offset(), cols),
                Operand::whole(w.gpu("add_rms_norm", "w", cols)?, w.offset(), cols),
            ];
            let pipe = row_kernel(
                g,
                "add_rms_norm",
                include_str!("add_norm.wgsl"),
                &[Access::ReadWrite, Access::Read, Access::Read],
            )?;
            run(
                g,
                "add_rms_norm",
                &pipe,
                rows,
                &ops,
                &[cols as u32, s.eps.to_bits()],
                Grid::Groups,
            )
        }
    }
}

/// Gradients of [`norm_forward`]: dx into `dx` and dw into `dw`, each overwritten or added to as
/// `dx_into` and `dw_into` say.
#[allow(clippy::too_many_arguments)]
pub fn norm_backward(
    be: &Backend,
    kind: NormKind,
    x: TRef<'_>,
    w: TRef<'_>,
    dy: TRef<'_>,
    stats: TRef<'_>,
    mut dx: TMut<'_>,
    mut dw: TMut<'_>,
    s: NormShape,
    dx_into: Grad,
    dw_into: Grad,
) -> Result<()> {
    check(&s)?;
    let (accumulate_dx, accumulate_dw) = (dx_into == Grad::Accumulate, dw_into == Grad::Accumulate);
    let (rows, cols) = (s.rows, s.cols);
    let n = rows * cols;
    match be {
        Backend::Cpu(c) => {
            let xs = x.cpu("norm_backward", "x", n)?;
            let ws = w.cpu("norm_backward", "w", cols)?;
            let dys = dy.cpu("norm_backward", "dy", n)?;
            let st = stats.cpu("norm_backward", "stats", 2 * rows)?;
            let (means, rstds) = st.split_at(rows);
            let dxs = dx.cpu("norm_backward", "dx", n)?;
            let inv = 1.0 / cols as f32;
            c.install(|| {
                dxs.par_chunks_mut(cols).enumerate().for_each(|(r, dxr)| {
                    let (mean, rstd) = (means[r], rstds[r]);
                    let (xr, dyr) = (&xs[r * cols..][..cols], &dys[r * cols..][..cols]);
                    let (mut sg, mut sgx) = (0.0f32, 0.0f32);
                    for c in 0..cols {
                        let g = dyr[c] * ws[c];
                        sg += g;
                        sgx += g * (xr[c] - mean) * rstd;
                    }
                    let mg = if kind == NormKind::Rms { 0.0 } else { sg * inv };
                    let mgx = sgx * inv;
                    for c in 0..cols {
                        let g = dyr[c] * ws[c];
                        let xh = (xr[c] - mean) * rstd;
                        let v = rstd * (g - mg - xh * mgx);
                        dxr[c] = if accumulate_dx { dxr[c] + v } else { v };
                    }
                })
            });
            let partial = c.install(|| {
                (0..rows)
                    .into_par_iter()
                    .with_min_len(64)
                    .fold(
                        || vec![0.0f32; cols],
                        |mut acc, r| {
                            let (mean, rstd) = (means[r], rstds[r]);
                            for c in 0..cols {
                                acc[c] += dys[r * cols + c] * (xs[r * cols + c] - mean) * rstd;
                            }
                            acc
                        },
                    )
                    .reduce(
                        || vec![0.0f32; cols],
                        |mut a, b| {
                            a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                            a
                        },
                    )
            });
            let dws = dw.cpu("norm_backward", "dw", cols)?;
            for (d, p) in dws.iter_mut().zip(partial) {
                *d = if accumulate_dw { *d + p } else { p };
            }
            Ok(())
        }
        Backend::Gpu(g) => gpu_backward(
            g,
            kind,
            x,
            w,
            dy,
            stats,
            dx,
            dw,
            s,
            accumulate_dx,
            accumulate_dw,
        ),
    }
}

/// Rows of x a workgroup of the fused backward kernel takes (as RB in backward_fused.wgsl).
const FUSED_ROWS: usize = 16;

#[allow(clippy::too_many_arguments)]
fn gpu_backward(
    g: &GpuBackend,
    kind: NormKind,
    x: TRef<'_>,
    w: TRef<'_>,
    dy: TRef<'_>,
    stats: TRef<'_>,
    dx: TMut<'_>,
    dw: TMut<'_>,
    s: NormShape,
    accumulate_dx: bool,
    accumulate_dw: bool,
) -> Result<()> {
    let (rows, cols) = (s.rows, s.cols);
    let n = rows * cols;
    let tx = x.gpu("norm_backward", "x", n)?;
    let tdy = dy.gpu("norm_backward", "dy", n)?;
    let ts = stats.gpu("norm_backward", "stats", 2 * rows)?;
    let tw = w.gpu("norm_backward", "w", cols)?;
    let tdx = dx.gpu("norm_backward", "dx", n)?;
    let ops = [
        Operand::rows(tx, x.offset(), cols),
        Operand::whole(tw, w.offset(), cols),
        Operand::rows(tdy, dy.offset(), cols),
        Operand::rows(ts, stats.offset(), 1),
        Operand::rows(ts, stats.offset() + rows, 1),
        Operand::rows(tdx, dx.offset(), cols),
    ];
    // dx and the weight gradient's partial sums (one per block of FUSED_ROWS rows and column, in a
    // scratch buffer) in one pass; then the partial sums added up per column.
    let segs = segments("norm_backward", rows, &ops)?;
    let blocks: usize = segs.iter().map(|sg| sg.len().div_ceil(FUSED_ROWS)).sum();
    let part = g.scratch("norm_dw_partial", blocks * cols)?;
    let pbuf = &part.chunks[0].buffer;
    let cpl = cols.div_ceil(64);
    let fused = kernel_parts(
        g,
        &format!("norm_backward_fused_c{cpl}"),
        &[
            ROW_REDUCE,
            ROWS4,
            &format!("const CPL: u32 = {cpl}u;"),
            include_str!("backward_fused.wgsl"),
        ],
        &[
            Access::Read,
            Access::Read,
            Access::Read,
            Access::Read,
            Access::Read,
            Access::ReadWrite,
            Access::ReadWrite,
        ],
    )?;
    let mut block0 = 0usize;
    for sg in &segs {
        let nb = sg.len().div_ceil(FUSED_ROWS);
        let mut params = vec![sg.len() as u32, sg.start as u32];
        params.extend(sg.places.iter().map(|pl| pl.offset as u32));
        params.extend([
            cols as u32,
            (kind == NormKind::Rms) as u32,
            accumulate_dx as u32,
            blocks as u32,
            block0 as u32,
        ]);
        let mut bufs: Vec<&wgpu::Buffer> = sg.places.iter().map(|pl| &pl.buffer).collect();
        bufs.push(pbuf);
        g.dispatch(&fused, &params, &bufs, g.grid(nb))?;
        block0 += nb;
    }
    let p2 = kernel(
        g,
        "norm_backward_dw_final",
        include_str!("backward_dw_final.wgsl"),
        &[Access::Read, Access::ReadWrite],
    )?;
    let tdw = dw.gpu("norm_backward", "dw", cols)?;
    let ops = [
        Operand::whole(&part, 0, blocks * cols),
        Operand::rows(tdw, dw.offset(), 1),
    ];
    run(
        g,
        "norm_backward",
        &p2,
        cols,
        &ops,
        &[blocks as u32, accumulate_dw as u32],
        Grid::Threads(8),
    )
}

#[cfg(test)]
mod tests;
