//! `tinygpt perplexity MODEL.gguf FILE`: perplexity of a text, by llama.cpp's method so the figures
//! compare: the text's tokens cut into chunks of `-c` tokens, each run from an empty cache with its
//! first token replaced by BOS (when the model adds one), and the second half of each chunk scored
//! (each token's negative log-likelihood given everything before it in the chunk).
//!
//! `--kl-divergence` measures what the fast paths cost in numerics over the whole file, as llama.cpp's
//! `--kl-divergence` does against a base model's logits: the model on the gated fast paths (and, when
//! several are active, on each one with the paths it builds on) against the same model on the
//! canonical f32 path, at every
//! scored token — the KL divergence of the fast path's next-token distribution from the f32 one, the
//! perplexity ratio and how often the two agree on the most likely token.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use tinygpt_kernels::gate::pills;
use tinygpt_kernels::{Backend, PathSet};
use tinygpt_models::llm::{Llm, LoadOptions};

use crate::gates::GateArgs;
use crate::llm_common::{ModelArgs, load};

#[derive(Args, Debug, Clone)]
pub struct PerplexityArgs {
    /// A GGUF model file.
    pub model: PathBuf,
    /// The UTF-8 text to score.
    pub file: PathBuf,
    /// Tokens per chunk (the context each scored token sees at most).
    #[arg(short = 'c', long = "ctx", default_value_t = 512)]
    pub ctx: usize,
    /// Score only the first K chunks (default: every whole chunk of the text).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Compare every active fast path against the canonical f32 path over the file: KL divergence,
    /// perplexity ratio and same-top-1 rate (a GPU's paths, or the CPU backend's `int-dot`).
    #[arg(long)]
    pub kl_divergence: bool,
}

/// Running sums of the scored tokens' negative log-likelihoods (f64, as llama.cpp keeps them).
#[derive(Default, Clone, Copy, Debug)]
pub struct NllSums {
    pub count: usize,
    pub nll: f64,
    pub nll2: f64,
}

impl NllSums {
    pub fn add(&mut self, nll: f64) {
        self.count += 1;
        self.nll += nll;
        self.nll2 += nll * nll;
    }
    pub fn ppl(&self) -> f64 {
        (self.nll / self.count.max(1) as f64).exp()
    }
    /// The standard error of the perplexity estimate (llama.cpp's: from the spread of the scored
    /// tokens' log-likelihoods, propagated through the exponential).
    pub fn ppl_err(&self) -> f64 {
        let n = self.count as f64;
        if self.count < 2 {
            return f64::NAN;
        }
        let mean = self.nll / n;
        let var = self.nll2 / n - mean * mean;
        if var <= 0.0 {
            return 0.0;
        }
        (var / (n - 1.0)).sqrt() * self.ppl()
    }
}

/// −log softmax(logits)[target], with the sums in f64.
pub fn nll(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    -(logits[target as usize] as f64 - max - sum.ln())
}

/// How far one distribution is from another over the scored tokens.
#[derive(Default, Clone, Copy, Debug)]
pub struct Divergence {
    pub count: usize,
    pub kl: f64,
    pub kl2: f64,
    pub kl_max: f64,
    pub same_top1: usize,
}

impl Divergence {
    /// Adds one token: KL(base ‖ test) over the vocabulary (f64 log-softmax of each).
    pub fn add(&mut self, base: &[f32], test: &[f32]) {
        let kl = tinygpt_models::llm::drift::kl_divergence(base, test);
        self.count += 1;
        self.kl += kl;
        self.kl2 += kl * kl;
        self.kl_max = self.kl_max.max(kl);
        let argmax = |v: &[f32]| tinygpt_models::sampler::argmax(v);
        if argmax(base) == argmax(test) {
            self.same_top1 += 1;
        }
    }
    pub fn mean(&self) -> f64 {
        self.kl / self.count.max(1) as f64
    }
    /// Standard error of the mean KL divergence.
    pub fn mean_err(&self) -> f64 {
        let n = self.count as f64;
        if self.count < 2 {
            return f64::NAN;
        }
        let var = (self.kl2 / n - self.mean().powi(2)).max(0.0);
        (var / (n - 1.0)).sqrt()
    }
    pub fn same_top1_pct(&self) -> f64 {
        100.0 * self.same_top1 as f64 / self.count.max(1) as f64
    }
}

pub fn run(be: &Backend, gate: &GateArgs, a: &PerplexityArgs) -> Result<()> {
    if a.ctx < 4 {
        bail!(
            "-c {}: a chunk needs at least 4 tokens (llama.cpp's default is 512)",
            a.ctx
        );
    }
    if a.chunks == Some(0) {
        bail!("--chunks 0: score at least 1 chunk (leave it out to score every whole chunk)");
    }
    let text = std::fs::read(&a.file)
        .with_context(|| format!("cannot read the text {}", a.file.display()))?;
    let text = String::from_utf8(text).map_err(|e| {
        anyhow::anyhow!(
            "{} is not UTF-8 (first bad byte at offset {})",
            a.file.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    let mut m = load(
        be,
        gate,
        &ModelArgs {
            model: a.model.clone(),
            ctx: Some(a.ctx),
        },
    )?;
    let t_tok = Instant::now();
    let tokens = m.tok.encode(&text, true);
    let n_ctx = a.ctx;
    let whole = tokens.len() / n_ctx;
    if whole < 1 || tokens.len() < 2 * n_ctx {
        bail!(
            "{} has {} tokens; perplexity with -c {n_ctx} needs at least {} (2 chunks): use a longer text or a smaller -c",
            a.file.display(),
            tokens.len(),
            2 * n_ctx
        );
    }
    let n_chunks = a.chunks.map_or(whole, |k| k.min(whole));
    eprintln!(
        "tokenized {} characters into {} tokens in {:.2}s; {n_chunks} chunks of {n_ctx}, the second half of each scored",
        text.chars().count(),
        tokens.len(),
        t_tok.elapsed().as_secs_f64()
    );
    let bos = m.tok.bos_id().filter(|_| m.tok.add_bos());
    let first = n_ctx / 2;
    let chunk_at = |i: usize| {
        let mut chunk = tokens[i * n_ctx..(i + 1) * n_ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        chunk
    };
    if a.kl_divergence {
        return kl_divergence(be, a, m, &tokens, n_chunks, &chunk_at);
    }
    let pb = ProgressBar::new(n_chunks as u64);
    pb.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} chunks · {msg} · ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut sums = NllSums::default();
    let mut line = String::new();
    let t0 = Instant::now();
    // Position j of a chunk scores its token j + 1 (the text's, also where BOS replaced the first).
    // A chunk that fits one pass is recorded before the numbers of the one before are waited for, so
    // the device goes from one chunk to the next without waiting for the host.
    let pipelined = n_ctx <= m.llm.batch() && m.llm.config().final_softcap <= 0.0;
    let mut pending: Option<tinygpt_models::llm::NllRead> = None;
    let mut done = 0;
    let mut take = |nll: Vec<f32>, sums: &mut NllSums, line: &mut String| {
        for v in nll {
            sums.add(v as f64);
        }
        done += 1;
        let tps = (done * n_ctx) as f64 / t0.elapsed().as_secs_f64();
        line.push_str(&format!("[{done}]{:.4},", sums.ppl()));
        pb.set_message(format!("PPL {:.4} · {tps:.0} tokens/s", sums.ppl()));
        pb.inc(1);
    };
    for i in 0..n_chunks {
        let chunk = chunk_at(i);
        m.llm.reset();
        if !pipelined {
            let nll = pollster::block_on(m.llm.score_nll(be, &chunk, first))?;
            take(nll, &mut sums, &mut line);
            continue;
        }
        let next = m.llm.score_nll_start(be, &chunk, first)?;
        if let Some(p) = pending.replace(next) {
            take(
                pollster::block_on(m.llm.score_nll_finish(be, p))?,
                &mut sums,
                &mut line,
            );
        }
    }
    if let Some(p) = pending {
        take(
            pollster::block_on(m.llm.score_nll_finish(be, p))?,
            &mut sums,
            &mut line,
        );
    }
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    println!("{line}");
    println!(
        "Final estimate: PPL = {:.4} +/- {:.5}",
        sums.ppl(),
        sums.ppl_err()
    );
    eprintln!(
        "{} tokens scored over {n_chunks} chunks in {secs:.2}s ({:.0} tokens/s processed) on {}",
        sums.count,
        (n_chunks * n_ctx) as f64 / secs,
        be.describe()
    );
    Ok(())
}

/// The scored rows' logits of chunk `chunk` (rows `first..` of it), one vocabulary row each.
fn score(be: &Backend, llm: &mut Llm, chunk: &[u32], first: usize) -> Result<Vec<f32>> {
    llm.reset();
    Ok(pollster::block_on(llm.score(be, chunk, first))?)
}

/// `--kl-divergence`: each configuration of fast paths against the f32 path, chunk by chunk (both
/// models loaded side by side, so each chunk's f32 logits are computed once per configuration and
/// never stored whole).
fn kl_divergence(
    be: &Backend,
    a: &PerplexityArgs,
    m: crate::llm_common::Loaded,
    tokens: &[u32],
    n_chunks: usize,
    chunk_at: &dyn Fn(usize) -> Vec<u32>,
) -> Result<()> {
    let active = m.llm.paths();
    if active.is_empty() {
        bail!(
            "no fast path is active on {} (only the f32 path runs), so there is nothing to compare: \
             --kl-divergence measures the gated fast paths (a GPU's, or the CPU's int-dot where the CPU \
             has AVX-512 VNNI)",
            be.describe()
        );
    }
    let (n_ctx, first) = (a.ctx, a.ctx / 2);
    let load_with = |paths: PathSet| -> Result<Llm> {
        let opts = LoadOptions {
            context: Some(n_ctx),
            paths,
            ..LoadOptions::default()
        };
        Llm::load(be, &a.model, &opts, &mut |_| {})
            .with_context(|| format!("loading {} on {}", a.model.display(), pills(paths)))
    };
    let mut base = load_with(PathSet::F32)?;
    let v = base.config().vocab;
    // The active set as the run uses it, then, when there are several, each path with only the paths
    // it builds on (alone, a path that needs another never reaches its kernels).
    let mut configs = vec![(active, Some(m.llm))];
    if active.len() > 1 {
        for p in active.iter() {
            let set = p.with_prerequisites().intersect(active);
            if set != active && !configs.iter().any(|(s, _)| *s == set) {
                configs.push((set, None));
            }
        }
    }
    eprintln!(
        "comparing {} configuration(s) against the f32 path over {n_chunks} chunks of {n_ctx}",
        configs.len()
    );
    println!(
        "{:<28} {:>10} {:>10} {:>8} {:>22} {:>10} {:>10}",
        "fast paths", "PPL(f32)", "PPL(fast)", "ratio", "mean KL", "max KL", "same top1"
    );
    for (paths, loaded) in configs {
        let mut test = match loaded {
            Some(llm) => llm,
            None => load_with(paths)?,
        };
        let pb = ProgressBar::new(n_chunks as u64);
        pb.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} chunks · {msg} · ETA {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        pb.set_message(pills(paths));
        let (mut nb, mut nt, mut d) = (
            NllSums::default(),
            NllSums::default(),
            Divergence::default(),
        );
        for i in 0..n_chunks {
            let chunk = chunk_at(i);
            let lb = score(be, &mut base, &chunk, first)?;
            let lt = score(be, &mut test, &chunk, first)?;
            for j in first..n_ctx - 1 {
                let (rb, rt) = (
                    &lb[(j - first) * v..(j - first + 1) * v],
                    &lt[(j - first) * v..(j - first + 1) * v],
                );
                let target = tokens[i * n_ctx + j + 1];
                nb.add(nll(rb, target));
                nt.add(nll(rt, target));
                d.add(rb, rt);
            }
            pb.inc(1);
        }
        pb.finish_and_clear();
        println!(
            "{:<28} {:>10.4} {:>10.4} {:>8.5} {:>22} {:>10.3e} {:>9.2}%",
            pills(paths),
            nb.ppl(),
            nt.ppl(),
            nt.ppl() / nb.ppl(),
            format!("{:.3e} ± {:.1e}", d.mean(), d.mean_err()),
            d.kl_max,
            d.same_top1_pct()
        );
    }
    eprintln!(
        "{} tokens scored per configuration on {}",
        (n_ctx - 1 - first) * n_chunks,
        be.describe()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_is_the_negative_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        assert!((nll(&logits, 2) - -(3f64.exp() / z).ln()).abs() < 1e-12);
        // Uniform logits: perplexity equals the vocabulary.
        let mut s = NllSums::default();
        for _ in 0..10 {
            s.add(nll(&[0.5; 7], 3));
        }
        assert!((s.ppl() - 7.0).abs() < 1e-9);
        assert_eq!(s.ppl_err(), 0.0);
    }

    #[test]
    fn kl_divergence_is_zero_for_equal_rows_and_matches_its_definition() {
        let mut d = Divergence::default();
        d.add(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]);
        assert_eq!(d.mean(), 0.0);
        assert_eq!(d.same_top1, 1);
        let (p, q) = ([0.0f32, 0.0], [0.0f32, (3.0f64).ln() as f32]);
        d.add(&p, &q);
        // KL(½,½ ‖ ¼,¾) = ½ ln 2 + ½ ln(2/3).
        let want = 0.5 * 2f64.ln() + 0.5 * (2.0f64 / 3.0).ln();
        assert!((d.kl_max - want).abs() < 1e-6, "{}", d.kl_max);
        assert_eq!(d.same_top1, 1, "argmax 0 against argmax 1");
        assert_eq!(d.count, 2);
    }
}
