//! The bundled Shakespeare model exported to GGUF (llama.cpp's `gpt2`) and to Hugging Face's GPT-2
//! layout, checked against what llama.cpp and transformers computed on those very files
//! (`tests/data/export/*.json`, recorded by scripts/reference/export_reference.py).
//!
//! Each test first exports the model again and checks the bytes hash to what the tools ran: the
//! recorded results are then results about the files checked here (a change to the exporter that
//! alters a byte fails until the references are regenerated).

use std::path::PathBuf;

use serde_json::Value;
use sha2::{Digest, Sha256};
use tinygpt_formats::GgufFile;
use tinygpt_kernels::testing::{cpu_backend, gpu_backend, nmse};
use tinygpt_kernels::{Backend, PathSet};
use tinygpt_models::gpt::GptRunner;
use tinygpt_models::gpt::checkpoint::{self, Loaded};
use tinygpt_models::gpt::export::{EOS_TOKEN, GgufWeights, to_gguf};
use tinygpt_models::gpt::hf::to_hf;
use tinygpt_models::llm::{Llm, LoadOptions};
use tinygpt_models::sampler::argmax;
use tinygpt_models::tokenizer::Tokenizer;

const N_GREEDY: usize = 100;
/// The bound for llama.cpp against our f32 math on F32 weights; F16 files are held to it too.
const NMSE_F32: f64 = 1e-5;
/// llama.cpp multiplies Q8_0 weights with activations quantized to 8 bits; ours stay f32.
const NMSE_Q8_0: f64 = 1e-3;
/// With Q8_0 weights the two continuations may part at a step where llama.cpp's top two logits are
/// closer than this (its 8-bit activations move logits by that much); before it they must agree.
const NEAR_TIE_Q8_0: f32 = 0.5;
/// transformers (f32) against our f32 math.
const NMSE_TRANSFORMERS: f64 = 1e-6;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn bundled() -> Loaded {
    checkpoint::load_model(&root().join("models/shakespeare-char")).expect("bundled model")
}

fn reference(tool: &str) -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/export")
        .join(format!("{tool}.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).expect("reference JSON")
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One recorded prompt.
struct Prompt {
    text: String,
    ids: Vec<u32>,
    /// Logits at every prompt position.
    logits: Vec<Vec<f32>>,
    greedy: Vec<u32>,
    /// llama.cpp's top-1 minus top-2 logit at each greedy step.
    greedy_gap: Vec<f32>,
    greedy_text: String,
}

fn prompts(file: &Value) -> Vec<Prompt> {
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    file["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| Prompt {
            text: p["text"].as_str().unwrap().to_string(),
            ids: ids(&p["ids"]),
            logits: p["logits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    r.as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_f64().unwrap() as f32)
                        .collect()
                })
                .collect(),
            greedy: ids(&p["greedy_ids"]),
            greedy_gap: p["greedy_top2"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| (r[1].as_f64().unwrap() - r[3].as_f64().unwrap()) as f32)
                .collect(),
            greedy_text: p["greedy_text"].as_str().unwrap().to_string(),
        })
        .collect()
}

/// NMSE of every prompt position's first `v` logits.
fn nmse_rows(want: &[Vec<f32>], got: &[Vec<f32>], v: usize) -> f64 {
    assert_eq!(want.len(), got.len(), "positions");
    let w: Vec<f32> = want.iter().flat_map(|r| r[..v].iter().copied()).collect();
    let g: Vec<f32> = got.iter().flat_map(|r| r[..v].iter().copied()).collect();
    nmse(&w, &g)
}

/// The logits after every prompt position and the greedy continuation, as `tinygpt generate` computes
/// them (the char-level GPT's own runner, one token per pass through its KV cache).
fn runner_outputs(be: &Backend, ck: &Loaded, ids: &[u32]) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut r = GptRunner::new(be, &ck.config.model, &ck.params, PathSet::F32).unwrap();
    let mut logits = vec![r.prefill(be, &ids[..1]).unwrap()];
    for &t in &ids[1..] {
        logits.push(r.step(be, t).unwrap());
    }
    let mut greedy = Vec::new();
    let mut last = logits.last().unwrap().clone();
    for _ in 0..N_GREEDY {
        let t = argmax(&last);
        greedy.push(t);
        last = r.step(be, t).unwrap();
    }
    (logits, greedy)
}

/// Checks `tinygpt generate`'s runner on the checkpoint against one tool's recorded prompts: the tool's
/// ids are our character ids, the logits agree within `bound`, the greedy continuation is the same.
fn check_runner_against(tool: &str, rec: &Value, ck: &Loaded, bound: f64) {
    let be = cpu_backend();
    let v = ck.config.model.vocab_size;
    for p in prompts(rec) {
        assert_eq!(ck.config.vocab.encode(&p.text).unwrap(), p.ids);
        let (logits, greedy) = runner_outputs(&be, ck, &p.ids);
        let e = nmse_rows(&p.logits, &logits, v);
        eprintln!("generate vs {tool}, {} tokens: NMSE {e:.2e}", p.ids.len());
        assert!(e <= bound, "NMSE {e:.3e}");
        assert_eq!(greedy, p.greedy, "greedy continuation of {:?}", p.text);
        assert_eq!(ck.config.vocab.decode(&greedy), p.greedy_text);
    }
}

/// The same through the GGUF runner on the exported file.
fn llm_outputs(be: &Backend, file: &GgufFile, ids: &[u32]) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut llm = Llm::from_gguf(be, file, &LoadOptions::default(), &mut |_| {}).unwrap();
    let v = llm.config().vocab;
    let flat = pollster::block_on(llm.score(be, ids, 0)).unwrap();
    let logits: Vec<Vec<f32>> = flat.chunks(v).map(<[f32]>::to_vec).collect();
    let mut greedy = Vec::new();
    let mut last = logits.last().unwrap().clone();
    for _ in 0..N_GREEDY {
        let t = argmax(&last);
        greedy.push(t);
        last = llm.decode(be, t).unwrap();
    }
    (logits, greedy)
}

fn weights(name: &str) -> (GgufWeights, f64) {
    match name {
        "shakespeare.f32.gguf" => (GgufWeights::F32, NMSE_F32),
        "shakespeare.f16.gguf" => (GgufWeights::F16, NMSE_F32),
        "shakespeare.q8_0.gguf" => (GgufWeights::Q8_0, NMSE_Q8_0),
        other => panic!("unexpected file {other} in the reference"),
    }
}

/// Exports `name` and checks it is the file llama.cpp ran.
fn export_checked(ck: &Loaded, name: &str, rec: &Value) -> GgufFile {
    let (w, _) = weights(name);
    let e = to_gguf(&ck.config, &ck.params, w, "TinyGPT shakespeare-char").unwrap();
    assert!(e.eos_logit < -500.0, "{}", e.eos_logit);
    let bytes = e.writer.to_bytes().unwrap();
    assert_eq!(
        sha256(&bytes),
        rec["sha256"].as_str().unwrap(),
        "{name}: the export differs from the file llama.cpp ran; regenerate with scripts/reference/regenerate.sh"
    );
    GgufFile::from_bytes(bytes).unwrap()
}

fn check_gguf_on(be: &Backend, names: &[&str]) {
    let ck = bundled();
    let v = ck.config.model.vocab_size;
    let lc = reference("llamacpp");
    for &name in names {
        let rec = &lc["files"][name];
        assert_eq!(rec["n_vocab"].as_u64(), Some(v as u64 + 1), "{name}");
        let file = export_checked(&ck, name, rec);
        let tok = Tokenizer::from_gguf(file.metadata()).unwrap();
        let (w, bound) = weights(name);
        for p in prompts(rec) {
            // Our tokenizer reads the vocabulary as llama.cpp does.
            assert_eq!(tok.encode_with(&p.text, true, false), p.ids, "{name}");
            let (logits, greedy) = llm_outputs(be, &file, &p.ids);
            // The characters' logits (the end-of-text logit, about -1000, is checked below).
            let e = nmse_rows(&p.logits, &logits, v);
            eprintln!(
                "[{} {name}] {} tokens: NMSE vs llama.cpp {e:.2e}",
                be.kind(),
                p.ids.len()
            );
            assert!(e <= bound, "{name}: NMSE {e:.3e} > {bound:e}");
            // The end-of-text token is never near being predicted.
            for row in &logits {
                let best = row[..v].iter().fold(f32::MIN, |m, &x| m.max(x));
                assert!(
                    row[v] < best - 500.0,
                    "{name}: {EOS_TOKEN} logit {}",
                    row[v]
                );
            }
            if w == GgufWeights::Q8_0 {
                if let Some(i) = (0..N_GREEDY).find(|&i| greedy[i] != p.greedy[i]) {
                    eprintln!(
                        "[{} {name}] greedy continuations part at step {i} (llama.cpp's top-2 gap {:.3})",
                        be.kind(),
                        p.greedy_gap[i]
                    );
                    assert!(
                        p.greedy_gap[i] < NEAR_TIE_Q8_0,
                        "{name}: step {i} is no near-tie"
                    );
                }
                continue;
            }
            assert_eq!(
                greedy, p.greedy,
                "{name}: greedy continuation of {:?}",
                p.text
            );
            assert_eq!(tok.decode(&greedy).unwrap(), p.greedy_text, "{name}");
        }
    }
}

#[test]
fn gguf_exports_are_the_files_llama_cpp_ran_and_the_gguf_runner_agrees_with_it() {
    check_gguf_on(
        &cpu_backend(),
        &[
            "shakespeare.f32.gguf",
            "shakespeare.f16.gguf",
            "shakespeare.q8_0.gguf",
        ],
    );
}

#[test]
fn gguf_exports_agree_with_llama_cpp_on_the_gpu_under_the_low_end_profile() {
    let Some(be) = gpu_backend(None) else { return };
    check_gguf_on(&be, &["shakespeare.f32.gguf"]);
}

/// The check: llama.cpp's greedy continuation of the F32 file equals `tinygpt generate
/// --temperature 0` (the char-level runner, on the checkpoint itself), and their logits agree.
#[test]
fn generate_on_the_checkpoint_agrees_with_llama_cpp_on_its_export() {
    let ck = bundled();
    let lc = reference("llamacpp");
    let rec = &lc["files"]["shakespeare.f32.gguf"];
    export_checked(&ck, "shakespeare.f32.gguf", rec);
    check_runner_against("llama.cpp", rec, &ck, NMSE_F32);
}

#[test]
fn hf_export_is_the_directory_transformers_ran_and_agrees_with_it() {
    let ck = bundled();
    let v = ck.config.model.vocab_size;
    let tf = reference("transformers");
    let rec = &tf["files"]["hf"];
    let files = to_hf(&ck.config, &ck.params).unwrap();
    for (name, bytes) in files.named() {
        assert_eq!(
            sha256(bytes),
            rec["sha256"][name].as_str().unwrap(),
            "{name} differs from what transformers loaded; regenerate with scripts/reference/regenerate.sh"
        );
    }
    assert_eq!(rec["n_vocab"].as_u64(), Some(v as u64));
    check_runner_against("transformers", rec, &ck, NMSE_TRANSFORMERS);
}

#[test]
fn hf_export_loads_back_as_the_same_model() {
    let ck = bundled();
    let files = to_hf(&ck.config, &ck.params).unwrap();
    let dir = std::env::temp_dir().join(format!("tinygpt-export-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, bytes) in files.named() {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let back = checkpoint::load_model(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(back.config.model, ck.config.model);
    assert_eq!(back.config.vocab, ck.config.vocab);
    assert!(back.params == ck.params, "weights changed on the way");
}
