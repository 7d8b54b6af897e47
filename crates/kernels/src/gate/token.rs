//! The end-to-end token gate: the op gates check each kernel at a few shapes; this checks a whole model.
//! A fixed prompt's first greedy tokens on the canonical f32 path are the reference; the fast paths must
//! give the same tokens. When they diverge, each path is tried on its own (with the paths it needs) and
//! every path whose tokens leave the f32 path's is dropped. The verdict is stored under the adapter,
//! driver, the paths' kernel versions and the model's key, so a later start with the same model skips it.

use serde::{Deserialize, Serialize};
use web_time::Instant;

use super::registry::def;
use super::{VerdictStore, adapter_key, first_divergence};
use crate::backend::Backend;
use crate::path::{PathId, PathSet};

/// What the token gate decided.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TokenOutcome {
    /// The store key of the verdict.
    pub key: String,
    /// Greedy tokens compared (0 when the verdict came from the store).
    pub tokens: usize,
    /// Paths that kept the f32 path's tokens.
    pub kept: Vec<PathId>,
    /// Paths dropped, with the token position where each one's output left the f32 path's.
    pub dropped: Vec<(PathId, usize)>,
    pub from_cache: bool,
    pub millis: f64,
}

impl TokenOutcome {
    pub fn kept_set(&self, within: PathSet) -> PathSet {
        within.intersect(self.kept.iter().copied().collect())
    }
}

/// The store key of the token gate's verdict for `active` on `be`'s adapter and the model `model_key`
/// (the paths' kernel versions and the kernels' digest are part of it).
fn token_key(be: &Backend, model_key: &str, active: PathSet) -> String {
    let versions: Vec<String> = active
        .iter()
        .map(|p| format!("{}v{}", p.name(), p.kernel_version()))
        .collect();
    let adapter = adapter_key(be);
    let digest = super::kernels_digest();
    format!(
        "token|{adapter}|{}|k{digest}|{model_key}",
        versions.join(",")
    )
}

/// The paths of `active` a stored token verdict kept, if one is stored under `key`.
fn stored_kept(store: &mut dyn VerdictStore, key: &str, active: PathSet) -> Option<PathSet> {
    let names = serde_json::from_str::<Vec<String>>(&store.load(key)?).ok()?;
    Some(
        active
            .iter()
            .filter(|p| names.iter().any(|n| n == p.name()))
            .collect(),
    )
}

/// The paths a stored token verdict keeps of `active` (the paths the op gates passed) for the model
/// `model_key`, if one is stored: with [`super::stored_passes`], whether gating a model will be instant.
pub fn stored_token_verdict(
    be: &Backend,
    store: &mut dyn VerdictStore,
    model_key: &str,
    active: PathSet,
) -> Option<PathSet> {
    if active.is_empty() {
        return Some(active);
    }
    stored_kept(store, &token_key(be, model_key, active), active)
}

/// Runs the token gate for `active` (the paths the op gates passed) and returns its outcome; the paths
/// to use are `outcome.kept_set(active)`. `greedy(paths)` produces the model's greedy tokens of a fixed
/// prompt on the kernels of `paths`. An error on the f32 path is the model's own failure and is returned;
/// an error on a fast path rejects that path. Log lines go to `log` as they happen.
pub async fn token_gate<E: std::fmt::Display>(
    be: &Backend,
    store: &mut dyn VerdictStore,
    model_key: &str,
    active: PathSet,
    regate: bool,
    mut greedy: impl AsyncFnMut(PathSet) -> Result<Vec<u32>, E>,
    log: &mut dyn FnMut(&str),
) -> Result<TokenOutcome, E> {
    let t0 = Instant::now();
    let key = token_key(be, model_key, active);
    let mut outcome = TokenOutcome {
        key: key.clone(),
        tokens: 0,
        kept: Vec::new(),
        dropped: Vec::new(),
        from_cache: false,
        millis: 0.0,
    };
    if active.is_empty() {
        return Ok(outcome);
    }
    let stored = (!regate)
        .then(|| stored_kept(store, &key, active))
        .flatten();
    if let Some(kept) = stored {
        outcome.kept = kept.iter().collect();
        outcome.from_cache = true;
        log(&format!(
            "[ops] token gate: cached verdict for this model and adapter — {}",
            if outcome.kept.len() == active.len() {
                "PASS".to_string()
            } else {
                format!("{} of {} paths kept", outcome.kept.len(), active.len())
            }
        ));
        return Ok(outcome);
    }
    let reference = greedy(PathSet::F32).await?;
    outcome.tokens = reference.len();
    log(&format!(
        "[ops] token gate: {} greedy tokens on the f32 path in {:.1} s; now the fast paths",
        reference.len(),
        t0.elapsed().as_secs_f64()
    ));
    let fast = greedy(active).await;
    match fast.map(|f| first_divergence(&reference, &f)) {
        Ok(None) => {
            log(&format!(
                "[ops] token gate: {} greedy tokens identical on the f32 and fast paths — PASS",
                reference.len()
            ));
            outcome.kept = active.iter().collect();
        }
        first => {
            log(&match first {
                Ok(Some(pos)) => format!(
                    "[ops] token gate: fast paths diverge from the f32 path at token {pos} — checking each path"
                ),
                Err(e) => {
                    format!("[ops] token gate: the fast paths failed ({e}) — checking each path")
                }
                Ok(None) => unreachable!("handled above"),
            });
            let mut keep = PathSet::F32;
            for p in active.iter() {
                // A path is checked together with the paths it needs; without them it is dropped.
                if let Some(missing) = def(p).requires.iter().find(|r| !keep.has(**r)) {
                    log(&format!(
                        "[ops] token gate: {} needs {}, which was dropped — off",
                        p.name(),
                        missing.name()
                    ));
                    outcome.dropped.push((p, 0));
                    continue;
                }
                let with = active.intersect(keep.with(p));
                let verdict = greedy(with).await.map(|t| first_divergence(&reference, &t));
                match verdict {
                    Ok(None) => keep = keep.with(p),
                    Ok(Some(at)) => {
                        log(&format!(
                            "[ops] token gate: {} diverges at token {at} — FAIL, falling back to f32 for it",
                            p.name()
                        ));
                        outcome.dropped.push((p, at));
                    }
                    Err(e) => {
                        log(&format!(
                            "[ops] token gate: {} failed ({e}) — FAIL, falling back to f32 for it",
                            p.name()
                        ));
                        outcome.dropped.push((p, 0));
                    }
                }
            }
            outcome.kept = keep.iter().collect();
        }
    }
    let names: Vec<&str> = outcome.kept.iter().map(|p| p.name()).collect();
    store.store(&key, serde_json::to_string(&names).ok().as_deref());
    outcome.millis = t0.elapsed().as_secs_f64() * 1e3;
    Ok(outcome)
}
