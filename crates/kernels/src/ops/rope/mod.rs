//! Rotary position embeddings in the two layouts GGUF models use: "normal" (llama, as GGUF lays out
//! Q and K: adjacent pairs) and NeoX (pairs half a rotation apart).

mod cache;
pub use cache::{QkNorm, RopeCacheShape, rope_into_cache};

use super::common::kernel;
use crate::backend::{Backend, TMut, TRef};
use crate::error::{Error, Result};
use crate::gpu::{Access, Operand};
use rayon::prelude::*;

/// WGSL shared by the kernels that rotate a head one thread per dimension (rope_cache.wgsl, the new
/// rows of attention/attend_rows.wgsl), so both pair dimensions as [`RopeLayout`] says.
pub(crate) const ROPE_PAIR: &str = "
// Dimension d (< n_rot) of a rotation of n_rot dimensions: its pair's index i (the table's column),
// whether it comes first in its pair, and its partner. llama pairs (2i, 2i + 1), NeoX (i, i + n_rot / 2).
struct RopePair { i: u32, first: bool, partner: u32 }
fn rope_pair(d: u32, n_rot: u32, neox: bool) -> RopePair {
  if (neox) {
    let half = n_rot / 2u;
    let first = d < half;
    return RopePair(d % half, first, select(d - half, d + half, first));
  }
  return RopePair(d / 2u, d % 2u == 0u, d ^ 1u);
}
";

/// Which dimensions are rotated together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs (2i, 2i+1): llama.cpp's `LLAMA_ROPE_TYPE_NORM`, used by GGUF llama models.
    Normal,
    /// Pairs (i, i + n_rot/2): `LLAMA_ROPE_TYPE_NEOX` (Gemma, GPT-NeoX, Hugging Face's llama).
    Neox,
}

/// `rows` rows of `heads` heads of `head_dim`, row r at position `pos0 + r`, rows `ld` apart.
#[derive(Clone, Copy, Debug)]
pub struct RopeShape {
    pub rows: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Leading dimensions rotated (the rest pass through).
    pub n_rot: usize,
    pub ld: usize,
    pub pos0: usize,
    pub layout: RopeLayout,
    /// Rotate backwards (the gradient of the forward rotation).
    pub inverse: bool,
}

/// The (cos, sin) table for positions `0..positions`, `n_rot / 2` pairs each, computed as Hugging Face
/// transformers does (f32 inverse frequencies `1 / base^(2i/n_rot)`, divided by `freq_scale` for linear
/// scaling; f32 angle `pos · inv_freq`; cos and sin of that angle rounded to f32).
pub fn rope_table(n_rot: usize, base: f32, freq_scale: f32, positions: usize) -> Vec<f32> {
    let half = n_rot / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / n_rot as f32) / freq_scale)
        .collect();
    let mut t = Vec::with_capacity(positions * half * 2);
    for p in 0..positions {
        for &f in &inv {
            let a = (p as f32 * f) as f64;
            t.push(a.cos() as f32);
            t.push(a.sin() as f32);
        }
    }
    t
}

/// Rotates `x` in place using `table` from [`rope_table`].
pub fn rope(
    be: &Backend,
    mut x: TMut<'_>,
    table: TRef<'_>,
    table_positions: usize,
    s: RopeShape,
) -> Result<()> {
    if !s.n_rot.is_multiple_of(2) || s.n_rot > s.head_dim || s.ld < s.heads * s.head_dim {
        return Err(Error::Shape {
            op: "rope",
            msg: format!(
                "bad shape {s:?}: n_rot must be even and <= head_dim, ld >= heads * head_dim"
            ),
        });
    }
    if s.rows > 0 && s.pos0 + s.rows > table_positions {
        return Err(Error::Shape {
            op: "rope",
            msg: format!(
                "positions up to {} need a longer table ({} positions)",
                s.pos0 + s.rows,
                table_positions
            ),
        });
    }
    let half = s.n_rot / 2;
    let n = if s.rows == 0 {
        0
    } else {
        (s.rows - 1) * s.ld + s.heads * s.head_dim
    };
    let tab_len = table_positions * half * 2;
    match be {
        Backend::Cpu(c) => {
            let tab = table.cpu("rope", "table", tab_len)?;
            let xs = x.cpu("rope", "x", n)?;
            c.install(|| {
                xs.par_chunks_mut(s.ld).enumerate().for_each(|(r, row)| {
                    let tr = &tab[(s.pos0 + r) * half * 2..][..half * 2];
                    for h in 0..s.heads {
                        let hb = &mut row[h * s.head_dim..][..s.head_dim];
                        for i in 0..half {
                            let (i0, i1) = match s.layout {
                                RopeLayout::Normal => (2 * i, 2 * i + 1),
                                RopeLayout::Neox => (i, i + half),
                            };
                            let (co, mut si) = (tr[2 * i], tr[2 * i + 1]);
                            if s.inverse {
                                si = -si;
                            }
                            let (a, b) = (hb[i0], hb[i1]);
                            hb[i0] = a * co - b * si;
                            hb[i1] = a * si + b * co;
                        }
                    }
                })
            });
            Ok(())
        }
        Backend::Gpu(g) => {
            let ops = [
                Operand::rows(x.gpu("rope", "x", n)?, x.offset(), s.ld),
                Operand::whole(
                    table.gpu("rope", "table", tab_len)?,
                    table.offset(),
                    tab_len,
                ),
            ];
            let pipe = kernel(
                g,
                "rope",
                include_str!("rope.wgsl"),
                &[Access::ReadWrite, Access::Read],
            )?;
            let extra = [
                s.heads as u32,
                s.head_dim as u32,
                s.n_rot as u32,
                s.ld as u32,
                s.pos0 as u32,
                (s.layout == RopeLayout::Neox) as u32,
                s.inverse as u32,
            ];
            // One thread per (row, head, pair): the segment's rows times heads times pairs.
            for seg in crate::gpu::segments("rope", s.rows, &ops)? {
                let mut p = vec![seg.len() as u32, seg.start as u32];
                p.extend(seg.places.iter().map(|pl| pl.offset as u32));
                p.extend_from_slice(&extra);
                let threads = seg.len() * s.heads * half;
                let bufs = [&seg.places[0].buffer, &seg.places[1].buffer];
                g.dispatch(&pipe, &p, &bufs, g.grid(threads.div_ceil(256)))?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Arg, SeedRng, check_twin};

    #[test]
    fn rope_matches_twin_in_both_layouts_and_inverts() {
        let mut rng = SeedRng::new(80);
        let (rows, heads, hd, ld) = (11, 3, 8, 30);
        let tab = rope_table(6, 10000.0, 1.0, 20);
        let x = rng.vec(rows * ld, -1.0, 1.0);
        for layout in [RopeLayout::Normal, RopeLayout::Neox] {
            let s = RopeShape {
                rows,
                heads,
                head_dim: hd,
                n_rot: 6,
                ld,
                pos0: 4,
                layout,
                inverse: false,
            };
            let args = [
                Arg::data(x.clone(), ld),
                Arg::data(tab.clone(), 1),
                Arg::data(x.clone(), ld),
            ];
            let out = check_twin("rope", 1e-12, &args, Some((ld * 4 * 4) as u64), |be, t| {
                let [tx, tt, tx2] = t else { unreachable!() };
                rope(be, tx.into(), (&*tt).into(), 20, s)?;
                rope(be, tx2.into(), (&*tt).into(), 20, s)?;
                rope(
                    be,
                    tx2.into(),
                    (&*tt).into(),
                    20,
                    RopeShape { inverse: true, ..s },
                )
            });
            // Dimensions past n_rot and the padding between rows pass through.
            for r in 0..rows {
                for h in 0..heads {
                    for d in 6..hd {
                        let i = r * ld + h * hd + d;
                        assert_eq!(out[0][i], x[i]);
                    }
                }
                for i in r * ld + heads * hd..(r + 1) * ld {
                    assert_eq!(out[0][i], x[i]);
                }
            }
            // Rotating forward then backward is the identity (to rounding).
            crate::testing::assert_nmse("rope inverse", &x, &out[2], 1e-12);
        }
        // Position 0 is not rotated.
        let t0 = &tab[..6];
        assert_eq!(t0, &[1.0, 0.0, 1.0, 0.0, 1.0, 0.0]);
    }

    #[test]
    fn rope_refuses_positions_past_its_table() {
        let be = crate::testing::cpu_backend();
        let mut x = be.zeros(64, 1).unwrap();
        let t = be.from_f32(&rope_table(8, 10000.0, 1.0, 4), 1).unwrap();
        let s = RopeShape {
            rows: 2,
            heads: 1,
            head_dim: 8,
            n_rot: 8,
            ld: 8,
            pos0: 3,
            layout: RopeLayout::Normal,
            inverse: false,
        };
        assert!(rope(&be, (&mut x).into(), (&t).into(), 4, s).is_err());
    }
}
