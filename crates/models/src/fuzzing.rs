//! The fuzz targets' bodies (`fuzz/`, cargo-fuzz), here so the committed corpora replay through the
//! same code as ordinary tests (`tests/fuzz_corpus.rs`). Each takes untrusted bytes and must return
//! without panicking, hanging or allocating beyond what the input's size justifies; where an invariant
//! holds for every input (a tokenizer's round trip), it is asserted.

use std::path::Path;

use tinygpt_formats::GgufFile;

use crate::chat_template::ChatTemplate;
use crate::gpt::checkpoint::{CheckpointFiles, decode};
use crate::llm::LlmConfig;
use crate::tokenizer::{DecodeOptions, Tokenizer};

/// A GGUF file: the header and tensor table (every tensor's shape, type and extent checked against
/// the file), the model config read from it, and the first tensors' data dequantized.
pub fn gguf(data: &[u8]) {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    let _ = LlmConfig::from_gguf(&file);
    for t in file.tensors().iter().take(4) {
        if let Ok(bytes) = file.tensor_data(t)
            && bytes.len() <= 1 << 20
        {
            let _ = tinygpt_formats::tensor::dequantize_tensor(t, bytes);
        }
    }
}

/// A checkpoint: the first two bytes give config.json's length, then config.json, then the rest is
/// model.safetensors.
pub fn checkpoint(data: &[u8]) {
    if data.len() < 2 {
        return;
    }
    let n = (u16::from_le_bytes([data[0], data[1]]) as usize).min(data.len() - 2);
    let files = CheckpointFiles {
        config: data[2..2 + n].to_vec(),
        model: data[2 + n..].to_vec(),
        optimizer: None,
        state: None,
    };
    let _ = decode(Path::new("fuzz"), &files);
}

/// A chat template from the input, rendered over a short conversation (untrusted templates come
/// inside GGUF files).
pub fn chat_template(data: &[u8]) {
    let Ok(src) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(t) = ChatTemplate::new(src) else {
        return;
    };
    let messages = [
        ("system", "Be brief."),
        ("user", "Hello {{ there }}"),
        ("assistant", "Hi."),
        ("user", "Bye"),
    ];
    let _ = t.with_time(0).render(&messages, true, "<s>", "</s>");
}

/// A tokenizer over the input as text (encode, then decode whole and streaming: both give the text
/// back for a byte-level vocabulary) and as token ids (decoding any ids never panics).
pub fn tokenizer(tok: &Tokenizer, data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    // As plain text (special-token names stay text), so the round trip holds.
    let ids = tok.encode_with(&text, false, false);
    let whole = tok.decode(&ids).expect("the ids encode made decode");
    let mut stream = tok.stream_decoder(false);
    let mut streamed = String::new();
    for &id in &ids {
        streamed.push_str(&stream.push(id).expect("the ids encode made decode"));
    }
    streamed.push_str(&stream.finish());
    assert_eq!(streamed, whole, "streaming decode differs from decode");
    if tok.model() == crate::tokenizer::TokenizerModel::Gpt2
        && text
            .bytes()
            .all(|b| tok.token_id(&byte_char(b).to_string()).is_some())
    {
        // Byte-level BPE keeps every byte its vocabulary has a token for (a byte without one is
        // dropped, as llama.cpp drops it: SmolLM2's vocabulary lacks a few control bytes).
        assert_eq!(whole, text, "decode(encode(text)) != text");
    }
    let n = tok.n_vocab().max(1) as u32;
    let arbitrary: Vec<u32> = data
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32 % n)
        .collect();
    let _ = tok.decode(&arbitrary);
    let _ = tok.encode(&text, true);
    let _ = tok.decode_with(
        &arbitrary,
        DecodeOptions {
            remove_special: true,
            unparse_special: true,
        },
    );
}

/// The real models' tokenizers (SmolLM2's byte-level BPE, Gemma 3's SentencePiece), from the files
/// in `TINYGPT_MODELS_DIR` (default: the repository's .cache/models).
#[cfg(not(target_arch = "wasm32"))]
pub fn tokenizers() -> Vec<Tokenizer> {
    let dir = std::env::var_os("TINYGPT_MODELS_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache/models"),
        std::path::PathBuf::from,
    );
    [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gemma-3-270m-Q4_K_M.gguf",
    ]
    .iter()
    .map(|name| {
        let p = dir.join(name);
        let f = GgufFile::open(&p).unwrap_or_else(|e| {
            panic!("{e} (the tokenizer target reads the real models: scripts/fetch-models.sh)")
        });
        Tokenizer::from_gguf(f.metadata()).expect("the real models' tokenizers load")
    })
    .collect()
}

/// GPT-2's byte-to-character map (printable bytes stand for themselves, the others for 256 + n).
fn byte_char(b: u8) -> char {
    let printable = |x: u8| (33..=126).contains(&x) || (161..=172).contains(&x) || x >= 174;
    if printable(b) {
        return b as char;
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).expect("in range")
}
