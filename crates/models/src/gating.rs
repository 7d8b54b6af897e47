//! The models as the numerics gate sees them ([`GateModel`]): their own matrix shapes, a key naming
//! their weights, and their greedy tokens from a fixed prompt on a given path set. With these,
//! `tinygpt_kernels::gate::gate_for_model` gives the path set to build a runner with, in one call.

use tinygpt_formats::GgufFile;
use tinygpt_kernels::gate::{GateCase, GateModel, fingerprint};
use tinygpt_kernels::{Backend, PathId, PathSet};

use crate::gpt::{CharVocab, GptConfig, GptRunner};
use crate::llm::{Llm, LlmConfig, LlmError, LoadOptions};
use crate::sampler::{Sampler, SamplerConfig, argmax};

/// Greedy tokens the token gate compares on a hardware GPU.
pub const TOKEN_GATE_TOKENS: usize = 100;

/// Greedy tokens the token gate compares on a software adapter (lavapipe, SwiftShader), where a model's
/// tokens cost seconds each: enough to catch a path that changes the model's choices, without holding
/// the first token for minutes.
pub const TOKEN_GATE_TOKENS_SOFTWARE: usize = 16;

/// Greedy tokens the token gate compares on the CPU backend (its own paths, e.g. `int-dot`): each
/// path's run costs what a short generation does.
pub const TOKEN_GATE_TOKENS_CPU: usize = 32;

/// How many greedy tokens the token gate compares on `be`.
pub fn token_budget(be: &Backend) -> usize {
    match be.as_gpu() {
        Some(g) if g.is_software() => TOKEN_GATE_TOKENS_SOFTWARE,
        Some(_) => TOKEN_GATE_TOKENS,
        None => TOKEN_GATE_TOKENS_CPU,
    }
}

/// The char-level GPT: its first greedy characters after a newline.
pub struct GptGate<'a> {
    pub cfg: &'a GptConfig,
    pub vocab: &'a CharVocab,
    pub params: &'a [f32],
    /// Greedy tokens to compare ([`token_budget`]).
    pub tokens: usize,
}

impl GateModel for GptGate<'_> {
    type Error = tinygpt_kernels::Error;

    fn gate_cases(&self) -> Vec<GateCase> {
        self.cfg.gate_cases()
    }

    /// The char GPT's weights are f32: the CPU's quantized products never run for it.
    fn uses(&self, path: PathId) -> bool {
        path != PathId::IntDot
    }

    fn model_key(&self) -> String {
        format!(
            "gpt {:016x} {} {} tokens",
            fingerprint(self.params.iter().map(|v| v.to_bits())),
            serde_json::to_string(self.cfg).unwrap_or_default(),
            self.tokens
        )
    }

    async fn greedy(&self, be: &Backend, paths: PathSet) -> Result<Vec<u32>, Self::Error> {
        // A vocabulary without a newline starts from its first character.
        let start = self.vocab.encode("\n").unwrap_or_else(|_| vec![0]);
        let mut r = GptRunner::new(be, self.cfg, self.params, paths)?;
        let mut greedy = Sampler::new(SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        });
        let mut out = Vec::with_capacity(self.tokens);
        r.generate_async(be, &start, self.tokens, &mut greedy, async |t| {
            out.push(t);
            Ok(())
        })
        .await?;
        Ok(out)
    }
}

/// A GGUF model: its first greedy tokens after a fixed prompt, loaded afresh for each path set (the
/// weights' layout depends on it).
pub struct GgufGate<'a> {
    pub file: &'a GgufFile,
    pub cfg: &'a LlmConfig,
    /// The prompt's token ids ("The capital of France is", as the model tokenizes it).
    pub prompt: Vec<u32>,
    /// Names the file in the key (its name; the size and the header's hash are added).
    pub name: String,
    /// Greedy tokens to compare ([`token_budget`]).
    pub tokens: usize,
}

impl GateModel for GgufGate<'_> {
    type Error = LlmError;

    fn gate_cases(&self) -> Vec<GateCase> {
        self.cfg.gate_cases()
    }

    fn model_key(&self) -> String {
        // The header and tokenizer tables live in the first MiB: with the size, they name the file.
        let bytes = self.file.bytes();
        let head = &bytes[..bytes.len().min(1 << 20)];
        format!(
            "gguf {} {} {:016x} {} tokens",
            self.name,
            bytes.len(),
            fingerprint(
                head.chunks(4)
                    .map(|c| c.iter().rev().fold(0u32, |w, &b| (w << 8) | b as u32))
            ),
            self.tokens
        )
    }

    async fn greedy(&self, be: &Backend, paths: PathSet) -> Result<Vec<u32>, Self::Error> {
        let opts = LoadOptions {
            context: Some(self.prompt.len() + self.tokens + 1),
            paths,
            ..LoadOptions::default()
        };
        let mut m = Llm::from_gguf(be, self.file, &opts, &mut |_| {})?;
        m.feed(be, &self.prompt)?;
        let mut out = Vec::with_capacity(self.tokens);
        for _ in 0..self.tokens {
            let t = argmax(&m.read_logits(be).await?);
            out.push(t);
            m.feed(be, &[t])?;
        }
        Ok(out)
    }
}
