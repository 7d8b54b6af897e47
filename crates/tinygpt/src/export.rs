//! `tinygpt export`: a char-level GPT checkpoint as a GGUF file of llama.cpp's `gpt2` architecture
//! and/or as a Hugging Face GPT-2 directory (see `tinygpt_models::gpt::export` and `::hf`).

use crate::paths;
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use std::path::{Path, PathBuf};
use tinygpt_models::gpt::checkpoint;
use tinygpt_models::gpt::export::{EOS_TOKEN, GgufWeights, to_gguf};
use tinygpt_models::gpt::hf::to_hf;

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("target").required(true).multiple(true).args(["gguf", "hf"])))]
pub struct ExportArgs {
    /// Checkpoint directory: TinyGPT's or a Hugging Face GPT-2 one (default: the bundled Shakespeare
    /// model).
    pub dir: Option<PathBuf>,
    /// Write the model as a GGUF file (llama.cpp's `gpt2` architecture; `tinygpt run` runs it too).
    #[arg(long, value_name = "OUT.gguf")]
    pub gguf: Option<PathBuf>,
    /// Weight type of the GGUF file's matrices (norms and biases stay f32).
    #[arg(long = "type", value_enum, default_value = "f32")]
    pub weight_type: WeightType,
    /// Write the model as a Hugging Face directory (GPT2LMHeadModel: config.json, model.safetensors,
    /// tokenizer.json, tokenizer_config.json).
    #[arg(long, value_name = "OUTDIR")]
    pub hf: Option<PathBuf>,
    /// Replace files that are already there (by default they are refused, and left untouched).
    #[arg(long)]
    pub overwrite: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WeightType {
    F32,
    F16,
    #[value(name = "q8_0")]
    Q8_0,
}

const HF_FILES: [&str; 4] = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
];

pub fn run(a: &ExportArgs) -> Result<()> {
    let dir = a
        .dir
        .clone()
        .unwrap_or_else(|| paths::bundled(paths::DEFAULT_MODEL));
    // Refuse what would be replaced before any work.
    if let Some(out) = &a.gguf {
        check_file_target(out, a.overwrite)?;
    }
    if let Some(out) = &a.hf {
        check_dir_target(out, a.overwrite)?;
    }
    let ck = checkpoint::load_model(&dir)
        .with_context(|| format!("cannot load the model in {}", dir.display()))?;
    let cfg = &ck.config.model;
    let summary = format!(
        "{:.2}M parameters, {} layers, {} heads, {} wide, context {}, {} characters",
        cfg.num_params() as f64 / 1e6,
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        cfg.block_size,
        cfg.vocab_size
    );
    if let Some(out) = &a.gguf {
        let weights = match a.weight_type {
            WeightType::F32 => GgufWeights::F32,
            WeightType::F16 => GgufWeights::F16,
            WeightType::Q8_0 => GgufWeights::Q8_0,
        };
        let name = dir
            .canonicalize()
            .ok()
            .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "tinygpt".into());
        let e = to_gguf(&ck.config, &ck.params, weights, &format!("TinyGPT {name}"))
            .with_context(|| format!("cannot export {} as GGUF", dir.display()))?;
        e.writer
            .write_atomic(out)
            .with_context(|| format!("cannot write {}", out.display()))?;
        let size = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
        println!(
            "wrote {} ({:.1} MB): gpt2 architecture, {:?} weights, {summary} + {EOS_TOKEN}",
            out.display(),
            size as f64 / 1e6,
            a.weight_type
        );
        if e.eos_logit == 0.0 {
            eprintln!(
                "warning: the vocabulary is at least as large as the model is wide, so {EOS_TOKEN} could not \
                 be kept from being predicted; llama.cpp may end a generation early (its --ignore-eos prevents that)"
            );
        }
    }
    if let Some(out) = &a.hf {
        let files = to_hf(&ck.config, &ck.params)
            .with_context(|| format!("cannot export {} in Hugging Face's layout", dir.display()))?;
        write_dir(out, &files.named())?;
        println!(
            "wrote {}/ (GPT2LMHeadModel, f32, {summary}): transformers loads it with \
             GPT2LMHeadModel.from_pretrained and AutoTokenizer.from_pretrained",
            out.display()
        );
    }
    Ok(())
}

fn check_file_target(out: &Path, overwrite: bool) -> Result<()> {
    if out.is_dir() {
        bail!(
            "{} is a directory; give the GGUF file's path",
            out.display()
        );
    }
    if out.exists() && !overwrite {
        bail!(
            "{} already exists: pass --overwrite to replace it, or choose another path",
            out.display()
        );
    }
    Ok(())
}

fn check_dir_target(out: &Path, overwrite: bool) -> Result<()> {
    if out.exists() && !out.is_dir() {
        bail!("{} exists and is not a directory", out.display());
    }
    if let Some(f) = HF_FILES.iter().find(|f| out.join(f).exists())
        && !overwrite
    {
        bail!(
            "{} already holds {f}: pass --overwrite to replace the model there, or choose another directory",
            out.display()
        );
    }
    Ok(())
}

/// Writes `files` into `out`. A new directory is filled under a temporary name beside it and renamed
/// into place once complete; in an existing one each file replaces the old one atomically.
fn write_dir(out: &Path, files: &[(&str, &[u8])]) -> Result<()> {
    let write_all = |dir: &Path| -> Result<()> {
        for (name, bytes) in files {
            checkpoint::write_atomic(&dir.join(name), bytes)?;
        }
        Ok(())
    };
    if out.is_dir() {
        return write_all(out);
    }
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    let name = out
        .file_name()
        .map_or_else(|| "export".into(), |n| n.to_string_lossy().into_owned());
    let staging = parent.join(format!(".{name}.partial-{}", std::process::id()));
    let result = std::fs::create_dir(&staging)
        .with_context(|| format!("cannot create {}", staging.display()))
        .and_then(|_| write_all(&staging))
        .and_then(|_| {
            std::fs::rename(&staging, out)
                .with_context(|| format!("cannot move the export into {}", out.display()))
        });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result
}
