//! Sums and sums of squares over a tensor, into one element of another: the mean loss, and the global
//! gradient norm that clipping needs — computed on the device, so no step waits on the host.

use super::common::kernel;
use crate::backend::{Backend, TMut, TRef};
use crate::error::Result;
use crate::gpu::{Access, Operand, segments};
use rayon::prelude::*;

const BLOCK: usize = 4096;

/// What to add up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    SumOfSquares,
}

/// out[0] = scale · Σ f(x[i]) over `n` elements (added to out[0] when `accumulate`).
pub fn reduce(
    be: &Backend,
    kind: Reduce,
    x: TRef<'_>,
    n: usize,
    mut out: TMut<'_>,
    scale: f32,
    accumulate: bool,
) -> Result<()> {
    let squares = kind == Reduce::SumOfSquares;
    match be {
        Backend::Cpu(c) => {
            let xs = x.cpu("reduce", "x", n)?;
            // Blocks of the same size as the kernel's, summed the same way at the top level.
            let s: f32 = c.install(|| {
                xs.par_chunks(BLOCK)
                    .map(|b| {
                        b.iter()
                            .map(|&v| if squares { v * v } else { v })
                            .sum::<f32>()
                    })
                    .collect::<Vec<f32>>()
                    .iter()
                    .sum()
            });
            let o = out.cpu("reduce", "out", 1)?;
            o[0] = scale * s + if accumulate { o[0] } else { 0.0 };
            Ok(())
        }
        Backend::Gpu(g) => {
            let tx = x.gpu("reduce", "x", n)?;
            let segs = segments("reduce", n, &[Operand::rows(tx, x.offset(), 1)])?;
            let blocks: usize = segs.iter().map(|s| s.len().div_ceil(BLOCK)).sum();
            let part = g.scratch("reduce_partial", blocks.max(1))?;
            let pbuf = &part.chunks[0].buffer;
            let p1 = kernel(
                g,
                "reduce",
                include_str!("reduce.wgsl"),
                &[Access::Read, Access::ReadWrite],
            )?;
            let mut block0 = 0;
            for s in &segs {
                let nb = s.len().div_ceil(BLOCK);
                let params = [
                    s.len() as u32,
                    s.start as u32,
                    s.places[0].offset as u32,
                    0,
                    squares as u32,
                    block0 as u32,
                ];
                g.dispatch(&p1, &params, &[&s.places[0].buffer, pbuf], g.grid(nb))?;
                block0 += nb;
            }
            let to = out.gpu("reduce", "out", 1)?;
            let place = segments("reduce", 1, &[Operand::rows(to, out.offset(), 1)])?;
            let p2 = kernel(
                g,
                "reduce_finish",
                include_str!("finish.wgsl"),
                &[Access::Read, Access::ReadWrite],
            )?;
            let params = [
                blocks as u32,
                0,
                0,
                place[0].places[0].offset as u32,
                scale.to_bits(),
                accumulate as u32,
            ];
            g.dispatch(&p2, &params, &[pbuf, &place[0].places[0].buffer], [1, 1, 1])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Arg, SeedRng, check_twin};

    #[test]
    fn sums_match_twin() {
        let mut rng = SeedRng::new(50);
        for n in [1usize, 4095, 4097, 100_000] {
            let x = rng.vec(n, -1.0, 1.0);
            let args = [
                Arg::data(x.clone(), 1),
                Arg::out(1, 1),
                Arg::data(vec![2.0, 5.0], 1),
            ];
            let out = check_twin("reduce", 1e-11, &args, Some(16384), |be, t| {
                let [tx, ts, tq] = t else { unreachable!() };
                reduce(be, Reduce::Sum, (&*tx).into(), n, ts.into(), 0.5, false)?;
                reduce(
                    be,
                    Reduce::SumOfSquares,
                    (&*tx).into(),
                    n,
                    tq.at_mut(1),
                    1.0,
                    true,
                )
            });
            let want: f64 = x.iter().map(|&v| v as f64).sum::<f64>() * 0.5;
            assert!((out[1][0] as f64 - want).abs() < 1e-3 * (1.0 + want.abs()));
            let sq: f64 = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() + 5.0;
            assert!((out[2][1] as f64 - sq).abs() < 1e-3 * sq);
            assert_eq!(out[2][0], 2.0, "only the addressed element is written");
        }
    }
}
