//! Row softmax (in place), optionally scaled and causally masked, and its backward (in place on the
//! incoming gradient).

use super::common::{Grid, ROW_REDUCE, ROWS4, kernel_parts, repeat_lines, run};
use super::dropout::{HASH_WGSL, check_probability, kept_fn, threshold};
use super::fastmath;
use crate::backend::{Backend, TMut, TRef};
use crate::error::{Error, Result};
use crate::gpu::{Access, Operand};
use crate::ops::matmul::{pack_f16, pack_f16_of, packed_len};
use crate::path::Fault;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Rows of `cols` scores; with `causal_t > 0`, row r is query position `r % causal_t + causal_offset`
/// and sees columns up to that position only.
#[derive(Clone, Copy, Debug)]
pub struct SoftmaxShape {
    pub rows: usize,
    pub cols: usize,
    pub scale: f32,
    pub causal_t: usize,
    pub causal_offset: usize,
}

impl SoftmaxShape {
    pub fn plain(rows: usize, cols: usize) -> Self {
        SoftmaxShape {
            rows,
            cols,
            scale: 1.0,
            causal_t: 0,
            causal_offset: 0,
        }
    }
    /// Causal attention scores: `rows` = batch · heads · t, `cols` = t.
    pub fn causal(rows: usize, t: usize) -> Self {
        SoftmaxShape {
            rows,
            cols: t,
            scale: 1.0,
            causal_t: t,
            causal_offset: 0,
        }
    }
    fn valid(&self, r: usize) -> usize {
        if self.causal_t == 0 {
            self.cols
        } else {
            self.cols.min(r % self.causal_t + self.causal_offset + 1)
        }
    }
}

/// CPU twin of one row of the forward pass.
#[inline(always)]
pub(crate) fn row_forward(x: &mut [f32], valid: usize, scale: f32) {
    let (live, masked) = x.split_at_mut(valid);
    // max(scale · v) is scale · max(v) for the usual scale ≥ 0.
    let m = if scale >= 0.0 {
        scale * fastmath::max(live)
    } else {
        live.iter().fold(f32::MIN, |m, &v| m.max(scale * v))
    };
    live.iter_mut()
        .for_each(|v| *v = fastmath::exp(scale * *v - m));
    let inv = 1.0 / fastmath::sum(live);
    live.iter_mut().for_each(|v| *v *= inv);
    masked.fill(0.0);
}

/// CPU twin of one row of the backward pass.
#[inline(always)]
pub(crate) fn row_backward(g: &mut [f32], y: &[f32], valid: usize, scale: f32) {
    let d = fastmath::dot(&g[..valid], y);
    let (kept, masked) = g.split_at_mut(valid);
    for (g, &yv) in kept.iter_mut().zip(y) {
        *g = scale * yv * (*g - d);
    }
    // Masked columns are exactly 0, without reading them (as the GPU kernel does).
    masked.fill(0.0);
}

/// x ← softmax(scale · x) per row.
pub fn softmax(be: &Backend, mut x: TMut<'_>, s: SoftmaxShape) -> Result<()> {
    launch(be, x.reborrow(), None, None, s, None, None)
}

/// [`softmax`] with the planted fault of a path set: with [`Fault::CausalMaskPast128`] the GPU kernel
/// lets query positions from 128 on see one position ahead (tests only; `None` in production).
pub fn softmax_planted(
    be: &Backend,
    mut x: TMut<'_>,
    s: SoftmaxShape,
    fault: Option<Fault>,
) -> Result<()> {
    launch(be, x.reborrow(), None, None, s, None, fault)
}

/// [`softmax_planted`], then `dropped` ← dropout(x) with probability `p` under `seed` (the values
/// [`dropout`](super::dropout::dropout) gives over the whole tensor), in one pass.
pub fn softmax_dropout(
    be: &Backend,
    x: TMut<'_>,
    dropped: TMut<'_>,
    s: SoftmaxShape,
    (p, seed): (f32, u32),
    fault: Option<Fault>,
) -> Result<()> {
    check_probability("softmax", p)?;
    launch(be, x, None, Some(dropped), s, Some((p, seed)), fault)
}

/// dy ← scale · y ⊙ (dy − Σ dy ⊙ y) per row: the gradient with respect to softmax's input.
pub fn softmax_backward(be: &Backend, y: TRef<'_>, dy: TMut<'_>, s: SoftmaxShape) -> Result<()> {
    launch(be, dy, Some(y), None, s, None, None)
}

/// [`softmax_backward`] of [`softmax_dropout`]: `dy` holds the gradient of the dropped-out
/// probabilities and becomes the gradient of the scores (dropout's backward, then softmax's, in one
/// pass).
pub fn softmax_dropout_backward(
    be: &Backend,
    y: TRef<'_>,
    dy: TMut<'_>,
    s: SoftmaxShape,
    (p, seed): (f32, u32),
) -> Result<()> {
    check_probability("softmax", p)?;
    launch(be, dy, Some(y), None, s, Some((p, seed)), None)
}

/// [`softmax_dropout`] (with `drop`; [`softmax_planted`] without) for the tensor-core training path:
/// the values the product reads next — the dropped-out probabilities, or the probabilities themselves
/// without dropout — go to `pairs` as f16 pairs (`packed_len(rows · cols)` words, rounded as
/// [`pack_f16`] rounds: the values that path's products stage from f32), and `x` keeps the f32
/// probabilities for the backward pass, which reads only the columns each row sees: a causal shape's
/// masked columns of `x` may be left as they were (the kernel does not write them).
pub fn softmax_dropout_f16(
    be: &Backend,
    x: TMut<'_>,
    pairs: TMut<'_>,
    s: SoftmaxShape,
    drop: Option<(f32, u32)>,
    fault: Option<Fault>,
) -> Result<()> {
    if let Some((p, _)) = drop {
        check_probability("softmax", p)?;
    }
    launch_pairs(be, x, None, pairs, s, drop, fault)
}

/// The backward pass of [`softmax_dropout_f16`]: the scores' gradient into `pairs` as f16 pairs (the
/// values the products dS·K and dSᵀ·Q stage), given the probabilities `y` and the gradient `dy` of
/// the values the forward's product read. `dy` may be overwritten.
pub fn softmax_dropout_backward_f16(
    be: &Backend,
    y: TRef<'_>,
    dy: TMut<'_>,
    pairs: TMut<'_>,
    s: SoftmaxShape,
    drop: Option<(f32, u32)>,
) -> Result<()> {
    if let Some((p, _)) = drop {
        check_probability("softmax", p)?;
    }
    launch_pairs(be, dy, Some(y), pairs, s, drop, None)
}

/// One kernel (softmax_f16.wgsl) where the rows fit its register form (an even number of at most
/// 256 columns); elsewhere (and on the CPU twin) the f32 form, then [`pack_f16`].
fn launch_pairs(
    be: &Backend,
    mut x: TMut<'_>,
    y: Option<TRef<'_>>,
    pairs: TMut<'_>,
    s: SoftmaxShape,
    drop: Option<(f32, u32)>,
    fault: Option<Fault>,
) -> Result<()> {
    let n = s.rows * s.cols;
    if let Backend::Gpu(g) = be
        && s.cols.is_multiple_of(2)
        && s.cols <= 256
    {
        let tx = x.gpu("softmax", "x", n)?;
        let td = pairs.gpu("softmax", "pairs", packed_len(n))?;
        let dummy;
        let (ty, oy, per_y) = match &y {
            Some(y) => (y.gpu("softmax", "y", n)?, y.offset(), s.cols),
            None => {
                dummy = g.scratch("dummy", 1)?;
                (&dummy, 0, 0)
            }
        };
        let ops = [
            Operand::rows(tx, x.offset(), s.cols),
            if per_y == 0 {
                Operand::whole(ty, oy, 1)
            } else {
                Operand::rows(ty, oy, per_y)
            },
            Operand::rows(td, pairs.offset(), s.cols / 2),
        ];
        static SOURCE: OnceLock<String> = OnceLock::new();
        let source = SOURCE.get_or_init(|| repeat_lines(include_str!("softmax_f16.wgsl"), "$j", 4));
        let pipe = pipeline(g, "softmax_f16", source, fault)?;
        let (p, seed) = drop.unwrap_or((0.0, 0));
        let extra = [
            s.cols as u32,
            s.scale.to_bits(),
            s.causal_t as u32,
            s.causal_offset as u32,
            y.is_some() as u32,
            drop.is_some() as u32,
            threshold(p),
            seed,
            (1.0 / (1.0 - p)).to_bits(),
        ];
        return run(g, "softmax", &pipe, s.rows, &ops, &extra, Grid::Threads(4));
    }
    match (y, drop) {
        // Backward: the gradient in place in dy, then packed.
        (Some(y), drop) => launch(be, x.reborrow(), Some(y), None, s, drop, None)?,
        (None, Some(drop)) => {
            return pack_f16_of(be, "softmax_f16", (n, s.cols), pairs, |wide| {
                launch(be, x, None, Some(wide), s, Some(drop), fault)
            });
        }
        (None, None) => launch(be, x.reborrow(), None, None, s, None, fault)?,
    }
    pack_f16(be, x.as_ref(), pairs, n)
}

/// A softmax kernel's pipeline (`key`, its source after the row reductions and the hash); with
/// [`Fault::CausalMaskPast128`] the form whose rows from position 128 on see one position ahead.
fn pipeline(
    g: &crate::gpu::GpuBackend,
    key: &str,
    source: &str,
    fault: Option<Fault>,
) -> Result<std::rc::Rc<crate::gpu::Pipeline>> {
    const BINDINGS: [Access; 3] = [Access::ReadWrite, Access::Read, Access::ReadWrite];
    if fault == Some(Fault::CausalMaskPast128) {
        let leak = source.replace(
            "p.causal_offset + 1u);",
            "p.causal_offset + select(1u, 2u, (p.start + row) % p.causal_t >= 128u));",
        );
        let key = format!("{key}_fault_causal128");
        return kernel_parts(g, &key, &[ROW_REDUCE, ROWS4, HASH_WGSL, &leak], &BINDINGS);
    }
    kernel_parts(g, key, &[ROW_REDUCE, ROWS4, HASH_WGSL, source], &BINDINGS)
}

fn launch(
    be: &Backend,
    x: TMut<'_>,
    y: Option<TRef<'_>>,
    dropped: Option<TMut<'_>>,
    s: SoftmaxShape,
    drop: Option<(f32, u32)>,
    fault: Option<Fault>,
) -> Result<()> {
    launch_on(be, x, y, dropped, s, drop, fault, true)
}

/// [`launch`], with short rows held in registers (`registers`, the kernel's form for them) or
/// walked in loops as long rows are (tests compare the two).
#[allow(clippy::too_many_arguments)]
fn launch_on(
    be: &Backend,
    mut x: TMut<'_>,
    y: Option<TRef<'_>>,
    mut dropped: Option<TMut<'_>>,
    s: SoftmaxShape,
    drop: Option<(f32, u32)>,
    fault: Option<Fault>,
    registers: bool,
) -> Result<()> {
    if s.cols == 0 {
        return Err(Error::Shape {
            op: "softmax",
            msg: "rows must have at least one column".into(),
        });
    }
    let n = s.rows * s.cols;
    match be {
        Backend::Cpu(c) => {
            let ys = y.map(|y| y.cpu("softmax", "y", n)).transpose()?;
            let xs = x.cpu("softmax", "x", n)?;
            let ds = dropped
                .as_mut()
                .map(|d| d.cpu("softmax", "dropped", n))
                .transpose()?;
            let kept = drop.map(|(p, seed)| kept_fn(p, seed));
            // Blocks of rows, each block's loops compiled wide (see fastmath::wide).
            const ROWS: usize = 64;
            let block = s.cols * ROWS;
            c.install(|| {
                xs.par_chunks_mut(block).enumerate().for_each(|(b, block)| {
                    fastmath::wide(|| {
                        for (i, row) in block.chunks_mut(s.cols).enumerate() {
                            let r = b * ROWS + i;
                            let valid = s.valid(r);
                            match ys {
                                None => row_forward(row, valid, s.scale),
                                Some(ys) => {
                                    if let Some(kept) = kept {
                                        fastmath::apply1i(row, (r * s.cols) as u32, kept);
                                    }
                                    let yr = &ys[r * s.cols..][..s.cols];
                                    row_backward(row, yr, valid, s.scale)
                                }
                            }
                        }
                    })
                })
            });
            if let (Some(ds), Some(kept)) = (ds, kept) {
                c.install(|| {
                    ds.par_chunks_mut(block)
                        .zip(xs.par_chunks(block))
                        .enumerate()
                        .for_each(|(b, (d, x))| fastmath::map1i(d, x, (b * block) as u32, kept))
                });
            }
            Ok(())
        }
        Backend::Gpu(g) => {
            let tx = x.gpu("softmax", "x", n)?;
            // Operands a pass does not use are bound to small dummy buffers (binding x twice
            // would mix read-only and read-write use of one buffer, which WebGPU forbids).
            let (dummy, dummy_rw);
            let (ty, oy, per_y) = match &y {
                Some(y) => (y.gpu("softmax", "y", n)?, y.offset(), s.cols),
                None => {
                    dummy = g.scratch("dummy", 1)?;
                    (&dummy, 0, 0)
                }
            };
            let (td, od, per_d) = match &dropped {
                Some(d) => (d.gpu("softmax", "dropped", n)?, d.offset(), s.cols),
                None => {
                    dummy_rw = g.scratch("dummy_rw", 1)?;
                    (&dummy_rw, 0, 0)
                }
            };
            let operand = |t, o, per| {
                if per == 0 {
                    Operand::whole(t, o, 1)
                } else {
                    Operand::rows(t, o, per)
                }
            };
            let ops = [
                Operand::rows(tx, x.offset(), s.cols),
                operand(ty, oy, per_y),
                operand(td, od, per_d),
            ];
            // The register form's lines, written out for a thread's four columns (softmax.wgsl).
            static SOURCE: OnceLock<String> = OnceLock::new();
            let source = SOURCE.get_or_init(|| repeat_lines(include_str!("softmax.wgsl"), "$j", 4));
            let pipe = pipeline(g, "softmax", source, fault)?;
            let (p, seed) = drop.unwrap_or((0.0, 0));
            let extra = [
                s.cols as u32,
                s.scale.to_bits(),
                s.causal_t as u32,
                s.causal_offset as u32,
                y.is_some() as u32,
                drop.is_some() as u32,
                threshold(p),
                seed,
                (1.0 / (1.0 - p)).to_bits(),
                registers as u32,
            ];
            // Four rows per workgroup (softmax.wgsl).
            run(g, "softmax", &pipe, s.rows, &ops, &extra, Grid::Threads(4))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tensor;
    use crate::testing::{Arg, SeedRng, check_twin};

    #[test]
    fn softmax_matches_twin_plain_and_causal() {
        let mut rng = SeedRng::new(30);
        for (rows, cols, causal) in [
            (1, 1, false),
            (5, 300, false),
            (24, 8, true),
            (60, 33, true),
        ] {
            let x = rng.vec(rows * cols, -5.0, 5.0);
            let dy = rng.vec(rows * cols, -1.0, 1.0);
            let mut s = if causal {
                SoftmaxShape::causal(rows, cols)
            } else {
                SoftmaxShape::plain(rows, cols)
            };
            s.scale = 0.7;
            let args = [Arg::data(x, cols), Arg::data(dy, cols)];
            let out = check_twin(
                "softmax",
                1e-11,
                &args,
                Some((cols as u64 * 12).max(1024)),
                |be, t| {
                    let [tx, tdy] = t else { unreachable!() };
                    softmax(be, (&mut *tx).into(), s)?;
                    softmax_backward(be, (&*tx).into(), tdy.into(), s)
                },
            );
            for r in 0..rows {
                let row = &out[0][r * cols..][..cols];
                let sum: f32 = row.iter().sum();
                assert!((sum - 1.0).abs() < 1e-5, "row {r} sums to {sum}");
                if causal {
                    assert!(
                        row[s.valid(r)..].iter().all(|&v| v == 0.0),
                        "masked entries must be 0"
                    );
                }
            }
        }
    }

    /// The fused pass gives what softmax then dropout (and dropout's backward then softmax's) give,
    /// bit for bit, on every backend, with bindings split into segments of rows (the mask is indexed
    /// over the whole tensor), and the backends agree with each other.
    #[test]
    fn softmax_with_dropout_fused_equals_the_two_passes() {
        let mut rng = SeedRng::new(32);
        let (rows, cols) = (96, 40);
        let x = rng.vec(rows * cols, -4.0, 4.0);
        let dy = rng.vec(rows * cols, -1.0, 1.0);
        let mut s = SoftmaxShape::causal(rows, cols);
        s.scale = 0.6;
        let drop = (0.3, 77);
        let n = rows * cols;
        let args = [
            Arg::data(x.clone(), cols),
            Arg::out(n, cols),
            Arg::data(dy.clone(), cols),
            Arg::data(x, cols),
            Arg::out(n, cols),
            Arg::data(dy, cols),
        ];
        check_twin(
            "softmax_dropout",
            1e-11,
            &args,
            Some((cols as u64 * 4 * 16).max(1024)),
            |be, t| {
                let [x, d, dy, x2, d2, dy2] = t else {
                    unreachable!()
                };
                softmax_dropout(be, (&mut *x).into(), (&mut *d).into(), s, drop, None)?;
                softmax_dropout_backward(be, (&*x).into(), (&mut *dy).into(), s, drop)?;
                softmax(be, (&mut *x2).into(), s)?;
                let d2v = d2.len();
                crate::ops::dropout::dropout(
                    be,
                    (&*x2).into(),
                    (&mut *d2).into(),
                    d2v,
                    drop.0,
                    drop.1,
                )?;
                let mut g = be.zeros(n, cols)?;
                crate::ops::dropout::dropout(
                    be,
                    (&*dy2).into(),
                    (&mut g).into(),
                    n,
                    drop.0,
                    drop.1,
                )?;
                softmax_backward(be, (&*x2).into(), (&mut g).into(), s)?;
                let bits = |t: &Tensor| -> Vec<u32> {
                    be.to_vec(t).unwrap().iter().map(|v| v.to_bits()).collect()
                };
                assert!(bits(x) == bits(x2), "{}: probabilities differ", be.kind());
                assert!(
                    bits(d) == bits(d2),
                    "{}: dropped-out probabilities differ",
                    be.kind()
                );
                assert!(bits(dy) == bits(&g), "{}: gradients differ", be.kind());
                let kept = bits(d).iter().filter(|&&b| b != 0).count() as f64;
                let live = bits(x).iter().filter(|&&b| b != 0).count() as f64;
                assert!((kept / live - 0.7).abs() < 0.05, "kept {kept} of {live}");
                Ok(())
            },
        );
    }

    /// Short rows held in registers give the values of the loops that walk long rows: forward and
    /// backward, plain and causal (with an offset), with and without dropout, rows narrower than a
    /// thread's four columns and up to 4 · 64. Bit for bit where both forms are compiled alike (a
    /// software adapter, CI's); a GPU's compiler may fuse scale · x − m into one multiply-add in
    /// one form and not the other (an H100's did: last-bit differences), so there within NMSE 1e-12.
    #[test]
    fn short_rows_in_registers_keep_the_loops_values() {
        let Some(be) = crate::testing::gpu_backend(None) else {
            return;
        };
        let mut rng = SeedRng::new(35);
        for (rows, cols, causal) in [
            (9, 256, true),
            (7, 200, false),
            (6, 65, true),
            (5, 3, false),
        ] {
            let mut s = if causal {
                SoftmaxShape::causal(rows, cols)
            } else {
                SoftmaxShape::plain(rows, cols)
            };
            s.scale = 0.7;
            if causal && cols == 65 {
                s.causal_offset = 2;
            }
            let n = rows * cols;
            let x = rng.vec(n, -4.0, 4.0);
            let dy = rng.vec(n, -1.0, 1.0);
            for drop in [None, Some((0.25, 9))] {
                let run = |registers: bool| -> Vec<Vec<f32>> {
                    let mut tx = be.from_f32(&x, cols).unwrap();
                    let mut td = crate::testing::poisoned(&be, n, cols).unwrap();
                    let mut tg = be.from_f32(&dy, cols).unwrap();
                    let d = drop.map(|_| (&mut td).into());
                    launch_on(&be, (&mut tx).into(), None, d, s, drop, None, registers).unwrap();
                    let y = (&tx).into();
                    launch_on(
                        &be,
                        (&mut tg).into(),
                        Some(y),
                        None,
                        s,
                        drop,
                        None,
                        registers,
                    )
                    .unwrap();
                    let mut out = vec![be.to_vec(&tx).unwrap(), be.to_vec(&tg).unwrap()];
                    if drop.is_some() {
                        out.push(be.to_vec(&td).unwrap());
                    }
                    out
                };
                let what = format!("{rows}x{cols} causal {causal} dropout {drop:?}");
                let (regs, loops) = (run(true), run(false));
                let software = be.as_gpu().is_some_and(|g| g.is_software());
                for (r, l) in regs.iter().zip(&loops) {
                    if software {
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert!(bits(r) == bits(l), "{what}: the forms differ");
                    } else {
                        crate::testing::assert_nmse(&what, l, r, 1e-12);
                    }
                }
            }
        }
    }

    #[test]
    fn softmax_backward_matches_finite_differences() {
        let be = crate::testing::cpu_backend();
        let (rows, cols) = (3, 6);
        let mut rng = SeedRng::new(31);
        let x = rng.vec(rows * cols, -2.0, 2.0);
        let r = rng.vec(rows * cols, -1.0, 1.0);
        let mut s = SoftmaxShape::causal(rows, cols);
        s.causal_offset = 2;
        s.scale = 1.3;
        let f = |x: &[f32]| -> f64 {
            let mut t = be.from_f32(x, 1).unwrap();
            softmax(&be, (&mut t).into(), s).unwrap();
            be.to_vec(&t)
                .unwrap()
                .iter()
                .zip(&r)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum()
        };
        let mut y = be.from_f32(&x, 1).unwrap();
        softmax(&be, (&mut y).into(), s).unwrap();
        let mut g = be.from_f32(&r, 1).unwrap();
        softmax_backward(&be, (&y).into(), (&mut g).into(), s).unwrap();
        let g = be.to_vec(&g).unwrap();
        for i in 0..x.len() {
            let (mut xp, mut xm) = (x.clone(), x.clone());
            xp[i] += 1e-2;
            xm[i] -= 1e-2;
            let fd = (f(&xp) - f(&xm)) / 2e-2;
            assert!(
                (fd - g[i] as f64).abs() < 1e-3,
                "dx[{i}]: fd {fd} vs {}",
                g[i]
            );
        }
    }

    /// The f16-pairs forms write the f32 forms' values rounded as `pack_f16` rounds them, bit for bit,
    /// and leave the f32 probabilities as the f32 form leaves them: forward (with and without
    /// dropout, causal and plain) and backward, on rows the kernel takes (an even number of columns up
    /// to 256, several rows a workgroup, a last workgroup part-filled) and on rows it leaves to the f32
    /// form (odd, longer), on every backend.
    #[test]
    fn f16_pairs_hold_the_f32_form_s_values() {
        let mut rng = SeedRng::new(35);
        let mut backends = vec![crate::testing::cpu_backend()];
        backends.extend(crate::testing::gpu_backend(None));
        let cases = [
            (3 * 256, 256, true, Some((0.2f32, 5u32))),
            (2 * 40, 40, true, None),
            (13, 130, false, Some((0.5, 9))),
            (2 * 9, 9, true, Some((0.1, 3))),
            (6, 300, false, None),
        ];
        for be in &backends {
            for (rows, cols, causal, drop) in cases {
                let n = rows * cols;
                let mut s = if causal {
                    SoftmaxShape::causal(rows, cols)
                } else {
                    SoftmaxShape::plain(rows, cols)
                };
                s.scale = 0.8;
                let x = rng.vec(n, -5.0, 5.0);
                let dy = rng.vec(n, -1.0, 1.0);
                let unit = cols;
                let what = format!("{} {rows}x{cols} causal {causal} drop {drop:?}", be.kind());
                let mut x32 = be.from_f32(&x, unit).unwrap();
                let mut x16 = be.from_f32(&x, unit).unwrap();
                crate::testing::assert_f16_pairs(
                    be,
                    n,
                    &format!("{what} forward"),
                    |mut w| match drop {
                        Some(d) => softmax_dropout(be, x32.at_mut(0), w, s, d, None),
                        None => {
                            softmax(be, x32.at_mut(0), s)?;
                            crate::ops::fill::copy(be, x32.at(0), w.reborrow(), n)
                        }
                    },
                    |pairs| softmax_dropout_f16(be, x16.at_mut(0), pairs, s, drop, None),
                );
                let bits = |t: &Tensor| -> Vec<u32> {
                    be.to_vec(t).unwrap().iter().map(|v| v.to_bits()).collect()
                };
                // The probabilities each row sees; the masked ones are not part of the contract.
                let (p32, p16) = (bits(&x32), bits(&x16));
                for r in 0..rows {
                    let row = r * cols..r * cols + s.valid(r);
                    assert!(
                        p32[row.clone()] == p16[row],
                        "{what}: row {r}'s probabilities"
                    );
                }
                let mut g32 = be.from_f32(&dy, unit).unwrap();
                let mut g16 = be.from_f32(&dy, unit).unwrap();
                crate::testing::assert_f16_pairs(
                    be,
                    n,
                    &format!("{what} backward"),
                    |mut w| {
                        match drop {
                            Some(d) => {
                                softmax_dropout_backward(be, x32.at(0), g32.at_mut(0), s, d)?
                            }
                            None => softmax_backward(be, x32.at(0), g32.at_mut(0), s)?,
                        }
                        crate::ops::fill::copy(be, g32.at(0), w.reborrow(), n)
                    },
                    |pairs| {
                        softmax_dropout_backward_f16(be, x16.at(0), g16.at_mut(0), pairs, s, drop)
                    },
                );
            }
        }
    }
}
