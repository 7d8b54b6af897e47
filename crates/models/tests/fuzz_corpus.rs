//! The fuzz targets' committed corpora (fuzz/corpus/TARGET/, minimised by `cargo fuzz cmin`), replayed
//! through the same code as ordinary tests: every input that once found new coverage still runs clean.

use std::path::PathBuf;

use tinygpt_models::fuzzing;

fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let p = e.unwrap().path();
            (p.display().to_string(), std::fs::read(&p).unwrap())
        })
        .collect();
    v.sort();
    assert!(!v.is_empty(), "{} is empty", dir.display());
    v
}

fn replay(target: &str, f: impl Fn(&[u8])) {
    for (name, data) in corpus(target) {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&data)));
        assert!(r.is_ok(), "{target}: {name} panics");
    }
}

#[test]
fn gguf_corpus_replays_clean() {
    replay("gguf", fuzzing::gguf);
}

#[test]
fn checkpoint_corpus_replays_clean() {
    replay("checkpoint", fuzzing::checkpoint);
}

#[test]
fn chat_template_corpus_replays_clean() {
    replay("chat_template", fuzzing::chat_template);
}

#[test]
fn tokenizer_corpus_replays_clean() {
    let toks = fuzzing::tokenizers();
    replay("tokenizer", |d| {
        for t in &toks {
            fuzzing::tokenizer(t, d);
        }
    });
}
