//! Where each parameter lives in the one flat parameter tensor (and, identically, in the gradient and
//! optimizer-state tensors).
//!
//! One tensor for all parameters lets the optimizer update everything in two dispatches and the
//! gradient norm come from one reduction. Matrices whose weight decays come first, then the LayerNorm
//! weights (no decay, as nanoGPT does for every tensor of fewer than two dimensions). Offsets are
//! multiples of 4 · n_embd, the tensor's split unit, so no weight row straddles two GPU buffers when the
//! tensor is larger than one binding.

use super::config::GptConfig;

/// One parameter tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub name: String,
    /// [rows, cols] for matrices, [len] for vectors.
    pub shape: Vec<usize>,
    pub offset: usize,
    pub decay: bool,
}

impl Entry {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The whole layout.
#[derive(Clone, Debug)]
pub struct Layout {
    pub entries: Vec<Entry>,
    /// Elements from 0 up to here decay; the rest do not.
    pub decay_end: usize,
    pub total: usize,
    pub unit: usize,
}

/// Offsets of one transformer block's parameters.
#[derive(Clone, Copy, Debug)]
pub struct BlockOffsets {
    pub ln_1: usize,
    pub c_attn: usize,
    pub attn_proj: usize,
    pub ln_2: usize,
    pub c_fc: usize,
    pub mlp_proj: usize,
}

impl Layout {
    pub fn new(cfg: &GptConfig) -> Self {
        let c = cfg.n_embd;
        let unit = 4 * c;
        let mut entries = Vec::new();
        let mut off = 0;
        let mut push = |name: String, shape: Vec<usize>, decay: bool, off: &mut usize| {
            let e = Entry {
                name,
                shape,
                offset: *off,
                decay,
            };
            *off += e.len().div_ceil(unit) * unit;
            entries.push(e);
        };
        push(
            "transformer.wte.weight".into(),
            vec![cfg.vocab_size, c],
            true,
            &mut off,
        );
        push(
            "transformer.wpe.weight".into(),
            vec![cfg.block_size, c],
            true,
            &mut off,
        );
        for l in 0..cfg.n_layer {
            let h = format!("transformer.h.{l}");
            push(
                format!("{h}.attn.c_attn.weight"),
                vec![3 * c, c],
                true,
                &mut off,
            );
            push(
                format!("{h}.attn.c_proj.weight"),
                vec![c, c],
                true,
                &mut off,
            );
            push(
                format!("{h}.mlp.c_fc.weight"),
                vec![4 * c, c],
                true,
                &mut off,
            );
            push(
                format!("{h}.mlp.c_proj.weight"),
                vec![c, 4 * c],
                true,
                &mut off,
            );
        }
        let decay_end = off;
        for l in 0..cfg.n_layer {
            let h = format!("transformer.h.{l}");
            push(format!("{h}.ln_1.weight"), vec![c], false, &mut off);
            push(format!("{h}.ln_2.weight"), vec![c], false, &mut off);
        }
        push("transformer.ln_f.weight".into(), vec![c], false, &mut off);
        Layout {
            entries,
            decay_end,
            total: off,
            unit,
        }
    }

    /// The entry called `name`.
    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.name == name)
    }

    fn off(&self, name: &str) -> usize {
        self.get(name)
            .map(|e| e.offset)
            .expect("layout built from the same config")
    }

    pub fn wte(&self) -> usize {
        self.off("transformer.wte.weight")
    }
    pub fn wpe(&self) -> usize {
        self.off("transformer.wpe.weight")
    }
    pub fn ln_f(&self) -> usize {
        self.off("transformer.ln_f.weight")
    }
    pub fn block(&self, l: usize) -> BlockOffsets {
        let h = format!("transformer.h.{l}");
        BlockOffsets {
            ln_1: self.off(&format!("{h}.ln_1.weight")),
            c_attn: self.off(&format!("{h}.attn.c_attn.weight")),
            attn_proj: self.off(&format!("{h}.attn.c_proj.weight")),
            ln_2: self.off(&format!("{h}.ln_2.weight")),
            c_fc: self.off(&format!("{h}.mlp.c_fc.weight")),
            mlp_proj: self.off(&format!("{h}.mlp.c_proj.weight")),
        }
    }

    /// Initial parameters as nanoGPT draws them: N(0, 0.02) for matrices and embeddings, N(0, 0.02 /
    /// sqrt(2 · layers)) for the projections into the residual stream, 1 for LayerNorm weights.
    pub fn init(&self, cfg: &GptConfig, seed: u64) -> Vec<f32> {
        let mut rng = tinygpt_kernels::rng::SeedRng::new(seed);
        let mut p = vec![0.0f32; self.total];
        let proj_std = 0.02 / (2.0 * cfg.n_layer as f32).sqrt();
        for e in &self.entries {
            let dst = &mut p[e.offset..e.offset + e.len()];
            if e.shape.len() == 1 {
                dst.fill(1.0);
            } else {
                let std = if e.name.ends_with("c_proj.weight") {
                    proj_std
                } else {
                    0.02
                };
                dst.copy_from_slice(&rng.normal_vec(e.len(), std));
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_has_nanogpt_parameter_count_and_aligned_offsets() {
        let cfg = GptConfig::shakespeare_char(65);
        // nanoGPT reports 10.65M excluding position embeddings; with them, 10.75M.
        assert_eq!(cfg.num_params(), 10_745_088);
        let l = Layout::new(&cfg);
        let counted: usize = l.entries.iter().map(Entry::len).sum();
        assert_eq!(counted, cfg.num_params());
        for e in &l.entries {
            assert_eq!(e.offset % l.unit, 0, "{}", e.name);
            assert_eq!(e.decay, e.offset < l.decay_end, "{}", e.name);
        }
        // Entries never overlap.
        for w in l.entries.windows(2) {
            assert!(w[0].offset + w[0].len() <= w[1].offset);
        }
    }
}
