//! `tinygpt perplexity MODEL.gguf FILE`: perplexity of a text, by llama.cpp's method so the figures
//! compare: the text's tokens cut into chunks of `-c` tokens, each run from an empty cache with its
//! first token replaced by BOS (when the model adds one), and the second half of each chunk scored
//! (each token's negative log-likelihood given everything before it in the chunk).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use tinygpt_kernels::Backend;

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

pub fn run(be: &Backend, gate: &GateArgs, a: &PerplexityArgs) -> Result<()> {
    if a.ctx < 4 {
        bail!(
            "-c {}: a chunk needs at least 4 tokens (llama.cpp's default is 512)",
            a.ctx
        );
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
    let n_chunks = a.chunks.map_or(whole, |k| k.clamp(1, whole));
    eprintln!(
        "tokenized {} characters into {} tokens in {:.2}s; {n_chunks} chunks of {n_ctx}, the second half of each scored",
        text.chars().count(),
        tokens.len(),
        t_tok.elapsed().as_secs_f64()
    );
    let bos = m.tok.bos_id().filter(|_| m.tok.add_bos());
    let first = n_ctx / 2;
    let pb = ProgressBar::new(n_chunks as u64);
    pb.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} chunks · {msg} · ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut sums = NllSums::default();
    let mut line = String::new();
    let t0 = Instant::now();
    for i in 0..n_chunks {
        let start = i * n_ctx;
        let mut chunk = tokens[start..start + n_ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        m.llm.reset();
        let logits = pollster::block_on(m.llm.score(be, &chunk, first))?;
        let v = m.llm.config().vocab;
        for j in first..n_ctx - 1 {
            let row = &logits[(j - first) * v..(j - first + 1) * v];
            sums.add(nll(row, tokens[start + j + 1]));
        }
        let tps = ((i + 1) * n_ctx) as f64 / t0.elapsed().as_secs_f64();
        line.push_str(&format!("[{}]{:.4},", i + 1, sums.ppl()));
        pb.set_message(format!("PPL {:.4} · {tps:.0} tokens/s", sums.ppl()));
        pb.inc(1);
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
}
