//! Token (and learned position) embedding lookup, and its backward: a scatter-add of the output
//! gradient into the table rows of the tokens that used them.
//!
//! The backward pass needs no float atomics: [`GradIndex`] groups the token positions by id on the
//! host (the ids are known there when the batch is made) and uploads that grouping with the batch, so
//! the kernel sums each used row's tokens in a fixed order — deterministic, and equal to the twin.

use super::Grad;
use super::common::{Grid, kernel, run};
use crate::backend::{Backend, DType, TMut, TRef, Tensor};
use crate::error::{Error, Result};
use crate::gpu::{Access, GpuTensor, Operand};
use rayon::prelude::*;

/// Shape of a lookup: `tokens` ids into a `vocab` x `dim` table.
#[derive(Clone, Copy, Debug)]
pub struct EmbedShape {
    pub tokens: usize,
    pub vocab: usize,
    pub dim: usize,
    /// Multiplies the token rows (Gemma scales embeddings by sqrt(dim); 1 elsewhere).
    pub scale: f32,
}

/// Learned positions added to token `i`: row `i % period + pos0` of the position table.
#[derive(Clone, Copy)]
pub struct Positions<'a> {
    pub table: TRef<'a>,
    pub rows: usize,
    pub period: usize,
    pub pos0: usize,
}

/// Row ranges of a (possibly split) table: (first row, end row, buffer, element offset of first row).
fn table_chunks(
    t: &GpuTensor,
    off: usize,
    rows: usize,
    dim: usize,
) -> Result<Vec<(usize, usize, wgpu::Buffer, usize)>> {
    let mut out = Vec::new();
    let mut r = 0;
    while r < rows {
        let e = off + r * dim;
        let ci = t.chunk_of(e).ok_or_else(|| Error::Shape {
            op: "embedding",
            msg: "table is shorter than vocab x dim".into(),
        })?;
        let c = &t.chunks[ci];
        let end = ((c.start + c.len - off) / dim).min(rows);
        if end <= r {
            return Err(Error::Shape {
                op: "embedding",
                msg: "a table row spans two buffers; allocate the table with unit = dim".into(),
            });
        }
        out.push((r, end, c.buffer.clone(), e - c.start));
        r = end;
    }
    Ok(out)
}

/// out[i] = scale · table[ids[i]] (+ positions) for i < tokens. Ids past the vocabulary give zeros.
pub fn embedding(
    be: &Backend,
    ids: TRef<'_>,
    table: TRef<'_>,
    pos: Option<Positions<'_>>,
    mut out: TMut<'_>,
    s: EmbedShape,
) -> Result<()> {
    let (n, d) = (s.tokens, s.dim);
    if let Some(p) = &pos
        && (p.period == 0 || p.rows < p.period.min(n) + p.pos0)
    {
        return Err(Error::Shape {
            op: "embedding",
            msg: format!(
                "position table has {} rows; positions up to {} are needed",
                p.rows,
                p.period.min(n) + p.pos0
            ),
        });
    }
    match be {
        Backend::Cpu(c) => {
            let ids = ids.cpu_u32("embedding", "ids", n)?;
            let tab = table.cpu("embedding", "table", s.vocab * d)?;
            let ps = pos
                .map(|p| p.table.cpu("embedding", "positions", p.rows * d))
                .transpose()?;
            let o = out.cpu("embedding", "out", n * d)?;
            // Plain values only in the parallel closure (views may hold GPU handles, not Sync on the web).
            let placement = pos.map(|p| (p.period, p.pos0));
            c.install(|| {
                o.par_chunks_mut(d.max(1)).enumerate().for_each(|(i, row)| {
                    let id = ids[i] as usize;
                    for (cc, v) in row.iter_mut().enumerate() {
                        *v = if id < s.vocab {
                            s.scale * tab[id * d + cc]
                        } else {
                            0.0
                        };
                    }
                    if let (Some(pt), Some((period, pos0))) = (ps, placement) {
                        let pr = &pt[(i % period + pos0) * d..][..d];
                        row.iter_mut().zip(pr).for_each(|(v, q)| *v += q);
                    }
                })
            });
            Ok(())
        }
        Backend::Gpu(g) => {
            let tt = table.gpu("embedding", "table", s.vocab * d)?;
            let dummy;
            let (tp, op, has, period, pos0) = match &pos {
                Some(p) => (
                    p.table.gpu("embedding", "positions", p.rows * d)?,
                    p.table.offset(),
                    1,
                    p.period,
                    p.pos0,
                ),
                None => {
                    dummy = g.scratch("dummy", 1)?;
                    (&dummy, 0, 0, 1, 0)
                }
            };
            let pipe = kernel(
                g,
                "embedding",
                include_str!("forward.wgsl"),
                &[Access::Read, Access::ReadWrite, Access::Read, Access::Read],
            )?;
            let pos_span = if has == 1 {
                pos.map_or(1, |p| p.rows * d)
            } else {
                1
            };
            for (k, (r0, r1, buf, local)) in table_chunks(tt, table.offset(), s.vocab, d)?
                .into_iter()
                .enumerate()
            {
                // The table chunk's buffer stands in as a one-chunk tensor for the segment plumbing.
                let chunk = GpuTensor::single(buf, (r1 - r0) * d + local);
                let ops = [
                    Operand::rows(ids.gpu("embedding", "ids", n)?, ids.offset(), 1),
                    Operand::rows(out.gpu("embedding", "out", n * d)?, out.offset(), d),
                    Operand::whole(&chunk, local, (r1 - r0) * d),
                    Operand::whole(tp, op, pos_span),
                ];
                let extra = [
                    d as u32,
                    r0 as u32,
                    r1 as u32,
                    s.vocab as u32,
                    (k == 0) as u32,
                    s.scale.to_bits(),
                    has,
                    period as u32,
                    pos0 as u32,
                ];
                run(g, "embedding", &pipe, n, &ops, &extra, Grid::Groups)?;
            }
            Ok(())
        }
    }
}

/// The batch's tokens grouped by id, for [`embedding_backward`]; reuse one per batch size.
pub struct GradIndex {
    max_tokens: usize,
    vocab: usize,
    tokens: usize,
    uniq_host: Vec<u32>,
    /// Distinct ids, ascending.
    uniq: Tensor,
    /// `uniq.len() + 1` offsets into `order`.
    offsets: Tensor,
    /// Token positions grouped by id, ascending within a group.
    order: Tensor,
}

impl GradIndex {
    /// An index for batches of up to `max_tokens` ids below `vocab`.
    pub fn new(be: &Backend, max_tokens: usize, vocab: usize) -> Result<Self> {
        Ok(GradIndex {
            max_tokens,
            vocab,
            tokens: 0,
            uniq_host: Vec::new(),
            uniq: be.zeros_typed(max_tokens.min(vocab).max(1), 1, DType::U32)?,
            offsets: be.zeros_typed(max_tokens.min(vocab) + 1, 1, DType::U32)?,
            order: be.zeros_typed(max_tokens.max(1), 1, DType::U32)?,
        })
    }

    /// Groups `ids` (uploads the grouping; call before recording the step).
    pub fn set(&mut self, be: &Backend, ids: &[u32]) -> Result<()> {
        if ids.len() > self.max_tokens {
            return Err(Error::Shape {
                op: "embedding_backward",
                msg: format!(
                    "{} tokens exceed the index's {}",
                    ids.len(),
                    self.max_tokens
                ),
            });
        }
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.vocab) {
            return Err(Error::Shape {
                op: "embedding_backward",
                msg: format!("token id {bad} is outside the vocabulary of {}", self.vocab),
            });
        }
        let mut order: Vec<u32> = (0..ids.len() as u32).collect();
        order.sort_by_key(|&i| (ids[i as usize], i));
        let mut uniq = Vec::new();
        let mut offsets = Vec::new();
        for (j, &i) in order.iter().enumerate() {
            let id = ids[i as usize];
            if uniq.last() != Some(&id) {
                uniq.push(id);
                offsets.push(j as u32);
            }
        }
        offsets.push(order.len() as u32);
        be.write_u32(self.uniq.at_mut(0), &uniq)?;
        be.write_u32(self.offsets.at_mut(0), &offsets)?;
        be.write_u32(self.order.at_mut(0), &order)?;
        self.tokens = ids.len();
        self.uniq_host = uniq;
        Ok(())
    }
}

/// dtable[id] (+)= scale · Σ dout[tokens with that id] (added to `dtable` with [`Grad::Accumulate`], as a
/// tied head has written its own gradient there) and, with `dpos`, the position table's gradient
/// (always overwritten), for the batch last given to `index`. `dout` must lie in one buffer.
pub fn embedding_backward(
    be: &Backend,
    index: &GradIndex,
    dout: TRef<'_>,
    mut dtable: TMut<'_>,
    dpos: Option<(TMut<'_>, usize)>,
    s: EmbedShape,
    into: Grad,
) -> Result<()> {
    let accumulate = into == Grad::Accumulate;
    let (n, d) = (index.tokens, s.dim);
    let u = index.uniq_host.len();
    match be {
        Backend::Cpu(c) => {
            let dos = dout.cpu("embedding_backward", "dout", n * d)?;
            let offs = index.offsets.cpu().expect("cpu index");
            let order: &[u32] = bytemuck::cast_slice(index.order.cpu().expect("cpu index"));
            let offs: &[u32] = bytemuck::cast_slice(offs);
            let dt = dtable.cpu("embedding_backward", "dtable", s.vocab * d)?;
            // Plain slices only inside the parallel closure: the index itself may hold GPU handles,
            // which are not Sync on the web.
            let uniq: &[u32] = &index.uniq_host;
            let rows: Vec<(usize, Vec<f32>)> = c.install(|| {
                (0..u)
                    .into_par_iter()
                    .map(|k| {
                        let mut acc = vec![0.0f32; d];
                        for &j in &order[offs[k] as usize..offs[k + 1] as usize] {
                            acc.iter_mut()
                                .zip(&dos[j as usize * d..][..d])
                                .for_each(|(a, b)| *a += b);
                        }
                        (uniq[k] as usize, acc)
                    })
                    .collect()
            });
            if !accumulate {
                dt.fill(0.0);
            }
            for (id, acc) in rows {
                dt[id * d..][..d]
                    .iter_mut()
                    .zip(acc)
                    .for_each(|(t, a)| *t += s.scale * a);
            }
            if let Some((mut dp, period)) = dpos {
                let dps = dp.cpu("embedding_backward", "dpos", period * d)?;
                for q in 0..period {
                    for cc in 0..d {
                        let mut acc = 0.0f32;
                        let mut i = q;
                        while i < n {
                            acc += dos[i * d + cc];
                            i += period;
                        }
                        dps[q * d + cc] = acc;
                    }
                }
            }
            Ok(())
        }
        Backend::Gpu(g) => {
            let td = dout.gpu("embedding_backward", "dout", n * d)?;
            let dsegs = crate::gpu::segments(
                "embedding_backward",
                1,
                &[Operand::whole(td, dout.offset(), n * d)],
            )?;
            let (dbuf, doff) = (&dsegs[0].places[0].buffer, dsegs[0].places[0].offset);
            if !accumulate {
                crate::ops::fill::fill(be, dtable.reborrow(), s.vocab * d, 0.0)?;
            }
            let tt = dtable.gpu("embedding_backward", "dtable", s.vocab * d)?;
            let pipe = kernel(
                g,
                "embedding_backward",
                include_str!("backward.wgsl"),
                &[
                    Access::Read,
                    Access::Read,
                    Access::Read,
                    Access::Read,
                    Access::ReadWrite,
                ],
            )?;
            let gi = |t: &Tensor| t.gpu().expect("gpu index").chunks[0].buffer.clone();
            let (ub, ob, rb) = (gi(&index.uniq), gi(&index.offsets), gi(&index.order));
            for (r0, r1, buf, local) in table_chunks(tt, dtable.offset(), s.vocab, d)? {
                let u0 = index.uniq_host.partition_point(|&v| (v as usize) < r0);
                let u1 = index.uniq_host.partition_point(|&v| (v as usize) < r1);
                if u1 == u0 {
                    continue;
                }
                let params = [
                    (u1 - u0) as u32,
                    0,
                    0,
                    0,
                    0,
                    doff as u32,
                    local as u32,
                    d as u32,
                    u0 as u32,
                    r0 as u32,
                    1,
                    s.scale.to_bits(),
                ];
                g.dispatch(
                    &pipe,
                    &params,
                    &[&ub, &ob, &rb, dbuf, &buf],
                    g.grid(u1 - u0),
                )?;
            }
            if let Some((dp, period)) = dpos {
                let tp = dp.gpu("embedding_backward", "dpos", period * d)?;
                let pipe = kernel(
                    g,
                    "embedding_backward_pos",
                    include_str!("backward_pos.wgsl"),
                    &[Access::Read, Access::ReadWrite],
                )?;
                let doperand = GpuTensor::single(dbuf.clone(), doff + n * d);
                let ops = [
                    Operand::whole(&doperand, doff, n * d),
                    Operand::rows(tp, dp.offset(), 1),
                ];
                let extra = [d as u32, n as u32, period as u32];
                run(
                    g,
                    "embedding_backward",
                    &pipe,
                    period * d,
                    &ops,
                    &extra,
                    Grid::Threads(256),
                )?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests;
