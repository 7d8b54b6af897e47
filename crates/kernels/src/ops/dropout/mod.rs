//! Inverted dropout with a counter-based mask: the mask of element i is a hash of (seed, i), so the
//! forward and backward passes, and the CPU and GPU backends, all draw the same mask without storing it.

use super::common::{FOUR_A_THREAD, FOUR_A_THREAD_MAIN, Grid, kernel_parts, run};
use super::fastmath::{map1i, map2i};
use crate::backend::{Backend, TMut, TRef};
use crate::error::{Error, Result};
use crate::gpu::{Access, Operand};
use crate::ops::matmul::{pack_f16_of, packed_len, pairs_in_one_pass};
use rayon::prelude::*;

/// "lowbias32" (Chris Wellons' hash-prospector): a fast, well-mixed 32-bit integer hash.
#[inline(always)]
pub fn hash(v: u32) -> u32 {
    let mut h = v;
    h ^= h >> 16;
    h = h.wrapping_mul(0x7feb_352d);
    h ^= h >> 15;
    h = h.wrapping_mul(0x846c_a68b);
    h ^= h >> 16;
    h
}

/// Whether element `i` survives dropout with probability `p` under `seed`.
#[inline(always)]
pub fn keep(i: u32, seed: u32, threshold: u32) -> bool {
    hash(i ^ hash(seed)) >= threshold
}

/// The CPU twin of one element: element `i` of x after dropout with probability `p` under `seed`
/// (x / (1 − p), or 0).
#[inline(always)]
pub(crate) fn kept_fn(p: f32, seed: u32) -> impl Fn(u32, f32) -> f32 + Copy + Send + Sync {
    let (th, scale, hs) = (threshold(p), 1.0 / (1.0 - p), hash(seed));
    move |i: u32, x: f32| {
        if hash(i ^ hs) >= th { x * scale } else { 0.0 }
    }
}

/// A drop probability must lie in [0, 1).
pub(crate) fn check_probability(op: &'static str, p: f32) -> Result<()> {
    if (0.0..1.0).contains(&p) {
        Ok(())
    } else {
        Err(Error::Shape {
            op,
            msg: format!("drop probability {p} must be in [0, 1)"),
        })
    }
}

/// The WGSL twin of [`hash`], for kernels that draw dropout's mask.
pub(crate) const HASH_WGSL: &str = include_str!("hash.wgsl");

/// The hash value at or above which an element survives dropout with probability `p`.
pub(crate) fn threshold(p: f32) -> u32 {
    (p as f64 * 4_294_967_296.0).min(u32::MAX as f64) as u32
}

/// Dropout's threshold, seed and scale (its bits) with probability `p` under `seed`, as dropout.wgsl
/// takes them: for kernels that draw the same mask (the tensor-core training product's epilogue).
pub(crate) fn mask_params(p: f32, seed: u32) -> [u32; 3] {
    [threshold(p), seed, (1.0 / (1.0 - p)).to_bits()]
}

/// y = dropout(x) over `n` elements with drop probability `p` (also the backward pass: dx =
/// dropout(dy) with the same seed). `seed` should differ per layer, site and step.
pub fn dropout(be: &Backend, x: TRef<'_>, y: TMut<'_>, n: usize, p: f32, seed: u32) -> Result<()> {
    launch(be, None, x, y, n, p, seed)
}

/// y = dropout(x) rounded to f16 pairs: `n` values into `packed_len(n)` words (the values [`dropout`]
/// writes, each rounded as [`pack_f16`] rounds), for a tensor only the tensor-core training products
/// read (the gradient at a product's output on that path). On the GPU, whole vectors in one binding
/// are written as pairs by one kernel; elsewhere (and on the CPU twin) the f32 values are formed in
/// scratch, then packed.
pub fn dropout_f16(
    be: &Backend,
    x: TRef<'_>,
    y: TMut<'_>,
    n: usize,
    p: f32,
    seed: u32,
) -> Result<()> {
    const OP: &str = "dropout";
    check_probability(OP, p)?;
    if let Backend::Gpu(g) = be {
        let (tx, ty) = (x.gpu(OP, "x", n)?, y.gpu(OP, "y", packed_len(n))?);
        if pairs_in_one_pass(n, &[(tx, x.offset())], (ty, y.offset())) {
            let pipe = kernel_parts(
                g,
                "dropout_f16",
                &[
                    HASH_WGSL,
                    include_str!("dropout_f16.wgsl"),
                    FOUR_A_THREAD_MAIN,
                ],
                &[Access::Read, Access::ReadWrite],
            )?;
            let ops = [
                Operand::whole(tx, x.offset(), n),
                Operand::whole(ty, y.offset(), packed_len(n)),
            ];
            let extra = mask_params(p, seed);
            let grid = Grid::Threads(FOUR_A_THREAD);
            return run(g, OP, &pipe, n / 4, &ops, &extra, grid);
        }
    }
    pack_f16_of(be, "dropout_f16", (n, 1), y, |wide| {
        dropout(be, x, wide, n, p, seed)
    })
}

/// out = residual + dropout(x): a dropped-out branch joining the residual stream, in one pass (the
/// same mask as [`dropout`] for the same seed).
pub fn dropout_add(
    be: &Backend,
    residual: TRef<'_>,
    x: TRef<'_>,
    out: TMut<'_>,
    n: usize,
    p: f32,
    seed: u32,
) -> Result<()> {
    launch(be, Some(residual), x, out, n, p, seed)
}

fn launch(
    be: &Backend,
    residual: Option<TRef<'_>>,
    x: TRef<'_>,
    mut out: TMut<'_>,
    n: usize,
    p: f32,
    seed: u32,
) -> Result<()> {
    const OP: &str = "dropout";
    check_probability(OP, p)?;
    let (th, scale) = (threshold(p), 1.0 / (1.0 - p));
    match be {
        Backend::Cpu(c) => {
            let rs = residual.map(|r| r.cpu(OP, "residual", n)).transpose()?;
            let xs = x.cpu(OP, "x", n)?;
            let os = out.cpu(OP, "out", n)?;
            // Chunks of whole vectors, each with its first index, so the hash loop vectorises.
            const CHUNK: usize = 1 << 14;
            let kept = kept_fn(p, seed);
            c.install(|| match rs {
                None => os
                    .par_chunks_mut(CHUNK)
                    .zip(xs.par_chunks(CHUNK))
                    .enumerate()
                    .for_each(|(k, (o, x))| map1i(o, x, (k * CHUNK) as u32, kept)),
                Some(rs) => os
                    .par_chunks_mut(CHUNK)
                    .zip(xs.par_chunks(CHUNK).zip(rs.par_chunks(CHUNK)))
                    .enumerate()
                    .for_each(|(k, (o, (x, r)))| {
                        map2i(o, x, r, (k * CHUNK) as u32, |i, x, r| r + kept(i, x))
                    }),
            });
            Ok(())
        }
        Backend::Gpu(g) => {
            // Without a residual, x stands in for it (read-only, never read: `has_residual` is 0).
            let (rt, ro) = match &residual {
                Some(r) => (r.gpu(OP, "residual", n)?, r.offset()),
                None => (x.gpu(OP, "x", n)?, x.offset()),
            };
            let ops = [
                Operand::rows(rt, ro, 1),
                Operand::rows(x.gpu(OP, "x", n)?, x.offset(), 1),
                Operand::rows(out.gpu(OP, "out", n)?, out.offset(), 1),
            ];
            let pipe = kernel_parts(
                g,
                OP,
                &[HASH_WGSL, include_str!("dropout.wgsl"), FOUR_A_THREAD_MAIN],
                &[Access::Read, Access::Read, Access::ReadWrite],
            )?;
            let extra = [th, seed, scale.to_bits(), residual.is_some() as u32];
            run(g, OP, &pipe, n, &ops, &extra, Grid::Threads(FOUR_A_THREAD))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Arg, SeedRng, check_twin};

    #[test]
    fn dropout_masks_agree_across_backends_and_keep_the_expected_fraction() {
        let mut rng = SeedRng::new(22);
        let n = 40_000;
        let x = rng.vec(n, 0.5, 1.5);
        let args = [Arg::data(x.clone(), 1), Arg::out(n, 1)];
        // Bit-exact: the mask is integer arithmetic and the scaling one multiply.
        let out = check_twin("dropout", 0.0, &args, Some(8192), |be, t| {
            let [tx, ty] = t else { unreachable!() };
            dropout(be, (&*tx).into(), ty.into(), n, 0.2, 1234)
        });
        let dropped = out[1].iter().filter(|&&v| v == 0.0).count() as f64 / n as f64;
        assert!((dropped - 0.2).abs() < 0.01, "dropped fraction {dropped}");
        for i in 0..n {
            assert!(out[1][i] == 0.0 || (out[1][i] - x[i] * 1.25).abs() < 1e-6);
        }
        let be = crate::testing::cpu_backend();
        let tx = be.from_f32(&x, 1).unwrap();
        let mut ty = be.zeros(n, 1).unwrap();
        dropout(&be, (&tx).into(), (&mut ty).into(), n, 0.2, 1235).unwrap();
        assert_ne!(
            be.to_vec(&ty).unwrap(),
            out[1],
            "another seed must give another mask"
        );
    }

    /// The f16-pairs form writes dropout's values rounded as `pack_f16` rounds them, bit for bit: the
    /// vector kernel (at a word offset, the words before it left alone) and the fallback (an odd count,
    /// an offset not a multiple of four), on the CPU twin and the GPU.
    #[test]
    fn f16_pairs_hold_the_f32_values_rounded() {
        let mut rng = SeedRng::new(24);
        let mut backends = vec![crate::testing::cpu_backend()];
        backends.extend(crate::testing::gpu_backend(None));
        for be in &backends {
            for (n, shift) in [(4096usize, 0usize), (40_000, 4), (5001, 0), (3000, 2)] {
                let x = rng.vec(n + shift, -3.0, 3.0);
                let tx = be.from_f32(&x, 1).unwrap();
                let what = format!("{} n {n} shift {shift}", be.kind());
                crate::testing::assert_f16_pairs(
                    be,
                    n,
                    &what,
                    |w| dropout(be, tx.at(shift), w, n, 0.2, 99),
                    |y| dropout_f16(be, tx.at(shift), y, n, 0.2, 99),
                );
            }
        }
    }

    #[test]
    fn dropout_add_is_residual_plus_dropout() {
        let mut rng = SeedRng::new(23);
        let n = 5000;
        let (r, x) = (rng.vec(n, -1.0, 1.0), rng.vec(n, -1.0, 1.0));
        let args = [
            Arg::data(r.clone(), 1),
            Arg::data(x.clone(), 1),
            Arg::out(n, 1),
            Arg::out(n, 1),
        ];
        let out = check_twin("dropout_add", 0.0, &args, Some(4096), |be, t| {
            let [tr, tx, to, td] = t else { unreachable!() };
            dropout_add(be, (&*tr).into(), (&*tx).into(), to.into(), n, 0.3, 77)?;
            dropout(be, (&*tx).into(), td.into(), n, 0.3, 77)
        });
        for i in 0..n {
            assert_eq!(out[2][i], r[i] + out[3][i]);
        }
    }
}
