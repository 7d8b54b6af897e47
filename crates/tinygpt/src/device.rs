//! Opening the backend the user asked for, and saying which one it is.

use clap::Args;
use tinygpt_kernels::Backend;
use tinygpt_kernels::device::{BackendChoice, DeviceOptions, open};

/// Where to run: flags shared by every command (each also read from an environment variable).
#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// cpu, gpu, or auto (a GPU adapter when one opens, else the CPU backend).
    #[arg(long, global = true, env = "TINYGPT_BACKEND", default_value = "auto")]
    pub backend: BackendChoice,
    /// GPU adapter by index (see `tinygpt adapters`) or by part of its name.
    #[arg(long, global = true, env = "TINYGPT_ADAPTER")]
    pub adapter: Option<String>,
    /// Ask the GPU for WebGPU's default limits only (128 MiB bindings), as the weakest adapters give.
    #[arg(long, global = true, env = "TINYGPT_LOW_END", value_parser = clap::builder::FalseyValueParser::new())]
    pub low_end: bool,
    /// Compile the GPU kernels with naga's runtime checks (indices clamped, loops bounded), as a
    /// browser's WebGPU does: slower; for telling whether a wrong result comes from a kernel reading out
    /// of range on this driver.
    #[arg(long, global = true, env = "TINYGPT_SHADER_CHECKS", value_parser = clap::builder::FalseyValueParser::new())]
    pub shader_checks: bool,
    /// Threads for the CPU backend (default: all cores).
    #[arg(long, global = true, env = "TINYGPT_THREADS")]
    pub threads: Option<usize>,
}

impl DeviceArgs {
    pub fn options(&self) -> DeviceOptions {
        DeviceOptions {
            backend: self.backend,
            adapter: self.adapter.clone(),
            low_end: self.low_end,
            max_binding_override: None,
            shader_checks: self.shader_checks,
            // The whole program already runs inside a pool of `--threads` threads (see main).
            cpu_threads: None,
        }
    }

    /// Opens the backend; prints one line when falling back to the CPU.
    pub fn open(&self) -> anyhow::Result<Backend> {
        let (be, note) = pollster::block_on(open(&self.options()))?;
        if let Some(n) = note {
            eprintln!("note: {n}");
        }
        Ok(be)
    }
}
