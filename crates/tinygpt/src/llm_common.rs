//! Shared by `run` and `chat`: loading a GGUF model (progress bar, status line), the
//! sampling flags, token generation with streamed text and timings, and memory figures.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use tinygpt_formats::GgufFile;
use tinygpt_kernels::Backend;
use tinygpt_kernels::gate::pills;
use tinygpt_kernels::ops::matmul::quant::cpu::CpuIsa;
use tinygpt_models::gating::GgufGate;
use tinygpt_models::llm::{DriftGuard, Finish, Llm, LlmConfig, LoadOptions};

use crate::background_gate::{BackgroundGate, Verdict};
use crate::gates::GateArgs;
use tinygpt_models::sampler::{Sampler, SamplerConfig};
use tinygpt_models::tokenizer::Tokenizer;

/// The model to load.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A GGUF model file (architectures: llama, gemma3, qwen2, qwen3, gpt2).
    pub model: PathBuf,
    /// KV cache length in tokens (default: the model's trained context, at most 4096).
    #[arg(long)]
    pub ctx: Option<usize>,
}

/// How tokens are picked (llama.cpp's defaults, with a fixed seed so runs repeat).
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// 0 picks the most likely token (greedy).
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Keep the k most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the most likely tokens up to this total probability (1: all).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// The sampler's seed: the same seed, settings and prompt give the same text. On a GPU a top-k of
    /// 1 to 64 is drawn on the device, from another random stream than the CPU backend's.
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
}

impl SamplingArgs {
    pub fn sampler(&self) -> Result<Sampler> {
        let cfg = SamplerConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
        };
        cfg.validate().map_err(anyhow::Error::msg)?;
        Ok(Sampler::new(cfg))
    }
}

/// A model with its tokenizer.
pub struct Loaded {
    pub llm: Llm,
    pub tok: Tokenizer,
    /// `tokenizer.chat_template`, if the file has one.
    pub chat_template: Option<String>,
    /// The file's name without the extension and quantization suffix.
    pub name: String,
    pub load_secs: f64,
    /// Watches generation on fast paths (`--drift-check`); None on the f32 path or when turned off.
    pub guard: Option<DriftGuard>,
    /// Fast paths still being gated while the model serves on the f32 path.
    pub gating: Option<BackgroundGate>,
}

/// Files at least this large get a progress bar while they load.
const BAR_BYTES: u64 = 32 << 20;

/// Loads `args.model` on `be`, showing a progress bar for large files, and prints the status line. On
/// a GPU the numerics gate runs first, with the model's own shapes: the quantized kernels are used only
/// if they pass it (otherwise the weights are held dequantized).
pub fn load(be: &Backend, gate: &GateArgs, args: &ModelArgs) -> Result<Loaded> {
    load_with(be, gate, args, 1, false, false)
}

/// [`load`] for generating at once: when some gate verdict is not stored, the model starts on the f32
/// path and its fast paths are gated in the background ([`BackgroundGate`]); [`generate`] moves it to
/// them between two tokens when they pass.
pub fn load_interactive(be: &Backend, gate: &GateArgs, args: &ModelArgs) -> Result<Loaded> {
    load_with(be, gate, args, 1, false, true)
}

/// [`load`] with room for `parallel` sequences decoded together (of their own, `serving`), gating in
/// the `background` where a verdict is missing.
fn load_with(
    be: &Backend,
    gate: &GateArgs,
    args: &ModelArgs,
    parallel: usize,
    serving: bool,
    background: bool,
) -> Result<Loaded> {
    let t = Instant::now();
    let path = &args.model;
    let file = GgufFile::open(path).context("cannot open the model")?;
    let cfg = LlmConfig::from_gguf(&file).with_context(|| format!("loading {}", path.display()))?;
    let tok = Tokenizer::from_gguf(file.metadata())
        .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
    let chat_template = tok.chat_template().map(str::to_string);
    let file_bytes = file.bytes().len() as u64;
    // On a GPU: the op gates at the model's shapes, then 100 greedy tokens of a fixed prompt, f32 path
    // against the fast paths. The quantized kernels are used only if they pass (otherwise the weights
    // are held dequantized).
    let gate_model = GgufGate {
        file: &file,
        cfg: &cfg,
        prompt: tok.encode("The capital of France is", true),
        name: display_name(path, ""),
        tokens: tinygpt_models::gating::token_budget(be),
    };
    let mut gating = None;
    let paths = match be.as_gpu().map(|g| g.opened_with()) {
        Some(device) if background && !gate.f32_only => {
            let opts = crate::gates::options(gate)?;
            let stored = tinygpt_kernels::gate::stored_verdict(
                be,
                &mut crate::gates::FileStore::open(),
                &gate_model,
                &opts,
            );
            match stored {
                // Every verdict is stored: gating takes no time (and prints the cached verdicts).
                Some(_) => crate::gates::prepare(be, gate, &gate_model)?,
                None => {
                    eprintln!(
                        "[ops] gating the fast paths in the background; the f32 path serves until they pass"
                    );
                    gating = Some(BackgroundGate::start(
                        device.clone(),
                        opts,
                        path,
                        gate_model.prompt.clone(),
                        gate_model.name.clone(),
                        gate_model.tokens,
                    ));
                    tinygpt_kernels::PathSet::F32
                }
            }
        }
        _ => crate::gates::prepare(be, gate, &gate_model)?,
    };
    // The model maps the file again and releases each tensor's pages as it converts them, so memory
    // does not peak at the file plus the converted weights.
    drop(file);
    let bar = (file_bytes >= BAR_BYTES).then(|| {
        let b = ProgressBar::new(file_bytes);
        b.set_style(
            ProgressStyle::with_template(
                "loading {msg} {bar:30} {bytes}/{total_bytes} ({elapsed})",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.set_message(display_name(path, ""));
        b
    });
    let opts = LoadOptions {
        context: args.ctx,
        paths,
        parallel,
        // A server's slots are sequences of their own; one conversation uses the model's.
        sequences: if serving { parallel } else { 0 },
        batch: LoadOptions::default().batch.max(parallel),
    };
    let llm = Llm::load(be, path, &opts, &mut |p| {
        if let Some(b) = &bar {
            b.set_length(p.total);
            b.set_position(p.done);
        }
    })
    .with_context(|| format!("loading {}", path.display()))?;
    // Submits the uploads and waits, so the load time includes them.
    be.sync()?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let load_secs = t.elapsed().as_secs_f64();
    let cfg = llm.config();
    let name = display_name(path, &cfg.file_type);
    let mem = llm.memory();
    eprintln!(
        "loaded {name} ({}, {}, {} layers) in {load_secs:.1}s · {} weights, {} KV cache ({} ctx) · {}{} — ready.",
        cfg.arch.name(),
        if cfg.file_type.is_empty() {
            "?"
        } else {
            &cfg.file_type
        },
        cfg.n_layer,
        mb(mem.weights),
        mb(mem.kv_cache),
        llm.context(),
        be.describe(),
        match (be.as_gpu(), &gating) {
            (Some(_), Some(_)) => " · gating… (f32 path until then)".to_string(),
            (Some(_), None) => format!(" · {}", pills(llm.paths())),
            (None, _) if !llm.paths().is_empty() => format!(" · {}", pills(llm.paths())),
            (None, _) => String::new(),
        },
    );
    // The drift guard's shadow runs the f32 path on the CPU (a server's guard watches all its
    // sequences: see serve::engine).
    let guard = if be.as_gpu().is_some()
        && (!llm.paths().is_empty() || gating.is_some())
        && gate.drift_check > 0
    {
        let file = GgufFile::open(path).context("cannot open the model")?;
        // A server's shadow loads its f32 model at start-up, on its thread: no request's check
        // waits behind that load.
        Some(if serving {
            DriftGuard::warm(file, llm.context(), gate.drift_check, gate.shadow_threads())
        } else {
            DriftGuard::new(
                file,
                llm.context(),
                gate.drift_check,
                gate.shadow_threads(),
                true,
            )
        })
    } else {
        None
    };
    Ok(Loaded {
        llm,
        tok,
        chat_template,
        name,
        load_secs,
        guard,
        gating,
    })
}

/// [`load`] for a server: the model with room for `parallel(kv bytes of one sequence)` sequences decoded
/// together (the count can depend on a sequence's size). Like [`load_interactive`], it serves on the
/// f32 path at once while missing gate verdicts are found in the background (`Loaded::gating`).
pub fn load_for_serving(
    be: &Backend,
    gate: &GateArgs,
    args: &ModelArgs,
    parallel: impl FnOnce(u64) -> usize,
) -> Result<(Loaded, usize)> {
    let file = GgufFile::open(&args.model).context("cannot open the model")?;
    let cfg =
        LlmConfig::from_gguf(&file).with_context(|| format!("loading {}", args.model.display()))?;
    drop(file);
    let ctx = args.ctx.unwrap_or_else(|| {
        cfg.train_context
            .clamp(1, tinygpt_models::llm::DEFAULT_CONTEXT)
    });
    let seq_bytes = cache_bytes(&cfg, ctx, 1)?;
    let n = parallel(seq_bytes).max(1);
    check_cache_memory(be, &cfg, ctx, n, "--parallel or --ctx")?;
    Ok((load_with(be, gate, args, n, true, true)?, n))
}

/// Bytes of the f32 keys and values of every layer for `slots` sequences of `ctx` positions.
pub fn cache_bytes(cfg: &LlmConfig, ctx: usize, slots: usize) -> Result<u64> {
    (cfg.n_layer as u64)
        .checked_mul(ctx as u64)
        .and_then(|b| b.checked_mul(2 * 4 * cfg.kv_dim() as u64))
        .and_then(|b| b.checked_mul(slots as u64))
        .with_context(|| {
            format!("{slots} caches of {ctx} positions: their size cannot even be counted")
        })
}

/// Every sequence's cache is allocated up front: on the CPU backend, or a software adapter whose
/// memory is the host's, `slots` caches of `ctx` positions must fit the memory free now (a refusal
/// here, not an out-of-memory abort later). A GPU's own memory is not known here; its allocation
/// fails with an error. `hint` names the flags that lower the need.
pub fn check_cache_memory(
    be: &Backend,
    cfg: &LlmConfig,
    ctx: usize,
    slots: usize,
    hint: &str,
) -> Result<()> {
    let need = cache_bytes(cfg, ctx, slots)?;
    if memory_is_the_hosts(be)
        && let Some(have) = available_memory()
        && need > have
    {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        bail!(
            "{slots} slots of {ctx} positions need {:.1} GiB of KV cache ({:.1} MiB each) and this \
             machine has {:.1} GiB free: lower {hint}",
            gib(need),
            need as f64 / slots.max(1) as f64 / (1u64 << 20) as f64,
            gib(have)
        );
    }
    Ok(())
}

/// Whether `be` allocates in the host's memory: the CPU backend, or a software adapter (lavapipe,
/// SwiftShader). There, what does not fit the free memory is refused before allocating (else the
/// process dies of it); a GPU's own memory is not known here, and its allocations fail with an error.
pub fn memory_is_the_hosts(be: &Backend) -> bool {
    be.as_gpu().is_none_or(|g| g.is_software())
}

/// Free memory (Linux's MemAvailable), where the system says.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Total memory of the machine, where /proc says.
pub fn total_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = s
        .lines()
        .find(|l| l.starts_with("MemTotal:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// "SmolLM2-135M-Instruct" from ".../SmolLM2-135M-Instruct.Q4_1.gguf".
fn display_name(path: &Path, file_type: &str) -> String {
    let stem = path
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    if !file_type.is_empty() {
        let lower = stem.to_ascii_lowercase();
        let ft = file_type.to_ascii_lowercase();
        for sep in ['.', '-', '_'] {
            if let Some(base) = lower.strip_suffix(&format!("{sep}{ft}")) {
                return stem[..base.len()].to_string();
            }
        }
    }
    stem
}

pub fn mb(bytes: u64) -> String {
    format!("{:.0} MB", bytes as f64 / 1e6)
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stop {
    EndOfGeneration,
    MaxTokens,
    ContextFull,
}

/// Timings of one generation.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Timings {
    pub prompt_tokens: usize,
    pub prompt_secs: f64,
    pub generated_tokens: usize,
    /// Forward passes of generated tokens (each generated token is fed back, except an end-of-generation
    /// token and the last one at the token limit).
    pub decode_passes: usize,
    pub decode_secs: f64,
}

impl Timings {
    pub fn prompt_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_secs.max(1e-9)
    }
    pub fn decode_tok_s(&self) -> f64 {
        self.decode_passes as f64 / self.decode_secs.max(1e-9)
    }
    /// "N tokens in X s (Y tok/s; prompt P tok/s)".
    pub fn summary(&self) -> String {
        format!(
            "{} tokens in {:.2} s ({:.1} tok/s; prompt {} tokens, {:.1} tok/s)",
            self.generated_tokens,
            self.prompt_secs + self.decode_secs,
            self.decode_tok_s(),
            self.prompt_tokens,
            self.prompt_tok_s()
        )
    }
}

/// Feeds `new_ids` after what the model holds, then samples up to `max_new` tokens, passing each one's
/// completed text to `emit`. Returns the generated ids (without an end-of-generation token). The
/// model's drift guard, if it has one, watches; when it trips, the event is printed and recorded and
/// generation goes on on the f32 path.
pub fn generate(
    be: &Backend,
    m: &mut Loaded,
    new_ids: &[u32],
    max_new: usize,
    sampler: &mut Sampler,
    mut emit: impl FnMut(&str) -> Result<()>,
) -> Result<(Vec<u32>, Stop, Timings)> {
    let Loaded {
        llm,
        tok,
        guard,
        name,
        gating,
        ..
    } = m;
    let mut tm = Timings {
        prompt_tokens: new_ids.len(),
        ..Timings::default()
    };
    // Gates that finished since the last turn take effect before the prompt.
    take_gate_verdict(be, llm, gating, false)?;
    let t = Instant::now();
    llm.feed(be, new_ids)?;
    if let Some(g) = be.as_gpu() {
        // The prompt's time includes its work on the device.
        g.sync()?;
    }
    tm.prompt_secs = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut out = Vec::new();
    let mut text = tok.stream_decoder(false);
    let g = pollster::block_on(tinygpt_models::llm::generate_watched(
        be,
        llm,
        sampler,
        max_new,
        |id| tok.is_eog(id),
        async |id| -> Result<bool> {
            out.push(id);
            emit(&text.push(id)?)?;
            Ok(true)
        },
        guard.as_mut(),
        |e| {
            eprintln!("\n{}", e.log_line("going on on the f32 path"));
            crate::gates::record_drift(be, name, e);
        },
        |llm| {
            take_gate_verdict(be, llm, gating, true)
                .map_err(|e| tinygpt_models::llm::LlmError::Options(format!("{e:#}")))
        },
    ))?;
    emit(&text.finish())?;
    tm.decode_secs = t.elapsed().as_secs_f64();
    tm.decode_passes = g.passes;
    tm.generated_tokens = out.len();
    let stop = match g.finish {
        Finish::EndOfGeneration => Stop::EndOfGeneration,
        Finish::ContextFull => Stop::ContextFull,
        Finish::MaxTokens | Finish::Stopped => Stop::MaxTokens,
    };
    Ok((out, stop, tm))
}

/// Takes the background gate's verdict if it is ready: the model moves to the paths that passed
/// (returns true when it did). `mid_text`: a line of generated text may be open on the terminal.
fn take_gate_verdict(
    be: &Backend,
    llm: &mut Llm,
    gating: &mut Option<BackgroundGate>,
    mid_text: bool,
) -> Result<bool> {
    let Some(g) = gating else { return Ok(false) };
    let Verdict::Done(v) = g.poll() else {
        return Ok(false);
    };
    if mid_text {
        eprintln!();
    }
    let at = format!("at position {}", llm.position());
    let moved = g.apply(be, llm, v, &at)?;
    *gating = None;
    Ok(moved)
}

/// Waits for gates still running in the background, so their verdicts are stored for the next start
/// (the model's output is complete by then); Ctrl-C skips the wait.
pub fn finish_gating(m: &mut Loaded) {
    let Some(mut g) = m.gating.take() else { return };
    eprintln!(
        "[ops] the fast paths' gates are still running ({:.1} s so far); waiting so the next start can use \
         them (Ctrl-C skips: they run again next time)",
        g.elapsed()
    );
    match g.wait() {
        Ok(paths) if !paths.is_empty() => eprintln!(
            "[ops] gated in {:.1} s: {} — the next start uses them at once",
            g.elapsed(),
            pills(paths)
        ),
        Ok(_) => eprintln!(
            "[ops] gated in {:.1} s: no fast path passed (the f32 path it is)",
            g.elapsed()
        ),
        Err(e) => eprintln!("[ops] gating failed ({e})"),
    }
}

/// Writes streamed text to stdout as it arrives.
pub fn print_flush(s: &str) -> Result<()> {
    if !s.is_empty() {
        let mut out = std::io::stdout().lock();
        out.write_all(s.as_bytes())?;
        out.flush()?;
    }
    Ok(())
}

/// (VmRSS, VmHWM) of this process in bytes, where /proc exists.
pub fn process_memory() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// The kernel paths a model runs on: each projection's layout, and the matmul implementation.
pub fn active_paths(be: &Backend, llm: &Llm) -> BTreeMap<String, String> {
    let mut m: BTreeMap<String, String> = llm.layouts().into_iter().collect();
    let mm = match be {
        Backend::Cpu(c) => format!("CPU {:?}, {} threads", CpuIsa::detected(), c.threads()),
        Backend::Gpu(_) => format!("WGSL ({})", pills(llm.paths())),
    };
    m.insert("quant_matmul".into(), mm);
    m
}
