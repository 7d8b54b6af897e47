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
    mut on_token: impl AsyncFnMut(u32) -> Result<bool, E>,
) -> Result<Generated, E> {
    let mut g = Generated {
        finish: Finish::MaxTokens,
        tokens: 0,
        passes: 0,
    };
    if max_new == 0 {
        return Ok(g);
    }
    let on_device = sampler.is_greedy() && llm.picks_on_device() && be.as_gpu().is_some();
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
        }
        return Ok(g);
    }
    llm.pick_greedy(be)?;
    let mut pending = llm.read_picks(be)?;
    loop {
        // Feed the token just picked (still on the device) unless the loop ends whatever it is.
        let ahead = g.tokens + 1 < max_new && llm.position() < llm.context();
        let next = if ahead {
            llm.decode_step(be, &mut [], Feed::Picked)?;
            llm.pick_greedy(be)?;
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
            break;
        }
        g.tokens += 1;
        if !on_token(id).await? {
            undo(llm);
            g.finish = Finish::Stopped;
            break;
        }
        match next {
            Some(p) => {
                pending = p;
                g.passes += 1;
            }
            None => {
                if g.tokens < max_new {
                    g.finish = Finish::ContextFull;
                }
                break;
            }
        }
    }
    Ok(g)
}
