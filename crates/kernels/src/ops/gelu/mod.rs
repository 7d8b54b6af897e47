//! GELU in its tanh form (GPT-2's MLP activation) and its backward.

use super::common::{Grid, kernel, run};
use super::fastmath::{self, map1, map2};
use crate::backend::{Backend, TMut, TRef};
use crate::error::Result;
use crate::gpu::{Access, Operand};
use rayon::prelude::*;

const S2PI: f32 = 0.797_884_6;
const K: f32 = 0.044715;

/// The tanh argument, clamped as the kernel does (see gelu.wgsl).
#[inline(always)]
fn inner(x: f32) -> f32 {
    (S2PI * (x + K * x * x * x)).clamp(-15.0, 15.0)
}

/// GELU of one value: the scalar twin (tanh within 3e-7, see [`fastmath`]).
#[inline(always)]
pub fn gelu_scalar(x: f32) -> f32 {
    0.5 * x * (1.0 + fastmath::tanh(inner(x)))
}

/// d GELU / dx.
#[inline(always)]
pub fn gelu_grad_scalar(x: f32) -> f32 {
    let t = fastmath::tanh(inner(x));
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * S2PI * (1.0 + 3.0 * K * x * x)
}

/// y = gelu(x) over `n` elements.
pub fn gelu(be: &Backend, x: TRef<'_>, y: TMut<'_>, n: usize) -> Result<()> {
    launch(be, x, None, y, n)
}

/// dx = dy · gelu'(x) over `n` elements.
pub fn gelu_backward(
    be: &Backend,
    x: TRef<'_>,
    dy: TRef<'_>,
    dx: TMut<'_>,
    n: usize,
) -> Result<()> {
    launch(be, x, Some(dy), dx, n)
}

fn launch(
    be: &Backend,
    x: TRef<'_>,
    dy: Option<TRef<'_>>,
    mut out: TMut<'_>,
    n: usize,
) -> Result<()> {
    match be {
        Backend::Cpu(c) => {
            let xs = x.cpu("gelu", "x", n)?;
            let dys = dy.map(|d| d.cpu("gelu", "dy", n)).transpose()?;
            let o = out.cpu("gelu", "out", n)?;
            const CHUNK: usize = 1 << 14;
            c.install(|| match dys {
                None => o
                    .par_chunks_mut(CHUNK)
                    .zip(xs.par_chunks(CHUNK))
                    .for_each(|(o, x)| map1(o, x, gelu_scalar)),
                Some(d) => o
                    .par_chunks_mut(CHUNK)
                    .zip(xs.par_chunks(CHUNK).zip(d.par_chunks(CHUNK)))
                    .for_each(|(o, (x, d))| map2(o, x, d, |v, g| g * gelu_grad_scalar(v))),
            });
            Ok(())
        }
        Backend::Gpu(g) => {
            let tx = x.gpu("gelu", "x", n)?;
            let (td, od) = match &dy {
                Some(d) => (d.gpu("gelu", "dy", n)?, d.offset()),
                None => (tx, x.offset()),
            };
            let to = out.gpu("gelu", "out", n)?;
            let pipe = kernel(
                g,
                "gelu",
                include_str!("gelu.wgsl"),
                &[Access::Read, Access::Read, Access::ReadWrite],
            )?;
            let ops = [
                Operand::rows(tx, x.offset(), 1),
                Operand::rows(td, od, 1),
                Operand::rows(to, out.offset(), 1),
            ];
            run(
                g,
                "gelu",
                &pipe,
                n,
                &ops,
                &[dy.is_some() as u32],
                // Four elements a thread (gelu.wgsl).
                Grid::Threads(1024),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Arg, SeedRng, check_twin};

    #[test]
    fn gelu_forward_and_backward_match_twin_and_finite_differences() {
        let mut rng = SeedRng::new(20);
        let n = 5003;
        let mut x = rng.vec(n, -6.0, 6.0);
        x[0] = 40.0; // far in the tail: must stay finite
        x[1] = -40.0;
        let dy = rng.vec(n, -1.0, 1.0);
        let args = [
            Arg::data(x.clone(), 1),
            Arg::data(dy.clone(), 1),
            Arg::out(n, 1),
            Arg::out(n, 1),
        ];
        let out = check_twin("gelu", 1e-12, &args, Some(4096), |be, t| {
            let [tx, td, ty, tg] = t else { unreachable!() };
            gelu(be, (&*tx).into(), ty.into(), n)?;
            gelu_backward(be, (&*tx).into(), (&*td).into(), tg.into(), n)
        });
        assert_eq!(out[2][0], 40.0);
        assert_eq!(out[2][1], 0.0);
        // Backward against central differences of the forward twin (in f64 around f32 inputs).
        for i in 2..200 {
            let h = 1e-3f32;
            let fd =
                (gelu_scalar(x[i] + h) as f64 - gelu_scalar(x[i] - h) as f64) / (2.0 * h as f64);
            let an = out[3][i] as f64 / dy[i] as f64;
            assert!((fd - an).abs() < 2e-3, "x={} fd={fd} analytic={an}", x[i]);
        }
    }
}
