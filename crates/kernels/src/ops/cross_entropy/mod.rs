//! Fused softmax cross-entropy: per-row losses and, for training, the logits' gradient in one pass.

use super::common::{Grid, row_kernel, run};
use crate::backend::{Backend, TMut, TRef};
use crate::error::{Error, Result};
use crate::gpu::{Access, Operand};
use rayon::prelude::*;

/// Target id that marks a row to ignore (zero loss, zero gradient).
pub const IGNORE: u32 = u32::MAX;

/// losses[r] = logsumexp(logits[r]) − logits[r][targets[r]]; when `dlogits` is given, also
/// dlogits[r] = (softmax(logits[r]) − onehot(targets[r])) · grad_scale (grad_scale = 1/rows for a mean).
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy(
    be: &Backend,
    logits: TRef<'_>,
    targets: TRef<'_>,
    mut losses: TMut<'_>,
    dlogits: Option<TMut<'_>>,
    rows: usize,
    vocab: usize,
    grad_scale: f32,
) -> Result<()> {
    if vocab == 0 {
        return Err(Error::Shape {
            op: "cross_entropy",
            msg: "vocabulary is empty".into(),
        });
    }
    let n = rows * vocab;
    match be {
        Backend::Cpu(c) => {
            let x = logits.cpu("cross_entropy", "logits", n)?;
            let t = targets.cpu_u32("cross_entropy", "targets", rows)?;
            let l = losses.cpu("cross_entropy", "losses", rows)?;
            let mut dl = dlogits;
            let d = dl
                .as_mut()
                .map(|d| d.cpu("cross_entropy", "dlogits", n))
                .transpose()?;
            c.install(|| {
                let row = |r: usize, lr: &mut f32, dr: Option<&mut [f32]>| {
                    let xr = &x[r * vocab..][..vocab];
                    let m = xr.iter().fold(f32::MIN, |m, &v| m.max(v));
                    let s: f32 = xr.iter().map(|&v| (v - m).exp()).sum();
                    let lse = m + s.ln();
                    let tr = t[r] as usize;
                    let ignore = tr >= vocab;
                    *lr = if ignore { 0.0 } else { lse - xr[tr] };
                    if let Some(dr) = dr {
                        for (c, g) in dr.iter_mut().enumerate() {
                            let v = if ignore {
                                0.0
                            } else {
                                (xr[c] - lse).exp() - if c == tr { 1.0 } else { 0.0 }
                            };
                            *g = v * grad_scale;
                        }
                    }
                };
                match d {
                    Some(d) => l
                        .par_iter_mut()
                        .zip(d.par_chunks_mut(vocab))
                        .enumerate()
                        .for_each(|(r, (lr, dr))| row(r, lr, Some(dr))),
                    None => l
                        .par_iter_mut()
                        .enumerate()
                        .for_each(|(r, lr)| row(r, lr, None)),
                }
            });
            Ok(())
        }
        Backend::Gpu(g) => {
            let dummy;
            let (td, od, per) = match &dlogits {
                Some(d) => (d.gpu("cross_entropy", "dlogits", n)?, d.offset(), vocab),
                None => {
                    dummy = g.scratch("dummy", 1)?;
                    (&dummy, 0, 0)
                }
            };
            let ops = [
                Operand::rows(
                    logits.gpu("cross_entropy", "logits", n)?,
                    logits.offset(),
                    vocab,
                ),
                Operand::rows(
                    targets.gpu("cross_entropy", "targets", rows)?,
                    targets.offset(),
                    1,
                ),
                Operand::rows(
                    losses.gpu("cross_entropy", "losses", rows)?,
                    losses.offset(),
                    1,
                ),
                if per == 0 {
                    Operand::whole(td, od, 1)
                } else {
                    Operand::rows(td, od, per)
                },
            ];
            let pipe = row_kernel(
                g,
                "cross_entropy",
                include_str!("cross_entropy.wgsl"),
                &[
                    Access::Read,
                    Access::Read,
                    Access::ReadWrite,
                    Access::ReadWrite,
                ],
            )?;
            let extra = [vocab as u32, grad_scale.to_bits(), dlogits.is_some() as u32];
            run(g, "cross_entropy", &pipe, rows, &ops, &extra, Grid::Groups)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Arg, SeedRng, check_twin, cpu_backend};

    #[test]
    fn cross_entropy_matches_twin_and_finite_differences() {
        let mut rng = SeedRng::new(40);
        for (rows, vocab) in [(1, 1), (7, 65), (33, 1000)] {
            let x = rng.vec(rows * vocab, -4.0, 4.0);
            let mut t: Vec<u32> = (0..rows).map(|_| rng.below(vocab) as u32).collect();
            if rows > 2 {
                t[1] = IGNORE;
            }
            let args = [
                Arg::data(x.clone(), vocab),
                Arg::words(&t, 1),
                Arg::out(rows, 1),
                Arg::out(rows * vocab, vocab),
                Arg::out(rows, 1),
            ];
            let out = check_twin(
                "cross_entropy",
                1e-11,
                &args,
                Some((vocab as u64 * 8).max(512)),
                |be, ts| {
                    let [tx, tt, tl, td, tl2] = ts else {
                        unreachable!()
                    };
                    cross_entropy(
                        be,
                        (&*tx).into(),
                        (&*tt).into(),
                        tl.into(),
                        Some(td.into()),
                        rows,
                        vocab,
                        0.5,
                    )?;
                    cross_entropy(
                        be,
                        (&*tx).into(),
                        (&*tt).into(),
                        tl2.into(),
                        None,
                        rows,
                        vocab,
                        0.5,
                    )
                },
            );
            assert_eq!(out[2], out[4]);
            if rows > 2 {
                assert_eq!(out[2][1], 0.0);
                assert!(out[3][vocab..2 * vocab].iter().all(|&g| g == 0.0));
            }
            // Gradient rows sum to zero (softmax minus one-hot).
            for r in 0..rows {
                let s: f32 = out[3][r * vocab..][..vocab].iter().sum();
                assert!(s.abs() < 1e-5);
            }
            // Finite differences of the summed loss on the CPU twin.
            let be = cpu_backend();
            let f = |x: &[f32]| -> f64 {
                let tx = be.from_f32(x, 1).unwrap();
                let tt = be.from_u32(&t, 1).unwrap();
                let mut tl = be.zeros(rows, 1).unwrap();
                cross_entropy(
                    &be,
                    (&tx).into(),
                    (&tt).into(),
                    (&mut tl).into(),
                    None,
                    rows,
                    vocab,
                    1.0,
                )
                .unwrap();
                be.to_vec(&tl)
                    .unwrap()
                    .iter()
                    .map(|&v| v as f64)
                    .sum::<f64>()
                    * 0.5
            };
            for i in (0..x.len()).step_by((x.len() / 20).max(1)) {
                let (mut xp, mut xm) = (x.clone(), x.clone());
                xp[i] += 1e-2;
                xm[i] -= 1e-2;
                let fd = (f(&xp) - f(&xm)) / 2e-2;
                assert!(
                    (fd - out[3][i] as f64).abs() < 1e-3,
                    "d[{i}]: fd {fd} vs {}",
                    out[3][i]
                );
            }
        }
    }
}
