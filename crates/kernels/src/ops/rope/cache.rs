//! The step between a decode pass's Q/K/V product and its attention: optional per-head RMSNorm of the
//! queries and keys (Gemma 3, Qwen3), RoPE, and the keys and values written to each row's cache row,
//! in one dispatch — what norm, rope and copy do one after another (that is the CPU twin).
//!
//! ```text
//!   input row (ld_in apart):   ... | q (heads x head_dim) | ... | k (kv_heads x head_dim) | ... | v | ...
//!   query output (ld_q apart): q rotated
//!   cache row base + pos:      [ k rotated | v ]  (ld_kv elements, keys from 0, values from kv_heads x head_dim)
//! ```

use super::ROPE_PAIR;
use super::{RopeLayout, RopeShape, rope};
use crate::backend::{Backend, TMut, TRef};
use crate::error::{Error, Result};
use crate::gpu::Access;
use crate::ops::attention::CacheRows;
use crate::ops::common::{ROW_REDUCE, kernel_parts};
use crate::ops::fill::copy;
use crate::ops::norm::{NormKind, NormShape, norm_forward};

/// Heads and layouts of [`rope_into_cache`].
#[derive(Clone, Copy, Debug)]
pub struct RopeCacheShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub layout: RopeLayout,
    /// Row stride of the input, and where its q, k and v start inside a row.
    pub ld_in: usize,
    pub q_at: usize,
    pub k_at: usize,
    pub v_at: usize,
    /// Row stride of the query output, and of the cache.
    pub ld_q: usize,
    pub ld_kv: usize,
}

/// Per-head RMSNorm weights of the queries and keys (head_dim each), and their epsilon.
#[derive(Clone, Copy)]
pub struct QkNorm<'a> {
    pub q: TRef<'a>,
    pub k: TRef<'a>,
    pub eps: f32,
}

/// Normalises (with `norm`), rotates and places the queries, keys and values of each row of `rows`
/// (`table`: the RoPE table of [`super::rope_table`], `positions` long).
#[allow(clippy::too_many_arguments)]
pub fn rope_into_cache(
    be: &Backend,
    input: TRef<'_>,
    q_out: TMut<'_>,
    cache: TMut<'_>,
    rows: CacheRows<'_>,
    table: TRef<'_>,
    positions: usize,
    norm: Option<QkNorm<'_>>,
    s: RopeCacheShape,
) -> Result<()> {
    let n = rows.host.len();
    let bad = |msg: String| {
        Err(Error::Shape {
            op: "rope_into_cache",
            msg,
        })
    };
    let kvd = s.kv_heads * s.head_dim;
    if s.ld_kv < 2 * kvd || s.n_rot > s.head_dim || !s.n_rot.is_multiple_of(2) || s.head_dim == 0 {
        return bad(format!(
            "bad shape {s:?}: cache rows hold [k | v], n_rot even and <= head_dim"
        ));
    }
    if let Some(r) = rows.host.iter().find(|r| r[1] as usize >= positions) {
        return bad(format!(
            "position {} is past the RoPE table's {positions}",
            r[1]
        ));
    }
    let cache_rows = (cache.tensor().len() - cache.offset()) / s.ld_kv;
    if let Some(r) = rows
        .host
        .iter()
        .find(|r| (r[0] as usize + r[1] as usize) >= cache_rows)
    {
        return bad(format!(
            "cache row {} + position {} is past the cache's {cache_rows} rows",
            r[0], r[1]
        ));
    }
    let g = match be {
        Backend::Gpu(g) if s.head_dim <= 256 && n > 0 => g,
        _ => return one_by_one(be, input, q_out, cache, rows, table, positions, norm, s),
    };
    let span_in = (n - 1) * s.ld_in
        + (s.q_at + s.heads * s.head_dim)
            .max(s.k_at + kvd)
            .max(s.v_at + kvd);
    let span_q = (n - 1) * s.ld_q + s.heads * s.head_dim;
    let tab_len = positions * (s.n_rot / 2) * 2;
    let places = (
        input
            .gpu("rope_into_cache", "input", span_in)?
            .span(input.offset(), span_in),
        q_out
            .gpu("rope_into_cache", "q", span_q)?
            .span(q_out.offset(), span_q),
        rows.table
            .gpu("rope_into_cache", "rows", 2 * n)?
            .span(rows.table.offset(), 2 * n),
        table
            .gpu("rope_into_cache", "table", tab_len.max(1))?
            .span(table.offset(), tab_len.max(1)),
    );
    let norm_places = match norm {
        Some(nm) => (
            nm.q.gpu("rope_into_cache", "q norm", s.head_dim)?
                .span(nm.q.offset(), s.head_dim),
            nm.k.gpu("rope_into_cache", "k norm", s.head_dim)?
                .span(nm.k.offset(), s.head_dim),
        ),
        None => (None, None),
    };
    let ((Some((bi, oi)), Some((bq, oq)), Some((bt, ot)), Some((br, or))), nw) =
        (places, norm_places)
    else {
        return one_by_one(be, input, q_out, cache, rows, table, positions, norm, s);
    };
    let dummy = g.scratch("dummy", 1)?;
    let (norm_on, (bqw, oqw), (bkw, okw)) = match (norm, nw) {
        (None, _) => (
            false,
            (&dummy.chunks[0].buffer, 0),
            (&dummy.chunks[0].buffer, 0),
        ),
        (Some(_), (Some(q), Some(k))) => (true, q, k),
        _ => return one_by_one(be, input, q_out, cache, rows, table, positions, norm, s),
    };
    let pipe = kernel_parts(
        g,
        "rope_cache",
        &[ROW_REDUCE, ROPE_PAIR, include_str!("rope_cache.wgsl")],
        &[
            Access::Read,
            Access::ReadWrite,
            Access::ReadWrite,
            Access::Read,
            Access::Read,
            Access::Read,
            Access::Read,
        ],
    )?;
    let ct = cache.gpu("rope_into_cache", "cache", cache_rows * s.ld_kv)?;
    let mut queries = true;
    for (buffer, o_kv, lo, hi) in rows.buffers(ct, cache.offset(), s.ld_kv) {
        let params = [
            n as u32,
            s.heads as u32,
            s.kv_heads as u32,
            s.head_dim as u32,
            s.n_rot as u32,
            (s.layout == RopeLayout::Neox) as u32,
            s.ld_in as u32,
            s.q_at as u32,
            s.k_at as u32,
            s.v_at as u32,
            s.ld_q as u32,
            s.ld_kv as u32,
            oi as u32,
            oq as u32,
            o_kv as u32,
            ot as u32,
            or as u32,
            norm_on as u32,
            oqw as u32,
            okw as u32,
            norm.map_or(0.0, |nm| nm.eps).to_bits(),
            lo as u32,
            hi as u32,
            queries as u32,
        ];
        g.dispatch(
            &pipe,
            &params,
            &[bi, bq, buffer, bt, br, bqw, bkw],
            [n as u32, (s.heads + s.kv_heads) as u32, 1],
        )?;
        queries = false;
    }
    Ok(())
}

/// The twin: norm, rope and copy, row by row.
#[allow(clippy::too_many_arguments)]
fn one_by_one(
    be: &Backend,
    input: TRef<'_>,
    mut q_out: TMut<'_>,
    mut cache: TMut<'_>,
    rows: CacheRows<'_>,
    table: TRef<'_>,
    positions: usize,
    norm: Option<QkNorm<'_>>,
    s: RopeCacheShape,
) -> Result<()> {
    let kvd = s.kv_heads * s.head_dim;
    let hd = s.head_dim;
    let mut stats = be.scratch("rope_cache_stats", 2 * s.heads.max(s.kv_heads), 1)?;
    for (r, &[base, pos]) in rows.host.iter().enumerate() {
        let row = input.shift(r * s.ld_in);
        let q = q_out.shift(r * s.ld_q);
        match norm {
            Some(nm) => {
                let shape = NormShape {
                    rows: s.heads,
                    cols: hd,
                    eps: nm.eps,
                };
                norm_forward(
                    be,
                    NormKind::Rms,
                    row.shift(s.q_at),
                    nm.q,
                    q,
                    stats.at_mut(0),
                    shape,
                )?
            }
            None => copy(be, row.shift(s.q_at), q, s.heads * hd)?,
        }
        let at = (base + pos) as usize * s.ld_kv;
        let rope_shape = |heads: usize| RopeShape {
            rows: 1,
            heads,
            head_dim: hd,
            n_rot: s.n_rot,
            ld: heads * hd,
            pos0: pos as usize,
            layout: s.layout,
            inverse: false,
        };
        rope(
            be,
            q_out.shift(r * s.ld_q),
            table,
            positions,
            rope_shape(s.heads),
        )?;
        let k = cache.shift(at);
        match norm {
            Some(nm) => {
                let shape = NormShape {
                    rows: s.kv_heads,
                    cols: hd,
                    eps: nm.eps,
                };
                norm_forward(
                    be,
                    NormKind::Rms,
                    row.shift(s.k_at),
                    nm.k,
                    k,
                    stats.at_mut(0),
                    shape,
                )?
            }
            None => copy(be, row.shift(s.k_at), k, kvd)?,
        }
        rope(
            be,
            cache.shift(at),
            table,
            positions,
            rope_shape(s.kv_heads),
        )?;
        copy(be, row.shift(s.v_at), cache.shift(at + kvd), kvd)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Tensor;
    use crate::ops::rope::rope_table;
    use crate::testing::{Arg, SeedRng, check_twin, gpu_backend};

    /// Both layouts, partial rotation, with and without the q/k norms, head sizes 64 and 256, rows of three
    /// sequences (two rows of one), the cache split at whole sequences; and on the GPU the one-dispatch
    /// kernel equal bit for bit to norm, rope and copy run there one after another.
    #[test]
    fn rope_into_cache_matches_the_ops_one_by_one() {
        let mut rng = SeedRng::new(77);
        let ctx = 40;
        for (heads, kv_heads, hd, n_rot, layout, norm) in [
            (9usize, 3usize, 64usize, 64usize, RopeLayout::Normal, false),
            (4, 1, 256, 256, RopeLayout::Neox, true),
            (2, 2, 64, 32, RopeLayout::Neox, false),
            (6, 2, 64, 48, RopeLayout::Normal, true),
        ] {
            let kvd = kv_heads * hd;
            let (q_at, k_at, v_at) = (1, 2 + heads * hd, 3 + heads * hd + kvd);
            let ld_in = v_at + kvd + 2;
            let (ld_q, ld_kv) = (heads * hd + 1, 2 * kvd);
            let host: Vec<[u32; 2]> = vec![[0, 3], [ctx as u32, 39], [2 * ctx as u32, 0], [0, 4]];
            let n = host.len();
            let words: Vec<u32> = host.iter().flatten().copied().collect();
            let tab = rope_table(n_rot, 10000.0, 1.0, ctx);
            let args = [
                Arg::data(rng.normal_vec(n * ld_in, 1.0), ld_in),
                Arg::data(rng.vec(n * ld_q, -1.0, 1.0), ld_q),
                Arg::data(rng.vec(3 * ctx * ld_kv, -1.0, 1.0), ctx * ld_kv),
                Arg::words(&words, 2),
                Arg::data(tab, 1),
                Arg::data(rng.vec(2 * hd, 0.5, 1.5), 1),
            ];
            let s = RopeCacheShape {
                heads,
                kv_heads,
                head_dim: hd,
                n_rot,
                layout,
                ld_in,
                q_at,
                k_at,
                v_at,
                ld_q,
                ld_kv,
            };
            let run = |be: &Backend, t: &mut [Tensor], fused: bool| {
                let [ti, tq, tc, tr, tt, tn] = t else {
                    unreachable!()
                };
                let rows = CacheRows {
                    table: tr.at(0),
                    host: &host,
                };
                let nm = norm.then(|| QkNorm {
                    q: tn.at(0),
                    k: tn.at(hd),
                    eps: 1e-6,
                });
                let f = if fused { rope_into_cache } else { one_by_one };
                f(
                    be,
                    ti.at(0),
                    tq.at_mut(0),
                    tc.at_mut(0),
                    rows,
                    tt.at(0),
                    ctx,
                    nm,
                    s,
                )
            };
            let name = format!(
                "rope_into_cache {heads}/{kv_heads}x{hd} rot {n_rot} {layout:?} norm {norm}"
            );
            check_twin(
                &name,
                1e-12,
                &args,
                Some((ctx * ld_kv * 4) as u64),
                |be, t| run(be, t, true),
            );
            let Some(g) = gpu_backend(None) else { continue };
            let mut got = Vec::new();
            for fused in [true, false] {
                let mut t: Vec<Tensor> = args
                    .iter()
                    .map(|a| g.from_f32(a.data.as_ref().unwrap(), a.unit).unwrap())
                    .collect();
                run(&g, &mut t, fused).unwrap();
                let bits = |t: &Tensor| {
                    g.to_vec(t)
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>()
                };
                got.push((bits(&t[1]), bits(&t[2])));
            }
            assert!(
                got[0] == got[1],
                "{name}: one dispatch differs from the ops one by one"
            );
        }
    }
}
