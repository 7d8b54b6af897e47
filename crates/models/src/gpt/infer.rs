//! Sampling from a trained GPT with a KV cache: the prompt is processed in one pass, then each new
//! token costs one row through every layer.
//!
//! Each layer's cache is simply its QKV rows `[block_size, 3 · n_embd]`: the projection writes new rows
//! straight into it and attention reads keys and values from it in place.

// The blocking passes below are native-only for now (the web will await reads instead).
#![cfg_attr(target_arch = "wasm32", allow(unused_imports, dead_code))]

use super::config::GptConfig;
use super::layout::Layout;
use crate::sampler::Sampler;
use tinygpt_kernels::gate::PathId;
use tinygpt_kernels::ops::add::add_assign;
use tinygpt_kernels::ops::attention::{DecodeShape, attend};
use tinygpt_kernels::ops::embedding::{EmbedShape, Positions, embedding};
use tinygpt_kernels::ops::gelu::gelu;
use tinygpt_kernels::ops::matmul::{Gemm, matmul};
use tinygpt_kernels::ops::matmul_f16::{matmul_f16w_with, pack_f16, packed_len};
use tinygpt_kernels::ops::norm::{NormKind, NormShape, norm_forward};
use tinygpt_kernels::{Backend, DType, Error, Result, Tensor};

/// A model loaded for inference on a backend, with its KV cache.
pub struct GptRunner {
    pub cfg: GptConfig,
    layout: Layout,
    params: Tensor,
    cache: Vec<Tensor>,
    ids: Tensor,
    x: Tensor,
    ln: Tensor,
    stats: Tensor,
    atty: Tensor,
    tmp: Tensor,
    fc: Tensor,
    act: Tensor,
    logits: Tensor,
    /// The parameters as f16 pairs, when the f16-storage path passed its gate: the block matrices are
    /// then read from here (the tied head stays f32).
    packed: Option<Tensor>,
    /// Cached positions.
    pos: usize,
}

/// y = x · Wᵀ for the block matrix at parameter offset `w`, from the f16 copy when there is one (and
/// on the tensor cores when `coop` allows and that path passed its gate).
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear(
    be: &Backend,
    params: &Tensor,
    packed: Option<&Tensor>,
    x: tinygpt_kernels::TRef<'_>,
    w: usize,
    y: tinygpt_kernels::TMut<'_>,
    g: &Gemm,
    coop: bool,
) -> Result<()> {
    match packed {
        // Layout offsets are multiples of 4 · n_embd, so even: word w / 2 starts the matrix.
        Some(p) => matmul_f16w_with(be, x, p.at(w / 2), y, g, coop),
        None => matmul(be, x, params.at(w), y, g),
    }
}

/// The f16 copy of `params`, when the f16-storage path is active on this backend.
pub(crate) fn pack_if_active(
    be: &Backend,
    params: &Tensor,
    into: Option<&mut Tensor>,
) -> Result<()> {
    if let Some(p) = into {
        pack_f16(be, params.at(0), p.at_mut(0), params.len())?;
    }
    Ok(())
}

/// A tensor for the f16 copy of `n` parameters, when the path is active.
pub(crate) fn packed_buffer(be: &Backend, n: usize) -> Result<Option<Tensor>> {
    match be.as_gpu() {
        Some(g) if g.path_active(PathId::F16Storage) => {
            Ok(Some(be.zeros_typed(packed_len(n), 1, DType::U32)?))
        }
        _ => Ok(None),
    }
}

impl GptRunner {
    /// Uploads `params` (host, [`Layout`] order) and plans buffers for a full block.
    pub fn new(be: &Backend, cfg: &GptConfig, params: &[f32]) -> Result<Self> {
        let layout = Layout::new(cfg);
        let (t, c) = (cfg.block_size, cfg.n_embd);
        let z = |n: usize, unit: usize| be.zeros(n, unit);
        let params_t = be.from_f32(params, layout.unit)?;
        let mut packed = packed_buffer(be, params.len())?;
        pack_if_active(be, &params_t, packed.as_mut())?;
        Ok(GptRunner {
            packed,
            params: params_t,
            cache: (0..cfg.n_layer)
                .map(|_| z(t * 3 * c, 3 * c))
                .collect::<Result<_>>()?,
            ids: be.zeros_typed(t, t, DType::U32)?,
            x: z(t * c, c)?,
            ln: z(t * c, c)?,
            stats: z(2 * t, 1)?,
            atty: z(t * c, c)?,
            tmp: z(t * c, c)?,
            fc: z(t * 4 * c, 4 * c)?,
            act: z(t * 4 * c, 4 * c)?,
            logits: z(cfg.vocab_size, cfg.vocab_size)?,
            cfg: cfg.clone(),
            layout,
            pos: 0,
        })
    }

    /// Positions already in the cache.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Clears the cache and runs `tokens` (at most block_size) from position 0; returns the logits after
    /// the last one.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn prefill(&mut self, be: &Backend, tokens: &[u32]) -> Result<Vec<f32>> {
        self.pos = 0;
        self.forward(be, tokens)
    }

    /// Appends one token; returns the logits after it.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn step(&mut self, be: &Backend, token: u32) -> Result<Vec<f32>> {
        self.forward(be, &[token])
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn forward(&mut self, be: &Backend, tokens: &[u32]) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let (t, c, v, h) = (cfg.block_size, cfg.n_embd, cfg.vocab_size, cfg.n_head);
        let (r, p) = (tokens.len(), self.pos);
        if r == 0 || p + r > t {
            return Err(Error::Shape {
                op: "gpt forward",
                msg: format!("{r} tokens at position {p} do not fit the block of {t}"),
            });
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= v) {
            return Err(Error::Shape {
                op: "gpt forward",
                msg: format!("token id {bad} is outside the vocabulary of {v}"),
            });
        }
        let lay = &self.layout;
        let w = &self.params;
        let pk = self.packed.as_ref();
        be.write_u32(self.ids.at_mut(0), tokens)?;
        let emb = EmbedShape {
            tokens: r,
            vocab: v,
            dim: c,
            scale: 1.0,
        };
        let pos = Positions {
            table: w.at(lay.wpe()),
            rows: t,
            period: t,
            pos0: p,
        };
        embedding(
            be,
            self.ids.at(0),
            w.at(lay.wte()),
            Some(pos),
            self.x.at_mut(0),
            emb,
        )?;
        let norm = NormShape {
            rows: r,
            cols: c,
            eps: 1e-5,
        };
        let hd = cfg.head_dim();
        for l in 0..cfg.n_layer {
            let o = lay.block(l);
            let kv = &mut self.cache[l];
            norm_forward(
                be,
                NormKind::Layer,
                self.x.at(0),
                w.at(o.ln_1),
                self.ln.at_mut(0),
                self.stats.at_mut(0),
                norm,
            )?;
            linear(
                be,
                w,
                pk,
                self.ln.at(0),
                o.c_attn,
                kv.at_mut(p * 3 * c),
                &Gemm::nt(r, 3 * c, c).ldc(3 * c),
                true,
            )?;
            let d = DecodeShape {
                rows: r,
                heads: h,
                kv_heads: h,
                head_dim: hd,
                ld_q: 3 * c,
                ld_kv: 3 * c,
                ld_o: c,
                q_pos0: p,
                kv_len: p + r,
                window: 0,
                scale: 1.0 / (hd as f32).sqrt(),
                softcap: 0.0,
            };
            attend(
                be,
                kv.at(p * 3 * c),
                kv.at(c),
                kv.at(2 * c),
                self.atty.at_mut(0),
                d,
            )?;
            linear(
                be,
                w,
                pk,
                self.atty.at(0),
                o.attn_proj,
                self.tmp.at_mut(0),
                &Gemm::nt(r, c, c),
                true,
            )?;
            add_assign(be, self.x.at_mut(0), self.tmp.at(0), r * c, 1.0)?;
            norm_forward(
                be,
                NormKind::Layer,
                self.x.at(0),
                w.at(o.ln_2),
                self.ln.at_mut(0),
                self.stats.at_mut(0),
                norm,
            )?;
            linear(
                be,
                w,
                pk,
                self.ln.at(0),
                o.c_fc,
                self.fc.at_mut(0),
                &Gemm::nt(r, 4 * c, c),
                true,
            )?;
            gelu(be, self.fc.at(0), self.act.at_mut(0), r * 4 * c)?;
            linear(
                be,
                w,
                pk,
                self.act.at(0),
                o.mlp_proj,
                self.tmp.at_mut(0),
                &Gemm::nt(r, c, 4 * c),
                true,
            )?;
            add_assign(be, self.x.at_mut(0), self.tmp.at(0), r * c, 1.0)?;
        }
        let last = NormShape {
            rows: 1,
            cols: c,
            eps: 1e-5,
        };
        norm_forward(
            be,
            NormKind::Layer,
            self.x.at((r - 1) * c),
            w.at(lay.ln_f()),
            self.ln.at_mut(0),
            self.stats.at_mut(0),
            last,
        )?;
        matmul(
            be,
            self.ln.at(0),
            w.at(lay.wte()),
            self.logits.at_mut(0),
            &Gemm::nt(1, v, c),
        )?;
        self.pos += r;
        pollster::block_on(be.read_f32(self.logits.at(0), v))
    }

    /// Generates `n` tokens after `prompt`, calling `emit` with each as it is sampled. When the block
    /// fills up, the cache restarts from the last half block of context (the model has learned
    /// positions only up to block_size).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn generate(
        &mut self,
        be: &Backend,
        prompt: &[u32],
        n: usize,
        sampler: &mut Sampler,
        mut emit: impl FnMut(u32) -> Result<()>,
    ) -> Result<()> {
        let t = self.cfg.block_size;
        let mut ctx: Vec<u32> = prompt.to_vec();
        let start = ctx.len().saturating_sub(t);
        let mut logits = self.prefill(be, &ctx[start..])?;
        for _ in 0..n {
            let next = sampler.sample(&logits);
            emit(next)?;
            ctx.push(next);
            logits = if self.pos < t {
                self.step(be, next)?
            } else {
                let keep = t / 2;
                self.prefill(be, &ctx[ctx.len() - keep..])?
            };
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpt::train::{OptimConfig, Trainer};
    use tinygpt_kernels::testing::{assert_nmse, cpu_backend, gpu_backend};

    /// Decoding one token at a time through the cache gives the logits of a full pass over each prefix,
    /// and those agree with the training forward pass's loss.
    #[test]
    fn cached_decoding_matches_the_training_forward_pass() {
        let cfg = GptConfig {
            vocab_size: 9,
            block_size: 8,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            dropout: 0.0,
        };
        let params = Layout::new(&cfg).init(&cfg, 11);
        let ids: Vec<u32> = vec![1, 4, 2, 8, 0, 3, 3, 5];
        let mut backends = vec![cpu_backend()];
        backends.extend(gpu_backend(None));
        // Reference: a fresh full-prompt pass for every prefix, on the CPU.
        let cpu = cpu_backend();
        let mut reference = Vec::new();
        for k in 1..=ids.len() {
            let mut r = GptRunner::new(&cpu, &cfg, &params).unwrap();
            reference.push(r.prefill(&cpu, &ids[..k]).unwrap());
        }
        for be in &backends {
            let mut r = GptRunner::new(be, &cfg, &params).unwrap();
            let mut got = vec![r.prefill(be, &ids[..1]).unwrap()];
            for &id in &ids[1..] {
                got.push(r.step(be, id).unwrap());
            }
            for (k, (a, b)) in reference.iter().zip(&got).enumerate() {
                assert_nmse(&format!("{} position {k}", be.kind()), a, b, 1e-10);
            }
        }
        // The prefill's last logits agree with the trainer's loss: cross-entropy of the training
        // forward pass at the last position equals -log softmax(logits)[target].
        let mut tr = Trainer::new(&cpu, &cfg, 1, &params, None, OptimConfig::default()).unwrap();
        let targets: Vec<u32> = vec![u32::MAX; 7].into_iter().chain([6]).collect();
        let loss = tr.eval_loss(&cpu, &ids, &targets).unwrap() as f64 * 8.0;
        let l = &reference[7];
        let m = l.iter().fold(f32::MIN, |m, &x| m.max(x)) as f64;
        let lse = m + l.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        assert!(
            (loss - (lse - l[6] as f64)).abs() < 1e-4,
            "{loss} vs {}",
            lse - l[6] as f64
        );
    }

    /// With the f16-storage (and shader-f16) paths on, the block matrices come from f16 copies: the logits
    /// stay within the precision those paths promise, and the f32 head is untouched.
    #[test]
    fn f16_weight_paths_stay_close_to_f32() {
        let Some(gpu) = gpu_backend(None) else { return };
        let g = gpu.as_gpu().expect("gpu");
        let cfg = GptConfig {
            vocab_size: 9,
            block_size: 8,
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            dropout: 0.0,
        };
        let params = Layout::new(&cfg).init(&cfg, 12);
        let ids = [1u32, 4, 2, 8, 0, 3];
        let cpu = cpu_backend();
        let want = GptRunner::new(&cpu, &cfg, &params)
            .unwrap()
            .prefill(&cpu, &ids)
            .unwrap();
        for shader in [false, true] {
            g.set_path_active(PathId::F16Storage, true);
            g.set_path_active(
                PathId::ShaderF16,
                shader && g.has_feature(wgpu_shader_f16()),
            );
            let mut r = GptRunner::new(&gpu, &cfg, &params).unwrap();
            assert!(r.packed.is_some());
            let got = r.prefill(&gpu, &ids).unwrap();
            assert_nmse("f16 weights", &want, &got, 1e-5);
            let one = r.step(&gpu, 5).unwrap();
            assert!(one.iter().all(|v| v.is_finite()));
        }
    }

    fn wgpu_shader_f16() -> tinygpt_kernels::wgpu::Features {
        tinygpt_kernels::wgpu::Features::SHADER_F16
    }

    #[test]
    fn generation_runs_past_the_block_and_refuses_bad_input() {
        let cfg = GptConfig {
            vocab_size: 5,
            block_size: 4,
            n_layer: 1,
            n_head: 1,
            n_embd: 4,
            dropout: 0.0,
        };
        let params = Layout::new(&cfg).init(&cfg, 2);
        let be = cpu_backend();
        let mut r = GptRunner::new(&be, &cfg, &params).unwrap();
        let mut s = Sampler::new(crate::sampler::SamplerConfig::default());
        let mut out = Vec::new();
        r.generate(&be, &[1, 2, 3, 4, 0, 1], 10, &mut s, |t| {
            out.push(t);
            Ok(())
        })
        .unwrap();
        assert_eq!(out.len(), 10);
        assert!(out.iter().all(|&t| t < 5));
        assert!(
            r.prefill(&be, &[7]).is_err(),
            "ids outside the vocabulary are refused"
        );
        assert!(
            r.prefill(&be, &[1; 5]).is_err(),
            "more tokens than the block are refused"
        );
    }
}
