//! Tests against llama.cpp's recorded tokenizations of the real models (tests/data/tokenizer/, made
//! by scripts/reference/llamacpp_reference.py) and properties of the algorithms.

use std::path::PathBuf;
use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::Value;
use tinygpt_formats::GgufFile;

use super::*;

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const GEMMA3: &str = "gemma-3-270m-Q4_K_M.gguf";

fn models_dir() -> PathBuf {
    match std::env::var_os("TINYGPT_MODELS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/models"),
    }
}

/// The tokenizer of a real model file. A missing file fails the test: these tests are the proof
/// that our ids are llama.cpp's.
fn load(file: &str) -> Tokenizer {
    let path = models_dir().join(file);
    if !path.exists() {
        panic!(
            "{} is missing: run scripts/fetch-models.sh (or set TINYGPT_MODELS_DIR)",
            path.display()
        );
    }
    let gguf =
        GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: cannot read: {e}", path.display()));
    Tokenizer::from_gguf(gguf.metadata())
        .unwrap_or_else(|e| panic!("{}: tokenizer: {e}", path.display()))
}

fn smollm2() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| load(SMOLLM2))
}

fn gemma3() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| load(GEMMA3))
}

fn reference(model: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tokenizer")
        .join(format!("{model}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every recorded case: ids with and without BOS and special-token parsing, each token's piece, the
/// detokenized text, and the round trip where llama.cpp round-trips.
fn check_against_llamacpp(tokenizer: &Tokenizer, model: &str) {
    let reference = reference(model);
    assert_eq!(
        tokenizer.n_vocab() as u64,
        reference["n_vocab"].as_u64().unwrap()
    );
    assert_eq!(tokenizer.add_bos(), reference["add_bos"].as_bool().unwrap());
    assert_eq!(tokenizer.add_eos(), reference["add_eos"].as_bool().unwrap());
    assert_eq!(
        tokenizer.bos_id().map(i64::from),
        reference["bos_id"].as_i64().filter(|&v| v >= 0)
    );
    assert_eq!(
        tokenizer.eos_id().map(i64::from),
        reference["eos_id"].as_i64().filter(|&v| v >= 0)
    );
    assert_eq!(
        tokenizer.eog_ids().collect::<Vec<_>>(),
        ids(&reference["eog_ids"]),
        "end-of-generation ids"
    );

    let cases = reference["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let checks = [
            ("ids", tokenizer.encode_with(text, true, false)),
            ("ids_no_special", tokenizer.encode_with(text, false, false)),
            ("ids_parse_special", tokenizer.encode(text, true)),
        ];
        for (key, got) in checks {
            let want = ids(&case[key]);
            if got != want {
                failures.push(format!("{name} {key}:\n   ours {got:?}\n  llama {want:?}"));
            }
        }
        let want_ids = ids(&case["ids"]);
        let pieces: Vec<String> = want_ids
            .iter()
            .map(|&id| hex(tokenizer.token_to_piece(id, false).unwrap()))
            .collect();
        let want_pieces: Vec<String> = case["pieces_hex"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap().to_string())
            .collect();
        if pieces != want_pieces {
            failures.push(format!("{name} pieces: {pieces:?} vs {want_pieces:?}"));
        }
        let decoded = tokenizer
            .decode_with(&want_ids, DecodeOptions::default())
            .unwrap();
        if hex(&decoded) != case["decoded_hex"].as_str().unwrap() {
            failures.push(format!(
                "{name} decoded: {:?}",
                String::from_utf8_lossy(&decoded)
            ));
        }
        if case["round_trips"].as_bool().unwrap() {
            let ours = tokenizer
                .decode(&tokenizer.encode_with(text, true, false))
                .unwrap();
            if ours != text {
                failures.push(format!("{name} round trip: {ours:?}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{model}: {} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn smollm2_ids_match_llamacpp() {
    check_against_llamacpp(smollm2(), "smollm2");
}

#[test]
fn gemma3_ids_match_llamacpp() {
    check_against_llamacpp(gemma3(), "gemma3");
}

#[test]
fn metadata_of_the_real_models() {
    let s = smollm2();
    assert_eq!(s.model(), TokenizerModel::Gpt2);
    assert_eq!(s.pre(), Some("smollm"));
    assert!(!s.add_bos());
    assert_eq!(s.token_id("<|im_start|>"), Some(1));
    assert_eq!(s.token_id("<|im_end|>"), Some(2));
    assert!(s.is_eog(2) && s.is_control(1));
    assert!(
        s.chat_template()
            .is_some_and(|t| t.contains("<|im_start|>"))
    );

    let g = gemma3();
    assert_eq!(g.model(), TokenizerModel::Llama);
    assert!(g.add_bos());
    assert_eq!(g.bos_id(), Some(2));
    assert_eq!(g.eos_id(), Some(1));
    assert_eq!(g.special_tokens().eot, Some(106));
    assert!(g.is_eog(106) && g.is_eog(1));
    // "</s>" is a user-defined HTML tag in Gemma 3's vocabulary, made an end-of-generation control
    // token by llama.cpp's rules.
    assert!(g.is_eog(212) && g.is_control(212));
    assert_eq!(g.chat_template(), None);
}

#[test]
fn streaming_decode_holds_back_split_characters() {
    // Fraktur letters are outside Gemma's vocabulary (byte fallback); SmolLM's byte-level tokens
    // split most non-Latin characters.
    let text = "A 😀 and 🇫🇷, naïve 日本語 👨\u{200d}👩\u{200d}👧 𝔘𝔫𝔦𝔠𝔬𝔡𝔢";
    for tokenizer in [smollm2(), gemma3()] {
        let ids = tokenizer.encode_with(text, false, false);
        // At least one token must end inside a character, or the test proves nothing.
        let split = ids
            .iter()
            .any(|&id| std::str::from_utf8(tokenizer.token_to_piece(id, false).unwrap()).is_err());
        assert!(
            split,
            "{:?}: no token splits a character",
            tokenizer.model()
        );

        let mut stream = tokenizer.stream_decoder(false);
        let mut out = String::new();
        let mut held_back = false;
        for &id in &ids {
            let chunk = stream.push(id).unwrap();
            held_back |= !stream.pending().is_empty();
            out.push_str(&chunk);
        }
        out.push_str(&stream.finish());
        assert!(held_back);
        assert_eq!(out, text);
    }
}

#[test]
fn streaming_decode_replaces_bytes_that_cannot_complete() {
    let g = gemma3();
    let byte = |b: u8| g.token_id(&format!("<0x{b:02X}>")).unwrap();
    let mut stream = g.stream_decoder(false);
    // 0xF0 0x9F starts a 4-byte character; "A" cannot continue it.
    assert_eq!(stream.push(byte(0xF0)).unwrap(), "");
    assert_eq!(stream.push(byte(0x9F)).unwrap(), "");
    assert_eq!(stream.push(byte(b'A')).unwrap(), "\u{FFFD}A");
    assert_eq!(stream.push(byte(0xE6)).unwrap(), "");
    assert_eq!(stream.finish(), "\u{FFFD}");
}

#[test]
fn special_tokens_render_only_when_asked() {
    let s = smollm2();
    let ids = s.encode("<|im_start|>user\nHi<|im_end|>", false);
    assert_eq!(ids[0], 1);
    assert_eq!(s.decode(&ids).unwrap(), "user\nHi");
    let shown = DecodeOptions {
        unparse_special: true,
        ..DecodeOptions::default()
    };
    assert_eq!(
        s.decode_with(&ids, shown).unwrap(),
        b"<|im_start|>user\nHi<|im_end|>"
    );
    assert!(matches!(
        s.decode(&[49152]),
        Err(TokenizerError::TokenOutOfRange { id: 49152, .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Byte-level BPE is lossless for any text without special-token markup.
    #[test]
    fn bpe_round_trips_random_unicode(text in any::<String>()) {
        let s = smollm2();
        let ids = s.encode_with(&text, false, false);
        prop_assert_eq!(s.decode(&ids).unwrap(), text);
    }

    #[test]
    fn bpe_round_trips_random_ascii_soup(text in "[ a-zA-Z0-9'\\n\\t.,!?<>|_]{0,64}") {
        let s = smollm2();
        let ids = s.encode_with(&text, false, false);
        prop_assert_eq!(s.decode(&ids).unwrap(), text);
    }

    /// SentencePiece with byte fallback is lossless too, except for a literal "▁" (it stands for
    /// the space) and text that spells a control token.
    #[test]
    fn spm_encodes_random_unicode(text in any::<String>()) {
        let g = gemma3();
        let ids = g.encode(&text, true);
        prop_assert!(ids.iter().all(|&id| (id as usize) < g.n_vocab()));
        if !text.contains('▁') && !text.contains('<') {
            prop_assert_eq!(g.decode(&ids).unwrap(), text);
        }
    }
}

/// A tiny SentencePiece vocabulary: merges follow scores, unknown characters fall back to bytes.
#[test]
fn spm_merges_by_score_and_falls_back_to_bytes() {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>", "▁", "a", "b", "ab", "▁a", "▁ab"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut types = vec![2, 3, 3, 1, 1, 1, 1, 1, 1];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let mut scores = vec![0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -3.0, -4.0, -1.5];
    scores.resize(tokens.len(), 0.0);
    let mut spec = TokenizerSpec::new(TokenizerModel::Llama, tokens);
    spec.scores = Some(scores);
    spec.token_types = Some(types);
    let t = Tokenizer::new(spec).unwrap();
    // Default SentencePiece settings: BOS, and a space prefix.
    assert_eq!(t.encode("ab", true), [1, 8]);
    // "é" is not in the vocabulary: its two UTF-8 bytes.
    assert_eq!(t.encode("é", false), [3, 9 + 0xC3, 9 + 0xA9]);
    // As in llama.cpp, the prefixed space is dropped only from a first token that is not BOS
    // (removing BOS with `remove_special` keeps the space, as llama.cpp's detokenize does).
    let ids = t.encode("ab é", true);
    assert_eq!(t.decode(&ids).unwrap(), " ab é");
    let options = DecodeOptions {
        remove_special: true,
        ..DecodeOptions::default()
    };
    assert_eq!(t.decode_with(&ids, options).unwrap(), b" ab \xC3\xA9");
    assert_eq!(t.decode(&ids[1..]).unwrap(), "ab é");
}

/// A tiny byte-level BPE vocabulary: lower rank merges first.
#[test]
fn bpe_applies_merges_by_rank() {
    let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc", "Ġ", "Ġa"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut spec = TokenizerSpec::new(TokenizerModel::Gpt2, tokens);
    spec.pre = Some("gpt-2".into());
    spec.merges = Some(vec![
        "b c".into(),
        "a b".into(),
        "a bc".into(),
        "Ġ a".into(),
    ]);
    let t = Tokenizer::new(spec).unwrap();
    // "b c" outranks "a b", so "abc" is a + bc, then "a bc".
    assert_eq!(t.encode("abc", false), [5]);
    assert_eq!(t.encode("ab a", false), [3, 7]);
    assert!(matches!(
        Tokenizer::new(TokenizerSpec::new(TokenizerModel::Gpt2, vec!["a".into()])),
        Err(TokenizerError::MissingMerges)
    ));
}

/// Generation threads share one tokenizer.
#[test]
fn tokenizer_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<crate::chat_template::ChatTemplate>();
}
