//! `tinygpt train`: train the char-level GPT, evaluating and checkpointing as it goes.

use crate::paths;
use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tinygpt_kernels::Backend;
use tinygpt_models::gpt::checkpoint::{self, CheckpointConfig, TrainState, WeightDtype};
use tinygpt_models::gpt::train_gate::{GATE_EVERY, GATE_STEPS, GateRun};
use tinygpt_models::gpt::{Dataset, GptConfig, Layout, OptimConfig, Trainer, learning_rate};

#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    /// UTF-8 text to train on (default: the bundled Shakespeare).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Checkpoint directory: the model (written whenever the validation loss improves) and, in
    /// DIR/resume, the full training state after every evaluation. A directory that already holds a
    /// checkpoint is refused unless --resume or --overwrite says what to do with it. Default: the
    /// --resume directory, else out/shakespeare-char.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue the run saved in this directory (its resume/ state), with the same data and --max-iters.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Start from the weights of this model (a TinyGPT checkpoint or a Hugging Face GPT-2 directory,
    /// e.g. one `tinygpt export --hf` wrote): its shape and vocabulary, a fresh optimizer and schedule.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["resume", "block_size", "n_layer", "n_head", "n_embd"])]
    pub init_from: Option<PathBuf>,
    /// Replace the checkpoint already in --out with this run's (it is replaced as a whole at the first
    /// evaluation; until then the old one stays intact).
    #[arg(long)]
    pub overwrite: bool,
    #[arg(long, default_value_t = 5000)]
    pub max_iters: usize,
    /// Evaluate (and checkpoint on improvement) every N iterations.
    #[arg(long, default_value_t = 250)]
    pub eval_every: usize,
    /// Batches per evaluation, for both splits.
    #[arg(long, default_value_t = 200)]
    pub eval_iters: usize,
    /// Read the training loss back every N iterations (each read waits for the device).
    #[arg(long, default_value_t = 10)]
    pub log_every: usize,
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    #[arg(long, default_value_t = 256)]
    pub block_size: usize,
    #[arg(long, default_value_t = 6)]
    pub n_layer: usize,
    #[arg(long, default_value_t = 6)]
    pub n_head: usize,
    #[arg(long, default_value_t = 384)]
    pub n_embd: usize,
    #[arg(long, default_value_t = 0.2)]
    pub dropout: f32,
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f32,
    #[arg(long, default_value_t = 1e-4)]
    pub min_lr: f32,
    #[arg(long, default_value_t = 100)]
    pub warmup: usize,
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f32,
    #[arg(long, default_value_t = 1.0)]
    pub grad_clip: f32,
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Save every evaluation, not only improvements.
    #[arg(long)]
    pub always_save: bool,
    /// Precision of saved weights (the optimizer state is always f32).
    #[arg(long, value_parser = ["f32", "f16"], default_value = "f32")]
    pub save_dtype: String,
    /// Read the forward pass's weights from an f16 copy when the f16-storage path passed its gate (off by
    /// default: for this size of model it measured slower on an H200, see docs/perf.md).
    #[arg(long)]
    pub f16_forward: bool,
    /// Stop after this iteration, as an interrupted run would (continue later with --resume).
    #[arg(long)]
    pub stop_at: Option<usize>,
    /// Write a JSON summary of the run here.
    #[arg(long)]
    pub summary: Option<PathBuf>,
}

fn read_text(path: &PathBuf) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read the training text {}", path.display()))
}

/// Refuses flags that cannot mean anything (zero batches, NaN rates) before anything is allocated.
fn check_flags(a: &TrainArgs) -> Result<()> {
    for (flag, v) in [
        ("--max-iters", a.max_iters),
        ("--eval-every", a.eval_every),
        ("--eval-iters", a.eval_iters),
        ("--log-every", a.log_every),
        ("--batch-size", a.batch_size),
        ("--block-size", a.block_size),
    ] {
        if v == 0 {
            bail!("{flag} 0: it must be at least 1");
        }
    }
    if a.batch_size > 1 << 16 {
        bail!("--batch-size {} is over the limit of 65536", a.batch_size);
    }
    for (flag, v, positive) in [
        ("--lr", a.lr, true),
        ("--min-lr", a.min_lr, false),
        ("--weight-decay", a.weight_decay, false),
        ("--grad-clip", a.grad_clip, false),
    ] {
        if !v.is_finite() || v < 0.0 || (positive && v == 0.0) {
            bail!(
                "{flag} {v}: it must be a finite number {}",
                if positive { "above 0" } else { "of 0 or more" }
            );
        }
    }
    if !(0.0..1.0).contains(&a.dropout) {
        bail!("--dropout {}: it must be in [0, 1)", a.dropout);
    }
    if a.min_lr > a.lr {
        bail!("--min-lr {} is above --lr {}", a.min_lr, a.lr);
    }
    Ok(())
}

/// Refuses a model and batch whose training would not fit in memory, before allocating any of it.
fn check_memory(be: &Backend, cfg: &GptConfig, batch: usize) -> Result<()> {
    let Some(need) = cfg.train_bytes(batch) else {
        bail!(
            "this model and --batch-size {batch} need more memory than can be counted: make them smaller"
        );
    };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    if crate::llm_common::memory_is_the_hosts(be)
        && let Some(have) = crate::llm_common::available_memory()
        && need > have
    {
        bail!(
            "training this model with --batch-size {batch} needs about {:.1} GiB and this machine has {:.1} GiB free: lower --batch-size, --block-size or the model's size",
            gib(need),
            gib(have)
        );
    }
    Ok(())
}

/// Whether `dir` already holds a checkpoint (the model, or a run's resumable state).
fn holds_checkpoint(dir: &Path) -> bool {
    dir.join("config.json").exists()
        || dir.join("model.safetensors").exists()
        || dir.join("resume").exists()
}

/// Where this run writes; refuses to replace a checkpoint by surprise.
fn out_dir(a: &TrainArgs) -> Result<PathBuf> {
    let out = a
        .out
        .clone()
        .or_else(|| a.resume.clone())
        .unwrap_or_else(|| PathBuf::from("out/shakespeare-char"));
    if out.exists() && !out.is_dir() {
        bail!("--out {}: it is not a directory", out.display());
    }
    let same = |x: &Path, y: &Path| {
        x.canonicalize()
            .ok()
            .zip(y.canonicalize().ok())
            .is_some_and(|(x, y)| x == y)
    };
    let resuming_here = a
        .resume
        .as_ref()
        .is_some_and(|r| same(r, &out) || same(r, &out.join("resume")));
    if holds_checkpoint(&out) && !resuming_here && !a.overwrite {
        bail!(
            "{} already holds a checkpoint: continue it with --resume {}, replace it with --overwrite, or train into another --out",
            out.display(),
            out.display()
        );
    }
    Ok(out)
}

/// Readies the checkpoint directory before the first iteration, so an unwritable one is found now
/// rather than at the first evaluation; tidies a save an earlier run left cut short.
fn prepare_out(out: &Path) -> Result<()> {
    std::fs::create_dir_all(out)
        .with_context(|| format!("cannot create the checkpoint directory {}", out.display()))?;
    // Finish or discard a save that an earlier run left cut short, here and in resume/.
    for dir in [out.to_path_buf(), out.join("resume")] {
        checkpoint::recover(&dir)
            .with_context(|| format!("cannot tidy the checkpoint in {}", dir.display()))?;
    }
    let probe = out.join(format!(".write-test.{}.tmp", std::process::id()));
    std::fs::write(&probe, b"")
        .and_then(|_| std::fs::remove_file(&probe))
        .with_context(|| format!("cannot write checkpoints into {}", out.display()))?;
    Ok(())
}

pub fn run(be: &Backend, gate: &crate::gates::GateArgs, a: &TrainArgs) -> Result<()> {
    check_flags(a)?;
    let out = out_dir(a)?;
    let data_path = a
        .data
        .clone()
        .unwrap_or_else(|| paths::bundled(paths::DEFAULT_DATA));
    let bytes = read_text(&data_path)?;
    let (cfg, data, params, moments, mut state) = match &a.resume {
        Some(dir) => {
            // A training run keeps its resumable state in OUT/resume; a directory holding it directly
            // works too.
            let dir = if dir.join("resume").join("optimizer.safetensors").exists() {
                dir.join("resume")
            } else {
                dir.clone()
            };
            let dir = &dir;
            let l = checkpoint::load(dir)
                .with_context(|| format!("cannot resume from {}", dir.display()))?;
            let text = std::str::from_utf8(&bytes).context("the training text is not UTF-8")?;
            let data =
                Dataset::with_vocab(text, l.config.vocab.clone(), l.config.model.block_size)?;
            let Some((m, v)) = l.optimizer else {
                bail!(
                    "{} has no optimizer state (it is an export, not a training checkpoint)",
                    dir.display()
                );
            };
            let state = l.state.unwrap_or_default();
            check_memory(be, &l.config.model, a.batch_size)?;
            (l.config.model, data, l.params, Some((m, v)), state)
        }
        None if a.init_from.is_some() => {
            let dir = a.init_from.as_ref().expect("matched");
            let l = checkpoint::load_model(dir)
                .with_context(|| format!("cannot start from the model in {}", dir.display()))?;
            let text = std::str::from_utf8(&bytes).context("the training text is not UTF-8")?;
            let data = Dataset::with_vocab(text, l.config.vocab.clone(), l.config.model.block_size)
                .with_context(|| {
                    format!(
                        "cannot train the model in {} on {}",
                        dir.display(),
                        data_path.display()
                    )
                })?;
            let cfg = GptConfig {
                dropout: a.dropout,
                ..l.config.model
            };
            cfg.validate().map_err(anyhow::Error::msg)?;
            check_memory(be, &cfg, a.batch_size)?;
            let state = TrainState {
                seed: a.seed,
                max_iters: a.max_iters,
                ..Default::default()
            };
            (cfg, data, l.params, None, state)
        }
        None => {
            let data = Dataset::from_bytes(&bytes, a.block_size)
                .with_context(|| format!("cannot train on {}", data_path.display()))?;
            let cfg = GptConfig {
                vocab_size: data.vocab.len(),
                block_size: a.block_size,
                n_layer: a.n_layer,
                n_head: a.n_head,
                n_embd: a.n_embd,
                dropout: a.dropout,
            };
            cfg.validate().map_err(anyhow::Error::msg)?;
            check_memory(be, &cfg, a.batch_size)?;
            let params = Layout::new(&cfg).init(&cfg, a.seed);
            let state = TrainState {
                seed: a.seed,
                max_iters: a.max_iters,
                ..Default::default()
            };
            (cfg, data, params, None, state)
        }
    };
    let seed = state.seed;
    let paths = crate::gates::prepare_ops(be, gate, cfg.gate_cases())?
        .map_or(tinygpt_kernels::PathSet::F32, |g| g.paths);
    let optim = OptimConfig {
        weight_decay: a.weight_decay,
        grad_clip: a.grad_clip,
        f16_forward: a.f16_forward,
        ..OptimConfig::default()
    };
    prepare_out(&out)?;
    // A training fast path trains the run's own first steps beside the f32 path before it is used.
    let batch_of = |s: usize| data.batch(false, seed, s as u64, a.batch_size, cfg.block_size);
    let lr_of = |s: usize| learning_rate(s, a.warmup, a.max_iters, a.lr, a.min_lr);
    let run = GateRun {
        cfg: &cfg,
        batch: a.batch_size,
        params: &params,
        optim,
        seed: seed as u32,
        steps: GATE_STEPS,
        every: GATE_EVERY,
        batch_of: &batch_of,
        lr_of: &lr_of,
        held_out: data.batch(true, seed ^ 0xE7A1, 0, a.batch_size, cfg.block_size),
    };
    let paths = crate::gates::prepare_training(be, gate, paths, &run)?;
    let t_setup = Instant::now();
    let mut tr = Trainer::new(
        be,
        &cfg,
        a.batch_size,
        &params,
        moments
            .as_ref()
            .map(|(m, v)| (m.as_slice(), v.as_slice(), state.step)),
        optim,
        paths,
    )?;
    eprintln!(
        "training {:.2}M parameters ({} layers, {} heads, {} wide, block {}) on {} · {} — {} train / {} val characters, vocabulary {}; set up in {:.2}s",
        cfg.num_params() as f64 / 1e6,
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        cfg.block_size,
        be.describe(),
        tinygpt_kernels::gate::pills(tr.paths()),
        data.train.len(),
        data.val.len(),
        data.vocab.len(),
        t_setup.elapsed().as_secs_f64()
    );
    let ckpt_cfg = CheckpointConfig {
        model: cfg.clone(),
        vocab: data.vocab.clone(),
        provenance: serde_json::json!({
            "data": data_path.display().to_string(),
            "trained_with": format!("tinygpt {}", env!("CARGO_PKG_VERSION")),
            "device": be.describe(),
            "batch_size": a.batch_size,
            "lr": a.lr, "min_lr": a.min_lr, "warmup": a.warmup,
            "init_from": a.init_from.as_ref().map(|d| d.display().to_string()),
        }),
    };
    let dtype = if a.save_dtype == "f16" {
        WeightDtype::F16
    } else {
        WeightDtype::F32
    };
    let tokens_per_iter = a.batch_size * cfg.block_size;
    let start = state.step as usize;
    let pb = ProgressBar::new(a.max_iters as u64);
    pb.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} iters · {msg} · ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.set_position(start as u64);
    let t0 = Instant::now();
    let mut timed_iters = 0usize;
    let mut train_time = 0.0f64;
    let mut last_loss = f32::NAN;
    let end = a.stop_at.map_or(a.max_iters, |s| s.min(a.max_iters));
    let mut saved = false;
    if let Some(dir) = &a.resume
        && state.max_iters != 0
        && state.max_iters != a.max_iters
    {
        eprintln!(
            "note: {} was started with --max-iters {}; continuing with {} changes the learning-rate schedule",
            dir.display(),
            state.max_iters,
            a.max_iters
        );
    }
    for it in start..end {
        let (x, y) = data.batch(false, seed, it as u64, a.batch_size, cfg.block_size);
        let lr = learning_rate(it, a.warmup, a.max_iters, a.lr, a.min_lr);
        let ts = Instant::now();
        tr.train_step(be, &x, &y, lr, seed as u32)?;
        let log = (it + 1) % a.log_every.max(1) == 0 || it + 1 == a.max_iters;
        if log {
            last_loss = tr.last_loss(be)?;
            if !last_loss.is_finite() {
                bail!(
                    "the training loss became {last_loss} at iteration {}; lower --lr",
                    it + 1
                );
            }
            state.train_losses.push((it + 1, last_loss));
        }
        if it > start {
            timed_iters += 1;
        }
        train_time += ts.elapsed().as_secs_f64();
        let tps = tokens_per_iter as f64 * (it + 1 - start) as f64 / t0.elapsed().as_secs_f64();
        pb.set_message(format!(
            "loss {last_loss:.4} · {:.0} tokens/s · lr {lr:.2e}",
            tps
        ));
        pb.inc(1);
        // Without a terminal the bar is hidden; log a line now and then instead.
        if pb.is_hidden() && log && (it + 1) % (a.log_every.max(1) * 10) == 0 {
            eprintln!(
                "iter {}: loss {last_loss:.4}, {tps:.0} tokens/s, lr {lr:.2e}",
                it + 1
            );
        }
        state.step = tr.step;
        if (it + 1) % a.eval_every.max(1) == 0 || it + 1 == a.max_iters || it + 1 == end {
            let val = evaluate(be, &mut tr, &data, seed, a, true)?;
            state.val_losses.push((it + 1, val));
            let improved = state.best_val.is_none_or(|b| val < b);
            let train_loss = if last_loss.is_nan() {
                "-".to_string()
            } else {
                format!("{last_loss:.4}")
            };
            let line = format!(
                "iter {}: train loss {train_loss}, val loss {val:.4}{}",
                it + 1,
                if improved {
                    " (best so far, saved)"
                } else {
                    ""
                }
            );
            if pb.is_hidden() {
                eprintln!("{line}");
            } else {
                pb.println(line);
            }
            if improved {
                state.best_val = Some(val);
                state.best_iter = Some(it + 1);
            }
            // The resumable state (f32 weights, optimizer, progress) after every evaluation; the model
            // people use (OUT itself) only when validation improves, unless told otherwise.
            let (p, m, v) = tr.state(be)?;
            let resume_dir = out.join("resume");
            checkpoint::save(
                &resume_dir,
                &ckpt_cfg,
                &p,
                WeightDtype::F32,
                Some((&m, &v)),
                Some(&state),
            )
            .with_context(|| format!("saving the resumable state to {}", resume_dir.display()))?;
            if improved || a.always_save {
                checkpoint::save(&out, &ckpt_cfg, &p, dtype, None, Some(&state))
                    .with_context(|| format!("saving the checkpoint to {}", out.display()))?;
                saved = true;
            }
            // The loss curve so far, beside the checkpoint.
            let png = out.join("loss.png");
            if let Err(e) = crate::plot::write_loss_png(
                &png,
                "TinyGPT training",
                &state.train_losses,
                &state.val_losses,
            ) {
                eprintln!("note: could not draw {}: {e:#}", png.display());
            }
        }
    }
    pb.finish_and_clear();
    let _ = timed_iters;
    let secs = t0.elapsed().as_secs_f64();
    let iters = end.saturating_sub(start);
    eprintln!(
        "done: {iters} iterations in {secs:.1}s ({:.2} ms/iter in steps, {:.0} tokens/s overall); best val loss {} at iter {}; {}",
        1e3 * train_time / iters.max(1) as f64,
        (tokens_per_iter * iters) as f64 / secs,
        state.best_val.map_or("-".into(), |v| format!("{v:.4}")),
        state.best_iter.map_or("-".into(), |v| v.to_string()),
        if saved {
            format!("checkpoint in {}", out.display())
        } else if iters == 0 {
            format!(
                "nothing to do: {} is already at iteration {start}",
                out.display()
            )
        } else {
            format!(
                "the checkpoint in {} is unchanged (no better validation loss)",
                out.display()
            )
        }
    );
    if let Some(p) = &a.summary {
        let s = serde_json::json!({
            "iters": iters, "seconds": secs, "ms_per_iter_steps": 1e3 * train_time / iters.max(1) as f64,
            "tokens_per_s": (tokens_per_iter * iters) as f64 / secs,
            "best_val": state.best_val, "best_iter": state.best_iter,
            "train_losses": state.train_losses, "val_losses": state.val_losses,
            "device": be.describe(),
        });
        std::fs::write(p, serde_json::to_vec_pretty(&s)?)?;
    }
    Ok(())
}

/// Mean loss over `eval_iters` fixed batches of one split (dropout off).
pub fn evaluate(
    be: &Backend,
    tr: &mut Trainer,
    data: &Dataset,
    seed: u64,
    a: &TrainArgs,
    val: bool,
) -> Result<f32> {
    let mut sum = 0.0f64;
    for i in 0..a.eval_iters.max(1) {
        let (x, y) = data.batch(
            val,
            seed ^ 0xE7A1,
            i as u64,
            a.batch_size,
            tr.cfg.block_size,
        );
        sum += tr.eval_loss(be, &x, &y)? as f64;
    }
    Ok((sum / a.eval_iters.max(1) as f64) as f32)
}
