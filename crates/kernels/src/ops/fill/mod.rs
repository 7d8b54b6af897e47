//! Filling and copying: zeroing gradients, poisoning test outputs, moving rows between tensors.

use super::common::{Grid, kernel, run};
use crate::backend::{Backend, TMut, TRef};
use crate::error::{Result, shape};
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

/// Copies `rows` rows of `cols` elements from rows `ld_src` apart (from `src`'s offset) to rows `ld_dst`
/// apart: a column block of one matrix into another (a slice of a fused projection's rows into the KV
/// cache, say). One dispatch; exact.
pub fn copy_rows(
    be: &Backend,
    src: TRef<'_>,
    ld_src: usize,
    mut dst: TMut<'_>,
    ld_dst: usize,
    rows: usize,
    cols: usize,
) -> Result<()> {
    if cols > ld_src || cols > ld_dst {
        return Err(shape(
            "copy_rows",
            format!("rows of {cols} do not fit strides {ld_src} and {ld_dst}"),
        ));
    }
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    match be {
        Backend::Cpu(_) => {
            let s = src.cpu_u32("copy_rows", "src", (rows - 1) * ld_src + cols)?;
            let d = dst.cpu_u32("copy_rows", "dst", (rows - 1) * ld_dst + cols)?;
            for r in 0..rows {
                d[r * ld_dst..r * ld_dst + cols].copy_from_slice(&s[r * ld_src..r * ld_src + cols]);
            }
            Ok(())
        }
        Backend::Gpu(g) => {
            let ts = src.gpu("copy_rows", "src", (rows - 1) * ld_src + cols)?;
            let td = dst.gpu("copy_rows", "dst", (rows - 1) * ld_dst + cols)?;
            let pipe = kernel(
                g,
                "copy_rows",
                include_str!("copy_rows.wgsl"),
                &[Access::Read, Access::ReadWrite],
            )?;
            let ops = [
                Operand::strided(ts, src.offset(), ld_src, cols),
                Operand::strided(td, dst.offset(), ld_dst, cols),
            ];
            let extra = [ld_src as u32, ld_dst as u32, cols as u32];
            run(g, "copy_rows", &pipe, rows, &ops, &extra, Grid::Groups)
        }
    }
}
