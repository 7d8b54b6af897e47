//! `tinygpt run MODEL.gguf -p TEXT`: continue a prompt with a GGUF model, streaming the text.

use anyhow::Result;
use clap::{Args, ValueEnum};
use tinygpt_kernels::Backend;

use crate::gates::GateArgs;
use crate::llm_common::{
    ModelArgs, SamplingArgs, active_paths, finish_gating, generate, load_interactive, print_flush,
    process_memory,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// The prompt and its continuation as they are generated; the summary on stderr.
    Text,
    /// One JSON object: prompt and generated ids, text, timings, active paths.
    Json,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt (special-token text such as `<|im_start|>` is parsed into those tokens).
    #[arg(short = 'p', long)]
    pub prompt: String,
    /// Most tokens to generate (generation also stops at an end-of-generation token).
    #[arg(short = 'n', long, default_value_t = 128)]
    pub n: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

pub fn run(be: &Backend, gate: &GateArgs, a: &RunArgs) -> Result<()> {
    let mut sampler = a.sampling.sampler()?;
    let mut m = load_interactive(be, gate, &a.model)?;
    // As llama.cpp tokenizes a prompt: BOS if the model adds one, special tokens parsed.
    let prompt_ids = m.tok.encode_with(&a.prompt, true, true);
    if prompt_ids.is_empty() {
        anyhow::bail!("the prompt is empty and the model adds no BOS token: give some text");
    }
    if prompt_ids.len() > m.llm.context() {
        anyhow::bail!(
            "the prompt is {} tokens long; the context holds {} (--ctx sets it, up to the model's {})",
            prompt_ids.len(),
            m.llm.context(),
            m.llm.config().train_context
        );
    }
    let text_mode = a.format == Format::Text;
    if text_mode {
        print_flush(&a.prompt)?;
    }
    let mut text = String::new();
    let (ids, stop, tm) = generate(be, &mut m, &prompt_ids, a.n, &mut sampler, |s| {
        text.push_str(s);
        if text_mode { print_flush(s) } else { Ok(()) }
    })?;
    if text_mode {
        print_flush("\n")?;
        eprintln!("{} · stop: {stop:?}", tm.summary());
        finish_gating(&mut m);
        return Ok(());
    }
    let (rss, hwm) = process_memory().unwrap_or((0, 0));
    let mem = m.llm.memory();
    let v = serde_json::json!({
        "model": m.name,
        "arch": m.llm.config().arch.name(),
        "file_type": m.llm.config().file_type,
        "backend": be.describe(),
        "prompt": a.prompt,
        "prompt_ids": prompt_ids,
        "generated_ids": ids,
        "text": text,
        "stop": stop,
        "timings": {
            "load_s": m.load_secs,
            "prompt_tokens": tm.prompt_tokens,
            "prompt_s": tm.prompt_secs,
            "prompt_tok_s": tm.prompt_tok_s(),
            "generated_tokens": tm.generated_tokens,
            "decode_passes": tm.decode_passes,
            "decode_s": tm.decode_secs,
            "decode_tok_s": tm.decode_tok_s(),
        },
        "memory": {
            "weights_bytes": mem.weights,
            "kv_cache_bytes": mem.kv_cache,
            "scratch_bytes": mem.scratch,
            "vm_rss_bytes": rss,
            "vm_hwm_bytes": hwm,
        },
        "paths": active_paths(be, &m.llm),
        "drift_guard": m.guard.as_ref().map(|g| {
            let s = g.stats();
            serde_json::json!({
                "every": g.every(),
                "checks": s.checks,
                "same_top1": s.same_top1,
                "worst_kl": s.worst_kl,
                "worst_kl_over_bound": s.worst_ratio,
                "tripped_at": g.tripped().map(|e| e.position),
            })
        }),
    });
    println!("{}", serde_json::to_string_pretty(&v)?);
    finish_gating(&mut m);
    Ok(())
}
