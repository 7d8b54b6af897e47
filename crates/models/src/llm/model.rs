//! The forward pass of llama and Gemma 3 from GGUF, written once for both backends (llm.c style: every
//! buffer is planned when the model loads, then each pass calls the ops top to bottom).
//!
//! A pass takes m new tokens (the prompt, or one token when decoding) at positions pos..pos+m:
//!
//! ```text
//!   x = embed(tokens) · embed_scale
//!   per layer:  x += [post_norm] o_proj(attend(rope([q_norm] q), cache ← rope([k_norm] k), cache ← v))
//!               x += [post_norm] down(act(gate) · up)           (each sublayer reads rms_norm(x))
//!   logits = head(rms_norm(x of the last token))                 (cap · tanh(logits / cap) if capped)
//! ```
//!
//! Q, K and V come out of one fused product (likewise gate and up), so each token row of the product
//! holds `[q | k | v]`. With one row (decoding) every member is already contiguous; with several rows
//! the members that must be contiguous (the norms take packed rows) are copied out first.

use tinygpt_formats::GgufFile;
use tinygpt_kernels::ops::add::add_assign;
use tinygpt_kernels::ops::attention::{DecodeShape, attend};
use tinygpt_kernels::ops::fill::copy;
use tinygpt_kernels::ops::glu::glu;
use tinygpt_kernels::ops::matmul::{Gemm, matmul};
use tinygpt_kernels::ops::norm::{NormKind, NormShape, norm_forward};
use tinygpt_kernels::ops::rope::{RopeShape, rope, rope_table};
use tinygpt_kernels::{Backend, DType, PathSet, TMut, TRef, Tensor};

use super::config::{LayerAttention, LlmConfig};
use super::error::{LlmError, Result};
use super::kv_cache::KvCache;
use super::weights::{LayerWeights, LoadProgress, Slot, Weights};

/// How to set a model up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Positions the KV cache holds; None: the model's trained context, at most [`DEFAULT_CONTEXT`].
    pub context: Option<usize>,
    /// Most tokens one forward pass takes (a longer prompt takes several); sizes the scratch buffers.
    pub batch: usize,
    /// The fast paths the model runs on (what the numerics gate passed; default: the f32 path). On a GPU
    /// without the quantized kernels in the set, quantized weights are held dequantized.
    pub paths: PathSet,
}

/// The context used when none is asked for (the trained context when smaller).
pub const DEFAULT_CONTEXT: usize = 4096;

impl Default for LoadOptions {
    fn default() -> Self {
        // llama.cpp's default micro-batch.
        LoadOptions {
            context: None,
            batch: 512,
            paths: PathSet::F32,
        }
    }
}

/// Memory a loaded model holds on its backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryReport {
    pub weights: u64,
    /// The KV cache as allocated (on the CPU backend, pages are committed only as positions are used).
    pub kv_cache: u64,
    pub scratch: u64,
}

impl MemoryReport {
    pub fn total(&self) -> u64 {
        self.weights + self.kv_cache + self.scratch
    }
}

/// Buffers of one forward pass, for up to `batch` token rows.
struct Scratch {
    /// Token ids (u32).
    ids: Tensor,
    /// The residual stream [batch, d].
    x: Tensor,
    /// A sublayer's normed input, or its post-normed output [batch, d].
    xn: Tensor,
    /// RMSNorm statistics of up to batch · heads rows.
    stats: Tensor,
    /// Fused products: [q | k | v] or [gate | up] per row.
    proj: Tensor,
    /// Members of `proj` copied out as contiguous rows.
    split_a: Tensor,
    split_b: Tensor,
    /// Normed and rotated queries [batch, q_dim] (Gemma).
    qn: Tensor,
    /// Attention output [batch, q_dim].
    att: Tensor,
    /// A sublayer's output [batch, d].
    out: Tensor,
    /// act(gate) · up [batch, ff].
    act: Tensor,
    logits: Tensor,
    /// The constant 1, the left operand of strided row copies (see [`copy_rows`]).
    one: Tensor,
}

impl Scratch {
    fn new(be: &Backend, cfg: &LlmConfig, batch: usize) -> Result<Scratch> {
        let (d, qd, kvd, ff) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
        let z = |rows: usize, width: usize| be.zeros(rows * width, width);
        let heads = cfg.n_head.max(cfg.n_kv_head).max(1);
        let split = qd.max(kvd).max(ff);
        Ok(Scratch {
            ids: be.zeros_typed(batch, batch, DType::U32)?,
            x: z(batch, d)?,
            xn: z(batch, d)?,
            stats: z(2, batch * heads)?,
            proj: z(batch, (qd + 2 * kvd).max(2 * ff))?,
            split_a: z(batch, split)?,
            split_b: z(batch, split)?,
            qn: if cfg.qk_norm { z(batch, qd)? } else { z(1, 1)? },
            att: z(batch, qd)?,
            out: z(batch, d)?,
            act: z(batch, ff)?,
            logits: z(1, cfg.vocab)?,
            one: be.from_f32(&[1.0], 1)?,
        })
    }

    fn bytes(&self) -> u64 {
        [
            &self.ids,
            &self.x,
            &self.xn,
            &self.stats,
            &self.proj,
            &self.split_a,
            &self.split_b,
            &self.qn,
            &self.att,
            &self.out,
            &self.act,
            &self.logits,
            &self.one,
        ]
        .iter()
        .map(|t| t.bytes())
        .sum()
    }
}

/// A GGUF model loaded on a backend, with its KV cache.
pub struct Llm {
    cfg: LlmConfig,
    w: Weights,
    cache: KvCache,
    /// RoPE tables, one per distinct (base, scale), and the table each layer uses.
    ropes: Vec<Tensor>,
    layer_rope: Vec<usize>,
    s: Scratch,
    batch: usize,
    /// Positions in the cache.
    pos: usize,
    /// The fast paths every product runs with.
    paths: PathSet,
}

impl Llm {
    /// Loads the model at `path`. The file is memory-mapped and each tensor's pages are released once
    /// converted, so memory peaks near the converted weights alone (with [`Llm::from_gguf`], the whole
    /// file stays resident while its caller keeps it open).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn load(
        be: &Backend,
        path: impl AsRef<std::path::Path>,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Llm> {
        let file = GgufFile::open(path)?;
        Llm::build(be, &file, opts, progress, true)
    }

    /// Loads the model of an opened GGUF file.
    pub fn from_gguf(
        be: &Backend,
        file: &GgufFile,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Llm> {
        Llm::build(be, file, opts, progress, false)
    }

    /// `release_pages`: the file is a mapping only this call reads (see [`Weights::load`]).
    fn build(
        be: &Backend,
        file: &GgufFile,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(LoadProgress),
        release_pages: bool,
    ) -> Result<Llm> {
        let cfg = LlmConfig::from_gguf(file)?;
        let context = match opts.context {
            None => cfg.train_context.clamp(1, DEFAULT_CONTEXT),
            Some(0) => {
                return Err(LlmError::Options(
                    "the context must hold at least one position".into(),
                ));
            }
            Some(c) if c > cfg.train_context => {
                return Err(LlmError::Options(format!(
                    "a context of {c} positions exceeds the {} the model was trained for",
                    cfg.train_context
                )));
            }
            Some(c) => c,
        };
        if opts.batch == 0 {
            return Err(LlmError::Options(
                "the batch must hold at least one token".into(),
            ));
        }
        let batch = opts.batch.min(context);
        let w = Weights::load(be, file, &cfg, progress, release_pages, opts.paths)?;
        let cache = KvCache::new(be, cfg.n_layer, context, 2 * cfg.kv_dim())?;
        let mut keys: Vec<(u32, u32)> = Vec::new();
        let mut ropes = Vec::new();
        let mut layer_rope = Vec::with_capacity(cfg.n_layer);
        for la in &cfg.layers {
            let key = (la.rope_base.to_bits(), la.rope_scale.to_bits());
            let i = match keys.iter().position(|&k| k == key) {
                Some(i) => i,
                None => {
                    // rope_table divides the frequencies by its factor (transformers' linear scaling);
                    // llama.cpp's freq_scale multiplies them.
                    let t = rope_table(cfg.n_rot, la.rope_base, 1.0 / la.rope_scale, context);
                    ropes.push(be.from_f32(&t, cfg.n_rot.max(2))?);
                    keys.push(key);
                    keys.len() - 1
                }
            };
            layer_rope.push(i);
        }
        let s = Scratch::new(be, &cfg, batch)?;
        Ok(Llm {
            cfg,
            w,
            cache,
            ropes,
            layer_rope,
            s,
            batch,
            pos: 0,
            paths: opts.paths,
        })
    }

    /// The fast paths the model runs on.
    pub fn paths(&self) -> PathSet {
        self.paths
    }

    pub fn config(&self) -> &LlmConfig {
        &self.cfg
    }

    /// Positions the KV cache holds.
    pub fn context(&self) -> usize {
        self.cache.context
    }

    /// Positions in use (tokens fed since the last reset).
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Forgets every position.
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Forgets the positions from `n` on (keeps the first `n` tokens' keys and values).
    pub fn truncate(&mut self, n: usize) {
        self.pos = self.pos.min(n);
    }

    pub fn memory(&self) -> MemoryReport {
        MemoryReport {
            weights: self.w.bytes(),
            kv_cache: self.cache.bytes(),
            scratch: self.s.bytes() + self.ropes.iter().map(Tensor::bytes).sum::<u64>(),
        }
    }

    /// The kernel layout of each projection, for reports: ("qkv", "q4 fused") etc.
    pub fn layouts(&self) -> Vec<(String, String)> {
        let fused = |f: &super::weights::Fused, n: usize| {
            if f.num_groups() == 1 {
                format!("{} (fused {n} in 1)", f.layout())
            } else {
                format!("{} ({n} in {})", f.layout(), f.num_groups())
            }
        };
        let layouts = |get: &dyn Fn(&LayerWeights) -> String| {
            let mut v: Vec<String> = self.w.layers.iter().map(get).collect();
            v.sort();
            v.dedup();
            v.join(", ")
        };
        vec![
            ("qkv".into(), layouts(&|l| fused(&l.qkv, 3))),
            ("attn_output".into(), layouts(&|l| l.wo.layout())),
            ("gate_up".into(), layouts(&|l| fused(&l.gate_up, 2))),
            ("ffn_down".into(), layouts(&|l| l.down.layout())),
            (
                "head".into(),
                format!(
                    "{}{}",
                    self.w.head().layout(),
                    if self.w.head.is_none() {
                        " (tied to token_embd)"
                    } else {
                        ""
                    }
                ),
            ),
        ]
    }

    /// Records the forward pass of `tokens` at the next positions (several passes if there are more
    /// than the batch). The last token's logits are then ready for [`Llm::read_logits`].
    pub fn feed(&mut self, be: &Backend, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(LlmError::Options("no tokens to feed".into()));
        }
        if tokens.len() > self.cache.context - self.pos {
            return Err(LlmError::ContextFull {
                tokens: tokens.len(),
                used: self.pos,
                limit: self.cache.context,
            });
        }
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= self.cfg.vocab) {
            return Err(LlmError::TokenOutOfRange {
                id,
                vocab: self.cfg.vocab,
            });
        }
        for chunk in tokens.chunks(self.batch) {
            self.forward(be, chunk)?;
        }
        Ok(())
    }

    /// The logits after the last token fed (host), soft-capped if the model caps them.
    pub async fn read_logits(&self, be: &Backend) -> Result<Vec<f32>> {
        let mut v = be.read_f32(self.s.logits.at(0), self.cfg.vocab).await?;
        let cap = self.cfg.final_softcap;
        if cap > 0.0 {
            v.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
        }
        Ok(v)
    }

    /// Feeds the prompt (or any tokens after what is cached) and returns the last position's logits.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn prefill(&mut self, be: &Backend, tokens: &[u32]) -> Result<Vec<f32>> {
        self.feed(be, tokens)?;
        pollster::block_on(self.read_logits(be))
    }

    /// Feeds one token and returns the logits after it.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn decode(&mut self, be: &Backend, token: u32) -> Result<Vec<f32>> {
        self.prefill(be, &[token])
    }

    fn forward(&mut self, be: &Backend, tokens: &[u32]) -> Result<()> {
        let Llm {
            cfg,
            w,
            cache,
            ropes,
            layer_rope,
            s,
            batch,
            pos,
            paths,
        } = self;
        let pass = Pass {
            be,
            paths: *paths,
            cfg,
            m: tokens.len(),
            pos0: *pos,
            batch: *batch,
            context: cache.context,
        };
        let d = cfg.d_model;
        be.write_u32(s.ids.at_mut(0), tokens)?;
        w.embed
            .get_rows(be, s.ids.at(0), s.x.at_mut(0), pass.m, cfg.embed_scale)?;
        for (l, lw) in w.layers.iter().enumerate() {
            let rope = &ropes[layer_rope[l]];
            pass.attention(lw, &cfg.layers[l], s, &mut cache.kv[l], rope)?;
            pass.feed_forward(lw, s)?;
        }
        // Only the last position's logits are needed.
        let last = s.x.at((pass.m - 1) * d);
        pass.rms_norm(last, &w.output_norm, s.xn.at_mut(0), &mut s.stats, 1, d)?;
        w.head()
            .matmul(be, *paths, s.xn.at(0), s.logits.at_mut(0), 1)?;
        *pos += pass.m;
        Ok(())
    }
}

/// The fixed inputs of one forward pass.
struct Pass<'a> {
    be: &'a Backend,
    paths: PathSet,
    cfg: &'a LlmConfig,
    /// Token rows in this pass, at positions pos0..pos0 + m.
    m: usize,
    pos0: usize,
    /// Rows the scratch buffers were planned for.
    batch: usize,
    /// Positions of the cache and the RoPE tables.
    context: usize,
}

impl Pass<'_> {
    fn rms_norm(
        &self,
        x: TRef<'_>,
        w: &Tensor,
        y: TMut<'_>,
        stats: &mut Tensor,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let shape = NormShape {
            rows,
            cols,
            eps: self.cfg.norm_eps,
        };
        Ok(norm_forward(
            self.be,
            NormKind::Rms,
            x,
            w.into(),
            y,
            stats.at_mut(0),
            shape,
        )?)
    }

    fn rope(&self, x: TMut<'_>, table: &Tensor, heads: usize, ld: usize) -> Result<()> {
        let shape = RopeShape {
            rows: self.m,
            heads,
            head_dim: self.cfg.head_dim,
            n_rot: self.cfg.n_rot,
            ld,
            pos0: self.pos0,
            layout: self.cfg.rope_layout,
            inverse: false,
        };
        Ok(rope(self.be, x, table.into(), self.context, shape)?)
    }

    /// x += [post_norm](out).
    fn residual(&self, post_norm: Option<&Tensor>, s: &mut Scratch) -> Result<()> {
        let n = self.m * self.cfg.d_model;
        match post_norm {
            Some(w) => {
                self.rms_norm(
                    s.out.at(0),
                    w,
                    s.xn.at_mut(0),
                    &mut s.stats,
                    self.m,
                    self.cfg.d_model,
                )?;
                add_assign(self.be, s.x.at_mut(0), s.xn.at(0), n, 1.0)?;
            }
            None => add_assign(self.be, s.x.at_mut(0), s.out.at(0), n, 1.0)?,
        }
        Ok(())
    }

    fn attention(
        &self,
        lw: &LayerWeights,
        la: &LayerAttention,
        s: &mut Scratch,
        cache: &mut Tensor,
        rope: &Tensor,
    ) -> Result<()> {
        let (be, cfg, m, p) = (self.be, self.cfg, self.m, self.pos0);
        let (d, hd, qd, kvd) = (cfg.d_model, cfg.head_dim, cfg.q_dim(), cfg.kv_dim());
        let (n_head, n_kv) = (cfg.n_head, cfg.n_kv_head);
        self.rms_norm(s.x.at(0), &lw.attn_norm, s.xn.at_mut(0), &mut s.stats, m, d)?;
        lw.qkv
            .apply(be, self.paths, s.xn.at(0), &mut s.proj, m, self.batch)?;
        let [q, k, v] = [0, 1, 2].map(|i| lw.qkv.slot(i, self.batch));
        // When Q, K and V come out of one product, each row holds [q | k | v]: without Q/K norms, one
        // RoPE call rotates the heads of q and k together, and one copy moves k and v into the cache.
        let follows = |a: Slot, b: Slot, width: usize| b.ld == a.ld && b.offset == a.offset + width;
        let qk_together = lw.q_norm.is_none() && lw.k_norm.is_none() && follows(q, k, qd);
        let kv_together = lw.k_norm.is_none() && follows(k, v, kvd);
        // A cache row holds one position's [k | v].
        let (row, at) = (2 * kvd, p * 2 * kvd);

        // Queries: normed per head into `qn` then rotated (Gemma), or rotated where they are.
        let (q_src, q_slot) = match &lw.q_norm {
            Some(nw) => {
                let src = contiguous(be, &s.proj, q, qd, m, &mut s.split_a, &s.one)?;
                self.rms_norm(src, nw, s.qn.at_mut(0), &mut s.stats, m * n_head, hd)?;
                self.rope(s.qn.at_mut(0), rope, n_head, qd)?;
                (&s.qn, Slot { offset: 0, ld: qd })
            }
            None => {
                let heads = if qk_together { n_head + n_kv } else { n_head };
                self.rope(s.proj.at_mut(q.offset), rope, heads, q.ld)?;
                (&s.proj, q)
            }
        };

        // Keys into the cache (normed on the way for Gemma, then rotated there unless already rotated).
        match &lw.k_norm {
            Some(nw) => {
                let src = contiguous(be, &s.proj, k, kvd, m, &mut s.split_b, &s.one)?;
                if m == 1 {
                    self.rms_norm(src, nw, cache.at_mut(at), &mut s.stats, n_kv, hd)?;
                } else {
                    // The norm writes packed rows; cache rows are [k | v].
                    self.rms_norm(src, nw, s.split_a.at_mut(0), &mut s.stats, m * n_kv, hd)?;
                    copy_rows(
                        be,
                        s.split_a.at(0),
                        kvd,
                        cache.at_mut(at),
                        row,
                        m,
                        kvd,
                        &s.one,
                    )?;
                }
            }
            None => {
                let width = if kv_together { 2 * kvd } else { kvd };
                copy_rows(
                    be,
                    s.proj.at(k.offset),
                    k.ld,
                    cache.at_mut(at),
                    row,
                    m,
                    width,
                    &s.one,
                )?;
            }
        }
        if !qk_together {
            self.rope(cache.at_mut(at), rope, n_kv, row)?;
        }
        if !kv_together {
            copy_rows(
                be,
                s.proj.at(v.offset),
                v.ld,
                cache.at_mut(at + kvd),
                row,
                m,
                kvd,
                &s.one,
            )?;
        }

        let shape = DecodeShape {
            rows: m,
            heads: n_head,
            kv_heads: n_kv,
            head_dim: hd,
            ld_q: q_slot.ld,
            ld_kv: row,
            ld_o: qd,
            q_pos0: p,
            kv_len: p + m,
            window: la.window,
            scale: cfg.attn_scale,
            softcap: 0.0,
        };
        let (keys, values) = (cache.at(0), cache.at(kvd));
        attend(
            be,
            q_src.at(q_slot.offset),
            keys,
            values,
            s.att.at_mut(0),
            shape,
        )?;
        lw.wo
            .matmul(be, self.paths, s.att.at(0), s.out.at_mut(0), m)?;
        self.residual(lw.post_attn_norm.as_ref(), s)
    }

    fn feed_forward(&self, lw: &LayerWeights, s: &mut Scratch) -> Result<()> {
        let (be, cfg, m) = (self.be, self.cfg, self.m);
        let (d, ff) = (cfg.d_model, cfg.n_ff);
        self.rms_norm(s.x.at(0), &lw.ffn_norm, s.xn.at_mut(0), &mut s.stats, m, d)?;
        lw.gate_up
            .apply(be, self.paths, s.xn.at(0), &mut s.proj, m, self.batch)?;
        let (g, u) = (
            lw.gate_up.slot(0, self.batch),
            lw.gate_up.slot(1, self.batch),
        );
        let gate = contiguous(be, &s.proj, g, ff, m, &mut s.split_a, &s.one)?;
        let up = contiguous(be, &s.proj, u, ff, m, &mut s.split_b, &s.one)?;
        glu(be, cfg.activation, gate, up, s.act.at_mut(0), m * ff)?;
        lw.down
            .matmul(be, self.paths, s.act.at(0), s.out.at_mut(0), m)?;
        self.residual(lw.post_ffn_norm.as_ref(), s)
    }
}

/// A member's m rows of `width` as one packed block: where they are when already packed (always for one
/// row), else copied into `spare`.
fn contiguous<'a>(
    be: &Backend,
    src: &'a Tensor,
    slot: Slot,
    width: usize,
    m: usize,
    spare: &'a mut Tensor,
    one: &Tensor,
) -> Result<TRef<'a>> {
    if m == 1 || slot.ld == width {
        return Ok(src.at(slot.offset));
    }
    copy_rows(
        be,
        src.at(slot.offset),
        slot.ld,
        spare.at_mut(0),
        width,
        m,
        width,
        one,
    )?;
    let spare: &'a Tensor = spare;
    Ok(spare.at(0))
}

/// Copies `rows` rows of `cols` elements, `ld_src` apart, to rows `ld_dst` apart.
#[allow(clippy::too_many_arguments)]
fn copy_rows(
    be: &Backend,
    src: TRef<'_>,
    ld_src: usize,
    dst: TMut<'_>,
    ld_dst: usize,
    rows: usize,
    cols: usize,
    one: &Tensor,
) -> Result<()> {
    if rows == 1 || (ld_src == cols && ld_dst == cols) {
        return Ok(copy(be, src, dst, rows * cols)?);
    }
    // The kernels have no strided copy; a batch of 1x1 · 1xcols products (one per row) is one op on
    // either backend and exact: each element is 1 · x with nothing added.
    let g = Gemm::nn(1, cols, 1).batched([1, rows], [0, 0], [0, ld_src], [0, ld_dst]);
    Ok(matmul(be, PathSet::F32, one.into(), src, dst, &g)?)
}
