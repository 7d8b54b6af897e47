//! Hyperparameters of a GGUF model, read from its metadata with llama.cpp's built-in defaults where the
//! file has no key (`src/models/<arch>.cpp` and `llama-hparams` in llama.cpp).

use tinygpt_formats::{GgufFile, Metadata, MetadataArray, MetadataValue};
use tinygpt_kernels::gate::GateCase;
use tinygpt_kernels::ops::glu::Activation;
use tinygpt_kernels::ops::norm::NormKind;
use tinygpt_kernels::ops::rope::RopeLayout;

use super::error::{LlmError, Result};

/// Largest layer count, width or head count accepted (2^20; the largest models have ~2^14).
const MAX_DIM: usize = 1 << 20;
/// Most layers a model may declare (the largest real models have a few hundred).
const MAX_LAYERS: usize = 4096;

/// Architectures the runner implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama and its relatives (SmolLM2): RMSNorm, RoPE, grouped-query attention, SwiGLU.
    Llama,
    /// Gemma 3: adds per-head Q/K norms, post-attention and post-FFN norms, GeGLU, scaled embeddings and
    /// interleaved sliding-window layers.
    Gemma3,
    /// Qwen2 / Qwen2.5: llama's layout with biases on Q, K and V, NeoX RoPE.
    Qwen2,
    /// Qwen3: per-head RMSNorm of Q and K before RoPE (as Gemma 3), no biases, NeoX RoPE.
    Qwen3,
    /// GPT-2 and its kind (TinyGPT's exported char-level models): LayerNorm with biases, learned
    /// positions, one fused Q/K/V matrix, a plain GELU MLP, biases on every projection.
    Gpt2,
}

impl Arch {
    /// Every architecture the runner implements.
    pub const ALL: [Arch; 5] = [
        Arch::Llama,
        Arch::Gemma3,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Gpt2,
    ];

    /// The `general.architecture` value.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gpt2 => "gpt2",
        }
    }

    fn from_name(s: &str) -> Option<Arch> {
        match s {
            "llama" => Some(Arch::Llama),
            "gemma3" => Some(Arch::Gemma3),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            "gpt2" => Some(Arch::Gpt2),
            _ => None,
        }
    }
}

/// Per-layer attention settings (Gemma 3 alternates local and global layers).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerAttention {
    pub rope_base: f32,
    /// Linear RoPE scaling: angles are multiplied by this (1 for none).
    pub rope_scale: f32,
    /// Sliding window: a query at position q sees keys k > q − window; 0 for full causal attention.
    pub window: usize,
}

/// Everything the forward pass needs to know about a model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlmConfig {
    pub arch: Arch,
    /// `general.name`, or empty.
    pub name: String,
    /// The quantization mix the file declares (`general.file_type`), e.g. "Q4_K_M".
    pub file_type: String,
    pub n_layer: usize,
    pub d_model: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    /// Leading dimensions of each head that RoPE rotates.
    pub n_rot: usize,
    /// Rows of `token_embd` (the vocabulary the model was trained with).
    pub vocab: usize,
    /// `<arch>.context_length`: the context the model was trained for.
    pub train_context: usize,
    pub norm_eps: f32,
    /// RMSNorm (llama, Gemma) or LayerNorm (GPT-2, whose norms also have biases).
    pub norm: NormKind,
    /// A learned position table (`position_embd`) is added to the token embeddings (GPT-2, whose
    /// `n_rot` is then 0: no RoPE).
    pub learned_positions: bool,
    /// act(gate) · up (llama, Gemma) or act(up) alone (GPT-2).
    pub gated_ffn: bool,
    pub rope_layout: RopeLayout,
    /// Multiplies the attention scores.
    pub attn_scale: f32,
    /// Multiplies the token embeddings (Gemma: sqrt(d_model)).
    pub embed_scale: f32,
    pub activation: Activation,
    /// Per-head RMSNorm of Q and K before RoPE (Gemma 3).
    pub qk_norm: bool,
    /// RMSNorm of the attention and FFN outputs before the residual add (Gemma 3).
    pub post_norms: bool,
    /// cap · tanh(logits / cap) on the output, 0 for none.
    pub final_softcap: f32,
    pub layers: Vec<LayerAttention>,
}

impl LlmConfig {
    /// Width of the query projection (all heads).
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of one position's keys (or values) in the cache.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim
    }

    /// The model's matrix products for the GPU numerics gate (`tinygpt_kernels::gate`), which must pass
    /// before the quantized kernels are used: every projection at one row (decoding) and at 64 rows (a
    /// prompt), and the head at one row with N cut to 8192 (its full width adds only time).
    pub fn gate_cases(&self) -> Vec<GateCase> {
        let (d, qd, kvd, ff) = (self.d_model, self.q_dim(), self.kv_dim(), self.n_ff);
        let mut v = Vec::new();
        let up = if self.gated_ffn { 2 * ff } else { ff };
        for (name, n, k) in [
            ("qkv", qd + 2 * kvd, d),
            ("attn_output", d, qd),
            ("gate_up", up, d),
            ("ffn_down", d, ff),
        ] {
            v.push(GateCase::new(&format!("model {name} decode"), 1, n, k));
            v.push(GateCase::new(&format!("model {name} prompt"), 64, n, k));
        }
        v.push(GateCase::new("model head", 1, self.vocab.min(8192), d));
        v
    }

    /// Reads and checks the hyperparameters of `file`.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let md = file.metadata();
        let arch_name = md.architecture()?;
        let arch = Arch::from_name(arch_name)
            .ok_or_else(|| LlmError::UnsupportedArch(arch_name.to_string()))?;
        let key = |k: &str| format!("{}.{k}", arch.name());
        let req = |k: &str| -> Result<usize> { Ok(md.get_usize(&key(k))?) };
        let opt = |k: &str| -> Result<Option<usize>> { Ok(md.get_opt::<usize>(&key(k))?) };
        let optf =
            |k: &str| -> Result<Option<f32>> { Ok(md.get_opt::<f64>(&key(k))?.map(|v| v as f32)) };

        let n_layer = req("block_count")?;
        let d_model = req("embedding_length")?;
        let n_ff = req("feed_forward_length")?;
        let n_head = req("attention.head_count")?;
        let n_kv_head = opt("attention.head_count_kv")?.unwrap_or(n_head);
        if n_head == 0 || d_model == 0 || n_ff == 0 || n_layer == 0 {
            return Err(LlmError::Invalid(format!(
                "block_count {n_layer}, embedding_length {d_model}, feed_forward_length {n_ff} and \
                 attention.head_count {n_head} must all be positive"
            )));
        }
        // llama.cpp: n_embd_head_k = key_length, else n_embd / n_head.
        let head_dim = opt("attention.key_length")?.unwrap_or(d_model / n_head);
        let head_dim_v = opt("attention.value_length")?.unwrap_or(head_dim);
        // GPT-2 has no RoPE: its positions are a learned table added to the embeddings.
        let n_rot = match arch {
            Arch::Gpt2 => 0,
            _ => opt("rope.dimension_count")?.unwrap_or(head_dim),
        };
        if head_dim_v != head_dim {
            return Err(LlmError::Unsupported(format!(
                "key length {head_dim} differs from value length {head_dim_v}"
            )));
        }
        // Bounds far above any real model, so a corrupted file cannot make the sizes derived from these
        // overflow (every matrix must also match the tensors, which the file's length bounds).
        let too_big = n_layer > MAX_LAYERS
            || [d_model, n_ff, n_head, n_kv_head, head_dim]
                .iter()
                .any(|&v| v > MAX_DIM)
            || n_head.checked_mul(head_dim).is_none_or(|p| p > MAX_DIM);
        if too_big {
            return Err(LlmError::Invalid(format!(
                "hyperparameters out of range: {n_layer} layers (at most {MAX_LAYERS}), width {d_model}, \
                 FFN {n_ff}, {n_head} heads of {head_dim} (each at most {MAX_DIM})"
            )));
        }
        if n_kv_head == 0 || n_head % n_kv_head != 0 {
            return Err(LlmError::Invalid(format!(
                "attention.head_count {n_head} is not a multiple of attention.head_count_kv {n_kv_head}"
            )));
        }
        // The attention kernel takes heads of up to 512; RoPE rotates pairs.
        if head_dim == 0 || head_dim > 512 || n_rot % 2 != 0 || n_rot > head_dim {
            return Err(LlmError::Invalid(format!(
                "head dimension {head_dim} (must be 1..=512) with {n_rot} rotated dimensions (even, at most \
                 the head dimension)"
            )));
        }
        let train_context = req("context_length")?;
        let eps_key = match arch {
            Arch::Gpt2 => "attention.layer_norm_epsilon",
            _ => "attention.layer_norm_rms_epsilon",
        };
        let norm_eps =
            optf(eps_key)?.ok_or_else(|| LlmError::Invalid(format!("missing {}", key(eps_key))))?;
        let rope_base = optf("rope.freq_base")?.unwrap_or(10_000.0);
        let rope_freq_scale = rope_scaling(md, &key)?;
        if let Some(n) = opt("expert_count")?
            && n > 0
        {
            return Err(LlmError::Unsupported(format!(
                "mixture-of-experts models ({n} experts)"
            )));
        }
        let vocab = file.tensor_info("token_embd.weight")?.rows() as usize;
        let name = md
            .get_opt::<&str>("general.name")?
            .unwrap_or("")
            .to_string();
        let file_type = md
            .get_opt::<u32>("general.file_type")
            .ok()
            .flatten()
            .map_or_else(String::new, file_type_name);
        if !(norm_eps >= 0.0 && norm_eps.is_finite() && rope_base > 0.0 && rope_base.is_finite()) {
            return Err(LlmError::Invalid(format!(
                "norm epsilon {norm_eps} and rope base {rope_base} must be finite and non-negative"
            )));
        }

        let mut cfg = LlmConfig {
            arch,
            name,
            file_type,
            n_layer,
            d_model,
            n_ff,
            n_head,
            n_kv_head,
            head_dim,
            n_rot,
            vocab,
            train_context,
            norm_eps,
            norm: NormKind::Rms,
            learned_positions: false,
            gated_ffn: true,
            rope_layout: RopeLayout::Normal,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            embed_scale: 1.0,
            activation: Activation::Silu,
            qk_norm: false,
            post_norms: false,
            final_softcap: 0.0,
            layers: vec![
                LayerAttention {
                    rope_base,
                    rope_scale: rope_freq_scale,
                    window: 0
                };
                n_layer
            ],
        };
        match arch {
            // llama.cpp's converter permutes the rows of Q and K so that RoPE rotates adjacent pairs
            // (LLAMA_ROPE_TYPE_NORM). transformers un-permutes them and rotates halves (NeoX); both apply
            // the same rotations to the same pairs of values, so the attention scores are identical.
            Arch::Llama => {}
            Arch::Gemma3 => gemma3(md, &key, &mut cfg)?,
            // llama.cpp `llama_model_qwen2` / `llama_model_qwen3` (LLAMA_ROPE_TYPE_NEOX): the
            // converter keeps transformers' Q/K row order, so RoPE rotates halves.
            Arch::Qwen2 => cfg.rope_layout = RopeLayout::Neox,
            Arch::Qwen3 => {
                cfg.rope_layout = RopeLayout::Neox;
                cfg.qk_norm = true;
            }
            // llama.cpp `llama_model_gpt2`: LayerNorm, learned positions, GELU (tanh) MLP.
            Arch::Gpt2 => {
                cfg.norm = NormKind::Layer;
                cfg.learned_positions = true;
                cfg.gated_ffn = false;
                cfg.activation = Activation::Gelu;
                if n_kv_head != n_head {
                    return Err(LlmError::Invalid(format!(
                        "gpt2 models have as many KV heads as heads ({n_head}), not {n_kv_head}"
                    )));
                }
            }
        }
        Ok(cfg)
    }
}

/// Gemma 3's additions (llama.cpp `llama_model_gemma3`).
fn gemma3(md: &Metadata, key: &dyn Fn(&str) -> String, cfg: &mut LlmConfig) -> Result<()> {
    cfg.rope_layout = RopeLayout::Neox;
    cfg.activation = Activation::Gelu;
    cfg.qk_norm = true;
    cfg.post_norms = true;
    // Gemma multiplies the embeddings by sqrt(n_embd) (in f32, as transformers' embed_scale).
    cfg.embed_scale = (cfg.d_model as f32).sqrt();
    // llama.cpp: 1/sqrt(n_embd / n_head) for the 27B model (62 layers), else 1/sqrt(head_dim), which is
    // transformers' query_pre_attn_scalar^-1/2 for these models.
    let scale_dim = if cfg.n_layer == 62 {
        cfg.d_model / cfg.n_head
    } else {
        cfg.head_dim
    };
    cfg.attn_scale = 1.0 / (scale_dim as f32).sqrt();
    cfg.final_softcap = md
        .get_opt::<f64>(&key("final_logit_softcapping"))?
        .map_or(0.0, |v| v as f32);
    let window = md
        .get_opt::<usize>(&key("attention.sliding_window"))?
        .unwrap_or(0);
    if window == 0 {
        return Ok(());
    }
    // Local layers use their own rope base (10000 unless the file says otherwise) and no rope scaling
    // (llama.cpp's rope_freq_scale_train_swa); the pattern is 5 local + 1 global unless the file gives
    // one (a per-layer bool array or a period).
    let swa_base = md
        .get_opt::<f64>(&key("rope.freq_base_swa"))?
        .map_or(10_000.0, |v| v as f32);
    if !(swa_base > 0.0 && swa_base.is_finite()) {
        return Err(LlmError::Invalid(format!(
            "sliding-window rope base {swa_base}"
        )));
    }
    let pattern_key = key("attention.sliding_window_pattern");
    let is_swa: Vec<bool> = match md.get(&pattern_key) {
        Some(MetadataValue::Array(MetadataArray::Bool(v))) => {
            if v.len() < cfg.n_layer {
                return Err(LlmError::Invalid(format!(
                    "{pattern_key} lists {} layers, the model has {}",
                    v.len(),
                    cfg.n_layer
                )));
            }
            v[..cfg.n_layer].to_vec()
        }
        _ => {
            let period = md.get_opt::<usize>(&pattern_key)?.unwrap_or(6);
            (0..cfg.n_layer)
                .map(|il| period == 0 || il % period < period - 1)
                .collect()
        }
    };
    for (layer, swa) in cfg.layers.iter_mut().zip(is_swa) {
        if swa {
            *layer = LayerAttention {
                rope_base: swa_base,
                rope_scale: 1.0,
                window,
            };
        }
    }
    Ok(())
}

/// Linear RoPE scaling factor from `rope.scaling.*` (llama.cpp `llama_model::load_hparams`).
fn rope_scaling(md: &Metadata, key: &dyn Fn(&str) -> String) -> Result<f32> {
    let kind = md
        .get_opt::<&str>(&key("rope.scaling.type"))?
        .unwrap_or("linear");
    let factor = match md.get_opt::<f64>(&key("rope.scaling.factor"))? {
        Some(f) => Some(f),
        None => md.get_opt::<f64>(&key("rope.scale_linear"))?,
    }
    .unwrap_or(0.0) as f32;
    match kind {
        "none" => Ok(1.0),
        "linear" if factor == 0.0 || factor == 1.0 => Ok(1.0),
        "linear" if factor.is_finite() && factor > 0.0 => Ok(1.0 / factor),
        other => Err(LlmError::Unsupported(format!(
            "RoPE scaling '{other}' with factor {factor} (supported: none, linear)"
        ))),
    }
}

/// llama.cpp's `llama_ftype` names for `general.file_type`.
fn file_type_name(t: u32) -> String {
    let s = match t {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        32 => "BF16",
        other => return format!("file type {other}"),
    };
    s.to_string()
}
