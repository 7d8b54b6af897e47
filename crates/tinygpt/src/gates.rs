//! Running the numerics gate for a command: the cache of passed gates and the local telemetry report
//! (both JSON in the user's cache directory; nothing leaves the machine), the `tinygpt gates` command,
//! and the end-to-end token gate.

use anyhow::Result;
use clap::Args;
use std::collections::HashMap;
use std::path::PathBuf;
use tinygpt_kernels::Backend;
use tinygpt_kernels::gate::{
    GateCase, GateOptions, GateSummary, PathId, PathReport, Status, first_divergence, run_gates,
};

/// Flags every command that runs kernels takes.
#[derive(Args, Clone, Debug, Default)]
pub struct GateArgs {
    /// Re-run every fast path's gate instead of trusting cached passes.
    #[arg(long, global = true)]
    pub regate: bool,
    /// Use only the canonical f32 kernels (no fast path is gated or used).
    #[arg(long, global = true, env = "TINYGPT_F32_ONLY")]
    pub f32_only: bool,
    /// Fast paths not to use, by name (f16-storage, shader-f16, subgroups, coop-matrix, q8-matmul).
    #[arg(
        long,
        global = true,
        env = "TINYGPT_DISABLE_PATHS",
        value_delimiter = ','
    )]
    pub disable_path: Vec<String>,
}

/// `tinygpt gates`.
#[derive(Args, Debug)]
pub struct GatesCmd {
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

fn cache_dir() -> Option<PathBuf> {
    std::env::var_os("TINYGPT_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|d| d.join("tinygpt")))
}

fn read_cache() -> HashMap<String, PathReport> {
    cache_dir()
        .and_then(|d| std::fs::read(d.join("gate-cache.json")).ok())
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Writes `bytes` next to the cache atomically; a failure to write is reported, never fatal.
fn write_file(name: &str, bytes: &[u8]) {
    let Some(dir) = cache_dir() else { return };
    let result = std::fs::create_dir_all(&dir)
        .map_err(anyhow::Error::from)
        .and_then(|_| {
            Ok(tinygpt_models::gpt::checkpoint::write_atomic(
                &dir.join(name),
                bytes,
            )?)
        });
    if let Err(e) = result {
        eprintln!("note: could not write {}: {e:#}", dir.join(name).display());
    }
}

/// Gates the fast paths for this run (with the model's own shapes added), prints the log lines, updates
/// the cache and the telemetry report, and returns the summary (None on the CPU backend).
pub fn prepare(be: &Backend, args: &GateArgs, model_cases: Vec<GateCase>) -> Option<GateSummary> {
    let g = be.as_gpu()?;
    if args.f32_only {
        for p in PathId::ALL {
            g.set_path_active(p, false);
        }
        eprintln!("[ops] fast paths off (--f32-only): canonical f32 kernels only");
        return None;
    }
    let mut cache = read_cache();
    for name in &args.disable_path {
        if !PathId::ALL.iter().any(|p| p.name() == name) {
            eprintln!(
                "note: --disable-path {name}: no such fast path (known: f16-storage, shader-f16, subgroups, coop-matrix, q8-matmul)"
            );
        }
    }
    let only: Vec<PathId> = PathId::ALL
        .into_iter()
        .filter(|p| !args.disable_path.iter().any(|d| d == p.name()))
        .collect();
    for p in PathId::ALL {
        g.set_path_active(p, false);
    }
    let opts = GateOptions {
        only: Some(only),
        extra_cases: model_cases,
        cached: cache.clone(),
        regate: args.regate,
        seed: 20261129,
        ..GateOptions::default()
    };
    let summary = run_gates(be, &opts);
    for r in &summary.reports {
        eprintln!("{}", r.log_line());
    }
    for r in &summary.reports {
        if r.status == Status::Active {
            cache.insert(r.cache_key.clone(), r.clone());
        } else {
            cache.remove(&r.cache_key);
        }
    }
    write_file(
        "gate-cache.json",
        &serde_json::to_vec_pretty(&cache).unwrap_or_default(),
    );
    let report = serde_json::json!({
        "time_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "adapter": summary.adapter,
        "driver": summary.driver,
        "gate_ms": summary.millis,
        "paths": summary.reports,
    });
    write_file(
        "gate-report.json",
        &serde_json::to_vec_pretty(&report).unwrap_or_default(),
    );
    Some(summary)
}

/// One-line list of the paths in use, for status lines.
pub fn pills(be: &Backend) -> String {
    match be.as_gpu() {
        None => "f32 path".into(),
        Some(g) => {
            let v: Vec<&str> = g.active_paths().iter().map(|p| p.pill()).collect();
            if v.is_empty() {
                "f32 path".into()
            } else {
                v.join(" ")
            }
        }
    }
}

/// A stable 64-bit FNV-1a hash (of a model's parameters, for the token gate's cache key).
pub fn fnv1a(words: impl IntoIterator<Item = u32>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for w in words {
        for b in w.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The end-to-end token gate: `greedy` produces the first tokens of a fixed prompt with whatever paths
/// are active. Compares the fast paths against the f32 path, all together and then one by one when
/// they diverge, and switches off every path whose tokens leave the f32 path's. The verdict is cached
/// under the adapter, driver, the active paths' kernel versions and `model_key` (which must identify
/// the weights and the prompt), so a later start with the same model skips it; `--regate` re-runs it.
pub fn token_gate(
    be: &Backend,
    args: &GateArgs,
    model_key: &str,
    mut greedy: impl FnMut(&Backend) -> Result<Vec<u32>>,
) -> Result<()> {
    let Some(g) = be.as_gpu() else { return Ok(()) };
    let active = g.active_paths();
    if active.is_empty() {
        return Ok(());
    }
    let set = |on: &[PathId]| {
        PathId::ALL
            .iter()
            .for_each(|p| g.set_path_active(*p, on.contains(p)))
    };
    let i = g.info();
    let versions: Vec<String> = active
        .iter()
        .map(|p| {
            format!(
                "{}v{}",
                p.name(),
                tinygpt_kernels::gate::paths::def(*p).kernel_version
            )
        })
        .collect();
    let key = format!(
        "{}|{}|{}|{}|{model_key}",
        i.name,
        i.driver,
        i.driver_info,
        versions.join(",")
    );
    let mut cache: HashMap<String, Vec<String>> = cache_dir()
        .and_then(|d| std::fs::read(d.join("token-gate-cache.json")).ok())
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    if !args.regate
        && let Some(kept) = cache.get(&key)
    {
        let keep: Vec<PathId> = active
            .iter()
            .copied()
            .filter(|p| kept.iter().any(|k| k == p.name()))
            .collect();
        set(&keep);
        eprintln!(
            "[ops] token gate: cached verdict for this model and adapter — {}",
            if keep.len() == active.len() {
                "PASS".to_string()
            } else {
                format!("{} of {} paths kept", keep.len(), active.len())
            }
        );
        return Ok(());
    }
    set(&[]);
    let reference = greedy(be)?;
    set(&active);
    let fast = greedy(be)?;
    let keep = match first_divergence(&reference, &fast) {
        None => {
            eprintln!(
                "[ops] token gate: {} greedy tokens identical on the f32 and fast paths — PASS",
                reference.len()
            );
            active.clone()
        }
        Some(pos) => {
            eprintln!(
                "[ops] token gate: fast paths diverge from the f32 path at token {pos} — checking each path"
            );
            let mut keep = Vec::new();
            for p in &active {
                // Paths that need another path are checked together with it.
                let with: Vec<PathId> = keep.iter().copied().chain([*p]).collect();
                set(&with);
                let t = greedy(be)?;
                match first_divergence(&reference, &t) {
                    None => keep.push(*p),
                    Some(at) => eprintln!(
                        "[ops] token gate: {} diverges at token {at} — FAIL, falling back to f32 for it",
                        p.name()
                    ),
                }
            }
            keep
        }
    };
    set(&keep);
    cache.insert(key, keep.iter().map(|p| p.name().to_string()).collect());
    write_file(
        "token-gate-cache.json",
        &serde_json::to_vec_pretty(&cache).unwrap_or_default(),
    );
    Ok(())
}

/// `tinygpt gates`: gate every path on the selected adapter and show the pills.
pub fn run(be: &Backend, args: &GateArgs, cmd: &GatesCmd) -> Result<()> {
    let summary = match prepare(be, args, Vec::new()) {
        Some(s) => s,
        None => {
            if cmd.json {
                println!(
                    "{}",
                    serde_json::json!({"backend": be.describe(), "paths": []})
                );
            } else {
                println!(
                    "{}: no fast paths to gate (they are GPU kernels)",
                    be.describe()
                );
            }
            return Ok(());
        }
    };
    if cmd.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
        return Ok(());
    }
    println!("{}", be.describe());
    let pills: Vec<String> = summary.reports.iter().map(|r| r.pill_text()).collect();
    println!("{}", pills.join("  "));
    println!(
        "gates took {:.0} ms{}",
        summary.millis,
        if summary
            .reports
            .iter()
            .all(|r| r.from_cache || r.status == Status::Unsupported)
        {
            " (all from cache)"
        } else {
            ""
        }
    );
    if let Some(d) = cache_dir() {
        println!("report: {}", d.join("gate-report.json").display());
    }
    Ok(())
}
