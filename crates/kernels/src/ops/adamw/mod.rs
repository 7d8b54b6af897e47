//! AdamW (decoupled weight decay) with global gradient-norm clipping folded in.

use super::common::{Grid, kernel, run};
use crate::backend::{Backend, TMut, TRef};
use crate::error::{Error, Result};
use crate::gpu::{Access, Operand};
use rayon::prelude::*;

/// Hyperparameters of one AdamW step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1-based step number (for bias correction).
    pub step: u32,
    /// The gradients hold this multiple of the true gradient (loss scaling; 1 without): divided out
    /// before clipping and the moments.
    pub grad_scale: f32,
}

/// Global-norm clipping: scale gradients by min(1, max_norm / (‖g‖ + 1e-6)), with ‖g‖² read from
/// one element of a tensor (see [`crate::ops::reduce`]).
#[derive(Clone, Copy)]
pub struct Clip<'a> {
    pub norm_sq: TRef<'a>,
    pub max_norm: f32,
}

/// One AdamW update of `n` parameters.
#[allow(clippy::too_many_arguments)]
pub fn adamw(
    be: &Backend,
    mut param: TMut<'_>,
    grad: TRef<'_>,
    mut m: TMut<'_>,
    mut v: TMut<'_>,
    n: usize,
    h: &AdamW,
    clip: Option<Clip<'_>>,
) -> Result<()> {
    if !(h.grad_scale.is_finite() && h.grad_scale > 0.0) {
        return Err(Error::Shape {
            op: "adamw",
            msg: format!("gradient scale {} is not a positive number", h.grad_scale),
        });
    }
    if h.step == 0 {
        return Err(Error::Shape {
            op: "adamw",
            msg: "step numbers start at 1".into(),
        });
    }
    let bc1 = 1.0 - h.beta1.powi(h.step as i32);
    let bc2_sqrt = (1.0 - h.beta2.powi(h.step as i32)).sqrt();
    match be {
        Backend::Cpu(c) => {
            let scale = match &clip {
                Some(cl) => {
                    let ns = cl.norm_sq.cpu("adamw", "norm_sq", 1)?[0];
                    (cl.max_norm / (ns.sqrt() + 1e-6)).min(1.0)
                }
                None => 1.0,
            } / h.grad_scale;
            let gs = grad.cpu("adamw", "grad", n)?;
            let ps = param.cpu("adamw", "param", n)?;
            let ms = m.cpu("adamw", "m", n)?;
            let vs = v.cpu("adamw", "v", n)?;
            c.install(|| {
                ps.par_iter_mut()
                    .with_min_len(1 << 14)
                    .zip(ms.par_iter_mut().zip(vs.par_iter_mut()))
                    .zip(gs)
                    .for_each(|((p, (m, v)), &g)| {
                        let g = g * scale;
                        *m = h.beta1 * *m + (1.0 - h.beta1) * g;
                        *v = h.beta2 * *v + (1.0 - h.beta2) * g * g;
                        let w = *p * (1.0 - h.lr * h.weight_decay);
                        *p = w - (h.lr / bc1) * *m / (v.sqrt() / bc2_sqrt + h.eps);
                    })
            });
            Ok(())
        }
        Backend::Gpu(g) => {
            let dummy;
            let (tn, on) = match &clip {
                Some(cl) => (cl.norm_sq.gpu("adamw", "norm_sq", 1)?, cl.norm_sq.offset()),
                None => {
                    dummy = g.scratch("dummy", 1)?;
                    (&dummy, 0)
                }
            };
            let ops = [
                Operand::rows(param.gpu("adamw", "param", n)?, param.offset(), 1),
                Operand::rows(grad.gpu("adamw", "grad", n)?, grad.offset(), 1),
                Operand::rows(m.gpu("adamw", "m", n)?, m.offset(), 1),
                Operand::rows(v.gpu("adamw", "v", n)?, v.offset(), 1),
                Operand::whole(tn, on, 1),
            ];
            let pipe = kernel(
                g,
                "adamw",
                include_str!("adamw.wgsl"),
                &[
                    Access::ReadWrite,
                    Access::Read,
                    Access::ReadWrite,
                    Access::ReadWrite,
                    Access::Read,
                ],
            )?;
            let extra = [
                h.lr.to_bits(),
                h.beta1.to_bits(),
                h.beta2.to_bits(),
                h.eps.to_bits(),
                h.weight_decay.to_bits(),
                bc1.to_bits(),
                bc2_sqrt.to_bits(),
                clip.map_or(0.0, |c| c.max_norm).to_bits(),
                clip.is_some() as u32,
                (1.0 / h.grad_scale).to_bits(),
            ];
            run(g, "adamw", &pipe, n, &ops, &extra, Grid::Threads(256))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Arg, SeedRng, check_twin};

    /// One step of torch.optim.AdamW in f64, for comparison.
    fn torch_step(p: f64, g: f64, m: f64, v: f64, h: &AdamW, scale: f64) -> (f64, f64, f64) {
        let g = g * scale;
        let m = h.beta1 as f64 * m + (1.0 - h.beta1 as f64) * g;
        let v = h.beta2 as f64 * v + (1.0 - h.beta2 as f64) * g * g;
        let bc1 = 1.0 - (h.beta1 as f64).powi(h.step as i32);
        let bc2 = 1.0 - (h.beta2 as f64).powi(h.step as i32);
        let p = p * (1.0 - h.lr as f64 * h.weight_decay as f64);
        (
            p - h.lr as f64 / bc1 * m / (v.sqrt() / bc2.sqrt() + h.eps as f64),
            m,
            v,
        )
    }

    #[test]
    fn adamw_matches_twin_and_torch_formula_with_clipping() {
        let mut rng = SeedRng::new(60);
        let n = 3000;
        let p = rng.vec(n, -1.0, 1.0);
        let gr = rng.vec(n, -1.0, 1.0);
        let m = rng.vec(n, -0.1, 0.1);
        let v = rng.vec(n, 0.0, 0.1);
        // Loss-scaled gradients (a power of two times the true ones) give the same step.
        for grad_scale in [1.0f32, 1024.0] {
            let h = AdamW {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.1,
                step: 7,
                grad_scale,
            };
            let norm_sq: f32 = 9.0; // ‖g‖ = 3, clip to 1 → scale ≈ 1/3
            let args = [
                Arg::data(p.clone(), 1),
                Arg::data(gr.iter().map(|g| g * grad_scale).collect(), 1),
                Arg::data(m.clone(), 1),
                Arg::data(v.clone(), 1),
                Arg::data(vec![norm_sq], 1),
            ];
            let out = check_twin("adamw", 1e-12, &args, Some(4096), |be, t| {
                let [tp, tg, tm, tv, tn] = t else {
                    unreachable!()
                };
                let clip = Clip {
                    norm_sq: (&*tn).into(),
                    max_norm: 1.0,
                };
                adamw(
                    be,
                    tp.into(),
                    (&*tg).into(),
                    tm.into(),
                    tv.into(),
                    n,
                    &h,
                    Some(clip),
                )
            });
            let scale = 1.0 / (3.0 + 1e-6);
            for i in 0..n {
                let (pw, mw, vw) = torch_step(
                    p[i] as f64,
                    gr[i] as f64,
                    m[i] as f64,
                    v[i] as f64,
                    &h,
                    scale,
                );
                assert!(
                    (out[0][i] as f64 - pw).abs() < 1e-6,
                    "p[{i}] {} vs {pw}",
                    out[0][i]
                );
                assert!((out[2][i] as f64 - mw).abs() < 1e-6);
                assert!((out[3][i] as f64 - vw).abs() < 1e-6);
            }
        }
    }
}
