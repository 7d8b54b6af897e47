//! Gated linear units — SwiGLU (llama's MLP: silu(gate) · up) and GeGLU (Gemma's: gelu(gate) · up) —
//! and their backward. SiLU alone is SwiGLU with `up` = 1.

use super::common::{Grid, kernel, run};
use super::fastmath::{self, map2};
use super::gelu::{gelu_grad_scalar, gelu_scalar};
use crate::backend::{Backend, TMut, TRef};
use crate::error::{Error, Result};
use crate::gpu::{Access, Operand};
use rayon::prelude::*;

/// The gate's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    Gelu,
}

impl Activation {
    /// The activation's number in the kernels' parameters (act.wgsl).
    fn code(self) -> u32 {
        match self {
            Activation::Silu => 0,
            Activation::Gelu => 1,
        }
    }
}

/// o = act(g) · u over a slice: the CPU twin of the forward kernels.
fn glu_slice(act: Activation, o: &mut [f32], g: &[f32], u: &[f32]) {
    match act {
        Activation::Silu => map2(o, g, u, |g, u| act_scalar(Activation::Silu, g).0 * u),
        Activation::Gelu => map2(o, g, u, |g, u| gelu_scalar(g) * u),
    }
}

/// (act(x), act'(x)): the scalar twin.
#[inline(always)]
pub fn act_scalar(a: Activation, x: f32) -> (f32, f32) {
    match a {
        Activation::Silu => {
            let s = 1.0 / (1.0 + fastmath::exp(-x));
            (x * s, s * (1.0 + x * (1.0 - s)))
        }
        Activation::Gelu => (gelu_scalar(x), gelu_grad_scalar(x)),
    }
}

/// out = act(gate) · up over `n` elements.
pub fn glu(
    be: &Backend,
    act: Activation,
    gate: TRef<'_>,
    up: TRef<'_>,
    mut out: TMut<'_>,
    n: usize,
) -> Result<()> {
    match be {
        Backend::Cpu(c) => {
            let (g, u) = (gate.cpu("glu", "gate", n)?, up.cpu("glu", "up", n)?);
            let o = out.cpu("glu", "out", n)?;
            const CHUNK: usize = 1 << 14;
            c.install(|| {
                o.par_chunks_mut(CHUNK)
                    .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
                    .for_each(|(o, (g, u))| glu_slice(act, o, g, u))
            });
            Ok(())
        }
        Backend::Gpu(gb) => {
            let tg = gate.gpu("glu", "gate", n)?;
            let tu = up.gpu("glu", "up", n)?;
            let to = out.gpu("glu", "out", n)?;
            // The backward pass's second output is not touched forward; it is bound to a buffer of
            // its own all the same (WebGPU rejects a written buffer bound twice in one dispatch).
            let unused = gb.scratch("glu_unused_out", 1)?;
            let ops = [
                Operand::rows(tg, gate.offset(), 1),
                Operand::rows(tu, up.offset(), 1),
                Operand::rows(tg, gate.offset(), 1),
                Operand::rows(to, out.offset(), 1),
                Operand::whole(&unused, 0, 1),
            ];
            launch(gb, &ops, n, act, false)
        }
    }
}

/// out = act(gate) · up for `rows` rows of `cols` (out packed), gate and up rows `ld` apart: the two
/// halves of a fused gate/up product's rows, with no copy to make them contiguous first.
#[allow(clippy::too_many_arguments)]
pub fn glu_rows(
    be: &Backend,
    act: Activation,
    gate: TRef<'_>,
    up: TRef<'_>,
    ld: usize,
    mut out: TMut<'_>,
    rows: usize,
    cols: usize,
) -> Result<()> {
    if cols > ld {
        return Err(Error::Shape {
            op: "glu_rows",
            msg: format!("rows of {cols} do not fit a stride of {ld}"),
        });
    }
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let span = (rows - 1) * ld + cols;
    match be {
        Backend::Cpu(c) => {
            let (g, u) = (gate.cpu("glu", "gate", span)?, up.cpu("glu", "up", span)?);
            let o = out.cpu("glu", "out", rows * cols)?;
            c.install(|| {
                o.par_chunks_mut(cols).enumerate().for_each(|(r, o)| {
                    glu_slice(act, o, &g[r * ld..][..cols], &u[r * ld..][..cols])
                })
            });
            Ok(())
        }
        Backend::Gpu(gb) => {
            let ops = [
                Operand::strided(gate.gpu("glu", "gate", span)?, gate.offset(), ld, cols),
                Operand::strided(up.gpu("glu", "up", span)?, up.offset(), ld, cols),
                Operand::rows(out.gpu("glu", "out", rows * cols)?, out.offset(), cols),
            ];
            let pipe = kernel(
                gb,
                "glu_rows",
                concat!(include_str!("act.wgsl"), include_str!("glu_rows.wgsl")),
                &[Access::Read, Access::Read, Access::ReadWrite],
            )?;
            run(
                gb,
                "glu_rows",
                &pipe,
                rows,
                &ops,
                &[ld as u32, cols as u32, act.code()],
                Grid::Groups,
            )
        }
    }
}

/// dgate = dout · up · act'(gate), dup = dout · act(gate).
#[allow(clippy::too_many_arguments)]
pub fn glu_backward(
    be: &Backend,
    act: Activation,
    gate: TRef<'_>,
    up: TRef<'_>,
    dout: TRef<'_>,
    mut dgate: TMut<'_>,
    mut dup: TMut<'_>,
    n: usize,
) -> Result<()> {
    match be {
        Backend::Cpu(c) => {
            let (g, u) = (gate.cpu("glu", "gate", n)?, up.cpu("glu", "up", n)?);
            let d = dout.cpu("glu", "dout", n)?;
            let dg = dgate.cpu("glu", "dgate", n)?;
            let du = dup.cpu("glu", "dup", n)?;
            c.install(|| {
                dg.par_iter_mut()
                    .with_min_len(1 << 14)
                    .zip(du.par_iter_mut())
                    .enumerate()
                    .for_each(|(i, (dg, du))| {
                        let (a, da) = act_scalar(act, g[i]);
                        *dg = d[i] * u[i] * da;
                        *du = d[i] * a;
                    })
            });
            Ok(())
        }
        Backend::Gpu(gb) => {
            let ops = [
                Operand::rows(gate.gpu("glu", "gate", n)?, gate.offset(), 1),
                Operand::rows(up.gpu("glu", "up", n)?, up.offset(), 1),
                Operand::rows(dout.gpu("glu", "dout", n)?, dout.offset(), 1),
                Operand::rows(dgate.gpu("glu", "dgate", n)?, dgate.offset(), 1),
                Operand::rows(dup.gpu("glu", "dup", n)?, dup.offset(), 1),
            ];
            if ops[3].t.chunks[0].buffer == ops[4].t.chunks[0].buffer {
                return Err(Error::Shape {
                    op: "glu_backward",
                    msg: "dgate and dup must be different tensors".into(),
                });
            }
            launch(gb, &ops, n, act, true)
        }
    }
}

fn launch(
    gb: &crate::gpu::GpuBackend,
    ops: &[Operand<'_>],
    n: usize,
    act: Activation,
    backward: bool,
) -> Result<()> {
    // The forward pass leaves binding 5 (the backward pass's second output) untouched.
    let pipe = kernel(
        gb,
        if backward { "glu_bwd" } else { "glu" },
        concat!(include_str!("act.wgsl"), include_str!("glu.wgsl")),
        &[
            Access::Read,
            Access::Read,
            Access::Read,
            Access::ReadWrite,
            Access::ReadWrite,
        ],
    )?;
    run(
        gb,
        "glu",
        &pipe,
        n,
        ops,
        &[act.code(), backward as u32],
        Grid::Threads(256),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Arg, SeedRng, check_twin};

    #[test]
    fn swiglu_and_geglu_match_twin_and_finite_differences() {
        let mut rng = SeedRng::new(21);
        let n = 3001;
        let g = rng.vec(n, -8.0, 8.0);
        let u = rng.vec(n, -2.0, 2.0);
        let d = rng.vec(n, -1.0, 1.0);
        for act in [Activation::Silu, Activation::Gelu] {
            let args = [
                Arg::data(g.clone(), 1),
                Arg::data(u.clone(), 1),
                Arg::data(d.clone(), 1),
                Arg::out(n, 1),
                Arg::out(n, 1),
                Arg::out(n, 1),
            ];
            let out = check_twin("glu", 1e-12, &args, Some(2048), |be, t| {
                let [tg, tu, td, to, tdg, tdu] = t else {
                    unreachable!()
                };
                glu(be, act, (&*tg).into(), (&*tu).into(), to.into(), n)?;
                glu_backward(
                    be,
                    act,
                    (&*tg).into(),
                    (&*tu).into(),
                    (&*td).into(),
                    tdg.into(),
                    tdu.into(),
                    n,
                )
            });
            for i in 0..100 {
                let h = 1e-3f32;
                let f = |x: f32| act_scalar(act, x).0 as f64 * u[i] as f64;
                let fd = (f(g[i] + h) - f(g[i] - h)) / (2.0 * h as f64) * d[i] as f64;
                assert!(
                    (fd - out[4][i] as f64).abs() < 5e-3,
                    "{act:?} dgate fd {fd} vs {}",
                    out[4][i]
                );
                let fdu = act_scalar(act, g[i]).0 * d[i];
                assert!((fdu - out[5][i]).abs() < 1e-5);
            }
        }
    }

    /// The halves of fused rows [gate | up] straight into packed rows: the same values as `glu` on
    /// contiguous halves, the rows split across buffers on the GPU.
    #[test]
    fn glu_over_strided_rows_equals_glu_on_the_halves() {
        let mut rng = SeedRng::new(22);
        let (rows, cols) = (37, 300);
        let ld = 2 * cols;
        let x = rng.vec(rows * ld, -6.0, 6.0);
        for act in [Activation::Silu, Activation::Gelu] {
            let args = [Arg::data(x.clone(), ld), Arg::out(rows * cols, cols)];
            let out = check_twin(
                "glu_rows",
                1e-12,
                &args,
                Some(4 * ld as u64 * 5),
                |be, t| {
                    let [tx, to] = t else { unreachable!() };
                    glu_rows(be, act, tx.at(0), tx.at(cols), ld, to.into(), rows, cols)
                },
            );
            for r in [0, 17, rows - 1] {
                for c in [0, 1, cols - 1] {
                    let (g, u) = (x[r * ld + c], x[r * ld + cols + c]);
                    let want = act_scalar(act, g).0 * u;
                    let got = out[1][r * cols + c];
                    assert!(
                        (want - got).abs() <= 1e-5 * want.abs().max(1.0),
                        "{act:?} {r},{c}"
                    );
                }
            }
        }
    }
}
