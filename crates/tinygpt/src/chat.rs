//! `tinygpt chat MODEL.gguf`: a multi-turn conversation on stdin, rendered with the model's chat
//! template, replies streamed as they are generated.
//!
//! Each turn renders the whole conversation and feeds only the tokens after the longest prefix the KV
//! cache already holds, so earlier turns are not processed again.

use std::io::BufRead;

use anyhow::{Context, Result};
use clap::Args;
use tinygpt_kernels::Backend;
use tinygpt_models::chat_template::ChatTemplate;
use tinygpt_models::tokenizer::Tokenizer;

use crate::gates::GateArgs;
use crate::llm_common::{
    ModelArgs, SamplingArgs, finish_gating, generate, load_interactive, print_flush,
};

/// What `chat` understands besides messages.
const CHAT_HELP: &str = "/reset starts the conversation over, /exit (or end of input) quits, /help \
                         shows this; a message that starts with a slash is sent with two (//like this)";

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A system message opening the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per reply (a reply also ends at an end-of-turn token or when the context is full).
    #[arg(short = 'n', long, default_value_t = 1024)]
    pub n: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// The template for files without one: the format whose markers the vocabulary has (llama.cpp falls
/// back to chatml).
pub(crate) fn builtin_template(tok: &Tokenizer) -> Result<ChatTemplate> {
    let name = if tok.token_id("<start_of_turn>").is_some() {
        "gemma"
    } else {
        "chatml"
    };
    eprintln!("note: the model has no chat template; using the built-in {name} format");
    Ok(ChatTemplate::builtin(name)?)
}

pub fn run(be: &Backend, gate: &GateArgs, a: &ChatArgs) -> Result<()> {
    let mut sampler = a.sampling.sampler()?;
    let mut m = load_interactive(be, gate, &a.model)?;
    let template = match &m.chat_template {
        Some(src) => ChatTemplate::new(src).context("the model's chat template")?,
        None => builtin_template(&m.tok)?,
    };
    let text_of = |id: Option<u32>| {
        id.and_then(|i| m.tok.token_text(i))
            .unwrap_or("")
            .to_string()
    };
    let (bos, eos) = (text_of(m.tok.bos_id()), text_of(m.tok.eos_id()));
    let mut messages: Vec<(String, String)> = Vec::new();
    if let Some(s) = &a.system {
        messages.push(("system".into(), s.clone()));
    }
    // The tokens whose keys and values the cache holds, in order.
    let mut cached: Vec<u32> = Vec::new();
    eprintln!(
        "type a message; /reset starts over, /exit (or end of input) quits, /help lists these."
    );
    let mut input = std::io::stdin().lock();
    let mut raw = Vec::new();
    loop {
        eprint!("> ");
        raw.clear();
        if input.read_until(b'\n', &mut raw).context("reading stdin")? == 0 {
            break;
        }
        // One bad line is reported and skipped; the conversation goes on.
        let line = match std::str::from_utf8(&raw) {
            Ok(l) => l,
            Err(e) => {
                eprintln!(
                    "that line is not valid UTF-8 (bad byte at offset {}); it was skipped, type it again",
                    e.valid_up_to()
                );
                continue;
            }
        };
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages.retain(|(role, _)| role == "system");
                m.llm.reset();
                cached.clear();
                eprintln!("(conversation cleared)");
                continue;
            }
            "/help" | "/?" => {
                eprintln!("{CHAT_HELP}");
                continue;
            }
            // A word after one slash is taken for a command; two slashes send one.
            l if l.starts_with('/') && !l.starts_with("//") && !l.contains(char::is_whitespace) => {
                eprintln!("unknown command {l}; {CHAT_HELP}");
                continue;
            }
            _ => {}
        }
        let line = line
            .strip_prefix('/')
            .filter(|l| l.starts_with('/'))
            .unwrap_or(line);
        messages.push(("user".into(), line.to_string()));
        let msgs: Vec<(&str, &str)> = messages
            .iter()
            .map(|(r, c)| (r.as_str(), c.as_str()))
            .collect();
        let prompt = template.render(&msgs, true, &bos, &eos)?;
        let ids = m.tok.encode_with(&prompt, true, true);
        if ids.is_empty() {
            messages.pop();
            eprintln!("the chat template rendered nothing for this message");
            continue;
        }
        if ids.len() >= m.llm.context() {
            messages.pop();
            eprintln!(
                "the conversation ({} tokens) no longer fits the context of {}: /reset to start over (or raise --ctx)",
                ids.len(),
                m.llm.context()
            );
            continue;
        }
        // Keep the cached prefix the new rendering shares (at least one token is always fed, so there
        // are logits to sample from).
        let keep = cached
            .iter()
            .zip(&ids)
            .take_while(|(a, b)| a == b)
            .count()
            .min(ids.len() - 1);
        m.llm.truncate(keep);
        cached.truncate(keep);
        let mut text = String::new();
        let (reply, stop, tm) = generate(be, &mut m, &ids[keep..], a.n, &mut sampler, |s| {
            text.push_str(s);
            print_flush(s)
        })?;
        print_flush("\n")?;
        cached.extend_from_slice(&ids[keep..]);
        // Every reply token was fed back except the last one sampled at the token limit.
        let fed = m.llm.position() - cached.len();
        cached.extend_from_slice(&reply[..fed]);
        messages.push(("assistant".into(), text));
        eprintln!("[{} · stop: {stop:?}]", tm.summary());
    }
    finish_gating(&mut m);
    Ok(())
}
