//! The one error type of this crate.
//!
//! Every variant that comes from parsing carries enough context to find the problem in a hex dump: which
//! field was being read (`what`), at which absolute byte offset of the file, and what was expected.

use std::path::PathBuf;

use crate::ggml_type::GgmlType;

/// Anything that can go wrong reading, writing or converting GGUF data.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The OS's error on a path (said once: it is the message, not a source to repeat).
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },

    #[error("not a GGUF file: magic at offset 0 is {found:02x?}, expected \"GGUF\" (47 47 55 46)")]
    BadMagic { found: Vec<u8> },

    #[error(
        "unsupported GGUF version {version} at offset 4: expected 2 or 3{}",
        if *version == 1 {
            " (version 1 used 32-bit counts and is obsolete)"
        } else if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
            " (this looks like a big-endian GGUF file, which is not supported)"
        } else {
            ""
        }
    )]
    UnsupportedVersion { version: u32 },

    #[error(
        "truncated file: {what} at offset {offset} needs {needed} bytes but only {available} remain"
    )]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },

    #[error(
        "{what} at offset {offset}: count {count} of {min_elem_bytes}-byte items cannot fit in the {available} \
         bytes that remain in the file"
    )]
    CountTooLarge {
        what: String,
        offset: u64,
        count: u64,
        min_elem_bytes: u64,
        available: u64,
    },

    #[error("{what} at offset {offset}: {detail}")]
    Invalid {
        what: String,
        offset: u64,
        detail: String,
    },

    #[error("{what} at offset {offset}: unknown metadata value type {type_id} (expected 0..=12)")]
    UnknownValueType {
        what: String,
        offset: u64,
        type_id: u32,
    },

    #[error("tensor '{tensor}' at offset {offset}: unknown ggml type number {type_id}")]
    UnknownTensorType {
        tensor: String,
        offset: u64,
        type_id: u32,
    },

    #[error("duplicate metadata key '{key}' at offset {offset}")]
    DuplicateKey { key: String, offset: u64 },

    #[error("duplicate tensor name '{name}' at offset {offset}")]
    DuplicateTensor { name: String, offset: u64 },

    #[error(
        "tensor '{tensor}': data offset {offset} is not a multiple of the file's alignment {alignment}"
    )]
    MisalignedTensor {
        tensor: String,
        offset: u64,
        alignment: u64,
    },

    #[error(
        "tensor '{tensor}': data bytes {start}..{end} (absolute) lie past the end of the file ({file_len} bytes)"
    )]
    TensorOutOfBounds {
        tensor: String,
        start: u64,
        end: u64,
        file_len: u64,
    },

    #[error("tensor '{tensor}': {detail}")]
    TensorShape { tensor: String, detail: String },

    #[error("metadata key '{key}' not found")]
    MissingKey { key: String },

    #[error("metadata key '{key}' has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },

    #[error("tensor '{name}' not found")]
    MissingTensor { name: String },

    #[error(
        "tensor '{tensor}': ggml type {} ({}) is not supported for {operation}",
        *ggml_type as u32,
        ggml_type.name()
    )]
    UnsupportedType {
        tensor: String,
        ggml_type: GgmlType,
        operation: &'static str,
    },

    #[error("tensor '{tensor}': expected {expected} bytes of data, got {found}")]
    DataSize {
        tensor: String,
        expected: u64,
        found: u64,
    },

    #[error("quantizing to {}: {detail}", ggml_type.name())]
    Quantize { ggml_type: GgmlType, detail: String },

    #[error("writing GGUF: {detail}")]
    Write { detail: String },
}

impl FormatError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        FormatError::Io {
            path: path.into(),
            err: source,
        }
    }
}
