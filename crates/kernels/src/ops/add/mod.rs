//! Element-wise addition: `out = a + s·b` and the residual form `out += s·b`.

use super::common::{Grid, kernel, run};
use crate::backend::{Backend, TMut, TRef};
use crate::error::Result;
use crate::gpu::{Access, Operand};
use rayon::prelude::*;

const PAR_MIN: usize = 1 << 16;

/// out = a + scale·b over `n` elements.
pub fn add(
    be: &Backend,
    a: TRef<'_>,
    b: TRef<'_>,
    mut out: TMut<'_>,
    n: usize,
    scale: f32,
) -> Result<()> {
    match be {
        Backend::Cpu(c) => {
            let (a, b) = (a.cpu("add", "a", n)?, b.cpu("add", "b", n)?);
            let o = out.cpu("add", "out", n)?;
            c.install(|| {
                o.par_iter_mut()
                    .with_min_len(PAR_MIN)
                    .zip(a.par_iter().zip(b.par_iter()))
                    .for_each(|(o, (x, y))| *o = x + scale * y)
            });
            Ok(())
        }
        Backend::Gpu(g) => {
            let ops = [
                Operand::rows(a.gpu("add", "a", n)?, a.offset(), 1),
                Operand::rows(b.gpu("add", "b", n)?, b.offset(), 1),
                Operand::rows(out.gpu("add", "out", n)?, out.offset(), 1),
            ];
            let pipe = kernel(
                g,
                "add",
                include_str!("add.wgsl"),
                &[Access::Read, Access::Read, Access::ReadWrite],
            )?;
            run(
                g,
                "add",
                &pipe,
                n,
                &ops,
                &[scale.to_bits()],
                Grid::Threads(256),
            )
        }
    }
}

/// out += scale·b over `n` elements (residual connections, gradient accumulation).
pub fn add_assign(
    be: &Backend,
    mut out: TMut<'_>,
    b: TRef<'_>,
    n: usize,
    scale: f32,
) -> Result<()> {
    match be {
        Backend::Cpu(c) => {
            let b = b.cpu("add_assign", "b", n)?;
            let o = out.cpu("add_assign", "out", n)?;
            c.install(|| {
                o.par_iter_mut()
                    .with_min_len(PAR_MIN)
                    .zip(b.par_iter())
                    .for_each(|(o, y)| *o += scale * y)
            });
            Ok(())
        }
        Backend::Gpu(g) => {
            let ops = [
                Operand::rows(b.gpu("add_assign", "b", n)?, b.offset(), 1),
                Operand::rows(out.gpu("add_assign", "out", n)?, out.offset(), 1),
            ];
            let pipe = kernel(
                g,
                "add_assign",
                include_str!("add_assign.wgsl"),
                &[Access::Read, Access::ReadWrite],
            )?;
            run(
                g,
                "add_assign",
                &pipe,
                n,
                &ops,
                &[scale.to_bits()],
                Grid::Threads(256),
            )
        }
    }
}
