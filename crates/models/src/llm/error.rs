//! What can go wrong loading or running a GGUF model.

use tinygpt_formats::{FormatError, GgmlType};

/// Errors of the model runner. File problems keep the reader's own error (which names the field and
/// offset); everything the runner itself refuses says what it supports.
#[derive(Debug, thiserror::Error)]
pub enum LlmError {
    #[error(transparent)]
    Format(#[from] FormatError),

    #[error(transparent)]
    Kernel(#[from] tinygpt_kernels::Error),

    #[error(
        "unsupported model architecture '{0}' (general.architecture); this runner supports: {supported}",
        supported = super::config::Arch::ALL.map(super::config::Arch::name).join(", ")
    )]
    UnsupportedArch(String),

    #[error(
        "tensor '{tensor}' has ggml type {} ({}), which the model runner cannot use; supported: F32, \
         F16, BF16, Q8_0, Q5_0, Q6_K, Q4_0, Q4_1, Q4_K",
        *ggml_type as u32,
        ggml_type.name()
    )]
    UnsupportedTensorType { tensor: String, ggml_type: GgmlType },

    /// A feature of the file the runner does not implement (a rope scaling type, an extra tensor).
    #[error("unsupported: {0}")]
    Unsupported(String),

    /// Hyperparameters or tensor shapes that contradict each other.
    #[error("invalid model file: {0}")]
    Invalid(String),

    #[error(
        "{tokens} tokens do not fit the context: {used} of {limit} positions are in use (--ctx sets the limit)"
    )]
    ContextFull {
        tokens: usize,
        used: usize,
        limit: usize,
    },

    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },

    #[error("{0}")]
    Options(String),
}

pub type Result<T, E = LlmError> = std::result::Result<T, E>;
