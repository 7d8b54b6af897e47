//! BPE pre-tokenization: the regex splits llama.cpp applies before merging, chosen by
//! `tokenizer.ggml.pre`.
//!
//! llama.cpp applies its regexes in sequence: each one re-splits every piece the previous ones made,
//! and text a regex does not match is kept as pieces of its own (so nothing is ever dropped). Its
//! hand-written matchers for the common expressions follow the regex semantics; we run the
//! expressions themselves with `fancy-regex` (pure Rust, so it builds for wasm32), which is needed for
//! the `\s+(?!\S)` look-ahead.

use std::sync::OnceLock;

use fancy_regex::Regex;

use super::TokenizerError;
use super::llama_unicode::UNDEFINED;

/// GPT-2's expression (without its final `|\s+` alternative, as llama.cpp writes it: whitespace the
/// expression leaves unmatched becomes a piece of its own anyway).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's expression, with the case-insensitive group spelled out as llama.cpp does.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's: Llama 3's with single digits.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen3.5's: Qwen2's with combining marks (\p{M}) kept inside words.
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek LLM's sequence: line breaks, Latin/Greek/Cyrillic/... letter runs (an explicit range
/// list), ASCII and full-width punctuation runs, trailing whitespace, CJK and Hangul runs, digit runs.
const DEEPSEEK_LLM: &[&str] = &[
    "[\r\n]",
    "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+",
    "\\s?[!-/:-~\u{ff01}-\u{ff0f}\u{ff1a}-\u{ff5e}\u{2018}-\u{201f}\u{3000}-\u{3002}]+",
    "\\s+$",
    "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+",
    "\\p{N}+",
];

/// DeepSeek Coder's sequence.
const DEEPSEEK_CODER: &[&str] = &[
    "[\r\n]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+",
    "\\p{N}",
];

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
        // SmolLM (and StarCoder's kind) isolates every digit before the GPT-2 split.
        "smollm" | "command-r" => PreTokenizerConfig {
            regexes: &[r"\p{N}", GPT2],
            clean_spaces: false,
            ..base
        },
        "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" => PreTokenizerConfig {
            regexes: &[r"\p{N}", GPT2],
            ..base
        },
        "falcon" => PreTokenizerConfig {
            regexes: &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"],
            ..base
        },
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "hunyuan" | "solar-open" => {
            PreTokenizerConfig {
                regexes: &[QWEN2],
                clean_spaces: false,
                ..base
            }
        }
        "stablelm2" | "megrez" => PreTokenizerConfig {
            regexes: &[QWEN2],
            ..base
        },
        "qwen35" => PreTokenizerConfig {
            regexes: &[QWEN35],
            clean_spaces: false,
            ..base
        },
        "deepseek-llm" => PreTokenizerConfig {
            regexes: DEEPSEEK_LLM,
            clean_spaces: false,
            ..base
        },
        "deepseek-coder" => PreTokenizerConfig {
            regexes: DEEPSEEK_CODER,
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

/// The class of code points llama.cpp's Unicode tables leave undefined, in regex syntax.
fn undefined_class() -> &'static str {
    static CLASS: OnceLock<String> = OnceLock::new();
    CLASS.get_or_init(|| {
        let mut class = String::from("[");
        for &(start, end) in UNDEFINED {
            // Surrogates are no characters (and no regex may name them).
            for (s, e) in [(start, end.min(0xD7FF)), (start.max(0xE000), end)] {
                if s <= e {
                    class.push_str(&format!("\\x{{{s:X}}}-\\x{{{e:X}}}"));
                }
            }
        }
        class.push(']');
        class
    })
}

/// `pattern` with every Unicode category it names (`\p{L}` and the like) restricted to the code points
/// llama.cpp's tables define. Its tables predate Unicode 16, so the thousands of characters added since
/// are in no category for llama.cpp, while the regex crate's tables class them as letters, numbers or
/// symbols; without this, text holding them would split (and tokenize) differently.
pub(crate) fn llama_categories(pattern: &str) -> String {
    let mut out = pattern.to_string();
    for cat in ["L", "N", "P", "S", "M"] {
        let name = format!("\\p{{{cat}}}");
        out = out.replace(&name, &format!("[{name}--{}]", undefined_class()));
    }
    out
}

impl PreTokenizer {
    pub fn new(patterns: &[&str]) -> Result<Self, TokenizerError> {
        let regexes = patterns
            .iter()
            .map(|&pattern| {
                Regex::new(&llama_categories(pattern)).map_err(|e| TokenizerError::Regex {
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
