//! Dispatch plumbing shared by the ops: segmenting split tensors, and the grid shapes.

use crate::error::Result;
use crate::gpu::{Access, GpuBackend, Operand, Pipeline, segments};
use std::rc::Rc;

/// Put in front of every hand-written kernel: the flat workgroup index of a grid folded into y.
pub(crate) const PRELUDE: &str = "
fn group_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 { return wid.x + wid.y * nwg.x; }
";

/// Workgroup-wide reductions for kernels of 256 threads, one row per workgroup (the row-wise ops:
/// norms, softmax, cross-entropy, attention). Prepended by [`row_kernel`]. Every thread of the workgroup
/// must call them (they contain barriers), with the same number of calls.
pub(crate) const ROW_REDUCE: &str = "
const WG: u32 = 256u;
var<workgroup> red: array<f32, WG>;

fn reduce_sum(v: f32, lid: u32) -> f32 {
  red[lid] = v;
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s = s >> 1u) {
    if (lid < s) { red[lid] = red[lid] + red[lid + s]; }
    workgroupBarrier();
  }
  let r = red[0];
  workgroupBarrier();
  return r;
}

fn reduce_max(v: f32, lid: u32) -> f32 {
  red[lid] = v;
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s = s >> 1u) {
    if (lid < s) { red[lid] = max(red[lid], red[lid + s]); }
    workgroupBarrier();
  }
  let r = red[0];
  workgroupBarrier();
  return r;
}
";

/// Row-wise kernels that give each row 64 threads and a workgroup of 256 four rows (after
/// [`ROW_REDUCE`], whose `red` they share): `row_sum` / `row_max` reduce over the threads of the
/// calling thread's row. Every thread of the workgroup must call them (they hold barriers). Such a
/// kernel is recorded with `Grid::Threads(4)`.
pub(crate) const ROWS4: &str = "
const TPR: u32 = 64u; // threads per row
const ROWS: u32 = 4u; // rows per workgroup

fn row_sum(v: f32, lid: u32) -> f32 {
  red[lid] = v;
  workgroupBarrier();
  let lane = lid % TPR;
  for (var s = TPR / 2u; s > 0u; s = s >> 1u) {
    if (lane < s) { red[lid] = red[lid] + red[lid + s]; }
    workgroupBarrier();
  }
  let r = red[lid - lane];
  workgroupBarrier();
  return r;
}

fn row_max(v: f32, lid: u32) -> f32 {
  red[lid] = v;
  workgroupBarrier();
  let lane = lid % TPR;
  for (var s = TPR / 2u; s > 0u; s = s >> 1u) {
    if (lane < s) { red[lid] = max(red[lid], red[lid + s]); }
    workgroupBarrier();
  }
  let r = red[lid - lane];
  workgroupBarrier();
  return r;
}
";

/// The `main` of element-wise kernels that take four units a thread, 256 apart (every access stays
/// coalesced, and a thread has four loads in flight): it calls the kernel's `fn one(i: u32)` for each
/// of its units below `p.n`. Such a kernel is recorded with `Grid::Threads(FOUR_A_THREAD)`.
pub(crate) const FOUR_A_THREAD_MAIN: &str = "
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_index(wid, nwg) * 1024u + lid;
  if (i + 768u < p.n) {
    one(i);
    one(i + 256u);
    one(i + 512u);
    one(i + 768u);
  } else {
    for (var j = 0u; j < 4u; j = j + 1u) {
      if (i + 256u * j < p.n) { one(i + 256u * j); }
    }
  }
}
";

/// Units a workgroup of a [`FOUR_A_THREAD_MAIN`] kernel takes.
pub(crate) const FOUR_A_THREAD: u32 = 1024;

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
    g.pipeline(key, bindings, || format!("{PRELUDE}\n{source}"))
}

/// [`kernel`] from several parts of source (shared functions first), joined only when the pipeline is
/// first built.
pub(crate) fn kernel_parts(
    g: &GpuBackend,
    key: &str,
    parts: &[&str],
    bindings: &[Access],
) -> Result<Rc<Pipeline>> {
    g.pipeline(key, bindings, || format!("{PRELUDE}\n{}", parts.join("\n")))
}

/// The pipeline for a row-wise kernel: `PRELUDE` + [`ROW_REDUCE`] + `source`.
pub(crate) fn row_kernel(
    g: &GpuBackend,
    key: &str,
    source: &str,
    bindings: &[Access],
) -> Result<Rc<Pipeline>> {
    g.pipeline(key, bindings, || {
        format!("{PRELUDE}\n{ROW_REDUCE}\n{source}")
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

/// Repeats each line of `body` that holds `var` (once per register of a thread's set: a row of x, a quant vector, a chunk of a head) `n` times, with `var` replaced by 0 .. n.
pub(crate) fn repeat_lines(body: &str, var: &str, n: usize) -> String {
    let mut out = String::with_capacity(body.len() * 2);
    for line in body.lines() {
        if line.contains(var) {
            for i in 0..n {
                out.push_str(&line.replace(var, &i.to_string()));
                out.push('\n');
            }
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Whether kernels issue their loads up front (the staged products' norm stages and merge, decode
/// attention's keys and values): on GPUs, whose memory latency it hides (H100, SmolLM2-135M decode 5%
/// faster); not on a software adapter, where the longer code measured slower (lavapipe, low-end
/// SmolLM2-135M decode 4.4 -> 3.4 tok/s). This crate's tests take it everywhere, so the form GPUs run is
/// checked bit for bit on lavapipe too.
pub(crate) fn hoist_loads(g: &GpuBackend) -> bool {
    cfg!(test) || !g.is_software()
}

/// A kernel's source in one of its forms: the lines tagged `tag` without the tag, and neither those
/// tagged for another form (`#once ` / `#lanes `, `#up ` / `#loop `) nor any other tag's.
pub(crate) fn form_lines(body: &str, tag: &str) -> String {
    body.lines()
        .filter_map(|line| match line.strip_prefix(tag) {
            Some(kept) => Some(kept),
            None => (!line.starts_with('#')).then_some(line),
        })
        .fold(String::with_capacity(body.len()), |mut s, line| {
            s.push_str(line);
            s.push('\n');
            s
        })
}
