//! llama.cpp's own tokenizer suite (`models/ggml-vocab-*.gguf` with `.inp`/`.out`, fetched by
//! scripts/fetch-vocab-suite.sh): for every vocabulary TinyGPT's tokenizer reads, its ids for every
//! test text equal llama.cpp's (as llama.cpp's test-tokenizer-0 tokenizes: no special tokens added,
//! special-token text not parsed); every other vocabulary is refused with an error naming what is
//! missing.

use std::path::PathBuf;

use tinygpt_formats::GgufFile;
use tinygpt_models::tokenizer::Tokenizer;

fn suite_dir() -> PathBuf {
    let dir = match std::env::var_os("TINYGPT_VOCAB_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/llama-vocab"),
    };
    assert!(
        dir.join(".complete").exists(),
        "{} holds no tokenizer suite: run scripts/fetch-vocab-suite.sh",
        dir.display()
    );
    dir
}

/// The test texts and their ids, read as test-tokenizer-0 reads them.
fn read_tests(inp: &[u8], out: &str) -> Vec<(String, Vec<u32>)> {
    let raw = String::from_utf8(inp.to_vec()).expect("UTF-8 inputs");
    let sep = "\n__ggml_vocab_test__\n";
    let mut texts = Vec::new();
    let mut pos = 0;
    while pos < raw.len() {
        match raw[pos..].find(sep) {
            Some(i) => {
                texts.push(raw[pos..pos + i].to_string());
                pos += i + sep.len();
            }
            None => {
                texts.push(raw[pos..].to_string());
                break;
            }
        }
    }
    let ids: Vec<Vec<u32>> = out
        .lines()
        .map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect())
        .collect();
    assert_eq!(
        texts.len(),
        ids.len(),
        "inputs and outputs differ in number"
    );
    texts.into_iter().zip(ids).collect()
}

/// Vocabularies the tokenizer does not read (not BPE or SentencePiece), and why.
const REFUSED: &[(&str, &str)] = &[
    ("bert-bge", "bert"),
    ("nomic-bert-moe", "t5"),
    ("gemma-4", "gemma4"),
];

#[test]
fn every_vocabulary_tokenizes_as_llama_cpp_or_is_refused_clearly() {
    let dir = suite_dir();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".gguf"))
        .collect();
    names.sort();
    assert!(names.len() >= 19, "{names:?}");
    let mut failures = Vec::new();
    for name in &names {
        let key = name
            .trim_start_matches("ggml-vocab-")
            .trim_end_matches(".gguf");
        let file = GgufFile::open(dir.join(name)).unwrap();
        let tok = Tokenizer::from_gguf(file.metadata());
        if let Some((_, model)) = REFUSED.iter().find(|(k, _)| *k == key) {
            let err = tok
                .err()
                .unwrap_or_else(|| panic!("{name} is read now: test it"));
            assert!(err.to_string().contains(model), "{name}: {err}");
            eprintln!("{key:16} refused: {err}");
            continue;
        }
        let tok = tok.unwrap_or_else(|e| panic!("{name}: {e}"));
        let inp = dir.join(format!("{name}.inp"));
        if !inp.exists() {
            // No recorded ids (aquila, baichuan, gpt-neox): it must at least tokenize and decode.
            let ids = tok.encode_with("Hello world, 123!", false, false);
            assert!(!ids.is_empty(), "{name}");
            eprintln!("{key:16} loads (no test texts in the suite)");
            continue;
        }
        let tests = read_tests(
            &std::fs::read(&inp).unwrap(),
            &std::fs::read_to_string(dir.join(format!("{name}.out"))).unwrap(),
        );
        let mut pass = 0;
        for (text, want) in &tests {
            let got = tok.encode_with(text, false, false);
            if &got == want {
                pass += 1;
            } else {
                failures.push(format!(
                    "{key}: {text:?}\n   llama.cpp {want:?}\n   ours      {got:?}"
                ));
            }
        }
        eprintln!("{key:16} {pass}/{} texts", tests.len());
    }
    assert!(
        failures.is_empty(),
        "{} texts differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Where llama.cpp departs from a plain reading of the vocabulary, deliberately followed
/// (tests/data/tokenizer/llamacpp_vocab_extra.json, recorded by scripts/reference/vocab_reference.py):
/// Phi-3's special tokens drop the whitespace after them, and characters added in Unicode 16 are in
/// no category (llama.cpp's tables predate them).
#[test]
fn phi3_strips_after_special_tokens_and_unicode_16_characters_have_no_category() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tokenizer/llamacpp_vocab_extra.json");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let models = match std::env::var_os("TINYGPT_MODELS_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/models"),
    };
    let vocab = suite_dir();
    let mut failures = Vec::new();
    for case in doc["cases"].as_array().unwrap() {
        let dir = if case["dir"] == "vocab" {
            &vocab
        } else {
            &models
        };
        let file = case["file"].as_str().unwrap();
        let gguf = GgufFile::open(dir.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let tok = Tokenizer::from_gguf(gguf.metadata()).unwrap();
        let text = case["text"].as_str().unwrap();
        let special = case["parse_special"].as_bool().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let got = tok.encode_with(text, false, special);
        if got != want {
            failures.push(format!(
                "{file} (parse_special {special}): {text:?}\n   llama.cpp {want:?}\n   ours      {got:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
