//! `tinygpt generate` and `tinygpt eval`: sample from a trained char-level GPT, or measure its loss.

use crate::paths;
use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;
use tinygpt_kernels::Backend;
use tinygpt_kernels::PathSet;
use tinygpt_kernels::gate::pills;
use tinygpt_models::gating::GptGate;
use tinygpt_models::gpt::{CharVocab, Dataset, GptRunner, OptimConfig, Trainer, checkpoint};
use tinygpt_models::llm::GptDriftGuard;
use tinygpt_models::sampler::{Sampler, SamplerConfig};

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Checkpoint directory (default: the bundled Shakespeare model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Text to continue (characters the model has never seen are refused). Default: a newline, or
    /// the model's first character when its text had no newline.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Characters to generate.
    #[arg(short = 'n', long = "max-new-tokens", default_value_t = 500)]
    pub n: usize,
    /// 0 for greedy decoding.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: all).
    #[arg(long, default_value_t = 200)]
    pub top_k: usize,
    /// Nucleus sampling: keep the most likely tokens up to this total probability (1: all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
}

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// Checkpoint directory (default: the bundled Shakespeare model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Text whose last 10% is the validation split (default: the bundled Shakespeare).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Batches to average: the first N of the fixed batches `tinygpt train` evaluates on (it uses
    /// 200). Default: 200 on a GPU; 10 on the CPU backend, about 30 seconds on 2 cores (200 take
    /// about 10 minutes there).
    #[arg(long)]
    pub eval_iters: Option<usize>,
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
}

fn model_dir(m: &Option<PathBuf>) -> PathBuf {
    m.clone()
        .unwrap_or_else(|| paths::bundled(paths::DEFAULT_MODEL))
}

/// Loads a checkpoint (default: the bundled model), gates its fast paths and builds its runner, and
/// the drift guard that watches it on fast paths (`--drift-check`; its shadow on `--drift-threads`).
pub fn load_runner(
    be: &Backend,
    gate: &crate::gates::GateArgs,
    model: Option<&std::path::Path>,
) -> Result<(GptRunner, CharVocab, PathSet, Option<GptDriftGuard>)> {
    let dir = model.map_or_else(|| paths::bundled(paths::DEFAULT_MODEL), |p| p.to_path_buf());
    let ck = checkpoint::load_model(&dir)
        .with_context(|| format!("cannot load the model in {}", dir.display()))?;
    let cfg = &ck.config.model;
    let gate_model = GptGate {
        cfg,
        vocab: &ck.config.vocab,
        params: &ck.params,
        tokens: tinygpt_models::gating::token_budget(be),
    };
    let paths = crate::gates::prepare(be, gate, &gate_model)?;
    let runner = GptRunner::new(be, cfg, &ck.params, paths)?;
    let guard = (be.as_gpu().is_some() && !paths.is_empty() && gate.drift_check > 0).then(|| {
        GptDriftGuard::new(
            cfg,
            ck.params,
            gate.drift_check,
            gate.shadow_threads(),
            true,
        )
    });
    Ok((runner, ck.config.vocab, paths, guard))
}

pub fn generate(be: &Backend, gate: &crate::gates::GateArgs, a: &GenerateArgs) -> Result<()> {
    let sc = SamplerConfig {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
    };
    sc.validate().map_err(anyhow::Error::msg)?;
    let dir = model_dir(&a.model);
    let t0 = Instant::now();
    let mut ck = checkpoint::load_model(&dir)
        .with_context(|| format!("cannot load the model in {}", dir.display()))?;
    let vocab = ck.config.vocab.clone();
    let text = match &a.prompt {
        Some(p) => p.clone(),
        None if vocab.encode("\n").is_ok() => "\n".to_string(),
        None => {
            let first = vocab.decode(&[0]);
            eprintln!(
                "note: this model's training text had no newline to start from; starting from \
                 {first:?} (--prompt chooses)"
            );
            first
        }
    };
    let prompt = vocab.encode(&text).context(
        "the prompt cannot be encoded: the model knows only the characters of its training text \
         (give a --prompt made of those)",
    )?;
    if prompt.is_empty() {
        bail!(
            "the prompt is empty; give at least one character (the default is a newline, or the \
             model's first character)"
        );
    }
    let cfg = &ck.config.model;
    let gate_model = GptGate {
        cfg,
        vocab: &vocab,
        params: &ck.params,
        tokens: tinygpt_models::gating::token_budget(be),
    };
    let paths = crate::gates::prepare(be, gate, &gate_model)?;
    let mut runner = GptRunner::new(be, cfg, &ck.params, paths)?;
    // Warm up: the first pass builds every pipeline.
    runner.prefill(be, &prompt[prompt.len().saturating_sub(cfg.block_size)..])?;
    eprintln!(
        "inference warmed up in {:.1}s · {} · {} — ready to generate.",
        t0.elapsed().as_secs_f64(),
        be.describe(),
        pills(paths)
    );
    // The drift guard watches the fast paths (its shadow: the f32 path on the CPU, on its thread).
    let mut guard =
        (be.as_gpu().is_some() && !paths.is_empty() && gate.drift_check > 0).then(|| {
            GptDriftGuard::new(
                cfg,
                std::mem::take(&mut ck.params),
                gate.drift_check,
                gate.shadow_threads(),
                true,
            )
        });
    let subject = dir.display().to_string();
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    let mut sampler = Sampler::new(sc);
    let t = Instant::now();
    let mut emit = async |id: u32| -> tinygpt_kernels::Result<()> {
        let s = vocab.decode(&[id]);
        out.write_all(s.as_bytes())
            .map_err(|e| tinygpt_kernels::Error::Gpu(format!("writing output: {e}")))?;
        out.flush()
            .map_err(|e| tinygpt_kernels::Error::Gpu(format!("writing output: {e}")))?;
        Ok(())
    };
    pollster::block_on(runner.generate_guarded_async(
        be,
        &prompt,
        a.n,
        &mut sampler,
        guard.as_mut(),
        |e| {
            eprintln!("\n{}", e.log_line("going on on the f32 path"));
            crate::gates::record_drift(be, &subject, e);
        },
        &mut emit,
    ))?;
    writeln!(out)?;
    let secs = t.elapsed().as_secs_f64();
    eprintln!(
        "{} characters in {secs:.2}s ({:.0} tokens/s)",
        a.n,
        a.n as f64 / secs.max(1e-9)
    );
    if let Some(g) = &mut guard {
        // Verdicts still on the shadow's thread count too.
        if let Some(e) = g.settle(be, &mut runner)? {
            eprintln!("{}", e.log_line("after the last token"));
            crate::gates::record_drift(be, &subject, &e);
        }
        let s = g.stats();
        eprintln!(
            "[ops] drift guard: {} checks (every {} tokens), {} with the same top-1, worst KL {:.2e} ({:.2e} of its bound)",
            s.checks,
            g.every(),
            s.same_top1,
            s.worst_kl,
            s.worst_ratio
        );
    }
    Ok(())
}

/// Batches `tinygpt train` evaluates on, and `eval`'s default on a GPU.
const TRAIN_EVAL_ITERS: usize = 200;

/// `eval`'s default on the CPU backend: about 30 seconds on 2 cores for the bundled model's shape.
const CPU_EVAL_ITERS: usize = 10;

pub fn eval(be: &Backend, gate: &crate::gates::GateArgs, a: &EvalArgs) -> Result<()> {
    let iters = match a.eval_iters {
        Some(0) => bail!("--eval-iters 0: give at least 1 batch"),
        Some(n) => n,
        None if be.as_gpu().is_some() => TRAIN_EVAL_ITERS,
        None => CPU_EVAL_ITERS,
    };
    let dir = model_dir(&a.model);
    let ck = checkpoint::load_model(&dir)
        .with_context(|| format!("cannot load the model in {}", dir.display()))?;
    let data_path = a
        .data
        .clone()
        .unwrap_or_else(|| paths::bundled(paths::DEFAULT_DATA));
    let bytes = std::fs::read(&data_path)
        .with_context(|| format!("cannot read {}", data_path.display()))?;
    let text = std::str::from_utf8(&bytes).context("the text is not UTF-8")?;
    let cfg = &ck.config.model;
    let data = Dataset::with_vocab(text, ck.config.vocab.clone(), cfg.block_size)?;
    let seed = ck.state.as_ref().map_or(1337, |s| s.seed);
    let gate_model = GptGate {
        cfg,
        vocab: &ck.config.vocab,
        params: &ck.params,
        tokens: tinygpt_models::gating::token_budget(be),
    };
    let paths = crate::gates::prepare(be, gate, &gate_model)?;
    let mut tr = Trainer::new(
        be,
        cfg,
        a.batch_size,
        &ck.params,
        None,
        OptimConfig::default(),
        paths,
    )?;
    let t = Instant::now();
    let mut sum = 0.0f64;
    let pb = ProgressBar::new(iters as u64);
    pb.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} batches · {msg} · ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    for i in 0..iters {
        let (x, y) = data.batch(true, seed ^ 0xE7A1, i as u64, a.batch_size, cfg.block_size);
        sum += tr.eval_loss(be, &x, &y)? as f64;
        pb.set_message(format!("val loss {:.4}", sum / (i + 1) as f64));
        pb.inc(1);
    }
    pb.finish_and_clear();
    let val = sum / iters as f64;
    println!(
        "val loss {val:.4} ({iters} batches of {} x {} characters, {:.1}s on {} · {})",
        a.batch_size,
        cfg.block_size,
        t.elapsed().as_secs_f64(),
        be.describe(),
        pills(tr.paths())
    );
    if a.eval_iters.is_none() && iters < TRAIN_EVAL_ITERS {
        eprintln!(
            "note: {iters} batches, the CPU backend's default; training reports {TRAIN_EVAL_ITERS} \
             (--eval-iters {TRAIN_EVAL_ITERS} gives that figure)"
        );
    }
    Ok(())
}
