//! Gating for a model in one call: the op gates at the device's default shapes and the model's own,
//! then the token gate on the model itself, then one telemetry record. The result is the [`PathSet`] to
//! build the model's runner with.

use std::future::Future;

use super::{
    GateCase, GateOptions, GateRecord, GateSummary, TokenOutcome, VerdictStore, run_gates,
    token_gate,
};
use crate::backend::Backend;
use crate::path::{PathId, PathSet};

/// A model the gate can check end to end.
pub trait GateModel {
    type Error: std::fmt::Display;
    /// Shapes of the model's own products, gated beside the default ones.
    fn gate_cases(&self) -> Vec<GateCase>;
    /// Whether the model's runner has kernels that `path` replaces (a model without quantized
    /// weights gains nothing from a quantized-product path, and its gate would only cost time).
    fn uses(&self, path: PathId) -> bool {
        let _ = path;
        true
    }
    /// Identifies the weights (and the token gate's prompt) in the token gate's store key.
    fn model_key(&self) -> String;
    /// The first greedy tokens of a fixed prompt with a runner built for `paths`.
    fn greedy(
        &self,
        be: &Backend,
        paths: PathSet,
    ) -> impl Future<Output = Result<Vec<u32>, Self::Error>>;
}

/// What gating decided.
#[derive(Clone, Debug)]
pub struct Gated {
    /// The paths to build the runner with.
    pub paths: PathSet,
    pub summary: GateSummary,
    /// The token gate's outcome (None when no fast path passed the op gates, or on the CPU).
    pub token: Option<TokenOutcome>,
}

/// Gates `model` on `be`: op gates (stored verdicts reused unless `opts.regate`), then the token gate
/// over the paths that passed. Each log line goes to `log` as it is decided; the run is recorded in
/// `store`. On the CPU backend the CPU's own paths are gated the same way.
pub async fn gate_for_model<M: GateModel>(
    be: &Backend,
    store: &mut dyn VerdictStore,
    model: &M,
    opts: &GateOptions,
    log: &mut dyn FnMut(&str),
) -> Result<Gated, M::Error> {
    let opts = model_options(model, opts);
    let summary = run_gates(be, &opts, store).await;
    for r in &summary.reports {
        log(&r.log_line());
    }
    let passed = summary.active();
    let (paths, token) = if passed.is_empty() {
        (passed, None)
    } else {
        let t = token_gate(
            be,
            store,
            &model.model_key(),
            passed,
            opts.regate,
            async |p| model.greedy(be, p).await,
            log,
        )
        .await?;
        (t.kept_set(passed), Some(t))
    };
    store.record(&record(&summary, model.model_key(), token.clone()));
    Ok(Gated {
        paths,
        summary,
        token,
    })
}

/// The paths [`gate_for_model`] would give `model` on `be` if every verdict it needs (op gates at the
/// model's shapes, then the token gate) is stored; None when something would have to be measured. A
/// caller that must not hold the first token hostage starts on the f32 path when this is None and
/// gates in the background.
pub fn stored_verdict<M: GateModel>(
    be: &Backend,
    store: &mut dyn VerdictStore,
    model: &M,
    opts: &GateOptions,
) -> Option<PathSet> {
    let opts = model_options(model, opts);
    let passed = super::stored_passes(be, &opts, store)?;
    super::token::stored_token_verdict(be, store, &model.model_key(), passed)
}

/// `opts` for `model`: its shapes added, and only the paths it uses.
fn model_options<M: GateModel>(model: &M, opts: &GateOptions) -> GateOptions {
    let mut opts = opts.clone();
    opts.extra_cases.extend(model.gate_cases());
    let allowed = opts.only.take().unwrap_or_else(|| PathId::ALL.to_vec());
    opts.only = Some(allowed.into_iter().filter(|&p| model.uses(p)).collect());
    opts
}

/// The op gates alone (no model): for `tinygpt gates` and benchmarks of bare kernels.
pub async fn gate_device(
    be: &Backend,
    store: &mut dyn VerdictStore,
    opts: &GateOptions,
    log: &mut dyn FnMut(&str),
) -> Gated {
    let summary = run_gates(be, opts, store).await;
    for r in &summary.reports {
        log(&r.log_line());
    }
    store.record(&record(&summary, "device".into(), None));
    Gated {
        paths: summary.active(),
        summary,
        token: None,
    }
}

fn record(summary: &GateSummary, subject: String, token: Option<TokenOutcome>) -> GateRecord {
    GateRecord {
        time_unix: web_time::SystemTime::now()
            .duration_since(web_time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        adapter: summary.adapter.clone(),
        driver: summary.driver.clone(),
        subject,
        gate_ms: summary.millis + token.as_ref().map_or(0.0, |t| t.millis),
        paths: summary.reports.clone(),
        token,
    }
}
