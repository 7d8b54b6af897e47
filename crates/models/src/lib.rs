//! TinyGPT models.

pub mod gpt;
pub mod tokenizer;
