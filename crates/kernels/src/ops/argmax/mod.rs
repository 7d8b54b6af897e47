//! The index of each row's first maximum, on the device: greedy decoding picks the next token there, so
//! only the id (4 bytes) comes back to the host, and the next step's embedding lookup can read it
//! straight from the device without waiting for the host.

use super::common::{Grid, kernel, run};

use crate::backend::{Backend, TMut, TRef};
use crate::error::{Result, shape};
use crate::gpu::{Access, Operand};

/// The workgroup tree the three argmax kernels end with, prepended to each: of two candidates
/// (value, index) it keeps the larger value, of equal values the smaller index; NONE (no candidate)
/// never wins. Every thread calls it (it has barriers); the winner is left in best_v[0], best_i[0].
pub(crate) const BEST_TREE: &str = "
const WG: u32 = 256u;
const NONE: u32 = 0xffffffffu;
var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;

fn best_tree(v: f32, i: u32, lid: u32) {
  best_v[lid] = v;
  best_i[lid] = i;
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s = s >> 1u) {
    if (lid < s) {
      let ov = best_v[lid + s];
      let oi = best_i[lid + s];
      let mv = best_v[lid];
      let mi = best_i[lid];
      if (oi != NONE && (mi == NONE || ov > mv || (ov == mv && oi < mi))) {
        best_v[lid] = ov;
        best_i[lid] = oi;
      }
    }
    workgroupBarrier();
  }
}
";

/// An argmax kernel: [`BEST_TREE`] and `source`.
fn argmax_kernel(
    g: &crate::gpu::GpuBackend,
    name: &str,
    source: &str,
) -> Result<std::rc::Rc<crate::gpu::Pipeline>> {
    kernel(
        g,
        name,
        &format!("{BEST_TREE}\n{source}"),
        &[Access::Read, Access::ReadWrite],
    )
}

/// out[r] = the index of the first maximum of row r of `x` (`rows` rows of `cols`, contiguous), as a
/// u32 word. NaN is never the maximum; a row with nothing above -inf gives 0.
pub fn argmax_rows(
    be: &Backend,
    x: TRef<'_>,
    mut out: TMut<'_>,
    rows: usize,
    cols: usize,
) -> Result<()> {
    if cols == 0 || cols > u32::MAX as usize {
        return Err(shape("argmax", format!("rows of {cols} elements")));
    }
    match be {
        Backend::Cpu(_) => {
            let xs = x.cpu("argmax", "x", rows * cols)?;
            let o = out.cpu_u32("argmax", "out", rows)?;
            for (row, slot) in xs.chunks(cols).zip(o.iter_mut()) {
                *slot = first_max(row);
            }
            Ok(())
        }
        Backend::Gpu(g) if cols > SPAN => long_rows(g, x, out, rows, cols),
        Backend::Gpu(g) => {
            let tx = x.gpu("argmax", "x", rows * cols)?;
            let to = out.gpu("argmax", "out", rows)?;
            let pipe = argmax_kernel(g, "argmax", include_str!("argmax.wgsl"))?;
            let ops = [
                Operand::rows(tx, x.offset(), cols),
                Operand::rows(to, out.offset(), 1),
            ];
            run(g, "argmax", &pipe, rows, &ops, &[cols as u32], Grid::Groups)
        }
    }
}

/// Elements of a row one workgroup of the first stage takes (argmax_partial.wgsl's SPAN): longer rows (a
/// vocabulary's logits) spread over that many workgroups, then one per row reduces their results.
pub(crate) const SPAN: usize = 4096;

/// Rows longer than [`SPAN`]: blocks in parallel, then one workgroup per row; x and out each in one
/// buffer (else the one-workgroup kernel, segment by segment).
fn long_rows(
    g: &crate::gpu::GpuBackend,
    x: TRef<'_>,
    out: TMut<'_>,
    rows: usize,
    cols: usize,
) -> Result<()> {
    let (Some((bx, ox)), Some((bo, oo))) = (
        x.gpu("argmax", "x", rows * cols)?
            .span(x.offset(), rows * cols),
        out.gpu("argmax", "out", rows)?.span(out.offset(), rows),
    ) else {
        let tx = x.gpu("argmax", "x", rows * cols)?;
        let to = out.gpu("argmax", "out", rows)?;
        let pipe = argmax_kernel(g, "argmax", include_str!("argmax.wgsl"))?;
        let ops = [
            Operand::rows(tx, x.offset(), cols),
            Operand::rows(to, out.offset(), 1),
        ];
        return run(g, "argmax", &pipe, rows, &ops, &[cols as u32], Grid::Groups);
    };
    let blocks = cols.div_ceil(SPAN);
    let part = g.scratch("argmax_part", 2 * rows * blocks)?;
    let pb = &part.chunks[0].buffer;
    let pipe = argmax_kernel(g, "argmax_partial", include_str!("argmax_partial.wgsl"))?;
    let params = [rows as u32, cols as u32, ox as u32, blocks as u32];
    g.dispatch(&pipe, &params, &[bx, pb], [blocks as u32, rows as u32, 1])?;
    let pipe = argmax_kernel(g, "argmax_final", include_str!("argmax_final.wgsl"))?;
    let params = [rows as u32, blocks as u32, oo as u32];
    g.dispatch(&pipe, &params, &[pb, bo], [rows as u32, 1, 1])
}

/// The CPU twin of one row: the first index whose value is larger than every earlier one's.
pub fn first_max(row: &[f32]) -> u32 {
    let (mut best, mut bv) = (0usize, f32::NEG_INFINITY);
    for (i, &v) in row.iter().enumerate() {
        if v > bv {
            (best, bv) = (i, v);
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Arg, SeedRng, check_twin};

    #[test]
    fn first_maximum_matches_twin() {
        let mut rng = SeedRng::new(71);
        // Odd widths, ties (values from a few levels), a row of NaN and -inf, one all -inf.
        for (rows, cols) in [
            (1usize, 1usize),
            (3, 255),
            (2, 257),
            (5, 49_152),
            (1, 262_145),
        ] {
            let mut x: Vec<f32> = (0..rows * cols)
                .map(|_| (rng.below(7) as f32) - 3.0)
                .collect();
            if rows >= 3 {
                x[cols..2 * cols].fill(f32::NEG_INFINITY);
                x[2 * cols..3 * cols].fill(f32::NAN);
                x[2 * cols + cols / 2] = -1e30;
            }
            let bits: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
            let args = [
                Arg::words(&bits, cols),
                Arg::words(&vec![u32::MAX; rows], 1),
            ];
            let out = check_twin("argmax", 0.0, &args, Some(64 * cols as u64 * 4), |be, t| {
                let [tx, to] = t else { unreachable!() };
                argmax_rows(be, (&*tx).into(), to.into(), rows, cols)
            });
            let ids: Vec<u32> = out[1].iter().map(|v| v.to_bits()).collect();
            let want: Vec<u32> = x.chunks(cols).map(first_max).collect();
            assert_eq!(ids, want, "{rows}x{cols}");
            if rows >= 3 {
                assert_eq!(ids[1], 0, "all -inf");
                assert_eq!(ids[2], (cols / 2) as u32, "NaN is never the maximum");
            }
        }
    }

    #[test]
    fn twin_keeps_the_first_of_equal_maxima() {
        assert_eq!(first_max(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(first_max(&[f32::NAN, 1.0]), 1);
        assert_eq!(first_max(&[f32::NEG_INFINITY; 4]), 0);
    }
}
