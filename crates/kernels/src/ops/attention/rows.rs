//! Attention of a decode pass: one query row per sequence (a prompt's last token, or each sequence of a
//! server's batch), every sequence's keys and values in one shared cache tensor, all rows in one
//! dispatch (two past [`CHUNK`] positions: the splits, then their merge).
//!
//! ```text
//!   cache (one per layer):  row base_s + j = [k | v] of sequence s at position j
//!   table (per query row):  [base, pos]  — the row's sequence's first cache row, and its position
//! ```

use super::{DecodeShape, attend, head_cpu};
use crate::backend::{Backend, TMut, TRef};
use crate::error::{Error, Result};
use crate::gpu::Access;
use crate::ops::common::kernel;
use rayon::prelude::*;

/// Positions one workgroup scores (attend_rows.wgsl's CHUNK): many small splits keep each workgroup
/// short (a decode step is bound by latency), and a second dispatch merges them. (One workgroup of 256
/// positions per head, with no merge, measured 2-3x slower on an H200.)
pub const CHUNK: usize = 32;
/// Query heads one workgroup serves (attend_rows.wgsl's GMAX).
const GMAX: usize = 4;

/// Where each row of a decode pass reads the KV cache.
#[derive(Clone, Copy)]
pub struct CacheRows<'a> {
    /// Per row two u32 words: the cache row holding its sequence's position 0, and its position.
    pub table: TRef<'a>,
    /// The same words on the host (they size the dispatch and are checked against the cache).
    pub host: &'a [[u32; 2]],
}

impl CacheRows<'_> {
    /// The buffers of `cache` (rows of `ld` elements from the view's offset; a cache split across
    /// buffers splits at whole sequences) that some row's sequence lies in: (buffer, element offset of
    /// its first whole row inside it, that row's index, one past its last row's index).
    pub(crate) fn buffers<'c>(
        &self,
        cache: &'c crate::gpu::GpuTensor,
        offset: usize,
        ld: usize,
    ) -> Vec<(&'c wgpu::Buffer, usize, usize, usize)> {
        cache
            .chunks
            .iter()
            .filter_map(|c| {
                let first = c.start.max(offset);
                let lo = (first - offset).div_ceil(ld);
                let hi = (c.start + c.len).saturating_sub(offset) / ld;
                let used = self
                    .host
                    .iter()
                    .any(|r| (lo..hi).contains(&(r[0] as usize)));
                used.then(|| (&c.buffer, offset + lo * ld - c.start, lo, hi))
            })
            .collect()
    }
}

/// Heads and layouts of a decode pass's attention.
#[derive(Clone, Copy, Debug)]
pub struct RowsShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Row strides of the queries, of the cache and of the output.
    pub ld_q: usize,
    pub ld_kv: usize,
    pub ld_o: usize,
    /// Where keys and values start inside a cache row.
    pub k_at: usize,
    pub v_at: usize,
    /// Positions a query sees (0: all).
    pub window: usize,
    pub scale: f32,
    pub softcap: f32,
}

/// Elements of the partial results of `n_split` splits: per (row, head, split) the split's maximum, its sum
/// of exponentials and its unnormalised output.
fn split_len(rows: usize, heads: usize, head_dim: usize, n_split: usize) -> usize {
    rows * heads * n_split * (head_dim + 2)
}

/// (positions per split, splits) for the longest row of `rows`.
fn splits(rows: &[[u32; 2]], window: usize) -> (usize, usize) {
    let longest = rows
        .iter()
        .map(|r| {
            let seen = r[1] as usize + 1;
            if window > 0 { seen.min(window) } else { seen }
        })
        .max()
        .unwrap_or(1);
    (CHUNK, longest.div_ceil(CHUNK))
}

/// out[r] = softmax(scale · q[r] · Kᵀ) · V over row r's sequence, positions (pos − window, pos], for
/// every row of `rows`; grouped-query heads share their KV head.
pub fn attend_rows(
    be: &Backend,
    q: TRef<'_>,
    cache: TRef<'_>,
    rows: CacheRows<'_>,
    mut out: TMut<'_>,
    s: RowsShape,
) -> Result<()> {
    let n = rows.host.len();
    let bad = |msg: String| {
        Err(Error::Shape {
            op: "attend_rows",
            msg,
        })
    };
    if s.kv_heads == 0 || s.head_dim == 0 || !s.heads.is_multiple_of(s.kv_heads) {
        return bad(format!(
            "heads {} must be a multiple of kv_heads {}",
            s.heads, s.kv_heads
        ));
    }
    let width = s.kv_heads * s.head_dim;
    if s.k_at + width > s.ld_kv || s.v_at + width > s.ld_kv {
        return bad(format!(
            "keys at {} and values at {} do not fit cache rows of {}",
            s.k_at, s.v_at, s.ld_kv
        ));
    }
    let cache_rows = (cache.tensor().len() - cache.offset()) / s.ld_kv;
    if let Some(r) = rows
        .host
        .iter()
        .find(|r| (r[0] as usize + r[1] as usize) >= cache_rows)
    {
        return bad(format!(
            "row at cache row {} + position {} is past the cache's {cache_rows} rows",
            r[0], r[1]
        ));
    }
    let shape = |pos: usize| DecodeShape {
        rows: 1,
        heads: s.heads,
        kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        ld_q: s.ld_q,
        ld_kv: s.ld_kv,
        ld_o: s.ld_o,
        q_pos0: pos,
        kv_len: pos + 1,
        window: s.window,
        scale: s.scale,
        softcap: s.softcap,
    };
    let one_by_one = |out: &mut TMut<'_>| -> Result<()> {
        for (r, &[base, pos]) in rows.host.iter().enumerate() {
            let at = cache.offset() + base as usize * s.ld_kv;
            let (k, v) = (
                cache.tensor().at(at + s.k_at),
                cache.tensor().at(at + s.v_at),
            );
            let o = out.shift(r * s.ld_o);
            attend(be, q.shift(r * s.ld_q), k, v, o, shape(pos as usize))?;
        }
        Ok(())
    };
    if n == 0 {
        return Ok(());
    }
    let span_q = (n - 1) * s.ld_q + s.heads * s.head_dim;
    let span_o = (n - 1) * s.ld_o + s.heads * s.head_dim;
    let g = match be {
        // The twin: every (row, head) of the pass in one parallel loop, each computed exactly as
        // `attend` computes that row alone (one fork-join a layer, not one a row).
        Backend::Cpu(c) => {
            let qs = q.cpu("attend_rows", "q", span_q)?;
            let cs = cache.cpu("attend_rows", "cache", cache_rows * s.ld_kv)?;
            let os = out.cpu("attend_rows", "out", span_o)?;
            let group = s.heads / s.kv_heads;
            let results: Vec<(usize, Vec<f32>)> = c.install(|| {
                (0..n * s.heads)
                    .into_par_iter()
                    .map(|gi| {
                        let (r, h) = (gi / s.heads, gi % s.heads);
                        let [base, pos] = rows.host[r].map(|v| v as usize);
                        let seq = &cs[base * s.ld_kv..];
                        let qr = &qs[r * s.ld_q + h * s.head_dim..][..s.head_dim];
                        let o = head_cpu(
                            qr,
                            &seq[s.k_at..],
                            &seq[s.v_at..],
                            h / group,
                            pos,
                            &shape(pos),
                        );
                        (r * s.ld_o + h * s.head_dim, o)
                    })
                    .collect()
            });
            for (off, o) in results {
                os[off..off + s.head_dim].copy_from_slice(&o);
            }
            return Ok(());
        }
        Backend::Gpu(g) => g,
    };
    // The kernel reads the cache as 16-byte vectors and splits 256 threads over a head's vectors.
    let vec4 = [s.ld_kv, s.k_at, s.v_at, cache.offset()]
        .iter()
        .all(|v| v.is_multiple_of(4));
    if !vec4 || !s.head_dim.is_multiple_of(4) || s.head_dim > 256 || 256 % (s.head_dim / 4) != 0 {
        return one_by_one(&mut out);
    }
    let (Some((bq, oq)), Some((bo, oo)), Some((bt, ot))) = (
        q.gpu("attend_rows", "q", span_q)?.span(q.offset(), span_q),
        out.gpu("attend_rows", "out", span_o)?
            .span(out.offset(), span_o),
        rows.table
            .gpu("attend_rows", "table", 2 * n)?
            .span(rows.table.offset(), 2 * n),
    ) else {
        return one_by_one(&mut out);
    };
    let (chunk, n_split) = splits(rows.host, s.window);
    let groups = (s.heads / s.kv_heads).div_ceil(GMAX);
    let wgs = n * s.kv_heads * groups;
    let max = g.limits.max_compute_workgroups_per_dimension as usize;
    if wgs > max || n_split > max {
        return one_by_one(&mut out);
    }
    // Partial results of every split, merged by a second dispatch.
    let scratch = if n_split > 1 {
        Some(g.scratch(
            "attend_rows_part",
            split_len(n, s.heads, s.head_dim, n_split),
        )?)
    } else {
        None
    };
    let dummy = g.scratch("dummy", 1)?;
    let pb = scratch.as_ref().unwrap_or(&dummy).chunks[0].buffer.clone();
    let pipe = kernel(
        g,
        &format!("attend_rows_c{chunk}"),
        &format!(
            "const CHUNK: u32 = {chunk}u;\n{}",
            include_str!("attend_rows.wgsl")
        ),
        &[
            Access::Read,
            Access::Read,
            Access::Read,
            Access::ReadWrite,
            Access::ReadWrite,
        ],
    )?;
    let ct = cache.gpu("attend_rows", "cache", cache_rows * s.ld_kv)?;
    for (buffer, o_kv, lo, hi) in rows.buffers(ct, cache.offset(), s.ld_kv) {
        let params = [
            n as u32,
            s.heads as u32,
            s.kv_heads as u32,
            s.head_dim as u32,
            s.ld_q as u32,
            s.ld_kv as u32,
            s.ld_o as u32,
            s.window as u32,
            s.scale.to_bits(),
            s.softcap.to_bits(),
            oq as u32,
            (o_kv + s.k_at) as u32,
            (o_kv + s.v_at) as u32,
            oo as u32,
            ot as u32,
            lo as u32,
            hi as u32,
            n_split as u32,
            0,
            groups as u32,
        ];
        g.dispatch(
            &pipe,
            &params,
            &[bq, buffer, bt, bo, &pb],
            [wgs as u32, n_split as u32, 1],
        )?;
    }
    if let Some(part) = scratch {
        merge_gpu(
            g,
            (&part.chunks[0].buffer, 0),
            (bo, oo),
            n,
            s.heads,
            s.head_dim,
            s.ld_o,
            n_split,
        )?;
    }
    Ok(())
}

/// out[r, h] = the merge of row r's, head h's `n_split` partial results in `part`:
/// Σ_s e^(m_s − M) o_s / Σ_s e^(m_s − M) l_s, M the largest split maximum, splits with l_s = 0 skipped.
#[allow(clippy::too_many_arguments)]
pub(super) fn merge_gpu(
    g: &crate::gpu::GpuBackend,
    (bp, op): (&wgpu::Buffer, usize),
    (bo, oo): (&wgpu::Buffer, usize),
    rows: usize,
    heads: usize,
    head_dim: usize,
    ld_o: usize,
    n_split: usize,
) -> Result<()> {
    let pipe = kernel(
        g,
        "attend_combine",
        include_str!("attend_combine.wgsl"),
        &[Access::Read, Access::ReadWrite],
    )?;
    let params = [
        (rows * heads) as u32,
        heads as u32,
        head_dim as u32,
        ld_o as u32,
        n_split as u32,
        op as u32,
        oo as u32,
    ];
    g.dispatch(&pipe, &params, &[bp, bo], g.grid(rows * heads))
}
