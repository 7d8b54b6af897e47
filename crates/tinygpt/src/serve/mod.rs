//! `tinygpt serve`: an OpenAI-compatible HTTP server (axum on tokio) in front of the continuous-batching
//! engine ([`engine`]), which also serves the browser playground.
//!
//! The socket is bound first and answers `/health` with 503 while the model loads on the engine thread;
//! then every route works. Each request is tokenized and checked here, queued (429 when the queue is
//! full), and streamed back from the engine's events.

mod api;
mod engine;
pub mod fuzzing;
mod http;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;

use crate::device::DeviceArgs;
use crate::gates::GateArgs;
use engine::{Codec, GptDecoder, LlmDecoder, Shared};
use tinygpt_models::chat_template::ChatTemplate;

/// `tinygpt serve`.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// A GGUF model (llama, gemma3, qwen2, qwen3, gpt2); without one, the bundled Shakespeare model
    /// (text completion only).
    pub model: Option<PathBuf>,
    /// Address to listen on. Anything but loopback exposes the server to the network.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every /v1 route.
    #[arg(long, env = "TINYGPT_API_KEY", conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// Read the API key from this file (its first line).
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// Requests decoded together (slots); default from the cores and memory.
    #[arg(long)]
    pub parallel: Option<usize>,
    /// Requests that may wait for a slot before new ones get 429 (default: 4 x parallel).
    #[arg(long)]
    pub queue: Option<usize>,
    /// Context (KV cache positions) of each slot (default: the model's, at most 4096).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Allow cross-origin requests from these origins (CORS is off otherwise).
    #[arg(long = "cors-origin")]
    pub cors_origin: Vec<String>,
    /// Longest a request may run, in seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body: usize,
    /// The playground's files (default: web/dist beside the binary's repository, built by
    /// scripts/build-web.sh).
    #[arg(long)]
    pub web_dir: Option<PathBuf>,
}

/// What the HTTP side knows of the loaded model.
pub struct ModelInfo {
    /// The id clients name in `model` (the file's name, or "shakespeare-char").
    pub id: String,
    pub codec: Arc<Codec>,
    pub template: Option<ChatTemplate>,
    pub bos: String,
    pub eos: String,
    /// Positions a request may use (prompt + completion); usize::MAX for the sliding char model.
    pub context: usize,
    pub parallel: usize,
    /// The fast paths active when the model was ready (see `Shared::paths` for now).
    pub pills: Vec<String>,
    /// Fast paths are being gated in the background (the f32 path serves until they pass).
    pub gating: bool,
    pub created: u64,
}

fn read_key(a: &ServeArgs) -> Result<Option<String>> {
    if let Some(k) = &a.api_key {
        if k.is_empty() {
            bail!("--api-key is empty");
        }
        return Ok(Some(k.clone()));
    }
    let Some(p) = &a.api_key_file else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(p)
        .with_context(|| format!("cannot read --api-key-file {}", p.display()))?;
    let key = text.lines().next().unwrap_or("").trim().to_string();
    if key.is_empty() {
        bail!(
            "--api-key-file {} holds no key on its first line",
            p.display()
        );
    }
    Ok(Some(key))
}

/// Default slots: a few per core on the CPU backend, 16 on a GPU; never more than the memory the
/// caches need allows (a quarter of the machine's memory on the CPU, 4 GiB on a GPU).
fn default_parallel(cpu: bool, seq_bytes: u64) -> usize {
    let want = if cpu {
        (4 * std::thread::available_parallelism().map_or(2, |n| n.get())).min(16)
    } else {
        16
    };
    let budget = if cpu {
        crate::llm_common::total_memory().unwrap_or(8 << 30) / 4
    } else {
        4 << 30
    };
    want.min((budget / seq_bytes.max(1)) as usize).max(1)
}

/// Loads the model on this thread (the engine's), then runs it until the server stops.
fn engine_thread(
    device: DeviceArgs,
    gate: GateArgs,
    a: ServeArgs,
    jobs: std::sync::mpsc::Receiver<engine::Job>,
    shared: Arc<Shared>,
    ready: tokio::sync::oneshot::Sender<Result<ModelInfo>>,
) {
    let mut ready = Some(ready);
    let result = (|| -> Result<()> {
        let be = device.open()?;
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        match &a.model {
            Some(path) => {
                let args = crate::llm_common::ModelArgs {
                    model: path.clone(),
                    ctx: a.ctx,
                };
                let cpu = be.as_gpu().is_none();
                let (m, parallel) =
                    crate::llm_common::load_for_serving(&be, &gate, &args, |seq| {
                        a.parallel.unwrap_or_else(|| default_parallel(cpu, seq))
                    })?;
                let template = match &m.chat_template {
                    Some(src) => Some(ChatTemplate::new(src).context("the model's chat template")?),
                    None => crate::chat::builtin_template(&m.tok).ok(),
                };
                let text_of = |id: Option<u32>| {
                    id.and_then(|i| m.tok.token_text(i))
                        .unwrap_or("")
                        .to_string()
                };
                let info = ModelInfo {
                    id: m.name.clone(),
                    bos: text_of(m.tok.bos_id()),
                    eos: text_of(m.tok.eos_id()),
                    context: m.llm.context(),
                    parallel,
                    pills: m.llm.paths().iter().map(|p| p.pill().to_string()).collect(),
                    gating: m.gating.is_some(),
                    template,
                    codec: Arc::new(Codec::Bpe(m.tok)),
                    created,
                };
                let codec = info.codec.clone();
                if let Some(g) = &m.guard {
                    eprintln!(
                        "[ops] drift guard: every {} tokens of each request, one step again on the f32 path",
                        g.every()
                    );
                }
                let guard = m.guard.map(|g| (g, m.name.clone()));
                let mut d = LlmDecoder::new(m.llm, m.gating, guard);
                if let Some(r) = ready.take() {
                    let _ = r.send(Ok(info));
                }
                engine::run(&be, &mut d, &codec, parallel, jobs, &shared)
            }
            None => {
                let (runner, vocab, paths, guard) = crate::generate::load_runner(&be, &gate, None)?;
                if let Some(g) = &guard {
                    eprintln!(
                        "[ops] drift guard: every {} tokens of each request, one step again on the f32 path",
                        g.every()
                    );
                }
                let parallel = a.parallel.unwrap_or(4);
                let info = ModelInfo {
                    id: "shakespeare-char".into(),
                    bos: String::new(),
                    eos: String::new(),
                    context: usize::MAX,
                    parallel,
                    pills: paths.iter().map(|p| p.pill().to_string()).collect(),
                    gating: false,
                    template: None,
                    codec: Arc::new(Codec::Chars(vocab)),
                    created,
                };
                let codec = info.codec.clone();
                let mut d = GptDecoder::new(runner, guard);
                if let Some(r) = ready.take() {
                    let _ = r.send(Ok(info));
                }
                engine::run(&be, &mut d, &codec, parallel, jobs, &shared)
            }
        }
    })();
    if let Err(e) = result {
        match ready.take() {
            Some(r) => {
                let _ = r.send(Err(e));
            }
            None => eprintln!("error: the model thread stopped: {e:#}"),
        }
    }
}

/// `tinygpt serve`.
pub fn run(device: &DeviceArgs, gate: &GateArgs, a: &ServeArgs) -> Result<()> {
    let key = read_key(a)?;
    if let Some(m) = &a.model
        && !m.is_file()
    {
        bail!("{}: no such model file", m.display());
    }
    if a.parallel == Some(0) {
        bail!("--parallel must be at least 1");
    }
    if a.queue == Some(0) {
        bail!("--queue must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(serve(device.clone(), gate.clone(), a.clone(), key))
}

async fn serve(
    device: DeviceArgs,
    gate: GateArgs,
    a: ServeArgs,
    key: Option<String>,
) -> Result<()> {
    let addr = SocketAddr::new(a.host, a.port);
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| {
        format!("cannot listen on {addr} (is another server using the port? --port picks another)")
    })?;
    let local = listener.local_addr()?;
    if !a.host.is_loopback() {
        eprintln!(
            "WARNING: listening on {local}, which is not loopback: anyone who can reach this machine can \
             use the model{}",
            if key.is_none() {
                " — and no --api-key is set"
            } else {
                ""
            }
        );
    }
    eprintln!(
        "tinygpt serve: listening on http://{local} (loading the model; /health says when ready)"
    );
    let shared = Arc::new(Shared::default());
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let state = http::AppState::new(shared.clone(), key, &a);
    let app = http::router(state.clone(), &a)?;
    let server = tokio::spawn({
        let shared = shared.clone();
        async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown_signal(shared))
                .await
        }
    });
    // The queue is bounded where requests enter it (429 past --queue), so the channel itself is not.
    let (job_tx, job_rx) = std::sync::mpsc::channel();
    // The engine's CPU work (the CPU backend's kernels, sampling) runs in a pool as large as the one
    // the program runs in (`--threads`), not in rayon's global pool of every core.
    let threads = rayon::current_num_threads();
    let engine = std::thread::Builder::new()
        .name("tinygpt-engine".into())
        .spawn({
            let (shared, a) = (shared.clone(), a.clone());
            move || {
                let run = move || engine_thread(device, gate, a, job_rx, shared, ready_tx);
                match rayon::ThreadPoolBuilder::new().num_threads(threads).build() {
                    Ok(pool) => pool.install(run),
                    Err(_) => run(),
                }
            }
        })?;
    let info = match ready_rx.await {
        Ok(Ok(info)) => info,
        Ok(Err(e)) => {
            shared.stopping.store(true, Ordering::Relaxed);
            return Err(e);
        }
        Err(_) => bail!("the model thread stopped before the model was loaded"),
    };
    let parallel = info.parallel;
    let queue = a.queue.unwrap_or(4 * parallel);
    // Requests are taken before the line that says so (a client may act on it at once).
    let line = format!(
        "ready: model {} · {} slots (queue {queue}) · context {} per slot · {}",
        info.id,
        parallel,
        if info.context == usize::MAX {
            "sliding".to_string()
        } else {
            info.context.to_string()
        },
        match (info.pills.is_empty(), info.gating) {
            (_, true) => "f32 path · gating the fast paths in the background".to_string(),
            (true, false) => "f32 path".to_string(),
            (false, false) => info.pills.join(" "),
        }
    );
    state.set_ready(info, job_tx, queue);
    shared.ready.store(true, Ordering::Relaxed);
    eprintln!("{line}");
    let served = server.await?;
    shared.stopping.store(true, Ordering::Relaxed);
    state.close_queue();
    // The engine ends every stream with an error chunk and stops within a step.
    let _ = tokio::task::spawn_blocking(move || engine.join()).await;
    served.context("the HTTP server failed")?;
    eprintln!("tinygpt serve: stopped");
    Ok(())
}

/// Resolves on SIGINT or SIGTERM; tells the engine to end the streams it holds.
async fn shutdown_signal(shared: Arc<Shared>) {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("tinygpt serve: stopping (ending open streams)");
    shared.stopping.store(true, Ordering::Relaxed);
    // Streams end with the engine's error chunk; give them a moment, then let axum close the rest.
    tokio::time::sleep(Duration::from_millis(200)).await;
}
