//! The forward pass of llama, Gemma 3 and GPT-2 from GGUF, written once for both backends (llm.c style:
//! every buffer is planned when the model loads, then each pass calls the ops top to bottom).
//!
//! A pass takes m new tokens (the prompt, or one token when decoding) at positions pos..pos+m:
//!
//! ```text
//!   x = embed(tokens) · embed_scale  [+ positions(pos)]
//!   per layer:  x += [post_norm] o_proj(attend(rope([q_norm] q), cache ← rope([k_norm] k), cache ← v))
//!               x += [post_norm] down(act(gate) · up)           (each sublayer reads norm(x))
//!   logits = head(norm(x of the last token))                     (cap · tanh(logits / cap) if capped)
//! ```
//!
//! GPT-2 differs only in its options: LayerNorm with biases for `norm`, learned positions instead of
//! RoPE, biases on every projection, and down(gelu(up)) for the MLP.
//!
//! Q, K and V come out of one fused product (likewise gate and up), so each token row of the product
//! holds `[q | k | v]`. With one row (decoding) every member is already contiguous; with several rows
//! the members that must be contiguous (the norms take packed rows) are copied out first.
//!
//! A pass may carry rows of several sequences ([`Sequence`], each with its own KV cache and position):
//! the products, norms and activations run once over all rows (the weights are read once for every
//! sequence), and only RoPE, the cache writes and attention run per sequence. That is how a server
//! decodes all of its active requests in one pass ([`Llm::decode_batch`]).

use tinygpt_formats::GgufFile;
use tinygpt_kernels::ops::add::add_assign;
use tinygpt_kernels::ops::attention::{DecodeShape, attend};
use tinygpt_kernels::ops::fill::copy;
use tinygpt_kernels::ops::gelu::gelu;
use tinygpt_kernels::ops::glu::glu;
use tinygpt_kernels::ops::matmul::{Gemm, RowMode, matmul};
use tinygpt_kernels::ops::norm::{NormKind, NormShape, norm_forward};
use tinygpt_kernels::ops::rope::{RopeShape, rope, rope_table};
use tinygpt_kernels::{Backend, DType, PathSet, TMut, TRef, Tensor};

use super::config::{LayerAttention, LlmConfig};
use super::error::{LlmError, Result};
use super::kv_cache::KvCache;
use super::weights::{LayerWeights, LoadProgress, Norm, Rows, Slot, Weights, add_bias};

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
    /// Most sequences one [`Llm::decode_batch`] pass decodes (sizes the logits buffer).
    pub parallel: usize,
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
            parallel: 1,
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
    /// Each row's position (u32), for learned positions.
    pos_ids: Tensor,
    /// `batch` ones: the left operand of bias additions (see [`add_bias`]).
    ones: Tensor,
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
    fn new(be: &Backend, cfg: &LlmConfig, batch: usize, parallel: usize) -> Result<Scratch> {
        let (d, qd, kvd, ff) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
        let z = |rows: usize, width: usize| be.zeros(rows * width, width);
        let heads = cfg.n_head.max(cfg.n_kv_head).max(1);
        let split = qd.max(kvd).max(ff);
        Ok(Scratch {
            ids: be.zeros_typed(batch, batch, DType::U32)?,
            pos_ids: be.zeros_typed(batch, batch, DType::U32)?,
            ones: be.from_f32(&vec![1.0; batch], batch)?,
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
            logits: z(parallel, cfg.vocab)?,
            one: be.from_f32(&[1.0], 1)?,
        })
    }

    fn bytes(&self) -> u64 {
        [
            &self.ids,
            &self.pos_ids,
            &self.ones,
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

/// One sequence's state: its KV cache and the positions it holds. A model holds one of its own (the
/// single-sequence methods of [`Llm`] use it); [`Llm::new_sequence`] makes more for batched decoding.
pub struct Sequence {
    cache: KvCache,
    pos: usize,
}

impl Sequence {
    /// Positions in use (tokens fed since the last reset).
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Positions the cache holds.
    pub fn context(&self) -> usize {
        self.cache.context
    }

    /// Forgets every position.
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Forgets the positions from `n` on (keeps the first `n` tokens' keys and values).
    pub fn truncate(&mut self, n: usize) {
        self.pos = self.pos.min(n);
    }

    /// Bytes its cache holds.
    pub fn bytes(&self) -> u64 {
        self.cache.bytes()
    }

    /// Checks that `tokens` fit after what the sequence holds and are in the vocabulary.
    fn check(&self, tokens: &[u32], vocab: usize) -> Result<()> {
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
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= vocab) {
            return Err(LlmError::TokenOutOfRange { id, vocab });
        }
        Ok(())
    }
}

/// The model's weights and the buffers of one pass.
struct Core {
    cfg: LlmConfig,
    w: Weights,
    /// RoPE tables, one per distinct (base, scale), and the table each layer uses (none without RoPE).
    ropes: Vec<Tensor>,
    layer_rope: Vec<usize>,
    s: Scratch,
    batch: usize,
    /// Positions of each sequence's cache (and of the RoPE tables).
    context: usize,
    /// Most sequences one decode pass takes.
    parallel: usize,
    /// The fast paths every product runs with.
    paths: PathSet,
    /// Logits of every row of a pass ([`Llm::score`]), made on first use.
    scored: Option<Tensor>,
}

/// A GGUF model loaded on a backend, with its own sequence's KV cache.
pub struct Llm {
    core: Core,
    seq: Sequence,
}

/// The rows of one sequence in a pass: `rows` tokens at the sequence's next positions.
struct Seg<'a> {
    seq: &'a mut Sequence,
    rows: usize,
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
        if opts.parallel == 0 || opts.parallel > opts.batch {
            return Err(LlmError::Options(format!(
                "a decode pass takes 1 to {} sequences (the batch), not {}",
                opts.batch, opts.parallel
            )));
        }
        let batch = opts.batch.min(context).max(opts.parallel);
        let w = Weights::load(be, file, &cfg, progress, release_pages, opts.paths)?;
        let cache = KvCache::new(be, cfg.n_layer, context, 2 * cfg.kv_dim())?;
        let mut keys: Vec<(u32, u32)> = Vec::new();
        let mut ropes = Vec::new();
        let mut layer_rope = Vec::with_capacity(cfg.n_layer);
        for la in cfg.layers.iter().filter(|_| cfg.n_rot > 0) {
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
        let s = Scratch::new(be, &cfg, batch, opts.parallel)?;
        Ok(Llm {
            core: Core {
                cfg,
                w,
                ropes,
                layer_rope,
                s,
                batch,
                context,
                parallel: opts.parallel,
                paths: opts.paths,
                scored: None,
            },
            seq: Sequence { cache, pos: 0 },
        })
    }

    /// The fast paths the model runs on.
    pub fn paths(&self) -> PathSet {
        self.core.paths
    }

    pub fn config(&self) -> &LlmConfig {
        &self.core.cfg
    }

    /// Positions the KV cache holds.
    pub fn context(&self) -> usize {
        self.core.context
    }

    /// Positions in use (tokens fed since the last reset).
    pub fn position(&self) -> usize {
        self.seq.pos
    }

    /// Forgets every position.
    pub fn reset(&mut self) {
        self.seq.reset();
    }

    /// Forgets the positions from `n` on (keeps the first `n` tokens' keys and values).
    pub fn truncate(&mut self, n: usize) {
        self.seq.truncate(n);
    }

    /// Most sequences one [`Llm::decode_batch`] takes.
    pub fn parallel(&self) -> usize {
        self.core.parallel
    }

    /// A new sequence with its own KV cache of the model's context (empty).
    pub fn new_sequence(&self, be: &Backend) -> Result<Sequence> {
        let cfg = &self.core.cfg;
        Ok(Sequence {
            cache: KvCache::new(be, cfg.n_layer, self.core.context, 2 * cfg.kv_dim())?,
            pos: 0,
        })
    }

    /// Bytes one more sequence's KV cache takes.
    pub fn sequence_bytes(&self) -> u64 {
        self.seq.bytes()
    }

    pub fn memory(&self) -> MemoryReport {
        let c = &self.core;
        MemoryReport {
            weights: c.w.bytes(),
            kv_cache: self.seq.cache.bytes(),
            scratch: c.s.bytes() + c.ropes.iter().map(Tensor::bytes).sum::<u64>(),
        }
    }

    /// The kernel layout of each projection, for reports: ("qkv", "q4 fused") etc.
    pub fn layouts(&self) -> Vec<(String, String)> {
        let fused = |f: &super::weights::Fused| {
            let n = f.num_members();
            if n == 1 {
                f.layout()
            } else if f.num_groups() == 1 {
                format!("{} (fused {n} in 1)", f.layout())
            } else {
                format!("{} ({n} in {})", f.layout(), f.num_groups())
            }
        };
        let layouts = |get: &dyn Fn(&LayerWeights) -> String| {
            let mut v: Vec<String> = self.core.w.layers.iter().map(get).collect();
            v.sort();
            v.dedup();
            v.join(", ")
        };
        vec![
            ("qkv".into(), layouts(&|l| fused(&l.qkv))),
            ("attn_output".into(), layouts(&|l| l.wo.w.layout())),
            ("gate_up".into(), layouts(&|l| fused(&l.gate_up))),
            ("ffn_down".into(), layouts(&|l| l.down.w.layout())),
            (
                "head".into(),
                format!(
                    "{}{}",
                    self.core.w.head().layout(),
                    if self.core.w.head.is_none() {
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
        self.core.feed(be, &mut self.seq, tokens)
    }

    /// [`Llm::feed`] for another sequence (a prompt, or any tokens after what it holds).
    pub fn feed_sequence(
        &mut self,
        be: &Backend,
        seq: &mut Sequence,
        tokens: &[u32],
    ) -> Result<()> {
        self.core.feed(be, seq, tokens)
    }

    /// Records one pass feeding one token to each sequence (at most [`Llm::parallel`]): the weights
    /// are read once for all of them. Row i of the logits ([`Llm::read_logits_batch`]) follows
    /// `steps[i]`'s token.
    pub fn decode_batch(&mut self, be: &Backend, steps: &mut [(&mut Sequence, u32)]) -> Result<()> {
        let c = &mut self.core;
        if steps.is_empty() || steps.len() > c.parallel {
            return Err(LlmError::Options(format!(
                "a decode pass takes 1 to {} sequences, not {}",
                c.parallel,
                steps.len()
            )));
        }
        for (seq, t) in steps.iter() {
            seq.check(std::slice::from_ref(t), c.cfg.vocab)?;
        }
        let tokens: Vec<u32> = steps.iter().map(|(_, t)| *t).collect();
        let mut segs: Vec<Seg<'_>> = steps
            .iter_mut()
            .map(|(seq, _)| Seg { seq, rows: 1 })
            .collect();
        c.forward(be, &tokens, &mut segs)
    }

    /// Feeds `tokens` (after what the cache holds) and returns the logits after each of the tokens
    /// from index `from` on, row after row (soft-capped if the model caps them): what perplexity
    /// scores. Passes of at most the batch, each read back before the next.
    pub async fn score(&mut self, be: &Backend, tokens: &[u32], from: usize) -> Result<Vec<f32>> {
        let c = &mut self.core;
        self.seq.check(tokens, c.cfg.vocab)?;
        let v = c.cfg.vocab;
        let mut out = Vec::with_capacity(tokens.len().saturating_sub(from) * v);
        for (i, chunk) in tokens.chunks(c.batch).enumerate() {
            let start = i * c.batch;
            let f = from.saturating_sub(start);
            if f >= chunk.len() {
                c.forward(
                    be,
                    chunk,
                    &mut [Seg {
                        seq: &mut self.seq,
                        rows: chunk.len(),
                    }],
                )?;
                continue;
            }
            c.forward_scored(
                be,
                chunk,
                &mut [Seg {
                    seq: &mut self.seq,
                    rows: chunk.len(),
                }],
                Some(f),
            )?;
            let t = c.scored.as_ref().expect("made by forward_scored");
            let rows = be.read_f32(t.at(0), (chunk.len() - f) * v).await?;
            out.extend_from_slice(&rows);
        }
        let cap = c.cfg.final_softcap;
        if cap > 0.0 {
            out.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
        }
        Ok(out)
    }

    /// The logits after the last token fed (host), soft-capped if the model caps them.
    pub async fn read_logits(&self, be: &Backend) -> Result<Vec<f32>> {
        Ok(self.core.read_logits(be, 1).await?.swap_remove(0))
    }

    /// The logits of each of the first `n` sequences of the last [`Llm::decode_batch`].
    pub async fn read_logits_batch(&self, be: &Backend, n: usize) -> Result<Vec<Vec<f32>>> {
        self.core.read_logits(be, n).await
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
}

impl Core {
    fn feed(&mut self, be: &Backend, seq: &mut Sequence, tokens: &[u32]) -> Result<()> {
        seq.check(tokens, self.cfg.vocab)?;
        for chunk in tokens.chunks(self.batch) {
            let mut segs = [Seg {
                seq: &mut *seq,
                rows: chunk.len(),
            }];
            self.forward(be, chunk, &mut segs)?;
        }
        Ok(())
    }

    async fn read_logits(&self, be: &Backend, n: usize) -> Result<Vec<Vec<f32>>> {
        let v = self.cfg.vocab;
        if n == 0 || n > self.parallel {
            return Err(LlmError::Options(format!(
                "logits of 1 to {} sequences, not {n}",
                self.parallel
            )));
        }
        let all = be.read_f32(self.s.logits.at(0), n * v).await?;
        let cap = self.cfg.final_softcap;
        Ok(all
            .chunks(v)
            .map(|row| {
                let mut row = row.to_vec();
                if cap > 0.0 {
                    row.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
                }
                row
            })
            .collect())
    }

    /// One pass over `tokens`, split among `segs` in order (one segment of any length, or several of
    /// one row each).
    fn forward(&mut self, be: &Backend, tokens: &[u32], segs: &mut [Seg<'_>]) -> Result<()> {
        self.forward_scored(be, tokens, segs, None)
    }

    /// [`Core::forward`]; with `scored_from = Some(f)` (one segment) the logits of rows f.. go to
    /// `scored` instead of the last row's to `logits`.
    fn forward_scored(
        &mut self,
        be: &Backend,
        tokens: &[u32],
        segs: &mut [Seg<'_>],
        scored_from: Option<usize>,
    ) -> Result<()> {
        if scored_from.is_some() && self.scored.is_none() {
            self.scored = Some(be.zeros(self.batch * self.cfg.vocab, self.cfg.vocab)?);
        }
        let Core {
            cfg,
            w,
            ropes,
            layer_rope,
            s,
            batch,
            context,
            paths,
            scored,
            ..
        } = self;
        let mut spans = Vec::with_capacity(segs.len());
        let mut row0 = 0;
        for g in segs.iter() {
            spans.push(Span {
                row0,
                rows: g.rows,
                pos0: g.seq.pos,
            });
            row0 += g.rows;
        }
        debug_assert!(segs.len() == 1 || segs.iter().all(|g| g.rows == 1));
        let pass = Pass {
            be,
            paths: *paths,
            cfg,
            m: tokens.len(),
            batch: *batch,
            context: *context,
            mode: if spans.len() > 1 {
                RowMode::Independent
            } else {
                RowMode::Shared
            },
            spans,
        };
        let d = cfg.d_model;
        be.write_u32(s.ids.at_mut(0), tokens)?;
        w.embed
            .get_rows(be, s.ids.at(0), s.x.at_mut(0), pass.m, cfg.embed_scale)?;
        if let Some(pos) = &w.pos_embd {
            let ids: Vec<u32> = pass
                .spans
                .iter()
                .flat_map(|sp| sp.pos0..sp.pos0 + sp.rows)
                .map(|p| p as u32)
                .collect();
            be.write_u32(s.pos_ids.at_mut(0), &ids)?;
            pos.get_rows(be, s.pos_ids.at(0), s.out.at_mut(0), pass.m, 1.0)?;
            add_assign(be, s.x.at_mut(0), s.out.at(0), pass.m * d, 1.0)?;
        }
        for (l, lw) in w.layers.iter().enumerate() {
            let rope = layer_rope.get(l).map(|&i| &ropes[i]);
            let mut caches: Vec<&mut Tensor> =
                segs.iter_mut().map(|g| &mut g.seq.cache.kv[l]).collect();
            pass.attention(lw, &cfg.layers[l], s, &mut caches, rope)?;
            pass.feed_forward(lw, s)?;
        }
        // Only each sequence's last position's logits are needed: one row for one sequence, every row
        // when each sequence has one.
        let (first, rows) = match scored_from {
            Some(f) => (f, pass.m - f),
            None if segs.len() == 1 => (pass.m - 1, 1),
            None => (0, pass.m),
        };
        let last = s.x.at(first * d);
        pass.norm(last, &w.output_norm, &mut s.xn, &mut s.stats, rows, &s.ones)?;
        let head_rows = Rows {
            m: rows,
            ..pass.rows()
        };
        let out = match (scored_from, scored.as_mut()) {
            (Some(_), Some(t)) => t.at_mut(0),
            _ => s.logits.at_mut(0),
        };
        w.head().matmul(be, head_rows, s.xn.at(0), out)?;
        for g in segs.iter_mut() {
            g.seq.pos += g.rows;
        }
        Ok(())
    }
}

/// Where one sequence's rows lie in a pass.
#[derive(Clone, Copy, Debug)]
struct Span {
    /// First row of the pass that belongs to it.
    row0: usize,
    rows: usize,
    /// Its position of that first row.
    pos0: usize,
}

/// The fixed inputs of one forward pass.
struct Pass<'a> {
    be: &'a Backend,
    paths: PathSet,
    cfg: &'a LlmConfig,
    /// Token rows in this pass.
    m: usize,
    /// Rows the scratch buffers were planned for.
    batch: usize,
    /// Positions of the cache and the RoPE tables.
    context: usize,
    /// Each sequence's rows, in order.
    spans: Vec<Span>,
    /// Independent when the rows belong to different sequences: each sequence's numbers must not
    /// depend on which others share its pass.
    mode: RowMode,
}

impl Pass<'_> {
    /// The products of this pass: its paths, all its rows, its row mode.
    fn rows(&self) -> Rows {
        Rows {
            paths: self.paths,
            m: self.m,
            mode: self.mode,
        }
    }

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

    /// y = norm(x) · w (+ b) over `rows` rows of the model's width, with the model's norm.
    fn norm(
        &self,
        x: TRef<'_>,
        n: &Norm,
        y: &mut Tensor,
        stats: &mut Tensor,
        rows: usize,
        ones: &Tensor,
    ) -> Result<()> {
        let d = self.cfg.d_model;
        let shape = NormShape {
            rows,
            cols: d,
            eps: self.cfg.norm_eps,
        };
        norm_forward(
            self.be,
            self.cfg.norm,
            x,
            (&n.w).into(),
            y.at_mut(0),
            stats.at_mut(0),
            shape,
        )?;
        if let Some(b) = &n.b {
            add_bias(self.be, ones.at(0), b, y.at_mut(0), rows, d)?;
        }
        Ok(())
    }

    /// Rotates the `span`'s rows of `x` (`x` views its first row).
    fn rope(&self, x: TMut<'_>, span: Span, table: &Tensor, heads: usize, ld: usize) -> Result<()> {
        let shape = RopeShape {
            rows: span.rows,
            heads,
            head_dim: self.cfg.head_dim,
            n_rot: self.cfg.n_rot,
            ld,
            pos0: span.pos0,
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
        caches: &mut [&mut Tensor],
        rope: Option<&Tensor>,
    ) -> Result<()> {
        let (be, cfg, m) = (self.be, self.cfg, self.m);
        let (hd, qd, kvd) = (cfg.head_dim, cfg.q_dim(), cfg.kv_dim());
        let (n_head, n_kv) = (cfg.n_head, cfg.n_kv_head);
        self.norm(
            s.x.at(0),
            &lw.attn_norm,
            &mut s.xn,
            &mut s.stats,
            m,
            &s.ones,
        )?;
        lw.qkv.apply(
            be,
            self.rows(),
            s.xn.at(0),
            &mut s.proj,
            self.batch,
            s.ones.at(0),
        )?;
        let [q, k, v] = [0, 1, 2].map(|i| lw.qkv.slot(i, self.batch));
        // When Q, K and V come out of one product, each row holds [q | k | v]: without Q/K norms, one
        // RoPE call rotates the heads of q and k together, and one copy moves k and v into the cache.
        let follows = |a: Slot, b: Slot, width: usize| b.ld == a.ld && b.offset == a.offset + width;
        let qk_together = lw.q_norm.is_none() && lw.k_norm.is_none() && follows(q, k, qd);
        let kv_together = lw.k_norm.is_none() && follows(k, v, kvd);
        // A cache row holds one position's [k | v].
        let row = 2 * kvd;
        let spans = &self.spans;

        // Queries: normed per head into `qn` then rotated (Gemma), or rotated where they are.
        let (q_src, q_slot) = match &lw.q_norm {
            Some(nw) => {
                let src = contiguous(be, &s.proj, q, qd, m, &mut s.split_a, &s.one)?;
                self.rms_norm(src, nw, s.qn.at_mut(0), &mut s.stats, m * n_head, hd)?;
                for sp in spans.iter().filter(|_| rope.is_some()) {
                    let table = rope.expect("filtered");
                    self.rope(s.qn.at_mut(sp.row0 * qd), *sp, table, n_head, qd)?;
                }
                (&s.qn, Slot { offset: 0, ld: qd })
            }
            None => {
                let heads = if qk_together { n_head + n_kv } else { n_head };
                for sp in spans.iter().filter(|_| rope.is_some()) {
                    let x = s.proj.at_mut(q.offset + sp.row0 * q.ld);
                    self.rope(x, *sp, rope.expect("filtered"), heads, q.ld)?;
                }
                (&s.proj, q)
            }
        };

        // Keys into the cache (normed on the way for Gemma, then rotated there unless already rotated).
        match &lw.k_norm {
            Some(nw) => {
                let src = contiguous(be, &s.proj, k, kvd, m, &mut s.split_b, &s.one)?;
                if m == 1 {
                    let at = spans[0].pos0 * row;
                    self.rms_norm(src, nw, caches[0].at_mut(at), &mut s.stats, n_kv, hd)?;
                } else {
                    // The norm writes packed rows; cache rows are [k | v].
                    self.rms_norm(src, nw, s.split_a.at_mut(0), &mut s.stats, m * n_kv, hd)?;
                    for (sp, cache) in spans.iter().zip(caches.iter_mut()) {
                        let (from, to) = (s.split_a.at(sp.row0 * kvd), cache.at_mut(sp.pos0 * row));
                        copy_rows(be, from, kvd, to, row, sp.rows, kvd, &s.one)?;
                    }
                }
            }
            None => {
                let width = if kv_together { 2 * kvd } else { kvd };
                for (sp, cache) in spans.iter().zip(caches.iter_mut()) {
                    let (from, to) = (
                        s.proj.at(k.offset + sp.row0 * k.ld),
                        cache.at_mut(sp.pos0 * row),
                    );
                    copy_rows(be, from, k.ld, to, row, sp.rows, width, &s.one)?;
                }
            }
        }
        for (sp, cache) in spans.iter().zip(caches.iter_mut()) {
            let at = sp.pos0 * row;
            if let (false, Some(table)) = (qk_together, rope) {
                self.rope(cache.at_mut(at), *sp, table, n_kv, row)?;
            }
            if !kv_together {
                let from = s.proj.at(v.offset + sp.row0 * v.ld);
                copy_rows(
                    be,
                    from,
                    v.ld,
                    cache.at_mut(at + kvd),
                    row,
                    sp.rows,
                    kvd,
                    &s.one,
                )?;
            }
            let shape = DecodeShape {
                rows: sp.rows,
                heads: n_head,
                kv_heads: n_kv,
                head_dim: hd,
                ld_q: q_slot.ld,
                ld_kv: row,
                ld_o: qd,
                q_pos0: sp.pos0,
                kv_len: sp.pos0 + sp.rows,
                window: la.window,
                scale: cfg.attn_scale,
                softcap: 0.0,
            };
            let (keys, values) = (cache.at(0), cache.at(kvd));
            let query = q_src.at(q_slot.offset + sp.row0 * q_slot.ld);
            attend(be, query, keys, values, s.att.at_mut(sp.row0 * qd), shape)?;
        }
        lw.wo
            .apply(be, self.rows(), s.att.at(0), s.out.at_mut(0), s.ones.at(0))?;
        self.residual(lw.post_attn_norm.as_ref(), s)
    }

    fn feed_forward(&self, lw: &LayerWeights, s: &mut Scratch) -> Result<()> {
        let (be, cfg, m) = (self.be, self.cfg, self.m);
        let ff = cfg.n_ff;
        self.norm(s.x.at(0), &lw.ffn_norm, &mut s.xn, &mut s.stats, m, &s.ones)?;
        lw.gate_up.apply(
            be,
            self.rows(),
            s.xn.at(0),
            &mut s.proj,
            self.batch,
            s.ones.at(0),
        )?;
        if cfg.gated_ffn {
            let (g, u) = (
                lw.gate_up.slot(0, self.batch),
                lw.gate_up.slot(1, self.batch),
            );
            let gate = contiguous(be, &s.proj, g, ff, m, &mut s.split_a, &s.one)?;
            let up = contiguous(be, &s.proj, u, ff, m, &mut s.split_b, &s.one)?;
            glu(be, cfg.activation, gate, up, s.act.at_mut(0), m * ff)?;
        } else {
            // The one member fills the group: m packed rows of ff.
            let up = lw.gate_up.slot(0, self.batch);
            gelu(be, s.proj.at(up.offset), s.act.at_mut(0), m * ff)?;
        }
        lw.down
            .apply(be, self.rows(), s.act.at(0), s.out.at_mut(0), s.ones.at(0))?;
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
