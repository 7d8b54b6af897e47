//! The model thread: it owns the device and the model (GPU handles live on one thread) and runs the
//! continuous-batching loop. Requests wait in a bounded queue; up to `parallel` of them hold a slot,
//! each with its own KV cache, position, sampler and text decoder. Every decode step runs all active
//! sequences in one batched forward pass (the weights are read once for all of them), and new requests
//! join between steps, their prompts prefilled on the way in. A client that goes away frees its slot
//! at the next step. Each row of a batched pass is computed exactly as it would be alone
//! (`RowMode::Independent`), so a request's text does not depend on what runs beside it.

use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use tinygpt_kernels::ops::sample::RowSampling;
use tinygpt_kernels::{Backend, PathSet, PendingRead};
use tinygpt_models::gpt::{CharVocab, GptRunner, GptSequence};
use tinygpt_models::llm::{DriftEvent, DriftGuard, DriftStats, Feed, GptDriftGuard, Llm, Sequence};
use tinygpt_models::sampler::{Sampler, SamplerConfig};
use tinygpt_models::tokenizer::{StreamDecoder, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use crate::background_gate::{BackgroundGate, Verdict};

/// Why a completion ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What the engine sends a request, in order: text pieces, then `Done` or `Failed`.
#[derive(Debug)]
pub enum Event {
    Text(String),
    Done {
        finish: Finish,
        completion_tokens: usize,
    },
    /// The request could not be completed (time limit, shutdown, device error).
    Failed {
        status: u16,
        message: String,
    },
}

/// One request as the engine runs it.
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    /// Generate through end-of-generation tokens.
    pub ignore_eos: bool,
    pub deadline: Instant,
    pub events: UnboundedSender<Event>,
}

/// State the HTTP side reads: readiness, load, throughput.
#[derive(Default)]
pub struct Shared {
    pub ready: AtomicBool,
    pub stopping: AtomicBool,
    pub queued: AtomicUsize,
    pub active: AtomicUsize,
    /// Aggregate decode tokens/s over recent steps (f64 bits).
    decode_tps: AtomicU64,
    pub decode_tokens: AtomicU64,
    /// The pills of the fast paths the model runs on now (they change when background gating ends,
    /// and when the drift guard turns them off).
    pub paths: std::sync::Mutex<Vec<String>>,
    /// Drift-guard checks taken, and those past the bound.
    pub drift_checks: AtomicU64,
    pub drift_events: AtomicU64,
    /// What the drift guard has cost so far (seconds): the engine's time in its checks between steps,
    /// the part of it spent reading cache rows, and the shadow's own f32 steps beside the decoding.
    pub drift_secs: std::sync::Mutex<DriftSecs>,
}

/// Where the drift guard's time goes (see [`Shared::drift_secs`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct DriftSecs {
    pub engine: f64,
    pub cache_reads: f64,
    pub shadow: f64,
}

impl Shared {
    pub fn decode_tps(&self) -> f64 {
        f64::from_bits(self.decode_tps.load(Ordering::Relaxed))
    }

    fn record_step(&self, rows: usize, secs: f64) {
        let now = rows as f64 / secs.max(1e-9);
        let old = self.decode_tps();
        // An exponential moving average over ~20 steps.
        let v = if old == 0.0 {
            now
        } else {
            0.95 * old + 0.05 * now
        };
        self.decode_tps.store(v.to_bits(), Ordering::Relaxed);
        self.decode_tokens.fetch_add(rows as u64, Ordering::Relaxed);
    }

    /// Takes the guard's accounts after a step: the checks counted since it had `before` of them,
    /// and its time (cache reads, shadow steps).
    fn drift_counted(&self, s: &DriftStats, before: usize) {
        self.drift_checks
            .fetch_add((s.checks - before) as u64, Ordering::Relaxed);
        if let Ok(mut d) = self.drift_secs.lock() {
            d.cache_reads = s.read_secs;
            d.shadow = s.shadow_secs;
        }
    }

    /// The pills of the fast paths the model runs on now.
    pub fn set_paths(&self, pills: Vec<String>) {
        if let Ok(mut p) = self.paths.lock() {
            *p = pills;
        }
    }

    fn add_drift_engine_secs(&self, secs: f64) {
        if let Ok(mut d) = self.drift_secs.lock() {
            d.engine += secs;
        }
    }

    pub fn drift_secs(&self) -> DriftSecs {
        self.drift_secs.lock().map(|d| *d).unwrap_or_default()
    }
}

/// A model's text side: token ids in, text out. (One per server, held in an `Arc`: boxing the larger
/// variant would buy nothing.)
#[allow(clippy::large_enum_variant)]
pub enum Codec {
    Bpe(Tokenizer),
    Chars(CharVocab),
}

impl Codec {
    /// A prompt's ids as `tinygpt run` tokenizes it (BOS if the model adds one, special-token text
    /// parsed), or what is wrong with it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        match self {
            Codec::Bpe(t) => Ok(t.encode_with(text, true, true)),
            Codec::Chars(v) => v.encode(text).map_err(|e| e.to_string()),
        }
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        match self {
            Codec::Bpe(t) => t.decode(ids).map_err(|e| e.to_string()),
            Codec::Chars(v) => {
                if let Some(bad) = ids.iter().find(|&&i| i as usize >= v.len()) {
                    return Err(format!(
                        "token {bad} is outside the vocabulary of {}",
                        v.len()
                    ));
                }
                Ok(v.decode(ids))
            }
        }
    }

    /// Whether [`Codec::encode`] starts with a BOS token.
    pub fn adds_bos(&self) -> bool {
        match self {
            Codec::Bpe(t) => t.add_bos() && t.bos_id().is_some(),
            Codec::Chars(_) => false,
        }
    }

    pub fn n_vocab(&self) -> usize {
        match self {
            Codec::Bpe(t) => t.n_vocab(),
            Codec::Chars(v) => v.len(),
        }
    }

    fn is_eog(&self, id: u32) -> bool {
        match self {
            Codec::Bpe(t) => t.is_eog(id),
            Codec::Chars(_) => false,
        }
    }

    fn stream(&self) -> TextStream<'_> {
        match self {
            Codec::Bpe(t) => TextStream::Bpe(t.stream_decoder(false)),
            Codec::Chars(v) => TextStream::Chars(v),
        }
    }
}

/// Token ids to text as they arrive (a multi-byte character may span tokens).
enum TextStream<'a> {
    Bpe(StreamDecoder<'a>),
    Chars(&'a CharVocab),
}

impl TextStream<'_> {
    fn push(&mut self, id: u32) -> String {
        match self {
            TextStream::Bpe(d) => d.push(id).unwrap_or_default(),
            TextStream::Chars(v) => v.decode(&[id]),
        }
    }

    fn finish(&mut self) -> String {
        match self {
            TextStream::Bpe(d) => d.finish(),
            TextStream::Chars(_) => String::new(),
        }
    }
}

/// Holds back text that could be the start of a stop string, and finds the first stop string.
struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    /// Adds `piece`; returns the text safe to send and whether a stop string was reached (the text
    /// before it is then all that is sent).
    fn push(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s)).min() {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Keep the longest tail that begins some stop string.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let out = self.held[..keep].to_string();
        self.held.drain(..keep);
        (out, false)
    }

    fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// What the loop needs from a model.
pub trait Decoder {
    type Seq;
    fn new_seq(&mut self, be: &Backend) -> anyhow::Result<Self::Seq>;
    /// Empties `seq`, feeds `prompt` and returns the logits after it.
    fn start(
        &mut self,
        be: &Backend,
        seq: &mut Self::Seq,
        prompt: &[u32],
    ) -> anyhow::Result<Vec<f32>>;
    /// Feeds one token to each sequence in one pass; returns each one's next logits.
    fn step(
        &mut self,
        be: &Backend,
        steps: &mut [(&mut Self::Seq, u32)],
    ) -> anyhow::Result<Vec<Vec<f32>>>;
    /// Whether [`Decoder::step_picked`] can pick tokens where the logits are (a GPU).
    fn picks_on_device(&self, _be: &Backend) -> bool {
        false
    }
    /// [`Decoder::step`] where the rows with settings in `device` get their next token picked where
    /// the logits are (on a GPU only the ids come back); the other rows get their logits.
    fn step_picked(
        &mut self,
        _be: &Backend,
        _steps: &mut [(&mut Self::Seq, u32)],
        _device: &[Option<RowSampling>],
    ) -> anyhow::Result<Vec<Next>> {
        anyhow::bail!("this model picks its tokens on the host")
    }
    /// [`Decoder::start`] with the token after the prompt picked where the logits are (they are not
    /// read back).
    fn start_picked(
        &mut self,
        _be: &Backend,
        _seq: &mut Self::Seq,
        _prompt: &[u32],
        _row: RowSampling,
    ) -> anyhow::Result<u32> {
        anyhow::bail!("this model picks its tokens on the host")
    }
    /// Positions `seq` has left for tokens (checked before a token is fed, and before a step is
    /// recorded ahead).
    fn room(&self, seq: &Self::Seq) -> usize;
    /// Whether `seq` can take another token.
    fn has_room(&self, seq: &Self::Seq) -> bool {
        self.room(seq) > 0
    }
    /// Whether the model can record a step fed by the previous step's picks before the host has
    /// read them ([`Decoder::begin_ahead`]): a GPU that picks on the device.
    fn can_look_ahead(&self, _be: &Backend) -> bool {
        false
    }
    /// Whether [`Decoder::watch`] would read the last step's logits after it (a drift check owed or
    /// due): a step recorded ahead would replace them first.
    fn watch_due(&self, _seqs: &[&Self::Seq]) -> bool {
        true
    }
    /// Records a step whose rows all get their next token picked on the device with `rows`, without
    /// waiting for it: [`Decoder::finish_picked`] brings the ids.
    fn begin_picked(
        &mut self,
        _be: &Backend,
        _steps: &mut [(&mut Self::Seq, u32)],
        _rows: &[RowSampling],
    ) -> anyhow::Result<PendingRead> {
        anyhow::bail!("this model picks its tokens on the host")
    }
    /// Records the step after the last one begun, every sequence (the same, in the same order) fed
    /// the token the device picked for it there, without the host knowing it yet.
    fn begin_ahead(
        &mut self,
        _be: &Backend,
        _seqs: &mut [&mut Self::Seq],
        _rows: &[RowSampling],
    ) -> anyhow::Result<PendingRead> {
        anyhow::bail!("this model picks its tokens on the host")
    }
    /// The ids of a step begun by [`Decoder::begin_picked`] or [`Decoder::begin_ahead`].
    fn finish_picked(&mut self, _be: &Backend, _p: PendingRead) -> anyhow::Result<Vec<u32>> {
        anyhow::bail!("this model picks its tokens on the host")
    }
    /// Whether the model has other kernels to move to (its background gates finished). The engine
    /// then admits no new request, lets the running ones finish on the kernels they started on (a
    /// request's text never depends on when gating ended), and calls [`Decoder::move_paths`].
    fn paths_waiting(&mut self) -> bool {
        false
    }
    /// Moves the model (no sequence running) to the kernels [`Decoder::paths_waiting`] found;
    /// returns the pills of the fast paths now active.
    fn move_paths(&mut self, _be: &Backend) -> anyhow::Result<Vec<String>> {
        Ok(Vec::new())
    }
    /// After a step: the drift guard's checks of the sequences that reached one (each with the
    /// tokens it holds). When a check passes its bound, the model and every sequence move to the f32
    /// path; returns the pills then active (none).
    /// With `ahead` (a step is recorded after this one), nothing is read or moved: finished verdicts
    /// are only taken, and a trip is acted on at the next call without one.
    fn watch(
        &mut self,
        _be: &Backend,
        _rows: &mut [(&mut Self::Seq, &[u32])],
        _shared: &Shared,
        _ahead: bool,
    ) -> anyhow::Result<Option<Vec<String>>> {
        Ok(None)
    }
}

/// A GGUF model: every decode step is one batched pass.
pub struct LlmDecoder {
    pub llm: Llm,
    /// Fast paths still being gated (the model serves on the f32 path meanwhile).
    pub gating: Option<BackgroundGate>,
    /// The gates' verdict, once they finished, until the model moves.
    verdict: Option<std::result::Result<PathSet, String>>,
    /// Watches the fast paths while they decode (`--drift-check`), with the model's name for the
    /// gate history.
    guard: Option<(DriftGuard, String)>,
    /// Slots of the sequences owed a drift check (one is checked a step).
    owed: std::collections::VecDeque<usize>,
    /// A verdict past the bound taken while a step was recorded ahead: acted on at the next watch.
    trip: Option<DriftEvent>,
}

impl LlmDecoder {
    pub fn new(
        llm: Llm,
        gating: Option<BackgroundGate>,
        guard: Option<(DriftGuard, String)>,
    ) -> Self {
        LlmDecoder {
            llm,
            gating,
            verdict: None,
            guard,
            owed: Default::default(),
            trip: None,
        }
    }
}

impl Decoder for LlmDecoder {
    type Seq = Sequence;

    fn new_seq(&mut self, be: &Backend) -> anyhow::Result<Sequence> {
        let _ = be;
        Ok(self.llm.new_sequence()?)
    }

    fn start(
        &mut self,
        be: &Backend,
        seq: &mut Sequence,
        prompt: &[u32],
    ) -> anyhow::Result<Vec<f32>> {
        seq.reset();
        self.llm.feed_sequence(be, seq, prompt)?;
        Ok(pollster::block_on(self.llm.read_logits(be))?)
    }

    fn start_picked(
        &mut self,
        be: &Backend,
        seq: &mut Sequence,
        prompt: &[u32],
        row: RowSampling,
    ) -> anyhow::Result<u32> {
        seq.reset();
        self.llm.feed_sequence(be, seq, prompt)?;
        self.llm.pick_sampled(be, &[row])?;
        let p = self.llm.read_picks(be)?;
        Ok(pollster::block_on(self.llm.finish_picks(be, p))?[0])
    }

    fn step(
        &mut self,
        be: &Backend,
        steps: &mut [(&mut Sequence, u32)],
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        self.llm.decode_batch(be, steps)?;
        Ok(pollster::block_on(
            self.llm.read_logits_batch(be, steps.len()),
        )?)
    }

    fn picks_on_device(&self, be: &Backend) -> bool {
        be.as_gpu().is_some() && self.llm.picks_on_device()
    }

    fn step_picked(
        &mut self,
        be: &Backend,
        steps: &mut [(&mut Sequence, u32)],
        device: &[Option<RowSampling>],
    ) -> anyhow::Result<Vec<Next>> {
        // Rows the host samples get a greedy pick too (unused): one kernel for the whole pass. The
        // settings go to the device before the pass is recorded (one submit for the step).
        let greedy = RowSampling {
            temperature: 0.0,
            top_k: 1,
            top_p: 1.0,
            seed: 0,
            draw: 0,
        };
        let rows: Vec<RowSampling> = device.iter().map(|r| r.unwrap_or(greedy)).collect();
        self.llm.set_sampling(be, &rows)?;
        self.llm.decode_batch(be, steps)?;
        self.llm.pick_set(be)?;
        let p = self.llm.read_picks(be)?;
        let ids = pollster::block_on(self.llm.finish_picks(be, p))?;
        let mut logits = if device.iter().any(Option::is_none) {
            pollster::block_on(self.llm.read_logits_batch(be, steps.len()))?
        } else {
            Vec::new()
        };
        Ok(device
            .iter()
            .zip(ids)
            .enumerate()
            .map(|(i, (r, id))| match r {
                Some(_) => Next::Id(id),
                None => Next::Logits(std::mem::take(&mut logits[i])),
            })
            .collect())
    }

    fn can_look_ahead(&self, be: &Backend) -> bool {
        self.picks_on_device(be)
    }

    fn room(&self, seq: &Sequence) -> usize {
        seq.context().saturating_sub(seq.position())
    }

    fn watch_due(&self, seqs: &[&Sequence]) -> bool {
        let Some((guard, _)) = &self.guard else {
            return false;
        };
        if self.trip.is_some() {
            return true;
        }
        if self.llm.paths().is_empty() || guard.tripped().is_some() {
            return false;
        }
        !self.owed.is_empty()
            || seqs
                .iter()
                .any(|s| s.position() > 0 && guard.due(s.position() - 1))
    }

    fn begin_picked(
        &mut self,
        be: &Backend,
        steps: &mut [(&mut Sequence, u32)],
        rows: &[RowSampling],
    ) -> anyhow::Result<PendingRead> {
        self.llm.set_sampling(be, rows)?;
        self.llm.decode_batch(be, steps)?;
        self.llm.pick_set(be)?;
        Ok(self.llm.read_picks(be)?)
    }

    fn begin_ahead(
        &mut self,
        be: &Backend,
        seqs: &mut [&mut Sequence],
        rows: &[RowSampling],
    ) -> anyhow::Result<PendingRead> {
        self.llm.set_sampling(be, rows)?;
        self.llm.decode_step(be, seqs, Feed::Picked)?;
        self.llm.pick_set(be)?;
        Ok(self.llm.read_picks(be)?)
    }

    fn finish_picked(&mut self, be: &Backend, p: PendingRead) -> anyhow::Result<Vec<u32>> {
        Ok(pollster::block_on(self.llm.finish_picks(be, p))?)
    }

    fn paths_waiting(&mut self) -> bool {
        if self.verdict.is_none()
            && let Some(g) = &mut self.gating
            && let Verdict::Done(v) = g.poll()
        {
            self.verdict = Some(v);
        }
        self.verdict.is_some()
    }

    fn move_paths(&mut self, be: &Backend) -> anyhow::Result<Vec<String>> {
        if let (Some(g), Some(v)) = (self.gating.take(), self.verdict.take()) {
            g.apply(be, &mut self.llm, v, "between two requests")?;
        }
        Ok(self
            .llm
            .paths()
            .iter()
            .map(|p| p.pill().to_string())
            .collect())
    }

    fn watch(
        &mut self,
        be: &Backend,
        rows: &mut [(&mut Sequence, &[u32])],
        shared: &Shared,
        ahead: bool,
    ) -> anyhow::Result<Option<Vec<String>>> {
        let Some((guard, name)) = &mut self.guard else {
            return Ok(None);
        };
        // On the f32 path (still gating, or after a trip) there is nothing to watch.
        if self.llm.paths().is_empty() || (guard.tripped().is_some() && self.trip.is_none()) {
            return Ok(None);
        }
        let before = guard.stats().checks;
        if ahead {
            // The step recorded ahead runs on these paths: a trip waits for it to be taken.
            if self.trip.is_none() {
                self.trip = guard.poll_sequences(be, &mut self.llm)?;
            }
            shared.drift_counted(&guard.stats(), before);
            return Ok(None);
        }
        // Verdicts the shadow has finished; then this step's check. Sequences reach their checks
        // together (a batch of requests sent at once), so they are owed and checked one a step, at
        // the position they have then (any step's distribution is as good a sample), against their
        // row of this step's logits (only that row is read back, with the sequence's cache rows, in
        // one copy the shadow waits for). The shadow takes the checks in order on its thread: a
        // check never waits for the one before.
        let mut event = match self.trip.take() {
            Some(e) => Some(e),
            None => guard.poll_sequences(be, &mut self.llm)?,
        };
        for (seq, _) in rows.iter() {
            let p = seq.position();
            if p > 0 && guard.due(p - 1) && !self.owed.contains(&seq.slot()) {
                self.owed.push_back(seq.slot());
            }
        }
        // While the shadow has checks queued, the next one waits for a later step.
        while event.is_none()
            && !guard.busy()
            && let Some(slot) = self.owed.pop_front()
        {
            // A request that finished before its turn is not checked.
            let Some(i) = rows.iter().position(|(s, _)| s.slot() == slot) else {
                continue;
            };
            let (seq, tokens) = &rows[i];
            event = pollster::block_on(guard.check_sequence(be, &mut self.llm, seq, tokens, i))?;
            break;
        }
        shared.drift_counted(&guard.stats(), before);
        let Some(e) = event else {
            return Ok(None);
        };
        shared.drift_events.fetch_add(1, Ordering::Relaxed);
        eprintln!("{}", e.log_line("every request goes on on the f32 path"));
        crate::gates::record_drift(be, name, &e);
        self.llm
            .switch_paths_with(be, guard.file(), PathSet::F32, rows)?;
        Ok(Some(Vec::new()))
    }
}

/// The char-level GPT: sequences take turns on one runner (its weights shared, each sequence's cache its
/// own). Past the block, the cache restarts from the last half block, as `tinygpt generate` does.
pub struct GptDecoder {
    runner: GptRunner,
    /// Watches the fast paths (`--drift-check`): every N tokens of each sequence.
    guard: Option<GptDriftGuard>,
    /// Checks the guard has counted that [`Decoder::watch`] has not reported, and its event.
    reported: usize,
    event: Option<DriftEvent>,
}

impl GptDecoder {
    pub fn new(runner: GptRunner, guard: Option<GptDriftGuard>) -> Self {
        GptDecoder {
            runner,
            guard,
            reported: 0,
            event: None,
        }
    }
}

/// A GPT sequence and the tokens it holds (for the restart past the block).
pub struct GptSeq {
    seq: GptSequence,
    history: Vec<u32>,
}

impl Decoder for GptDecoder {
    type Seq = GptSeq;

    fn new_seq(&mut self, be: &Backend) -> anyhow::Result<GptSeq> {
        Ok(GptSeq {
            seq: self.runner.new_sequence(be)?,
            history: Vec::new(),
        })
    }

    fn start(
        &mut self,
        be: &Backend,
        seq: &mut GptSeq,
        prompt: &[u32],
    ) -> anyhow::Result<Vec<f32>> {
        let t = self.runner.cfg.block_size;
        seq.history = prompt.to_vec();
        let tail = &prompt[prompt.len().saturating_sub(t)..];
        Ok(self
            .runner
            .with_sequence(&mut seq.seq, |r| r.prefill(be, tail))?)
    }

    fn step(
        &mut self,
        be: &Backend,
        steps: &mut [(&mut GptSeq, u32)],
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let t = self.runner.cfg.block_size;
        let mut out = Vec::with_capacity(steps.len());
        for i in 0..steps.len() {
            let (s, tok) = &mut steps[i];
            s.history.push(*tok);
            let h = &s.history;
            let guard = self.guard.as_mut();
            let (logits, event) = self.runner.with_sequence(&mut s.seq, |r| {
                let logits = if r.position() < t {
                    r.step(be, *tok)?
                } else {
                    r.prefill(be, &h[h.len() - r.restart_len()..])?
                };
                // A check every N tokens of the sequence's own; verdicts ready are taken too. A trip
                // moves the runner to the f32 path with this sequence's cache recomputed.
                let event = match guard {
                    Some(g) if !r.paths().is_empty() => {
                        let due = g.every() > 0 && h.len().is_multiple_of(g.every());
                        pollster::block_on(g.watch(be, r, &logits, due))?
                    }
                    _ => None,
                };
                anyhow::Ok((logits, event))
            })?;
            out.push(logits);
            let Some(e) = event else { continue };
            // This sequence's logits are the f32 path's now (read before the runner's logits buffer
            // serves another sequence). Every other sequence's cache is recomputed on the f32 path
            // from its tokens (those stepped already get this step's logits from it).
            out[i] = pollster::block_on(self.runner.read_logits(be))?;
            for (j, (other, _)) in steps.iter_mut().enumerate() {
                if j == i {
                    continue;
                }
                self.runner.with_sequence(&mut other.seq, |r| {
                    let tokens = r.history().to_vec();
                    r.reset();
                    if !tokens.is_empty() {
                        r.feed(be, &tokens)?;
                        if j < i {
                            out[j] = pollster::block_on(r.read_logits(be))?;
                        }
                    }
                    anyhow::Ok(())
                })?;
            }
            self.event = Some(e);
        }
        Ok(out)
    }

    /// Past the block the cache restarts from its last half: there is always room.
    fn room(&self, _: &GptSeq) -> usize {
        usize::MAX
    }

    fn watch(
        &mut self,
        be: &Backend,
        _rows: &mut [(&mut GptSeq, &[u32])],
        shared: &Shared,
        _ahead: bool,
    ) -> anyhow::Result<Option<Vec<String>>> {
        let Some(g) = &self.guard else {
            return Ok(None);
        };
        let stats = g.stats();
        shared.drift_counted(&stats, self.reported);
        self.reported = stats.checks;
        let Some(e) = self.event.take() else {
            return Ok(None);
        };
        shared.drift_events.fetch_add(1, Ordering::Relaxed);
        eprintln!("{}", e.log_line("every request goes on on the f32 path"));
        crate::gates::record_drift(be, "shakespeare-char", &e);
        Ok(Some(Vec::new()))
    }
}

/// A request holding a slot.
struct Active<'c, S> {
    job: Job,
    seq: S,
    sampler: Sampler,
    text: TextStream<'c>,
    stop: StopMatcher,
    generated: usize,
    /// The token to feed at the next step.
    next: u32,
    /// The tokens the sequence holds, one per position (what the drift guard's shadow and a switch of
    /// paths recompute it from).
    fed: Vec<u32>,
    done: bool,
}

impl<S> Active<'_, S> {
    fn send(&self, e: Event) {
        let _ = self.job.events.send(e);
    }

    fn finish(&mut self, finish: Finish) {
        let rest = self.text.finish();
        let (mut tail, hit) = self.stop.push(&rest);
        if !hit {
            tail.push_str(&self.stop.finish());
        }
        if !tail.is_empty() {
            self.send(Event::Text(tail));
        }
        self.send(Event::Done {
            finish: if hit { Finish::Stop } else { finish },
            completion_tokens: self.generated,
        });
        self.done = true;
    }

    fn fail(&mut self, status: u16, message: String) {
        self.send(Event::Failed { status, message });
        self.done = true;
    }

    /// Sends the text of the next token `id`; ends the request when it is done.
    fn take_id<D: Decoder<Seq = S>>(&mut self, id: u32, codec: &Codec, d: &D) {
        if codec.is_eog(id) && !self.job.ignore_eos {
            return self.finish(Finish::Stop);
        }
        self.generated += 1;
        let piece = self.text.push(id);
        let (out, hit) = self.stop.push(&piece);
        if !out.is_empty() {
            self.send(Event::Text(out));
        }
        if hit {
            return self.finish(Finish::Stop);
        }
        if self.generated >= self.job.max_tokens || !d.has_room(&self.seq) {
            return self.finish(Finish::Length);
        }
        self.next = id;
    }
}

/// Runs requests from `jobs` until the server stops (`shared.stopping`) or every sender is gone.
pub fn run<D: Decoder>(
    be: &Backend,
    d: &mut D,
    codec: &Codec,
    parallel: usize,
    jobs: Receiver<Job>,
    shared: &Shared,
) -> anyhow::Result<()> {
    let mut free: Vec<D::Seq> = (0..parallel)
        .map(|_| d.new_seq(be))
        .collect::<anyhow::Result<_>>()?;
    let mut active: Vec<Active<'_, D::Seq>> = Vec::with_capacity(parallel);
    // The next step, recorded before the host read this one's picks (fed by them on the device): its
    // rows are `active`'s, in the same order, so nothing joins or leaves until it is taken.
    let mut ahead: Option<PendingRead> = None;
    loop {
        if shared.stopping.load(Ordering::Relaxed) {
            for a in &mut active {
                a.fail(503, "the server is shutting down".into());
            }
            while let Ok(job) = jobs.try_recv() {
                let _ = job.events.send(Event::Failed {
                    status: 503,
                    message: "the server is shutting down".into(),
                });
            }
            return Ok(());
        }
        // Background gates finished: once the running requests are done, the model moves to the
        // kernels that passed; until then no request is admitted (they wait in the queue).
        let mut moving = d.paths_waiting();
        if moving && active.is_empty() {
            match d.move_paths(be) {
                Ok(pills) => shared.set_paths(pills),
                Err(e) => eprintln!("[ops] moving to the gated fast paths failed ({e:#})"),
            }
            moving = false;
        }
        // Admit waiting requests into free slots; wait for one when nothing runs.
        while !moving
            && ahead.is_none()
            && let Some(seq) = free.pop()
        {
            let job = if active.is_empty() {
                match jobs.recv_timeout(Duration::from_millis(50)) {
                    Ok(j) => j,
                    Err(RecvTimeoutError::Timeout) => {
                        free.push(seq);
                        break;
                    }
                    Err(RecvTimeoutError::Disconnected) => return Ok(()),
                }
            } else {
                match jobs.try_recv() {
                    Ok(j) => j,
                    Err(TryRecvError::Empty) => {
                        free.push(seq);
                        break;
                    }
                    Err(TryRecvError::Disconnected) => return Ok(()),
                }
            };
            shared.queued.fetch_sub(1, Ordering::Relaxed);
            if job.events.is_closed() {
                free.push(seq);
                continue;
            }
            let mut a = Active {
                sampler: Sampler::new(job.sampler),
                text: codec.stream(),
                stop: StopMatcher::new(job.stop.clone()),
                generated: 0,
                next: 0,
                fed: Vec::new(),
                done: false,
                seq,
                job,
            };
            let prompt = std::mem::take(&mut a.job.prompt);
            a.fed.extend_from_slice(&prompt);
            // The first token is picked where the later ones are: a request's tokens are those
            // `tinygpt run` gives with the same settings and seed.
            let device = if d.picks_on_device(be) {
                a.sampler.device_row()
            } else {
                None
            };
            let first = match device {
                Some(row) => d.start_picked(be, &mut a.seq, &prompt, row),
                None => d
                    .start(be, &mut a.seq, &prompt)
                    .map(|l| a.sampler.sample(&l)),
            };
            match first {
                Ok(id) => a.take_id(id, codec, d),
                Err(e) => a.fail(500, format!("{e:#}")),
            }
            active.push(a);
            shared.active.store(active.len(), Ordering::Relaxed);
        }
        // Clients that left, and requests past their time.
        let now = Instant::now();
        for a in active.iter_mut().filter(|a| !a.done) {
            if a.job.events.is_closed() {
                a.done = true;
            } else if now > a.job.deadline {
                a.fail(504, "the request exceeded the server's time limit".into());
            }
        }
        if ahead.is_none() {
            retire(&mut active, &mut free);
        }
        shared.active.store(active.len(), Ordering::Relaxed);
        if active.is_empty() {
            // Verdicts the shadow finishes after the last request are taken (and acted on) now.
            match d.watch(be, &mut [], shared, false) {
                Ok(Some(pills)) => shared.set_paths(pills),
                Ok(None) => {}
                Err(e) => eprintln!("[ops] drift guard: {e:#}"),
            }
            continue;
        }
        let t0 = Instant::now();
        let begun = ahead.take();
        // Where the model can, each request whose settings the device sampler takes gets its token
        // picked there (only the id comes back); the others are sampled from their logits here. Which
        // one a request gets depends on its own settings only, never on the requests beside it.
        let device: Vec<Option<RowSampling>> = if begun.is_some() {
            Vec::new()
        } else if d.picks_on_device(be) {
            active.iter_mut().map(|a| a.sampler.device_row()).collect()
        } else {
            vec![None; active.len()]
        };
        let all_picked =
            begun.is_some() || (d.can_look_ahead(be) && device.iter().all(Option::is_some));
        let result = if all_picked {
            // Every row is picked on the device: this step is recorded (or was, ahead), and where
            // nothing can change the batch before the next step, that one is recorded too before
            // the host waits for this one's ids — the device never waits for the host between them.
            let begun = match begun {
                Some(p) => Ok(p),
                None => {
                    let rows: Vec<RowSampling> = device.iter().flatten().copied().collect();
                    let mut steps: Vec<(&mut D::Seq, u32)> =
                        active.iter_mut().map(|a| (&mut a.seq, a.next)).collect();
                    d.begin_picked(be, &mut steps, &rows)
                }
            };
            begun.and_then(|p| {
                let seqs: Vec<&D::Seq> = active.iter().map(|a| &a.seq).collect();
                let go = shared.queued.load(Ordering::Relaxed) == 0
                    && !shared.stopping.load(Ordering::Relaxed)
                    && !d.watch_due(&seqs)
                    && active.iter().all(|a| {
                        !a.done
                            && a.sampler.fits_device()
                            && a.generated + 1 < a.job.max_tokens
                            && d.room(&a.seq) >= 2
                    });
                if go {
                    let rows: Vec<RowSampling> = active
                        .iter_mut()
                        .filter_map(|a| a.sampler.device_row())
                        .collect();
                    let mut seqs: Vec<&mut D::Seq> =
                        active.iter_mut().map(|a| &mut a.seq).collect();
                    ahead = Some(d.begin_ahead(be, &mut seqs, &rows)?);
                }
                let ids = d.finish_picked(be, p)?;
                Ok(ids.into_iter().map(Next::Id).collect::<Vec<_>>())
            })
        } else {
            let mut steps: Vec<(&mut D::Seq, u32)> =
                active.iter_mut().map(|a| (&mut a.seq, a.next)).collect();
            if device.iter().any(Option::is_some) {
                d.step_picked(be, &mut steps, &device)
            } else {
                d.step(be, &mut steps)
                    .map(|rows| rows.into_iter().map(Next::Logits).collect::<Vec<_>>())
            }
        };
        match result {
            Ok(next) => {
                for a in active.iter_mut() {
                    a.fed.push(a.next);
                }
                // Each request samples from its own row with its own generator, so the rows are
                // sampled side by side (the same tokens as one after the other).
                let mut samplers: Vec<&mut Sampler> =
                    active.iter_mut().map(|a| &mut a.sampler).collect();
                let ids: Vec<u32> = samplers
                    .par_iter_mut()
                    .zip(next.par_iter())
                    .map(|(s, n)| match n {
                        Next::Id(id) => *id,
                        Next::Logits(l) => s.sample(l),
                    })
                    .collect();
                shared.record_step(next.len(), t0.elapsed().as_secs_f64());
                // The drift guard reads this step's logits: before the next step replaces them.
                let mut rows: Vec<(&mut D::Seq, &[u32])> = active
                    .iter_mut()
                    .map(|a| (&mut a.seq, a.fed.as_slice()))
                    .collect();
                let tw = Instant::now();
                let watched = d.watch(be, &mut rows, shared, ahead.is_some());
                shared.add_drift_engine_secs(tw.elapsed().as_secs_f64());
                match watched {
                    Ok(Some(pills)) => shared.set_paths(pills),
                    Ok(None) => {}
                    Err(e) => {
                        // The sequences' state is not known after a failed check or switch.
                        eprintln!("[ops] drift guard: {e:#}");
                        for a in &mut active {
                            a.fail(500, format!("the drift guard failed: {e:#}"));
                        }
                    }
                }
                for (a, id) in active.iter_mut().zip(ids) {
                    if !a.done {
                        a.take_id(id, codec, d);
                    }
                }
            }
            Err(e) => {
                ahead = None;
                for a in &mut active {
                    a.fail(500, format!("{e:#}"));
                }
            }
        }
        if ahead.is_none() {
            retire(&mut active, &mut free);
        }
        shared.active.store(active.len(), Ordering::Relaxed);
    }
}

/// What a step gives each sequence: its next token, or the logits to sample it from.
pub enum Next {
    Id(u32),
    Logits(Vec<f32>),
}

/// Returns the slots of finished requests to the free list.
fn retire<S>(active: &mut Vec<Active<'_, S>>, free: &mut Vec<S>) {
    let mut i = 0;
    while i < active.len() {
        if active[i].done {
            free.push(active.swap_remove(i).seq);
        } else {
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Decoder, GptDecoder, StopMatcher};
    use tinygpt_kernels::path::Fault;
    use tinygpt_kernels::testing::{assert_nmse, gpu_backend};
    use tinygpt_kernels::{PathId, PathSet};
    use tinygpt_models::gpt::{GptConfig, GptRunner, Layout};
    use tinygpt_models::llm::GptDriftGuard;
    use tinygpt_models::sampler::argmax;

    /// A server's char-level sequences share one guard: a planted fault from position 200 on trips
    /// it at the first check past 200 of whichever sequence gets there, and every sequence moves to
    /// the f32 path, its cache recomputed: the step's logits of each are then the f32 runner's after
    /// its tokens.
    #[test]
    fn a_drift_trip_moves_every_gpt_sequence_to_the_f32_path() {
        let Some(be) = gpu_backend(None) else { return };
        let cfg = GptConfig {
            vocab_size: 16,
            block_size: 256,
            n_layer: 2,
            n_head: 2,
            n_embd: 32,
            dropout: 0.0,
        };
        let params = Layout::new(&cfg).init(&cfg, 5);
        let faulty = PathSet::of(&[PathId::F16Storage]).with_fault(Some(Fault::PositionsPast200));
        let runner = GptRunner::new(&be, &cfg, &params, faulty).unwrap();
        let guard = GptDriftGuard::new(&cfg, params.clone(), 50, Some(1), false);
        let mut d = GptDecoder::new(runner, Some(guard));
        let mut seqs = Vec::new();
        let mut next = Vec::new();
        for p in [vec![1u32], vec![2; 30], vec![3; 75]] {
            let mut s = d.new_seq(&be).unwrap();
            next.push(argmax(&d.start(&be, &mut s, &p).unwrap()));
            seqs.push(s);
        }
        let mut logits = Vec::new();
        for _ in 0..200 {
            let mut steps: Vec<_> = seqs.iter_mut().zip(next.iter().copied()).collect();
            logits = d.step(&be, &mut steps).unwrap();
            if d.event.is_some() {
                break;
            }
            next = logits.iter().map(|l| argmax(l)).collect();
        }
        let e = d.event.take().expect("the guard tripped");
        // The third sequence (75 prompt tokens) is checked at 200 tokens (position 199, healthy) and
        // 250 (position 249).
        assert_eq!(e.position, 249, "{e:?}");
        assert_eq!(seqs[2].history.len(), 250);
        assert_eq!(d.runner.paths(), PathSet::F32);
        for (s, l) in seqs.iter().zip(&logits) {
            let mut reference = GptRunner::new(&be, &cfg, &params, PathSet::F32).unwrap();
            let want = reference.prefill(&be, &s.history).unwrap();
            assert_nmse("after the trip", &want, l, 1e-10);
        }
    }

    #[test]
    fn stop_strings_hold_back_only_what_could_start_them() {
        let mut m = StopMatcher::new(vec!["\n\n".into(), "END".into()]);
        assert_eq!(m.push("Hello"), ("Hello".into(), false));
        assert_eq!(m.push(" E"), (" ".into(), false), "'E' may begin END");
        assert_eq!(m.push("N"), (String::new(), false));
        assert_eq!(m.push("ough"), ("ENough".into(), false));
        assert_eq!(m.push("\nX\n"), ("\nX".into(), false));
        assert_eq!(
            m.push("\nafter"),
            (String::new(), true),
            "stops at the first stop string"
        );
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("caféé"), ("café".into(), false));
        assert_eq!(m.push("x"), ("éx".into(), false));
        assert_eq!(m.finish(), "");
    }
}
