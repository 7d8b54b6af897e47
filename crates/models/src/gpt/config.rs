//! The GPT's hyperparameters.

use serde::{Deserialize, Serialize};

/// Largest vocabulary (every Unicode scalar value, for a character vocabulary).
pub const MAX_VOCAB: usize = 1_114_112;
/// Longest context.
pub const MAX_BLOCK: usize = 65_536;
pub const MAX_LAYERS: usize = 1_024;
pub const MAX_HEADS: usize = 1_024;
pub const MAX_WIDTH: usize = 65_536;
/// Most parameters (8 GB of f32 weights).
pub const MAX_PARAMS: usize = 2_000_000_000;

/// Shape of a GPT-2-style model: learned token and position embeddings, pre-LayerNorm blocks without
/// biases, causal multi-head attention, a 4x GELU MLP, a final LayerNorm and a head tied to the token
/// embedding.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GptConfig {
    pub vocab_size: usize,
    pub block_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub dropout: f32,
}

impl GptConfig {
    /// nanoGPT's shakespeare-char recipe: 6 layers, 6 heads, 384 wide, block 256, dropout 0.2.
    pub fn shakespeare_char(vocab_size: usize) -> Self {
        GptConfig {
            vocab_size,
            block_size: 256,
            n_layer: 6,
            n_head: 6,
            n_embd: 384,
            dropout: 0.2,
        }
    }

    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head.max(1)
    }

    /// Number of trainable parameters (the tied head counted once).
    pub fn num_params(&self) -> usize {
        self.checked_num_params().unwrap_or(usize::MAX)
    }

    /// [`Self::num_params`], or `None` when it overflows.
    pub fn checked_num_params(&self) -> Option<usize> {
        let c = self.n_embd;
        let per_layer = c.checked_mul(c)?.checked_mul(12)?.checked_add(2 * c)?;
        self.vocab_size
            .checked_mul(c)?
            .checked_add(self.block_size.checked_mul(c)?)?
            .checked_add(self.n_layer.checked_mul(per_layer)?)?
            .checked_add(c)
    }

    /// Bytes a training step holds for `batch` sequences: parameters, gradients and the two AdamW
    /// moments, plus the activations kept for the backward pass (a close upper estimate), or `None`
    /// when the figure overflows.
    pub fn train_bytes(&self, batch: usize) -> Option<u64> {
        let (b, t, c) = (batch as u64, self.block_size as u64, self.n_embd as u64);
        let (l, h, v) = (
            self.n_layer as u64,
            self.n_head as u64,
            self.vocab_size as u64,
        );
        let params = (self.checked_num_params()? as u64).checked_mul(4 * 4)?;
        let rows = b.checked_mul(t)?;
        // Per layer: ~20 row vectors of width c (norms, qkv, attention out, 4c MLP twice) and the
        // attention probabilities (h × t per row); then the logits and their gradient.
        let per_layer = rows.checked_mul(
            c.checked_mul(20)?
                .checked_add(h.checked_mul(t)?.checked_mul(2)?)?,
        )?;
        let acts = l
            .checked_mul(per_layer)?
            .checked_add(rows.checked_mul(v.checked_mul(2)?)?)?;
        params.checked_add(acts.checked_mul(4)?)
    }

    /// The model's own weight products, added to the numerics gate's default shapes: one decode row and
    /// a batch of rows through each block matrix (y = x · Wᵀ), and the tied head.
    pub fn gate_cases(&self) -> Vec<tinygpt_kernels::gate::GateCase> {
        use tinygpt_kernels::gate::GateCase;
        let c = self.n_embd;
        let mut v = Vec::new();
        for (name, n, k) in [
            ("qkv", 3 * c, c),
            ("proj", c, c),
            ("fc", 4 * c, c),
            ("mlp-proj", c, 4 * c),
        ] {
            v.push(GateCase::new(&format!("model {name} decode"), 1, n, k));
            v.push(GateCase::new(&format!("model {name} batch"), 64, n, k));
        }
        v.push(GateCase::new("model head", 8, self.vocab_size, c));
        v
    }

    /// Checks the shape is buildable and within the bounds below; the message says what to change.
    pub fn validate(&self) -> Result<(), String> {
        if self.vocab_size == 0 || self.block_size == 0 || self.n_layer == 0 || self.n_head == 0 {
            return Err("vocab size, block size, layers and heads must all be at least 1".into());
        }
        for (what, value, max) in [
            ("vocabulary size", self.vocab_size, MAX_VOCAB),
            ("block size", self.block_size, MAX_BLOCK),
            ("number of layers", self.n_layer, MAX_LAYERS),
            ("number of heads", self.n_head, MAX_HEADS),
            ("width", self.n_embd, MAX_WIDTH),
        ] {
            if value > max {
                return Err(format!("{what} {value} is over the limit of {max}"));
            }
        }
        match self.checked_num_params() {
            Some(n) if n <= MAX_PARAMS => {}
            n => {
                return Err(format!(
                    "the model would have {} parameters, over the limit of {MAX_PARAMS}: make it smaller",
                    n.map_or("too many".into(), |n| n.to_string())
                ));
            }
        }
        if self.n_embd == 0 || !self.n_embd.is_multiple_of(self.n_head) {
            return Err(format!(
                "width {} must be a positive multiple of the number of heads {}",
                self.n_embd, self.n_head
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("dropout {} must be in [0, 1)", self.dropout));
        }
        Ok(())
    }
}
