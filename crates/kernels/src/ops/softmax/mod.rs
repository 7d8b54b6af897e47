//! Row softmax (in place), optionally scaled and causally masked, and its backward (in place on the
//! incoming gradient).

use super::common::{Grid, row_kernel, run};
use super::fastmath;
use crate::backend::{Backend, TMut, TRef};
use crate::error::{Error, Result};
use crate::gpu::{Access, Operand};
use rayon::prelude::*;

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
    for (g, &yv) in g.iter_mut().zip(y) {
        *g = scale * yv * (*g - d);
    }
}

/// x ← softmax(scale · x) per row.
pub fn softmax(be: &Backend, mut x: TMut<'_>, s: SoftmaxShape) -> Result<()> {
    launch(be, x.reborrow(), None, s)
}

/// dy ← scale · y ⊙ (dy − Σ dy ⊙ y) per row: the gradient with respect to softmax's input.
pub fn softmax_backward(be: &Backend, y: TRef<'_>, dy: TMut<'_>, s: SoftmaxShape) -> Result<()> {
    launch(be, dy, Some(y), s)
}

fn launch(be: &Backend, mut x: TMut<'_>, y: Option<TRef<'_>>, s: SoftmaxShape) -> Result<()> {
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
            // Blocks of rows, each block's loops compiled wide (see fastmath::wide).
            const ROWS: usize = 64;
            c.install(|| {
                xs.par_chunks_mut(s.cols * ROWS)
                    .enumerate()
                    .for_each(|(b, block)| {
                        fastmath::wide(|| {
                            for (i, row) in block.chunks_mut(s.cols).enumerate() {
                                let r = b * ROWS + i;
                                let valid = s.valid(r);
                                match ys {
                                    None => row_forward(row, valid, s.scale),
                                    Some(ys) => {
                                        let yr = &ys[r * s.cols..][..s.cols];
                                        row_backward(row, yr, valid, s.scale)
                                    }
                                }
                            }
                        })
                    })
            });
            Ok(())
        }
        Backend::Gpu(g) => {
            let tx = x.gpu("softmax", "x", n)?;
            // The forward pass reads no y; a small dummy buffer fills its binding (binding x twice
            // would mix read-only and read-write use of one buffer, which WebGPU forbids).
            let dummy;
            let (ty, oy, per) = match &y {
                Some(y) => (y.gpu("softmax", "y", n)?, y.offset(), s.cols),
                None => {
                    dummy = g.scratch("dummy", 1)?;
                    (&dummy, 0, 0)
                }
            };
            let ops = [
                Operand::rows(tx, x.offset(), s.cols),
                if per == 0 {
                    Operand::whole(ty, oy, 1)
                } else {
                    Operand::rows(ty, oy, per)
                },
            ];
            let pipe = row_kernel(
                g,
                "softmax",
                include_str!("softmax.wgsl"),
                &[Access::ReadWrite, Access::Read],
            )?;
            let extra = [
                s.cols as u32,
                s.scale.to_bits(),
                s.causal_t as u32,
                s.causal_offset as u32,
                y.is_some() as u32,
            ];
            run(g, "softmax", &pipe, s.rows, &ops, &extra, Grid::Groups)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
}
