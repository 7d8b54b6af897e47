//! Training: the forward pass, the backward pass and the AdamW step, all recorded into one submission
//! per step on the GPU (or run directly on the CPU backend), with every buffer planned up front.
//!
//! Reading the functions top to bottom is reading the model: `forward` walks embedding → blocks
//! ([`block_forward`], the same one inference runs) → final LayerNorm → tied head → cross-entropy;
//! `backward` walks the same path in reverse.

use super::block::{
    Act, Attention, BackScratch, BlockActs, Dims, EPS, Params, ResidualDropout, SavedAttention,
    block_backward, block_forward, linear_backward,
};
use super::config::GptConfig;
use super::infer::packed_copy;
use super::layout::Layout;
use tinygpt_kernels::ops::Grad;
use tinygpt_kernels::ops::adamw::{AdamW, Clip, adamw};
use tinygpt_kernels::ops::attention::AttnShape;
use tinygpt_kernels::ops::cross_entropy::cross_entropy;
use tinygpt_kernels::ops::dropout::{dropout, hash};
use tinygpt_kernels::ops::embedding::{
    EmbedShape, GradIndex, Positions, embedding, embedding_backward,
};
use tinygpt_kernels::ops::matmul::{Gemm, matmul, pack_f16, packed_len};
use tinygpt_kernels::ops::norm::{NormKind, NormShape, norm_backward, norm_forward};
use tinygpt_kernels::ops::reduce::{Reduce, reduce};
use tinygpt_kernels::{Backend, DType, PathId, PathSet, Result, Tensor};

/// Optimizer settings (nanoGPT's shakespeare-char recipe by default).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub grad_clip: f32,
    /// Read the forward pass's block matrices from an f16 copy (re-packed every step) when the path set
    /// has f16 storage. Off by default: a training batch's activations dwarf its weights, so halving
    /// weight reads does not pay for the packing (measured on an H200, docs/perf.md).
    pub f16_forward: bool,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: 1.0,
            f16_forward: false,
        }
    }
}

/// A layer's `dropped`: f16 pairs of what P·V reads with `pairs`, else the dropped-out probabilities
/// where there is dropout.
fn dropped_probs(
    be: &Backend,
    len: usize,
    unit: usize,
    cfg: &GptConfig,
    pairs: bool,
) -> Result<Option<Tensor>> {
    Ok(if pairs {
        Some(be.zeros_typed(packed_len(len), unit / 2, DType::U32)?)
    } else if cfg.dropout > 0.0 {
        Some(be.zeros(len, unit)?)
    } else {
        None
    })
}

/// One layer's saved activations: the block's input, its activations, and what its attention kept.
struct LayerActs {
    x: Tensor, // residual stream entering the block [N, C]
    acts: BlockActs,
    qkv: Tensor, // [N, 3C]; f16 pairs with `Trainer::probs_pairs` (only attention reads it)
    probs: Tensor, // [B, H, T, T]
    /// With dropout, the dropped-out probabilities; with `Trainer::probs_pairs`, the values P·V reads
    /// (dropped-out or not) as f16 pairs.
    dropped: Option<Tensor>,
}

/// Everything a training step needs, allocated once for a batch size.
pub struct Trainer {
    pub cfg: GptConfig,
    pub layout: Layout,
    pub batch: usize,
    pub optim: OptimConfig,
    pub params: Tensor,
    pub grads: Tensor,
    m: Tensor,
    v: Tensor,
    /// AdamW steps taken so far.
    pub step: u32,
    /// The fast paths the products run on (f32 unless the tensor-core training path is held).
    paths: PathSet,
    /// The loss's gradient is multiplied by this power of two before the backward pass (loss scaling,
    /// so f16 operands hold per-token gradients of order one) and divided out in the optimizer step:
    /// the token count rounded to a power of two with the tensor-core training path, else 1.
    loss_scale: f32,
    ids: Tensor,
    targets: Tensor,
    index: GradIndex,
    layers: Vec<LayerActs>,
    x_final: Tensor,
    lnf: Tensor,
    lnf_stats: Tensor,
    logits: Tensor,
    losses: Tensor,
    /// [0]: mean loss of the last forward pass; [1]: squared global gradient norm.
    stats: Tensor,
    /// [N, C] f32 scratch: the embedding's output and its gradient, each block's projection outputs.
    tmp: Tensor,
    // Scratch for the backward pass.
    back: BackScratch,
    /// Attention's T x T operands kept as f16 pairs (see `LayerActs::dropped`).
    probs_pairs: bool,
    dresid: Tensor,
    dlogits: Tensor,
    /// f16 copy of the parameters for the block matrices: the forward pass's with `f16_forward` and the
    /// f16-storage path, both passes' on the tensor-core training path; re-packed at the top of every
    /// forward pass, so it is never stale.
    packed: Option<Tensor>,
}

/// The dropout seed of (run seed, step, layer, site): every mask differs, and is the same on every
/// backend and in a resumed run.
fn drop_seed(seed: u32, step: u32, layer: usize, site: u32) -> u32 {
    hash(
        seed ^ hash(
            step.wrapping_mul(1024)
                .wrapping_add(layer as u32 * 8 + site),
        ),
    )
}

impl Trainer {
    /// The paths of `paths` a trainer with `optim` uses: never the inference kernel's f16 weights on
    /// the tensor cores, f16 weights elsewhere only with `optim.f16_forward`.
    pub fn training_paths(paths: PathSet, optim: &OptimConfig) -> PathSet {
        let paths = paths.without(PathId::CoopMatrix);
        if optim.f16_forward {
            paths
        } else {
            paths.without(PathId::F16Storage).without(PathId::ShaderF16)
        }
    }

    /// Plans every buffer for batches of `batch` sequences, starting from `params` (host, in
    /// [`Layout`] order) and, when resuming, the optimizer moments and step. The products use the fast
    /// paths of `paths` that suit training: f16 weights only with `optim.f16_forward`, the tensor cores
    /// only through the training path ([`PathId::MixedTraining`], f16 operands of f32 tensors, which
    /// must have passed the training gate), never the inference kernel's f16 weights.
    pub fn new(
        be: &Backend,
        cfg: &GptConfig,
        batch: usize,
        params: &[f32],
        moments: Option<(&[f32], &[f32], u32)>,
        optim: OptimConfig,
        paths: PathSet,
    ) -> Result<Self> {
        let layout = Layout::new(cfg);
        assert_eq!(
            params.len(),
            layout.total,
            "parameters do not match the layout"
        );
        let paths = Self::training_paths(paths, &optim);
        let (t, c, h, v) = (cfg.block_size, cfg.n_embd, cfg.n_head, cfg.vocab_size);
        let n = batch * t;
        let loss_scale = if paths.has(PathId::MixedTraining) {
            (n.max(1) as f32).log2().round().exp2()
        } else {
            1.0
        };
        let shape = AttnShape {
            batch,
            t,
            heads: h,
            head_dim: cfg.head_dim(),
        };
        let probs_unit = h * t * t;
        // On the tensor-core training path the norms' and the GELU's outputs, and the gradients at
        // the outputs of attn_proj, c_fc and mlp_proj, are read only by tensor-core products: kept as
        // the f16 values those stage.
        let act_f16 = be.as_gpu().is_some() && paths.has(PathId::MixedTraining);
        // So are attention's T x T operands of P·V, dV = Pᵀ·dY, dS·K and dSᵀ·Q (rows of even length),
        // and the products' outputs only tensor-core products read: Q, K and V (attention's), its
        // output (attn_proj's input), the gradient at its output (attn_proj's dX, read by dV and
        // dP) and the gradient dQKV (c_attn's backward products').
        let probs_pairs = act_f16 && t.is_multiple_of(2) && c.is_multiple_of(2);
        let z = |len: usize, unit: usize| be.zeros(len, unit);
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for _ in 0..cfg.n_layer {
            layers.push(LayerActs {
                x: z(n * c, t * c)?,
                acts: BlockActs::new(be, n, c, t, act_f16, probs_pairs)?,
                qkv: Act::zeros(be, n * 3 * c, t * 3 * c, probs_pairs)?,
                probs: z(shape.probs_len(), probs_unit)?,
                dropped: dropped_probs(be, shape.probs_len(), probs_unit, cfg, probs_pairs)?,
            });
        }
        let (m, vv, step) = match moments {
            Some((m, v, s)) => (
                be.from_f32(m, layout.unit)?,
                be.from_f32(v, layout.unit)?,
                s,
            ),
            None => (
                z(layout.total, layout.unit)?,
                z(layout.total, layout.unit)?,
                0,
            ),
        };
        let params = be.from_f32(params, layout.unit)?;
        // The tensor-core training path reads the block matrices from the f16 copy too: the values its
        // kernel would stage from the f32 weights, in half the bytes.
        let copy_paths = if paths.has(PathId::MixedTraining) {
            paths.with(PathId::F16Storage)
        } else {
            paths
        };
        Ok(Trainer {
            packed: packed_copy(be, &params, copy_paths)?,
            params,
            grads: z(layout.total, layout.unit)?,
            m,
            v: vv,
            step,
            paths,
            loss_scale,
            ids: be.zeros_typed(n, t, DType::U32)?,
            targets: be.zeros_typed(n, t, DType::U32)?,
            index: GradIndex::new(be, n, v)?,
            layers,
            x_final: z(n * c, c)?,
            lnf: z(n * c, c)?,
            lnf_stats: z(2 * n, 1)?,
            logits: z(n * v, v)?,
            losses: z(n, 1)?,
            stats: z(2, 1)?,
            tmp: z(n * c, t * c)?,
            back: BackScratch::new(
                be,
                (n, c, t),
                (shape.probs_len(), probs_unit, probs_pairs),
                act_f16,
            )?,
            probs_pairs,
            dresid: z(n * c, t * c)?,
            dlogits: z(n * v, v)?,
            cfg: cfg.clone(),
            layout,
            batch,
            optim,
        })
    }

    fn tokens(&self) -> usize {
        self.batch * self.cfg.block_size
    }

    /// The fast paths the forward pass runs on.
    pub fn paths(&self) -> PathSet {
        self.paths
    }

    /// Keeps the products' inputs and output gradients as f32 (as every path but the tensor-core one
    /// does), for tests that hold the f16 pairs to the values they replace.
    #[cfg(test)]
    fn keep_f32_activations(&mut self, be: &Backend) -> Result<()> {
        let (t, c, n) = (
            self.cfg.block_size,
            self.cfg.n_embd,
            self.batch * self.cfg.block_size,
        );
        let (probs, unit) = (self.attn_shape().probs_len(), self.cfg.n_head * t * t);
        for l in &mut self.layers {
            l.acts = BlockActs::new(be, n, c, t, false, false)?;
            l.qkv = be.zeros(n * 3 * c, t * 3 * c)?;
            l.dropped = dropped_probs(be, probs, unit, &self.cfg, false)?;
        }
        self.back = BackScratch::new(be, (n, c, t), (probs, unit, false), false)?;
        self.probs_pairs = false;
        Ok(())
    }

    fn attn_shape(&self) -> AttnShape {
        AttnShape {
            batch: self.batch,
            t: self.cfg.block_size,
            heads: self.cfg.n_head,
            head_dim: self.cfg.head_dim(),
        }
    }

    fn dims(&self) -> Dims {
        Dims {
            rows: self.tokens(),
            c: self.cfg.n_embd,
            heads: self.cfg.n_head,
        }
    }

    /// Dropout of layer `l`'s residual branches at this step (none outside training).
    fn residual_dropout(&self, l: usize, p: f32, seed: u32) -> ResidualDropout {
        ResidualDropout {
            p,
            attn_seed: drop_seed(seed, self.step, l, 2),
            mlp_seed: drop_seed(seed, self.step, l, 3),
        }
    }

    /// Uploads a batch (ids and targets, `batch · block_size` each).
    pub fn set_batch(
        &mut self,
        be: &Backend,
        ids: &[u32],
        targets: &[u32],
        with_grad_index: bool,
    ) -> Result<()> {
        be.write_u32(self.ids.at_mut(0), ids)?;
        be.write_u32(self.targets.at_mut(0), targets)?;
        if with_grad_index {
            self.index.set(be, ids)?;
        }
        Ok(())
    }

    /// Records the forward pass for the uploaded batch; the mean loss lands in `stats[0]`. With
    /// `train`, dropout is on (seeded by `seed` and the step) and the logits' gradient is computed.
    pub fn forward(&mut self, be: &Backend, train: bool, seed: u32) -> Result<()> {
        let (t, c, v) = (self.cfg.block_size, self.cfg.n_embd, self.cfg.vocab_size);
        let (n, n_layer) = (self.tokens(), self.cfg.n_layer);
        let p = if train { self.cfg.dropout } else { 0.0 };
        let lay = self.layout.clone();
        if let Some(pk) = self.packed.as_mut() {
            pack_f16(be, self.params.at(0), pk.at_mut(0), self.params.len())?;
        }
        let (shape, d) = (self.attn_shape(), self.dims());
        let drops: Vec<ResidualDropout> = (0..n_layer)
            .map(|l| self.residual_dropout(l, p, seed))
            .collect();
        let w = Params {
            f32: &self.params,
            f16: self.packed.as_ref(),
            paths: self.paths,
        };

        // Token + position embedding, then dropout into the first block's residual stream.
        let emb = EmbedShape {
            tokens: n,
            vocab: v,
            dim: c,
            scale: 1.0,
        };
        let pos = Positions {
            table: w.f32.at(lay.wpe()),
            rows: t,
            period: t,
            pos0: 0,
        };
        let tmp = &mut self.tmp;
        embedding(
            be,
            self.ids.at(0),
            w.f32.at(lay.wte()),
            Some(pos),
            tmp.at_mut(0),
            emb,
        )?;
        let seed0 = drop_seed(seed, self.step, n_layer, 0);
        dropout(be, tmp.at(0), self.layers[0].x.at_mut(0), n * c, p, seed0)?;

        for (l, &drop) in drops.iter().enumerate() {
            let (head, rest) = self.layers.split_at_mut(l + 1);
            let (before, cur) = head.split_at_mut(l);
            let LayerActs {
                x,
                acts,
                qkv,
                probs,
                dropped,
            } = &mut cur[0];
            // Without a backward pass to follow, every block reuses the first block's activations:
            // an evaluation touches one layer's worth of memory instead of all of them.
            let (acts, qkv, probs, dropped) = match before.first_mut() {
                Some(first) if !train => (
                    &mut first.acts,
                    &mut first.qkv,
                    &mut first.probs,
                    &mut first.dropped,
                ),
                _ => (acts, qkv, probs, dropped),
            };
            let next = match rest.first_mut() {
                Some(nx) => &mut nx.x,
                None => &mut self.x_final,
            };
            let attn = Attention::Batch {
                qkv,
                probs,
                dropped: dropped.as_mut(),
                pairs: self.probs_pairs,
                shape,
                drop: (p > 0.0).then(|| (p, drop_seed(seed, self.step, l, 1))),
            };
            block_forward(
                be,
                w,
                lay.block(l),
                d,
                x.at(0),
                next.at_mut(0),
                acts,
                attn,
                drop,
                tmp,
            )?;
        }

        // Final LayerNorm, tied head, loss.
        let norm = NormShape {
            rows: n,
            cols: c,
            eps: EPS,
        };
        let (xf, wf) = (self.x_final.at(0), w.f32.at(lay.ln_f()));
        let (lnf, stats) = (self.lnf.at_mut(0), self.lnf_stats.at_mut(0));
        norm_forward(be, NormKind::Layer, xf, wf, lnf, stats, norm)?;
        let head = Gemm::nt(n, v, c);
        let wte = w.f32.at(lay.wte());
        matmul(
            be,
            w.paths,
            self.lnf.at(0),
            wte,
            self.logits.at_mut(0),
            &head,
        )?;
        let dl = train.then(|| self.dlogits.at_mut(0));
        let (logits, targets) = (self.logits.at(0), self.targets.at(0));
        let inv_n = 1.0 / n as f32;
        let grad_scale = inv_n * self.loss_scale;
        cross_entropy(
            be,
            logits,
            targets,
            self.losses.at_mut(0),
            dl,
            n,
            v,
            grad_scale,
        )?;
        let mean = self.stats.at_mut(0);
        reduce(be, Reduce::Sum, self.losses.at(0), n, mean, inv_n, false)
    }

    /// Records the backward pass of the last training forward pass into `grads` (every gradient is
    /// overwritten, so nothing needs zeroing between steps).
    pub fn backward(&mut self, be: &Backend, seed: u32) -> Result<()> {
        let (t, c, v) = (self.cfg.block_size, self.cfg.n_embd, self.cfg.vocab_size);
        let (n, n_layer) = (self.tokens(), self.cfg.n_layer);
        let p = self.cfg.dropout;
        let lay = self.layout.clone();
        let (shape, d) = (self.attn_shape(), self.dims());
        let drops: Vec<ResidualDropout> = (0..n_layer)
            .map(|l| self.residual_dropout(l, p, seed))
            .collect();
        let norm = NormShape {
            rows: n,
            cols: c,
            eps: EPS,
        };
        let w = &self.params;
        // The backward products read the f16 copy on the tensor-core training path only (with
        // `f16_forward` alone they stay f32).
        let params = Params {
            f32: w,
            f16: self
                .packed
                .as_ref()
                .filter(|_| self.paths.has(PathId::MixedTraining)),
            paths: self.paths,
        };
        let g = &mut self.grads;
        let s = &mut self.back;
        let paths = self.paths;

        // Head: dwte = dlogitsᵀ · lnf; dlnf = dlogits · wte; back through the final LayerNorm.
        let (dwte, dln) = (g.at_mut(lay.wte()), s.dln.at_mut(0));
        let (dlogits, lnf) = (self.dlogits.at(0), self.lnf.at(0));
        linear_backward(be, paths, dlogits, lnf, w.at(lay.wte()), dwte, dln, n, v, c)?;
        norm_backward(
            be,
            NormKind::Layer,
            self.x_final.at(0),
            w.at(lay.ln_f()),
            s.dln.at(0),
            self.lnf_stats.at(0),
            self.dresid.at_mut(0),
            g.at_mut(lay.ln_f()),
            norm,
            Grad::Overwrite,
            Grad::Overwrite,
        )?;

        for l in (0..n_layer).rev() {
            let a = &mut self.layers[l];
            let attn = SavedAttention {
                qkv: &a.qkv,
                probs: &a.probs,
                dropped: a.dropped.as_ref(),
                pairs: self.probs_pairs,
                shape,
                drop: (p > 0.0).then(|| (p, drop_seed(seed, self.step, l, 1))),
            };
            let (o, x) = (lay.block(l), a.x.at(0));
            block_backward(
                be,
                params,
                g,
                o,
                d,
                x,
                &a.acts,
                attn,
                drops[l],
                &mut self.dresid,
                s,
            )?;
        }

        // Embedding dropout, then the scatter-add into wte (which already holds the head's gradient)
        // and the position table's gradient.
        let seed0 = drop_seed(seed, self.step, n_layer, 0);
        let tmp = &mut self.tmp;
        dropout(be, self.dresid.at(0), tmp.at_mut(0), n * c, p, seed0)?;
        let emb = EmbedShape {
            tokens: n,
            vocab: v,
            dim: c,
            scale: 1.0,
        };
        let (gw, gp) = (lay.wte(), lay.wpe());
        // Two views of the gradient tensor cannot both be borrowed mutably: the position gradient goes
        // through a scratch row block first.
        embedding_backward(
            be,
            &self.index,
            tmp.at(0),
            g.at_mut(gw),
            Some((s.dln.at_mut(0), t)),
            emb,
            Grad::Accumulate,
        )?;
        tinygpt_kernels::ops::fill::copy(be, s.dln.at(0), g.at_mut(gp), t * c)
    }

    /// Records the AdamW step (with global-norm clipping computed on the device) at learning rate `lr`.
    pub fn update(&mut self, be: &Backend, lr: f32) -> Result<()> {
        self.step += 1;
        let lay = &self.layout;
        let total = lay.total;
        reduce(
            be,
            Reduce::SumOfSquares,
            self.grads.at(0),
            total,
            self.stats.at_mut(1),
            1.0 / (self.loss_scale * self.loss_scale),
            false,
        )?;
        let o = &self.optim;
        for (start, end, wd) in [
            (0, lay.decay_end, o.weight_decay),
            (lay.decay_end, total, 0.0),
        ] {
            let h = AdamW {
                lr,
                beta1: o.beta1,
                beta2: o.beta2,
                eps: o.eps,
                weight_decay: wd,
                step: self.step,
                grad_scale: self.loss_scale,
            };
            let clip = (o.grad_clip > 0.0).then(|| Clip {
                norm_sq: self.stats.at(1),
                max_norm: o.grad_clip,
            });
            adamw(
                be,
                self.params.at_mut(start),
                self.grads.at(start),
                self.m.at_mut(start),
                self.v.at_mut(start),
                end - start,
                &h,
                clip,
            )?;
        }
        Ok(())
    }

    /// One full training step on a batch: upload, forward, backward, update, one submit.
    pub fn train_step(
        &mut self,
        be: &Backend,
        ids: &[u32],
        targets: &[u32],
        lr: f32,
        seed: u32,
    ) -> Result<()> {
        self.set_batch(be, ids, targets, true)?;
        self.forward(be, true, seed)?;
        self.backward(be, seed)?;
        self.update(be, lr)?;
        be.flush()
    }

    /// The mean loss of the last forward pass.
    pub async fn read_loss(&self, be: &Backend) -> Result<f32> {
        Ok(be.read_f32(self.stats.at(0), 1).await?[0])
    }

    /// Mean loss of a batch without dropout or gradients.
    pub async fn eval_loss_async(
        &mut self,
        be: &Backend,
        ids: &[u32],
        targets: &[u32],
    ) -> Result<f32> {
        self.set_batch(be, ids, targets, false)?;
        self.forward(be, false, 0)?;
        self.read_loss(be).await
    }

    /// Parameters, first and second moments, on the host.
    pub async fn read_state(&self, be: &Backend) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let (p, m, v) = (&self.params, &self.m, &self.v);
        Ok((
            be.read_f32(p.into(), p.len()).await?,
            be.read_f32(m.into(), m.len()).await?,
            be.read_f32(v.into(), v.len()).await?,
        ))
    }

    /// [`Trainer::read_loss`], blocking (native).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn last_loss(&self, be: &Backend) -> Result<f32> {
        pollster::block_on(self.read_loss(be))
    }

    /// The global gradient norm of the last backward pass (waits for the device).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn last_grad_norm(&self, be: &Backend) -> Result<f32> {
        Ok(pollster::block_on(be.read_f32(self.stats.at(1), 1))?[0].sqrt())
    }

    /// [`Trainer::eval_loss_async`], blocking (native).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn eval_loss(&mut self, be: &Backend, ids: &[u32], targets: &[u32]) -> Result<f32> {
        pollster::block_on(self.eval_loss_async(be, ids, targets))
    }

    /// [`Trainer::read_state`], blocking (native).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn state(&self, be: &Backend) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        pollster::block_on(self.read_state(be))
    }

    /// The last backward pass's gradients on the host (loss scaling divided out).
    pub async fn read_grads(&self, be: &Backend) -> Result<Vec<f32>> {
        let g = &self.grads;
        let mut g = be.read_f32(g.into(), g.len()).await?;
        if self.loss_scale != 1.0 {
            g.iter_mut().for_each(|v| *v /= self.loss_scale);
        }
        Ok(g)
    }

    /// [`Trainer::read_grads`], blocking (native).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn grads_host(&self, be: &Backend) -> Result<Vec<f32>> {
        pollster::block_on(self.read_grads(be))
    }
}

/// nanoGPT's schedule: linear warmup to `max_lr` over `warmup` iterations, then cosine decay to
/// `min_lr` at `max_iters`.
pub fn learning_rate(it: usize, warmup: usize, max_iters: usize, max_lr: f32, min_lr: f32) -> f32 {
    if it < warmup {
        return max_lr * (it + 1) as f32 / (warmup + 1) as f32;
    }
    let span = max_iters.saturating_sub(warmup).max(1);
    let r = ((it - warmup) as f32 / span as f32).min(1.0);
    min_lr + 0.5 * (1.0 + (std::f32::consts::PI * r).cos()) * (max_lr - min_lr)
}

#[cfg(test)]
mod tests;
