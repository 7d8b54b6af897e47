//! Token generation for one sequence, as `run`, `chat` and the playground do it.
//!
//! Greedy decoding on a GPU never waits for the device between tokens: each pass picks its token on the
//! device (argmax), the next pass is recorded to read it from there and submitted, and only then does the
//! host wait for the token before (4 bytes) to stream its text. The host's recording of pass t + 1
//! overlaps the device's work on pass t. Generation that ends on a token the host only sees afterwards
//! (end of generation, or the caller stopping) rolls that one speculative pass back, so the sequence
//! ends exactly as the one-pass-at-a-time loop leaves it: the prompt and every generated token but the
//! last (an end-of-generation token is never fed). Sampling with a temperature reads the logits, picks
//! on the host and feeds the id: one round trip per token.

use tinygpt_kernels::Backend;

use super::drift::{DriftEvent, DriftGuard};
use super::error::LlmError;
use super::model::{Feed, Llm};
use crate::sampler::Sampler;

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The model produced an end-of-generation token.
    EndOfGeneration,
    /// `max_new` tokens were generated.
    MaxTokens,
    /// The sequence holds as many positions as the cache.
    ContextFull,
    /// The caller asked to stop.
    Stopped,
}

/// What a generation did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Generated {
    pub finish: Finish,
    /// Tokens handed to the caller.
    pub tokens: usize,
    /// Decode passes that count (a rolled-back speculative pass does not).
    pub passes: usize,
}

/// Generates up to `max_new` tokens after what the model's sequence holds (the last pass's logits must
/// be ready: after [`Llm::feed`]). Each token goes to `on_token`, which returns whether to go on; an
/// end-of-generation token (`is_eog`) ends generation without being handed over.
pub async fn generate<E: From<LlmError>>(
    be: &Backend,
    llm: &mut Llm,
    sampler: &mut Sampler,
    max_new: usize,
    is_eog: impl Fn(u32) -> bool,
    on_token: impl AsyncFnMut(u32) -> Result<bool, E>,
) -> Result<Generated, E> {
    generate_guarded(be, llm, sampler, max_new, is_eog, on_token, None, |_| {}).await
}

/// [`generate`] watched by a drift guard: at each check it is due, the step just taken is compared
/// with the f32 path's, and when the guard trips (`on_drift` hears of it) generation goes on with the
/// model on the f32 path, from the same tokens.
#[allow(clippy::too_many_arguments)]
pub async fn generate_guarded<E: From<LlmError>>(
    be: &Backend,
    llm: &mut Llm,
    sampler: &mut Sampler,
    max_new: usize,
    is_eog: impl Fn(u32) -> bool,
    on_token: impl AsyncFnMut(u32) -> Result<bool, E>,
    guard: Option<&mut DriftGuard>,
    on_drift: impl FnMut(&DriftEvent),
) -> Result<Generated, E> {
    generate_watched(
        be,
        llm,
        sampler,
        max_new,
        is_eog,
        on_token,
        guard,
        on_drift,
        |_| Ok(false),
    )
    .await
}

/// [`generate_guarded`] that also lets `switch` move the model to other paths between two steps (a
/// model that started on the f32 path while its fast paths were gated in the background moves to
/// them when they pass): `switch` returns true when it did, with [`Llm::switch_paths`], so that the
/// model's next logits are those of its new paths. The guard checks only while the model is on fast
/// paths.
#[allow(clippy::too_many_arguments)]
pub async fn generate_watched<E: From<LlmError>>(
    be: &Backend,
    llm: &mut Llm,
    sampler: &mut Sampler,
    max_new: usize,
    is_eog: impl Fn(u32) -> bool,
    mut on_token: impl AsyncFnMut(u32) -> Result<bool, E>,
    mut guard: Option<&mut DriftGuard>,
    mut on_drift: impl FnMut(&DriftEvent),
    mut switch: impl FnMut(&mut Llm) -> Result<bool, LlmError>,
) -> Result<Generated, E> {
    let mut g = Generated {
        finish: Finish::MaxTokens,
        tokens: 0,
        passes: 0,
    };
    if max_new == 0 {
        return Ok(g);
    }
    // After each step: the guard takes a verdict that is ready, and checks the step that fed the token
    // at the model's last position when one is due. True when it moved the model to the f32 path
    // (whose logits after the same tokens are then ready).
    let mut check = async |llm: &mut Llm, logits: Option<&[f32]>| -> Result<bool, LlmError> {
        if switch(llm)? {
            return Ok(true);
        }
        let Some(guard) = guard.as_deref_mut().filter(|_| !llm.paths().is_empty()) else {
            return Ok(false);
        };
        let mut event = guard.poll(be, llm)?;
        if event.is_none() && guard.due(llm.position().saturating_sub(1)) {
            let read;
            let fast = match logits {
                Some(l) => l,
                None => {
                    read = llm.read_logits(be).await?;
                    &read
                }
            };
            event = guard.check(be, llm, fast).await?;
        }
        match event {
            Some(e) => {
                on_drift(&e);
                Ok(true)
            }
            None => Ok(false),
        }
    };
    // On a GPU the tokens are picked where the logits are (greedy, or sampled from the top-k on the
    // device) and only their ids come back; the next pass is recorded before the host reads them.
    // A sampled token's settings go to the device before its pass is recorded (a write flushes the
    // work recorded before it: so the step stays one submit); `sampled` says whether they did.
    let prepare = |llm: &mut Llm, sampler: &mut Sampler| -> Result<bool, LlmError> {
        match sampler.device_row().filter(|r| r.temperature > 0.0) {
            Some(r) => llm.set_sampling(be, &[r]).map(|_| true),
            None => Ok(false),
        }
    };
    let pick = |llm: &mut Llm, sampled: bool| -> Result<(), LlmError> {
        if sampled {
            llm.pick_set(be)
        } else {
            llm.pick_greedy(be)
        }
    };
    'paths: loop {
        let on_device = (sampler.is_greedy() || sampler.fits_device())
            && llm.picks_on_device()
            && be.as_gpu().is_some();
        if !on_device {
            let mut logits = llm.read_logits(be).await?;
            loop {
                let id = sampler.sample(&logits);
                if is_eog(id) {
                    g.finish = Finish::EndOfGeneration;
                    break;
                }
                g.tokens += 1;
                if !on_token(id).await? {
                    g.finish = Finish::Stopped;
                    break;
                }
                if g.tokens >= max_new {
                    break;
                }
                if llm.position() >= llm.context() {
                    g.finish = Finish::ContextFull;
                    break;
                }
                llm.decode_step(be, &mut [], Feed::Ids(&[id]))?;
                g.passes += 1;
                logits = llm.read_logits(be).await?;
                if check(llm, Some(&logits)).await? {
                    logits = llm.read_logits(be).await?;
                }
            }
            break 'paths;
        }
        let sampled = prepare(llm, sampler)?;
        pick(llm, sampled)?;
        let mut pending = llm.read_picks(be)?;
        loop {
            // Feed the token just picked (still on the device) unless the loop ends whatever it is.
            let ahead = g.tokens + 1 < max_new && llm.position() < llm.context();
            let next = if ahead {
                let sampled = prepare(llm, sampler)?;
                llm.decode_step(be, &mut [], Feed::Picked)?;
                pick(llm, sampled)?;
                Some(llm.read_picks(be)?)
            } else {
                None
            };
            let id = llm.finish_picks(be, pending).await?[0];
            let undo = |llm: &mut Llm| {
                if ahead {
                    let p = llm.position();
                    llm.truncate(p - 1);
                }
            };
            if is_eog(id) {
                undo(llm);
                g.finish = Finish::EndOfGeneration;
                break 'paths;
            }
            g.tokens += 1;
            if !on_token(id).await? {
                undo(llm);
                g.finish = Finish::Stopped;
                break 'paths;
            }
            match next {
                Some(p) => {
                    g.passes += 1;
                    // The pass just recorded fed `id`: a check reads its logits (waiting for it).
                    if check(llm, None).await? {
                        // The pick it made on the fast paths is dropped: the f32 path picks again.
                        continue 'paths;
                    }
                    pending = p;
                }
                None => {
                    if g.tokens < max_new {
                        g.finish = Finish::ContextFull;
                    }
                    break 'paths;
                }
            }
        }
    }
    // A verdict still being computed is waited for: the run reports it, and a model it moves to the
    // f32 path stays there for what comes next (a chat's next turn).
    if let Some(guard) = guard
        && let Some(e) = guard.settle(be, llm).await?
    {
        on_drift(&e);
    }
    Ok(g)
}
