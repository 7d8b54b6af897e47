//! Gating that never holds the first token hostage. A model whose gate verdicts are all stored is
//! gated at once, as before (it costs nothing). Otherwise it starts on the canonical f32 path and a
//! thread of its own gates the fast paths — op gates at the model's shapes, then the token gate — on a
//! second device of the same adapter, printing its progress; between two tokens, the model moves to
//! the paths that passed ([`Llm::switch_paths`]), and the verdicts are stored for the next start.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{Context, Result};
use tinygpt_formats::GgufFile;
use tinygpt_kernels::device::{DeviceOptions, open_gpu};
use tinygpt_kernels::gate::{GateOptions, gate_for_model, pills};
use tinygpt_kernels::{Backend, PathSet};
use tinygpt_models::gating::GgufGate;
use tinygpt_models::llm::{Llm, LlmConfig};

use crate::gates::FileStore;

/// What the gating thread says.
enum Msg {
    /// A gate's log line, as it is decided.
    Line(String),
    /// The paths that passed every gate, or why gating failed.
    Done(std::result::Result<PathSet, String>),
}

/// Fast paths being gated on a thread of their own while the model serves on the f32 path.
pub struct BackgroundGate {
    rx: Receiver<Msg>,
    handle: Option<JoinHandle<()>>,
    /// The model file (its weights are converted again from it when the model switches).
    path: PathBuf,
    started: Instant,
}

/// What [`BackgroundGate::poll`] found.
pub enum Verdict {
    /// Still gating.
    Pending,
    /// Gating finished: the paths to use (possibly none), or why gating failed.
    Done(std::result::Result<PathSet, String>),
}

impl BackgroundGate {
    /// Starts gating the model in `path` (tokenized prompt `prompt`, `tokens` greedy tokens for the
    /// token gate) on a new device opened with `device`, under `opts`.
    pub fn start(
        device: DeviceOptions,
        opts: GateOptions,
        path: &Path,
        prompt: Vec<u32>,
        name: String,
        tokens: usize,
    ) -> BackgroundGate {
        let (tx, rx) = mpsc::channel();
        let file_path = path.to_path_buf();
        let handle = std::thread::Builder::new()
            .name("tinygpt-gate".into())
            .spawn(move || {
                let run = || -> Result<PathSet> {
                    // GPU handles stay on the thread that opened them: this thread has its own device.
                    let g = pollster::block_on(open_gpu(&device))
                        .context("opening a second device on the adapter to gate on")?;
                    let be = Backend::Gpu(g);
                    let file = GgufFile::open(&file_path).context("cannot open the model")?;
                    let cfg = LlmConfig::from_gguf(&file)?;
                    let model = GgufGate {
                        file: &file,
                        cfg: &cfg,
                        prompt,
                        name,
                        tokens,
                    };
                    let mut store = FileStore::open();
                    let tx = tx.clone();
                    let gated = pollster::block_on(gate_for_model(
                        &be,
                        &mut store,
                        &model,
                        &opts,
                        &mut |l| {
                            let _ = tx.send(Msg::Line(l.to_string()));
                        },
                    ))?;
                    Ok(gated.paths)
                };
                let _ = tx.send(Msg::Done(run().map_err(|e| format!("{e:#}"))));
            })
            .expect("a thread can be started");
        BackgroundGate {
            rx,
            handle: Some(handle),
            path: path.to_path_buf(),
            started: Instant::now(),
        }
    }

    /// Prints the gate's new lines and says whether it has finished (waiting for it if `wait`).
    fn receive(&mut self, wait: bool) -> Verdict {
        loop {
            let msg = if wait {
                self.rx.recv().map_err(|_| TryRecvError::Disconnected)
            } else {
                self.rx.try_recv()
            };
            match msg {
                Ok(Msg::Line(l)) => eprintln!("{l}"),
                Ok(Msg::Done(v)) => {
                    if let Some(h) = self.handle.take() {
                        let _ = h.join();
                    }
                    return Verdict::Done(v);
                }
                Err(TryRecvError::Empty) => return Verdict::Pending,
                Err(TryRecvError::Disconnected) => {
                    return Verdict::Done(Err("the gating thread stopped".into()));
                }
            }
        }
    }

    /// Takes what the gate has decided so far, without waiting.
    pub fn poll(&mut self) -> Verdict {
        self.receive(false)
    }

    /// Waits for the gate to finish.
    pub fn wait(&mut self) -> std::result::Result<PathSet, String> {
        match self.receive(true) {
            Verdict::Done(v) => v,
            Verdict::Pending => unreachable!("a waiting receive ends with the verdict"),
        }
    }

    /// Seconds since gating started.
    pub fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Moves `llm` (on the f32 path) to the paths the gate passed, saying so (`at`: where in the
    /// work it moves, "at position 12"); true when it moved.
    pub fn apply(
        &self,
        be: &Backend,
        llm: &mut Llm,
        verdict: std::result::Result<PathSet, String>,
        at: &str,
    ) -> Result<bool> {
        let secs = self.elapsed();
        match verdict {
            Ok(paths) if !paths.is_empty() => {
                let t = Instant::now();
                let file = GgufFile::open(&self.path).context("cannot open the model")?;
                llm.switch_paths(be, &file, paths)?;
                be.sync()?;
                eprintln!(
                    "[ops] fast paths gated in {secs:.1} s: {} — the model moves to them {at} \
                     (in {:.1} s; the f32 path served until now)",
                    pills(paths),
                    t.elapsed().as_secs_f64()
                );
                Ok(true)
            }
            Ok(_) => {
                eprintln!(
                    "[ops] gated in {secs:.1} s: no fast path passed — the model stays on the f32 path"
                );
                Ok(false)
            }
            Err(e) => {
                eprintln!("[ops] gating failed ({e}) — the model stays on the f32 path");
                Ok(false)
            }
        }
    }
}
