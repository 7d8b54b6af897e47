//! A TinyGPT checkpoint as a GGUF file of llama.cpp's `gpt2` architecture, so llama.cpp (and what is
//! built on it: Ollama, LM Studio) and TinyGPT's own GGUF runner run the model.
//!
//! The model maps one to one: learned token and position embeddings, pre-LayerNorm blocks with one
//! fused Q/K/V matrix, a GELU (tanh) MLP, a final LayerNorm and a head tied to the token embedding.
//! llama.cpp's `gpt2` requires a bias on every norm and projection; TinyGPT's model has none, so they
//! are written as zeros (adding zero changes no value).
//!
//! **Vocabulary.** The characters become a byte-level BPE vocabulary (`tokenizer.ggml.model = gpt2`),
//! each character one token written in GPT-2's byte alphabet. A character of one UTF-8 byte needs no
//! merge; a character of n bytes gets the n − 1 merges that join its bytes left to right, so it becomes
//! its one token again (merges never cross characters: a merge's left side always starts with a lead
//! byte, its right side is a continuation byte). Any Unicode character works.
//!
//! **End of text.** llama.cpp always has an end-of-generation token: for a `gpt2` vocabulary without
//! one it takes id 11, which here would be a character, and generation would stop at it. So the file
//! adds one control token `<|endoftext|>` after the characters (id = vocabulary size) and makes sure the
//! model never predicts it: its logit is computed as w · (n ∘ g + b), where n is the normalised final
//! hidden state (which sums to zero), g the final LayerNorm's weight and b its bias. With w = k / g
//! the first term is k · Σ n = 0 for every input; b is chosen in the null space of the characters' rows
//! (so no character's logit changes) and such that w · b is a large negative number. The characters'
//! logits stay what TinyGPT computes; the end-of-text logit is about −1000 at every position. When the
//! null space is empty (a vocabulary at least as large as the width) the row is zero instead: its
//! logit is then 0, and llama.cpp may end a generation early — [`GgufExport::eos_logit`] says which.

use tinygpt_formats::{
    FormatError, GgmlType, GgufWriter, MetadataArray, MetadataValue, dequantize_bytes, quantize,
};

use super::block::EPS;
use super::checkpoint::CheckpointConfig;
use super::layout::Layout;
use crate::tokenizer::byte_level_char;

/// How the matrices are stored (norms and biases are always F32, as llama.cpp's converter writes them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufWeights {
    F32,
    F16,
    /// 8-bit blocks of 32 with an f16 scale (llama.cpp's Q8_0); needs a width that is a multiple of 32.
    Q8_0,
}

impl GgufWeights {
    fn ggml(self) -> GgmlType {
        match self {
            GgufWeights::F32 => GgmlType::F32,
            GgufWeights::F16 => GgmlType::F16,
            GgufWeights::Q8_0 => GgmlType::Q8_0,
        }
    }

    /// llama.cpp's `general.file_type` (`llama_ftype`).
    fn file_type(self) -> u32 {
        match self {
            GgufWeights::F32 => 0,
            GgufWeights::F16 => 1,
            GgufWeights::Q8_0 => 7,
        }
    }
}

/// The end-of-text token's text.
pub const EOS_TOKEN: &str = "<|endoftext|>";

/// Target logit of the end-of-text token (see the module documentation).
const EOS_LOGIT: f64 = -1000.0;

/// The bias's length relative to the final LayerNorm weight's: small next to the normalised
/// activations, so it adds next to nothing to the rounding of a product that converts them (f16, Q8_0).
const BIAS_SCALE: f64 = 0.01;

/// A file ready to write, and what it does with the end-of-text token.
pub struct GgufExport {
    pub writer: GgufWriter,
    /// The end-of-text token's logit at every position, up to the stored weights' rounding: about −1000,
    /// or 0 when the vocabulary leaves no room for the construction (see the module documentation).
    pub eos_logit: f32,
}

/// Why a checkpoint cannot be exported.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("{0}")]
    Unsupported(String),
    #[error(transparent)]
    Format(#[from] FormatError),
}

/// The GGUF file of `params` (in [`Layout`] order) for `config`.
pub fn to_gguf(
    config: &CheckpointConfig,
    params: &[f32],
    weights: GgufWeights,
    name: &str,
) -> Result<GgufExport, ExportError> {
    let cfg = &config.model;
    let (v, c, t) = (cfg.vocab_size, cfg.n_embd, cfg.block_size);
    let layout = Layout::new(cfg);
    if params.len() != layout.total {
        return Err(ExportError::Unsupported(format!(
            "the parameters hold {} values; the config needs {}",
            params.len(),
            layout.total
        )));
    }
    let mt = weights.ggml();
    if !c.is_multiple_of(mt.block_size()) {
        return Err(ExportError::Unsupported(format!(
            "{} stores rows in blocks of {}; this model is {c} wide: export it as F16 or F32",
            mt.name(),
            mt.block_size()
        )));
    }
    let get = |off: usize, n: usize| &params[off..off + n];
    let mut w = GgufWriter::new();
    let arch = "gpt2";
    let k = |s: &str| format!("{arch}.{s}");
    w.add_metadata("general.architecture", arch)?;
    w.add_metadata("general.name", name)?;
    w.add_metadata("general.file_type", weights.file_type())?;
    w.add_metadata(k("context_length"), t as u32)?;
    w.add_metadata(k("embedding_length"), c as u32)?;
    w.add_metadata(k("feed_forward_length"), (4 * c) as u32)?;
    w.add_metadata(k("block_count"), cfg.n_layer as u32)?;
    w.add_metadata(k("attention.head_count"), cfg.n_head as u32)?;
    w.add_metadata(k("attention.layer_norm_epsilon"), EPS)?;
    vocabulary(&mut w, config)?;

    // Token embedding: the characters' rows as stored, then the end-of-text row.
    let chars = quantize(mt, get(layout.wte(), v * c))?;
    let stored = dequantize_bytes(mt, &chars, v * c)?;
    let ln_f = get(layout.ln_f(), c);
    let (eos_row, ln_f_bias, eos_logit) = match end_of_text(&stored, v, ln_f) {
        Some(e) => (e.row, e.bias, EOS_LOGIT as f32),
        None => (vec![0.0; c], vec![0.0; c], 0.0),
    };
    let mut embd = chars;
    embd.extend(quantize(mt, &eos_row)?);
    let (c64, v1) = (c as u64, (v + 1) as u64);
    w.add_tensor_bytes("token_embd.weight", &[c64, v1], mt, embd)?;
    w.add_tensor_f32(
        "position_embd.weight",
        &[c64, t as u64],
        mt,
        get(layout.wpe(), t * c),
    )?;
    let zeros = vec![0.0f32; 4 * c];
    let f32v = |w: &mut GgufWriter, name: String, v: &[f32]| {
        w.add_tensor_f32(name, &[v.len() as u64], GgmlType::F32, v)
    };
    for l in 0..cfg.n_layer {
        let b = layout.block(l);
        let n = |s: &str| format!("blk.{l}.{s}");
        f32v(&mut w, n("attn_norm.weight"), get(b.ln_1, c))?;
        f32v(&mut w, n("attn_norm.bias"), &zeros[..c])?;
        w.add_tensor_f32(
            n("attn_qkv.weight"),
            &[c64, 3 * c64],
            mt,
            get(b.c_attn, 3 * c * c),
        )?;
        f32v(&mut w, n("attn_qkv.bias"), &zeros[..3 * c])?;
        w.add_tensor_f32(
            n("attn_output.weight"),
            &[c64, c64],
            mt,
            get(b.attn_proj, c * c),
        )?;
        f32v(&mut w, n("attn_output.bias"), &zeros[..c])?;
        f32v(&mut w, n("ffn_norm.weight"), get(b.ln_2, c))?;
        f32v(&mut w, n("ffn_norm.bias"), &zeros[..c])?;
        w.add_tensor_f32(
            n("ffn_up.weight"),
            &[c64, 4 * c64],
            mt,
            get(b.c_fc, 4 * c * c),
        )?;
        f32v(&mut w, n("ffn_up.bias"), &zeros[..4 * c])?;
        w.add_tensor_f32(
            n("ffn_down.weight"),
            &[4 * c64, c64],
            mt,
            get(b.mlp_proj, 4 * c * c),
        )?;
        f32v(&mut w, n("ffn_down.bias"), &zeros[..c])?;
    }
    f32v(&mut w, "output_norm.weight".into(), ln_f)?;
    f32v(&mut w, "output_norm.bias".into(), &ln_f_bias)?;
    Ok(GgufExport {
        writer: w,
        eos_logit,
    })
}

/// The characters as a byte-level BPE vocabulary, plus the end-of-text control token.
fn vocabulary(w: &mut GgufWriter, config: &CheckpointConfig) -> Result<(), FormatError> {
    let chars = &config.vocab.chars;
    let mut tokens: Vec<String> = Vec::with_capacity(chars.len() + 1);
    let mut merges: Vec<String> = Vec::new();
    for &ch in chars {
        let mut buf = [0u8; 4];
        let bytes = ch.encode_utf8(&mut buf).as_bytes();
        let mut prefix = String::new();
        for (i, &b) in bytes.iter().enumerate() {
            let next = byte_level_char(b).to_string();
            if i > 0 {
                merges.push(format!("{prefix} {next}"));
            }
            prefix.push_str(&next);
        }
        tokens.push(prefix);
    }
    // Characters sharing leading bytes share merges; keep each once, first occurrence first.
    let mut seen = std::collections::HashSet::new();
    merges.retain(|m| seen.insert(m.clone()));
    add_byte_level_vocabulary(w, tokens, merges)
}

/// Writes a byte-level BPE ("gpt2") vocabulary: `tokens` (normal tokens, in byte-level characters) and
/// `merges` in rank order, then [`EOS_TOKEN`] as the control token that begins and ends a text (never
/// added by the tokenizer).
pub fn add_byte_level_vocabulary(
    w: &mut GgufWriter,
    mut tokens: Vec<String>,
    merges: Vec<String>,
) -> Result<(), FormatError> {
    let eos = tokens.len() as u32;
    let mut types = vec![1i32; tokens.len()]; // LLAMA_TOKEN_TYPE_NORMAL
    tokens.push(EOS_TOKEN.to_string());
    types.push(3); // LLAMA_TOKEN_TYPE_CONTROL
    w.add_metadata("tokenizer.ggml.model", "gpt2")?;
    w.add_metadata("tokenizer.ggml.pre", "gpt-2")?;
    w.add_metadata(
        "tokenizer.ggml.tokens",
        MetadataValue::Array(MetadataArray::String(tokens)),
    )?;
    w.add_metadata(
        "tokenizer.ggml.token_type",
        MetadataValue::Array(MetadataArray::I32(types)),
    )?;
    w.add_metadata(
        "tokenizer.ggml.merges",
        MetadataValue::Array(MetadataArray::String(merges)),
    )?;
    w.add_metadata("tokenizer.ggml.bos_token_id", eos)?;
    w.add_metadata("tokenizer.ggml.eos_token_id", eos)?;
    w.add_metadata("tokenizer.ggml.add_bos_token", false)?;
    w.add_metadata("tokenizer.ggml.add_eos_token", false)?;
    Ok(())
}

/// The end-of-text row and the final LayerNorm bias that give that token the logit [`EOS_LOGIT`]
/// whatever the input, leaving every character's logit unchanged (module documentation). `w` holds
/// the `v` characters' rows as stored, `g` the final LayerNorm weight. None when there is no room.
struct EndOfText {
    row: Vec<f32>,
    bias: Vec<f32>,
}

fn end_of_text(w: &[f32], v: usize, g: &[f32]) -> Option<EndOfText> {
    let c = g.len();
    let gmax = g.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
    if v >= c || gmax == 0.0 || g.iter().any(|x| (x.abs() as f64) < 1e-4 * gmax) {
        return None;
    }
    let row = |i: usize| &w[i * c..(i + 1) * c];
    let u: Vec<f64> = g.iter().map(|&x| 1.0 / x as f64).collect();
    // p = u − Wᵀ (W Wᵀ)⁻¹ W u: u's component orthogonal to every character's row (f64, sequential,
    // so the file is the same on every machine).
    let mut gram = vec![0.0f64; v * v];
    for i in 0..v {
        for j in 0..=i {
            let s: f64 = row(i)
                .iter()
                .zip(row(j))
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            gram[i * v + j] = s;
            gram[j * v + i] = s;
        }
    }
    let wu: Vec<f64> = (0..v)
        .map(|i| row(i).iter().zip(&u).map(|(&a, b)| a as f64 * b).sum())
        .collect();
    let y = cholesky_solve(&mut gram, v, &wu)?;
    let mut p = u.clone();
    for (i, yi) in y.iter().enumerate() {
        for (pk, &wk) in p.iter_mut().zip(row(i)) {
            *pk -= yi * wk as f64;
        }
    }
    let p_norm = p.iter().map(|x| x * x).sum::<f64>().sqrt();
    let u_norm = u.iter().map(|x| x * x).sum::<f64>().sqrt();
    if p_norm.is_nan() || p_norm <= 1e-3 * u_norm {
        return None;
    }
    // b = t · p / |p|, so u · b = t |p|; the row w = k · u then gives w · b = k t |p| = EOS_LOGIT.
    let g_norm = g.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    let t = BIAS_SCALE * g_norm;
    let bias: Vec<f32> = p.iter().map(|x| (t * x / p_norm) as f32).collect();
    let k = EOS_LOGIT / (t * p_norm);
    let row_eos: Vec<f32> = u.iter().map(|x| (k * x) as f32).collect();
    // The row must survive f16 storage.
    if row_eos.iter().any(|x| !x.is_finite() || x.abs() > 60_000.0) {
        return None;
    }
    Some(EndOfText { row: row_eos, bias })
}

/// Solves A x = b for a symmetric positive-definite n x n `a` (overwritten by its Cholesky factor);
/// None when `a` is not (numerically) positive definite.
fn cholesky_solve(a: &mut [f64], n: usize, b: &[f64]) -> Option<Vec<f64>> {
    let max_diag = (0..n).map(|i| a[i * n + i]).fold(0.0f64, f64::max);
    for j in 0..n {
        let mut d = a[j * n + j];
        for k in 0..j {
            d -= a[j * n + k] * a[j * n + k];
        }
        if d.is_nan() || d <= 1e-12 * max_diag {
            return None;
        }
        let d = d.sqrt();
        a[j * n + j] = d;
        for i in j + 1..n {
            let mut s = a[i * n + j];
            for k in 0..j {
                s -= a[i * n + k] * a[j * n + k];
            }
            a[i * n + j] = s / d;
        }
    }
    // L z = b, then Lᵀ x = z.
    let mut z = b.to_vec();
    for i in 0..n {
        for k in 0..i {
            z[i] -= a[i * n + k] * z[k];
        }
        z[i] /= a[i * n + i];
    }
    for i in (0..n).rev() {
        for k in i + 1..n {
            z[i] -= a[k * n + i] * z[k];
        }
        z[i] /= a[i * n + i];
    }
    Some(z)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpt::{CharVocab, GptConfig};

    fn config(text: &str, n_embd: usize) -> CheckpointConfig {
        let vocab = CharVocab::from_text(text);
        CheckpointConfig {
            model: GptConfig {
                vocab_size: vocab.len(),
                block_size: 8,
                n_layer: 1,
                n_head: 2,
                n_embd,
                dropout: 0.0,
            },
            vocab,
            provenance: serde_json::Value::Null,
        }
    }

    #[test]
    fn end_of_text_row_cancels_every_normalised_input_and_spares_the_characters() {
        let cfg = config("abcdefg\n", 64);
        let layout = Layout::new(&cfg.model);
        let mut params = layout.init(&cfg.model, 3);
        // A LayerNorm weight that is not all ones.
        let ln_f = layout.ln_f();
        for (i, x) in params[ln_f..ln_f + 64].iter_mut().enumerate() {
            *x = 0.5 + (i % 7) as f32 * 0.2;
        }
        let (v, c) = (cfg.model.vocab_size, 64);
        let w = &params[layout.wte()..layout.wte() + v * c];
        let g = &params[ln_f..ln_f + c];
        let e = end_of_text(w, v, g).expect("room for the construction");
        // Characters: W · b = 0.
        for i in 0..v {
            let dot: f64 = (0..c).map(|k| (w[i * c + k] * e.bias[k]) as f64).sum();
            assert!(dot.abs() < 1e-5, "character {i}: {dot}");
        }
        // End of text: w · (n ∘ g + b) = EOS_LOGIT for any n with zero mean.
        let mut rng = tinygpt_kernels::rng::SeedRng::new(9);
        for _ in 0..5 {
            let mut n = rng.normal_vec(c, 1.0);
            let mean = n.iter().sum::<f32>() / c as f32;
            n.iter_mut().for_each(|x| *x -= mean);
            let logit: f64 = (0..c)
                .map(|k| e.row[k] as f64 * (n[k] * g[k] + e.bias[k]) as f64)
                .sum();
            assert!((logit - EOS_LOGIT).abs() < 1.0, "{logit}");
        }
    }

    #[test]
    fn a_vocabulary_as_wide_as_the_model_gets_a_zero_row() {
        let text: String = ('a'..='z').chain('A'..='Z').chain('0'..='9').collect();
        let cfg = config(&text, 32); // 62 characters, 32 wide
        let params = Layout::new(&cfg.model).init(&cfg.model, 1);
        let e = to_gguf(&cfg, &params, GgufWeights::F32, "t").unwrap();
        assert_eq!(e.eos_logit, 0.0);
    }

    #[test]
    fn multi_byte_characters_get_the_merges_that_rebuild_them() {
        let cfg = config("aé—😀", 32);
        let mut w = GgufWriter::new();
        vocabulary(&mut w, &cfg).unwrap();
        let md = w.metadata();
        let Some(MetadataValue::Array(MetadataArray::String(merges))) =
            md.get("tokenizer.ggml.merges")
        else {
            panic!("merges missing")
        };
        // é: 1 merge, —: 2, 😀: 3.
        assert_eq!(merges.len(), 6, "{merges:?}");
        let Some(MetadataValue::Array(MetadataArray::String(tokens))) =
            md.get("tokenizer.ggml.tokens")
        else {
            panic!("tokens missing")
        };
        assert_eq!(tokens.len(), 5);
        assert_eq!(tokens[0], "a");
        assert_eq!(tokens[1], "Ã©");
        assert_eq!(tokens[4], EOS_TOKEN);
    }

    #[test]
    fn q8_0_needs_a_width_in_whole_blocks() {
        let cfg = config("abc", 48);
        let params = Layout::new(&cfg.model).init(&cfg.model, 1);
        let err = to_gguf(&cfg, &params, GgufWeights::Q8_0, "t")
            .err()
            .expect("48 is not a multiple of 32");
        assert!(err.to_string().contains("F16 or F32"), "{err}");
    }
}
