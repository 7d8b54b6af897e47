//! Sampling from a trained GPT with a KV cache: the prompt is processed in one pass, then each new
//! token costs one row through every layer — the same [`block_forward`] training runs, with its
//! attention reading keys and values from the cache.
//!
//! Each layer's cache is simply its QKV rows `[block_size, 3 · n_embd]`: the projection writes new rows
//! straight into it and attention reads keys and values from it in place.

use super::block::{Attention, BlockActs, Dims, EPS, Params, ResidualDropout, block_forward};
use super::config::GptConfig;
use super::layout::Layout;
use crate::llm::{DriftEvent, GptDriftGuard};
use crate::sampler::Sampler;
use tinygpt_kernels::ops::embedding::{EmbedShape, Positions, embedding};
use tinygpt_kernels::ops::matmul::{Gemm, matmul, pack_f16, packed_len};
use tinygpt_kernels::ops::norm::{NormKind, NormShape, norm_forward};
use tinygpt_kernels::path::Fault;
use tinygpt_kernels::{Backend, DType, Error, PathId, PathSet, Result, Tensor};

/// A model loaded for inference on a backend, with its KV cache.
pub struct GptRunner {
    pub cfg: GptConfig,
    layout: Layout,
    params: Tensor,
    /// The parameters as f16 pairs, when the runner's paths include f16 storage on a GPU: the block
    /// matrices are then read from here (the tied head stays f32).
    packed: Option<Tensor>,
    paths: PathSet,
    cache: Vec<Tensor>,
    ids: Tensor,
    /// The residual stream entering and leaving a block (swapped after each one).
    x: Tensor,
    xout: Tensor,
    acts: BlockActs,
    tmp: Tensor,
    logits: Tensor,
    /// Cached positions.
    pos: usize,
    /// The token at each cached position.
    tokens: Vec<u32>,
}

/// Another sequence's KV cache and position, for a runner serving several sequences in turn
/// ([`GptRunner::with_sequence`]).
pub struct GptSequence {
    cache: Vec<Tensor>,
    pos: usize,
    tokens: Vec<u32>,
}

impl GptSequence {
    /// Positions in its cache.
    pub fn position(&self) -> usize {
        self.pos
    }
}

/// The f16 copy of `params` when `paths` reads weights as f16 on a GPU (re-packed by the caller
/// whenever the f32 parameters change).
pub(crate) fn packed_copy(be: &Backend, params: &Tensor, paths: PathSet) -> Result<Option<Tensor>> {
    if be.as_gpu().is_none() || !paths.has(PathId::F16Storage) {
        return Ok(None);
    }
    let mut p = be.zeros_typed(packed_len(params.len()), 1, DType::U32)?;
    pack_f16(be, params.at(0), p.at_mut(0), params.len())?;
    Ok(Some(p))
}

/// `params` on the backend for a runner on `paths`. A planted [`Fault::PositionsPast200`] (tests only)
/// scales the position embeddings from position 200 on, more with every position.
fn upload_params(
    be: &Backend,
    cfg: &GptConfig,
    layout: &Layout,
    params: &[f32],
    paths: PathSet,
) -> Result<Tensor> {
    if paths.fault() != Some(Fault::PositionsPast200) {
        return be.from_f32(params, layout.unit);
    }
    let mut p = params.to_vec();
    let (start, c) = (layout.wpe(), cfg.n_embd);
    for (pos, row) in p[start..start + cfg.block_size * c]
        .chunks_mut(c)
        .enumerate()
        .skip(200)
    {
        let scale = 1.0 + (pos - 199) as f32 / 4.0;
        row.iter_mut().for_each(|x| *x *= scale);
    }
    be.from_f32(&p, layout.unit)
}

impl GptRunner {
    /// Tokens a generation keeps when its cache is full: it restarts from the last half block (at
    /// least the last token, so a model of block 1 generates too).
    pub fn restart_len(&self) -> usize {
        (self.cfg.block_size / 2).max(1)
    }

    /// Uploads `params` (host, [`Layout`] order) and plans buffers for a full block; every product runs
    /// on the kernels of `paths`.
    pub fn new(be: &Backend, cfg: &GptConfig, params: &[f32], paths: PathSet) -> Result<Self> {
        // The tensor-core training path is a trainer's (its f16 operands are gated by training).
        let paths = paths.without(PathId::MixedTraining);
        let layout = Layout::new(cfg);
        let (t, c) = (cfg.block_size, cfg.n_embd);
        let z = |n: usize, unit: usize| be.zeros(n, unit);
        let params_t = upload_params(be, cfg, &layout, params, paths)?;
        Ok(GptRunner {
            packed: packed_copy(be, &params_t, paths)?,
            paths,
            params: params_t,
            cache: (0..cfg.n_layer)
                .map(|_| z(t * 3 * c, 3 * c))
                .collect::<Result<_>>()?,
            ids: be.zeros_typed(t, t, DType::U32)?,
            x: z(t * c, c)?,
            xout: z(t * c, c)?,
            acts: BlockActs::new(be, t, c, 1, false, false)?,
            tmp: z(t * c, c)?,
            logits: z(cfg.vocab_size, cfg.vocab_size)?,
            cfg: cfg.clone(),
            layout,
            pos: 0,
            tokens: Vec::new(),
        })
    }

    /// Positions already in the cache.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// The fast paths the runner uses.
    pub fn paths(&self) -> PathSet {
        self.paths
    }

    /// Forgets every cached position.
    pub fn reset(&mut self) {
        self.pos = 0;
        self.tokens.clear();
    }

    /// The token at each cached position.
    pub fn history(&self) -> &[u32] {
        &self.tokens
    }

    /// Each layer's cache rows (QKV, `3 · n_embd` values a position) of positions `from .. from + n`.
    pub async fn read_cache(&self, be: &Backend, from: usize, n: usize) -> Result<Vec<Vec<f32>>> {
        let w = 3 * self.cfg.n_embd;
        if from + n > self.pos {
            return Err(Error::Shape {
                op: "gpt cache",
                msg: format!("rows {from}..{} of {} cached", from + n, self.pos),
            });
        }
        if n == 0 {
            return Ok(vec![Vec::new(); self.cache.len()]);
        }
        // Every layer's rows in one read (one submission, one staging buffer).
        let views = self
            .cache
            .iter()
            .map(|c| (c.at(from * w), n * w))
            .collect::<Vec<_>>();
        let read = be.read_start_many(&views)?;
        be.read_finish_many_f32(read, &vec![n * w; views.len()])
            .await
    }

    /// Writes each layer's cache rows `rows[l]` (of the tokens `tokens`) at positions `from ..`: the
    /// cache then holds the positions up to the last one written (as if those tokens had been fed).
    pub fn write_cache(
        &mut self,
        be: &Backend,
        from: usize,
        rows: &[Vec<f32>],
        tokens: &[u32],
    ) -> Result<()> {
        let w = 3 * self.cfg.n_embd;
        let n = tokens.len();
        if from > self.pos
            || from + n > self.cfg.block_size
            || rows.len() != self.cache.len()
            || rows.iter().any(|r| r.len() != n * w)
        {
            return Err(Error::Shape {
                op: "gpt cache",
                msg: format!(
                    "{} layers of rows for {n} tokens at position {from} do not fit a cache of {} \
                     positions, {} held",
                    rows.len(),
                    self.cfg.block_size,
                    self.pos
                ),
            });
        }
        if n > 0 {
            for (c, r) in self.cache.iter_mut().zip(rows) {
                be.write_f32(c.at_mut(from * w), r)?;
            }
        }
        self.tokens.truncate(from);
        self.tokens.extend_from_slice(tokens);
        self.pos = from + n;
        Ok(())
    }

    /// Moves the runner to the kernels of `paths`, its weights uploaded again from `params` (the host
    /// copy it was made from) and its cache recomputed from the tokens it holds, so its logits are then
    /// those of `paths` after the same tokens.
    pub fn switch_paths(&mut self, be: &Backend, params: &[f32], paths: PathSet) -> Result<()> {
        let paths = paths.without(PathId::MixedTraining);
        if params.len() != self.params.len() {
            return Err(Error::Shape {
                op: "gpt switch",
                msg: format!(
                    "{} parameters for a model of {}",
                    params.len(),
                    self.params.len()
                ),
            });
        }
        self.params = upload_params(be, &self.cfg, &self.layout, params, paths)?;
        self.packed = packed_copy(be, &self.params, paths)?;
        self.paths = paths;
        let tokens = std::mem::take(&mut self.tokens);
        self.pos = 0;
        if !tokens.is_empty() {
            self.feed(be, &tokens)?;
        }
        Ok(())
    }

    /// A new, empty sequence with a cache of its own.
    pub fn new_sequence(&self, be: &Backend) -> Result<GptSequence> {
        let (t, c) = (self.cfg.block_size, self.cfg.n_embd);
        Ok(GptSequence {
            cache: (0..self.cfg.n_layer)
                .map(|_| be.zeros(t * 3 * c, 3 * c))
                .collect::<Result<_>>()?,
            pos: 0,
            tokens: Vec::new(),
        })
    }

    /// Runs `f` with `seq`'s cache and position in place of the runner's own (a swap of handles: nothing
    /// is copied), so one set of weights serves many sequences.
    pub fn with_sequence<R>(&mut self, seq: &mut GptSequence, f: impl FnOnce(&mut Self) -> R) -> R {
        std::mem::swap(&mut self.cache, &mut seq.cache);
        std::mem::swap(&mut self.pos, &mut seq.pos);
        std::mem::swap(&mut self.tokens, &mut seq.tokens);
        let r = f(self);
        std::mem::swap(&mut self.cache, &mut seq.cache);
        std::mem::swap(&mut self.pos, &mut seq.pos);
        std::mem::swap(&mut self.tokens, &mut seq.tokens);
        r
    }

    /// Records the pass of `tokens` at the next positions (at most what is left of the block); the
    /// logits after the last one are then ready for [`GptRunner::read_logits`].
    pub fn feed(&mut self, be: &Backend, tokens: &[u32]) -> Result<()> {
        let cfg = &self.cfg;
        let (t, c, v) = (cfg.block_size, cfg.n_embd, cfg.vocab_size);
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
        let w = Params {
            f32: &self.params,
            f16: self.packed.as_ref(),
            paths: self.paths,
        };
        be.write_u32(self.ids.at_mut(0), tokens)?;
        let emb = EmbedShape {
            tokens: r,
            vocab: v,
            dim: c,
            scale: 1.0,
        };
        let pos = Positions {
            table: self.params.at(lay.wpe()),
            rows: t,
            period: t,
            pos0: p,
        };
        let wte = self.params.at(lay.wte());
        embedding(be, self.ids.at(0), wte, Some(pos), self.x.at_mut(0), emb)?;
        let d = Dims {
            rows: r,
            c,
            heads: cfg.n_head,
        };
        for (l, cache) in self.cache.iter_mut().enumerate() {
            let attn = Attention::Cached { cache, pos: p };
            let (x, out) = (self.x.at(0), self.xout.at_mut(0));
            let none = ResidualDropout::NONE;
            let acts = &mut self.acts;
            block_forward(
                be,
                w,
                lay.block(l),
                d,
                x,
                out,
                acts,
                attn,
                none,
                &mut self.tmp,
            )?;
            std::mem::swap(&mut self.x, &mut self.xout);
        }
        // Final LayerNorm and the tied head, for the last row only.
        let last = NormShape {
            rows: 1,
            cols: c,
            eps: EPS,
        };
        let (ln, stats) = (self.acts.ln1.at_mut(0), self.acts.ln1_stats.at_mut(0));
        let x_last = self.x.at((r - 1) * c);
        norm_forward(
            be,
            NormKind::Layer,
            x_last,
            self.params.at(lay.ln_f()),
            ln,
            stats,
            last,
        )?;
        let head = Gemm::nt(1, v, c);
        matmul(
            be,
            self.paths,
            self.acts.ln1.at(0),
            wte,
            self.logits.at_mut(0),
            &head,
        )?;
        self.pos += r;
        self.tokens.truncate(p);
        self.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// The logits after the last token fed.
    pub async fn read_logits(&self, be: &Backend) -> Result<Vec<f32>> {
        be.read_f32(self.logits.at(0), self.cfg.vocab_size).await
    }

    /// Clears the cache and runs `tokens` (at most block_size) from position 0; returns the logits after
    /// the last one.
    pub async fn prefill_async(&mut self, be: &Backend, tokens: &[u32]) -> Result<Vec<f32>> {
        self.reset();
        self.feed(be, tokens)?;
        self.read_logits(be).await
    }

    /// Appends one token; returns the logits after it.
    pub async fn step_async(&mut self, be: &Backend, token: u32) -> Result<Vec<f32>> {
        self.feed(be, &[token])?;
        self.read_logits(be).await
    }

    /// [`GptRunner::prefill_async`], blocking (native).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn prefill(&mut self, be: &Backend, tokens: &[u32]) -> Result<Vec<f32>> {
        pollster::block_on(self.prefill_async(be, tokens))
    }

    /// [`GptRunner::step_async`], blocking (native).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn step(&mut self, be: &Backend, token: u32) -> Result<Vec<f32>> {
        pollster::block_on(self.step_async(be, token))
    }

    /// Generates `n` tokens after `prompt`, awaiting `emit` with each as it is sampled (an error from
    /// `emit` stops generation). When the block fills up, the cache restarts from the last half block of
    /// context (the model has learned positions only up to block_size).
    pub async fn generate_async(
        &mut self,
        be: &Backend,
        prompt: &[u32],
        n: usize,
        sampler: &mut Sampler,
        emit: impl AsyncFnMut(u32) -> Result<()>,
    ) -> Result<()> {
        self.generate_guarded_async(be, prompt, n, sampler, None, |_| {}, emit)
            .await
    }

    /// [`GptRunner::generate_async`] watched by a drift guard while the runner is on fast paths: when
    /// a check passes its bound the runner moves to the f32 path, `on_drift` hears of it, and the
    /// generation goes on from the f32 path's logits after the same tokens.
    #[allow(clippy::too_many_arguments)]
    pub async fn generate_guarded_async(
        &mut self,
        be: &Backend,
        prompt: &[u32],
        n: usize,
        sampler: &mut Sampler,
        mut guard: Option<&mut GptDriftGuard>,
        mut on_drift: impl FnMut(&DriftEvent),
        mut emit: impl AsyncFnMut(u32) -> Result<()>,
    ) -> Result<()> {
        let t = self.cfg.block_size;
        let mut ctx: Vec<u32> = prompt.to_vec();
        let start = ctx.len().saturating_sub(t);
        let mut logits = self.prefill_async(be, &ctx[start..]).await?;
        for _ in 0..n {
            let next = sampler.sample(&logits);
            emit(next).await?;
            ctx.push(next);
            logits = if self.pos < t {
                self.step_async(be, next).await?
            } else {
                let keep = self.restart_len();
                self.prefill_async(be, &ctx[ctx.len() - keep..]).await?
            };
            if let Some(g) = guard.as_deref_mut()
                && let Some(e) = g.after_step(be, self, &logits).await?
            {
                on_drift(&e);
                logits = self.read_logits(be).await?;
            }
        }
        Ok(())
    }

    /// [`GptRunner::generate_async`], blocking (native).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn generate(
        &mut self,
        be: &Backend,
        prompt: &[u32],
        n: usize,
        sampler: &mut Sampler,
        mut emit: impl FnMut(u32) -> Result<()>,
    ) -> Result<()> {
        pollster::block_on(self.generate_async(be, prompt, n, sampler, async |t| emit(t)))
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
            let mut r = GptRunner::new(&cpu, &cfg, &params, PathSet::F32).unwrap();
            reference.push(r.prefill(&cpu, &ids[..k]).unwrap());
        }
        for be in &backends {
            let mut r = GptRunner::new(be, &cfg, &params, PathSet::F32).unwrap();
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
        let mut tr = Trainer::new(
            &cpu,
            &cfg,
            1,
            &params,
            None,
            OptimConfig::default(),
            PathSet::F32,
        )
        .unwrap();
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
        let want = GptRunner::new(&cpu, &cfg, &params, PathSet::F32)
            .unwrap()
            .prefill(&cpu, &ids)
            .unwrap();
        for shader in [false, true] {
            let mut paths = PathSet::of(&[PathId::F16Storage]);
            if shader && g.has_feature(wgpu_shader_f16()) {
                paths = paths.with(PathId::ShaderF16);
            }
            let mut r = GptRunner::new(&gpu, &cfg, &params, paths).unwrap();
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
        let mut r = GptRunner::new(&be, &cfg, &params, PathSet::F32).unwrap();
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
