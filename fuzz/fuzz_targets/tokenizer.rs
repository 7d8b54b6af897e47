#![no_main]
//! See tinygpt_models::fuzzing::tokenizer: SmolLM2's byte-level BPE and Gemma 3's SentencePiece
//! vocabulary, read from the real files (TINYGPT_MODELS_DIR, default ../.cache/models).
use std::sync::OnceLock;

use tinygpt_models::fuzzing::{tokenizer, tokenizers};
use tinygpt_models::tokenizer::Tokenizer;

static TOKENIZERS: OnceLock<Vec<Tokenizer>> = OnceLock::new();

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    for tok in TOKENIZERS.get_or_init(tokenizers) {
        tokenizer(tok, data);
    }
});
