//! The `tinygpt` command line.

mod bench;
mod device;
mod paths;
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
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// List the GPU adapters wgpu can open (the index and names `--adapter` takes).
    Adapters,
    /// Train the character-level GPT (default: nanoGPT's shakespeare-char recipe on the bundled text).
    Train(train::TrainArgs),
    /// Benchmarks: per-op throughput and training throughput.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
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
                println!("[{}] {} — {} {}, driver {} {}", a.index, a.name, a.backend, a.device_type, a.driver, a.driver_info);
            }
            Ok(())
        }
        Cmd::Train(a) => {
            let be = cli.device.open()?;
            train::run(&be, a)
        }
        Cmd::Bench(b) => {
            let be = cli.device.open()?;
            bench::run(&be, b)
        }
    }
}
