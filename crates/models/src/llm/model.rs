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
//! holds `[q | k | v]`: one op ([`rope_into_cache`]) norms and rotates the heads and writes the
//! queries out and the keys and values into the cache, and the GLU reads the two halves of each row in
//! place ([`glu_rows`]). (When the members come from products of different widths, the members that
//! must be contiguous are copied out first and the ops run one by one.)
//!
//! Two kinds of pass share the model's weights and KV cache:
//!
//! - a **prompt pass** ([`Llm::feed`]) takes m tokens of one sequence in one batched pass: its
//!   quantized products run as tiled GEMMs, its attention as flash-style tiles of 16 queries;
//! - a **decode pass** ([`Llm::decode_step`]) takes one token of each of up to `parallel` sequences
//!   ([`Sequence`], each a slot of the shared cache with its own position) and is built for the fewest
//!   dispatches: the norm before each projection, the GLU before the down projection and the residual
//!   addition after the output projections ride inside the quantized products
//!   ([`matmul_fused`]); the Q/K norms, RoPE, the cache writes and attention over every sequence are
//!   one op ([`attend_new_rows`]: the dispatch of [`attend_rows`], which takes the new rows as the
//!   product left them, and its merge past 32 positions — for a lone row, the output product merges
//!   the splits on its way in). A llama layer is five dispatches. The next tokens can be picked on the device ([`Llm::pick_greedy`]) and fed to the next
//!   pass from there, so the host never waits on the device in between ([`Llm::read_picks`]).
//!
//! Every op of a decode pass computes each row as it would alone, so a sequence's numbers do not depend
//! on which others share its pass.

use tinygpt_formats::GgufFile;
use tinygpt_kernels::ops::add::add_assign;
use tinygpt_kernels::ops::argmax::argmax_rows;
use tinygpt_kernels::ops::attention::{
    Attended, CacheRows, DecodeShape, NewRows, RowsShape, attend, attend_new_rows, attend_rows,
};
use tinygpt_kernels::ops::fill::copy_rows;
use tinygpt_kernels::ops::gelu::gelu;
use tinygpt_kernels::ops::glu::{glu, glu_rows};
use tinygpt_kernels::ops::matmul::RowMode;
use tinygpt_kernels::ops::matmul::fused::{Input, Output, Residual, residual_norm_pays};
use tinygpt_kernels::ops::norm::{NormKind, NormShape, add_rms_norm, norm_forward};
use tinygpt_kernels::ops::rope::{
    QkNorm, RopeCacheShape, RopeShape, rope, rope_into_cache, rope_table,
};
use tinygpt_kernels::ops::sample::{PARAM_WORDS, RowSampling, sample_rows};
use tinygpt_kernels::path::Fault;
use tinygpt_kernels::{Backend, DType, PathId, PathSet, PendingRead, TMut, TRef, Tensor};

use super::config::{LayerAttention, LlmConfig};
use super::error::{LlmError, Result};
use super::kv_cache::KvPool;
use super::weights::{
    Fused, LayerWeights, Linear, LoadProgress, Matrix, Norm, Rows, Slot, Weights, add_bias,
};

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
    /// Most sequences one decode pass takes.
    pub parallel: usize,
    /// Sequences the KV cache holds besides the model's own, for [`Llm::new_sequence`] (a server's
    /// slots); 0 for one conversation.
    pub sequences: usize,
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
            sequences: 0,
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
    /// Token ids (u32): a pass's input, and the tokens [`Llm::pick_greedy`] picks.
    ids: Tensor,
    /// Each row's position (u32), for learned positions.
    pos_ids: Tensor,
    /// A pass's cache rows: [first cache row of its sequence, position] per row (u32); a prompt pass's
    /// count from its sequence's first cache row.
    rows: Tensor,
    /// `batch` ones: the left operand of bias additions (see [`add_bias`]).
    ones: Tensor,
    /// The residual stream [batch, d].
    x: Tensor,
    /// Where a decode pass's product that lets a post-normed output join the residual stream writes
    /// the new stream (then swapped with `x`) [batch, d].
    x2: Tensor,
    /// A sublayer's normed input, or its post-normed output [batch, d].
    xn: Tensor,
    /// RMSNorm statistics of up to batch · heads rows.
    stats: Tensor,
    /// Fused products: [q | k | v] or [gate | up] per row.
    proj: Tensor,
    /// Members of `proj` copied out as contiguous rows.
    split_a: Tensor,
    split_b: Tensor,
    /// Normed and rotated queries [batch, q_dim] (Gemma; every model in a decode pass).
    qn: Tensor,
    /// Attention output [batch, q_dim].
    att: Tensor,
    /// A sublayer's output [batch, d].
    out: Tensor,
    /// act(gate) · up [batch, ff].
    act: Tensor,
    logits: Tensor,
    /// Each row's settings for the device sampler (u32 words, [`PARAM_WORDS`] per row).
    sampling: Tensor,
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
            rows: be.zeros_typed(2 * batch, 2 * batch, DType::U32)?,
            ones: be.from_f32(&vec![1.0; batch], batch)?,
            x: z(batch, d)?,
            x2: z(batch, d)?,
            xn: z(batch, d)?,
            stats: z(2, batch * heads)?,
            proj: z(batch, (qd + 2 * kvd).max(2 * ff))?,
            split_a: z(batch, split)?,
            split_b: z(batch, split)?,
            qn: z(batch, qd)?,
            att: z(batch, qd)?,
            out: z(batch, d)?,
            act: z(batch, ff)?,
            logits: z(parallel, cfg.vocab)?,
            sampling: be.zeros_typed(parallel * PARAM_WORDS, PARAM_WORDS, DType::U32)?,
        })
    }

    fn bytes(&self) -> u64 {
        [
            &self.ids,
            &self.pos_ids,
            &self.rows,
            &self.ones,
            &self.x,
            &self.x2,
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
        ]
        .iter()
        .map(|t| t.bytes())
        .sum()
    }
}

/// One sequence's state: its slot of the model's KV cache and the positions it holds. A model holds one
/// of its own (the single-sequence methods of [`Llm`] use it); [`Llm::new_sequence`] hands out the others.
#[derive(Debug)]
pub struct Sequence {
    slot: usize,
    pos: usize,
    context: usize,
}

impl Sequence {
    /// Which slot of the model's KV cache the sequence holds (unique among the live sequences of a
    /// model).
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// Positions in use (tokens fed since the last reset).
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Positions the cache holds.
    pub fn context(&self) -> usize {
        self.context
    }

    /// Forgets every position.
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Forgets the positions from `n` on (keeps the first `n` tokens' keys and values).
    pub fn truncate(&mut self, n: usize) {
        self.pos = self.pos.min(n);
    }

    /// Checks that `tokens` fit after what the sequence holds and are in the vocabulary.
    fn check(&self, tokens: &[u32], vocab: usize) -> Result<()> {
        if tokens.is_empty() {
            return Err(LlmError::Options("no tokens to feed".into()));
        }
        self.check_room(tokens.len())?;
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= vocab) {
            return Err(LlmError::TokenOutOfRange { id, vocab });
        }
        Ok(())
    }

    fn check_room(&self, n: usize) -> Result<()> {
        if n > self.context - self.pos {
            return Err(LlmError::ContextFull {
                tokens: n,
                used: self.pos,
                limit: self.context,
            });
        }
        Ok(())
    }
}

/// The tokens a decode pass feeds.
#[derive(Clone, Copy, Debug)]
pub enum Feed<'a> {
    /// One id per sequence, from the host.
    Ids(&'a [u32]),
    /// The ids the last [`Llm::pick_greedy`] left on the device, one per sequence.
    Picked,
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
    /// Every sequence's keys and values.
    pool: KvPool,
    /// Rows of the last decode pass (sizes the logits and picks to read).
    last_rows: usize,
    /// Rows whose device-sampling settings [`Llm::set_sampling`] stored last.
    sampling_rows: usize,
    /// Whether a decode pass's post-normed outputs join the residual stream inside the next product
    /// ([`Llm::set_fold_post_norms`]).
    fold_post_norms: bool,
}

/// A GGUF model loaded on a backend, with its own sequence's KV cache.
pub struct Llm {
    core: Core,
    seq: Sequence,
    /// The tokens of the model's own sequence, one per position; [`PICKED`] for a token fed from the
    /// device ([`Feed::Picked`]) until [`Llm::finish_picks`] brings its id to the host.
    history: Vec<u32>,
    /// Indices into `history` of tokens still [`PICKED`], oldest first.
    unread: std::collections::VecDeque<usize>,
}

/// A history entry whose id is still on the device.
const PICKED: u32 = u32::MAX;

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
        // The model's own sequence, and the others a server hands out.
        let slots = opts.sequences.checked_add(1).ok_or_else(|| {
            LlmError::Options(format!("{} sequences is too many", opts.sequences))
        })?;
        let pool = KvPool::new(be, cfg.n_layer, slots, context, 2 * cfg.kv_dim())?;
        let (ropes, layer_rope) = rope_tables(be, &cfg, context, opts.paths)?;
        let s = Scratch::new(be, &cfg, batch, opts.parallel)?;
        let mut pool = pool;
        pool.taken[0] = true;
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
                // The tensor-core training path is a trainer's, never an inference runner's.
                paths: opts.paths.without(PathId::MixedTraining),
                scored: None,
                pool,
                last_rows: 0,
                sampling_rows: 0,
                fold_post_norms: residual_norm_pays(be),
            },
            seq: Sequence {
                slot: 0,
                pos: 0,
                context,
            },
            history: Vec::new(),
            unread: Default::default(),
        })
    }

    /// Moves the model to the fast paths `paths` (the f32 path: [`PathSet::F32`]), converting its
    /// weights again from `file` (the file it was loaded from), then recomputes its sequence's keys and
    /// values on them from its token history, so the next logits are those of the new paths alone. The
    /// drift guard's fallback ([`super::DriftGuard`]). Fails if a token fed from the device has not
    /// been read yet ([`Llm::finish_picks`]).
    pub fn switch_paths(&mut self, be: &Backend, file: &GgufFile, paths: PathSet) -> Result<()> {
        let paths = paths.without(PathId::MixedTraining);
        if !self.unread.is_empty() {
            return Err(LlmError::Options(
                "a picked token is still on the device: finish_picks first".into(),
            ));
        }
        let c = &mut self.core;
        let w = Weights::load(be, file, &c.cfg, &mut |_| {}, false, paths)?;
        let (ropes, layer_rope) = rope_tables(be, &c.cfg, c.context, paths)?;
        c.w = w;
        c.ropes = ropes;
        c.layer_rope = layer_rope;
        c.paths = paths;
        let tokens = std::mem::take(&mut self.history);
        self.seq.reset();
        if !tokens.is_empty() {
            self.feed(be, &tokens)?;
        }
        Ok(())
    }

    /// [`Llm::switch_paths`] for a model serving other sequences too: each of `seqs` (with the tokens
    /// it holds, one per position) has its keys and values recomputed on the new paths.
    pub fn switch_paths_with(
        &mut self,
        be: &Backend,
        file: &GgufFile,
        paths: PathSet,
        seqs: &mut [(&mut Sequence, &[u32])],
    ) -> Result<()> {
        self.switch_paths(be, file, paths)?;
        for (seq, tokens) in seqs.iter_mut() {
            if tokens.len() != seq.pos {
                return Err(LlmError::Options(format!(
                    "a sequence holds {} positions, {} tokens given",
                    seq.pos,
                    tokens.len()
                )));
            }
            seq.reset();
            if !tokens.is_empty() {
                self.feed_sequence(be, seq, tokens)?;
            }
        }
        Ok(())
    }

    /// The tokens the model's own sequence holds, one per position (see [`Llm::finish_picks`] for
    /// tokens fed from the device).
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// Starts reading what a drift check of `seq` (None: the model's own sequence) needs, in one
    /// submission: row `row` of the last pass's logits if asked (as the device holds them: a final
    /// softcap is not applied, see [`soft_cap`]) and the sequence's keys and values of positions
    /// `from .. from + n` of every layer (`n` rows of `[k | v]` each: what [`Llm::write_kv`] puts
    /// into another model of the same file). Returns the read, for any thread to finish
    /// ([`Backend::read_detach`]), and the lengths of its views: the logits row's (if asked), then
    /// each layer's.
    pub fn start_check_read(
        &self,
        be: &Backend,
        seq: Option<&Sequence>,
        row: Option<usize>,
        from: usize,
        n: usize,
    ) -> Result<(tinygpt_kernels::PendingRead, Vec<usize>)> {
        let c = &self.core;
        let v = c.cfg.vocab;
        let seq = seq.unwrap_or(&self.seq);
        if let Some(row) = row
            && row >= c.parallel
        {
            return Err(LlmError::Options(format!(
                "row {row} of a pass of at most {} sequences",
                c.parallel
            )));
        }
        if from + n > seq.pos {
            return Err(LlmError::Options(format!(
                "positions {from}..{} asked, {} held",
                from + n,
                seq.pos
            )));
        }
        let pool = &c.pool;
        let at = (pool.base(seq.slot) + from) * pool.width;
        let mut views: Vec<_> = row
            .map(|row| (c.s.logits.at(row * v), v))
            .into_iter()
            .collect();
        let mut lens: Vec<usize> = views.iter().map(|&(_, len)| len).collect();
        lens.extend(std::iter::repeat_n(n * pool.width, pool.kv.len()));
        // No rows: no views of the cache (its lengths are the zeros above).
        if n > 0 {
            views.extend(pool.kv.iter().map(|kv| (kv.at(at), n * pool.width)));
        }
        Ok((be.read_start_many(&views)?, lens))
    }

    /// Makes the model's own sequence hold its first `from` tokens, then `tokens` with the keys and
    /// values `kv` (read by [`Llm::start_check_read`] from a model of the same file), without
    /// computing them.
    pub fn write_kv(
        &mut self,
        be: &Backend,
        from: usize,
        kv: &[Vec<f32>],
        tokens: &[u32],
    ) -> Result<()> {
        let pool = &mut self.core.pool;
        let n = tokens.len();
        if from > self.seq.pos
            || kv.len() != pool.kv.len()
            || kv.iter().any(|l| l.len() != n * pool.width)
        {
            return Err(LlmError::Options(format!(
                "keys and values of {} layers of {n} rows of {} after at most {} positions expected",
                pool.kv.len(),
                pool.width,
                self.seq.pos
            )));
        }
        self.seq.truncate(from);
        self.seq.check_room(n)?;
        let at = (pool.base(self.seq.slot) + from) * pool.width;
        for (t, rows) in pool.kv.iter_mut().zip(kv) {
            if n > 0 {
                be.write_f32(t.at_mut(at), rows)?;
            }
        }
        self.seq.pos = from + n;
        self.history.truncate(from);
        self.history.extend_from_slice(tokens);
        self.unread.clear();
        Ok(())
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
        self.history.clear();
        self.unread.clear();
    }

    /// Forgets the positions from `n` on (keeps the first `n` tokens' keys and values).
    pub fn truncate(&mut self, n: usize) {
        self.seq.truncate(n);
        self.history.truncate(self.seq.pos);
        let n = self.history.len();
        self.unread.retain(|&i| i < n);
    }

    /// Most sequences one decode pass takes.
    pub fn parallel(&self) -> usize {
        self.core.parallel
    }

    /// A new sequence with its own slot of the KV cache (empty), one of the `parallel` the model was
    /// loaded with; [`Llm::free_sequence`] gives the slot back.
    pub fn new_sequence(&mut self) -> Result<Sequence> {
        let p = &mut self.core.pool;
        let Some(slot) = p.taken.iter().position(|t| !t) else {
            return Err(LlmError::Options(format!(
                "all {} sequences of the KV cache are in use (load with more `sequences`)",
                p.taken.len().saturating_sub(1)
            )));
        };
        p.taken[slot] = true;
        Ok(Sequence {
            slot,
            pos: 0,
            context: p.context,
        })
    }

    /// Gives a sequence's slot back for a later [`Llm::new_sequence`].
    pub fn free_sequence(&mut self, seq: Sequence) {
        if seq.slot != 0 {
            self.core.pool.taken[seq.slot] = false;
        }
    }

    /// Bytes one more sequence's KV cache takes.
    pub fn sequence_bytes(&self) -> u64 {
        self.core.pool.slot_bytes()
    }

    pub fn memory(&self) -> MemoryReport {
        let c = &self.core;
        MemoryReport {
            weights: c.w.bytes(),
            kv_cache: c.pool.bytes(),
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
        self.core.feed(be, &mut self.seq, tokens)?;
        self.history.extend_from_slice(tokens);
        Ok(())
    }

    /// [`Llm::feed`] for another sequence (a prompt, or any tokens after what it holds). Its logits go
    /// to row 0 of [`Llm::read_logits_batch`].
    pub fn feed_sequence(
        &mut self,
        be: &Backend,
        seq: &mut Sequence,
        tokens: &[u32],
    ) -> Result<()> {
        self.core.feed(be, seq, tokens)
    }

    /// Records one decode pass feeding one token to each of `seqs` (at most [`Llm::parallel`]; the
    /// model's own sequence with `seqs` empty): the weights are read once for all of them. Row i of the
    /// logits ([`Llm::read_logits_batch`]) follows sequence i's token.
    pub fn decode_step(
        &mut self,
        be: &Backend,
        seqs: &mut [&mut Sequence],
        feed: Feed<'_>,
    ) -> Result<()> {
        if seqs.is_empty() {
            self.core.decode(be, &mut [&mut self.seq], feed)?;
            match feed {
                Feed::Ids(ids) => self.history.extend_from_slice(ids),
                Feed::Picked => {
                    self.unread.push_back(self.history.len());
                    self.history.push(PICKED);
                }
            }
            return Ok(());
        }
        self.core.decode(be, seqs, feed)
    }

    /// Records picking each row's most likely token of the last pass (the first of equal maxima, as
    /// [`crate::sampler::argmax`]) on the device: the next [`Feed::Picked`] pass reads them there, and
    /// [`Llm::read_picks`] brings them to the host. Models that soft-cap their logits read them instead
    /// ([`Llm::picks_on_device`] says which).
    pub fn pick_greedy(&mut self, be: &Backend) -> Result<()> {
        let c = &mut self.core;
        if !c.picks_on_device() {
            return Err(LlmError::Options(
                "this model caps its logits: pick from read_logits".into(),
            ));
        }
        let rows = c.last_rows.max(1);
        argmax_rows(be, c.s.logits.at(0), c.s.ids.at_mut(0), rows, c.cfg.vocab)?;
        Ok(())
    }

    /// Records sampling each row of the last pass on the device with its settings (`rows`: one per
    /// row of the pass; see [`crate::sampler::Sampler::device_row`]): the next [`Feed::Picked`] pass
    /// reads the tokens there, and [`Llm::read_picks`] brings them to the host, as with
    /// [`Llm::pick_greedy`] (which a greedy row's pick equals). Models that soft-cap their logits
    /// cannot ([`Llm::picks_on_device`]).
    pub fn pick_sampled(&mut self, be: &Backend, rows: &[RowSampling]) -> Result<()> {
        self.set_sampling(be, rows)?;
        self.pick_set(be)
    }

    /// Whether a decode pass's post-normed sublayer outputs (Gemma 3) join the residual stream inside
    /// the next product or by a dispatch of their own. The numbers are the same either way; the default
    /// is what is faster on the backend (folded on a GPU, not on a software adapter, where every
    /// workgroup's repeated norms are CPU time). Tests turn it on to run the folded form on lavapipe.
    pub fn set_fold_post_norms(&mut self, on: bool) {
        self.core.fold_post_norms = on;
    }

    /// The first half of [`Llm::pick_sampled`]: stores the settings of the rows of the pass about to
    /// be recorded. Writing them before that pass, not after it, keeps a decode step to one submit
    /// (a write flushes the work recorded before it).
    pub fn set_sampling(&mut self, be: &Backend, rows: &[RowSampling]) -> Result<()> {
        let c = &mut self.core;
        if rows.is_empty() || rows.len() > c.parallel {
            return Err(LlmError::Options(format!(
                "sampling settings for 1 to {} rows, not {}",
                c.parallel,
                rows.len()
            )));
        }
        let words: Vec<u32> = rows.iter().flat_map(|r| r.words()).collect();
        be.write_u32(c.s.sampling.at_mut(0), &words)?;
        c.sampling_rows = rows.len();
        Ok(())
    }

    /// The second half of [`Llm::pick_sampled`]: records sampling the last pass's rows with the
    /// settings [`Llm::set_sampling`] stored.
    pub fn pick_set(&mut self, be: &Backend) -> Result<()> {
        let c = &mut self.core;
        if !c.picks_on_device() {
            return Err(LlmError::Options(
                "this model caps its logits: sample from read_logits".into(),
            ));
        }
        let n = c.last_rows.max(1);
        if c.sampling_rows != n {
            return Err(LlmError::Options(format!(
                "sampling settings for {} rows, the last pass had {n}",
                c.sampling_rows
            )));
        }
        sample_rows(
            be,
            c.s.logits.at(0),
            c.s.sampling.at(0),
            c.s.ids.at_mut(0),
            n,
            c.cfg.vocab,
        )?;
        Ok(())
    }

    /// Whether [`Llm::pick_greedy`] picks what the host's argmax of [`Llm::read_logits`] would.
    pub fn picks_on_device(&self) -> bool {
        self.core.picks_on_device()
    }

    /// Starts bringing the last [`Llm::pick_greedy`]'s ids to the host; work recorded after this call
    /// keeps the device busy while the host waits in [`Llm::finish_picks`].
    pub fn read_picks(&self, be: &Backend) -> Result<PendingRead> {
        let c = &self.core;
        Ok(be.read_start(c.s.ids.at(0), c.last_rows.max(1))?)
    }

    /// The ids of a [`Llm::read_picks`], one per row of its pass. The oldest token the model's own
    /// sequence was fed from the device ([`Feed::Picked`]) is the first of them: it goes into
    /// [`Llm::history`].
    pub async fn finish_picks(&mut self, be: &Backend, p: PendingRead) -> Result<Vec<u32>> {
        let ids = be.read_finish(p).await?;
        if let (Some(i), Some(&id)) = (self.unread.front().copied(), ids.first()) {
            self.history[i] = id;
            self.unread.pop_front();
        }
        Ok(ids)
    }

    /// Records one decode pass feeding one token to each sequence (at most [`Llm::parallel`]).
    pub fn decode_batch(&mut self, be: &Backend, steps: &mut [(&mut Sequence, u32)]) -> Result<()> {
        let ids: Vec<u32> = steps.iter().map(|(_, t)| *t).collect();
        let mut seqs: Vec<&mut Sequence> = steps.iter_mut().map(|(s, _)| &mut **s).collect();
        if seqs.is_empty() {
            return Err(LlmError::Options("a decode pass needs a sequence".into()));
        }
        self.core.decode(be, &mut seqs, Feed::Ids(&ids))
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
                c.forward(be, chunk, &mut self.seq, None)?;
                continue;
            }
            c.forward(be, chunk, &mut self.seq, Some(f))?;
            let t = c.scored.as_ref().expect("made by forward");
            let rows = be.read_f32(t.at(0), (chunk.len() - f) * v).await?;
            out.extend_from_slice(&rows);
        }
        self.history.extend_from_slice(tokens);
        soft_cap(&mut out, c.cfg.final_softcap);
        Ok(out)
    }

    /// Feeds `tokens` (after what the cache holds) and returns, for each position j from `from` to the
    /// last but one, −log p(tokens[j + 1]) under the model's next-token distribution at j: what
    /// perplexity sums. The log-softmax runs on the backend (on a GPU only one number per row comes
    /// back, not a vocabulary of logits), with f32 sums; models that soft-cap their logits are scored
    /// on the host from [`Llm::score`]'s rows.
    pub async fn score_nll(
        &mut self,
        be: &Backend,
        tokens: &[u32],
        from: usize,
    ) -> Result<Vec<f32>> {
        let v = self.core.cfg.vocab;
        let target = |p: usize| {
            tokens
                .get(p + 1)
                .copied()
                .unwrap_or(tinygpt_kernels::ops::cross_entropy::IGNORE)
        };
        if self.core.cfg.final_softcap > 0.0 {
            let rows = self.score(be, tokens, from).await?;
            return Ok(rows
                .chunks(v)
                .enumerate()
                .take(tokens.len().saturating_sub(from + 1))
                .map(|(i, row)| nll_of(row, target(from + i) as usize))
                .collect());
        }
        if tokens.len() <= self.core.batch {
            let r = self.score_nll_start(be, tokens, from)?;
            return self.score_nll_finish(be, r).await;
        }
        let c = &mut self.core;
        self.seq.check(tokens, v)?;
        let mut out = Vec::with_capacity(tokens.len().saturating_sub(from));
        for (i, chunk) in tokens.chunks(c.batch).enumerate() {
            let start = i * c.batch;
            let f = from.saturating_sub(start);
            if f >= chunk.len() {
                c.forward(be, chunk, &mut self.seq, None)?;
                continue;
            }
            c.forward(be, chunk, &mut self.seq, Some(f))?;
            let targets: Vec<u32> = (start + f..start + chunk.len()).map(target).collect();
            let losses = c.scored_losses(be, &targets)?;
            out.extend(be.read_f32((&losses).into(), targets.len()).await?);
        }
        self.history.extend_from_slice(tokens);
        // The last position has no next token to score.
        out.truncate(tokens.len().saturating_sub(from + 1));
        Ok(out)
    }

    /// [`Llm::score_nll`] in two halves, for `tokens` that fit one pass ([`Llm::batch`]) of a model that
    /// does not soft-cap its logits: this records the pass and the losses and starts reading them
    /// back, so a caller can record the next sequence's pass before waiting for this one's numbers
    /// ([`Llm::score_nll_finish`]); the device then never waits for the host between the two.
    pub fn score_nll_start(
        &mut self,
        be: &Backend,
        tokens: &[u32],
        from: usize,
    ) -> Result<NllRead> {
        let c = &mut self.core;
        let v = c.cfg.vocab;
        if tokens.len() > c.batch || c.cfg.final_softcap > 0.0 {
            return Err(LlmError::Options(format!(
                "score_nll_start takes at most {} tokens of a model without soft-capped logits",
                c.batch
            )));
        }
        self.seq.check(tokens, v)?;
        let want = tokens.len().saturating_sub(from + 1);
        if from >= tokens.len() {
            c.forward(be, tokens, &mut self.seq, None)?;
            self.history.extend_from_slice(tokens);
            return Ok(NllRead { losses: None, want });
        }
        c.forward(be, tokens, &mut self.seq, Some(from))?;
        let targets: Vec<u32> = (from..tokens.len())
            .map(|p| {
                tokens
                    .get(p + 1)
                    .copied()
                    .unwrap_or(tinygpt_kernels::ops::cross_entropy::IGNORE)
            })
            .collect();
        let losses = c.scored_losses(be, &targets)?;
        let read = be.read_start((&losses).into(), targets.len())?;
        self.history.extend_from_slice(tokens);
        Ok(NllRead {
            losses: Some((losses, read)),
            want,
        })
    }

    /// The numbers of a [`Llm::score_nll_start`].
    pub async fn score_nll_finish(&self, be: &Backend, r: NllRead) -> Result<Vec<f32>> {
        let Some((_losses, read)) = r.losses else {
            return Ok(Vec::new());
        };
        let mut out = be.read_finish_f32(read).await?;
        out.truncate(r.want);
        Ok(out)
    }

    /// Most tokens one pass takes.
    pub fn batch(&self) -> usize {
        self.core.batch
    }

    /// The logits after the last token fed (host), soft-capped if the model caps them.
    pub async fn read_logits(&self, be: &Backend) -> Result<Vec<f32>> {
        Ok(self.core.read_logits(be, 1).await?.swap_remove(0))
    }

    /// The logits of each of the first `n` rows of the last decode pass.
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
        self.decode_step(be, &mut [], Feed::Ids(&[token]))?;
        pollster::block_on(self.read_logits(be))
    }
}

impl Core {
    /// Prompt passes of at most the batch.
    fn feed(&mut self, be: &Backend, seq: &mut Sequence, tokens: &[u32]) -> Result<()> {
        seq.check(tokens, self.cfg.vocab)?;
        for chunk in tokens.chunks(self.batch) {
            self.forward(be, chunk, seq, None)?;
        }
        self.last_rows = 1;
        Ok(())
    }

    fn picks_on_device(&self) -> bool {
        self.cfg.final_softcap == 0.0
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
        Ok(all
            .chunks(v)
            .map(|row| {
                let mut row = row.to_vec();
                soft_cap(&mut row, self.cfg.final_softcap);
                row
            })
            .collect())
    }

    /// −log softmax(row)[targets[r]] for each row r of the last pass's `scored` logits (one row per
    /// target; a target of `IGNORE` scores 0), on the backend.
    fn scored_losses(&self, be: &Backend, targets: &[u32]) -> Result<Tensor> {
        let rows = targets.len();
        let t = be.from_u32(targets, 1)?;
        let mut losses = be.zeros(rows, 1)?;
        let scored = self.scored.as_ref().expect("made by forward");
        tinygpt_kernels::ops::cross_entropy::cross_entropy(
            be,
            scored.at(0),
            (&t).into(),
            (&mut losses).into(),
            None,
            rows,
            self.cfg.vocab,
            1.0,
        )?;
        Ok(losses)
    }

    /// One prompt pass over `tokens` of `seq`; with `scored_from = Some(f)` the logits of rows f.. go
    /// to `scored` instead of the last row's to `logits`.
    fn forward(
        &mut self,
        be: &Backend,
        tokens: &[u32],
        seq: &mut Sequence,
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
            pool,
            ..
        } = self;
        let pass = Pass {
            be,
            paths: *paths,
            cfg,
            m: tokens.len(),
            batch: *batch,
            context: *context,
            mode: RowMode::Shared,
            pos0: seq.pos,
            fold_post_norms: false,
        };
        let d = cfg.d_model;
        // The pass's inputs, all written before its first op is recorded (a write flushes the work
        // recorded before it): the ids, the positions (learned position embeddings), and where each
        // row goes in the sequence's cache (one write for every layer's rope_into_cache).
        be.write_u32(s.ids.at_mut(0), tokens)?;
        if w.pos_embd.is_some() {
            let ids: Vec<u32> = (seq.pos..seq.pos + pass.m).map(|p| p as u32).collect();
            be.write_u32(s.pos_ids.at_mut(0), &ids)?;
        }
        let table: Vec<[u32; 2]> = (0..pass.m).map(|r| [0, (seq.pos + r) as u32]).collect();
        let words: Vec<u32> = table.iter().flatten().copied().collect();
        be.write_u32(s.rows.at_mut(0), &words)?;
        w.embed
            .get_rows(be, s.ids.at(0), s.x.at_mut(0), pass.m, cfg.embed_scale)?;
        if let Some(pos) = &w.pos_embd {
            pos.get_rows(be, s.pos_ids.at(0), s.out.at_mut(0), pass.m, 1.0)?;
            add_assign(be, s.x.at_mut(0), s.out.at(0), pass.m * d, 1.0)?;
        }
        let at = pool.base(seq.slot) * pool.width;
        for (l, lw) in w.layers.iter().enumerate() {
            let rope = layer_rope.get(l).map(|&i| &ropes[i]);
            let cache = pool.kv[l].at_mut(at);
            pass.attention(lw, &cfg.layers[l], s, cache, &table, rope)?;
            pass.feed_forward(lw, s)?;
        }
        // Only the last position's logits are needed, or those of every row from `scored_from`.
        let (first, rows) = match scored_from {
            Some(f) => (f, pass.m - f),
            None => (pass.m - 1, 1),
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
        seq.pos += pass.m;
        Ok(())
    }

    /// One decode pass: a token for each of `seqs`, every op over all rows at once.
    fn decode(&mut self, be: &Backend, seqs: &mut [&mut Sequence], feed: Feed<'_>) -> Result<()> {
        let m = seqs.len();
        if m == 0 || m > self.parallel {
            return Err(LlmError::Options(format!(
                "a decode pass takes 1 to {} sequences, not {m}",
                self.parallel
            )));
        }
        match feed {
            Feed::Ids(ids) => {
                if ids.len() != m {
                    return Err(LlmError::Options(format!(
                        "{} ids for {m} sequences",
                        ids.len()
                    )));
                }
                for (seq, id) in seqs.iter().zip(ids) {
                    seq.check(std::slice::from_ref(id), self.cfg.vocab)?;
                }
            }
            Feed::Picked => {
                if self.last_rows != m {
                    return Err(LlmError::Options(format!(
                        "the last pass picked {} tokens, not {m}",
                        self.last_rows
                    )));
                }
                for seq in seqs.iter() {
                    seq.check_room(1)?;
                }
            }
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
            pool,
            fold_post_norms,
            ..
        } = self;
        let table: Vec<[u32; 2]> = seqs
            .iter()
            .map(|q| [pool.base(q.slot) as u32, q.pos as u32])
            .collect();
        let pass = Pass {
            be,
            paths: *paths,
            cfg,
            m,
            batch: *batch,
            context: *context,
            mode: RowMode::Independent,
            pos0: 0,
            fold_post_norms: *fold_post_norms,
        };
        let d = cfg.d_model;
        if let Feed::Ids(ids) = feed {
            be.write_u32(s.ids.at_mut(0), ids)?;
        }
        let words: Vec<u32> = table.iter().flatten().copied().collect();
        be.write_u32(s.rows.at_mut(0), &words)?;
        if w.pos_embd.is_some() {
            // Written before the first op too (a write flushes the work recorded before it).
            let ids: Vec<u32> = table.iter().map(|r| r[1]).collect();
            be.write_u32(s.pos_ids.at_mut(0), &ids)?;
        }
        w.embed
            .get_rows(be, s.ids.at(0), s.x.at_mut(0), m, cfg.embed_scale)?;
        if let Some(pos) = &w.pos_embd {
            pos.get_rows(be, s.pos_ids.at(0), s.out.at_mut(0), m, 1.0)?;
            add_assign(be, s.x.at_mut(0), s.out.at(0), m * d, 1.0)?;
        }
        // A post-normed sublayer output waiting in `s.out` to join the residual stream (Gemma 3): the
        // next product takes it in (its post-norm weight).
        let mut pending = None;
        for (l, lw) in w.layers.iter().enumerate() {
            let rope = layer_rope.get(l).map(|&i| &ropes[i]);
            let kv = &mut pool.kv[l];
            pending = pass.decode_attention(lw, &cfg.layers[l], s, kv, &table, rope, pending)?;
            pending = pass.decode_feed_forward(lw, s, pending)?;
        }
        pass.first_products(&w.output_norm, pending, s, First::Head(w.head()))?;
        for q in seqs.iter_mut() {
            q.pos += 1;
        }
        self.last_rows = m;
        Ok(())
    }
}

/// What reads a decode pass's normed residual stream first: a sublayer's fused group, or the head.
#[derive(Clone, Copy)]
enum First<'w> {
    Group(&'w Fused),
    Head(&'w Matrix),
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
    /// Independent when the rows belong to different sequences: each sequence's numbers must not
    /// depend on which others share its pass.
    mode: RowMode,
    /// A prompt pass's first position (its rows follow on).
    pos0: usize,
    /// Whether a post-normed output waits for the next product to take it in (decode passes).
    fold_post_norms: bool,
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

    /// What a product reading norm(x) takes: the norm itself, fused into the product, for RMSNorm
    /// without a bias; otherwise x normed into `xn` first.
    fn normed<'t>(
        &self,
        n: &'t Norm,
        x: &'t Tensor,
        xn: &'t mut Tensor,
        stats: &mut Tensor,
        ones: &Tensor,
    ) -> Result<Input<'t>> {
        if self.rms_fusable(n) {
            return Ok(Input::RmsNorm {
                x: x.at(0),
                w: (&n.w).into(),
                eps: self.cfg.norm_eps,
            });
        }
        self.norm(x.at(0), n, xn, stats, self.m, ones)?;
        let xn: &'t Tensor = xn;
        Ok(Input::Rows(xn.at(0)))
    }

    /// Whether a product can take norm `n` in (an RMSNorm without a bias).
    fn rms_fusable(&self, n: &Norm) -> bool {
        self.cfg.norm == NormKind::Rms && n.b.is_none()
    }

    /// x += RMSNorm(s.out) · post: a post-normed sublayer output joins the residual stream.
    fn join(&self, post: &Tensor, s: &mut Scratch) -> Result<()> {
        let shape = NormShape {
            rows: self.m,
            cols: self.cfg.d_model,
            eps: self.cfg.norm_eps,
        };
        Ok(add_rms_norm(
            self.be,
            s.x.at_mut(0),
            s.out.at(0),
            post.into(),
            shape,
        )?)
    }

    /// A decode pass's first products of norm(x) · n (a sublayer's group into `s.proj`, or the head into
    /// `s.logits`), after a post-normed output waiting in `s.out` (`pending`: its post-norm weight)
    /// joins x: inside the first product where the fused kernel takes it (the new x goes to `s.x2`, then
    /// is swapped in), else as an op of its own.
    fn first_products(
        &self,
        n: &Norm,
        pending: Option<&Tensor>,
        s: &mut Scratch,
        first: First<'_>,
    ) -> Result<()> {
        let (be, rows) = (self.be, self.rows());
        if let Some(post) = pending {
            if self.rms_fusable(n) {
                let norms = (post.into(), (&n.w).into(), self.cfg.norm_eps);
                let (d, ones) = (s.out.at(0), s.ones.at(0));
                let how = match first {
                    First::Group(f) => {
                        let xs = (&mut s.x, &mut s.x2);
                        f.apply_residual_norm(
                            be,
                            rows,
                            xs,
                            d,
                            norms,
                            &mut s.proj,
                            self.batch,
                            ones,
                        )?
                    }
                    First::Head(h) => {
                        let xs = (s.x.at_mut(0), s.x2.at_mut(0));
                        h.residual_norm(be, rows, xs, d, norms, s.logits.at_mut(0))?
                    }
                };
                if how == Residual::Moved {
                    std::mem::swap(&mut s.x, &mut s.x2);
                }
                return Ok(());
            }
            self.join(post, s)?;
        }
        let input = self.normed(n, &s.x, &mut s.xn, &mut s.stats, &s.ones)?;
        match first {
            First::Group(f) => {
                f.apply_fused(be, rows, input, &mut s.proj, self.batch, s.ones.at(0))
            }
            First::Head(h) => h.fused(be, rows, input, s.logits.at_mut(0), Output::Store),
        }
    }

    /// Rotates the pass's rows of `x` (`x` views its first row).
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

    /// x += [post_norm](input · Wᵀ + b): the addition rides inside the product when there is neither a
    /// post-norm nor a bias. With `defer`, a post-normed output without a bias is left in `out` for the
    /// next product to take in: the post-norm's weight comes back.
    #[allow(clippy::too_many_arguments)]
    fn residual_fused<'t>(
        &self,
        input: Input<'_>,
        lin: &Linear,
        post_norm: Option<&'t Tensor>,
        x: &mut Tensor,
        out: &mut Tensor,
        ones: &Tensor,
        defer: bool,
    ) -> Result<Option<&'t Tensor>> {
        let (be, m, d) = (self.be, self.m, self.cfg.d_model);
        if post_norm.is_none() && lin.b.is_none() {
            lin.w
                .fused(be, self.rows(), input, x.at_mut(0), Output::Accumulate)?;
            return Ok(None);
        }
        lin.w
            .fused(be, self.rows(), input, out.at_mut(0), Output::Store)?;
        if defer && lin.b.is_none() {
            return Ok(post_norm);
        }
        if let Some(b) = &lin.b {
            add_bias(be, ones.at(0), b, out.at_mut(0), m, d)?;
        }
        let shape = NormShape {
            rows: m,
            cols: d,
            eps: self.cfg.norm_eps,
        };
        match post_norm {
            Some(w) => add_rms_norm(be, x.at_mut(0), out.at(0), w.into(), shape)?,
            None => add_assign(be, x.at_mut(0), out.at(0), m * d, 1.0)?,
        }
        Ok(None)
    }

    /// A prompt pass's attention sublayer; `cache` views the sequence's position 0, `table` (in
    /// `s.rows` too) says where each row goes in it.
    fn attention(
        &self,
        lw: &LayerWeights,
        la: &LayerAttention,
        s: &mut Scratch,
        mut cache: TMut<'_>,
        table: &[[u32; 2]],
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
        // A cache row holds one position's [k | v].
        let row = 2 * kvd;
        let (q_src, q_slot) = if q.ld == k.ld && k.ld == v.ld {
            // One product's rows [q | k | v]: norms, RoPE and the cache writes in one op, as decoding does.
            self.rope_cache(lw, s, cache.reborrow(), table, rope)?;
            (&s.qn, Slot { offset: 0, ld: qd })
        } else {
            // Q, K and V from products of different widths (their weights quantized differently), op
            // by op. Where two of them share a product's rows: without Q/K norms one RoPE call rotates
            // the heads of q and k together, and one copy moves k and v into the cache.
            let follows =
                |a: Slot, b: Slot, width: usize| b.ld == a.ld && b.offset == a.offset + width;
            let qk_together = lw.q_norm.is_none() && lw.k_norm.is_none() && follows(q, k, qd);
            let kv_together = lw.k_norm.is_none() && follows(k, v, kvd);
            let at = self.pos0 * row;

            // Queries: normed per head into `qn` then rotated (Gemma), or rotated where they are.
            let (q_src, q_slot) = match &lw.q_norm {
                Some(nw) => {
                    let src = contiguous(be, &s.proj, q, qd, m, &mut s.split_a)?;
                    self.rms_norm(src, nw, s.qn.at_mut(0), &mut s.stats, m * n_head, hd)?;
                    if let Some(table) = rope {
                        self.rope(s.qn.at_mut(0), table, n_head, qd)?;
                    }
                    (&s.qn, Slot { offset: 0, ld: qd })
                }
                None => {
                    let heads = if qk_together { n_head + n_kv } else { n_head };
                    if let Some(table) = rope {
                        self.rope(s.proj.at_mut(q.offset), table, heads, q.ld)?;
                    }
                    (&s.proj, q)
                }
            };

            // Keys into the cache (normed on the way for Gemma, then rotated there unless already rotated).
            match &lw.k_norm {
                Some(nw) => {
                    let src = contiguous(be, &s.proj, k, kvd, m, &mut s.split_b)?;
                    if m == 1 {
                        self.rms_norm(src, nw, cache.shift(at), &mut s.stats, n_kv, hd)?;
                    } else {
                        // The norm writes packed rows; cache rows are [k | v].
                        self.rms_norm(src, nw, s.split_a.at_mut(0), &mut s.stats, m * n_kv, hd)?;
                        copy_rows(be, s.split_a.at(0), kvd, cache.shift(at), row, m, kvd)?;
                    }
                }
                None => {
                    let width = if kv_together { 2 * kvd } else { kvd };
                    let from = s.proj.at(k.offset);
                    copy_rows(be, from, k.ld, cache.shift(at), row, m, width)?;
                }
            }
            if let (false, Some(table)) = (qk_together, rope) {
                self.rope(cache.shift(at), table, n_kv, row)?;
            }
            if !kv_together {
                let from = s.proj.at(v.offset);
                copy_rows(be, from, v.ld, cache.shift(at + kvd), row, m, kvd)?;
            }
            (q_src, q_slot)
        };
        let shape = DecodeShape {
            rows: m,
            heads: n_head,
            kv_heads: n_kv,
            head_dim: hd,
            ld_q: q_slot.ld,
            ld_kv: row,
            ld_o: qd,
            q_pos0: self.pos0,
            kv_len: self.pos0 + m,
            window: la.window,
            scale: cfg.attn_scale,
            softcap: 0.0,
        };
        let (keys, values) = (cache.as_ref(), cache.as_ref().shift(kvd));
        let query = q_src.at(q_slot.offset);
        attend(be, query, keys, values, s.att.at_mut(0), shape)?;
        self.attention_output(lw, s, None, false)?;
        Ok(())
    }

    /// x += [post_attn_norm](att · Woᵀ): the attention sublayer's output product and residual, the
    /// same for prompt and decode passes.
    /// The output product with its post-norm and the residual addition, of the attention's rows in
    /// `s.att` or, given `splits` (a lone row's partial results and their count), of their merge.
    /// With `defer`, a post-normed output is left in `s.out` for the next product (its weight comes
    /// back).
    fn attention_output<'t>(
        &self,
        lw: &'t LayerWeights,
        s: &mut Scratch,
        splits: Option<(&Tensor, usize)>,
        defer: bool,
    ) -> Result<Option<&'t Tensor>> {
        let Scratch {
            att, x, out, ones, ..
        } = s;
        let input = match splits {
            Some((part, n_split)) => Input::Merge {
                part: part.at(0),
                heads: self.cfg.n_head,
                head_dim: self.cfg.head_dim,
                n_split,
            },
            None => Input::Rows(att.at(0)),
        };
        let post = lw.post_attn_norm.as_ref();
        self.residual_fused(input, &lw.wo, post, x, out, ones, defer)
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
            if g.ld == u.ld {
                // Halves of one product's rows.
                let (gate, up) = (s.proj.at(g.offset), s.proj.at(u.offset));
                glu_rows(be, cfg.activation, gate, up, g.ld, s.act.at_mut(0), m, ff)?;
            } else {
                let gate = contiguous(be, &s.proj, g, ff, m, &mut s.split_a)?;
                let up = contiguous(be, &s.proj, u, ff, m, &mut s.split_b)?;
                glu(be, cfg.activation, gate, up, s.act.at_mut(0), m * ff)?;
            }
        } else {
            // The one member fills the group: m packed rows of ff.
            let up = lw.gate_up.slot(0, self.batch);
            gelu(be, s.proj.at(up.offset), s.act.at_mut(0), m * ff)?;
        }
        let Scratch {
            act, x, out, ones, ..
        } = s;
        let post = lw.post_ffn_norm.as_ref();
        self.residual_fused(Input::Rows(act.at(0)), &lw.down, post, x, out, ones, false)?;
        Ok(())
    }

    /// The step between the Q/K/V product and attention, as one op: Gemma's Q/K norms, RoPE, the queries
    /// into `s.qn` (rows of the query width), keys and values into the cache rows `table` names (`s.rows`
    /// holds the same words, one pair per row of the pass).
    fn rope_cache(
        &self,
        lw: &LayerWeights,
        s: &mut Scratch,
        mut cache: TMut<'_>,
        table: &[[u32; 2]],
        rope: Option<&Tensor>,
    ) -> Result<()> {
        let (be, m) = (self.be, self.m);
        let qd = self.cfg.q_dim();
        let [q, k, v] = [0, 1, 2].map(|i| lw.qkv.slot(i, self.batch));
        let (norm, shape) = self.rope_cache_shape(lw, rope);
        let (tab, positions) = (rope.unwrap_or(&s.ones), self.context);
        let all = CacheRows {
            table: s.rows.at(0),
            host: table,
        };
        if m == 1 || (q.ld == k.ld && k.ld == v.ld) {
            rope_into_cache(
                be,
                s.proj.at(0),
                s.qn.at_mut(0),
                cache.reborrow(),
                all,
                tab.at(0),
                positions,
                norm,
                shape,
            )?;
        } else {
            // Members of different products lie in rows of different lengths: one row at a time.
            for r in 0..m {
                let one = CacheRows {
                    table: s.rows.at(2 * r),
                    host: &table[r..r + 1],
                };
                let shape = RopeCacheShape {
                    q_at: q.offset + r * q.ld,
                    k_at: k.offset + r * k.ld,
                    v_at: v.offset + r * v.ld,
                    ..shape
                };
                rope_into_cache(
                    be,
                    s.proj.at(0),
                    s.qn.at_mut(r * qd),
                    cache.reborrow(),
                    one,
                    tab.at(0),
                    positions,
                    norm,
                    shape,
                )?;
            }
        }
        Ok(())
    }

    /// [`Self::rope_cache`]'s Q/K norms and shape, for rows of one product (`[q | k | v]`, `q.ld` apart).
    fn rope_cache_shape<'w>(
        &self,
        lw: &'w LayerWeights,
        rope: Option<&Tensor>,
    ) -> (Option<QkNorm<'w>>, RopeCacheShape) {
        let cfg = self.cfg;
        let (hd, qd, kvd) = (cfg.head_dim, cfg.q_dim(), cfg.kv_dim());
        let [q, k, v] = [0, 1, 2].map(|i| lw.qkv.slot(i, self.batch));
        let norm = match (&lw.q_norm, &lw.k_norm) {
            (Some(qw), Some(kw)) => Some(QkNorm {
                q: qw.into(),
                k: kw.into(),
                eps: cfg.norm_eps,
            }),
            _ => None,
        };
        let shape = RopeCacheShape {
            heads: cfg.n_head,
            kv_heads: cfg.n_kv_head,
            head_dim: hd,
            n_rot: if rope.is_some() { cfg.n_rot } else { 0 },
            layout: cfg.rope_layout,
            ld_in: q.ld,
            q_at: q.offset,
            k_at: k.offset,
            v_at: v.offset,
            ld_q: qd,
            ld_kv: 2 * kvd,
        };
        (norm, shape)
    }

    /// A decode pass's attention sublayer: the Q/K/V product (norm fused in); norms, RoPE, the cache
    /// writes and attention over every row's sequence in one op (two where the rows' q, k and v lie in
    /// products of different widths); the output product with the residual addition (and, for a lone
    /// row, the attention's merge in front).
    #[allow(clippy::too_many_arguments)]
    fn decode_attention<'t>(
        &self,
        lw: &'t LayerWeights,
        la: &LayerAttention,
        s: &mut Scratch,
        cache: &mut Tensor,
        table: &[[u32; 2]],
        rope: Option<&Tensor>,
        pending: Option<&Tensor>,
    ) -> Result<Option<&'t Tensor>> {
        let (be, cfg) = (self.be, self.cfg);
        let (hd, qd, kvd) = (cfg.head_dim, cfg.q_dim(), cfg.kv_dim());
        self.first_products(&lw.attn_norm, pending, s, First::Group(&lw.qkv))?;
        let all = CacheRows {
            table: s.rows.at(0),
            host: table,
        };
        let shape = RowsShape {
            heads: cfg.n_head,
            kv_heads: cfg.n_kv_head,
            head_dim: hd,
            ld_q: qd,
            ld_kv: 2 * kvd,
            ld_o: qd,
            k_at: 0,
            v_at: kvd,
            window: la.window,
            scale: cfg.attn_scale,
            softcap: 0.0,
        };
        let [q, k, v] = [0, 1, 2].map(|i| lw.qkv.slot(i, self.batch));
        let attended = if self.m == 1 || (q.ld == k.ld && k.ld == v.ld) {
            // Rows of one product: the norms, RoPE and cache writes happen inside the attention's
            // dispatch.
            let (norm, rs) = self.rope_cache_shape(lw, rope);
            let new = NewRows {
                input: s.proj.at(0),
                table: rope.unwrap_or(&s.ones).at(0),
                positions: self.context,
                norm,
                shape: rs,
            };
            let Scratch { qn, att, .. } = s;
            // One row's splits go to the output product, which merges them on its way in.
            attend_new_rows(
                be,
                new,
                qn.at_mut(0),
                cache.at_mut(0),
                all,
                att.at_mut(0),
                shape,
                self.m == 1,
            )?
        } else {
            self.rope_cache(lw, s, cache.at_mut(0), table, rope)?;
            let all = CacheRows {
                table: s.rows.at(0),
                host: table,
            };
            attend_rows(be, s.qn.at(0), cache.at(0), all, s.att.at_mut(0), shape)?;
            Attended::Written
        };
        let splits = match &attended {
            Attended::Splits { part, n_split } => Some((part, *n_split)),
            Attended::Written => None,
        };
        self.attention_output(lw, s, splits, self.fold_post_norms)
    }

    /// A decode pass's feed-forward sublayer: gate and up (norm fused in), then down with the GLU fused
    /// in front and the residual addition behind.
    fn decode_feed_forward<'t>(
        &self,
        lw: &'t LayerWeights,
        s: &mut Scratch,
        pending: Option<&Tensor>,
    ) -> Result<Option<&'t Tensor>> {
        let (be, cfg, m) = (self.be, self.cfg, self.m);
        let ff = cfg.n_ff;
        self.first_products(&lw.ffn_norm, pending, s, First::Group(&lw.gate_up))?;
        let Scratch {
            proj,
            split_a,
            split_b,
            act,
            x,
            out,
            ones,
            ..
        } = s;
        let input = if cfg.gated_ffn {
            let (g, u) = (
                lw.gate_up.slot(0, self.batch),
                lw.gate_up.slot(1, self.batch),
            );
            if m == 1 || g.ld == u.ld {
                Input::Glu {
                    act: cfg.activation,
                    gate: proj.at(g.offset),
                    up: proj.at(u.offset),
                    ld: g.ld,
                }
            } else {
                let gate = contiguous(be, proj, g, ff, m, split_a)?;
                let up = contiguous(be, proj, u, ff, m, split_b)?;
                Input::Glu {
                    act: cfg.activation,
                    gate,
                    up,
                    ld: ff,
                }
            }
        } else {
            // The one member fills the group: m packed rows of ff.
            let up = lw.gate_up.slot(0, self.batch);
            gelu(be, proj.at(up.offset), act.at_mut(0), m * ff)?;
            Input::Rows(act.at(0))
        };
        let post = lw.post_ffn_norm.as_ref();
        self.residual_fused(input, &lw.down, post, x, out, ones, self.fold_post_norms)
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
    )?;
    let spare: &'a Tensor = spare;
    Ok(spare.at(0))
}

/// The RoPE tables of `cfg` for `context` positions, one per distinct (base, scale), and the table each
/// layer uses (none without RoPE). A planted [`Fault::RopePast500`] (tests only) scales the rows from
/// position 500 on, more with every position.
fn rope_tables(
    be: &Backend,
    cfg: &LlmConfig,
    context: usize,
    paths: PathSet,
) -> Result<(Vec<Tensor>, Vec<usize>)> {
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
                let mut t = rope_table(cfg.n_rot, la.rope_base, 1.0 / la.rope_scale, context);
                if paths.fault() == Some(Fault::RopePast500) {
                    let row = cfg.n_rot / 2 * 2;
                    for (p, r) in t.chunks_mut(row).enumerate().skip(500) {
                        let scale = 1.0 + (p - 499) as f32 / 4.0;
                        r.iter_mut().for_each(|x| *x *= scale);
                    }
                }
                ropes.push(be.from_f32(&t, cfg.n_rot.max(2))?);
                keys.push(key);
                keys.len() - 1
            }
        };
        layer_rope.push(i);
    }
    Ok((ropes, layer_rope))
}

/// A [`Llm::score_nll_start`] whose numbers are on their way back (the losses tensor stays alive until
/// they are read).
pub struct NllRead {
    losses: Option<(Tensor, PendingRead)>,
    want: usize,
}

/// A final logit softcap, cap · tanh(x / cap), applied in place (`cap` 0: none), as every read of the
/// logits applies it.
pub(crate) fn soft_cap(logits: &mut [f32], cap: f32) {
    if cap > 0.0 {
        logits.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
    }
}

/// −log softmax(row)[target], with the sums in f64 (0 for a target outside the row).
fn nll_of(row: &[f32], target: usize) -> f32 {
    let Some(&x) = row.get(target) else {
        return 0.0;
    };
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    (-(x as f64 - max - sum.ln())) as f32
}
