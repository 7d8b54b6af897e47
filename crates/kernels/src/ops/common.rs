//! Dispatch plumbing shared by the ops: segmenting split tensors, and the grid shapes.

use crate::error::Result;
use crate::gpu::{Access, GpuBackend, Operand, Pipeline, PipelineOptions, segments};
use std::rc::Rc;

/// Put in front of every hand-written kernel: the flat workgroup index of a grid folded into y.
pub(crate) const PRELUDE: &str = "
fn group_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 { return wid.x + wid.y * nwg.x; }
";

/// How a segmented op maps units to workgroups.
#[derive(Clone, Copy)]
pub(crate) enum Grid {
    /// One thread per unit, `wg` threads per workgroup.
    Threads(u32),
    /// One workgroup per unit.
    Groups,
}

/// The pipeline for a hand-written kernel (`PRELUDE` + `source`), cached under `key`.
pub(crate) fn kernel(
    g: &GpuBackend,
    key: &str,
    source: &str,
    bindings: &[Access],
) -> Result<Rc<Pipeline>> {
    g.pipeline(key, bindings, PipelineOptions::default(), || {
        format!("{PRELUDE}\n{source}")
    })
}

/// Records `pipe` over `units` units, once per segment of the split operands. The kernel's parameter
/// block starts with `[units in segment, first unit, element offset of each operand...]`, then `extra`.
pub(crate) fn run(
    g: &GpuBackend,
    op: &'static str,
    pipe: &Pipeline,
    units: usize,
    operands: &[Operand<'_>],
    extra: &[u32],
    grid: Grid,
) -> Result<()> {
    for seg in segments(op, units, operands)? {
        let mut p = Vec::with_capacity(2 + operands.len() + extra.len());
        p.push(seg.len() as u32);
        p.push(seg.start as u32);
        p.extend(seg.places.iter().map(|pl| pl.offset as u32));
        p.extend_from_slice(extra);
        let bufs: Vec<&wgpu::Buffer> = seg.places.iter().map(|pl| &pl.buffer).collect();
        let groups = match grid {
            Grid::Threads(wg) => g.grid(seg.len().div_ceil(wg as usize)),
            Grid::Groups => g.grid(seg.len()),
        };
        g.dispatch(pipe, &p, &bufs, groups)?;
    }
    Ok(())
}
