//! Helpers the binary's integration tests share.

use std::path::PathBuf;

/// Where scripts/fetch-models.sh puts the real GGUF models (`TINYGPT_MODELS_DIR` overrides).
pub fn models_dir() -> PathBuf {
    std::env::var_os("TINYGPT_MODELS_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/models"),
        PathBuf::from,
    )
}

/// SmolLM2-135M-Instruct Q4_1; a missing file fails the test rather than skipping it.
pub fn smollm2() -> PathBuf {
    let p = models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh",
        p.display()
    );
    p
}
