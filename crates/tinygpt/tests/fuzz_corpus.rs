//! The `http` fuzz target's committed corpus (fuzz/corpus/http/, minimised by `cargo fuzz cmin`),
//! replayed through the same code as an ordinary test: every request that once found new coverage is
//! still answered without a panic, a stray 5xx or a non-OpenAI error body.

use std::path::PathBuf;

#[test]
fn http_corpus_replays_clean() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/http");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} is empty", dir.display());
    for p in files {
        let data = std::fs::read(&p).unwrap();
        let r = std::panic::catch_unwind(|| tinygpt::serve::fuzzing::request(&data));
        assert!(r.is_ok(), "http: {} panics", p.display());
    }
}
