//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

use tinygpt_formats::{GgmlType, TensorInfo};

pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GEMMA3: &str = "gemma-3-270m-Q4_K_M.gguf";

/// `$TINYGPT_MODELS_DIR`, or `<workspace root>/.cache/models`.
pub fn models_dir() -> PathBuf {
    match std::env::var_os("TINYGPT_MODELS_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/models"),
    }
}

/// Path of a real model file; panics (failing the test) with instructions when it is missing.
pub fn model_path(file: &str) -> PathBuf {
    let path = models_dir().join(file);
    assert!(
        path.is_file(),
        "model file {} is missing: run `scripts/fetch-models.sh` from the workspace root (or point \
         TINYGPT_MODELS_DIR at a directory holding {SMOLLM2} and {GEMMA3})",
        path.display()
    );
    path
}

/// The JSON reference file `name` under tests/data.
pub fn reference(name: &str) -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn ggml_type_named(name: &str) -> GgmlType {
    GgmlType::ALL
        .into_iter()
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("unknown type name {name}"))
}

/// A stand-alone tensor info for raw bytes (data at offset 0 of a buffer of its own).
pub fn info_for(name: &str, dims: &[u64], ggml_type: GgmlType) -> TensorInfo {
    let n: u64 = dims.iter().product();
    TensorInfo {
        name: name.to_string(),
        dims: dims.to_vec(),
        ggml_type,
        offset: 0,
        data_start: 0,
        n_bytes: ggml_type.bytes_for(n).expect("whole blocks"),
    }
}

pub fn hex_bytes(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect()
}

pub fn u32_list(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("u32") as u32)
        .collect()
}

pub fn f32_bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Asserts two f32 slices are bitwise equal, except that where `allow_zero_sign` both may be zeros of
/// different sign (the documented Q4_0 exception).
pub fn assert_same_bits(got: &[f32], want: &[f32], allow_zero_sign: bool, context: &str) {
    assert_eq!(got.len(), want.len(), "{context}: lengths differ");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let same = a.to_bits() == b.to_bits() || (allow_zero_sign && *a == 0.0 && *b == 0.0);
        assert!(
            same,
            "{context}: value {i}: {a:e} ({:#010x}) vs {b:e} ({:#010x})",
            a.to_bits(),
            b.to_bits()
        );
    }
}
