//! The plain description a [`Tokenizer`](super::Tokenizer) is built from, and its extraction from GGUF
//! metadata.

use std::fmt;
use std::str::FromStr;

use tinygpt_formats::{Metadata, MetadataArray, MetadataValue};

use super::TokenizerError;

/// The tokenization algorithm (`tokenizer.ggml.model`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenizerModel {
    /// `gpt2`: byte-level BPE with merge ranks and a regex pre-tokenizer (SmolLM2, Llama 3, ...).
    Gpt2,
    /// `llama`: SentencePiece-style BPE driven by token scores, with `<0xNN>` byte fallback (Llama 2,
    /// Gemma 3, ...).
    Llama,
}

impl TokenizerModel {
    pub fn as_str(self) -> &'static str {
        match self {
            TokenizerModel::Gpt2 => "gpt2",
            TokenizerModel::Llama => "llama",
        }
    }
}

impl fmt::Display for TokenizerModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TokenizerModel {
    type Err = TokenizerError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "gpt2" => Ok(TokenizerModel::Gpt2),
            "llama" => Ok(TokenizerModel::Llama),
            other => Err(TokenizerError::UnsupportedModel(other.to_string())),
        }
    }
}

/// Everything a tokenizer is made of, as GGUF stores it. `None` means "absent from the file": the
/// tokenizer then applies llama.cpp's default for the model type (for example SentencePiece adds BOS
/// and a space prefix unless told otherwise).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizerSpec {
    pub model: TokenizerModel,
    /// `tokenizer.ggml.pre`: the BPE pre-tokenizer (regex set) name; ignored for `llama`.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub scores: Option<Vec<f32>>,
    /// llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    pub token_types: Option<Vec<i32>>,
    /// BPE merges, "left right", in rank order.
    pub merges: Option<Vec<String>>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub eot_id: Option<u32>,
    pub eom_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub sep_id: Option<u32>,
    pub pad_id: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
    pub chat_template: Option<String>,
    /// `general.name`: llama.cpp sets some token attributes by model name (Phi-3's special tokens
    /// drop the whitespace after them).
    pub model_name: Option<String>,
}

impl TokenizerSpec {
    /// A spec with only the model and the vocabulary set.
    pub fn new(model: TokenizerModel, tokens: Vec<String>) -> Self {
        TokenizerSpec {
            model,
            pre: None,
            tokens,
            scores: None,
            token_types: None,
            merges: None,
            bos_id: None,
            eos_id: None,
            eot_id: None,
            eom_id: None,
            unk_id: None,
            sep_id: None,
            pad_id: None,
            add_bos: None,
            add_eos: None,
            add_space_prefix: None,
            chat_template: None,
            model_name: None,
        }
    }

    /// Reads the `tokenizer.*` keys of a GGUF file's metadata.
    pub fn from_gguf(metadata: &Metadata) -> Result<Self, TokenizerError> {
        let model: TokenizerModel = metadata.get_str("tokenizer.ggml.model")?.parse()?;
        let tokens = metadata.get_str_array("tokenizer.ggml.tokens")?.to_vec();
        let scores = read_scores(metadata)?;
        let token_types = metadata
            .get_opt::<&[i32]>("tokenizer.ggml.token_type")?
            .map(<[i32]>::to_vec);
        let merges = metadata
            .get_opt::<&[String]>("tokenizer.ggml.merges")?
            .map(<[String]>::to_vec);
        let id = |key: &str| metadata.get_opt::<u32>(key);
        let flag = |key: &str| metadata.get_opt::<bool>(key);
        Ok(TokenizerSpec {
            model,
            pre: metadata
                .get_opt::<&str>("tokenizer.ggml.pre")?
                .map(str::to_string),
            tokens,
            scores,
            token_types,
            merges,
            bos_id: id("tokenizer.ggml.bos_token_id")?,
            eos_id: id("tokenizer.ggml.eos_token_id")?,
            eot_id: id("tokenizer.ggml.eot_token_id")?,
            eom_id: id("tokenizer.ggml.eom_token_id")?,
            unk_id: id("tokenizer.ggml.unknown_token_id")?,
            // The key's spelling is llama.cpp's.
            sep_id: id("tokenizer.ggml.seperator_token_id")?,
            pad_id: id("tokenizer.ggml.padding_token_id")?,
            add_bos: flag("tokenizer.ggml.add_bos_token")?,
            add_eos: flag("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix")?,
            chat_template: metadata
                .get_opt::<&str>("tokenizer.chat_template")?
                .map(str::to_string),
            model_name: metadata
                .get_opt::<&str>("general.name")?
                .map(str::to_string),
        })
    }
}

/// Scores are f32 in practice; llama.cpp also accepts i32 arrays.
fn read_scores(metadata: &Metadata) -> Result<Option<Vec<f32>>, TokenizerError> {
    const KEY: &str = "tokenizer.ggml.scores";
    match metadata.get(KEY) {
        None => Ok(None),
        Some(MetadataValue::Array(MetadataArray::F32(v))) => Ok(Some(v.clone())),
        Some(MetadataValue::Array(MetadataArray::I32(v))) => {
            Ok(Some(v.iter().map(|&s| s as f32).collect()))
        }
        Some(other) => Err(TokenizerError::InvalidMetadata {
            key: KEY,
            message: format!(
                "expected an array of f32 or i32, found {}",
                other.type_description()
            ),
        }),
    }
}
