use thiserror::Error;

/// Why a tokenizer could not be built, or a request could not be served.
#[derive(Debug, Error)]
pub enum TokenizerError {
    #[error(
        "unsupported tokenizer model {0:?} (supported: \"gpt2\" byte-level BPE, \"llama\" SentencePiece)"
    )]
    UnsupportedModel(String),

    #[error(
        "unsupported BPE pre-tokenizer {0:?} (supported: default, gpt-2, smollm, llama3 and their aliases)"
    )]
    UnsupportedPreTokenizer(String),

    #[error("the vocabulary is empty")]
    EmptyVocab,

    #[error("{what} has {got} entries but the vocabulary has {expected} tokens")]
    LengthMismatch {
        what: &'static str,
        got: usize,
        expected: usize,
    },

    #[error("a BPE (gpt2) tokenizer needs merges (tokenizer.ggml.merges)")]
    MissingMerges,

    #[error("token id {id} is out of range (vocabulary of {n_vocab} tokens)")]
    TokenOutOfRange { id: u32, n_vocab: usize },

    #[error("pre-tokenizer regex {pattern:?} failed to compile: {message}")]
    Regex { pattern: String, message: String },

    #[error("GGUF tokenizer metadata: {0}")]
    Metadata(#[from] tinygpt_formats::FormatError),

    #[error("GGUF tokenizer metadata: {key}: {message}")]
    InvalidMetadata { key: &'static str, message: String },
}
