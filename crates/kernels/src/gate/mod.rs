//! The numerics gate: no fast path is used before it has proven, on this device, that it computes what
//! the canonical f32 path computes. This module owns the whole guarantee:
//!
//! ```text
//!   registry.rs   the fast paths, one row each: id, name, pill, detection, kernel version, evaluation
//!   mod.rs        the metric, the op gates at several shapes (run_gates), their reports and log lines
//!   token.rs      the end-to-end token gate: a model's greedy tokens, f32 path against the fast paths
//!   model.rs      one call for a model: op gates at its shapes, then the token gate -> a PathSet
//!   store.rs      where verdicts persist (VerdictStore: files for the CLI, browser storage on the web)
//! ```
//!
//! The gate's output is a [`PathSet`], a plain value: whatever runs (a model runner, a trainer) holds it
//! and hands it to the ops. Nothing is switched on behind anyone's back.
//!
//! The metric (our precision spec): with inputs drawn uniformly from [-0.2, 0.2] and
//! rel_i = |f_i − r_i| / max(|r_i|, 1% of mean|ref|), a path passes a shape only if
//! max_abs < 1% of mean|ref| and mean_rel < 0.5%, with no NaN or Inf anywhere and nothing written
//! outside its output. max_rel is reported, not gating. Every shape must pass.
//!
//! The gate does no file I/O and never blocks (it also runs in browsers): reads are awaited, and
//! verdicts go through the caller's [`VerdictStore`].

mod model;
pub mod registry;
mod store;
mod token;

pub use model::{GateModel, Gated, gate_device, gate_for_model, stored_verdict};
pub use store::{GateRecord, MemoryStore, VerdictStore};
pub use token::{TokenOutcome, token_gate};

use crate::backend::{Backend, Tensor};
use crate::error::Result;
use crate::path::{Fault, PathId, PathSet};
use registry::{PathDef, REGISTRY};
use serde::{Deserialize, Serialize};
use web_time::Instant;

/// One shape a path is gated at: y[m, n] = x[m, k] · W[n, k]ᵀ.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GateCase {
    pub label: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

impl GateCase {
    pub fn new(label: &str, m: usize, n: usize, k: usize) -> Self {
        GateCase {
            label: label.into(),
            m,
            n,
            k,
        }
    }
}

/// The shapes every path is gated at: inference-typical (K = 256, one row: the decode kernels),
/// training-typical (K = 1024, 64 rows: the tiled kernels) and head-output (K = 49152, a vocabulary's
/// size, which also catches errors that only appear past 2048 along K). Callers add the loaded model's
/// real shapes.
pub fn default_cases() -> Vec<GateCase> {
    vec![
        GateCase::new("inference K=256", 1, 512, 256),
        GateCase::new("training K=1024", 64, 256, 1024),
        GateCase::new("head-output K=49152", 4, 64, 49152),
    ]
}

/// One kernel run of a path's evaluation, recorded but not yet read back: its output tensor (m·n
/// results poisoned with NaN beforehand, then a guard region) and the canonical f32 result.
pub struct Pending {
    pub reference: Vec<f32>,
    pub output: Tensor,
}

/// The metric at one shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShapeReport {
    pub case: GateCase,
    pub mean_abs_ref: f64,
    pub max_abs: f64,
    pub limit_abs: f64,
    pub mean_rel: f64,
    pub limit_rel: f64,
    pub max_rel: f64,
    pub all_finite: bool,
    pub guard_intact: bool,
    pub pass: bool,
}

/// Relative-error floor as a fraction of mean|ref|, the max_abs limit, and the mean_rel limit.
pub const REL_FLOOR: f64 = 0.01;
pub const ABS_LIMIT: f64 = 0.01;
pub const MEAN_REL_LIMIT: f64 = 0.005;

/// Computes the gate metric of `fast` against `reference`.
pub fn measure(
    case: &GateCase,
    reference: &[f32],
    fast: &[f32],
    guard_intact: bool,
) -> ShapeReport {
    let n = reference.len().min(fast.len()).max(1);
    let all_finite =
        reference.len() == fast.len() && fast.iter().chain(reference).all(|v| v.is_finite());
    let mean_abs_ref = reference.iter().map(|v| v.abs() as f64).sum::<f64>() / n as f64;
    let floor = REL_FLOOR * mean_abs_ref;
    let (mut max_abs, mut sum_rel, mut max_rel) = (0.0f64, 0.0f64, 0.0f64);
    for (&r, &f) in reference.iter().zip(fast) {
        let d = (f as f64 - r as f64).abs();
        let rel = d / (r.abs() as f64).max(floor).max(f64::MIN_POSITIVE);
        max_abs = max_abs.max(d);
        max_rel = max_rel.max(rel);
        sum_rel += rel;
    }
    let mean_rel = sum_rel / n as f64;
    let limit_abs = ABS_LIMIT * mean_abs_ref;
    let pass = all_finite && guard_intact && max_abs < limit_abs && mean_rel < MEAN_REL_LIMIT;
    ShapeReport {
        case: case.clone(),
        mean_abs_ref,
        max_abs: if all_finite { max_abs } else { f64::NAN },
        limit_abs,
        mean_rel: if all_finite { mean_rel } else { f64::NAN },
        limit_rel: MEAN_REL_LIMIT,
        max_rel: if all_finite { max_rel } else { f64::NAN },
        all_finite,
        guard_intact,
        pass,
    }
}

/// Where a path stands after gating.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Passed (now or in the cache): in use.
    Active,
    /// Detected but rejected (failed gate, build error, device error, missing prerequisite).
    Rejected,
    /// The adapter lacks the feature.
    Unsupported,
}

/// The gate's verdict on one path, as shown to the user and written to the telemetry report.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PathReport {
    pub path: PathId,
    pub name: String,
    pub pill: String,
    pub status: Status,
    pub reason: Option<String>,
    pub shapes: Vec<ShapeReport>,
    pub millis: f64,
    pub from_cache: bool,
    pub cache_key: String,
    pub kernel_version: u32,
}

impl PathReport {
    /// The log line of our precision spec, for the deciding shape (the first failing one, or the
    /// tightest passing one).
    pub fn log_line(&self) -> String {
        let deciding = self.shapes.iter().find(|s| !s.pass).or_else(|| {
            self.shapes
                .iter()
                .max_by(|a, b| (a.mean_rel / a.limit_rel).total_cmp(&(b.mean_rel / b.limit_rel)))
        });
        match (self.status, deciding) {
            (Status::Unsupported, _) => format!(
                "[ops] {} gate: not run — {}",
                self.name,
                self.reason.as_deref().unwrap_or("unsupported")
            ),
            (_, None) => format!(
                "[ops] {} gate: {}{}",
                self.name,
                if self.status == Status::Active {
                    "PASS (cached)"
                } else {
                    "FAIL"
                },
                self.reason
                    .as_ref()
                    .map_or(String::new(), |r| format!(" — {r}"))
            ),
            (_, Some(s)) => {
                let verdict = if s.pass { "PASS" } else { "FAIL" };
                let tail = match self.status {
                    Status::Active => format!(" — {}", self.path.active_text()),
                    _ => self
                        .reason
                        .as_ref()
                        .map_or(String::new(), |r| format!(" ({r})")),
                };
                format!(
                    "[ops] {} gate: mean|ref|={:.4}, max_abs={:.3e} (limit {:.3e}), mean_rel={:.4}% (limit {:.1}%), max_rel={:.3}% — {verdict}{tail}{}",
                    self.name,
                    s.mean_abs_ref,
                    s.max_abs,
                    s.limit_abs,
                    100.0 * s.mean_rel,
                    100.0 * s.limit_rel,
                    100.0 * s.max_rel,
                    if self.from_cache { " [cached]" } else { "" }
                )
            }
        }
    }

    /// "+f16 storage", or "-f16 storage (reason)" when detected but rejected.
    pub fn pill_text(&self) -> String {
        match self.status {
            Status::Active => self.pill.clone(),
            Status::Rejected => format!(
                "-{} ({})",
                &self.pill[1..],
                self.reason.as_deref().unwrap_or("rejected")
            ),
            Status::Unsupported => format!(
                "-{} (not on this {})",
                &self.pill[1..],
                if registry::def(self.path).on_cpu {
                    "CPU"
                } else {
                    "adapter"
                }
            ),
        }
    }
}

/// All verdicts of one gating run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GateSummary {
    pub adapter: String,
    pub driver: String,
    pub reports: Vec<PathReport>,
    pub millis: f64,
}

impl GateSummary {
    /// The paths that passed: what a runner should be built with.
    pub fn active(&self) -> PathSet {
        self.reports
            .iter()
            .filter(|r| r.status == Status::Active)
            .map(|r| r.path)
            .collect()
    }

    /// Pills of the paths in use, e.g. "+f16 storage +q8 matmul"; "f32 path" when none.
    pub fn active_pills(&self) -> String {
        pills(self.active())
    }

    /// Whether nothing had to be evaluated (every verdict came from the store, or the path is absent).
    pub fn all_cached(&self) -> bool {
        self.reports
            .iter()
            .all(|r| r.from_cache || r.status == Status::Unsupported)
    }
}

/// "+f16 storage +q8 matmul" for a path set; "f32 path" when it is empty.
pub fn pills(paths: PathSet) -> String {
    if paths.is_empty() {
        return "f32 path".into();
    }
    paths.iter().map(PathId::pill).collect::<Vec<_>>().join(" ")
}

/// How to run the gates.
#[derive(Clone, Debug, Default)]
pub struct GateOptions {
    /// Shapes added to [`default_cases`] (the loaded model's real shapes).
    pub extra_cases: Vec<GateCase>,
    /// Gate only these paths (None: all).
    pub only: Option<Vec<PathId>>,
    /// Ignore stored verdicts.
    pub regate: bool,
    /// Replace the default shapes instead of adding to them (the planted-fault tests gate at K=128 only
    /// to show what a single small shape misses).
    pub replace_cases: bool,
    /// Seed of the random inputs.
    pub seed: u64,
}

impl GateOptions {
    /// The shapes every path is gated at: [`default_cases`] (unless replaced) and the extra ones.
    pub fn cases(&self) -> Vec<GateCase> {
        let mut cases = if self.replace_cases {
            Vec::new()
        } else {
            default_cases()
        };
        cases.extend(self.extra_cases.iter().cloned());
        cases
    }

    /// Whether `opts.only` lets `id` be gated.
    fn allows(&self, id: PathId) -> bool {
        self.only.as_ref().is_none_or(|o| o.contains(&id))
    }
}

/// The paths [`run_gates`] would pass if every verdict it needs is stored (None as soon as one path
/// would have to be measured): the way to know, without running a kernel, whether gating will be
/// instant or whether the caller should start on the f32 path and gate in the background.
pub fn stored_passes(
    be: &Backend,
    opts: &GateOptions,
    store: &mut dyn VerdictStore,
) -> Option<PathSet> {
    if opts.regate {
        return None;
    }
    let cases = opts.cases();
    let mut passed = PathSet::F32;
    for def in paths_of(be).filter(|d| opts.allows(d.id)) {
        if (def.detect)(be).is_err() || def.requires.iter().any(|r| !passed.has(*r)) {
            continue;
        }
        store
            .load(&cache_key(be, def.id, &cases))
            .and_then(|s| serde_json::from_str::<PathReport>(&s).ok())
            .filter(|c| c.status == Status::Active)?;
        passed = passed.with(def.id);
    }
    Some(passed)
}

/// The registry rows of the paths `be`'s kind of backend has (see [`PathDef::on_cpu`]).
fn paths_of(be: &Backend) -> impl Iterator<Item = &'static PathDef> {
    let cpu = be.as_gpu().is_none();
    REGISTRY.iter().filter(move |d| d.on_cpu == cpu)
}

/// The device's identity in cache keys: the adapter's name, driver and driver version (and whether its
/// kernels are compiled with naga's runtime checks); on the CPU backend, the processor's name.
pub fn adapter_key(be: &Backend) -> String {
    match be.as_gpu() {
        Some(g) => {
            let i = g.info();
            // Kernels compiled with naga's runtime checks are other machine code: gated apart.
            let checks = if i.shader_checks {
                "|shader-checks"
            } else {
                ""
            };
            format!("{}|{}|{}{checks}", i.name, i.driver, i.driver_info)
        }
        None => format!("cpu|{}", cpu_name()),
    }
}

/// The processor's name as it reports it (x86-64), else the architecture; read once.
pub fn cpu_name() -> String {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(read_cpu_name).clone()
}

fn read_cpu_name() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        // Leaves 0x80000002..4 hold the brand string where the highest extended leaf reaches them.
        let max = __cpuid(0x8000_0000).eax;
        if max >= 0x8000_0004 {
            let mut bytes = Vec::with_capacity(48);
            for leaf in 0x8000_0002u32..=0x8000_0004 {
                let r = __cpuid(leaf);
                for w in [r.eax, r.ebx, r.ecx, r.edx] {
                    bytes.extend_from_slice(&w.to_le_bytes());
                }
            }
            let name = String::from_utf8_lossy(&bytes);
            let name = name.trim_matches(char::from(0)).trim();
            if !name.is_empty() {
                return name.to_string();
            }
        }
    }
    std::env::consts::ARCH.to_string()
}

/// A digest of the kernel crate's sources this build was compiled from (build.rs): every stored
/// verdict's key holds it beside the path's kernel version, so a build whose kernels changed in any
/// way gates them again rather than trusting a verdict an earlier build earned.
pub fn kernels_digest() -> &'static str {
    env!("TINYGPT_KERNELS_DIGEST")
}

/// Cache key of a path's verdict: device, driver, path, kernel version, the kernels' digest and the
/// shapes gated.
pub fn cache_key(be: &Backend, id: PathId, cases: &[GateCase]) -> String {
    let shapes: Vec<String> = cases
        .iter()
        .map(|c| format!("{}x{}x{}", c.m, c.n, c.k))
        .collect();
    format!(
        "{}|{}|v{}|k{}|{}",
        adapter_key(be),
        id.name(),
        id.kernel_version(),
        kernels_digest(),
        shapes.join(",")
    )
}

/// Gates every registered path of `be`'s kind of backend (the GPU's paths on a GPU, the CPU's on the
/// CPU backend; paths not in `opts.only` are not gated and not passed). Passed verdicts are taken
/// from and written to `store`.
pub async fn run_gates(
    be: &Backend,
    opts: &GateOptions,
    store: &mut dyn VerdictStore,
) -> GateSummary {
    run_gates_from(be, opts, store, None).await
}

/// [`run_gates`] with `fault` planted into the kernels of path `victim` (the other paths stay healthy):
/// the test-only way to prove the gate rejects each kind of fault.
#[cfg(any(test, feature = "testing"))]
pub async fn run_gates_planted(
    be: &Backend,
    opts: &GateOptions,
    store: &mut dyn VerdictStore,
    fault: Fault,
    victim: PathId,
) -> GateSummary {
    run_gates_from(be, opts, store, Some((fault, victim))).await
}

async fn run_gates_from(
    be: &Backend,
    opts: &GateOptions,
    store: &mut dyn VerdictStore,
    planted: Option<(Fault, PathId)>,
) -> GateSummary {
    let t0 = Instant::now();
    let cases = opts.cases();
    let mut reports: Vec<PathReport> = Vec::new();
    let mut passed = PathSet::F32;
    for def in paths_of(be) {
        if !opts.allows(def.id) {
            continue;
        }
        let key = cache_key(be, def.id, &cases);
        let ts = Instant::now();
        let mut report = PathReport {
            path: def.id,
            name: def.name.into(),
            pill: def.pill.into(),
            status: Status::Rejected,
            reason: None,
            shapes: Vec::new(),
            millis: 0.0,
            from_cache: false,
            cache_key: key.clone(),
            kernel_version: def.kernel_version,
        };
        let cached = (!opts.regate)
            .then(|| store.load(&key))
            .flatten()
            .and_then(|s| serde_json::from_str::<PathReport>(&s).ok())
            .filter(|c| c.status == Status::Active);
        if let Err(why) = (def.detect)(be) {
            report.status = Status::Unsupported;
            report.reason = Some(why);
        } else if let Some(missing) = def.requires.iter().find(|r| !passed.has(**r)) {
            report.reason = Some(format!("needs {} first", missing.name()));
        } else if let Some(c) = cached {
            report.status = Status::Active;
            report.shapes = c.shapes;
            report.from_cache = true;
        } else {
            let base = match planted {
                Some((fault, victim)) if victim == def.id => PathSet::planted(fault),
                _ => PathSet::F32,
            };
            let paths = def
                .requires
                .iter()
                .fold(base.with(def.id), |s, r| s.with(*r));
            evaluate_path(be, def, &cases, opts.seed, paths, &mut report).await;
            // Only passes are remembered: a failure is re-checked next time (a driver update may fix it).
            let verdict = (report.status == Status::Active)
                .then(|| serde_json::to_string(&report).ok())
                .flatten();
            store.store(&key, verdict.as_deref());
        }
        report.millis = ts.elapsed().as_secs_f64() * 1e3;
        if report.status == Status::Active {
            passed = passed.with(def.id);
        }
        reports.push(report);
    }
    let (adapter, driver) = match be.as_gpu() {
        Some(g) => {
            let i = g.info();
            (i.name.clone(), format!("{} {}", i.driver, i.driver_info))
        }
        None => (format!("CPU backend ({})", cpu_name()), String::new()),
    };
    GateSummary {
        adapter,
        driver,
        reports,
        millis: t0.elapsed().as_secs_f64() * 1e3,
    }
}

/// Runs `def`'s evaluation at every shape with the kernels of `paths`; the report says the first shape
/// that fails and why.
async fn evaluate_path(
    be: &Backend,
    def: &PathDef,
    cases: &[GateCase],
    seed: u64,
    paths: PathSet,
    report: &mut PathReport,
) {
    for case in cases {
        let runs = match record(be, def, case, seed, paths) {
            Ok(r) => r,
            Err(e) => {
                report.reason = Some(format!("{}: {e}", case.label));
                return;
            }
        };
        // The worst of the path's kernels at this shape decides (the quantized path runs two layouts).
        let mut worst: Option<ShapeReport> = None;
        for run in runs {
            let (fast, guard_intact) = match read_guarded(be, &run.output, case).await {
                Ok(r) => r,
                Err(e) => {
                    report.reason = Some(format!("{}: {e}", case.label));
                    return;
                }
            };
            let s = measure(case, &run.reference, &fast, guard_intact);
            let worse = match &worst {
                None => true,
                Some(w) => w.pass && (!s.pass || s.mean_rel > w.mean_rel),
            };
            if worse {
                worst = Some(s);
            }
        }
        let Some(s) = worst else { continue };
        let pass = s.pass;
        report.reason = (!pass).then(|| {
            format!(
                "{}: {}",
                case.label,
                if !s.guard_intact {
                    "wrote outside its output"
                } else if !s.all_finite {
                    "produced NaN or Inf"
                } else {
                    "outside the error limits"
                }
            )
        });
        report.shapes.push(s);
        if !pass {
            return;
        }
    }
    report.status = Status::Active;
}

/// Records a path's kernels at one shape. A shader compiler that panics (naga does, on some
/// experimental features) becomes a failed gate, not a crashed program.
fn record(
    be: &Backend,
    def: &PathDef,
    case: &GateCase,
    seed: u64,
    paths: PathSet,
) -> std::result::Result<Vec<Pending>, String> {
    #[cfg(not(target_arch = "wasm32"))]
    {
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            (def.evaluate)(be, case, seed, paths)
        }));
        match out {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panic".into());
                Err(format!("kernel panicked: {msg}"))
            }
        }
    }
    #[cfg(target_arch = "wasm32")]
    (def.evaluate)(be, case, seed, paths).map_err(|e| e.to_string())
}

/// Value the guard region after a gated output is filled with (and must still hold afterwards).
pub const GUARD: f32 = 1234.5;

/// An output of m·n elements poisoned with NaN, followed by a guard region.
pub fn guarded_output(be: &Backend, c: &GateCase) -> Result<Tensor> {
    let mut v = vec![f32::NAN; c.m * c.n];
    v.extend(std::iter::repeat_n(GUARD, c.n + 64));
    be.from_f32(&v, 1)
}

/// Reads a guarded output back: (the m·n results, whether the guard is intact).
pub async fn read_guarded(be: &Backend, t: &Tensor, c: &GateCase) -> Result<(Vec<f32>, bool)> {
    be.flush()?;
    let mut v = be.read_f32(t.into(), t.len()).await?;
    let guard = v.split_off(c.m * c.n);
    Ok((v, guard.iter().all(|&g| g == GUARD)))
}

/// A stable 64-bit FNV-1a hash of `words`: names a model's weights in the token gate's store key.
pub fn fingerprint(words: impl IntoIterator<Item = u32>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for w in words {
        for b in w.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The token gate: the first position where the fast path's greedy tokens leave the f32 path's.
pub fn first_divergence(reference: &[u32], fast: &[u32]) -> Option<usize> {
    reference
        .iter()
        .zip(fast)
        .position(|(a, b)| a != b)
        .or((reference.len() != fast.len()).then(|| reference.len().min(fast.len())))
}

#[cfg(test)]
mod tests;
