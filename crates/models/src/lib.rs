//! TinyGPT models.

pub mod tokenizer;
