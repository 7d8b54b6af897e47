//! The GPT's hyperparameters.

use serde::{Deserialize, Serialize};

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
        let c = self.n_embd;
        self.vocab_size * c + self.block_size * c + self.n_layer * (12 * c * c + 2 * c) + c
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

    /// Checks the shape is buildable; the message says what to change.
    pub fn validate(&self) -> Result<(), String> {
        if self.vocab_size == 0 || self.block_size == 0 || self.n_layer == 0 || self.n_head == 0 {
            return Err("vocab size, block size, layers and heads must all be at least 1".into());
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
