//! The drift guard: the start-up gates check each fast path on short products and the first 100
//! tokens, which cannot see an error that only appears deep into a long generation (one that grows
//! with the position, or a kernel that is wrong only for long caches). While a model on fast paths
//! generates, every `every` tokens one step is computed again on the canonical f32 path — the CPU
//! twin of every kernel, from the same keys and values (copied from the model's cache) and the same
//! token — and the two next-token distributions are compared. When the KL divergence passes the
//! bound (see [`kl_bound`]), the model moves to the f32 path for the rest of the run: its weights are
//! converted again from the file and its cache recomputed from its token history
//! ([`Llm::switch_paths`]).
//!
//! A check costs the device one wait for its last pass and a read of the cache rows written since the
//! last check; the shadow's CPU step runs on a thread of its own while the device goes on decoding
//! (natively; in the browser it runs in line), and its verdict is taken a few tokens later. The
//! guarded model's weights stay where they are; the shadow's own live on the host (the file's
//! quantized blocks, as the CPU backend runs them).
//!
//! [`DriftGuard`] watches a GGUF model ([`Llm`]); [`GptDriftGuard`] the char-level GPT
//! ([`GptRunner`]), whose cache rows are its layers' QKV rows and whose f32 weights are uploaded
//! again from the host copy the guard holds when it trips. Both share the shadow and its bookkeeping.

use std::sync::Arc;

use tinygpt_formats::GgufFile;
use tinygpt_kernels::cpu::CpuBackend;
use tinygpt_kernels::{Backend, DetachedRead, PathSet};

use super::error::{LlmError, Result};
use super::model::{Feed, Llm, LoadOptions, Sequence, soft_cap};
use crate::gpt::{GptConfig, GptRunner};

/// Checks every this many tokens by default (`--drift-check N`).
pub const DEFAULT_EVERY: usize = 128;

/// Threads the shadow computes on unless told otherwise (`--drift-threads N`). One: measured in
/// `tinygpt serve` on an H100 host (16 CPUs, the SmolLM2-135M shape, 16 streams), a shadow step took
/// about as long on one thread as on four (25–38 ms: most of it writes the rows it is handed), while
/// every thread it takes is one the thread driving the device may have to share.
pub const DEFAULT_SHADOW_THREADS: usize = 1;

/// Checks a server's guard keeps queued for its shadow at most: while that many wait, the next check
/// waits for a later step (so the guard never costs more than its shadow keeps up with, and the reads
/// it holds stay bounded).
pub const MAX_QUEUED_CHECKS: usize = 2;

/// One check that found the fast paths' distribution past the bound.
#[derive(Clone, Debug, PartialEq)]
pub struct DriftEvent {
    /// Position of the token whose next-token distributions were compared.
    pub position: usize,
    /// KL(f32 ‖ fast) over the vocabulary, and the bound it passed.
    pub kl: f64,
    pub bound: f64,
    /// Checks whose most likely tokens agreed, of all checks so far (this one included).
    pub same_top1: usize,
    pub checks: usize,
    /// The fast paths turned off.
    pub paths: PathSet,
}

impl DriftEvent {
    /// The console line of the event: `[ops] drift guard: position P, KL=… (bound …), top-1 a/b — +…
    /// off for this run, ` followed by `then` (what happens next).
    pub fn log_line(&self, then: &str) -> String {
        format!(
            "[ops] drift guard: position {}, KL={:.3e} (bound {:.3e}), top-1 {}/{} — {} off for this run, {then}",
            self.position,
            self.kl,
            self.bound,
            self.same_top1,
            self.checks,
            tinygpt_kernels::gate::pills(self.paths)
        )
    }
}

/// Which step a check compares: the model's own sequence with its logits read (`Own`), or a server's
/// sequence whose logits are a row of the last pass, read with its cache rows (`Row`).
enum Checked<'a> {
    Own(&'a [f32]),
    Row(&'a Sequence, usize),
}

/// What the guard has seen.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DriftStats {
    pub checks: usize,
    pub same_top1: usize,
    pub worst_kl: f64,
    /// The worst KL divergence as a fraction of its bound (above 1 trips the guard).
    pub worst_ratio: f64,
    /// Seconds the guarded side spent on the reads of the cache rows its checks handed to the shadow
    /// (the whole read where it reads them itself, only starting the copy where the shadow finishes
    /// it).
    pub read_secs: f64,
    /// Seconds the shadow spent on its f32 steps (on its own thread, natively: beside the decoding).
    pub shadow_secs: f64,
}

/// A step for the shadow to take: the cache rows it lacks (positions `from` .. `from + tokens.len()`,
/// per layer), then `id` at the next position, compared with the fast paths' logits.
struct Request {
    from: usize,
    reads: Reads,
    tokens: Vec<u32>,
    id: u32,
}

/// The device state a check compares from: the cache rows (one vector per layer) and the fast paths'
/// logits of the checked step.
enum Reads {
    /// Read by the guarded side.
    Ready { kv: Vec<Vec<f32>>, fast: Vec<f32> },
    /// Started by the guarded side and finished by the shadow (so the thread driving the device
    /// neither waits for the copy nor copies it out): the logits row first, then one view per layer;
    /// `softcap` (if above 0) is the model's final logit softcap, applied to the row as it is read.
    Detached {
        read: DetachedRead,
        lens: Vec<usize>,
        softcap: f32,
        /// The logits when the guarded side had them already (the read then holds the rows only).
        fast: Option<Vec<f32>>,
    },
}

impl Reads {
    /// (cache rows per layer, fast logits), waiting for a detached read's copy.
    async fn finish(self) -> tinygpt_kernels::Result<(Vec<Vec<f32>>, Vec<f32>)> {
        match self {
            Reads::Ready { kv, fast } => Ok((kv, fast)),
            Reads::Detached {
                read,
                lens,
                softcap,
                fast,
            } => {
                let mut views = read.finish_many_f32(&lens).await?;
                let fast = match fast {
                    Some(f) => f,
                    None => {
                        let mut f = views.remove(0);
                        soft_cap(&mut f, softcap);
                        f
                    }
                };
                Ok((views, fast))
            }
        }
    }
}

/// The shadow's comparison of one step.
struct Verdict {
    position: usize,
    kl: f64,
    bound: f64,
    same_top1: bool,
    /// Seconds the shadow's step took (writing the rows it was handed, the step, the comparison).
    secs: f64,
}

/// The model the shadow runs on the f32 path: a GGUF model (from its file) or a char-level GPT (from
/// its f32 parameters).
enum ShadowModel {
    Llm { file: Arc<GgufFile>, context: usize },
    Gpt { cfg: GptConfig, params: Arc<[f32]> },
}

/// The shadow's model made on the CPU backend.
enum Made {
    Llm(Backend, Box<Llm>),
    Gpt(Backend, Box<GptRunner>),
}

/// The f32 path on a CPU backend of `threads` threads, made at its first step (so a short run never
/// pays for it) unless made before.
struct Shadow {
    model: ShadowModel,
    threads: Option<usize>,
    made: Option<Made>,
}

impl Shadow {
    /// Makes the shadow's model if it has not been made yet.
    fn make(&mut self) -> Result<&mut Made> {
        if self.made.is_none() {
            let cpu = Backend::Cpu(CpuBackend::new(self.threads));
            self.made = Some(match &self.model {
                ShadowModel::Llm { file, context } => {
                    let opts = LoadOptions {
                        context: Some(*context),
                        batch: 1,
                        paths: PathSet::F32,
                        ..LoadOptions::default()
                    };
                    let llm = Llm::from_gguf(&cpu, file, &opts, &mut |_| {})?;
                    Made::Llm(cpu, Box::new(llm))
                }
                ShadowModel::Gpt { cfg, params } => {
                    let runner = GptRunner::new(&cpu, cfg, params, PathSet::F32)?;
                    Made::Gpt(cpu, Box::new(runner))
                }
            });
        }
        Ok(self.made.as_mut().expect("made above"))
    }

    async fn step(&mut self, r: Request) -> Result<Verdict> {
        let t0 = web_time::Instant::now();
        let (kv, fast) = r.reads.finish().await?;
        let (position, reference) = match self.make()? {
            Made::Llm(cpu, llm) => {
                llm.write_kv(cpu, r.from, &kv, &r.tokens)?;
                let position = llm.position();
                llm.decode_step(cpu, &mut [], Feed::Ids(&[r.id]))?;
                (position, llm.read_logits(cpu).await?)
            }
            Made::Gpt(cpu, runner) => {
                runner.write_cache(cpu, r.from, &kv, &r.tokens)?;
                let position = runner.position();
                runner.feed(cpu, &[r.id])?;
                (position, runner.read_logits(cpu).await?)
            }
        };
        Ok(Verdict {
            position,
            kl: kl_divergence(&reference, &fast),
            bound: kl_bound(&reference),
            same_top1: crate::sampler::argmax(&reference) == crate::sampler::argmax(&fast),
            secs: t0.elapsed().as_secs_f64(),
        })
    }
}

/// Where the shadow runs: on a thread of its own, so the device goes on decoding while it computes
/// (native), or in line (the browser, or when asked).
enum Runner {
    Inline(Box<Shadow>),
    #[cfg(not(target_arch = "wasm32"))]
    Thread {
        tx: std::sync::mpsc::Sender<Request>,
        rx: std::sync::mpsc::Receiver<Result<Verdict>>,
        /// Requests sent whose verdicts have not been taken (the shadow takes them in order).
        pending: usize,
    },
}

/// What both guards share: the shadow, the rows it holds, and the verdicts so far.
struct Watch {
    every: usize,
    runner: Runner,
    /// The tokens whose cache rows the shadow holds (copied from the guarded model's cache).
    held: Vec<u32>,
    stats: DriftStats,
    tripped: Option<DriftEvent>,
}

impl Watch {
    /// A shadow of `model` on `threads` threads (None: [`DEFAULT_SHADOW_THREADS`]); with `background`
    /// (native only) on a thread of its own. With `warm` (a thread only) the shadow makes its model at
    /// once instead of at its first step.
    fn new(
        model: ShadowModel,
        every: usize,
        threads: Option<usize>,
        background: bool,
        warm: bool,
    ) -> Watch {
        let threads = threads.or(Some(DEFAULT_SHADOW_THREADS));
        let shadow = move || Shadow {
            model,
            threads,
            made: None,
        };
        #[cfg(not(target_arch = "wasm32"))]
        let runner = if background {
            let (tx, requests) = std::sync::mpsc::channel::<Request>();
            let (verdicts, rx) = std::sync::mpsc::channel();
            // The shadow's model is made on its thread (a backend stays on the thread that made it).
            std::thread::spawn(move || {
                let mut shadow = shadow();
                if warm {
                    // A failure here is reported by the first check, which tries again.
                    let _ = shadow.make();
                }
                for r in requests {
                    if verdicts.send(pollster::block_on(shadow.step(r))).is_err() {
                        break;
                    }
                }
            });
            Runner::Thread { tx, rx, pending: 0 }
        } else {
            Runner::Inline(Box::new(shadow()))
        };
        #[cfg(target_arch = "wasm32")]
        let runner = {
            let _ = (background, warm);
            Runner::Inline(Box::new(shadow()))
        };
        Watch {
            every,
            runner,
            held: Vec::new(),
            stats: DriftStats::default(),
            tripped: None,
        }
    }

    /// Of `history` (one token per position, the last one the token the shadow feeds): the first
    /// position whose cache row the shadow lacks (the rows it holds stay valid while the tokens before
    /// them are the same), and the tokens from there up to the last one.
    fn span(&mut self, history: &[u32]) -> (usize, Vec<u32>) {
        let p = history.len() - 1;
        let from = self
            .held
            .iter()
            .zip(&history[..p])
            .take_while(|(a, b)| a == b)
            .count();
        let tokens = history[from..p].to_vec();
        self.held.truncate(from);
        self.held.extend_from_slice(&tokens);
        (from, tokens)
    }

    /// Hands `r`, a check of a model on `paths`, to the shadow: in line, its verdict is counted now
    /// (and returned when it trips the guard); on its thread, later ([`Watch::receive`]).
    async fn submit(&mut self, r: Request, paths: PathSet) -> Result<Option<DriftEvent>> {
        match &mut self.runner {
            Runner::Inline(shadow) => {
                let v = shadow.step(r).await?;
                Ok(self.count(v, paths))
            }
            #[cfg(not(target_arch = "wasm32"))]
            Runner::Thread { tx, pending, .. } => {
                tx.send(r).map_err(|_| stopped())?;
                *pending += 1;
                Ok(None)
            }
        }
    }

    /// Counts the shadow thread's outstanding verdicts on checks of a model on `paths`: all of them
    /// (waiting), or those that are ready. Returns the event when one trips the guard.
    // In the browser every verdict is taken in line.
    #[cfg_attr(target_arch = "wasm32", allow(unused_variables))]
    fn receive(&mut self, wait: bool, paths: PathSet) -> Result<Option<DriftEvent>> {
        #[cfg(target_arch = "wasm32")]
        return Ok(None);
        #[cfg(not(target_arch = "wasm32"))]
        {
            let mut event = None;
            while let Runner::Thread { rx, pending, .. } = &mut self.runner
                && *pending > 0
            {
                let v = if wait {
                    rx.recv().map_err(|_| stopped())?
                } else {
                    match rx.try_recv() {
                        Ok(v) => v,
                        Err(std::sync::mpsc::TryRecvError::Empty) => break,
                        Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                            return Err(stopped());
                        }
                    }
                };
                *pending -= 1;
                // Only the first verdict past the bound trips the guard (and makes an event).
                if let Some(e) = self.count(v?, paths) {
                    event = Some(e);
                }
            }
            Ok(event)
        }
    }

    /// Checks handed to the shadow's thread whose verdicts have not been taken.
    fn queued(&self) -> usize {
        match &self.runner {
            Runner::Inline(_) => 0,
            #[cfg(not(target_arch = "wasm32"))]
            Runner::Thread { pending, .. } => *pending,
        }
    }

    /// Counts a verdict on `paths`; past the bound (the first time), returns the event.
    fn count(&mut self, v: Verdict, paths: PathSet) -> Option<DriftEvent> {
        let s = &mut self.stats;
        s.checks += 1;
        s.shadow_secs += v.secs;
        if v.same_top1 {
            s.same_top1 += 1;
        }
        let ratio = if v.kl.is_nan() {
            f64::INFINITY
        } else {
            v.kl / v.bound
        };
        if ratio >= s.worst_ratio {
            s.worst_ratio = ratio;
            s.worst_kl = v.kl;
        }
        if ratio <= 1.0 || self.tripped.is_some() {
            return None;
        }
        let event = DriftEvent {
            position: v.position,
            kl: v.kl,
            bound: v.bound,
            same_top1: s.same_top1,
            checks: s.checks,
            paths,
        };
        self.tripped = Some(event.clone());
        Some(event)
    }
}

/// Watches one model's generation; see the module documentation.
pub struct DriftGuard {
    watch: Watch,
    file: Arc<GgufFile>,
}

impl DriftGuard {
    /// A guard for a model of `file` holding `context` positions, checking every `every` tokens (0:
    /// never). The shadow runs on a CPU backend of `threads` threads (None:
    /// [`DEFAULT_SHADOW_THREADS`]); with `background` (native only) on a thread of its own, its
    /// verdict taken when it is ready.
    pub fn new(
        file: impl Into<Arc<GgufFile>>,
        context: usize,
        every: usize,
        threads: Option<usize>,
        background: bool,
    ) -> DriftGuard {
        Self::with_warm(file, context, every, threads, background, false)
    }

    /// [`DriftGuard::new`] whose shadow (on its thread) loads its model at once rather than at its
    /// first check: what a long-lived server wants, so that no request waits behind that load.
    pub fn warm(
        file: impl Into<Arc<GgufFile>>,
        context: usize,
        every: usize,
        threads: Option<usize>,
    ) -> DriftGuard {
        Self::with_warm(file, context, every, threads, true, true)
    }

    fn with_warm(
        file: impl Into<Arc<GgufFile>>,
        context: usize,
        every: usize,
        threads: Option<usize>,
        background: bool,
        warm: bool,
    ) -> DriftGuard {
        let file = file.into();
        let model = ShadowModel::Llm {
            file: file.clone(),
            context,
        };
        DriftGuard {
            watch: Watch::new(model, every, threads, background, warm),
            file,
        }
    }

    /// Checks every this many tokens (0: never).
    pub fn every(&self) -> usize {
        self.watch.every
    }

    /// Whether a check is due now that the token at `position` has been fed: at positions every−1,
    /// 2·every−1, ... (wherever the sequence was rolled back to), while the guard has not tripped.
    pub fn due(&self, position: usize) -> bool {
        let w = &self.watch;
        w.every > 0 && w.tripped.is_none() && (position + 1).is_multiple_of(w.every)
    }

    /// What the checks so far measured.
    pub fn stats(&self) -> DriftStats {
        self.watch.stats
    }

    /// Whether [`MAX_QUEUED_CHECKS`] checks wait for the shadow (on its thread): a server then keeps
    /// its next check for a later step.
    pub fn busy(&self) -> bool {
        self.watch.queued() >= MAX_QUEUED_CHECKS
    }

    /// The check that tripped the guard, if one did.
    pub fn tripped(&self) -> Option<&DriftEvent> {
        self.watch.tripped.as_ref()
    }

    /// Starts checking `llm`'s last step, whose logits (on its fast paths) are `fast`, against the f32
    /// path from the same state: the cache rows the shadow lacks are read from the device, then the
    /// shadow takes the step (in line, or on its thread after the verdict of an earlier check is
    /// taken). A verdict taken past the bound moves `llm` to the f32 path (its next logits are then
    /// the f32 path's after the same tokens) and is returned.
    pub async fn check(
        &mut self,
        be: &Backend,
        llm: &mut Llm,
        fast: &[f32],
    ) -> Result<Option<DriftEvent>> {
        if llm.position() == 0 {
            return Ok(None);
        }
        if let Some(e) = self.settle(be, llm).await? {
            return Ok(Some(e));
        }
        let history = llm.history().to_vec();
        let r = self.request(be, llm, &history, Checked::Own(fast))?;
        self.submit(be, llm, r, true).await
    }

    /// [`DriftGuard::check`] for one of the sequences a server decodes side by side: `seq` holds the
    /// tokens `history` (one per position) and its logits are row `row` of the last pass. A verdict
    /// past the bound is returned but the model is *not* switched: the caller moves it and all its
    /// sequences ([`Llm::switch_paths_with`]). Checks of different sequences share the shadow, which
    /// keeps the cache rows of the tokens they have in common. On the shadow's thread the checks
    /// queue: this never waits for an earlier verdict (verdicts that are ready are taken), nor for
    /// the device: the logits row and the cache rows are copied behind the pass in one submission,
    /// and the shadow waits for that copy and takes the words out.
    pub async fn check_sequence(
        &mut self,
        be: &Backend,
        llm: &mut Llm,
        seq: &Sequence,
        history: &[u32],
        row: usize,
    ) -> Result<Option<DriftEvent>> {
        if history.len() != seq.position() {
            return Err(LlmError::Options(format!(
                "a sequence of {} positions checked with {} tokens",
                seq.position(),
                history.len()
            )));
        }
        if history.is_empty() {
            return Ok(None);
        }
        if let Some(e) = self.receive(be, llm, false, false)? {
            return Ok(Some(e));
        }
        let r = self.request(be, llm, history, Checked::Row(seq, row))?;
        self.submit(be, llm, r, false).await
    }

    /// Takes the verdict of the last [`DriftGuard::check_sequence`] if it is ready, without switching
    /// the model (see there).
    pub fn poll_sequences(&mut self, be: &Backend, llm: &mut Llm) -> Result<Option<DriftEvent>> {
        self.receive(be, llm, false, false)
    }

    /// The shadow's next step: the cache rows it lacks of the checked sequence, which holds
    /// `history`, its last token, and the fast paths' logits.
    fn request(
        &mut self,
        be: &Backend,
        llm: &Llm,
        history: &[u32],
        checked: Checked<'_>,
    ) -> Result<Request> {
        let p = history.len() - 1;
        let id = match history.get(p) {
            Some(&id) if (id as usize) < llm.config().vocab => id,
            _ => {
                return Err(LlmError::Options(format!(
                    "the token at position {p} is not known on the host yet"
                )));
            }
        };
        let (from, tokens) = self.watch.span(history);
        let t0 = web_time::Instant::now();
        let (seq, row, fast) = match checked {
            Checked::Own(fast) => (None, None, Some(fast.to_vec())),
            Checked::Row(seq, row) => (Some(seq), Some(row), None),
        };
        let (read, lens) = llm.start_check_read(be, seq, row, from, p - from)?;
        let reads = Reads::Detached {
            read: be.read_detach(read)?,
            lens,
            softcap: llm.config().final_softcap,
            fast,
        };
        self.watch.stats.read_secs += t0.elapsed().as_secs_f64();
        Ok(Request {
            from,
            reads,
            tokens,
            id,
        })
    }

    /// Hands `r` to the shadow: in line, its verdict taken now; on its thread, taken later.
    async fn submit(
        &mut self,
        be: &Backend,
        llm: &mut Llm,
        r: Request,
        switch: bool,
    ) -> Result<Option<DriftEvent>> {
        let event = self.watch.submit(r, llm.paths()).await?;
        self.switch_on(be, llm, event, switch)
    }

    /// Takes the verdict of the last check if it is ready (native background shadow; in line every
    /// verdict is taken by [`DriftGuard::check`]).
    pub fn poll(&mut self, be: &Backend, llm: &mut Llm) -> Result<Option<DriftEvent>> {
        self.receive(be, llm, false, true)
    }

    /// Waits for the verdict of the last check, if one is outstanding, and takes it.
    pub async fn settle(&mut self, be: &Backend, llm: &mut Llm) -> Result<Option<DriftEvent>> {
        self.receive(be, llm, true, true)
    }

    /// Takes the shadow thread's outstanding verdicts: waiting for all of them, or those that are
    /// ready; with `switch`, a verdict past the bound moves the model to the f32 path. Returns the
    /// first event.
    fn receive(
        &mut self,
        be: &Backend,
        llm: &mut Llm,
        wait: bool,
        switch: bool,
    ) -> Result<Option<DriftEvent>> {
        let event = self.watch.receive(wait, llm.paths())?;
        self.switch_on(be, llm, event, switch)
    }

    /// Passes `event` on; with `switch`, when there is one, moves `llm` to the f32 path first.
    fn switch_on(
        &self,
        be: &Backend,
        llm: &mut Llm,
        event: Option<DriftEvent>,
        switch: bool,
    ) -> Result<Option<DriftEvent>> {
        if event.is_some() && switch {
            llm.switch_paths(be, &self.file, PathSet::F32)?;
        }
        Ok(event)
    }

    /// The model file the guard was made for (what a caller switching the model itself loads).
    pub fn file(&self) -> &GgufFile {
        &self.file
    }
}

/// The drift guard of a char-level GPT ([`GptRunner::generate_guarded_async`]): every `every` tokens
/// generated, the step is computed again on the f32 path from the runner's cache rows (the QKV rows of
/// the positions in its block) and compared as for a GGUF model. Past the bound the runner moves to
/// the f32 path: its f32 weights are uploaded again from the parameters the guard holds and its cache
/// recomputed from the tokens in its block.
pub struct GptDriftGuard {
    watch: Watch,
    params: Arc<[f32]>,
    /// Steps seen since the guard was made.
    steps: usize,
}

impl GptDriftGuard {
    /// A guard for a runner of `cfg` made from `params` (the host copy, [`crate::gpt::Layout`] order),
    /// checking every `every` tokens (0: never); the shadow as in [`DriftGuard::new`].
    pub fn new(
        cfg: &GptConfig,
        params: impl Into<Arc<[f32]>>,
        every: usize,
        threads: Option<usize>,
        background: bool,
    ) -> GptDriftGuard {
        let params = params.into();
        let model = ShadowModel::Gpt {
            cfg: cfg.clone(),
            params: params.clone(),
        };
        GptDriftGuard {
            watch: Watch::new(model, every, threads, background, false),
            params,
            steps: 0,
        }
    }

    /// Checks every this many tokens (0: never).
    pub fn every(&self) -> usize {
        self.watch.every
    }

    /// What the checks so far measured.
    pub fn stats(&self) -> DriftStats {
        self.watch.stats
    }

    /// The check that tripped the guard, if one did.
    pub fn tripped(&self) -> Option<&DriftEvent> {
        self.watch.tripped.as_ref()
    }

    /// After one generated token's step, whose logits are `fast`: every `every` steps (counted by
    /// the guard), [`GptDriftGuard::watch`] with a check due.
    pub async fn after_step(
        &mut self,
        be: &Backend,
        runner: &mut GptRunner,
        fast: &[f32],
    ) -> tinygpt_kernels::Result<Option<DriftEvent>> {
        if runner.paths().is_empty() || self.watch.every == 0 || self.watch.tripped.is_some() {
            return Ok(None);
        }
        self.steps += 1;
        let due = self.steps.is_multiple_of(self.watch.every);
        self.watch(be, runner, fast, due).await
    }

    /// After a step of `runner` (whose logits are `fast`): takes the verdicts that are ready and, when
    /// `due`, starts a check of this step against the f32 path from the runner's cache rows. When a
    /// verdict passes the bound the runner moves to the f32 path (its logits are then the f32 path's
    /// after the same tokens: read them again) and the event is returned. Nothing is checked on the
    /// f32 path. A server's sequences share one guard (each run through the runner in turn).
    pub async fn watch(
        &mut self,
        be: &Backend,
        runner: &mut GptRunner,
        fast: &[f32],
        due: bool,
    ) -> tinygpt_kernels::Result<Option<DriftEvent>> {
        if runner.paths().is_empty() || self.watch.tripped.is_some() {
            return Ok(None);
        }
        if let Some(e) = self.receive(be, runner, false)? {
            return Ok(Some(e));
        }
        if !due || runner.position() == 0 {
            return Ok(None);
        }
        let history = runner.history().to_vec();
        let (from, tokens) = self.watch.span(&history);
        let p = history.len() - 1;
        let t0 = web_time::Instant::now();
        let kv = runner.read_cache(be, from, p - from).await?;
        self.watch.stats.read_secs += t0.elapsed().as_secs_f64();
        let r = Request {
            from,
            reads: Reads::Ready {
                kv,
                fast: fast.to_vec(),
            },
            tokens,
            id: history[p],
        };
        let event = self
            .watch
            .submit(r, runner.paths())
            .await
            .map_err(kernel_error)?;
        self.switch_on(be, runner, event)
    }

    /// Waits for the verdicts outstanding and takes them (the end of a run, for its report).
    pub fn settle(
        &mut self,
        be: &Backend,
        runner: &mut GptRunner,
    ) -> tinygpt_kernels::Result<Option<DriftEvent>> {
        self.receive(be, runner, true)
    }

    fn receive(
        &mut self,
        be: &Backend,
        runner: &mut GptRunner,
        wait: bool,
    ) -> tinygpt_kernels::Result<Option<DriftEvent>> {
        let event = self
            .watch
            .receive(wait, runner.paths())
            .map_err(kernel_error)?;
        self.switch_on(be, runner, event)
    }

    /// Passes `event` on, when there is one moving `runner` to the f32 path first.
    fn switch_on(
        &self,
        be: &Backend,
        runner: &mut GptRunner,
        event: Option<DriftEvent>,
    ) -> tinygpt_kernels::Result<Option<DriftEvent>> {
        if event.is_some() && !runner.paths().is_empty() {
            runner.switch_paths(be, &self.params, PathSet::F32)?;
        }
        Ok(event)
    }
}

/// A shadow's error as the GPT runner's (it runs the kernels' errors only).
fn kernel_error(e: LlmError) -> tinygpt_kernels::Error {
    match e {
        LlmError::Kernel(e) => e,
        e => tinygpt_kernels::Error::Shape {
            op: "drift guard",
            msg: e.to_string(),
        },
    }
}

/// The error of a shadow thread that is gone (it ends only when its guard is dropped, or panicked).
#[cfg(not(target_arch = "wasm32"))]
fn stopped() -> LlmError {
    LlmError::Options("the drift guard's shadow stopped".into())
}

/// KL(base ‖ test) of the two distributions the logits give (f64 log-softmax of each); 0 for equal
/// rows, NaN when either holds a NaN.
pub fn kl_divergence(base: &[f32], test: &[f32]) -> f64 {
    let lb = log_softmax(base);
    let lt = log_softmax(test);
    let kl: f64 = lb.iter().zip(&lt).map(|(b, t)| b.exp() * (b - t)).sum();
    if kl.is_nan() { kl } else { kl.max(0.0) }
}

fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln();
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// The largest KL divergence a step may show: what the op gate's own limit allows at the logits. The
/// gate passes an output whose every element is within 1% of the reference's mean magnitude
/// (`max_abs < 0.01 · mean|ref|`). Logits z + δ with |δᵢ| ≤ ε give q ∝ p·e^δ, so
/// KL(p ‖ q) = log E_p[e^δ] − E_p[δ] ≤ (2ε)²/8 = ½ ε² (Hoeffding's lemma: δ lies in a range of 2ε),
/// hence bound = ½ (0.01 · mean|z|)², z the f32 path's logits. docs/precision.md gives the figures.
pub fn kl_bound(reference: &[f32]) -> f64 {
    let mean =
        reference.iter().map(|&x| (x as f64).abs()).sum::<f64>() / reference.len().max(1) as f64;
    0.5 * (0.01 * mean).powi(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_is_zero_for_equal_rows_and_matches_its_definition() {
        assert_eq!(kl_divergence(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]), 0.0);
        let (p, q) = ([0.0f32, 0.0], [0.0f32, (3.0f64).ln() as f32]);
        // KL(½,½ ‖ ¼,¾) = ½ ln 2 + ½ ln(2/3).
        let want = 0.5 * 2f64.ln() + 0.5 * (2.0f64 / 3.0).ln();
        assert!((kl_divergence(&p, &q) - want).abs() < 1e-6);
        assert!(kl_divergence(&[0.0, f32::NAN], &[0.0, 1.0]).is_nan());
    }

    #[test]
    fn the_bound_holds_for_any_perturbation_within_the_gates_limit() {
        // Logits of a spread like a real model's, and perturbations at the gate's limit ε: alternating
        // signs, all one sign (KL 0: a shift), and one spike on the most likely token.
        let z: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 1000) as f32 / 50.0 - 10.0)
            .collect();
        let bound = kl_bound(&z);
        let mean = z.iter().map(|x| x.abs()).sum::<f32>() / z.len() as f32;
        let eps = 0.01 * mean;
        let top = crate::sampler::argmax(&z) as usize;
        let perturbed: [Box<dyn Fn(usize) -> f32>; 3] = [
            Box::new(|i| if i % 2 == 0 { eps } else { -eps }),
            Box::new(|_| eps),
            Box::new(|i| if i == top { eps } else { 0.0 }),
        ];
        for d in perturbed {
            let q: Vec<f32> = z.iter().enumerate().map(|(i, x)| x + d(i)).collect();
            let kl = kl_divergence(&z, &q);
            assert!(kl <= bound, "{kl} > {bound}");
        }
        // Ten times the limit on alternate tokens is past it.
        let q: Vec<f32> = z
            .iter()
            .enumerate()
            .map(|(i, x)| x + if i % 2 == 0 { 10.0 * eps } else { 0.0 })
            .collect();
        assert!(kl_divergence(&z, &q) > bound);
    }
}
