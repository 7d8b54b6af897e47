//! The `gpt2` architecture on a GPT-2 that is not a TinyGPT export: random weights with non-zero
//! biases on every norm and projection, written by llama.cpp's gguf-py the way its converter writes a
//! GPT-2, against transformers' GPT2LMHeadModel on the same weights (tests/data/gpt2, recorded by
//! scripts/reference/gpt2_reference.py).

use std::path::PathBuf;

use serde_json::Value;
use tinygpt_formats::GgufFile;
use tinygpt_kernels::Backend;
use tinygpt_kernels::testing::{cpu_backend, gpu_backend, nmse};
use tinygpt_models::llm::{Llm, LoadOptions};
use tinygpt_models::sampler::argmax;
use tinygpt_models::tokenizer::Tokenizer;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/gpt2")
        .join(name)
}

fn check(be: &Backend) {
    let file = GgufFile::open(data("tiny-biased.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(file.metadata()).unwrap();
    let mut llm = Llm::from_gguf(be, &file, &LoadOptions::default(), &mut |_| {}).unwrap();
    let v = llm.config().vocab;
    let reference: Value =
        serde_json::from_slice(&std::fs::read(data("transformers.json")).unwrap()).unwrap();
    for p in reference["prompts"].as_array().unwrap() {
        let ids: Vec<u32> = serde_json::from_value(p["ids"].clone()).unwrap();
        let text = p["text"].as_str().unwrap();
        assert_eq!(tok.encode_with(text, true, false), ids, "{text:?}");
        let want: Vec<f32> = p["logits"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
            })
            .collect();
        llm.reset();
        let got = pollster::block_on(llm.score(be, &ids, 0)).unwrap();
        let e = nmse(&want, &got);
        eprintln!(
            "[{}] {} tokens: NMSE vs transformers {e:.2e}",
            be.kind(),
            ids.len()
        );
        assert!(e <= 1e-5, "NMSE {e:.3e}");
        let greedy_want: Vec<u32> = serde_json::from_value(p["greedy_ids"].clone()).unwrap();
        let mut last = got[got.len() - v..].to_vec();
        let mut greedy = Vec::new();
        for _ in 0..greedy_want.len() {
            let t = argmax(&last);
            greedy.push(t);
            last = llm.decode(be, t).unwrap();
        }
        assert_eq!(greedy, greedy_want, "greedy continuation of {text:?}");
    }
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
