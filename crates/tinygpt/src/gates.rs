//! The numerics gate for a command: the flags, the verdict store in the user's cache directory (JSON
//! files; nothing leaves the machine), and `tinygpt gates`. The gate itself — op gates, token gate,
//! registry — lives in `tinygpt_kernels::gate`; this file only decides where verdicts are kept and
//! prints what the gate says.

use anyhow::{Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use tinygpt_kernels::gate::{
    GateModel, GateOptions, GateRecord, Gated, VerdictStore, gate_device, gate_for_model, registry,
};
use tinygpt_kernels::{Backend, PathId, PathSet};
use tinygpt_models::gpt::train_gate::{GateRun, TrainGateReport, training_gate};

/// Flags every command that runs kernels takes.
#[derive(Args, Clone, Debug)]
pub struct GateArgs {
    /// Re-run every fast path's gate instead of trusting stored passes.
    #[arg(long, global = true)]
    pub regate: bool,
    /// Use only the canonical f32 kernels (no fast path is gated or used).
    #[arg(long, global = true, env = "TINYGPT_F32_ONLY", value_parser = clap::builder::FalseyValueParser::new())]
    pub f32_only: bool,
    /// Fast paths not to use, by name (see `tinygpt gates`).
    #[arg(
        long,
        global = true,
        env = "TINYGPT_DISABLE_PATHS",
        value_delimiter = ','
    )]
    pub disable_path: Vec<String>,
    /// While a model generates on fast paths (`run`, `chat`, `serve`, `generate`), compute one step every
    /// N tokens on the f32 path too (from the same cache) and go on on the f32 path if the two disagree
    /// past the gate's bound (0: off).
    #[arg(long, global = true, value_name = "N", default_value_t = tinygpt_models::llm::drift::DEFAULT_EVERY)]
    pub drift_check: usize,
    /// Threads the drift guard's f32 shadow computes on (on the CPU, beside the decoding). Default: 1.
    #[arg(long, global = true, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    pub drift_threads: Option<u16>,
}

impl GateArgs {
    /// The shadow's threads when `--drift-threads` names them (None: the guard's default).
    pub fn shadow_threads(&self) -> Option<usize> {
        self.drift_threads.map(usize::from)
    }
}

/// `tinygpt gates`.
#[derive(Args, Debug)]
pub struct GatesCmd {
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
    /// Summarise the local gate history (every gating run this machine recorded in the cache
    /// directory's gate-history.jsonl) instead of gating: per adapter and driver, per path, runs,
    /// passes, fails, the worst figures and when. Nothing leaves the machine.
    #[arg(long)]
    pub history: bool,
}

/// One path's record on one adapter and driver, over the gate history.
#[derive(Default, serde::Serialize)]
struct PathHistory {
    /// Gate runs that measured (verdicts taken from the cache are not counted).
    runs: usize,
    passes: usize,
    fails: usize,
    /// The largest mean_rel / limit seen (1 or more is a fail), and when.
    worst_ratio: f64,
    worst_time_unix: u64,
    last_time_unix: u64,
    last_reason: Option<String>,
}

/// A drift-guard event, one line of the gate history (`"kind": "drift"`).
#[derive(serde::Serialize, serde::Deserialize)]
pub struct DriftRecord {
    pub kind: String,
    pub time_unix: u64,
    pub adapter: String,
    pub driver: String,
    /// The model.
    pub subject: String,
    pub position: usize,
    pub kl: f64,
    pub bound: f64,
    pub same_top1: usize,
    pub checks: usize,
    /// The fast paths the guard turned off.
    pub paths: Vec<String>,
}

/// A training gate's run, one line of the gate history (`"kind": "training"`).
#[derive(serde::Serialize, serde::Deserialize)]
pub struct TrainingRecord {
    pub kind: String,
    pub time_unix: u64,
    pub adapter: String,
    pub driver: String,
    pub report: TrainGateReport,
}

/// The end-to-end token gate's record on one adapter and driver.
#[derive(Default, serde::Serialize)]
struct TokenHistory {
    runs: usize,
    /// (path, token position where it left the f32 path's tokens, when).
    drops: Vec<(String, usize, u64)>,
}

#[derive(Default, serde::Serialize)]
struct AdapterHistory {
    adapter: String,
    driver: String,
    first_time_unix: u64,
    last_time_unix: u64,
    paths: BTreeMap<String, PathHistory>,
    token_gate: TokenHistory,
    /// Drift-guard events: (model, position, KL, bound, paths turned off, when).
    drift_events: Vec<(String, usize, f64, f64, String, u64)>,
    /// Training gates: (paths, passed, first-gradient error, worst loss difference, steps, when).
    training_gates: Vec<(String, bool, f64, f64, usize, u64)>,
}

/// The history of `name` and `driver` in `by` (made on first sight), its time span widened to `t`.
fn adapter_entry<'a>(
    by: &'a mut BTreeMap<(String, String), AdapterHistory>,
    name: &str,
    driver: &str,
    t: u64,
) -> &'a mut AdapterHistory {
    let a = by
        .entry((name.to_string(), driver.to_string()))
        .or_insert_with(|| AdapterHistory {
            adapter: name.to_string(),
            driver: driver.to_string(),
            first_time_unix: t,
            ..Default::default()
        });
    a.first_time_unix = a.first_time_unix.min(t);
    a.last_time_unix = a.last_time_unix.max(t);
    a
}

/// `tinygpt gates --history`: reads the history file, skipping (and counting) lines it cannot parse.
fn history(cmd: &GatesCmd) -> Result<()> {
    let Some(dir) = cache_dir() else {
        bail!("no cache directory (set TINYGPT_CACHE_DIR)");
    };
    let path = dir.join("gate-history.jsonl");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(anyhow::anyhow!("cannot read {}: {e}", path.display())),
    };
    let mut by: BTreeMap<(String, String), AdapterHistory> = BTreeMap::new();
    let mut bad = 0usize;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if let Ok(d) = serde_json::from_str::<DriftRecord>(line)
            .map_err(drop)
            .and_then(|d| if d.kind == "drift" { Ok(d) } else { Err(()) })
        {
            let a = adapter_entry(&mut by, &d.adapter, &d.driver, d.time_unix);
            a.drift_events.push((
                d.subject,
                d.position,
                d.kl,
                d.bound,
                d.paths.join(" "),
                d.time_unix,
            ));
            continue;
        }
        if let Ok(t) = serde_json::from_str::<TrainingRecord>(line)
            .map_err(drop)
            .and_then(|t| if t.kind == "training" { Ok(t) } else { Err(()) })
        {
            let a = adapter_entry(&mut by, &t.adapter, &t.driver, t.time_unix);
            let r = t.report;
            a.training_gates.push((
                r.paths.join(" "),
                r.passed,
                r.grad_error,
                r.worst_rel,
                r.steps,
                t.time_unix,
            ));
            continue;
        }
        let Ok(r) = serde_json::from_str::<GateRecord>(line) else {
            bad += 1;
            continue;
        };
        let a = adapter_entry(&mut by, &r.adapter, &r.driver, r.time_unix);
        for p in r
            .paths
            .iter()
            .filter(|p| !p.from_cache && !p.shapes.is_empty())
        {
            let h = a.paths.entry(p.name.clone()).or_default();
            h.runs += 1;
            if p.status == tinygpt_kernels::gate::Status::Active {
                h.passes += 1;
            } else {
                h.fails += 1;
            }
            let worst = p
                .shapes
                .iter()
                .map(|s| s.mean_rel / s.limit_rel.max(f64::MIN_POSITIVE))
                .fold(
                    0.0f64,
                    |m, x| if x.is_nan() { f64::INFINITY } else { m.max(x) },
                );
            if worst >= h.worst_ratio {
                h.worst_ratio = worst;
                h.worst_time_unix = r.time_unix;
            }
            if r.time_unix >= h.last_time_unix {
                h.last_time_unix = r.time_unix;
                h.last_reason = p.reason.clone();
            }
        }
        if let Some(t) = r.token.as_ref().filter(|t| !t.from_cache) {
            a.token_gate.runs += 1;
            for (p, pos) in &t.dropped {
                a.token_gate
                    .drops
                    .push((format!("{p:?}"), *pos, r.time_unix));
            }
        }
    }
    let adapters: Vec<AdapterHistory> = by.into_values().collect();
    if cmd.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "file": path.display().to_string(),
                "unreadable_lines": bad,
                "adapters": adapters,
            }))?
        );
        return Ok(());
    }
    if adapters.is_empty() {
        println!("no gate runs recorded yet in {}", path.display());
        return Ok(());
    }
    let when = chrono_like;
    for a in &adapters {
        println!(
            "{} · driver {} · {} to {}",
            a.adapter,
            a.driver,
            when(a.first_time_unix),
            when(a.last_time_unix)
        );
        for (name, h) in &a.paths {
            println!(
                "  {name:<14} {:>3} runs, {:>3} passed, {:>3} failed · worst mean_rel at {:.0}% of its limit ({}){}",
                h.runs,
                h.passes,
                h.fails,
                100.0 * h.worst_ratio,
                when(h.worst_time_unix),
                h.last_reason
                    .as_ref()
                    .filter(|_| h.fails > 0)
                    .map_or(String::new(), |r| format!(" · last failure: {r}"))
            );
        }
        let t = &a.token_gate;
        if t.runs > 0 {
            println!(
                "  token gate     {:>3} runs, {} paths dropped{}",
                t.runs,
                t.drops.len(),
                t.drops
                    .iter()
                    .map(|(p, pos, at)| format!(" · {p} at token {pos} ({})", when(*at)))
                    .collect::<String>()
            );
        }
        for (paths, passed, grad, worst, steps, at) in &a.training_gates {
            println!(
                "  training gate  {paths}: {} · first gradients {:.3}% off · worst loss difference {:.3}% over {steps} steps ({})",
                if *passed { "passed" } else { "failed" },
                100.0 * grad,
                100.0 * worst,
                when(*at)
            );
        }
        if !a.drift_events.is_empty() {
            let n = a.drift_events.len();
            println!(
                "  drift guard    {n} event{}",
                if n == 1 { "" } else { "s" }
            );
            for (model, pos, kl, bound, paths, at) in &a.drift_events {
                println!(
                    "    {model}: position {pos}, KL={kl:.3e} (bound {bound:.3e}), {paths} turned off ({})",
                    when(*at)
                );
            }
        }
    }
    if bad > 0 {
        println!("({bad} unreadable lines in {} skipped)", path.display());
    }
    println!("from {}", path.display());
    Ok(())
}

/// A Unix time as "YYYY-MM-DD HH:MM UTC".
fn chrono_like(t: u64) -> String {
    let (y, mo, d) = tinygpt_models::chat_template::civil_from_days((t / 86_400) as i64);
    let (h, m) = ((t % 86_400) / 3600, (t % 3600) / 60);
    format!("{y:04}-{mo:02}-{d:02} {h:02}:{m:02} UTC")
}

/// `tinygpt gates` without a device when only the history is asked for.
pub fn history_only(cmd: &GatesCmd) -> Option<Result<()>> {
    cmd.history.then(|| history(cmd))
}

/// The cache directory: `TINYGPT_CACHE_DIR`, else the user's cache directory.
pub fn cache_dir() -> Option<PathBuf> {
    std::env::var_os("TINYGPT_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|d| d.join("tinygpt")))
}

/// Verdicts in `DIR/verdicts.json`, the last run in `DIR/gate-report.json`, every run appended to
/// `DIR/gate-history.jsonl`. Each write re-reads the file under an exclusive lock and merges its one
/// change, so processes sharing the directory never lose each other's verdicts; files are replaced
/// atomically, so a reader never sees half a file. A directory that cannot be written is reported once.
pub struct FileStore {
    dir: Option<PathBuf>,
    verdicts: BTreeMap<String, String>,
    warned: bool,
}

impl FileStore {
    pub fn open() -> Self {
        Self::at(cache_dir())
    }

    /// The store of the cache directory `dir` (None: verdicts are kept for this run only).
    fn at(dir: Option<PathBuf>) -> Self {
        let verdicts = dir
            .as_ref()
            .and_then(|d| std::fs::read(d.join("verdicts.json")).ok())
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        FileStore {
            dir,
            verdicts,
            warned: false,
        }
    }

    fn warn(&mut self, what: &str, e: impl std::fmt::Display) {
        if !self.warned {
            eprintln!(
                "note: the gate's verdicts cannot be kept ({what}: {e}); they are checked again next run \
                 (set TINYGPT_CACHE_DIR to a writable directory)"
            );
            self.warned = true;
        }
    }

    /// Runs `f` on the verdict file's current contents under the directory's lock, then writes it back.
    fn update(&mut self, f: impl FnOnce(&mut BTreeMap<String, String>)) {
        let Some(dir) = self.dir.clone() else { return };
        let result = (|| -> Result<()> {
            std::fs::create_dir_all(&dir)?;
            let lock = File::create(dir.join(".lock"))?;
            lock.lock()?;
            let path = dir.join("verdicts.json");
            let mut now: BTreeMap<String, String> = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default();
            f(&mut now);
            tinygpt_models::gpt::checkpoint::write_atomic(
                &path,
                &serde_json::to_vec_pretty(&now)?,
            )?;
            self.verdicts = now;
            Ok(())
        })();
        if let Err(e) = result {
            self.warn(&dir.display().to_string(), format!("{e:#}"));
        }
    }
}

impl VerdictStore for FileStore {
    fn load(&self, key: &str) -> Option<String> {
        self.verdicts.get(key).cloned()
    }

    fn store(&mut self, key: &str, verdict: Option<&str>) {
        if self.verdicts.get(key).map(String::as_str) == verdict {
            return;
        }
        self.update(|m| match verdict {
            Some(v) => {
                m.insert(key.to_string(), v.to_string());
            }
            None => {
                m.remove(key);
            }
        });
    }

    fn record(&mut self, record: &GateRecord) {
        let Some(dir) = self.dir.clone() else { return };
        let result = (|| -> Result<()> {
            std::fs::create_dir_all(&dir)?;
            let lock = File::create(dir.join(".lock"))?;
            lock.lock()?;
            tinygpt_models::gpt::checkpoint::write_atomic(
                &dir.join("gate-report.json"),
                &serde_json::to_vec_pretty(record)?,
            )?;
            let mut history = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join("gate-history.jsonl"))?;
            let mut line = serde_json::to_vec(record)?;
            line.push(b'\n');
            history.write_all(&line)?;
            Ok(())
        })();
        if let Err(e) = result {
            self.warn(&dir.display().to_string(), format!("{e:#}"));
        }
    }
}

/// Appends a drift-guard event to the gate history (`tinygpt gates --history` shows it); a directory
/// that cannot be written is reported, never fatal.
pub fn record_drift(be: &Backend, model: &str, e: &tinygpt_models::llm::DriftEvent) {
    let (adapter, driver) = match be.as_gpu() {
        Some(g) => {
            let i = g.info();
            (i.name.clone(), format!("{} {}", i.driver, i.driver_info))
        }
        None => ("CPU backend".to_string(), String::new()),
    };
    let r = DriftRecord {
        kind: "drift".into(),
        time_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        adapter,
        driver,
        subject: model.to_string(),
        position: e.position,
        kl: e.kl,
        bound: e.bound,
        same_top1: e.same_top1,
        checks: e.checks,
        paths: e.paths.iter().map(|p| p.name().to_string()).collect(),
    };
    append_history("drift-guard event", &r);
}

/// Appends one line to the gate history; a directory that cannot be written is reported, never fatal.
fn append_history(what: &str, line: &impl serde::Serialize) {
    let Some(dir) = cache_dir() else { return };
    let result = (|| -> Result<()> {
        std::fs::create_dir_all(&dir)?;
        let lock = File::create(dir.join(".lock"))?;
        lock.lock()?;
        let mut history = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("gate-history.jsonl"))?;
        let mut bytes = serde_json::to_vec(line)?;
        bytes.push(b'\n');
        history.write_all(&bytes)?;
        Ok(())
    })();
    if let Err(e) = result {
        eprintln!(
            "note: the {what} cannot be recorded in {} ({e:#})",
            dir.display()
        );
    }
}

/// The training gate in front of a trainer's path set: when `paths` holds the tensor-core training
/// path, its stored verdict on this adapter and driver, or else a fresh gate on `run` (with a progress
/// bar; printed, stored and recorded in the history). Returns the set to train with: `paths`, or
/// without the training path when it failed.
pub fn prepare_training(
    be: &Backend,
    args: &GateArgs,
    paths: PathSet,
    run: &GateRun<'_>,
) -> Result<PathSet> {
    let id = PathId::MixedTraining;
    let Some(g) = be.as_gpu().filter(|_| paths.has(id)) else {
        return Ok(paths);
    };
    let i = g.info();
    let (adapter, driver) = (i.name.clone(), format!("{} {}", i.driver, i.driver_info));
    // A verdict holds for the shapes it trained: a fault can live past some sequence length or width.
    let c = run.cfg;
    let key = format!(
        "{}|training-gate|{}|v{}|k{}|{} steps|{}x{}x{} block {} vocab {} batch {}",
        tinygpt_kernels::gate::adapter_key(be),
        id.name(),
        id.kernel_version(),
        tinygpt_kernels::gate::kernels_digest(),
        run.steps,
        c.n_layer,
        c.n_head,
        c.n_embd,
        c.block_size,
        c.vocab_size,
        run.batch
    );
    let mut store = FileStore::open();
    let verdict = |r: &TrainGateReport| {
        if r.passed {
            paths
        } else {
            eprintln!("[ops] {} off: training on the f32 products", id.pill());
            paths.without(id)
        }
    };
    if !args.regate
        && let Some(r) = store
            .load(&key)
            .and_then(|s| serde_json::from_str::<TrainGateReport>(&s).ok())
    {
        eprintln!("{} [cached]", r.log_line());
        return Ok(verdict(&r));
    }
    eprintln!(
        "[ops] training gate: the first {} steps on the f32 path, then on {} (once per adapter and driver)",
        run.steps,
        id.pill()
    );
    let pb = ProgressBar::new(2 * run.steps as u64);
    pb.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps · ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let r = pollster::block_on(training_gate(be, run, paths, &mut |d, _| {
        pb.set_position(d as u64)
    }));
    pb.finish_and_clear();
    let r = r?;
    eprintln!("{}", r.log_line());
    store.store(&key, serde_json::to_string(&r).ok().as_deref());
    append_history(
        "training gate",
        &TrainingRecord {
            kind: "training".into(),
            time_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            adapter,
            driver,
            report: r.clone(),
        },
    );
    Ok(verdict(&r))
}

/// The paths `args` allows (all, less `--disable-path`); an unknown name is an error that lists the
/// known ones.
fn allowed(args: &GateArgs) -> Result<Vec<PathId>> {
    for name in &args.disable_path {
        if PathId::from_name(name).is_none() {
            bail!(
                "--disable-path {name}: no such fast path (known: {})",
                registry::names()
            );
        }
    }
    Ok(PathId::ALL
        .into_iter()
        .filter(|p| !args.disable_path.iter().any(|d| d == p.name()))
        .collect())
}

pub(crate) fn options(args: &GateArgs) -> Result<GateOptions> {
    Ok(GateOptions {
        only: Some(allowed(args)?),
        regate: args.regate,
        seed: 20261129,
        ..GateOptions::default()
    })
}

/// Gates the fast paths for `model` on `be` (op gates at its shapes, then its token gate), printing
/// the gate's lines, and returns the path set to build the model's runner with (the f32 path on the
/// CPU backend, or with `--f32-only`).
pub fn prepare<M: GateModel>(be: &Backend, args: &GateArgs, model: &M) -> Result<PathSet>
where
    M::Error: std::error::Error + Send + Sync + 'static,
{
    let mut opts = options(args)?;
    // Inference never runs the training path's kernels.
    if let Some(only) = opts.only.as_mut() {
        only.retain(|&p| p != PathId::MixedTraining);
    }
    if args.f32_only {
        eprintln!("[ops] fast paths off (--f32-only): canonical f32 kernels only");
        return Ok(PathSet::F32);
    }
    let mut store = FileStore::open();
    let gated = pollster::block_on(gate_for_model(be, &mut store, model, &opts, &mut |l| {
        eprintln!("{l}")
    }))?;
    Ok(gated.paths)
}

/// The op gates alone, at the default shapes plus `cases` (training and benchmarks, where no model's
/// tokens can be compared).
pub fn prepare_ops(
    be: &Backend,
    args: &GateArgs,
    cases: Vec<tinygpt_kernels::gate::GateCase>,
) -> Result<Option<Gated>> {
    if be.as_gpu().is_none() {
        // The CPU's paths are quantized products, which training and the op benchmarks never run.
        return Ok(None);
    }
    gate_ops(be, args, cases)
}

/// The op gates of `be`'s kind of backend at the default shapes plus `cases` (None with `--f32-only`).
pub(crate) fn gate_ops(
    be: &Backend,
    args: &GateArgs,
    cases: Vec<tinygpt_kernels::gate::GateCase>,
) -> Result<Option<Gated>> {
    let mut opts = options(args)?;
    if args.f32_only {
        eprintln!("[ops] fast paths off (--f32-only): canonical f32 kernels only");
        return Ok(None);
    }
    opts.extra_cases = cases;
    let mut store = FileStore::open();
    Ok(Some(pollster::block_on(gate_device(
        be,
        &mut store,
        &opts,
        &mut |l| eprintln!("{l}"),
    ))))
}

/// `tinygpt gates`: gate every path on the selected adapter and show the pills.
pub fn run(be: &Backend, args: &GateArgs, cmd: &GatesCmd) -> Result<()> {
    let Some(gated) = gate_ops(be, args, Vec::new())? else {
        if cmd.json {
            println!(
                "{}",
                serde_json::json!({"backend": be.describe(), "paths": []})
            );
        } else {
            println!("{}: no fast paths to gate (--f32-only)", be.describe());
        }
        return Ok(());
    };
    let summary = &gated.summary;
    if cmd.json {
        println!("{}", serde_json::to_string_pretty(summary)?);
        return Ok(());
    }
    println!("{}", be.describe());
    let pills: Vec<String> = summary.reports.iter().map(|r| r.pill_text()).collect();
    println!("{}", pills.join("  "));
    println!(
        "gates took {:.0} ms{}",
        summary.millis,
        if summary.all_cached() {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory for one test.
    fn fresh(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tinygpt-gates-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn verdicts_on_disk(dir: &std::path::Path) -> BTreeMap<String, String> {
        serde_json::from_slice(&std::fs::read(dir.join("verdicts.json")).unwrap()).unwrap()
    }

    /// Processes sharing one cache directory (each opened it before the others wrote) keep every
    /// verdict any of them stored: each write merges into the file under the directory's lock.
    #[test]
    fn stores_sharing_a_cache_directory_never_lose_each_others_verdicts() {
        let path = fresh("shared");
        // Two stores opened on the empty directory: the second one's map never saw the first's write.
        let mut a = FileStore::at(Some(path.clone()));
        let mut b = FileStore::at(Some(path.clone()));
        a.store("adapter-1/f16", Some("pass"));
        b.store("adapter-1/subgroups", Some("fail"));
        let on_disk = verdicts_on_disk(&path);
        assert_eq!(
            on_disk.get("adapter-1/f16").map(String::as_str),
            Some("pass")
        );
        assert_eq!(
            on_disk.get("adapter-1/subgroups").map(String::as_str),
            Some("fail")
        );
        // Writers at the same time (threads standing in for processes): none loses another's.
        std::thread::scope(|s| {
            for t in 0..6 {
                let path = path.clone();
                s.spawn(move || {
                    let mut st = FileStore::at(Some(path));
                    for i in 0..15 {
                        st.store(&format!("t{t}/k{i}"), Some("pass"));
                    }
                });
            }
        });
        let on_disk = verdicts_on_disk(&path);
        assert_eq!(on_disk.len(), 2 + 6 * 15, "{on_disk:?}");
        // A removal merges too: it takes out its key and leaves the others'.
        b.store("adapter-1/f16", None);
        let on_disk = verdicts_on_disk(&path);
        assert!(!on_disk.contains_key("adapter-1/f16"));
        assert_eq!(on_disk.len(), 1 + 6 * 15);
        std::fs::remove_dir_all(&path).unwrap();
    }

    /// A cache directory that cannot be written is reported (once) and the run goes on: nothing
    /// claims a verdict was kept.
    #[test]
    fn an_unwritable_cache_directory_is_reported_not_fatal() {
        let dir = fresh("unwritable");
        let file = dir.join("not-a-directory");
        std::fs::write(&file, b"x").unwrap();
        let mut st = FileStore::at(Some(file.join("cache")));
        st.store("adapter-1/f16", Some("pass"));
        assert!(st.warned);
        assert_eq!(st.load("adapter-1/f16"), None);
        st.store("adapter-1/subgroups", Some("pass"));
        assert!(!file.join("cache").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
