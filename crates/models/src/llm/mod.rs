//! Real small LLMs from GGUF files — the `llama` (SmolLM2, Llama), `gemma3`, `qwen2` (Qwen2.5),
//! `qwen3` and `gpt2` architectures — on either backend: weights stay block-quantized in the kernels' layouts, the prompt runs in one batched pass,
//! then one token per pass through a KV cache.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use tinygpt_models::llm::{Llm, LoadOptions};
//! use tinygpt_models::sampler::argmax;
//! let be = tinygpt_kernels::Backend::Cpu(tinygpt_kernels::cpu::CpuBackend::new(None));
//! let mut model = Llm::load(&be, "model.gguf", &LoadOptions::default(), &mut |_| {})?;
//! let logits = model.prefill(&be, &[504, 3575, 282, 4649, 314])?;
//! let next = model.decode(&be, argmax(&logits))?;
//! # let _ = next; Ok(()) }
//! ```

mod config;
pub mod drift;
mod error;
mod generate;
mod kv_cache;
mod model;
mod weights;

pub use config::{Arch, LayerAttention, LlmConfig};
pub use drift::{DriftEvent, DriftGuard, DriftStats, GptDriftGuard};
pub use error::{LlmError, Result};
pub use generate::{Finish, Generated, generate, generate_guarded, generate_watched};
pub use model::{DEFAULT_CONTEXT, Feed, Llm, LoadOptions, MemoryReport, NllRead, Sequence};
pub use weights::LoadProgress;
