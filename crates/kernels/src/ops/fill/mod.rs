//! Filling and copying: zeroing gradients, poisoning test outputs, moving rows between tensors.

use super::common::{Grid, kernel, run};
use crate::backend::{Backend, TMut, TRef};
use crate::error::Result;
use crate::gpu::{Access, Operand};

/// Sets `n` elements of `out` to `value`.
pub fn fill(be: &Backend, out: TMut<'_>, n: usize, value: f32) -> Result<()> {
    fill_bits(be, out, n, value.to_bits())
}

/// Sets `n` elements of `out` to the raw word `bits`.
pub fn fill_bits(be: &Backend, mut out: TMut<'_>, n: usize, bits: u32) -> Result<()> {
    match be {
        Backend::Cpu(_) => {
            out.cpu_u32("fill", "out", n)?.fill(bits);
            Ok(())
        }
        Backend::Gpu(g) => {
            let t = out.gpu("fill", "out", n)?;
            let pipe = kernel(g, "fill", include_str!("fill.wgsl"), &[Access::ReadWrite])?;
            run(
                g,
                "fill",
                &pipe,
                n,
                &[Operand::rows(t, out.offset(), 1)],
                &[bits],
                Grid::Threads(256),
            )
        }
    }
}

/// Copies `n` elements from `src` to `dst`.
pub fn copy(be: &Backend, src: TRef<'_>, mut dst: TMut<'_>, n: usize) -> Result<()> {
    match be {
        Backend::Cpu(_) => {
            let s = src.cpu_u32("copy", "src", n)?;
            dst.cpu_u32("copy", "dst", n)?.copy_from_slice(s);
            Ok(())
        }
        Backend::Gpu(g) => {
            let (ts, td) = (src.gpu("copy", "src", n)?, dst.gpu("copy", "dst", n)?);
            let pipe = kernel(
                g,
                "copy",
                include_str!("copy.wgsl"),
                &[Access::Read, Access::ReadWrite],
            )?;
            let ops = [
                Operand::rows(ts, src.offset(), 1),
                Operand::rows(td, dst.offset(), 1),
            ];
            run(g, "copy", &pipe, n, &ops, &[], Grid::Threads(256))
        }
    }
}
