//! The qwen2 (Q/K/V biases) and qwen3 (Q/K norms) architectures from GGUF metadata alone, on tiny
//! random-weight models converted by llama.cpp's own convert_hf_to_gguf.py (F32 and Q8_0), against
//! transformers on the same weights (tests/data/qwen, recorded by scripts/reference/qwen_reference.py):
//! every position's logits within NMSE 1e-5 and 32 greedy tokens identical, on the CPU backend and on
//! the GPU under the low-end profile (the quantized kernels gated as the CLI gates them).

use std::path::PathBuf;

use serde_json::Value;
use tinygpt_formats::GgufFile;
use tinygpt_kernels::gate::{GateOptions, MemoryStore, run_gates};
use tinygpt_kernels::testing::{cpu_backend, gpu_backend};
use tinygpt_kernels::{Backend, PathId, PathSet};
use tinygpt_models::llm::{Arch, Llm, LlmConfig, LoadOptions};
use tinygpt_models::tokenizer::Tokenizer;

mod llm_common;
use llm_common::check_transformers_prompts;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/qwen")
        .join(name)
}

/// The paths a model runs on: on a GPU, the quantized kernels once their gate passed at its shapes.
fn paths(be: &Backend, cfg: &LlmConfig) -> PathSet {
    if be.as_gpu().is_none() {
        return PathSet::F32;
    }
    let opts = GateOptions {
        only: Some(vec![PathId::QuantMatmul]),
        extra_cases: cfg.gate_cases(),
        ..GateOptions::default()
    };
    let summary = pollster::block_on(run_gates(be, &opts, &mut MemoryStore::default()));
    let p = summary.active();
    assert!(
        p.has(PathId::QuantMatmul),
        "the quantized matmul gate failed"
    );
    p
}

fn check(be: &Backend, stem: &str, arch: Arch) {
    let file = GgufFile::open(data(&format!("{stem}.gguf"))).unwrap();
    let cfg = LlmConfig::from_gguf(&file).unwrap();
    assert_eq!(cfg.arch, arch);
    let tok = Tokenizer::from_gguf(file.metadata()).unwrap();
    let opts = LoadOptions {
        paths: paths(be, &cfg),
        ..LoadOptions::default()
    };
    let mut llm = Llm::from_gguf(be, &file, &opts, &mut |_| {}).unwrap();
    let reference: Value =
        serde_json::from_slice(&std::fs::read(data(&format!("{stem}.transformers.json"))).unwrap())
            .unwrap();
    // The converter's vocabulary tokenizes as transformers' tokenizer did.
    check_transformers_prompts(be, &tok, &mut llm, &reference, stem, false);
}

fn all(be: &Backend) {
    for (stem, arch) in [
        ("qwen2.f32", Arch::Qwen2),
        ("qwen2.q8_0", Arch::Qwen2),
        ("qwen3.f32", Arch::Qwen3),
        ("qwen3.q8_0", Arch::Qwen3),
    ] {
        check(be, stem, arch);
    }
}

#[test]
fn qwen2_and_qwen3_match_transformers_on_the_cpu() {
    all(&cpu_backend());
}

#[test]
fn qwen2_and_qwen3_match_transformers_on_the_gpu_under_the_low_end_profile() {
    let Some(be) = gpu_backend(None) else { return };
    all(&be);
}
