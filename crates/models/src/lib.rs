//! TinyGPT models.

pub mod chat_template;
#[doc(hidden)]
pub mod fuzzing;
pub mod gating;
pub mod gpt;
pub mod llm;
pub mod sampler;
pub mod tokenizer;
