//! The `gpt2` architecture on a GPT-2 that is not a TinyGPT export: random weights with non-zero
//! biases on every norm and projection, written by llama.cpp's gguf-py the way its converter writes a
//! GPT-2, against transformers' GPT2LMHeadModel on the same weights (tests/data/gpt2, recorded by
//! scripts/reference/gpt2_reference.py).

use std::path::PathBuf;

use serde_json::Value;
use tinygpt_formats::GgufFile;
use tinygpt_kernels::Backend;
use tinygpt_kernels::testing::{cpu_backend, gpu_backend};
use tinygpt_models::llm::{Llm, LoadOptions};
use tinygpt_models::tokenizer::Tokenizer;

mod llm_common;
use llm_common::check_transformers_prompts;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/gpt2")
        .join(name)
}

fn check(be: &Backend) {
    let file = GgufFile::open(data("tiny-biased.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(file.metadata()).unwrap();
    let mut llm = Llm::from_gguf(be, &file, &LoadOptions::default(), &mut |_| {}).unwrap();
    let reference: Value =
        serde_json::from_slice(&std::fs::read(data("transformers.json")).unwrap()).unwrap();
    check_transformers_prompts(be, &tok, &mut llm, &reference, "gpt2", true);
}

#[test]
fn a_gpt2_with_biases_matches_transformers_on_the_cpu() {
    check(&cpu_backend());
}

#[test]
fn a_gpt2_with_biases_matches_transformers_on_the_gpu_under_the_low_end_profile() {
    let Some(be) = gpu_backend(None) else { return };
    check(&be);
}
