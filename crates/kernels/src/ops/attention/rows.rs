//! Attention of a decode pass: one query row per sequence (a prompt's last token, or each sequence of a
//! server's batch), every sequence's keys and values in one shared cache tensor, all rows in one
//! dispatch (two past [`CHUNK`] positions: the splits, then their merge).
//!
//! [`attend_new_rows`] takes the rows as the Q/K/V product left them and does [`rope_into_cache`]'s
//! work (Q/K norms, RoPE, the new key and value into the cache) inside the same dispatch: a decode
//! step's layer saves that op's dispatch.
//!
//! ```text
//!   cache (one per layer):  row base_s + j = [k | v] of sequence s at position j
//!   table (per query row):  [base, pos]  — the row's sequence's first cache row, and its position
//! ```

use super::{DecodeShape, attend, head_cpu};
use crate::backend::{Backend, TMut, TRef, Tensor};
use crate::error::{Error, Result};
use crate::gpu::Access;
use crate::ops::common::{PRELUDE, form_lines, hoist_loads, kernel, repeat_lines};
use crate::ops::rope::{QkNorm, ROPE_PAIR, RopeCacheShape, RopeLayout, rope_into_cache};
use rayon::prelude::*;

/// Positions one workgroup scores (attend_rows.wgsl's CHUNK): many small splits keep each workgroup
/// short (a decode step is bound by latency), and a second dispatch merges them. (One workgroup of 256
/// positions per head, with no merge, measured 2-3x slower on an H200.)
pub const CHUNK: usize = 32;

/// The most floats of partial results (heads × splits × (head_dim + 2)) one row's attention leaves
/// for its output product to merge: every workgroup of that product reads and merges all of them, so
/// past a few thousand floats the merge's own dispatch (one workgroup per head, the same values in the
/// same order) costs less. H100, decode 128 tokens (tok/s), merged in the product / by its own dispatch:
/// SmolLM2-135M's shape after 128 positions (5 splits, 2,970 floats) 999-1,001 / 981-982; after 512
/// (17 splits, 10,098 floats) 835 / 951-954, after 1,024 690 / 917; Gemma-3-270M's after 512 (16-17
/// splits, 16,512-17,544 floats) 1,081-1,083 / 1,175-1,178, after 1,024 1,054 / 1,176.
const DEFER_MAX_FLOATS: usize = 8192;

/// attend_rows.wgsl's source (both forms, see [`form_lines`]).
const ATTEND_ROWS: &str = include_str!("attend_rows.wgsl");
/// attend_rows.wgsl's threads per position in the scores (TPP).
const TPP: usize = 8;
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
        cache_buffers(self.host, cache, offset, ld)
    }
}

/// [`CacheRows::buffers`] for the rows `host`.
fn cache_buffers<'c>(
    host: &[[u32; 2]],
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
            let used = host.iter().any(|r| (lo..hi).contains(&(r[0] as usize)));
            used.then(|| (&c.buffer, offset + lo * ld - c.start, lo, hi))
        })
        .collect()
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
pub(crate) fn split_len(rows: usize, heads: usize, head_dim: usize, n_split: usize) -> usize {
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
    if !fits_kernel(g, rows.host, cache.offset(), &s) {
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
    let ct = cache.gpu("attend_rows", "cache", cache_rows * s.ld_kv)?;
    let place = Places {
        q: (bq, oq),
        out: (bo, oo),
        table: (bt, ot),
        cache: ct,
        cache_offset: cache.offset(),
    };
    record(g, place, rows.host, &s, None, false).map(|_| ())
}

/// The new rows of a decode pass as the Q/K/V product left them, for [`attend_new_rows`].
#[derive(Clone, Copy)]
pub struct NewRows<'a> {
    /// Rows of `[q | k | v]`, `shape.ld_in` apart (q, k and v at `shape`'s `q_at`, `k_at`, `v_at`).
    pub input: TRef<'a>,
    /// The RoPE table of [`crate::ops::rope::rope_table`] and its length in positions.
    pub table: TRef<'a>,
    pub positions: usize,
    /// Per-head RMSNorm of the queries and keys (Gemma 3, Qwen3).
    pub norm: Option<QkNorm<'a>>,
    pub shape: RopeCacheShape,
}

/// [`rope_into_cache`] then [`attend_rows`] — each row's query and key heads normed (optional) and
/// rotated, its key and value written to its cache row, its attention over its sequence — in one
/// dispatch (and the merge) where the attention kernel takes the shapes; the two ops otherwise (the CPU
/// backend: its twin), with the rotated queries in `q_scratch` (`s.ld_q` apart). The cache holds
/// rope_into_cache's rows: keys at 0, values at `kv_heads · head_dim` (`s.k_at`, `s.v_at`).
///
/// With `defer_merge`, one row whose attention takes several splits may come back as
/// [`Attended::Splits`] (its output not written) for the output product to merge.
#[allow(clippy::too_many_arguments)]
pub fn attend_new_rows(
    be: &Backend,
    new: NewRows<'_>,
    q_scratch: TMut<'_>,
    cache: TMut<'_>,
    rows: CacheRows<'_>,
    out: TMut<'_>,
    s: RowsShape,
    defer_merge: bool,
) -> Result<Attended> {
    let r = new.shape;
    let kvd = r.kv_heads * r.head_dim;
    if (r.heads, r.kv_heads, r.head_dim, r.ld_kv, r.ld_q)
        != (s.heads, s.kv_heads, s.head_dim, s.ld_kv, s.ld_q)
        || s.k_at != 0
        || s.v_at != kvd
    {
        return Err(Error::Shape {
            op: "attend_new_rows",
            msg: format!(
                "the rotation's shape {r:?} and the attention's {s:?} must agree (heads, cache rows of [k | v], query rows)"
            ),
        });
    }
    let n = rows.host.len();
    let cache_rows = (cache.tensor().len() - cache.offset()) / s.ld_kv.max(1);
    let fused = match be {
        Backend::Gpu(g)
            if n > 0
                && r.n_rot <= r.head_dim
                && r.n_rot.is_multiple_of(2)
                && rows.host.iter().enumerate().all(|(i, h)| {
                    (h[1] as usize) < new.positions
                        && (h[0] as usize + h[1] as usize) < cache_rows
                        // Rows of one sequence: a row would read another's new key (the two ops
                        // write every row's first).
                        && rows.host[..i].iter().all(|o| o[0] != h[0])
                })
                && fits_kernel(g, rows.host, cache.offset(), &s) =>
        {
            Some(g)
        }
        _ => None,
    };
    let Some(g) = fused else {
        return two_ops(be, new, q_scratch, cache, rows, out, s);
    };
    let span_in = (n - 1) * r.ld_in
        + (r.q_at + r.heads * r.head_dim)
            .max(r.k_at + kvd)
            .max(r.v_at + kvd);
    let span_o = (n - 1) * s.ld_o + s.heads * s.head_dim;
    let tab_len = new.positions * (r.n_rot / 2) * 2;
    let input = new.input;
    let places = (
        input
            .gpu("attend_new_rows", "input", span_in)?
            .span(input.offset(), span_in),
        out.gpu("attend_new_rows", "out", span_o)?
            .span(out.offset(), span_o),
        rows.table
            .gpu("attend_new_rows", "rows", 2 * n)?
            .span(rows.table.offset(), 2 * n),
        new.table
            .gpu("attend_new_rows", "table", tab_len.max(1))?
            .span(new.table.offset(), tab_len.max(1)),
    );
    // None: a norm weight across buffers.
    let norm = match new.norm {
        None => Some(None),
        Some(nm) => match (
            nm.q.gpu("attend_new_rows", "q norm", r.head_dim)?
                .span(nm.q.offset(), r.head_dim),
            nm.k.gpu("attend_new_rows", "k norm", r.head_dim)?
                .span(nm.k.offset(), r.head_dim),
        ) {
            (Some(q), Some(k)) => Some(Some((q, k, nm.eps))),
            _ => None,
        },
    };
    let ((Some((bi, oi)), Some(o), Some(t), Some(rope)), Some(norm)) = (places, norm) else {
        // A view across buffers: the two ops.
        return two_ops(be, new, q_scratch, cache, rows, out, s);
    };
    let ct = cache
        .as_ref()
        .gpu("attend_new_rows", "cache", cache_rows * s.ld_kv)?;
    let place = Places {
        q: (bi, oi + r.q_at),
        out: o,
        table: t,
        cache: ct,
        cache_offset: cache.offset(),
    };
    let fresh = FreshGpu {
        o_kn: oi + r.k_at,
        o_vn: oi + r.v_at,
        n_rot: r.n_rot,
        layout: r.layout,
        rope,
        norm,
    };
    record(
        g,
        place,
        rows.host,
        &RowsShape { ld_q: r.ld_in, ..s },
        Some(fresh),
        defer_merge,
    )
}

/// [`attend_new_rows`] as its two ops: [`rope_into_cache`] (the rotated queries into `q_scratch`), then
/// [`attend_rows`].
fn two_ops(
    be: &Backend,
    new: NewRows<'_>,
    mut q_scratch: TMut<'_>,
    mut cache: TMut<'_>,
    rows: CacheRows<'_>,
    out: TMut<'_>,
    s: RowsShape,
) -> Result<Attended> {
    rope_into_cache(
        be,
        new.input,
        q_scratch.reborrow(),
        cache.reborrow(),
        rows,
        new.table,
        new.positions,
        new.norm,
        new.shape,
    )?;
    attend_rows(be, q_scratch.as_ref(), cache.as_ref(), rows, out, s)?;
    Ok(Attended::Written)
}

/// Whether the kernel takes `s` over `rows` (else the row-by-row path runs): it reads the cache as
/// 16-byte vectors and splits 256 threads over a head's vectors.
fn fits_kernel(
    g: &crate::gpu::GpuBackend,
    rows: &[[u32; 2]],
    cache_offset: usize,
    s: &RowsShape,
) -> bool {
    let vec4 = [s.ld_kv, s.k_at, s.v_at, cache_offset]
        .iter()
        .all(|v| v.is_multiple_of(4));
    let (_, n_split) = splits(rows, s.window);
    let wgs = rows.len() * s.kv_heads * (s.heads / s.kv_heads).div_ceil(GMAX);
    let max = g.limits.max_compute_workgroups_per_dimension as usize;
    vec4 && s.head_dim.is_multiple_of(4)
        && s.head_dim <= 256
        && 256 % (s.head_dim / 4) == 0
        && wgs <= max
        && n_split <= max
}

/// Where the kernel's operands lie: (buffer, element offset) of the queries (or, for new rows, of the
/// Q/K/V product's rows), the output and the row table, and the cache.
struct Places<'a> {
    q: Place<'a>,
    out: Place<'a>,
    table: Place<'a>,
    cache: &'a crate::gpu::GpuTensor,
    cache_offset: usize,
}

/// A buffer and an element offset in it.
type Place<'a> = (&'a wgpu::Buffer, usize);

/// What the FRESH variant needs beyond [`Places`]: where the new key and value heads start (element
/// offsets in the queries' buffer, rows `ld_q` apart), the rotation and the optional norms.
struct FreshGpu<'a> {
    o_kn: usize,
    o_vn: usize,
    n_rot: usize,
    layout: RopeLayout,
    rope: Place<'a>,
    /// The query and key norm weights, and epsilon.
    norm: Option<(Place<'a>, Place<'a>, f32)>,
}

/// Records the attention for every row of `rows`, and past one split its merge, unless `defer` (one
/// row, few enough splits for the product's merging stage): then the splits are left for the product.
fn record(
    g: &crate::gpu::GpuBackend,
    place: Places<'_>,
    rows: &[[u32; 2]],
    s: &RowsShape,
    fresh: Option<FreshGpu<'_>>,
    defer: bool,
) -> Result<Attended> {
    let n = rows.len();
    let Places {
        q: (bq, oq),
        out: (bo, oo),
        table: (bt, ot),
        ..
    } = place;
    let (chunk, n_split) = splits(rows, s.window);
    let groups = (s.heads / s.kv_heads).div_ceil(GMAX);
    let wgs = n * s.kv_heads * groups;
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
    // Read-only stand-ins (`dummy` may be bound read-write as `part` in the same dispatch).
    let none = g.scratch("attend_rows_none", 1)?;
    let db = &none.chunks[0].buffer;
    let is_fresh = fresh.is_some();
    // Up front (GPUs): each thread's key and value loads are written out (NC and NV of them for this
    // head size) and issued as soon as the table is read, before the queries' norms and the sums that
    // use them, which add in the loops' order. The form scores its chunk in one step.
    let up = (hoist_loads(g) && chunk <= 256 / TPP).then(|| {
        let hd4 = s.head_dim / 4;
        (hd4.div_ceil(TPP), chunk.div_ceil(256 / hd4))
    });
    let key = format!(
        "attend_rows_c{chunk}{}{}",
        if is_fresh { "_new" } else { "" },
        up.map_or(String::new(), |(nc, nv)| format!("_up{nc}x{nv}"))
    );
    let pipe = g.pipeline(
        &key,
        &[
            Access::Read,
            Access::ReadWrite,
            Access::Read,
            Access::ReadWrite,
            Access::ReadWrite,
            Access::Read,
            Access::Read,
            Access::Read,
        ],
        || {
            let form = match up {
                Some((nc, nv)) => {
                    let src = form_lines(ATTEND_ROWS, "#up ");
                    repeat_lines(&repeat_lines(&src, "$c", nc), "$v", nv)
                }
                None => form_lines(ATTEND_ROWS, "#loop "),
            };
            format!(
                "{PRELUDE}\nconst CHUNK: u32 = {chunk}u;\nconst FRESH: bool = {is_fresh};\n{ROPE_PAIR}\n{form}"
            )
        },
    )?;
    let (o_kn, o_vn, n_rot, neox, (br, or)) = match &fresh {
        Some(f) => (
            f.o_kn,
            f.o_vn,
            f.n_rot,
            f.layout == RopeLayout::Neox,
            f.rope,
        ),
        None => (0, 0, 0, false, (db, 0)),
    };
    let (norm_on, (bqw, oqw), (bkw, okw), eps) = match fresh.as_ref().and_then(|f| f.norm) {
        Some((qw, kw, eps)) => (true, qw, kw, eps),
        None => (false, (db, 0), (db, 0), 0.0),
    };
    for (buffer, o_kv, lo, hi) in cache_buffers(rows, place.cache, place.cache_offset, s.ld_kv) {
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
            o_kn as u32,
            o_vn as u32,
            n_rot as u32,
            neox as u32,
            or as u32,
            norm_on as u32,
            oqw as u32,
            okw as u32,
            eps.to_bits(),
        ];
        g.dispatch(
            &pipe,
            &params,
            &[bq, buffer, bt, bo, &pb, br, bqw, bkw],
            [wgs as u32, n_split as u32, 1],
        )?;
    }
    if let Some(part) = scratch {
        let len = split_len(1, s.heads, s.head_dim, n_split);
        if defer
            && n == 1
            && len <= DEFER_MAX_FLOATS
            && crate::ops::matmul::quant::merge_takes(s.heads, n_split)
        {
            return Ok(Attended::Splits {
                part: Tensor::of_gpu(part),
                n_split,
            });
        }
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
    Ok(Attended::Written)
}

/// What a decode pass's attention leaves for the product after it.
pub enum Attended {
    /// The output rows are written.
    Written,
    /// One row's partial results, per head and split (its maximum, its sum of exponentials, its
    /// unnormalised output), for the output product to merge as it reads them
    /// ([`crate::ops::matmul::fused::Input::Merge`]) — the merge's dispatch saved.
    Splits { part: Tensor, n_split: usize },
}

/// out = the merge of one row's `n_split` splits per head in `part` (as [`Attended::Splits`] holds
/// them): per head Σ_s e^(m_s − M) o_s / Σ_s e^(m_s − M) l_s, M the largest maximum of a non-empty
/// split, empty splits (l_s = 0) skipped, each sum in split order.
pub fn merge_splits(
    be: &Backend,
    part: TRef<'_>,
    mut out: TMut<'_>,
    heads: usize,
    head_dim: usize,
    n_split: usize,
) -> Result<()> {
    let stride = head_dim + 2;
    let len = split_len(1, heads, head_dim, n_split);
    match be {
        Backend::Cpu(_) => {
            let ps = part.cpu("merge_splits", "part", len)?;
            let os = out.cpu("merge_splits", "out", heads * head_dim)?;
            for h in 0..heads {
                let sp = &ps[h * n_split * stride..][..n_split * stride];
                let live = |s: usize| sp[s * stride + 1] > 0.0;
                let mx = (0..n_split)
                    .filter(|&s| live(s))
                    .map(|s| sp[s * stride])
                    .fold(f32::NEG_INFINITY, f32::max);
                let w: Vec<f32> = (0..n_split)
                    .map(|s| {
                        if live(s) {
                            (sp[s * stride] - mx).exp()
                        } else {
                            0.0
                        }
                    })
                    .collect();
                let den = (0..n_split)
                    .filter(|&s| live(s))
                    .fold(0.0f32, |a, s| a + w[s] * sp[s * stride + 1]);
                for d in 0..head_dim {
                    let acc = (0..n_split)
                        .filter(|&s| live(s))
                        .fold(0.0f32, |a, s| a + w[s] * sp[s * stride + 2 + d]);
                    os[h * head_dim + d] = acc / den;
                }
            }
            Ok(())
        }
        Backend::Gpu(g) => {
            let (Some(p), Some(o)) = (
                part.gpu("merge_splits", "part", len)?
                    .span(part.offset(), len),
                out.gpu("merge_splits", "out", heads * head_dim)?
                    .span(out.offset(), heads * head_dim),
            ) else {
                return Err(Error::Shape {
                    op: "merge_splits",
                    msg: "the splits and the output must each lie in one buffer".into(),
                });
            };
            merge_gpu(g, p, o, 1, heads, head_dim, heads * head_dim, n_split)
        }
    }
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
