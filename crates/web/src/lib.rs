//! TinyGPT in the browser: the same kernels, gate and models, compiled to wasm32 and driven by the
//! playground's Web Worker (`web/worker.js`). The worker calls one method at a time; each returns a
//! Promise and reports through the callbacks it is given (log lines, text as it is generated), so the
//! page stays responsive and every line the console shows is the library's own.
//!
//! The verdict store is the gate's `MemoryStore`, seeded from and saved back to the browser's
//! IndexedDB by the worker (a worker has no synchronous storage).
//!
//! The session's state is one `RefCell`, borrowed for the whole of each method, across its awaits:
//! safe because the worker queues the calls, so one runs at a time; only `stop` comes in between, and
//! it touches a separate `Cell`.
#![allow(clippy::await_holding_refcell_ref)]

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use js_sys::{Function, Promise, Uint8Array};
use serde_json::{Value, json};
use tinygpt_formats::GgufFile;
use tinygpt_kernels::device::{BackendChoice, DeviceOptions};
use tinygpt_kernels::gate::{GateOptions, Gated, MemoryStore, gate_device, gate_for_model};
use tinygpt_kernels::{Backend, PathId, PathSet};
use tinygpt_models::chat_template::ChatTemplate;
use tinygpt_models::gating::{GgufGate, GptGate};
use tinygpt_models::gpt::checkpoint::{
    self, CheckpointConfig, CheckpointFiles, TrainState, WeightDtype,
};
use tinygpt_models::gpt::{
    CharVocab, Dataset, GptConfig, GptRunner, Layout, OptimConfig, Trainer, learning_rate,
};
use tinygpt_models::llm::{DriftEvent, DriftGuard, GptDriftGuard, Llm, LlmConfig, LoadOptions};
use tinygpt_models::sampler::{Sampler, SamplerConfig};
use tinygpt_models::tokenizer::Tokenizer;
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::{JsFuture, future_to_promise, spawn_local};
use web_time::Instant;

mod archive;

#[wasm_bindgen(start)]
pub fn start() {
    console_error_panic_hook::set_once();
}

fn js_err(e: impl std::fmt::Display) -> JsValue {
    JsValue::from_str(&e.to_string())
}

/// Lets the worker's event loop run (messages such as "stop" are handled there).
async fn yield_now() {
    let p = Promise::new(&mut |resolve, _| {
        let global = js_sys::global();
        if let Ok(f) = js_sys::Reflect::get(&global, &JsValue::from_str("setTimeout"))
            && let Ok(f) = f.dyn_into::<Function>()
        {
            let _ = f.call2(&global, &resolve, &JsValue::from(0));
        } else {
            let _ = resolve.call0(&JsValue::NULL);
        }
    });
    let _ = JsFuture::from(p).await;
}

fn call(f: &Function, v: impl Into<JsValue>) {
    let _ = f.call1(&JsValue::NULL, &v.into());
}

/// A drift-guard event, warned on the browser console and reported to the page (which records it as
/// the CLI does).
fn drift_report(e: &DriftEvent) -> serde_json::Value {
    let line = e.log_line("going on on the f32 path");
    console_warn(&line);
    json!({"position": e.position, "kl": e.kl, "bound": e.bound, "same_top1": e.same_top1,
           "checks": e.checks, "line": line,
           "paths": e.paths.iter().map(PathId::name).collect::<Vec<_>>()})
}

/// The char-level GPT the page samples from (the bundled model, a trained or an uploaded one).
struct Gpt {
    runner: GptRunner,
    vocab: CharVocab,
    config: CheckpointConfig,
    /// Watches the fast paths while they generate (its shadow runs in line, on the wasm CPU backend).
    guard: Option<GptDriftGuard>,
}

/// A training run in the page.
struct Training {
    trainer: Trainer,
    data: Dataset,
    config: CheckpointConfig,
    seed: u64,
    max_iters: usize,
    lr: f32,
    min_lr: f32,
    warmup: usize,
    state: TrainState,
    started: Instant,
    steps_timed: usize,
}

#[wasm_bindgen]
extern "C" {
    /// The browser console's warning line (where the page's developer tools show it).
    #[wasm_bindgen(js_namespace = console, js_name = warn)]
    fn console_warn(s: &str);
}

/// A GGUF model and its conversation.
struct Chat {
    llm: Llm,
    tok: Tokenizer,
    template: Option<ChatTemplate>,
    name: String,
    messages: Vec<(String, String)>,
    /// Token ids the KV cache holds.
    cached: Vec<u32>,
    /// Watches generation on fast paths (the f32 shadow runs on the wasm CPU backend).
    guard: Option<DriftGuard>,
    /// The file (the weights are converted again from it when the model moves to other paths).
    file: Arc<GgufFile>,
    /// Which load this is (background gating applies to the load it was started for).
    load: u64,
}

/// Fast paths being gated for the chat's model, on a second device, while it answers on the f32
/// path: the first reply never waits for the gates.
struct BackgroundGating {
    load: u64,
    /// Set when the gates finished: the paths that passed (or why gating failed) until the chat
    /// moves, and the verdicts and records they stored until the worker saves them.
    paths: Option<std::result::Result<PathSet, String>>,
    store: Option<MemoryStore>,
}

struct Inner {
    be: Backend,
    store: MemoryStore,
    device: Option<Gated>,
    gpt: Option<Gpt>,
    training: Option<Training>,
    chat: Option<Chat>,
    /// The drift guard checks one generated token in this many (0: off); models loaded later take it.
    drift_every: usize,
}

/// One page's engine.
#[wasm_bindgen]
pub struct Session {
    inner: Rc<RefCell<Inner>>,
    /// Apart from `inner` (borrowed across a whole call): the gating future writes here while a
    /// reply runs.
    gating: Rc<RefCell<Option<BackgroundGating>>>,
    loads: Rc<Cell<u64>>,
    stop: Rc<Cell<bool>>,
    label: String,
    fallback: Option<String>,
}

/// Opens the backend `choice` names ("auto", "gpu" or "cpu"). WebGPU is opened with only WebGPU's
/// default limits (as on phones and many laptops); "auto" falls back to the wasm CPU backend when there
/// is no adapter, the device request fails, or the only adapter is a software one (SwiftShader runs the
/// kernels far slower than the CPU backend: "gpu" still uses it). `verdicts` is the JSON map of stored
/// gate verdicts.
#[wasm_bindgen]
pub fn open_session(choice: String, verdicts: String) -> Promise {
    future_to_promise(async move {
        let store = MemoryStore {
            verdicts: serde_json::from_str(&verdicts).unwrap_or_default(),
            records: Vec::new(),
        };
        let cpu = || Backend::Cpu(tinygpt_kernels::cpu::CpuBackend::new(None));
        let (be, fallback) = if choice == "cpu" {
            (
                cpu(),
                Some("the CPU backend was asked for (?backend=cpu)".to_string()),
            )
        } else {
            let opts = DeviceOptions {
                backend: BackendChoice::Gpu,
                low_end: true,
                ..DeviceOptions::default()
            };
            match tinygpt_kernels::device::open(&opts).await {
                Ok((be, _)) if choice == "auto" && be.as_gpu().is_some_and(|g| g.is_software()) => (
                    cpu(),
                    Some(
                        "the only WebGPU adapter is a software one (SwiftShader), which runs the \
                             kernels far slower than the CPU backend: using the CPU (wasm); \
                             ?backend=gpu uses WebGPU anyway"
                            .to_string(),
                    ),
                ),
                Ok((be, _)) => (be, None),
                Err(e) if choice == "auto" => (cpu(), Some(format!("no WebGPU device ({e})"))),
                Err(e) => return Err(js_err(format!("WebGPU was asked for (?backend=gpu): {e}"))),
            }
        };
        let label = match &be {
            Backend::Cpu(_) => "CPU (wasm)".to_string(),
            Backend::Gpu(g) => {
                // Browsers may withhold the adapter's name; its description or vendor stands in.
                let i = g.info();
                let name = [&i.name, &i.driver_info, &i.driver]
                    .into_iter()
                    .find(|s| !s.is_empty())
                    .cloned()
                    .unwrap_or_else(|| format!("WebGPU adapter {:04x}:{:04x}", i.vendor, i.device));
                format!("{name} (WebGPU)")
            }
        };
        let s = Session {
            label,
            fallback,
            inner: Rc::new(RefCell::new(Inner {
                be,
                store,
                device: None,
                gpt: None,
                training: None,
                chat: None,
                drift_every: tinygpt_models::llm::drift::DEFAULT_EVERY,
            })),
            gating: Rc::new(RefCell::new(None)),
            loads: Rc::new(Cell::new(0)),
            stop: Rc::new(Cell::new(false)),
        };
        Ok(JsValue::from(s))
    })
}

fn pill_json(g: &Gated) -> Value {
    json!(
        g.summary
            .reports
            .iter()
            .map(|r| json!({
                "path": r.name,
                "pill": r.pill,
                "active": g.paths.has(r.path),
                "status": r.status,
                "reason": r.reason,
                "text": r.pill_text(),
            }))
            .collect::<Vec<_>>()
    )
}

impl Inner {
    fn paths(&self) -> PathSet {
        self.device.as_ref().map_or(PathSet::F32, |g| g.paths)
    }
}

#[wasm_bindgen]
impl Session {
    /// "SwiftShader Device (Subzero) (BrowserWebGpu)" or "CPU (wasm)".
    pub fn backend(&self) -> String {
        self.label.clone()
    }

    /// What the adapter reported and what was asked of it (JSON).
    pub fn adapter_info(&self) -> String {
        match &self.inner.borrow().be {
            Backend::Gpu(g) => serde_json::to_string(g.info()).unwrap_or_default(),
            Backend::Cpu(_) => "{}".into(),
        }
    }

    /// Why the GPU is not used, if it is not.
    pub fn fallback(&self) -> Option<String> {
        self.fallback.clone()
    }

    /// The stored verdicts (JSON), for the worker to save to IndexedDB (those of background gating
    /// that finished included).
    pub fn verdicts(&self) -> String {
        let mut i = self.inner.borrow_mut();
        absorb_gating(&self.gating, &mut i.store);
        serde_json::to_string(&i.store.verdicts).unwrap_or_default()
    }

    /// Gating runs recorded since the last call (JSON list), for the page's telemetry.
    pub fn take_records(&self) -> String {
        let mut i = self.inner.borrow_mut();
        absorb_gating(&self.gating, &mut i.store);
        let records = std::mem::take(&mut i.store.records);
        serde_json::to_string(&records).unwrap_or_default()
    }

    /// The drift guard of models loaded after this call checks one generated token in every `n` on the
    /// f32 path too (0: off), as `tinygpt --drift-check N` does; the page takes it from
    /// `?drift-check=N` (default 128).
    pub fn set_drift_check(&self, n: usize) {
        self.inner.borrow_mut().drift_every = n;
    }

    /// Asks a running generation or chat reply to stop at its next token.
    pub fn stop(&self) {
        self.stop.set(true);
    }

    /// Gates every fast path the adapter offers (each log line to `log`); returns the pills (JSON).
    pub fn gate(&self, regate: bool, log: Function) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            let mut i = inner.borrow_mut();
            let Inner { be, store, .. } = &mut *i;
            let opts = GateOptions {
                regate,
                seed: 20261129,
                ..GateOptions::default()
            };
            let gated = gate_device(be, store, &opts, &mut |l| call(&log, l)).await;
            let pills = pill_json(&gated);
            i.device = Some(gated);
            Ok(JsValue::from_str(&pills.to_string()))
        })
    }

    /// Loads a char-level GPT checkpoint from its files (config.json, model.safetensors) and gates it
    /// end to end (its 100 greedy tokens on the f32 path and the fast paths).
    pub fn load_gpt(&self, config: Vec<u8>, model: Vec<u8>, log: Function) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            let files = CheckpointFiles {
                config,
                model,
                optimizer: None,
                state: None,
            };
            let ck = checkpoint::decode(std::path::Path::new("bundled"), &files).map_err(js_err)?;
            let mut i = inner.borrow_mut();
            let gpt = gpt_from(&mut i, ck.config, ck.params, &log).await?;
            let info = json!({"params": gpt.config.model.num_params(), "vocab": gpt.vocab.len(),
                              "block": gpt.config.model.block_size});
            i.gpt = Some(gpt);
            Ok(JsValue::from_str(&info.to_string()))
        })
    }

    /// Samples `n` characters after `prompt` from the loaded GPT, passing each to `on_text`; resolves
    /// to the timings (JSON). `tinygpt --backend cpu generate` with the same settings gives the same
    /// text.
    #[allow(clippy::too_many_arguments)]
    pub fn generate(
        &self,
        prompt: String,
        n: usize,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        seed: u64,
        on_text: Function,
    ) -> Promise {
        let (inner, stop) = (self.inner.clone(), self.stop.clone());
        stop.set(false);
        future_to_promise(async move {
            let sc = SamplerConfig {
                temperature,
                top_k,
                top_p,
                seed,
            };
            sc.validate().map_err(js_err)?;
            let mut i = inner.borrow_mut();
            let Inner { be, gpt, .. } = &mut *i;
            let gpt = gpt.as_mut().ok_or_else(|| js_err("no model is loaded"))?;
            let ids = gpt.vocab.encode(&prompt).map_err(|e| {
                js_err(format!(
                    "{e}: the model knows only the characters of its training text"
                ))
            })?;
            if ids.is_empty() {
                return Err(js_err("the prompt is empty"));
            }
            let mut sampler = Sampler::new(sc);
            let t0 = Instant::now();
            let mut made = 0usize;
            let vocab = gpt.vocab.clone();
            let mut drift = None;
            let r = gpt
                .runner
                .generate_guarded_async(
                    be,
                    &ids,
                    n,
                    &mut sampler,
                    gpt.guard.as_mut(),
                    |e| drift = Some(drift_report(e)),
                    async |t| {
                        call(&on_text, vocab.decode(&[t]));
                        made += 1;
                        if made.is_multiple_of(8) {
                            yield_now().await;
                        }
                        if stop.get() {
                            return Err(tinygpt_kernels::Error::Shape {
                                op: "generate",
                                msg: "stopped".into(),
                            });
                        }
                        Ok(())
                    },
                )
                .await;
            if let Err(e) = r
                && !stop.get()
            {
                return Err(js_err(e));
            }
            let secs = t0.elapsed().as_secs_f64();
            Ok(JsValue::from_str(
                &json!({"tokens": made, "seconds": secs, "tokens_per_s": made as f64 / secs.max(1e-9),
                        "drift": drift,
                        "drift_checks": gpt.guard.as_ref().map_or(0, |g| g.stats().checks),
                        "paths": gpt.runner.paths().iter().map(PathId::name).collect::<Vec<_>>()})
                .to_string(),
            ))
        })
    }

    /// Times `n` single-token steps of the loaded GPT: recording and reading back apart (diagnostics).
    pub fn bench_steps(&self, n: usize, log: Function) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            let mut i = inner.borrow_mut();
            let Inner { be, gpt, .. } = &mut *i;
            let gpt = gpt.as_mut().ok_or_else(|| js_err("no model is loaded"))?;
            gpt.runner.reset();
            for k in 0..n {
                let t0 = Instant::now();
                gpt.runner.feed(be, &[1]).map_err(js_err)?;
                let t1 = Instant::now();
                be.flush().map_err(js_err)?;
                let t2 = Instant::now();
                let _ = gpt.runner.read_logits(be).await.map_err(js_err)?;
                let t3 = Instant::now();
                call(
                    &log,
                    format!(
                        "step {k}: record {:.1} ms, submit {:.1} ms, read {:.1} ms",
                        (t1 - t0).as_secs_f64() * 1e3,
                        (t2 - t1).as_secs_f64() * 1e3,
                        (t3 - t2).as_secs_f64() * 1e3
                    ),
                );
            }
            Ok(JsValue::UNDEFINED)
        })
    }

    /// Starts a training run: `preset` (JSON: n_layer, n_head, n_embd, block_size, batch_size,
    /// dropout, lr, min_lr, warmup, max_iters, seed) on `text`. Refuses a text too short to train on.
    pub fn train_start(&self, preset: String, text: String) -> Result<String, JsValue> {
        let p: Value = serde_json::from_str(&preset).map_err(js_err)?;
        let get = |k: &str, d: f64| p.get(k).and_then(Value::as_f64).unwrap_or(d);
        let block = get("block_size", 64.0) as usize;
        let data = Dataset::from_bytes(text.as_bytes(), block).map_err(js_err)?;
        let cfg = GptConfig {
            vocab_size: data.vocab.len(),
            block_size: block,
            n_layer: get("n_layer", 2.0) as usize,
            n_head: get("n_head", 2.0) as usize,
            n_embd: get("n_embd", 64.0) as usize,
            dropout: get("dropout", 0.0) as f32,
        };
        cfg.validate().map_err(js_err)?;
        let seed = get("seed", 1337.0) as u64;
        let params = Layout::new(&cfg).init(&cfg, seed);
        let mut i = self.inner.borrow_mut();
        // The page does not run the training gate, so it never trains on the tensor-core path (which
        // WebGPU does not expose today anyway).
        let paths = i.paths().without(PathId::MixedTraining);
        let batch = get("batch_size", 16.0) as usize;
        let trainer = Trainer::new(
            &i.be,
            &cfg,
            batch,
            &params,
            None,
            OptimConfig::default(),
            paths,
        )
        .map_err(js_err)?;
        let max_iters = get("max_iters", 200.0) as usize;
        let info = json!({"params": cfg.num_params(), "vocab": data.vocab.len(),
                          "train_chars": data.train.len(), "val_chars": data.val.len()});
        i.training = Some(Training {
            config: CheckpointConfig {
                model: cfg,
                vocab: data.vocab.clone(),
                provenance: json!({"trained_with": "tinygpt playground"}),
            },
            trainer,
            data,
            seed,
            max_iters,
            lr: get("lr", 1e-3) as f32,
            min_lr: get("min_lr", 1e-4) as f32,
            warmup: get("warmup", 10.0) as usize,
            state: TrainState {
                seed,
                max_iters,
                ..TrainState::default()
            },
            started: Instant::now(),
            steps_timed: 0,
        });
        Ok(info.to_string())
    }

    /// Runs up to `k` training steps (one submit each) and resolves to {iter, loss, tokens_per_s, done}.
    pub fn train_steps(&self, k: usize) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            let mut i = inner.borrow_mut();
            let Inner { be, training, .. } = &mut *i;
            let t = training.as_mut().ok_or_else(|| js_err("no training run"))?;
            let cfg = t.config.model.clone();
            let batch = t.trainer.batch;
            let start = t.trainer.step as usize;
            let end = (start + k.max(1)).min(t.max_iters);
            for it in start..end {
                let (x, y) = t
                    .data
                    .batch(false, t.seed, it as u64, batch, cfg.block_size);
                let lr = learning_rate(it, t.warmup, t.max_iters, t.lr, t.min_lr);
                t.trainer
                    .train_step(be, &x, &y, lr, t.seed as u32)
                    .map_err(js_err)?;
            }
            let loss = t.trainer.read_loss(be).await.map_err(js_err)?;
            if !loss.is_finite() {
                return Err(js_err(format!(
                    "the training loss became {loss}: lower the learning rate"
                )));
            }
            t.steps_timed += end - start;
            let iter = t.trainer.step as usize;
            t.state.step = t.trainer.step;
            t.state.train_losses.push((iter, loss));
            let secs = t.started.elapsed().as_secs_f64();
            let tps = (t.steps_timed * batch * cfg.block_size) as f64 / secs.max(1e-9);
            Ok(JsValue::from_str(
                &json!({"iter": iter, "loss": loss, "tokens_per_s": tps,
                        "ms_per_iter": 1e3 * secs / t.steps_timed.max(1) as f64,
                        "max_iters": t.max_iters, "done": iter >= t.max_iters})
                .to_string(),
            ))
        })
    }

    /// Mean validation loss over `batches` fixed batches (dropout off).
    pub fn train_eval(&self, batches: usize) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            let mut i = inner.borrow_mut();
            let Inner { be, training, .. } = &mut *i;
            let t = training.as_mut().ok_or_else(|| js_err("no training run"))?;
            let (batch, block) = (t.trainer.batch, t.config.model.block_size);
            let mut sum = 0.0f64;
            for b in 0..batches.max(1) {
                let (x, y) = t.data.batch(true, t.seed ^ 0xE7A1, b as u64, batch, block);
                sum += t
                    .trainer
                    .eval_loss_async(be, &x, &y)
                    .await
                    .map_err(js_err)? as f64;
                yield_now().await;
            }
            let val = (sum / batches.max(1) as f64) as f32;
            let iter = t.trainer.step as usize;
            t.state.val_losses.push((iter, val));
            if t.state.best_val.is_none_or(|b| val < b) {
                t.state.best_val = Some(val);
                t.state.best_iter = Some(iter);
            }
            Ok(JsValue::from_str(
                &json!({"iter": iter, "val_loss": val}).to_string(),
            ))
        })
    }

    /// The trained model as a checkpoint archive (a zip of config.json, model.safetensors and
    /// train_state.json: unzip it into a directory and `tinygpt generate --model DIR` loads it). The
    /// last complete step's weights, so a running training can always be saved.
    pub fn train_checkpoint(&self) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            let i = inner.borrow();
            let t = i
                .training
                .as_ref()
                .ok_or_else(|| js_err("no training run"))?;
            let (params, _, _) = t.trainer.read_state(&i.be).await.map_err(js_err)?;
            let files =
                checkpoint::encode(&t.config, &params, WeightDtype::F32, None, Some(&t.state))
                    .map_err(js_err)?;
            let zip = archive::write(&files).map_err(js_err)?;
            Ok(JsValue::from(Uint8Array::from(zip.as_slice())))
        })
    }

    /// Samples from the model being trained from now on (its current weights, gated like any model).
    pub fn use_trained(&self, log: Function) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            let mut i = inner.borrow_mut();
            let (config, params) = {
                let t = i
                    .training
                    .as_ref()
                    .ok_or_else(|| js_err("no training run"))?;
                let (p, _, _) = t.trainer.read_state(&i.be).await.map_err(js_err)?;
                (t.config.clone(), p)
            };
            let gpt = gpt_from(&mut i, config, params, &log).await?;
            i.gpt = Some(gpt);
            Ok(JsValue::UNDEFINED)
        })
    }

    /// Loads a checkpoint archive (as downloaded) and samples from it.
    pub fn load_checkpoint(&self, zip: Vec<u8>, log: Function) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            let files = archive::read(&zip).map_err(js_err)?;
            let ck = checkpoint::decode(std::path::Path::new("upload"), &files).map_err(js_err)?;
            let mut i = inner.borrow_mut();
            let gpt = gpt_from(&mut i, ck.config, ck.params, &log).await?;
            let info = json!({"params": gpt.config.model.num_params(), "vocab": gpt.vocab.len()});
            i.gpt = Some(gpt);
            Ok(JsValue::from_str(&info.to_string()))
        })
    }

    /// Loads a GGUF model from its bytes on the f32 path and resolves to its description (JSON) at
    /// once. Where the adapter has fast paths, they are gated for this model in the background (op
    /// gates at its shapes, then the token gate, each log line to `log`, on a second device); when
    /// they finish, `on_gated` hears of it (JSON: the paths that passed, a status line) and the chat
    /// moves to them at its next token ([`Session::chat_send`]).
    pub fn load_gguf(
        &self,
        bytes: Vec<u8>,
        name: String,
        log: Function,
        on_gated: Function,
    ) -> Promise {
        let (inner, gating, loads) = (self.inner.clone(), self.gating.clone(), self.loads.clone());
        future_to_promise(async move {
            let file = GgufFile::from_bytes(bytes).map_err(|e| {
                js_err(format!(
                    "{name} is not a GGUF model this runner can read: {e}"
                ))
            })?;
            let file = Arc::new(file);
            let cfg = LlmConfig::from_gguf(&file).map_err(js_err)?;
            let tok = Tokenizer::from_gguf(file.metadata()).map_err(js_err)?;
            let mut i = inner.borrow_mut();
            let Inner {
                be,
                store,
                device,
                drift_every,
                ..
            } = &mut *i;
            let gate = device.as_ref().is_some_and(|d| !d.paths.is_empty());
            let opts = LoadOptions {
                context: Some(cfg.train_context.clamp(1, 2048)),
                paths: PathSet::F32,
                ..LoadOptions::default()
            };
            let llm = Llm::from_gguf(be, &file, &opts, &mut |_| {}).map_err(js_err)?;
            // The guard keeps the file: its f32 shadow is made from it at the first check, and the
            // model's weights are converted again from it if the guard trips. It checks only while
            // the model is on fast paths.
            let guard = (gate && *drift_every > 0).then(|| {
                DriftGuard::new(file.clone(), llm.context(), *drift_every, Some(1), false)
            });
            let load = loads.get() + 1;
            loads.set(load);
            if gate {
                *gating.borrow_mut() = Some(BackgroundGating {
                    load,
                    paths: None,
                    store: None,
                });
                spawn_local(gate_in_background(
                    GatingJob {
                        load,
                        file: file.clone(),
                        cfg: cfg.clone(),
                        prompt: tok.encode("The capital of France is", true),
                        tokens: tinygpt_models::gating::token_budget(be),
                        name: name.clone(),
                        store: store.clone(),
                    },
                    gating.clone(),
                    log,
                    on_gated,
                ));
            } else {
                *gating.borrow_mut() = None;
            }
            let template = match tok.chat_template() {
                Some(src) => Some(ChatTemplate::new(src).map_err(js_err)?),
                None => ChatTemplate::builtin(if tok.token_id("<start_of_turn>").is_some() {
                    "gemma"
                } else {
                    "chatml"
                })
                .ok(),
            };
            let info = json!({"name": name, "arch": cfg.arch.name(), "layers": cfg.n_layer,
                "vocab": cfg.vocab, "context": llm.context(),
                "weights_mb": llm.memory().weights as f64 / 1e6,
                "paths": llm.paths().iter().map(PathId::name).collect::<Vec<_>>(),
                "gating": gate});
            i.chat = Some(Chat {
                llm,
                tok,
                template,
                name,
                messages: Vec::new(),
                cached: Vec::new(),
                guard,
                file,
                load,
            });
            Ok(JsValue::from_str(&info.to_string()))
        })
    }

    /// Forgets the conversation.
    pub fn chat_reset(&self) {
        if let Some(c) = self.inner.borrow_mut().chat.as_mut() {
            c.messages.clear();
            c.cached.clear();
            c.llm.reset();
        }
    }

    /// Adds `message` to the conversation and streams the reply to `on_text`; resolves to the timings.
    pub fn chat_send(
        &self,
        message: String,
        max_tokens: usize,
        temperature: f32,
        seed: u64,
        on_text: Function,
    ) -> Promise {
        let (inner, stop, gating) = (self.inner.clone(), self.stop.clone(), self.gating.clone());
        stop.set(false);
        future_to_promise(async move {
            let sc = SamplerConfig {
                temperature,
                top_k: 40,
                top_p: 0.95,
                seed,
            };
            sc.validate().map_err(js_err)?;
            let mut i = inner.borrow_mut();
            let Inner {
                be, chat, store, ..
            } = &mut *i;
            let c = chat
                .as_mut()
                .ok_or_else(|| js_err("no GGUF model is loaded"))?;
            // Fast paths gated since the last reply take effect before the prompt.
            let mut moved = None;
            move_to_gated(&gating, store, be, &mut c.llm, &c.file, c.load, &mut moved)
                .map_err(js_err)?;
            let template = c
                .template
                .as_ref()
                .ok_or_else(|| js_err(format!("{} has no chat template", c.name)))?;
            c.messages.push(("user".into(), message));
            let text_of = |id: Option<u32>| {
                id.and_then(|i| c.tok.token_text(i))
                    .unwrap_or("")
                    .to_string()
            };
            let msgs: Vec<(&str, &str)> = c
                .messages
                .iter()
                .map(|(r, t)| (r.as_str(), t.as_str()))
                .collect();
            let prompt = template
                .render(
                    &msgs,
                    true,
                    &text_of(c.tok.bos_id()),
                    &text_of(c.tok.eos_id()),
                )
                .map_err(js_err)?;
            let ids = c.tok.encode_with(&prompt, true, true);
            if ids.len() >= c.llm.context() {
                c.messages.pop();
                return Err(js_err(format!(
                    "the conversation ({} tokens) no longer fits the context of {}: reset it",
                    ids.len(),
                    c.llm.context()
                )));
            }
            // Keep the cached prefix the new rendering shares (at least one token is always fed).
            let keep = c
                .cached
                .iter()
                .zip(&ids)
                .take_while(|(a, b)| a == b)
                .count()
                .min(ids.len() - 1);
            c.llm.truncate(keep);
            c.cached.truncate(keep);
            let t0 = Instant::now();
            c.llm.feed(be, &ids[keep..]).map_err(js_err)?;
            c.cached.extend_from_slice(&ids[keep..]);
            let prompt_secs = t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            let mut sampler = Sampler::new(sc);
            let mut text = c.tok.stream_decoder(false);
            let mut reply = String::new();
            let mut made = Vec::new();
            let tok = &c.tok;
            let mut drift = None;
            let (file, load) = (c.file.clone(), c.load);
            let g = tinygpt_models::llm::generate_watched(
                be,
                &mut c.llm,
                &mut sampler,
                max_tokens,
                |id| tok.is_eog(id),
                async |id| -> Result<bool, tinygpt_models::llm::LlmError> {
                    made.push(id);
                    let piece = text
                        .push(id)
                        .map_err(|e| tinygpt_models::llm::LlmError::Options(e.to_string()))?;
                    reply.push_str(&piece);
                    call(&on_text, piece);
                    if made.len().is_multiple_of(8) {
                        yield_now().await;
                    }
                    Ok(!stop.get())
                },
                c.guard.as_mut(),
                |e| drift = Some(drift_report(e)),
                // Between two tokens: the paths background gating passed, once it has.
                |llm| {
                    move_to_gated(&gating, store, be, llm, &file, load, &mut moved)
                        .map_err(|e| tinygpt_models::llm::LlmError::Options(e.to_string()))
                },
            )
            .await;
            let g = match g {
                Ok(g) => g,
                Err(e) => {
                    // The conversation stays as it was before this message: the model keeps the
                    // tokens known to be fed (none of this reply's), the message is dropped.
                    c.llm.truncate(c.cached.len());
                    c.messages.pop();
                    return Err(js_err(e));
                }
            };
            // Every token but the last was fed (an end-of-generation token never).
            let fed = c.llm.position() - c.cached.len();
            c.cached.extend_from_slice(&made[..fed]);
            let finish = match g.finish {
                tinygpt_models::llm::Finish::EndOfGeneration => "stop",
                tinygpt_models::llm::Finish::Stopped => "stopped",
                _ => "length",
            };
            let made = made.len();
            let tail = text.finish();
            reply.push_str(&tail);
            call(&on_text, tail);
            c.messages.push(("assistant".into(), reply));
            let secs = t1.elapsed().as_secs_f64();
            Ok(JsValue::from_str(
                &json!({"tokens": made, "seconds": secs, "prompt_tokens": ids.len() - keep,
                        "prompt_seconds": prompt_secs, "finish": finish,
                        "tokens_per_s": made as f64 / secs.max(1e-9), "drift": drift,
                        "drift_checks": c.guard.as_ref().map_or(0, |g| g.stats().checks),
                        "moved": moved,
                        "paths": c.llm.paths().iter().map(PathId::name).collect::<Vec<_>>()})
                .to_string(),
            ))
        })
    }
}

/// A runner for `params`, its paths gated end to end for this model.
async fn gpt_from(
    i: &mut Inner,
    config: CheckpointConfig,
    params: Vec<f32>,
    log: &Function,
) -> Result<Gpt, JsValue> {
    let Inner {
        be,
        store,
        device,
        drift_every,
        ..
    } = i;
    let cfg = &config.model;
    let paths = match device.as_ref() {
        Some(d) if !d.paths.is_empty() => {
            let gm = GptGate {
                cfg,
                vocab: &config.vocab,
                params: &params,
                tokens: tinygpt_models::gating::token_budget(be),
            };
            let opts = GateOptions {
                seed: 20261129,
                ..GateOptions::default()
            };
            gate_for_model(be, store, &gm, &opts, &mut |l| call(log, l))
                .await
                .map_err(js_err)?
                .paths
        }
        _ => PathSet::F32,
    };
    let runner = GptRunner::new(be, cfg, &params, paths).map_err(js_err)?;
    let guard = (!paths.is_empty() && *drift_every > 0)
        .then(|| GptDriftGuard::new(cfg, params, *drift_every, None, false));
    Ok(Gpt {
        runner,
        vocab: config.vocab.clone(),
        config,
        guard,
    })
}

/// What background gating needs of a model load (it owns all of it: the call that started it has
/// returned).
struct GatingJob {
    load: u64,
    file: Arc<GgufFile>,
    cfg: LlmConfig,
    prompt: Vec<u32>,
    tokens: usize,
    name: String,
    /// The verdicts stored when it started (it adds its own).
    store: MemoryStore,
}

/// Gates a model's fast paths on a device of its own (the same adapter, WebGPU's default limits),
/// then leaves the verdict for the chat ([`move_to_gated`]) and tells `on_gated`.
async fn gate_in_background(
    mut job: GatingJob,
    gating: Rc<RefCell<Option<BackgroundGating>>>,
    log: Function,
    on_gated: Function,
) {
    let t0 = Instant::now();
    call(
        &log,
        format!(
            "[ops] {}: answering on the f32 path while its fast paths are gated in the background",
            job.name
        ),
    );
    let opts = DeviceOptions {
        backend: BackendChoice::Gpu,
        low_end: true,
        ..DeviceOptions::default()
    };
    let result = match tinygpt_kernels::device::open(&opts).await {
        Ok((be, _)) => {
            let gate_model = GgufGate {
                file: &job.file,
                cfg: &job.cfg,
                prompt: job.prompt.clone(),
                name: job.name.clone(),
                tokens: job.tokens,
            };
            let gopts = GateOptions {
                seed: 20261129,
                ..GateOptions::default()
            };
            gate_for_model(&be, &mut job.store, &gate_model, &gopts, &mut |l| {
                call(&log, l)
            })
            .await
            .map(|g| g.paths)
            .map_err(|e| e.to_string())
        }
        Err(e) => Err(format!("no second WebGPU device to gate on ({e})")),
    };
    let secs = t0.elapsed().as_secs_f64();
    let line = match &result {
        Ok(p) if !p.is_empty() => format!(
            "fast paths gated in {secs:.1} s: {} — the chat moves to them at its next token",
            tinygpt_kernels::gate::pills(*p)
        ),
        Ok(_) => {
            format!("gated in {secs:.1} s: no fast path passed — the chat stays on the f32 path")
        }
        Err(e) => format!("gating failed ({e}) — the chat stays on the f32 path"),
    };
    call(&log, format!("[ops] {line}"));
    let current = {
        let mut g = gating.borrow_mut();
        match g.as_mut().filter(|g| g.load == job.load) {
            Some(g) => {
                g.paths = Some(result.clone());
                g.store = Some(std::mem::take(&mut job.store));
                true
            }
            None => false,
        }
    };
    if current {
        let paths = result.unwrap_or(PathSet::F32);
        call(
            &on_gated,
            json!({"paths": paths.iter().map(PathId::name).collect::<Vec<_>>(),
                   "seconds": secs, "line": line})
            .to_string(),
        );
    }
}

/// Moves the verdicts and records that background gating stored into the session's store.
fn absorb_gating(gating: &RefCell<Option<BackgroundGating>>, store: &mut MemoryStore) {
    if let Some(s) = gating.borrow_mut().as_mut().and_then(|g| g.store.take()) {
        store.verdicts.extend(s.verdicts);
        store.records.extend(s.records);
    }
}

/// If background gating for load `load` has finished, moves `llm` to the paths it passed (none:
/// it stays); `moved` then describes the move. True when the model moved (its next logits are then
/// those of the new paths after the same tokens).
fn move_to_gated(
    gating: &RefCell<Option<BackgroundGating>>,
    store: &mut MemoryStore,
    be: &Backend,
    llm: &mut Llm,
    file: &GgufFile,
    load: u64,
    moved: &mut Option<Value>,
) -> Result<bool, tinygpt_models::llm::LlmError> {
    let paths = {
        let mut g = gating.borrow_mut();
        match g.as_mut().filter(|g| g.load == load) {
            Some(g) => match g.paths.take() {
                Some(p) => p,
                None => return Ok(false),
            },
            None => return Ok(false),
        }
    };
    absorb_gating(gating, store);
    *gating.borrow_mut() = None;
    match paths {
        Ok(p) if !p.is_empty() => {
            let position = llm.position();
            llm.switch_paths(be, file, p)?;
            *moved = Some(json!({"position": position,
                "paths": p.iter().map(PathId::name).collect::<Vec<_>>()}));
            Ok(true)
        }
        _ => Ok(false),
    }
}
