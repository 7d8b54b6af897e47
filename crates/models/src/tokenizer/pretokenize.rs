//! BPE pre-tokenization: the regex splits llama.cpp applies before merging, chosen by
//! `tokenizer.ggml.pre`.
//!
//! llama.cpp applies its regexes in sequence: each one re-splits every piece the previous ones made,
//! and text a regex does not match is kept as pieces of its own (so nothing is ever dropped). Its
//! hand-written matchers for the common expressions follow the regex semantics; we run the
//! expressions themselves with `fancy-regex` (pure Rust, so it builds for wasm32), which is needed for
//! the `\s+(?!\S)` look-ahead.

use fancy_regex::Regex;

use super::TokenizerError;

/// GPT-2's expression (without its final `|\s+` alternative, as llama.cpp writes it: whitespace the
/// expression leaves unmatched becomes a piece of its own anyway).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's expression, with the case-insensitive group spelled out as llama.cpp does.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a pre-tokenizer name configures the BPE tokenizer (mirrors llama.cpp's `llama_vocab::load`).
pub(crate) struct PreTokenizerConfig {
    pub regexes: &'static [&'static str],
    /// Whole pre-tokenized words found in the vocabulary are emitted without merging.
    pub ignore_merges: bool,
    /// Detokenization removes the spaces that tokenization conventions put before punctuation.
    pub clean_spaces: bool,
    /// The default for `add_bos` when the file does not say.
    pub add_bos_default: bool,
}

pub(crate) fn config_for(pre: Option<&str>) -> Result<PreTokenizerConfig, TokenizerError> {
    let base = PreTokenizerConfig {
        regexes: &[],
        ignore_merges: false,
        clean_spaces: true,
        add_bos_default: false,
    };
    let config = match pre.unwrap_or("default") {
        // llama.cpp warns that a missing name degrades quality and uses its default set.
        "default" => PreTokenizerConfig {
            regexes: &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
            ..base
        },
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" | "mpt" | "olmo" | "jais" | "trillion"
        | "granite-docling" => PreTokenizerConfig {
            regexes: &[GPT2],
            ..base
        },
        // SmolLM isolates every digit before the GPT-2 split.
        "smollm" => PreTokenizerConfig {
            regexes: &[r"\p{N}", GPT2],
            clean_spaces: false,
            ..base
        },
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" => PreTokenizerConfig {
            regexes: &[LLAMA3],
            ignore_merges: true,
            add_bos_default: true,
            ..base
        },
        other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
    };
    Ok(config)
}

/// A compiled sequence of splitting regexes.
pub(crate) struct PreTokenizer {
    regexes: Vec<Regex>,
}

impl PreTokenizer {
    pub fn new(patterns: &[&str]) -> Result<Self, TokenizerError> {
        let regexes = patterns
            .iter()
            .map(|&pattern| {
                Regex::new(pattern).map_err(|e| TokenizerError::Regex {
                    pattern: pattern.to_string(),
                    message: e.to_string(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(PreTokenizer { regexes })
    }

    /// Splits `text` into words; the concatenation of the words is `text`.
    pub fn split<'a>(&self, text: &'a str) -> Vec<&'a str> {
        let mut pieces = vec![text];
        for regex in &self.regexes {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for piece in pieces {
                split_one(regex, piece, &mut next);
            }
            pieces = next;
        }
        pieces.retain(|p| !p.is_empty());
        pieces
    }
}

/// Matches and the gaps between them, in order. Each piece is matched on its own, so a look-ahead
/// never sees past the piece (as in llama.cpp).
fn split_one<'a>(regex: &Regex, piece: &'a str, out: &mut Vec<&'a str>) {
    let mut last = 0;
    for found in regex.find_iter(piece) {
        match found {
            Ok(m) => {
                if m.start() > last {
                    out.push(&piece[last..m.start()]);
                }
                if m.end() > m.start() {
                    out.push(m.as_str());
                }
                last = m.end();
            }
            // Only the backtracking limit can stop these expressions, on pathological input; the
            // unsplit rest is then tokenized as one word, which is slower but still lossless.
            Err(_) => break,
        }
    }
    if last < piece.len() {
        out.push(&piece[last..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(pre: &str, text: &str) -> Vec<String> {
        let config = config_for(Some(pre)).unwrap();
        let pre = PreTokenizer::new(config.regexes).unwrap();
        pre.split(text).into_iter().map(str::to_string).collect()
    }

    #[test]
    fn smollm_isolates_digits_and_keeps_whitespace_runs() {
        assert_eq!(
            split("smollm", "abc  12 x's\n\n  y"),
            ["abc", "  ", "1", "2", " x", "'s", "\n\n ", " y"]
        );
    }

    #[test]
    fn gpt2_splits_words_numbers_and_punctuation() {
        assert_eq!(
            split("gpt-2", "Hello, world 2026!!"),
            ["Hello", ",", " world", " 2026", "!!"]
        );
    }

    #[test]
    fn llama3_groups_digits_by_three() {
        assert_eq!(split("llama3", "x 12345"), ["x", " ", "123", "45"]);
    }

    #[test]
    fn unknown_pre_tokenizer_is_an_error() {
        assert!(matches!(
            config_for(Some("nope")),
            Err(TokenizerError::UnsupportedPreTokenizer(_))
        ));
    }
}
