//! Plain autoregressive decoding with the target alone — the reference every other mode must equal.
//!
//! Invariants: the prompt is prefilled in one causal block; each step feeds exactly the last
//! committed token at its position; generation stops right after a stop token is emitted (the stop
//! token is part of the output, as in transformers) or when `max_new_tokens` tokens exist; the cache
//! never grows past `prompt + max_new_tokens`.

use crate::sampling::{Sampler, SamplingConfig};
use crate::{DecodeError, Result};
use candle_core::Tensor;
use dflash_models::{ForwardRequest, LogitRows, TargetModel};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct GenerateConfig {
    pub max_new_tokens: usize,
    pub stop_tokens: Vec<u32>,
    pub sampling: SamplingConfig,
    /// Set by the caller (from the token callback or another thread) to end the generation
    /// right after the token being emitted, with [`StopReason::Cancelled`]: a server's stop
    /// string matched, its client gone. `None`: generation runs to a stop token or the budget.
    pub cancel: Option<Arc<AtomicBool>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// A stop token was generated.
    Eos,
    /// `max_new_tokens` reached.
    MaxTokens,
    /// The model's context is full.
    ContextLength,
    /// The caller asked to stop ([`GenerateConfig::cancel`]).
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub stop_reason: StopReason,
    pub prompt_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// Target forwards after the prefill.
    pub steps: usize,
    /// [`generate_ar_with_margins`] only: top-1 − top-2 logit margin of each emitted token (to
    /// explain near-tie flips); empty otherwise.
    pub margins: Vec<f32>,
    /// Speculative modes only: per-step acceptance and timings.
    pub spec: Option<crate::spec::SpecStats>,
}

/// Collects emitted tokens and decides when generation stops, identically for every mode.
pub(crate) struct Emitter<'a> {
    tokens: Vec<u32>,
    budget: usize,
    context_bound: bool,
    stop_tokens: &'a [u32],
    cancel: Option<&'a AtomicBool>,
}

impl<'a> Emitter<'a> {
    pub(crate) fn new(budget: usize, context_bound: bool, cfg: &'a GenerateConfig) -> Self {
        Self {
            tokens: Vec::with_capacity(budget),
            budget,
            context_bound,
            stop_tokens: &cfg.stop_tokens,
            cancel: cfg.cancel.as_deref(),
        }
    }

    /// Emits `tok`; returns why generation must stop now, if it must.
    pub(crate) fn push(&mut self, tok: u32, on_token: &mut dyn FnMut(u32)) -> Option<StopReason> {
        self.tokens.push(tok);
        on_token(tok);
        if self.stop_tokens.contains(&tok) {
            return Some(StopReason::Eos);
        }
        if self.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Some(StopReason::Cancelled);
        }
        if self.tokens.len() >= self.budget {
            return Some(if self.context_bound {
                StopReason::ContextLength
            } else {
                StopReason::MaxTokens
            });
        }
        None
    }

    pub(crate) fn finish(self, reason: StopReason) -> (Vec<u32>, StopReason) {
        (self.tokens, reason)
    }
}

/// Checks the prompt against the context and returns how many tokens may be generated.
pub fn token_budget(prompt: usize, max_new: usize, context: usize) -> Result<(usize, bool)> {
    if prompt == 0 {
        return Err(DecodeError::InvalidInput("empty prompt".into()));
    }
    if prompt >= context {
        return Err(DecodeError::PromptTooLong { prompt, context });
    }
    let room = context - prompt;
    Ok((max_new.min(room), max_new > room))
}

/// Autoregressive generation; `on_token` sees each new token as soon as it is chosen. Greedy
/// steps pick the token where the logits are: only its id crosses to the host.
pub fn generate_ar(
    target: &dyn TargetModel,
    prompt: &[u32],
    cfg: &GenerateConfig,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation> {
    ar_loop(target, prompt, cfg, false, on_token)
}

/// [`generate_ar`] that also records each emitted token's top-1 − top-2 logit margin
/// (`Generation::margins`), which copies every step's logits row to the host: for diagnosis
/// (`--ids`, near-tie flips), never for timing.
pub fn generate_ar_with_margins(
    target: &dyn TargetModel,
    prompt: &[u32],
    cfg: &GenerateConfig,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation> {
    ar_loop(target, prompt, cfg, true, on_token)
}

fn ar_loop(
    target: &dyn TargetModel,
    prompt: &[u32],
    cfg: &GenerateConfig,
    with_margins: bool,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation> {
    let choose = |sampler: &mut Sampler, logits: &Tensor| -> Result<(u32, f32)> {
        if with_margins {
            let (t, m) = sampler.sample_rows_with_margin(logits)?;
            Ok((t[0], m[0]))
        } else {
            Ok((sampler.sample_rows(logits)?[0], f32::NAN))
        }
    };
    let (budget, context_bound) = token_budget(
        prompt.len(),
        cfg.max_new_tokens,
        target.info().max_position_embeddings,
    )?;
    let mut sampler = Sampler::new(cfg.sampling.clone())?;
    let mut cache = target.take_cache(prompt.len() + budget)?;
    let t0 = Instant::now();
    let positions: Vec<u32> = (0..prompt.len() as u32).collect();
    let out = target.forward(
        &ForwardRequest::causal(prompt, &positions, LogitRows::Last),
        &mut cache,
    )?;
    let (mut next, m) = choose(&mut sampler, out.logits.as_ref().expect("asked for logits"))?;
    let mut margins = vec![m];
    let prefill_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut emit = Emitter::new(budget, context_bound, cfg);
    let mut steps = 0;
    let stop_reason = loop {
        if budget == 0 {
            break StopReason::MaxTokens;
        }
        if let Some(reason) = emit.push(next, on_token) {
            break reason;
        }
        let pos = [(prompt.len() + steps) as u32];
        let out = target.forward(
            &ForwardRequest::causal(&[next], &pos, LogitRows::Last),
            &mut cache,
        )?;
        steps += 1;
        let (t, m) = choose(&mut sampler, out.logits.as_ref().expect("asked for logits"))?;
        next = t;
        margins.push(m);
    };
    let (tokens, stop_reason) = emit.finish(stop_reason);
    target.recycle_cache(cache);
    margins.truncate(tokens.len());
    if !with_margins {
        margins.clear();
    }
    Ok(Generation {
        tokens,
        stop_reason,
        prompt_tokens: prompt.len(),
        prefill_seconds,
        decode_seconds: t1.elapsed().as_secs_f64(),
        steps,
        spec: None,
        margins,
    })
}
