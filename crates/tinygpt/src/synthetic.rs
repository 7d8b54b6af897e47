//! Random-weight GGUF models with real models' shapes, for benchmarks where the real files cannot go
//! (a lent GPU machine with no network): decode speed does not depend on the weights' values.
//! Matrices are Q8_0 (random int8 quants, one f16 scale per 32) or, for the layers, Q4_1 (random 4-bit
//! quants, an f16 scale and minimum per 32: the layout of SmolLM2-135M-Instruct's Q4_1 file, whose
//! embedding stays Q8_0), norms f32 ones. The vocabulary is a
//! placeholder llama.cpp loads (byte-level BPE: the 256 byte characters, fillers, an end-of-text token,
//! no merges), so `llama-bench` can time the same file.

use anyhow::{Result, bail};
use tinygpt_formats::{GgmlType, GgufWriter};
use tinygpt_kernels::rng::SeedRng;

/// A model shape to imitate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// SmolLM2-135M: llama, 30 layers, 576 wide, 9 heads / 3 KV heads, FFN 1536, vocabulary 49152.
    #[value(name = "smollm2-135m")]
    Smollm2_135m,
    /// Gemma-3-270M: gemma3, 18 layers, 640 wide, 4 heads / 1 KV head of 256, FFN 2048, vocabulary 262144.
    #[value(name = "gemma3-270m")]
    Gemma3_270m,
}

/// The block format of a synthetic model's layer matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Quant {
    /// 8-bit quants, one f16 scale per 32 (34 bytes a block).
    #[value(name = "q8_0")]
    Q8_0,
    /// 4-bit quants, an f16 scale and an f16 minimum per 32 (20 bytes a block).
    #[value(name = "q4_1")]
    Q4_1,
    /// llama.cpp's Q4_K_M mix: Q4_K where a row is whole 256-value super-blocks, Q5_0 where it is
    /// not; `attn_v` and `ffn_down` of the first eighth, the last eighth and every third layer between
    /// take more bits (Q6_K, or Q8_0 where a row is not whole super-blocks). For Gemma-3-270M's shape
    /// this is the real file's layout, tensor by tensor.
    #[value(name = "q4_k_m")]
    Q4KM,
}

impl Quant {
    /// The block format of layer `layer` (of `layers`)'s matrix `name`, whose rows are `cols` long.
    fn layer_type(self, name: &str, layer: usize, layers: usize, cols: usize) -> GgmlType {
        match self {
            Quant::Q8_0 => GgmlType::Q8_0,
            Quant::Q4_1 => GgmlType::Q4_1,
            Quant::Q4KM => {
                let whole = cols.is_multiple_of(256);
                let more_bits =
                    layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2;
                match (name, more_bits, whole) {
                    ("attn_v" | "ffn_down", true, true) => GgmlType::Q6_K,
                    ("attn_v" | "ffn_down", true, false) => GgmlType::Q8_0,
                    (_, _, true) => GgmlType::Q4_K,
                    (_, _, false) => GgmlType::Q5_0,
                }
            }
        }
    }
}

/// Random blocks of `ty` for `values` values: random quants and fixed scales that keep every weight
/// within about ±0.04.
fn random_blocks(rng: &mut SeedRng, ty: GgmlType, values: usize) -> Vec<u8> {
    let f16 = |x: f32| half::f16::from_f32(x).to_le_bytes();
    // Bytes per block, values per block, and the f16 fields (offset, value) each block carries:
    // Q8_0 d, then 32 int8 quants; Q4_1 d and the minimum, then 16 bytes of nibbles; Q5_0 d, then 4
    // bytes of fifth bits and 16 of nibbles.
    let (bytes, per, fields): (usize, usize, Vec<(usize, [u8; 2])>) = match ty {
        GgmlType::Q8_0 => (34, 32, vec![(0, f16(0.02 / 127.0))]),
        GgmlType::Q4_1 => (20, 32, vec![(0, f16(0.04 / 15.0)), (2, f16(-0.02))]),
        GgmlType::Q5_0 => (22, 32, vec![(0, f16(0.02 / 16.0))]),
        // d and dmin, then 12 bytes of 6-bit sub-block scales and minimums, then 128 of nibbles.
        GgmlType::Q4_K => (
            144,
            256,
            vec![(0, f16(0.04 / 945.0)), (2, f16(0.02 / 63.0))],
        ),
        // ql, qh, 16 signed 8-bit scales, then d.
        GgmlType::Q6_K => (210, 256, vec![(208, f16(0.02 / 4064.0))]),
        _ => unreachable!("no random blocks for {ty:?}"),
    };
    let mut out = Vec::with_capacity(values / per * bytes);
    let mut block = vec![0u8; bytes];
    for _ in 0..values / per {
        for chunk in block.chunks_mut(8) {
            let r = rng.next_u64().to_le_bytes();
            chunk.copy_from_slice(&r[..chunk.len()]);
        }
        for (off, v) in &fields {
            block[*off..*off + 2].copy_from_slice(v);
        }
        out.extend_from_slice(&block);
    }
    out
}

/// GGUF bytes of a random model of `preset`'s shape, its layer matrices in `quant`.
pub fn gguf(preset: Preset, quant: Quant, seed: u64) -> Result<Vec<u8>> {
    let (arch, layers, d, heads, kv_heads, hd, ff, vocab) = match preset {
        Preset::Smollm2_135m => ("llama", 30, 576, 9, 3, 64, 1536, 49152),
        Preset::Gemma3_270m => ("gemma3", 18, 640, 4, 1, 256, 2048, 262144),
    };
    let mut w = GgufWriter::new();
    let k = |s: &str| format!("{arch}.{s}");
    w.add_metadata("general.architecture", arch)?;
    w.add_metadata("general.name", format!("synthetic {preset:?}").as_str())?;
    w.add_metadata(k("block_count"), layers as u32)?;
    w.add_metadata(k("embedding_length"), d as u32)?;
    w.add_metadata(k("feed_forward_length"), ff as u32)?;
    w.add_metadata(k("attention.head_count"), heads as u32)?;
    w.add_metadata(k("attention.head_count_kv"), kv_heads as u32)?;
    w.add_metadata(k("attention.key_length"), hd as u32)?;
    w.add_metadata(k("attention.value_length"), hd as u32)?;
    w.add_metadata(k("rope.dimension_count"), hd as u32)?;
    w.add_metadata(k("context_length"), 8192u32)?;
    w.add_metadata(k("attention.layer_norm_rms_epsilon"), 1e-6f32)?;
    w.add_metadata(
        k("rope.freq_base"),
        if arch == "gemma3" { 1e6f32 } else { 1e5f32 },
    )?;
    if arch == "gemma3" {
        w.add_metadata(k("attention.sliding_window"), 512u32)?;
    }
    add_vocab(&mut w, vocab)?;
    let mut rng = SeedRng::new(seed);
    let ones = |n: usize| -> Vec<u8> {
        std::iter::repeat_n(1.0f32.to_le_bytes(), n)
            .flatten()
            .collect()
    };
    let (qd, kvd) = (heads * hd, kv_heads * hd);
    w.add_tensor_bytes(
        "token_embd.weight",
        &[d as u64, vocab as u64],
        GgmlType::Q8_0,
        random_blocks(&mut rng, GgmlType::Q8_0, vocab * d),
    )?;
    w.add_tensor_bytes("output_norm.weight", &[d as u64], GgmlType::F32, ones(d))?;
    for i in 0..layers {
        let n = |t: &str| format!("blk.{i}.{t}.weight");
        w.add_tensor_bytes(n("attn_norm"), &[d as u64], GgmlType::F32, ones(d))?;
        w.add_tensor_bytes(n("ffn_norm"), &[d as u64], GgmlType::F32, ones(d))?;
        for (t, rows, cols) in [
            ("attn_q", qd, d),
            ("attn_k", kvd, d),
            ("attn_v", kvd, d),
            ("attn_output", d, qd),
            ("ffn_gate", ff, d),
            ("ffn_up", ff, d),
            ("ffn_down", d, ff),
        ] {
            let ty = quant.layer_type(t, i, layers, cols);
            let bytes = random_blocks(&mut rng, ty, rows * cols);
            w.add_tensor_bytes(n(t), &[cols as u64, rows as u64], ty, bytes)?;
        }
        if arch == "gemma3" {
            w.add_tensor_bytes(n("attn_q_norm"), &[hd as u64], GgmlType::F32, ones(hd))?;
            w.add_tensor_bytes(n("attn_k_norm"), &[hd as u64], GgmlType::F32, ones(hd))?;
            w.add_tensor_bytes(
                n("post_attention_norm"),
                &[d as u64],
                GgmlType::F32,
                ones(d),
            )?;
            w.add_tensor_bytes(n("post_ffw_norm"), &[d as u64], GgmlType::F32, ones(d))?;
        }
    }
    let bytes = w.to_bytes()?;
    if bytes.is_empty() {
        bail!("empty synthetic model");
    }
    Ok(bytes)
}

/// A placeholder byte-level BPE vocabulary of `n` tokens (see the module docs): the 256 bytes,
/// placeholders, and the end-of-text token.
fn add_vocab(w: &mut GgufWriter, n: usize) -> Result<()> {
    let mut tokens: Vec<String> = (0..=255u8)
        .map(|b| tinygpt_models::tokenizer::byte_level_char(b).to_string())
        .collect();
    tokens.extend((256..n - 1).map(|i| format!("<t{i}>")));
    tinygpt_models::gpt::export::add_byte_level_vocabulary(w, tokens, Vec::new())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tinygpt_formats::GgufFile;
    use tinygpt_models::llm::LlmConfig;

    /// Both block formats give a file the reader and the model configuration accept, with the layer
    /// matrices in the asked format (and their byte sizes: 34 or 20 bytes per 32 values) and the
    /// embedding in Q8_0.
    #[test]
    fn synthetic_models_have_the_asked_block_format() {
        for (quant, ty, block_bytes) in [
            (Quant::Q8_0, GgmlType::Q8_0, 34),
            (Quant::Q4_1, GgmlType::Q4_1, 20),
        ] {
            let file = GgufFile::from_bytes(gguf(Preset::Smollm2_135m, quant, 7).unwrap()).unwrap();
            LlmConfig::from_gguf(&file).unwrap();
            let t = file.tensor("blk.3.ffn_down.weight").unwrap();
            assert_eq!(t.ggml_type, ty);
            assert_eq!(t.dims, [1536, 576]);
            assert_eq!(t.n_bytes, 1536 * 576 / 32 * block_bytes);
            let e = file.tensor("token_embd.weight").unwrap();
            assert_eq!(e.ggml_type, GgmlType::Q8_0);
        }
    }

    /// The Q4_K_M mix gives Gemma-3-270M's shape the real file's block format, tensor by tensor
    /// (gemma-3-270m-Q4_K_M.gguf: Q5_0 for the 640-long rows, Q4_K for attn_output, and on layers 0,
    /// 1, 4, 7, 10, 13, 15, 16, 17 Q8_0 for attn_v and Q6_K for ffn_down).
    #[test]
    fn q4_k_m_mix_is_the_real_gemma_file_s() {
        let more = [0, 1, 4, 7, 10, 13, 15, 16, 17];
        for layer in 0..18 {
            let ty = |name, cols| Quant::Q4KM.layer_type(name, layer, 18, cols);
            let m = more.contains(&layer);
            assert_eq!(ty("attn_q", 640), GgmlType::Q5_0);
            assert_eq!(ty("attn_k", 640), GgmlType::Q5_0);
            assert_eq!(ty("ffn_gate", 640), GgmlType::Q5_0);
            assert_eq!(ty("ffn_up", 640), GgmlType::Q5_0);
            assert_eq!(ty("attn_output", 1024), GgmlType::Q4_K);
            let v = if m { GgmlType::Q8_0 } else { GgmlType::Q5_0 };
            assert_eq!(ty("attn_v", 640), v, "layer {layer}");
            let down = if m { GgmlType::Q6_K } else { GgmlType::Q4_K };
            assert_eq!(ty("ffn_down", 2048), down, "layer {layer}");
        }
    }

    /// A Q4_K_M file of SmolLM2's shape holds all four of the mix's formats with their block sizes,
    /// and every weight of them decodes to a finite value within ±0.05.
    #[test]
    fn q4_k_m_file_holds_the_mix() {
        let file =
            GgufFile::from_bytes(gguf(Preset::Smollm2_135m, Quant::Q4KM, 7).unwrap()).unwrap();
        LlmConfig::from_gguf(&file).unwrap();
        for (name, ty, dims, block_bytes, per) in [
            ("blk.0.attn_q.weight", GgmlType::Q5_0, [576, 576], 22, 32),
            ("blk.0.attn_v.weight", GgmlType::Q8_0, [576, 192], 34, 32),
            (
                "blk.0.ffn_down.weight",
                GgmlType::Q6_K,
                [1536, 576],
                210,
                256,
            ),
            (
                "blk.4.ffn_down.weight",
                GgmlType::Q4_K,
                [1536, 576],
                144,
                256,
            ),
        ] {
            let t = file.tensor(name).unwrap();
            assert_eq!(
                (t.ggml_type, t.dims.as_slice()),
                (ty, dims.as_slice()),
                "{name}"
            );
            assert_eq!(t.n_bytes, dims[0] * dims[1] / per * block_bytes, "{name}");
            let w = file.dequantize(name).unwrap();
            let worst = w.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!(worst.is_finite() && worst < 0.05, "{name}: {worst}");
            assert!(worst > 0.005, "{name}: {worst}");
        }
    }
}
