//! The numerics gate: no fast path is used before it has proven, on this device, that it computes what
//! the canonical f32 path computes.
//!
//! A fast path is five things, declared together in [`paths::REGISTRY`]: feature detection, its
//! kernel(s) (living in their op folders), its gate (the shapes it is checked at and how to evaluate
//! one), its activation flag ([`PathId`], a bit on the GPU backend that ops consult) and its capability
//! pill ("+f16 storage"). [`run_gates`] checks every path on the open device and turns on those that
//! pass; a failed gate, a shader that does not compile, a device error or a panicking shader compiler
//! leaves the f32 path in place and says why.
//!
//! The metric (our precision spec): with inputs drawn uniformly from [-0.2, 0.2] and
//! rel_i = |f_i − r_i| / max(|r_i|, 1% of mean|ref|), a path passes a shape only if
//! max_abs < 1% of mean|ref| and mean_rel < 0.5%, with no NaN or Inf anywhere and nothing written
//! outside its output. max_rel is reported, not gating. Every shape must pass.
//!
//! This crate does no file I/O (it also runs in browsers): the caller keeps the cache of passed gates
//! and the telemetry report (see the `tinygpt` CLI), handing cached verdicts back in [`GateOptions`].

pub mod paths;

use crate::gpu::GpuBackend;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::time::Instant;

/// A deliberately broken kernel, planted by tests to prove the gate rejects it
/// ([`GpuBackend::plant_fault`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Fault {
    /// int8 quants unpacked without sign extension (q8 matmul).
    SignExtensionDropped,
    /// Products accumulated in f16 instead of f32 (shader-f16 and f16-storage kernels).
    F16Accumulation,
    /// Scale index wraps after 64 blocks: wrong only when K >= 2048 (q8 matmul).
    BlockIndexAtK2048,
    /// One element written past the end of the output (every gated matmul kernel).
    OutOfBoundsWrite,
    /// A NaN written into the output (every gated matmul kernel).
    NanOutput,
}

impl Fault {
    pub const ALL: [Fault; 5] = [
        Fault::SignExtensionDropped,
        Fault::F16Accumulation,
        Fault::BlockIndexAtK2048,
        Fault::OutOfBoundsWrite,
        Fault::NanOutput,
    ];
}

/// A fast path's identity: its activation flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum PathId {
    F16Storage,
    ShaderF16,
    Subgroups,
    CoopMatrix,
    QuantMatmul,
}

impl PathId {
    pub const ALL: [PathId; 5] = [
        PathId::F16Storage,
        PathId::ShaderF16,
        PathId::Subgroups,
        PathId::CoopMatrix,
        PathId::QuantMatmul,
    ];

    pub(crate) fn bit(self) -> u32 {
        1 << (self as u32)
    }

    /// The name used in log lines and the cache ("f16-storage").
    pub fn name(self) -> &'static str {
        paths::def(self).name
    }

    /// The capability pill ("+f16 storage").
    pub fn pill(self) -> &'static str {
        paths::def(self).pill
    }
}

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

/// What one evaluation of a path at one shape produced.
pub struct CaseOutput {
    pub reference: Vec<f32>,
    pub fast: Vec<f32>,
    /// Whether the guard region after the fast path's output was left untouched.
    pub guard_intact: bool,
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
                    Status::Active => format!(" — {}", paths::def(self.path).active_text),
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
            Status::Unsupported => format!("-{} (not on this adapter)", &self.pill[1..]),
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
    /// Pills of the paths in use, e.g. "+f16 storage +q8 matmul"; "f32 path" when none.
    pub fn active_pills(&self) -> String {
        let v: Vec<&str> = self
            .reports
            .iter()
            .filter(|r| r.status == Status::Active)
            .map(|r| r.pill.as_str())
            .collect();
        if v.is_empty() {
            "f32 path".into()
        } else {
            v.join(" ")
        }
    }
}

/// How to run the gates.
#[derive(Default)]
pub struct GateOptions {
    /// Shapes added to [`default_cases`] (the loaded model's real shapes).
    pub extra_cases: Vec<GateCase>,
    /// Gate only these paths (None: all).
    pub only: Option<Vec<PathId>>,
    /// Reports of earlier passes, by cache key; a passed path found here is not re-run.
    pub cached: HashMap<String, PathReport>,
    /// Ignore the cache.
    pub regate: bool,
    /// Replace the default shapes instead of adding to them (the planted-fault tests gate at K=128 only
    /// to show what a single small shape misses).
    pub replace_cases: bool,
    /// Seed of the random inputs.
    pub seed: u64,
}

/// Cache key of a path's verdict: adapter, driver, path, kernel version and the shapes gated.
pub fn cache_key(g: &GpuBackend, id: PathId, cases: &[GateCase]) -> String {
    let i = g.info();
    let shapes: Vec<String> = cases
        .iter()
        .map(|c| format!("{}x{}x{}", c.m, c.n, c.k))
        .collect();
    format!(
        "{}|{}|{}|{}|v{}|{}",
        i.name,
        i.driver,
        i.driver_info,
        id.name(),
        paths::def(id).kernel_version,
        shapes.join(",")
    )
}

/// Gates every registered path on the GPU backend `be` and activates those that pass (paths not gated
/// stay off). On the CPU backend there is nothing to gate: the summary is empty.
pub fn run_gates(be: &crate::Backend, opts: &GateOptions) -> GateSummary {
    let t0 = Instant::now();
    let Some(g) = be.as_gpu() else {
        return GateSummary {
            adapter: "CPU backend".into(),
            driver: String::new(),
            reports: Vec::new(),
            millis: 0.0,
        };
    };
    let mut cases = if opts.replace_cases {
        Vec::new()
    } else {
        default_cases()
    };
    cases.extend(opts.extra_cases.iter().cloned());
    let mut reports = Vec::new();
    for def in paths::REGISTRY {
        if opts.only.as_ref().is_some_and(|o| !o.contains(&def.id)) {
            continue;
        }
        g.set_path_active(def.id, false);
        let key = cache_key(g, def.id, &cases);
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
        if let Err(why) = (def.detect)(g) {
            report.status = Status::Unsupported;
            report.reason = Some(why);
        } else if let Some(missing) = def.requires.iter().find(|r| !g.path_active(**r)) {
            report.reason = Some(format!("needs {} first", missing.name()));
        } else if let (false, Some(c)) = (
            opts.regate,
            opts.cached.get(&key).filter(|c| c.status == Status::Active),
        ) {
            report.status = Status::Active;
            report.shapes = c.shapes.clone();
            report.from_cache = true;
        } else {
            evaluate_path(be, def, &cases, opts.seed, &mut report);
        }
        report.millis = ts.elapsed().as_secs_f64() * 1e3;
        g.set_path_active(def.id, report.status == Status::Active);
        reports.push(report);
    }
    let i = g.info();
    GateSummary {
        adapter: i.name.clone(),
        driver: format!("{} {}", i.driver, i.driver_info),
        reports,
        millis: t0.elapsed().as_secs_f64() * 1e3,
    }
}

fn evaluate_path(
    be: &crate::Backend,
    def: &paths::PathDef,
    cases: &[GateCase],
    seed: u64,
    report: &mut PathReport,
) {
    for case in cases {
        // A shader compiler that panics (naga does, on some experimental features) must become a failed
        // gate, not a crashed program.
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            (def.evaluate)(be, case, seed)
        }));
        let out = match out {
            Ok(Ok(o)) => o,
            Ok(Err(e)) => {
                report.reason = Some(format!("{}: {e}", case.label));
                return;
            }
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panic".into());
                report.reason = Some(format!("{}: kernel panicked: {msg}", case.label));
                return;
            }
        };
        let s = measure(case, &out.reference, &out.fast, out.guard_intact);
        let pass = s.pass;
        report.shapes.push(s);
        if !pass {
            let last = report.shapes.last().expect("just pushed");
            report.reason = Some(if !last.guard_intact {
                format!("{}: wrote outside its output", case.label)
            } else if !last.all_finite {
                format!("{}: produced NaN or Inf", case.label)
            } else {
                format!("{}: outside the error limits", case.label)
            });
            return;
        }
    }
    report.status = Status::Active;
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
