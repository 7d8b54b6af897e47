//! The `tinygpt` command line, as a library: the binary is `main` around [`main`]; the server's request
//! handling is also reachable from outside for fuzzing ([`serve::fuzzing`]).

mod background_gate;
mod bench;
mod chat;
mod device;
mod export;
mod gates;
mod generate;
mod llm_common;
mod paths;
mod perplexity;
mod plot;
mod run;
pub mod serve;
mod synthetic;
mod train;

use anyhow::Result;
use clap::{Parser, Subcommand};
use device::DeviceArgs;

/// TinyGPT: train, sample and run small language models on any GPU, or none.
#[derive(Parser, Debug)]
#[command(name = "tinygpt", version, about)]
struct Cli {
    #[command(flatten)]
    device: DeviceArgs,
    #[command(flatten)]
    gate: gates::GateArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// List the GPU adapters wgpu can open (the index and names `--adapter` takes).
    Adapters,
    /// The selected device: adapter, driver, features and the limits requested from it (JSON).
    Info,
    /// Gate every fast path on the selected adapter and show which are in use (capability pills).
    Gates(gates::GatesCmd),
    /// Train the character-level GPT (default: nanoGPT's shakespeare-char recipe on the bundled text).
    Train(train::TrainArgs),
    /// Sample from a trained char-level GPT (default: the bundled Shakespeare model).
    Generate(generate::GenerateArgs),
    /// Validation loss of a trained char-level GPT.
    Eval(generate::EvalArgs),
    /// Export a char-level GPT as a GGUF file (llama.cpp's gpt2 architecture) or a Hugging Face GPT-2
    /// directory.
    Export(export::ExportArgs),
    /// Continue a prompt with a GGUF model (llama, gemma3, qwen2, qwen3, gpt2), streaming the text.
    Run(run::RunArgs),
    /// Chat with a GGUF model on stdin, using its chat template.
    Chat(chat::ChatArgs),
    /// Perplexity of a text under a GGUF model (llama.cpp's method: chunks of -c tokens, the second
    /// half of each scored).
    Perplexity(perplexity::PerplexityArgs),
    /// An OpenAI-compatible HTTP server (chat and text completions, continuous batching) that also
    /// serves the browser playground.
    Serve(serve::ServeArgs),
    /// Draw (again) the loss curve of a checkpoint directory into DIR/loss.png.
    Plot {
        /// Checkpoint directory (default: the bundled Shakespeare model).
        dir: Option<std::path::PathBuf>,
    },
    /// Benchmarks: per-op throughput and training throughput.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
}

/// Parses the command line, runs the command and exits with its status.
pub fn main() {
    // Mesa's Vulkan loader tries to reach a Wayland compositor while wgpu probes adapters and prints
    // "XDG_RUNTIME_DIR is invalid" on headless machines; pointing it at the temp dir keeps the output
    // clean. Safe: nothing else runs yet (no threads), as `set_var` requires.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
    }
    let cli = Cli::parse();
    // Everything runs inside one rayon pool: the CPU backend's ops then split work across it without
    // handing each call over from an outside thread (which costs microseconds per op, and a decode
    // step makes hundreds of them).
    let mut pool = rayon::ThreadPoolBuilder::new();
    if let Some(n) = cli.device.threads {
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        if n == 0 || n > cores {
            eprintln!(
                "error: --threads {n}: this machine runs 1 to {cores} threads (leave it out to use all {cores})"
            );
            std::process::exit(2);
        }
        pool = pool.num_threads(n);
    }
    let result = match pool.build() {
        Ok(p) => p.install(|| run(cli)),
        Err(_) => run(cli),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match &cli.cmd {
        Cmd::Adapters => {
            let list = pollster::block_on(tinygpt_kernels::device::list_adapters());
            if list.is_empty() {
                println!("no GPU adapters (the CPU backend is always available: --backend cpu)");
            }
            for a in list {
                println!(
                    "[{}] {} — {} {}, driver {} {}",
                    a.index, a.name, a.backend, a.device_type, a.driver, a.driver_info
                );
            }
            Ok(())
        }
        Cmd::Info => {
            let be = cli.device.open()?;
            let info = match be.as_gpu() {
                Some(g) => serde_json::to_value(g.info())?,
                None => serde_json::json!({ "backend": be.describe() }),
            };
            println!("{}", serde_json::to_string_pretty(&info)?);
            Ok(())
        }
        Cmd::Gates(c) => {
            if let Some(r) = gates::history_only(c) {
                return r;
            }
            let be = cli.device.open()?;
            gates::run(&be, &cli.gate, c)
        }
        Cmd::Train(a) => {
            let be = cli.device.open()?;
            train::run(&be, &cli.gate, a)
        }
        Cmd::Generate(a) => {
            let be = cli.device.open()?;
            generate::generate(&be, &cli.gate, a)
        }
        Cmd::Eval(a) => {
            let be = cli.device.open()?;
            generate::eval(&be, &cli.gate, a)
        }
        Cmd::Export(a) => export::run(a),
        Cmd::Run(a) => {
            let be = cli.device.open()?;
            run::run(&be, &cli.gate, a)
        }
        Cmd::Chat(a) => {
            let be = cli.device.open()?;
            chat::run(&be, &cli.gate, a)
        }
        Cmd::Perplexity(a) => {
            let be = cli.device.open()?;
            perplexity::run(&be, &cli.gate, a)
        }
        // The server opens the device on its model thread (GPU handles stay on one thread).
        Cmd::Serve(a) => serve::run(&cli.device, &cli.gate, a),
        Cmd::Plot { dir } => {
            let dir = dir
                .clone()
                .unwrap_or_else(|| paths::bundled(paths::DEFAULT_MODEL));
            let p = dir.join("train_state.json");
            let state: tinygpt_models::gpt::checkpoint::TrainState = serde_json::from_slice(
                &std::fs::read(&p)
                    .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", p.display()))?,
            )
            .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
            let png = dir.join("loss.png");
            plot::write_loss_png(
                &png,
                "TinyGPT training",
                &state.train_losses,
                &state.val_losses,
            )?;
            println!("wrote {}", png.display());
            Ok(())
        }
        Cmd::Bench(b) => {
            let be = cli.device.open()?;
            bench::run(&be, &cli.gate, b)
        }
    }
}
