//! Shared by the real-model tests: finding the files, reading the recorded references
//! (`tests/data/reference`, see scripts/reference/README.md) and checking one prompt against them.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Instant;

use serde_json::Value;
use tinygpt_formats::GgufFile;
use tinygpt_kernels::Backend;
use tinygpt_kernels::gate::{GateOptions, MemoryStore, run_gates};
use tinygpt_kernels::testing::nmse;
use tinygpt_kernels::{PathId, PathSet};
use tinygpt_models::llm::{Llm, LlmConfig, LoadOptions};
use tinygpt_models::sampler::argmax;
use tinygpt_models::tokenizer::Tokenizer;

/// llama.cpp's top-1/top-2 margin below which its choice counts as a near-tie: llama.cpp quantizes
/// activations to 8 bits, which moves logits by up to ~0.6 against exact f32 math on the same weights
/// (README: max abs diff 0.58..1.37 over the whole vocabulary), so a smaller margin may legitimately
/// flip. Positions under it are reported, not asserted.
pub const NEAR_TIE: f32 = 0.5;

/// The bounds the tests hold the runner to.
pub const NMSE_VS_TRANSFORMERS: f64 = 1e-5;
pub const NMSE_VS_LLAMACPP: f64 = 5e-3;

pub struct RealModel {
    /// Directory name under tests/data/reference.
    pub key: &'static str,
    pub file: &'static str,
}

pub const SMOLLM2: RealModel = RealModel {
    key: "smollm2",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
};
pub const GEMMA3: RealModel = RealModel {
    key: "gemma3",
    file: "gemma-3-270m-Q4_K_M.gguf",
};

fn models_dir() -> PathBuf {
    match std::env::var_os("TINYGPT_MODELS_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/models"),
    }
}

fn reference_dir(key: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/reference")
        .join(key)
}

/// The model file's path; a missing file fails the test (it must never pass without the model).
pub fn path(model: &RealModel) -> PathBuf {
    let path = models_dir().join(model.file);
    if !path.exists() {
        panic!(
            "{} is missing: run scripts/fetch-models.sh (or point TINYGPT_MODELS_DIR at a directory holding it)",
            path.display()
        );
    }
    path
}

pub fn open(model: &RealModel) -> GgufFile {
    let path = path(model);
    GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Loads tokenizer and model on `be`; prints the load time. On a GPU the quantized kernels must first
/// pass the numerics gate at the model's shapes, as the CLI requires (else the weights would be held
/// dequantized and the quantized kernels not tested at all).
pub fn load(be: &Backend, model: &RealModel) -> (Tokenizer, Llm) {
    let t = Instant::now();
    let file = open(model);
    let tok = Tokenizer::from_gguf(file.metadata()).expect("tokenizer");
    let mut paths = PathSet::F32;
    if be.as_gpu().is_some() {
        let cfg = LlmConfig::from_gguf(&file).expect("config");
        let opts = GateOptions {
            only: Some(vec![PathId::QuantMatmul]),
            extra_cases: cfg.gate_cases(),
            ..GateOptions::default()
        };
        let summary = pollster::block_on(run_gates(be, &opts, &mut MemoryStore::default()));
        for r in &summary.reports {
            eprintln!("{}", r.log_line());
        }
        paths = summary.active();
        assert!(
            paths.has(PathId::QuantMatmul),
            "the quantized matmul gate did not pass on this adapter"
        );
    }
    let opts = LoadOptions {
        context: Some(512),
        paths,
        ..LoadOptions::default()
    };
    drop(file);
    // As the CLI loads: the file mapped again and each tensor's pages released once converted.
    let llm = Llm::load(be, path(model), &opts, &mut |_| {}).expect("model loads");
    eprintln!(
        "[{} {}] loaded in {:.2}s, {:.1} MB of weights",
        model.key,
        be.kind(),
        t.elapsed().as_secs_f64(),
        llm.memory().weights as f64 / 1e6
    );
    (tok, llm)
}

pub fn reference(model: &RealModel, tool: &str) -> Value {
    let path = reference_dir(model.key).join(format!("{tool}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("reference json")
}

fn logits_file(model: &RealModel, name: &str) -> Vec<f32> {
    let path = reference_dir(model.key).join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// [id1, logit1, id2, logit2] rows.
fn top2_rows(v: &Value) -> Vec<(u32, f32, u32, f32)> {
    v.as_array()
        .expect("top-2 array")
        .iter()
        .map(|r| {
            let f = |i: usize| r[i].as_f64().expect("number");
            (f(0) as u32, f(1) as f32, f(2) as u32, f(3) as f32)
        })
        .collect()
}

fn prompt<'a>(doc: &'a Value, name: &str) -> &'a Value {
    doc["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no prompt {name}"))
}

/// (top-1 id, logit, top-2 id, logit), ties to the lower id as the references record them.
pub fn top2(l: &[f32]) -> (u32, f32, u32, f32) {
    let a = argmax(l) as usize;
    let mut b = if a == 0 { 1 } else { 0 };
    for (i, &x) in l.iter().enumerate() {
        if i != a && x > l[b] {
            b = i;
        }
    }
    (a as u32, l[a], b as u32, l[b])
}

/// What one prompt's check measured.
#[derive(Debug)]
pub struct Figures {
    pub prompt_tokens: usize,
    pub nmse_vs_transformers: Option<f64>,
    pub nmse_vs_llamacpp: Option<f64>,
    /// Largest |ours − transformers'| of the top-1 and top-2 logits over the steps of transformers'
    /// greedy continuation.
    pub max_top2_diff_vs_transformers: f32,
    /// Steps of llama.cpp's continuation (teacher-forced) whose top-1 we reproduce, of those compared.
    pub llamacpp_top1_agree: usize,
    pub llamacpp_top1_compared: usize,
    /// Steps skipped as near-ties: (step, llama.cpp's margin, whether we agreed anyway).
    pub llamacpp_near_ties: Vec<(usize, f32, bool)>,
    pub seconds: f64,
    pub decode_steps: usize,
}

/// Runs `name`'s prompt and both continuations, asserting every bound; returns the figures.
pub fn check_prompt(
    be: &Backend,
    model: &RealModel,
    tok: &Tokenizer,
    llm: &mut Llm,
    name: &str,
) -> Figures {
    let t0 = Instant::now();
    let (lc, hf) = (reference(model, "llamacpp"), reference(model, "hf"));
    let (lp, hp) = (prompt(&lc, name), prompt(&hf, name));
    let prompt_ids = ids(&lp["ids"]);
    assert_eq!(
        ids(&hp["ids"]),
        prompt_ids,
        "the two references were fed the same ids"
    );

    // The prompt text tokenizes to llama.cpp's ids (special tokens parsed, BOS as the model asks).
    let text = lp["text"].as_str().expect("prompt text");
    assert_eq!(
        tok.encode_with(text, true, true),
        prompt_ids,
        "{}/{name}: prompt ids",
        model.key
    );

    llm.reset();
    let logits = llm.prefill(be, &prompt_ids).expect("prefill");
    let mut fig = Figures {
        prompt_tokens: prompt_ids.len(),
        nmse_vs_transformers: None,
        nmse_vs_llamacpp: None,
        max_top2_diff_vs_transformers: 0.0,
        llamacpp_top1_agree: 0,
        llamacpp_top1_compared: 0,
        llamacpp_near_ties: Vec::new(),
        seconds: 0.0,
        decode_steps: 0,
    };
    if let Some(f) = hp["last_logits_file"].as_str() {
        let e = nmse(&logits_file(model, f), &logits);
        fig.nmse_vs_transformers = Some(e);
        assert!(
            e <= NMSE_VS_TRANSFORMERS,
            "{}/{name}: NMSE vs transformers {e:.3e}",
            model.key
        );
    }
    if let Some(f) = lp["last_logits_file"].as_str() {
        let e = nmse(&logits_file(model, f), &logits);
        fig.nmse_vs_llamacpp = Some(e);
        assert!(
            e <= NMSE_VS_LLAMACPP,
            "{}/{name}: NMSE vs llama.cpp {e:.3e}",
            model.key
        );
    }

    // Greedy continuation: identical to transformers' (exact f32 math on the same weights), with top-2
    // logits close to the ones it recorded at every step.
    let hf_ids = ids(&hp["greedy_ids"]);
    let hf_top2 = top2_rows(&hp["greedy_top2"]);
    let lc_ids = ids(&lp["greedy_ids"]);
    let lc_top2 = top2_rows(&lp["greedy_top2"]);
    let mut ours_top2 = Vec::with_capacity(hf_ids.len());
    let mut ours = Vec::with_capacity(hf_ids.len());
    let mut l = logits;
    for (step, &want) in hf_ids.iter().enumerate() {
        let t = top2(&l);
        ours_top2.push(t);
        ours.push(t.0);
        let h = hf_top2[step];
        fig.max_top2_diff_vs_transformers = fig
            .max_top2_diff_vs_transformers
            .max((t.1 - h.1).abs())
            .max((t.3 - h.3).abs());
        assert_eq!(
            t.0, want,
            "{}/{name}: greedy step {step}: we pick {} ({:.4}, runner-up {} {:.4}), transformers {} ({:.4}, {} {:.4})",
            model.key, t.0, t.1, t.2, t.3, h.0, h.1, h.2, h.3
        );
        if step + 1 < hf_ids.len() {
            l = llm.decode(be, t.0).expect("decode");
            fig.decode_steps += 1;
        }
    }
    assert_eq!(ours, hf_ids, "{}/{name}: greedy continuation", model.key);

    // llama.cpp's continuation, teacher-forced: while it equals ours the logits are the ones above;
    // from the first difference on, the cache is rolled back and llama.cpp's tokens are fed instead.
    let common = ours.iter().zip(&lc_ids).take_while(|(a, b)| a == b).count();
    let mut forced: Vec<(u32, f32, u32, f32)> =
        ours_top2[..(common + 1).min(lc_ids.len())].to_vec();
    if forced.len() < lc_ids.len() {
        llm.truncate(prompt_ids.len() + common);
        for &id in &lc_ids[common..lc_ids.len() - 1] {
            let l = llm.decode(be, id).expect("decode");
            fig.decode_steps += 1;
            forced.push(top2(&l));
        }
    }
    for (step, (t, w)) in forced.iter().zip(&lc_top2).enumerate() {
        let margin = w.1 - w.3;
        if margin < NEAR_TIE {
            fig.llamacpp_near_ties.push((step, margin, t.0 == w.0));
            continue;
        }
        fig.llamacpp_top1_compared += 1;
        assert_eq!(
            t.0, w.0,
            "{}/{name}: llama.cpp's step {step} (margin {margin:.3}): we pick {} ({:.3}), llama.cpp {} ({:.3})",
            model.key, t.0, t.1, w.0, w.1
        );
        fig.llamacpp_top1_agree += 1;
    }
    fig.seconds = t0.elapsed().as_secs_f64();
    eprintln!("[{} {} {name}] {fig:?}", model.key, be.kind());
    fig
}

/// Checks `llm` against transformers' recorded prompts (each with `text`, `ids`, the `logits` at
/// every position and `greedy_ids`, as scripts/reference/gpt2_reference.py and qwen_reference.py
/// write them): our tokenizer gives the ids, every position's logits are within NMSE 1e-5, and the
/// greedy continuation is the same.
pub fn check_transformers_prompts(
    be: &Backend,
    tok: &Tokenizer,
    llm: &mut Llm,
    reference: &Value,
    what: &str,
    add_special: bool,
) {
    let v = llm.config().vocab;
    for p in reference["prompts"].as_array().expect("prompts") {
        let ids: Vec<u32> = serde_json::from_value(p["ids"].clone()).expect("ids");
        let text = p["text"].as_str().expect("text");
        assert_eq!(
            tok.encode_with(text, add_special, false),
            ids,
            "{what}: {text:?}"
        );
        let want: Vec<f32> = p["logits"]
            .as_array()
            .expect("logits")
            .iter()
            .flat_map(|r| {
                r.as_array()
                    .expect("row")
                    .iter()
                    .map(|x| x.as_f64().expect("logit") as f32)
            })
            .collect();
        llm.reset();
        let got = pollster::block_on(llm.score(be, &ids, 0)).expect("score");
        let e = nmse(&want, &got);
        eprintln!(
            "[{} {what}] {} tokens: NMSE vs transformers {e:.2e}",
            be.kind(),
            ids.len()
        );
        assert!(e <= 1e-5, "{what}: NMSE {e:.3e}");
        let greedy_want: Vec<u32> =
            serde_json::from_value(p["greedy_ids"].clone()).expect("greedy ids");
        let mut last = got[got.len() - v..].to_vec();
        let mut greedy = Vec::new();
        for _ in 0..greedy_want.len() {
            let t = argmax(&last);
            greedy.push(t);
            last = llm.decode(be, t).expect("decode");
        }
        assert_eq!(
            greedy, greedy_want,
            "{what}: greedy continuation of {text:?}"
        );
    }
}
