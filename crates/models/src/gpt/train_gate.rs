//! The training gate: a training fast path earns its place by training.
//!
//! The op gates compare one product at a time; training compounds rounding through thousands of
//! steps, and a fault can hide in a kernel the op gates never call (a weight gradient, attention's mask
//! past some length). So before a trainer uses a training fast path, the same seed's first
//! [`GATE_STEPS`] steps run on the canonical f32 path and on the fast path, from the same parameters
//! and on the same batches, and the mean loss of one fixed held-out batch (dropout off) is compared
//! every [`GATE_EVERY`] steps. The fast path passes when every compared loss is finite and within
//! [`GATE_TOLERANCE`] (relative) of the f32 path's; the figures go to the caller's telemetry.

use serde::{Deserialize, Serialize};
use tinygpt_kernels::{Backend, PathSet, Result};

use super::config::GptConfig;
use super::train::{OptimConfig, Trainer};

/// Steps each path trains for.
pub const GATE_STEPS: usize = 200;
/// Steps between compared losses.
pub const GATE_EVERY: usize = 20;
/// Largest relative difference of a compared loss.
pub const GATE_TOLERANCE: f64 = 0.01;
/// Largest Σ|fast − f32| / Σ|f32| of the first step's gradients: twice f16's unit roundoff (2⁻¹¹).
/// Rounding each operand of a dot product to f16 once, with exact products and f32 sums, costs about
/// 0.8 units on average (√(2/3) for independent roundings of terms of random sign); an accumulator
/// that rounds as it adds costs units in proportion to √K.
pub const GRAD_TOLERANCE: f64 = 2.0 / 2048.0;

/// The losses of one compared step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossPoint {
    pub step: usize,
    pub f32_loss: f32,
    pub fast_loss: f32,
}

impl LossPoint {
    /// |fast − f32| / f32 (infinite when either is not finite).
    pub fn rel(&self) -> f64 {
        let (a, b) = (self.f32_loss as f64, self.fast_loss as f64);
        if a.is_finite() && b.is_finite() {
            (b - a).abs() / a.abs().max(f64::MIN_POSITIVE)
        } else {
            f64::INFINITY
        }
    }
}

/// What one training gate saw.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainGateReport {
    /// Names of the fast paths the trainer held.
    pub paths: Vec<String>,
    pub steps: usize,
    /// The first step's gradients: Σ|fast − f32| / Σ|f32| over every parameter.
    pub grad_error: f64,
    pub points: Vec<LossPoint>,
    /// The largest relative difference of a compared loss.
    pub worst_rel: f64,
    pub tolerance: f64,
    pub passed: bool,
    /// Why it failed, in words.
    pub reason: Option<String>,
    /// Milliseconds the two runs took (f32, fast).
    pub f32_ms: f64,
    pub fast_ms: f64,
}

impl TrainGateReport {
    /// The console line: `[ops] training gate: …`.
    pub fn log_line(&self) -> String {
        let Some(last) = self.points.last() else {
            return format!(
                "[ops] training gate ({}): first gradients {:.3}% off — FAIL ({})",
                self.paths.join(" + "),
                100.0 * self.grad_error,
                self.reason.as_deref().unwrap_or("no step compared")
            );
        };
        format!(
            "[ops] training gate ({}): first gradients {:.3}% off, {} steps, loss at step {} {:.4} (f32 {:.4}), worst difference {:.3}% (limit {:.1}%), {:.1} s + {:.1} s — {}{}",
            self.paths.join(" + "),
            100.0 * self.grad_error,
            self.steps,
            last.step,
            last.fast_loss,
            last.f32_loss,
            100.0 * self.worst_rel,
            100.0 * self.tolerance,
            self.f32_ms / 1e3,
            self.fast_ms / 1e3,
            if self.passed { "PASS" } else { "FAIL" },
            self.reason
                .as_ref()
                .map_or(String::new(), |r| format!(" ({r})")),
        )
    }
}

/// The run a training gate reproduces: the trainer's configuration, its starting parameters, and its
/// batches and learning rate for each step.
pub struct GateRun<'a> {
    pub cfg: &'a GptConfig,
    pub batch: usize,
    pub params: &'a [f32],
    pub optim: OptimConfig,
    /// The dropout seed.
    pub seed: u32,
    /// Steps per path ([`GATE_STEPS`] for a real gate; tests use fewer).
    pub steps: usize,
    /// Steps between compared losses.
    pub every: usize,
    /// The training batch (ids, targets) of a step.
    pub batch_of: &'a dyn Fn(usize) -> (Vec<u32>, Vec<u32>),
    /// The learning rate of a step.
    pub lr_of: &'a dyn Fn(usize) -> f32,
    /// The held-out batch whose loss is compared.
    pub held_out: (Vec<u32>, Vec<u32>),
}

/// Trains `run.steps` steps on `paths`, returning the held-out loss every `run.every` steps (and
/// after the last) and the milliseconds it took. `progress` hears (steps done, steps in all).
async fn losses(
    be: &Backend,
    run: &GateRun<'_>,
    paths: PathSet,
    progress: &mut dyn FnMut(usize),
) -> Result<(Vec<(usize, f32)>, f64)> {
    let t = web_time::Instant::now();
    let mut tr = Trainer::new(be, run.cfg, run.batch, run.params, None, run.optim, paths)?;
    let mut out = Vec::new();
    let (hx, hy) = &run.held_out;
    for step in 0..run.steps {
        let (x, y) = (run.batch_of)(step);
        tr.train_step(be, &x, &y, (run.lr_of)(step), run.seed)?;
        let done = step + 1;
        if done % run.every.max(1) == 0 || done == run.steps {
            out.push((done, tr.eval_loss_async(be, hx, hy).await?));
            progress(done);
        }
    }
    Ok((out, t.elapsed().as_secs_f64() * 1e3))
}

/// The first step's gradients on `paths` (same parameters, batch and dropout masks on every path).
async fn first_gradients(be: &Backend, run: &GateRun<'_>, paths: PathSet) -> Result<Vec<f32>> {
    let mut tr = Trainer::new(be, run.cfg, run.batch, run.params, None, run.optim, paths)?;
    let (x, y) = (run.batch_of)(0);
    tr.set_batch(be, &x, &y, true)?;
    tr.forward(be, true, run.seed)?;
    tr.backward(be, run.seed)?;
    tr.read_grads(be).await
}

/// Σ|fast − f32| / Σ|f32| over every gradient (infinite when one is not finite).
fn gradient_error(reference: &[f32], fast: &[f32]) -> f64 {
    let (mut diff, mut mag) = (0.0f64, 0.0f64);
    for (&r, &f) in reference.iter().zip(fast) {
        if !f.is_finite() {
            return f64::INFINITY;
        }
        diff += (f as f64 - r as f64).abs();
        mag += (r as f64).abs();
    }
    diff / mag.max(f64::MIN_POSITIVE)
}

/// Runs the training gate of `fast` (a trainer's path set holding a training fast path) against the
/// f32 path. `progress` hears (steps done, steps in all) over both runs.
pub async fn training_gate(
    be: &Backend,
    run: &GateRun<'_>,
    fast: PathSet,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<TrainGateReport> {
    let total = 2 * run.steps;
    let grad_error = gradient_error(
        &first_gradients(be, run, PathSet::F32).await?,
        &first_gradients(be, run, fast).await?,
    );
    let report = |points: Vec<LossPoint>, reason: Option<String>, ms: (f64, f64)| {
        let worst_rel = points.iter().map(LossPoint::rel).fold(0.0, f64::max);
        TrainGateReport {
            paths: Trainer::training_paths(fast, &run.optim)
                .iter()
                .map(|p| p.name().to_string())
                .collect(),
            steps: points.last().map_or(0, |p| p.step),
            grad_error,
            passed: reason.is_none() && !points.is_empty(),
            reason,
            points,
            worst_rel,
            tolerance: GATE_TOLERANCE,
            f32_ms: ms.0,
            fast_ms: ms.1,
        }
    };
    if grad_error.is_nan() || grad_error > GRAD_TOLERANCE {
        // A kernel that gets one step's gradients wrong need not be trained on to be refused.
        let why = format!(
            "first gradients {:.3}% off, limit {:.3}%",
            100.0 * grad_error,
            100.0 * GRAD_TOLERANCE
        );
        return Ok(report(Vec::new(), Some(why), (0.0, 0.0)));
    }
    let (reference, f32_ms) = losses(be, run, PathSet::F32, &mut |d| progress(d, total)).await?;
    let (got, fast_ms) = losses(be, run, fast, &mut |d| progress(run.steps + d, total)).await?;
    let points: Vec<LossPoint> = reference
        .iter()
        .zip(&got)
        .map(|(&(step, f32_loss), &(_, fast_loss))| LossPoint {
            step,
            f32_loss,
            fast_loss,
        })
        .collect();
    let reason = if let Some(p) = points.iter().find(|p| !p.fast_loss.is_finite()) {
        Some(format!("loss {} at step {}", p.fast_loss, p.step))
    } else {
        points.iter().find(|p| p.rel() > GATE_TOLERANCE).map(|p| {
            format!(
                "step {}: loss {:.4} against {:.4}",
                p.step, p.fast_loss, p.f32_loss
            )
        })
    };
    Ok(report(points, reason, (f32_ms, fast_ms)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpt::{Dataset, Layout};
    use tinygpt_kernels::PathId;
    use tinygpt_kernels::path::Fault;
    use tinygpt_kernels::testing::gpu_backend;

    /// A small model over the bundled text, with sequences past 128 positions (where the planted mask
    /// fault starts).
    fn setup() -> (GptConfig, Dataset, Vec<f32>) {
        let text = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/shakespeare.txt"
        ))
        .expect("the bundled text");
        let data = Dataset::from_bytes(&text[..200_000], 160).expect("a dataset");
        let cfg = GptConfig {
            vocab_size: data.vocab.len(),
            block_size: 160,
            n_layer: 2,
            n_head: 2,
            n_embd: 32,
            dropout: 0.0,
        };
        let params = Layout::new(&cfg).init(&cfg, 7);
        (cfg, data, params)
    }

    fn gate(be: &Backend, fault: Option<Fault>) -> TrainGateReport {
        let (cfg, data, params) = setup();
        // On the tensor cores the planted f16 accumulators round once per 16 values of K (a
        // fragment), not once per value as the tiled kernel's do: over this model's 640 rows a weight
        // gradient's first-step error stayed at 0.068% on an H100, under the gate's limit (the default
        // GPT's rows, 16,384, take it to 0.223%). There the batch gives K = 3,840 (no split-K): on an
        // H100 the fault's first gradients are then 0.132% off, the mask fault's 0.163% (limit 0.098%),
        // the healthy path's 0.028%.
        let coop = be.as_gpu().is_some_and(|g| {
            g.has_feature(tinygpt_kernels::wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
        });
        let batch = if coop { 24 } else { 4 };
        let batch_of = |s: usize| data.batch(false, 3, s as u64, batch, cfg.block_size);
        let run = GateRun {
            cfg: &cfg,
            batch,
            params: &params,
            optim: OptimConfig::default(),
            seed: 3,
            steps: 60,
            every: 20,
            batch_of: &batch_of,
            lr_of: &|_| 3e-3,
            held_out: data.batch(true, 4, 0, batch, cfg.block_size),
        };
        let fast = PathSet::of(&[PathId::MixedTraining]).with_fault(fault);
        let r = pollster::block_on(training_gate(be, &run, fast, &mut |_, _| {})).unwrap();
        eprintln!("{fault:?}: {}", r.log_line());
        r
    }

    /// The training path (on lavapipe on the tiled kernel's f16 operands; on an adapter with
    /// cooperative matrices on the tensor cores, with a longer K) trains like the f32 path; f16
    /// accumulation in the weight gradients and a causal mask that leaks past 128 positions each fail
    /// the gate.
    #[test]
    fn training_gate_passes_f16_operands_and_rejects_planted_faults() {
        let Some(be) = gpu_backend(None) else { return };
        let healthy = gate(&be, None);
        assert!(healthy.passed, "{}", healthy.log_line());
        assert!(healthy.points.len() == 3 && healthy.worst_rel > 0.0);
        assert!(healthy.grad_error > 0.0 && healthy.grad_error <= GRAD_TOLERANCE);
        for fault in [Fault::WeightGradF16Accumulation, Fault::CausalMaskPast128] {
            let r = gate(&be, Some(fault));
            assert!(!r.passed, "{fault:?} passed: {}", r.log_line());
        }
    }
}
