//! Dispatch of the WGSL quantized kernels: variant choice, the split-buffer loops, parameter blocks.
//!
//! One `qmatmul` is one dispatch in the usual case (x, y and the weights each in one buffer, m ≤ 8 or a
//! multiple of 8). Split tensors multiply it: x/y are cut by rows of x where either changes buffer, the
//! weights by the row ranges stored with the matrix, and every pair of pieces is one dispatch writing its
//! block of y (y's leading dimension stays N; the piece's first column goes into y's offset).

use std::rc::Rc;

use super::{GpuParts, QKind};
use crate::error::{Result, shape};
use crate::gpu::{Access, GpuBackend, GpuTensor, Operand, Pipeline, PipelineOptions, segments};
use crate::ops::common::PRELUDE;
use crate::path::Fault;

/// Threads per workgroup of the matmul kernels. With WORDS_PER_LANE = 16, 128 was the fastest of the
/// configurations tried on an H200 (64, 128, 256 threads; 4, 8, 16 words per lane) for the large
/// matrices, and within noise for the small ones; the reduction buffer (R · WG floats) stays at 4 KiB.
const WG: usize = 128;
/// Most rows of x one pass over the weights serves.
const MAX_R: usize = 8;
/// Quant words each lane aims to take per row: fewer lanes per row mean shorter reductions and more rows
/// per workgroup, more words per lane more loads in flight per lane.
const WORDS_PER_LANE: usize = 16;
/// Threads per workgroup of the row-lookup kernels (one workgroup per token).
const GET_ROWS_WG: usize = 64;

/// Threads per weight row for rows of `kw` quant words: a power of two in 8..=64 (8 ≥ MAX_R, so the
/// lanes that write the R results exist; ≤ WG).
fn threads_per_row(kw: usize) -> usize {
    kw.div_ceil(WORDS_PER_LANE)
        .next_power_of_two()
        .clamp(MAX_R, 64)
}

/// The matmul pipeline for one variant; the WGSL file gets its constants and `xload` prepended.
fn matmul_pipeline(
    g: &GpuBackend,
    kind: QKind,
    tpr: usize,
    r: usize,
    xvec: bool,
    fault: Option<Fault>,
) -> Result<Rc<Pipeline>> {
    let (name, body, bindings): (String, &str, &[Access]) = match kind {
        QKind::Q8 { block } => (
            format!("qmm_q8b{block}"),
            include_str!("q8.wgsl"),
            &[Access::Read, Access::ReadWrite, Access::Read, Access::Read],
        ),
        QKind::Q4 => (
            "qmm_q4".to_string(),
            include_str!("q4.wgsl"),
            &[
                Access::Read,
                Access::ReadWrite,
                Access::Read,
                Access::Read,
                Access::Read,
            ],
        ),
    };
    let key = format!(
        "{name}_t{tpr}_r{r}_{}{}",
        if xvec { "xv4" } else { "xf32" },
        fault.map_or(String::new(), |f| format!("_fault{f:?}"))
    );
    g.pipeline(&key, bindings, PipelineOptions::default(), || {
        // x[i..i + 4] for i a multiple of 4: one 16-byte load when the view is 16-byte aligned, else four.
        let (xt, xload) = if xvec {
            ("vec4<f32>", "return x[i >> 2u];")
        } else {
            ("f32", "return vec4<f32>(x[i], x[i + 1u], x[i + 2u], x[i + 3u]);")
        };
        let src = format!(
            "{PRELUDE}\nconst WG: u32 = {WG}u;\nconst TPR: u32 = {tpr}u;\nconst R: u32 = {r}u;\n\
             const BLOCK: u32 = {}u;\nalias XT = {xt};\nfn xload(i: u32) -> vec4<f32> {{ {xload} }}\n{}",
            kind.block(),
            per_row(body, r)
        );
        plant(src, fault)
    })
}

/// Rewrites a matmul kernel's source into a planted fault's broken variant (tests of the gate only).
fn plant(src: String, fault: Option<Fault>) -> String {
    let tail = |src: String, code: &str| match src.rfind('}') {
        Some(i) => format!("{}{code}\n}}\n", &src[..i]),
        None => src,
    };
    match fault {
        None | Some(Fault::F16Accumulation) => src,
        // Zero-extends the bytes: negative quants become 128..255.
        Some(Fault::SignExtensionDropped) => src.replace(
            "vec4<f32>((vec4<i32>(bitcast<i32>(w)) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u))",
            "vec4<f32>((vec4<u32>(w) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u))",
        ),
        // The scale index wraps after 64 blocks, i.e. from K = 2048 on (block 32).
        Some(Fault::BlockIndexAtK2048) => src.replace("scales[srow + w / WPB]", "scales[srow + (w / WPB) % 64u]"),
        Some(Fault::OutOfBoundsWrite) => tail(
            src,
            "  if (lid == 0u && group_index(wid, nwg) == 0u && wid.z == 0u) { y[p.o_y + p.m * p.ldy] = 1.0; }",
        ),
        Some(Fault::NanOutput) => tail(
            src,
            "  workgroupBarrier();\n  if (lid == 0u && group_index(wid, nwg) == 0u && wid.z == 0u) { y[p.o_y] = bitcast<f32>(0x7fc00000u); }",
        ),
    }
}

/// Repeats each line of `body` that holds `$r` once per row of x, with `$r` replaced by 0 .. r.
fn per_row(body: &str, r: usize) -> String {
    let mut out = String::with_capacity(body.len() * 2);
    for line in body.lines() {
        if line.contains("$r") {
            for i in 0..r {
                out.push_str(&line.replace("$r", &i.to_string()));
                out.push('\n');
            }
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// A grid of `n` workgroups folded into x and y with as few spare groups as possible (`GpuBackend::grid`
/// fills x to the limit first, which can nearly double the groups launched past 65535).
fn fold(g: &GpuBackend, n: usize) -> [u32; 3] {
    let max = g.limits.max_compute_workgroups_per_dimension as usize;
    let ny = n.div_ceil(max).max(1);
    [n.div_ceil(ny) as u32, ny as u32, 1]
}

#[allow(clippy::too_many_arguments)]
pub(super) fn qmatmul(
    g: &GpuBackend,
    (tx, ox): (&GpuTensor, usize),
    (ty, oy): (&GpuTensor, usize),
    w: &GpuParts,
    kind: QKind,
    m: usize,
    n: usize,
    k: usize,
    fault: Option<Fault>,
) -> Result<()> {
    const OP: &str = "qmatmul";
    if m == 0 {
        return Ok(());
    }
    let kw = kind.words_per_row(k);
    let tpr = threads_per_row(kw);
    let rows_per_wg = WG / tpr;
    let max_z = g.limits.max_compute_workgroups_per_dimension as usize;
    let xy = segments(OP, m, &[Operand::rows(tx, ox, k), Operand::rows(ty, oy, n)])?;
    for xs in &xy {
        let (xb, yb) = (&xs.places[0].buffer, &xs.places[1].buffer);
        let xvec = xs.places[0].offset % 4 == 0;
        // Passes: full groups of MAX_R rows of x (several per dispatch, along z), then the remainder
        // with the smallest power-of-two R that holds it (its extra rows repeat the last one, unwritten).
        let mut passes = Vec::with_capacity(2);
        let (full, rem) = if xs.len() <= MAX_R {
            (0, xs.len())
        } else {
            (xs.len() / MAX_R, xs.len() % MAX_R)
        };
        let mut row = 0;
        let mut left = full;
        while left > 0 {
            let z = left.min(max_z);
            passes.push((row, z * MAX_R, MAX_R, z));
            row += z * MAX_R;
            left -= z;
        }
        if rem > 0 {
            passes.push((row, rem, rem.next_power_of_two(), 1));
        }
        for (i0, rows, r, z) in passes {
            let pipe = matmul_pipeline(g, kind, tpr, r, xvec, fault)?;
            let x_off = xs.places[0].offset + i0 * k;
            let y_off = xs.places[1].offset + i0 * n;
            for ws in &w.segs {
                let nseg = ws.len();
                let mut grid = fold(g, nseg.div_ceil(rows_per_wg));
                grid[2] = z as u32;
                let (sp, qp) = (&ws.places[0], &ws.places[1]);
                let mut params = vec![
                    nseg as u32,
                    kw as u32,
                    rows as u32,
                    k as u32,
                    n as u32,
                    x_off as u32,
                    (y_off + ws.start) as u32,
                    sp.offset as u32,
                    qp.offset as u32,
                ];
                let mut bufs = vec![xb, yb, &sp.buffer];
                if let Some(mp) = ws.places.get(2) {
                    params.push(mp.offset as u32);
                    bufs.push(&mp.buffer);
                }
                bufs.push(&qp.buffer);
                g.dispatch(&pipe, &params, &bufs, grid)?;
            }
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(super) fn get_rows(
    g: &GpuBackend,
    (ti, oi): (&GpuTensor, usize),
    (to, oo): (&GpuTensor, usize),
    w: &GpuParts,
    kind: QKind,
    n: usize,
    rows: usize,
    k: usize,
    scale: f32,
) -> Result<()> {
    const OP: &str = "qget_rows";
    if !scale.is_finite() {
        return Err(shape(OP, format!("scale {scale} is not finite")));
    }
    let (name, body, bindings): (&str, &str, &[Access]) = match kind {
        QKind::Q8 { .. } => (
            "qget_rows_q8",
            include_str!("get_rows_q8.wgsl"),
            &[Access::Read, Access::ReadWrite, Access::Read, Access::Read],
        ),
        QKind::Q4 => (
            "qget_rows_q4",
            include_str!("get_rows_q4.wgsl"),
            &[
                Access::Read,
                Access::ReadWrite,
                Access::Read,
                Access::Read,
                Access::Read,
            ],
        ),
    };
    let pipe = g.pipeline(name, bindings, PipelineOptions::default(), || {
        format!("{PRELUDE}\nconst WG: u32 = {GET_ROWS_WG}u;\n{body}")
    })?;
    let nb = k / kind.block();
    let words = kind.words_per_row(k);
    for ts in segments(OP, n, &[Operand::rows(ti, oi, 1), Operand::rows(to, oo, k)])? {
        for (first, ws) in w.segs.iter().enumerate() {
            let (sp, qp) = (&ws.places[0], &ws.places[1]);
            let mut params = vec![
                ts.len() as u32,
                ts.places[0].offset as u32,
                ts.places[1].offset as u32,
                words as u32,
                nb as u32,
                kind.block() as u32,
                ws.start as u32,
                ws.end as u32,
                rows as u32,
                (first == 0) as u32,
                scale.to_bits(),
                sp.offset as u32,
                qp.offset as u32,
            ];
            let mut bufs = vec![&ts.places[0].buffer, &ts.places[1].buffer, &sp.buffer];
            if let Some(mp) = ws.places.get(2) {
                params.push(mp.offset as u32);
                bufs.push(&mp.buffer);
            }
            bufs.push(&qp.buffer);
            g.dispatch(&pipe, &params, &bufs, g.grid(ts.len()))?;
        }
    }
    Ok(())
}
