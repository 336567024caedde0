//! Batched autoregressive decoding of many prompts at once (data regeneration for training).
//!
//! Invariants:
//! - Every sequence produces exactly what [`crate::generate_ar`] produces for it alone (greedy:
//!   the same tokens, up to float reassociation of a wider matmul; sampled: the same seeded stream
//!   per sequence, independent of which other prompts share the batch).
//! - Prompts are left-padded to one length; a padding key is hidden from every query except its own
//!   row (so no softmax row is empty) and never from a real token's point of view, and positions
//!   count real tokens only, so a padded row computes what an unpadded one does.
//! - Finished sequences leave the batch (their cache rows are dropped) once enough of them have
//!   finished, so a long answer does not keep short ones computing.

use crate::ar::{token_budget, StopReason};
use crate::sampling::{greedy_rows, Sampler, SamplingConfig};
use crate::Result;
use candle_core::{Device, Tensor};
use dflash_models::{BatchForwardRequest, LogitRows, TargetModel};

#[derive(Debug, Clone)]
pub struct BatchConfig {
    pub max_new_tokens: usize,
    pub stop_tokens: Vec<u32>,
    pub sampling: SamplingConfig,
    /// Prompt tokens per prefill forward (bounds the attention score memory).
    pub prefill_chunk: usize,
}

#[derive(Debug, Clone)]
pub struct BatchOutput {
    pub tokens: Vec<u32>,
    pub stop_reason: StopReason,
}

struct Row {
    /// index into the caller's prompts
    id: usize,
    pad: usize,
    budget: usize,
    context_bound: bool,
    out: Vec<u32>,
    done: Option<StopReason>,
    sampler: Sampler,
}

/// Decodes every prompt; `seed_of(i)` seeds prompt `i`'s sampler (ignored when greedy).
pub fn generate_ar_batch(
    target: &dyn TargetModel,
    prompts: &[Vec<u32>],
    cfg: &BatchConfig,
    seed_of: &dyn Fn(usize) -> u64,
) -> Result<Vec<BatchOutput>> {
    if prompts.is_empty() {
        return Ok(vec![]);
    }
    let dev = target.info().device.clone();
    let ctx = target.info().max_position_embeddings;
    let width = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
    let mut rows = Vec::with_capacity(prompts.len());
    for (id, p) in prompts.iter().enumerate() {
        let (budget, context_bound) = token_budget(p.len(), cfg.max_new_tokens, ctx)?;
        let mut sampling = cfg.sampling.clone();
        sampling.seed = seed_of(id);
        rows.push(Row {
            id,
            pad: width - p.len(),
            budget,
            context_bound,
            out: vec![],
            done: None,
            sampler: Sampler::new(sampling)?,
        });
    }
    let max_budget = rows.iter().map(|r| r.budget).max().unwrap_or(0);
    let capacity = width + max_budget;
    let mut cache = target.new_cache(capacity)?;
    // per-row key visibility of the cache columns: -inf on left padding, 0 elsewhere
    let mut key_mask: Vec<f32> = Vec::with_capacity(rows.len() * capacity);
    for r in &rows {
        key_mask.extend((0..capacity).map(|j| if j < r.pad { f32::NEG_INFINITY } else { 0.0 }));
    }
    let mut key_mask = Tensor::from_vec(key_mask, (rows.len(), capacity), &dev)?;

    // prefill in chunks over the padded width
    let chunk = cfg.prefill_chunk.max(1);
    let mut logits = None;
    let mut c0 = 0;
    while c0 < width {
        let c1 = (c0 + chunk).min(width);
        let n = c1 - c0;
        let pads: Vec<u32> = rows.iter().map(|r| r.pad as u32).collect();
        let (mut toks, mut pos, mut mask) = (vec![], vec![], vec![]);
        for (r, p) in rows.iter().zip(prompts) {
            for g in c0..c1 {
                let real = g >= r.pad;
                toks.push(if real { p[g - r.pad] } else { 0 });
                pos.push(if real { (g - r.pad) as u32 } else { 0 });
                mask.extend((0..c1).map(|k| {
                    let visible = k <= g && (k >= r.pad || k == g);
                    if visible {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                }));
            }
        }
        let req = BatchForwardRequest {
            batch: rows.len(),
            tokens: &toks,
            positions: &pos,
            mask: Tensor::from_vec(mask, (rows.len(), n, c1), &dev)?,
            // causal behind each row's left padding
            causal_from: Some(&pads),
            taps: &[],
            logits: if c1 == width {
                LogitRows::Last
            } else {
                LogitRows::None
            },
        };
        logits = target.forward_batch(&req, &mut cache)?.logits;
        c0 = c1;
    }
    let mut logits = logits.expect("the last prefill chunk asks for logits");
    let mut finished: Vec<Row> = vec![];
    let mut step = 0usize;
    loop {
        let next = pick(&mut rows, &logits, &cfg.sampling)?;
        for (r, t) in rows.iter_mut().zip(&next) {
            if r.done.is_some() {
                continue;
            }
            if r.out.len() >= r.budget {
                r.done = Some(budget_reason(r));
                continue;
            }
            r.out.push(*t);
            if cfg.stop_tokens.contains(t) {
                r.done = Some(StopReason::Eos);
            } else if r.out.len() >= r.budget {
                r.done = Some(budget_reason(r));
            }
        }
        let n_done = rows.iter().filter(|r| r.done.is_some()).count();
        if n_done == rows.len() {
            finished.append(&mut rows);
            break;
        }
        if n_done > 0 && n_done * 8 >= rows.len() {
            let keep: Vec<u32> = (0..rows.len() as u32)
                .filter(|&i| rows[i as usize].done.is_none())
                .collect();
            cache.select_batch(&keep)?;
            let idx = Tensor::from_slice(&keep, keep.len(), &dev)?;
            key_mask = key_mask.index_select(&idx, 0)?;
            let mut kept = vec![];
            for r in rows.drain(..) {
                if r.done.is_some() {
                    finished.push(r);
                } else {
                    kept.push(r);
                }
            }
            rows = kept;
        }
        // every live row feeds its last token; finished-but-kept rows feed a harmless copy
        let toks: Vec<u32> = rows
            .iter()
            .map(|r| r.out.last().copied().unwrap_or(0))
            .collect();
        let pos: Vec<u32> = rows.iter().map(|r| (width - r.pad + step) as u32).collect();
        let pads: Vec<u32> = rows.iter().map(|r| r.pad as u32).collect();
        let kv_len = cache.len() + 1;
        let mask = key_mask.narrow(1, 0, kv_len)?.unsqueeze(1)?;
        let req = BatchForwardRequest {
            batch: rows.len(),
            tokens: &toks,
            positions: &pos,
            mask,
            causal_from: Some(&pads),
            taps: &[],
            logits: LogitRows::Last,
        };
        logits = target
            .forward_batch(&req, &mut cache)?
            .logits
            .expect("asked for logits");
        step += 1;
    }
    finished.sort_by_key(|r| r.id);
    Ok(finished
        .into_iter()
        .map(|r| BatchOutput {
            tokens: r.out,
            stop_reason: r.done.unwrap_or(StopReason::MaxTokens),
        })
        .collect())
}

fn budget_reason(r: &Row) -> StopReason {
    if r.context_bound {
        StopReason::ContextLength
    } else {
        StopReason::MaxTokens
    }
}

/// The next token of every row from `[rows, 1, vocab]` logits: [`greedy_rows`] on the device when
/// greedy (only `rows` ids cross to the host, ties to the lowest id as in single-sequence
/// decoding), else each row's own sampler.
fn pick(rows: &mut [Row], logits: &Tensor, sampling: &SamplingConfig) -> Result<Vec<u32>> {
    let logits = logits.squeeze(1)?;
    if sampling.is_greedy() {
        return greedy_rows(&logits);
    }
    let host: Vec<Vec<f32>> = logits.to_device(&Device::Cpu)?.to_vec2()?;
    Ok(rows
        .iter_mut()
        .zip(&host)
        .map(|(r, l)| r.sampler.sample(l))
        .collect())
}
