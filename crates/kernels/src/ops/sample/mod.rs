//! Sampling the next token on the device: each row of logits gives one token id — the first maximum for
//! a greedy row, else a draw from the softmax of the row's top-k logits at its temperature, cut to its
//! top-p nucleus, from a counter-based generator (seed and draw number), so only the ids come back to
//! the host and a row's token never depends on the other rows of the pass.
//!
//! Two stages on a GPU, as the argmax: blocks of [`SPAN`] logits each keep their k best candidates
//! (k rounds of a workgroup arg-max, each below the last pick in the order), then one workgroup per row
//! merges them the same way and draws. The CPU twin ([`sample_row`]) computes the same candidates in the
//! same order and draws with the same f32 arithmetic; a draw can differ only where the uniform number
//! falls within a rounding of a cumulative sum (the device's `exp` is not the host's).

use super::argmax::{BEST_TREE, SPAN};
use crate::backend::{Backend, TMut, TRef};
use crate::error::{Result, shape};
use crate::gpu::{Access, GpuBackend};

/// The largest top-k the device sampler takes (a request with more, or none, samples on the host).
pub const MAX_TOP_K: usize = 64;

/// How one row is sampled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowSampling {
    /// 0: the first maximum (greedy).
    pub temperature: f32,
    /// 1..=[`MAX_TOP_K`] when the temperature is above 0.
    pub top_k: u32,
    /// In (0, 1]; 1 keeps all k.
    pub top_p: f32,
    pub seed: u64,
    /// Which draw of the seed's stream this token uses (0 for a request's first sampled token, ...).
    pub draw: u32,
}

impl RowSampling {
    /// Whether the device sampler takes these settings.
    pub fn fits(temperature: f32, top_k: usize, top_p: f32) -> bool {
        temperature == 0.0
            || (temperature.is_finite()
                && temperature > 0.0
                && (1..=MAX_TOP_K).contains(&top_k)
                && top_p > 0.0
                && top_p <= 1.0)
    }

    /// The row's 8 parameter words, as the kernels read them.
    pub fn words(&self) -> [u32; 8] {
        [
            self.temperature.to_bits(),
            self.top_k,
            self.top_p.to_bits(),
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.draw,
            0,
            0,
        ]
    }
}

/// Words per row of the parameter tensor.
pub const PARAM_WORDS: usize = 8;

/// out[r] = the token sampled from row r of `logits` (`rows` rows of `cols`) with row r's parameters
/// (`params`: [`RowSampling::words`] of each row, u32 words), as a u32 word. Each of the three tensors
/// must be in one buffer on a GPU.
pub fn sample_rows(
    be: &Backend,
    logits: TRef<'_>,
    params: TRef<'_>,
    mut out: TMut<'_>,
    rows: usize,
    cols: usize,
) -> Result<()> {
    if cols == 0 || cols > u32::MAX as usize / 2 {
        return Err(shape("sample", format!("rows of {cols} logits")));
    }
    match be {
        Backend::Cpu(_) => {
            let x = logits.cpu("sample", "logits", rows * cols)?;
            let w = params.cpu_u32("sample", "params", rows * PARAM_WORDS)?;
            let o = out.cpu_u32("sample", "out", rows)?;
            for ((row, pw), slot) in x.chunks(cols).zip(w.chunks(PARAM_WORDS)).zip(o.iter_mut()) {
                *slot = sample_row(row, pw.try_into().expect("8 words"));
            }
            Ok(())
        }
        Backend::Gpu(g) => gpu_rows(g, logits, params, out, rows, cols),
    }
}

fn gpu_rows(
    g: &GpuBackend,
    logits: TRef<'_>,
    params: TRef<'_>,
    out: TMut<'_>,
    rows: usize,
    cols: usize,
) -> Result<()> {
    let one = |what: &str| shape("sample", format!("{what} must be in one buffer"));
    let (bx, ox) = logits
        .gpu("sample", "logits", rows * cols)?
        .span(logits.offset(), rows * cols)
        .ok_or_else(|| one("the logits"))?;
    let (bp, op) = params
        .gpu("sample", "params", rows * PARAM_WORDS)?
        .span(params.offset(), rows * PARAM_WORDS)
        .ok_or_else(|| one("the parameters"))?;
    let (bo, oo) = out
        .gpu("sample", "out", rows)?
        .span(out.offset(), rows)
        .ok_or_else(|| one("the ids"))?;
    if op != 0 {
        return Err(shape("sample", "the parameters must start their buffer"));
    }
    let blocks = cols.div_ceil(SPAN);
    let part = g.scratch("sample_part", 2 * rows * blocks * MAX_TOP_K)?;
    let pb = &part.chunks[0].buffer;
    let consts = format!(
        "const KMAX: u32 = {MAX_TOP_K}u;\nconst SPAN: u32 = {SPAN}u;\nconst PER: u32 = {}u;\n{BEST_TREE}\n{AFTER}",
        SPAN / 256
    );
    let bind = [Access::Read, Access::Read, Access::ReadWrite];
    let pipe = super::common::kernel(
        g,
        "sample_partial",
        &format!("{consts}\n{}", include_str!("sample_partial.wgsl")),
        &bind,
    )?;
    let params_words = [rows as u32, cols as u32, ox as u32, blocks as u32];
    g.dispatch(
        &pipe,
        &params_words,
        &[bx, bp, pb],
        [blocks as u32, rows as u32, 1],
    )?;
    let pipe = super::common::kernel(
        g,
        "sample_final",
        &format!("{consts}\n{}", include_str!("sample_final.wgsl")),
        &bind,
    )?;
    let params_words = [rows as u32, blocks as u32, oo as u32];
    g.dispatch(&pipe, &params_words, &[pb, bp, bo], [rows as u32, 1, 1])
}

/// The order both stages select in, round by round: whether candidate (v, c) comes after the last pick
/// (pv, pi) — larger logits first, of equal logits the smaller index; before the first pick (pi = NONE)
/// everything does.
const AFTER: &str = "
fn after(v: f32, c: u32, pv: f32, pi: u32) -> bool {
  return pi == NONE || v < pv || (v == pv && c > pi);
}
";

/// lowbias32, as sample_final.wgsl's `mix`.
fn mix(a: u32) -> u32 {
    let mut x = a;
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    x
}

/// The uniform number in [0, 1) of draw `counter` of the seed (lo, hi): 24 bits, as the kernel's `draw`.
pub fn draw(lo: u32, hi: u32, counter: u32) -> f32 {
    let h = mix(lo ^ mix(hi ^ mix(counter.wrapping_add(0x9e37_79b9))));
    (h >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// The CPU twin of one row: what sample_partial.wgsl and sample_final.wgsl compute.
pub fn sample_row(row: &[f32], w: &[u32; PARAM_WORDS]) -> u32 {
    let t = f32::from_bits(w[0]);
    let greedy = t == 0.0;
    let k = if greedy {
        1
    } else {
        (w[1] as usize).min(MAX_TOP_K)
    };
    // The k best candidates: larger logit first, of equal logits the smaller index; finite logits only
    // (a greedy row takes ±inf too; NaN never).
    let mut top: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() || (!greedy && v.is_infinite()) {
            continue;
        }
        let at = top.partition_point(|&(tv, _)| tv >= v);
        if at < k {
            top.insert(at, (v, i as u32));
            top.truncate(k);
        }
    }
    let Some(&(v0, i0)) = top.first() else {
        return 0;
    };
    if greedy {
        return i0;
    }
    let top_p = f32::from_bits(w[2]);
    let e: Vec<f32> = top.iter().map(|&(v, _)| ((v - v0) / t).exp()).collect();
    let mut sum = 0.0f32;
    for &x in &e {
        sum += x;
    }
    let mut keep = e.len();
    if top_p < 1.0 {
        let mut acc = 0.0f32;
        for (j, &x) in e.iter().enumerate() {
            acc += x / sum;
            if acc >= top_p {
                keep = j + 1;
                break;
            }
        }
    }
    let mut kept = 0.0f32;
    for &x in &e[..keep] {
        kept += x;
    }
    let u = draw(w[3], w[4], w[5]) * kept;
    let mut acc = 0.0f32;
    for (j, &x) in e[..keep].iter().enumerate() {
        acc += x;
        if u < acc {
            return top[j].1;
        }
    }
    top[keep - 1].1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::argmax::first_max;
    use crate::testing::{Arg, SeedRng, check_twin};

    fn words(t: f32, k: u32, p: f32, seed: u64, draw: u32) -> [u32; PARAM_WORDS] {
        RowSampling {
            temperature: t,
            top_k: k,
            top_p: p,
            seed,
            draw,
        }
        .words()
    }

    /// Rows of every kind (greedy, top-k 1, 40 with and without a nucleus, 64, hot and cold), widths
    /// from one logit to a vocabulary of several blocks, ties, NaN and ±inf: the device gives the twin's
    /// ids.
    #[test]
    fn device_sampling_matches_twin() {
        let mut rng = SeedRng::new(83);
        let kinds = [
            (0.0, 0, 1.0),
            (0.8, 1, 1.0),
            (0.8, 40, 0.95),
            (1.0, 40, 1.0),
            (1.5, 64, 0.9),
            (0.3, 7, 0.5),
        ];
        for cols in [1usize, 3, 255, 4097, 49_152] {
            let rows = 2 * kinds.len();
            let mut x: Vec<f32> = (0..rows * cols)
                .map(|i| {
                    if i % 2 == 0 {
                        // Ties: a few levels.
                        (rng.below(5) as f32) - 2.0
                    } else {
                        rng.range(-6.0, 6.0)
                    }
                })
                .collect();
            if cols > 3 {
                x[1] = f32::NAN;
                x[2] = f32::INFINITY;
                x[cols + 2] = f32::NEG_INFINITY;
            }
            let mut params = Vec::new();
            for r in 0..rows {
                let (t, k, p) = kinds[r % kinds.len()];
                params.extend(words(t, k, p, 1000 + r as u64 * 77, r as u32 * 3));
            }
            let bits: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
            let args = [
                Arg::words(&bits, cols),
                Arg::words(&params, PARAM_WORDS),
                Arg::words(&vec![u32::MAX; rows], 1),
            ];
            let out = check_twin("sample", 0.0, &args, None, |be, t| {
                let [tx, tp, to] = t else { unreachable!() };
                sample_rows(be, (&*tx).into(), (&*tp).into(), to.into(), rows, cols)
            });
            let ids: Vec<u32> = out[2].iter().map(|v| v.to_bits()).collect();
            for (r, (&id, row)) in ids.iter().zip(x.chunks(cols)).enumerate() {
                assert!((id as usize) < cols, "row {r}: id {id} of {cols}");
                let (t, _, _) = kinds[r % kinds.len()];
                if t == 0.0 {
                    assert_eq!(id, first_max(row), "a greedy row is the argmax");
                } else if cols > 1 {
                    assert!(
                        row[id as usize].is_finite(),
                        "row {r}: sampled a non-finite logit"
                    );
                }
            }
        }
    }

    /// The twin draws in proportion to the softmax of the kept logits, from the k best only, and the
    /// nucleus cuts as it should.
    #[test]
    fn twin_follows_the_distribution() {
        // Probabilities 1/4 and 3/4 at temperature 1; the third logit is outside k = 2.
        let row = [0.0f32, 3.0f32.ln(), -1.0];
        let n = 20_000;
        let ones = (0..n)
            .filter(|&d| sample_row(&row, &words(1.0, 2, 1.0, 5, d)) == 1)
            .count() as f64
            / n as f64;
        assert!((ones - 0.75).abs() < 0.02, "{ones}");
        assert!((0..n).all(|d| sample_row(&row, &words(1.0, 2, 1.0, 5, d)) != 2));
        // Over the three, the best has 3 / (4 + 1/e) = 0.687: top_p 0.6 keeps it alone.
        assert!((0..200).all(|d| sample_row(&row, &words(1.0, 3, 0.6, 5, d)) == 1));
        // Seeded: the same (seed, draw) gives the same token, other seeds other streams.
        let stream = |seed| {
            (0..40)
                .map(|d| sample_row(&[0.0, 0.1, 0.2, 0.3], &words(1.0, 4, 1.0, seed, d)))
                .collect::<Vec<_>>()
        };
        assert_eq!(stream(9), stream(9));
        assert_ne!(stream(9), stream(10));
        // Nothing finite: token 0.
        assert_eq!(
            sample_row(&[f32::NAN, f32::INFINITY], &words(1.0, 4, 1.0, 1, 0)),
            0
        );
    }

    #[test]
    fn settings_the_device_takes() {
        assert!(RowSampling::fits(0.0, 0, 1.0));
        assert!(RowSampling::fits(0.8, 40, 0.95));
        assert!(
            !RowSampling::fits(0.8, 0, 0.95),
            "top-k off needs the whole vocabulary"
        );
        assert!(!RowSampling::fits(0.8, MAX_TOP_K + 1, 1.0));
        assert!(!RowSampling::fits(f32::NAN, 40, 1.0));
    }
}
