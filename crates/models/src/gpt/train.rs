//! Training: the forward pass, the backward pass and the AdamW step, all recorded into one submission
//! per step on the GPU (or run directly on the CPU backend), with every buffer planned up front.
//!
//! Reading the functions top to bottom is reading the model: `forward` walks embedding → blocks →
//! final LayerNorm → tied head → cross-entropy; `backward` walks the same path in reverse.

use super::config::GptConfig;
use super::infer::linear;
use super::layout::Layout;
use tinygpt_kernels::ops::adamw::{AdamW, Clip, adamw};
use tinygpt_kernels::ops::attention::{AttnShape, attention_backward, attention_forward};
use tinygpt_kernels::ops::cross_entropy::cross_entropy;
use tinygpt_kernels::ops::dropout::{dropout, dropout_add, hash};
use tinygpt_kernels::ops::embedding::{
    EmbedShape, GradIndex, Positions, embedding, embedding_backward,
};
use tinygpt_kernels::ops::gelu::{gelu, gelu_backward};
use tinygpt_kernels::ops::matmul::{Gemm, matmul};
use tinygpt_kernels::ops::norm::{NormKind, NormShape, norm_backward, norm_forward};
use tinygpt_kernels::ops::reduce::{Reduce, reduce};
use tinygpt_kernels::{Backend, DType, Result, Tensor};

/// Optimizer settings (nanoGPT's shakespeare-char recipe by default).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub grad_clip: f32,
    /// Read the forward pass's block matrices from an f16 copy (re-packed every step) when the
    /// f16-storage path passed its gate. Off by default: a training batch's activations dwarf its weights,
    /// so halving weight reads does not pay for the packing (measured on an H200, docs/perf.md).
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

const EPS: f32 = 1e-5;

/// Per-layer saved activations.
struct LayerActs {
    x: Tensor,         // residual stream entering the block [N, C]
    ln1: Tensor,       // [N, C]
    ln1_stats: Tensor, // [2N]
    qkv: Tensor,       // [N, 3C]
    probs: Tensor,     // [B, H, T, T]
    dropped: Option<Tensor>,
    atty: Tensor, // attention output before the projection [N, C]
    xmid: Tensor, // residual after the attention branch [N, C]
    ln2: Tensor,
    ln2_stats: Tensor,
    fc: Tensor,  // MLP hidden before GELU [N, 4C]
    act: Tensor, // after GELU [N, 4C]
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
    // Scratch for the backward pass.
    tmp: Tensor,
    dresid: Tensor,
    dln: Tensor,
    datty: Tensor,
    dqkv: Tensor,
    d4a: Tensor,
    d4b: Tensor,
    dprobs: Tensor,
    dlogits: Tensor,
    /// f16 copy of the parameters for the forward pass's block matrices, when the f16-storage path
    /// passed its gate; re-packed at the top of every forward pass, so it is never stale.
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
    /// Plans every buffer for batches of `batch` sequences, starting from `params` (host, in
    /// [`Layout`] order) and, when resuming, the optimizer moments and step.
    pub fn new(
        be: &Backend,
        cfg: &GptConfig,
        batch: usize,
        params: &[f32],
        moments: Option<(&[f32], &[f32], u32)>,
        optim: OptimConfig,
    ) -> Result<Self> {
        let layout = Layout::new(cfg);
        assert_eq!(
            params.len(),
            layout.total,
            "parameters do not match the layout"
        );
        let (t, c, h, v) = (cfg.block_size, cfg.n_embd, cfg.n_head, cfg.vocab_size);
        let n = batch * t;
        let shape = AttnShape {
            batch,
            t,
            heads: h,
            head_dim: cfg.head_dim(),
        };
        let probs_unit = h * t * t;
        let z = |len: usize, unit: usize| be.zeros(len, unit);
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for _ in 0..cfg.n_layer {
            layers.push(LayerActs {
                x: z(n * c, t * c)?,
                ln1: z(n * c, c)?,
                ln1_stats: z(2 * n, 1)?,
                qkv: z(n * 3 * c, t * 3 * c)?,
                probs: z(shape.probs_len(), probs_unit)?,
                dropped: if cfg.dropout > 0.0 {
                    Some(z(shape.probs_len(), probs_unit)?)
                } else {
                    None
                },
                atty: z(n * c, t * c)?,
                xmid: z(n * c, c)?,
                ln2: z(n * c, c)?,
                ln2_stats: z(2 * n, 1)?,
                fc: z(n * 4 * c, 4 * c)?,
                act: z(n * 4 * c, 4 * c)?,
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
        Ok(Trainer {
            params: be.from_f32(params, layout.unit)?,
            grads: z(layout.total, layout.unit)?,
            m,
            v: vv,
            step,
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
            dresid: z(n * c, t * c)?,
            dln: z(n * c, c)?,
            datty: z(n * c, t * c)?,
            dqkv: z(n * 3 * c, t * 3 * c)?,
            d4a: z(n * 4 * c, 4 * c)?,
            d4b: z(n * 4 * c, 4 * c)?,
            dprobs: z(shape.probs_len(), probs_unit)?,
            dlogits: z(n * v, v)?,
            packed: if optim.f16_forward {
                super::infer::packed_buffer(be, layout.total)?
            } else {
                None
            },
            cfg: cfg.clone(),
            layout,
            batch,
            optim,
        })
    }

    fn tokens(&self) -> usize {
        self.batch * self.cfg.block_size
    }

    fn attn_shape(&self) -> AttnShape {
        AttnShape {
            batch: self.batch,
            t: self.cfg.block_size,
            heads: self.cfg.n_head,
            head_dim: self.cfg.head_dim(),
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
        let cfg = self.cfg.clone();
        let (t, c, v) = (cfg.block_size, cfg.n_embd, cfg.vocab_size);
        let n = self.tokens();
        let p = if train { cfg.dropout } else { 0.0 };
        let step = self.step;
        let lay = self.layout.clone();
        super::infer::pack_if_active(be, &self.params, self.packed.as_mut())?;
        let w = &self.params;
        let pk = self.packed.as_ref();
        let shape = self.attn_shape();
        let norm = NormShape {
            rows: n,
            cols: c,
            eps: EPS,
        };

        // Token + position embedding, then dropout into the first block's residual stream.
        let emb = EmbedShape {
            tokens: n,
            vocab: v,
            dim: c,
            scale: 1.0,
        };
        let pos = Positions {
            table: w.at(lay.wpe()),
            rows: t,
            period: t,
            pos0: 0,
        };
        embedding(
            be,
            self.ids.at(0),
            w.at(lay.wte()),
            Some(pos),
            self.tmp.at_mut(0),
            emb,
        )?;
        dropout(
            be,
            self.tmp.at(0),
            self.layers[0].x.at_mut(0),
            n * c,
            p,
            drop_seed(seed, step, cfg.n_layer, 0),
        )?;

        for l in 0..cfg.n_layer {
            let o = lay.block(l);
            let (head, tail) = self.layers.split_at_mut(l + 1);
            let a = &mut head[l];
            // Attention branch.
            norm_forward(
                be,
                NormKind::Layer,
                a.x.at(0),
                w.at(o.ln_1),
                a.ln1.at_mut(0),
                a.ln1_stats.at_mut(0),
                norm,
            )?;
            linear(
                be,
                w,
                pk,
                a.ln1.at(0),
                o.c_attn,
                a.qkv.at_mut(0),
                &Gemm::nt(n, 3 * c, c),
                false,
            )?;
            let drop = (p > 0.0).then(|| (p, drop_seed(seed, step, l, 1)));
            attention_forward(
                be,
                a.qkv.at(0),
                a.atty.at_mut(0),
                a.probs.at_mut(0),
                a.dropped.as_mut().map(|d| d.at_mut(0)),
                shape,
                drop,
            )?;
            linear(
                be,
                w,
                pk,
                a.atty.at(0),
                o.attn_proj,
                self.tmp.at_mut(0),
                &Gemm::nt(n, c, c),
                false,
            )?;
            dropout_add(
                be,
                a.x.at(0),
                self.tmp.at(0),
                a.xmid.at_mut(0),
                n * c,
                p,
                drop_seed(seed, step, l, 2),
            )?;
            // MLP branch.
            norm_forward(
                be,
                NormKind::Layer,
                a.xmid.at(0),
                w.at(o.ln_2),
                a.ln2.at_mut(0),
                a.ln2_stats.at_mut(0),
                norm,
            )?;
            linear(
                be,
                w,
                pk,
                a.ln2.at(0),
                o.c_fc,
                a.fc.at_mut(0),
                &Gemm::nt(n, 4 * c, c),
                false,
            )?;
            gelu(be, a.fc.at(0), a.act.at_mut(0), n * 4 * c)?;
            linear(
                be,
                w,
                pk,
                a.act.at(0),
                o.mlp_proj,
                self.tmp.at_mut(0),
                &Gemm::nt(n, c, 4 * c),
                false,
            )?;
            let next = match tail.first_mut() {
                Some(nx) => &mut nx.x,
                None => &mut self.x_final,
            };
            dropout_add(
                be,
                a.xmid.at(0),
                self.tmp.at(0),
                next.at_mut(0),
                n * c,
                p,
                drop_seed(seed, step, l, 3),
            )?;
        }

        // Final LayerNorm, tied head, loss.
        norm_forward(
            be,
            NormKind::Layer,
            self.x_final.at(0),
            w.at(lay.ln_f()),
            self.lnf.at_mut(0),
            self.lnf_stats.at_mut(0),
            norm,
        )?;
        matmul(
            be,
            self.lnf.at(0),
            w.at(lay.wte()),
            self.logits.at_mut(0),
            &Gemm::nt(n, v, c),
        )?;
        let dl = if train {
            Some(self.dlogits.at_mut(0))
        } else {
            None
        };
        cross_entropy(
            be,
            self.logits.at(0),
            self.targets.at(0),
            self.losses.at_mut(0),
            dl,
            n,
            v,
            1.0 / n as f32,
        )?;
        reduce(
            be,
            Reduce::Sum,
            self.losses.at(0),
            n,
            self.stats.at_mut(0),
            1.0 / n as f32,
            false,
        )
    }

    /// Records the backward pass of the last training forward pass into `grads` (every gradient is
    /// overwritten, so nothing needs zeroing between steps).
    pub fn backward(&mut self, be: &Backend, seed: u32) -> Result<()> {
        let cfg = self.cfg.clone();
        let (t, c, v) = (cfg.block_size, cfg.n_embd, cfg.vocab_size);
        let n = self.tokens();
        let p = cfg.dropout;
        let step = self.step;
        let lay = self.layout.clone();
        let shape = self.attn_shape();
        let norm = NormShape {
            rows: n,
            cols: c,
            eps: EPS,
        };
        let w = &self.params;
        let g = &mut self.grads;

        // Head: dwte = dlogitsᵀ · lnf; dlnf = dlogits · wte; back through the final LayerNorm.
        linear_backward(
            be,
            self.dlogits.at(0),
            self.lnf.at(0),
            w.at(lay.wte()),
            g.at_mut(lay.wte()),
            self.dln.at_mut(0),
            n,
            v,
            c,
        )?;
        norm_backward(
            be,
            NormKind::Layer,
            self.x_final.at(0),
            w.at(lay.ln_f()),
            self.dln.at(0),
            self.lnf_stats.at(0),
            self.dresid.at_mut(0),
            g.at_mut(lay.ln_f()),
            norm,
            false,
            false,
        )?;

        for l in (0..cfg.n_layer).rev() {
            let o = lay.block(l);
            let a = &mut self.layers[l];
            // MLP branch: dresid holds the gradient of the block's output.
            dropout(
                be,
                self.dresid.at(0),
                self.tmp.at_mut(0),
                n * c,
                p,
                drop_seed(seed, step, l, 3),
            )?;
            linear_backward(
                be,
                self.tmp.at(0),
                a.act.at(0),
                w.at(o.mlp_proj),
                g.at_mut(o.mlp_proj),
                self.d4a.at_mut(0),
                n,
                c,
                4 * c,
            )?;
            gelu_backward(
                be,
                a.fc.at(0),
                self.d4a.at(0),
                self.d4b.at_mut(0),
                n * 4 * c,
            )?;
            linear_backward(
                be,
                self.d4b.at(0),
                a.ln2.at(0),
                w.at(o.c_fc),
                g.at_mut(o.c_fc),
                self.dln.at_mut(0),
                n,
                4 * c,
                c,
            )?;
            norm_backward(
                be,
                NormKind::Layer,
                a.xmid.at(0),
                w.at(o.ln_2),
                self.dln.at(0),
                a.ln2_stats.at(0),
                self.dresid.at_mut(0),
                g.at_mut(o.ln_2),
                norm,
                true,
                false,
            )?;
            // Attention branch: dresid now holds the gradient of xmid.
            dropout(
                be,
                self.dresid.at(0),
                self.tmp.at_mut(0),
                n * c,
                p,
                drop_seed(seed, step, l, 2),
            )?;
            linear_backward(
                be,
                self.tmp.at(0),
                a.atty.at(0),
                w.at(o.attn_proj),
                g.at_mut(o.attn_proj),
                self.datty.at_mut(0),
                n,
                c,
                c,
            )?;
            let drop = (p > 0.0).then(|| (p, drop_seed(seed, step, l, 1)));
            attention_backward(
                be,
                a.qkv.at(0),
                a.probs.at(0),
                a.dropped.as_mut().map(|d| d.at_mut(0)),
                self.datty.at(0),
                self.dqkv.at_mut(0),
                self.dprobs.at_mut(0),
                shape,
                drop,
            )?;
            linear_backward(
                be,
                self.dqkv.at(0),
                a.ln1.at(0),
                w.at(o.c_attn),
                g.at_mut(o.c_attn),
                self.dln.at_mut(0),
                n,
                3 * c,
                c,
            )?;
            norm_backward(
                be,
                NormKind::Layer,
                a.x.at(0),
                w.at(o.ln_1),
                self.dln.at(0),
                a.ln1_stats.at(0),
                self.dresid.at_mut(0),
                g.at_mut(o.ln_1),
                norm,
                true,
                false,
            )?;
        }

        // Embedding dropout, then the scatter-add into wte (which already holds the head's gradient)
        // and the position table's gradient.
        dropout(
            be,
            self.dresid.at(0),
            self.tmp.at_mut(0),
            n * c,
            p,
            drop_seed(seed, step, cfg.n_layer, 0),
        )?;
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
            self.tmp.at(0),
            g.at_mut(gw),
            Some((self.dln.at_mut(0), t)),
            emb,
            true,
        )?;
        tinygpt_kernels::ops::fill::copy(be, self.dln.at(0), g.at_mut(gp), t * c)
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
            1.0,
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

    /// The mean loss of the last forward pass (waits for the device).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn last_loss(&self, be: &Backend) -> Result<f32> {
        Ok(pollster::block_on(be.read_f32(self.stats.at(0), 1))?[0])
    }

    /// The global gradient norm of the last backward pass (waits for the device).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn last_grad_norm(&self, be: &Backend) -> Result<f32> {
        Ok(pollster::block_on(be.read_f32(self.stats.at(1), 1))?[0].sqrt())
    }

    /// Mean loss of a batch without dropout or gradients.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn eval_loss(&mut self, be: &Backend, ids: &[u32], targets: &[u32]) -> Result<f32> {
        self.set_batch(be, ids, targets, false)?;
        self.forward(be, false, 0)?;
        self.last_loss(be)
    }

    /// Parameters, first and second moments, on the host.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn state(&self, be: &Backend) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        Ok((
            be.to_vec(&self.params)?,
            be.to_vec(&self.m)?,
            be.to_vec(&self.v)?,
        ))
    }

    /// The last backward pass's gradients on the host.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn grads_host(&self, be: &Backend) -> Result<Vec<f32>> {
        be.to_vec(&self.grads)
    }
}

/// Gradients of y = x · Wᵀ for `rows` rows (W is `out` x `inp`): dW = dyᵀ · x and dx = dy · W, as
/// llm.c's matmul_backward.
#[allow(clippy::too_many_arguments)]
fn linear_backward(
    be: &Backend,
    dy: tinygpt_kernels::TRef<'_>,
    x: tinygpt_kernels::TRef<'_>,
    w: tinygpt_kernels::TRef<'_>,
    dw: tinygpt_kernels::TMut<'_>,
    dx: tinygpt_kernels::TMut<'_>,
    rows: usize,
    out: usize,
    inp: usize,
) -> Result<()> {
    matmul(be, dy, x, dw, &Gemm::tn(out, inp, rows))?;
    matmul(be, dy, w, dx, &Gemm::nn(rows, inp, out))
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
