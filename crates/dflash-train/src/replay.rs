//! Replay of speculative decoding on a known continuation with the training-mode forward: the
//! forward `train` optimises and validates with drafts a block at every anchor of a sequence in
//! one pass, and walking those blocks the way decoding walks gives the steps decoding would take.
//!
//! Invariants:
//! - A block anchored at position `a` sees the target's taps strictly before `a` and its anchor
//!   token (the training forward's block mask), so its drafts do not depend on which other anchors
//!   share the pass, and equal what the inference path drafts after accepting `tokens[..=a]`.
//! - Drafts are chosen as decoding chooses them: each row's argmax (lowest id on ties) for
//!   DFlash; DDTree's tree from the rows' log-softmax top-k, walked along the true continuation.
//! - So under greedy decoding (f32, no near-ties) the replayed steps of an output equal the steps
//!   `generate_speculative` measured for it, except the last: decoding may accept drafts past
//!   the output's end (a stop token, the token budget), which the replay cannot see. Any other
//!   difference is a train/inference mismatch.
//! - [`bootstrap_ci95`] is deterministic: the same per-prompt sums give the same interval.

use crate::Result;
use candle_core::{DType, Tensor, D};
use dflash_core::Grad;
use dflash_decoding::sampling::greedy_rows;
use dflash_decoding::tree::build_tree;
use dflash_models::drafter::BlockConvention;
use dflash_models::{DFlashDrafter, TargetModel};
use rand::{Rng, SeedableRng};

/// Drafted tokens a verifier following the true continuation accepts at each anchor.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AnchorAcceptance {
    pub anchors: Vec<u32>,
    /// Single-path DFlash: the leading drafts that equal the continuation.
    pub dflash: Vec<usize>,
    /// DDTree: one list per budget (in the order asked), the accepted depth of the tree.
    pub ddtree: Vec<Vec<usize>>,
}

impl AnchorAcceptance {
    /// The accepted drafts at `anchor` (one of [`Self::anchors`]) for DFlash (`tree` None) or
    /// the DDTree of the `k`-th budget (`tree` Some(k)).
    fn at(&self, anchor: usize, tree: Option<usize>) -> usize {
        let i = self
            .anchors
            .binary_search(&(anchor as u32))
            .expect("replay walks only anchors it has");
        match tree {
            None => self.dflash[i],
            Some(k) => self.ddtree[k][i],
        }
    }
}

/// Drafts a block at each of `anchors` (sorted, each `< tokens.len()`) with the training-mode
/// forward over `taps` (the target's, [`crate::step::sequence_taps`] of `tokens`), `chunk` anchors
/// a pass (bounds the logits' memory), and counts what a verifier whose choices are `tokens`
/// accepts: single path and a DDTree of each of `budgets`.
pub fn anchor_acceptance(
    target: &dyn TargetModel,
    drafter: &DFlashDrafter,
    taps: &Tensor,
    tokens: &[u32],
    anchors: &[u32],
    budgets: &[usize],
    chunk: usize,
) -> Result<AnchorAcceptance> {
    let conv = drafter.block_convention();
    let (acc, _) = acceptance(
        target, drafter, taps, tokens, anchors, budgets, chunk, false, &conv,
    )?;
    Ok(acc)
}

/// [`anchor_acceptance`] and, per anchor, the mean log-probability the block's draft rows give
/// the true continuation (rows past the end of `tokens` left out; 0 for an anchor with none):
/// a continuous score of the same forward, far less noisy than acceptance counts (`diagnose`
/// compares drafter inputs with it).
pub fn anchor_likelihood(
    target: &dyn TargetModel,
    drafter: &DFlashDrafter,
    taps: &Tensor,
    tokens: &[u32],
    anchors: &[u32],
    budgets: &[usize],
    chunk: usize,
) -> Result<(AnchorAcceptance, Vec<f64>)> {
    let conv = drafter.block_convention();
    acceptance(
        target, drafter, taps, tokens, anchors, budgets, chunk, true, &conv,
    )
}

/// [`anchor_likelihood`] with the blocks laid out by `conv` (diagnose's alternatives).
#[allow(clippy::too_many_arguments)]
pub fn anchor_likelihood_with(
    target: &dyn TargetModel,
    drafter: &DFlashDrafter,
    taps: &Tensor,
    tokens: &[u32],
    anchors: &[u32],
    budgets: &[usize],
    chunk: usize,
    conv: &BlockConvention,
) -> Result<(AnchorAcceptance, Vec<f64>)> {
    acceptance(
        target, drafter, taps, tokens, anchors, budgets, chunk, true, conv,
    )
}

#[allow(clippy::too_many_arguments)]
fn acceptance(
    target: &dyn TargetModel,
    drafter: &DFlashDrafter,
    taps: &Tensor,
    tokens: &[u32],
    anchors: &[u32],
    budgets: &[usize],
    chunk: usize,
    likelihood: bool,
    conv: &BlockConvention,
) -> Result<(AnchorAcceptance, Vec<f64>)> {
    let mut ll = vec![];
    let mut out = AnchorAcceptance {
        anchors: anchors.to_vec(),
        ddtree: vec![vec![]; budgets.len()],
        ..Default::default()
    };
    if anchors.is_empty() {
        return Ok((out, ll));
    }
    for group in anchors.chunks(chunk.max(1)) {
        let logits = drafter.forward_train_with(target, taps, tokens, group, Grad::Off, conv)?;
        let (n, b, v) = logits.dims3()?;
        // row 0 is the anchor's slot; rows 1.. draft the tokens after it
        let drafts = logits.narrow(1, 1, b - 1)?.to_dtype(DType::F32)?;
        // log p(true token) of each draft row; rows past the end look up token 0, unused
        let truth: Option<Vec<u32>> = likelihood.then(|| {
            group
                .iter()
                .flat_map(|&a| (1..b).map(move |k| a as usize + k))
                .map(|p| tokens.get(p).copied().unwrap_or(0))
                .collect()
        });
        // the same top-k decoding's tree takes (top_k_log_probs), once at the largest budget: a
        // smaller budget's top-k is its prefix
        let rows = summarize_rows(
            &drafts.reshape((n * (b - 1), v))?,
            budgets.iter().max().map(|&k| k.max(1)),
            truth.as_deref(),
        )?;
        let (ids, top) = (rows.ids, rows.top);
        if let Some(lp) = rows.truth_log_probs {
            for (i, &a) in group.iter().enumerate() {
                let rows = (b - 1).min(tokens.len().saturating_sub(a as usize + 1));
                let sum: f64 = lp[i * (b - 1)..i * (b - 1) + rows]
                    .iter()
                    .map(|&x| x as f64)
                    .sum();
                ll.push(if rows == 0 { 0.0 } else { sum / rows as f64 });
            }
        }
        for (i, &a) in group.iter().enumerate() {
            let a = a as usize;
            let continuation = &tokens[(a + 1).min(tokens.len())..];
            let drafted = &ids[i * (b - 1)..(i + 1) * (b - 1)];
            out.dflash.push(
                drafted
                    .iter()
                    .zip(continuation)
                    .take_while(|(d, t)| d == t)
                    .count(),
            );
            if let Some(top) = &top {
                let rows = &top[i * (b - 1)..(i + 1) * (b - 1)];
                for (k, &budget) in budgets.iter().enumerate() {
                    let cut: Vec<Vec<(f32, u32)>> = rows
                        .iter()
                        .map(|r| r[..budget.max(1).min(r.len())].to_vec())
                        .collect();
                    let tree = build_tree(tokens[a], &cut, budget);
                    out.ddtree[k].push(tree.accepted_depth(continuation));
                }
            }
        }
    }
    Ok((out, ll))
}

/// What the replay needs of each draft row of a group.
struct RowSummaries {
    /// Each row's argmax (decoding's DFlash draft).
    ids: Vec<u32>,
    /// Each row's top-k log-probabilities (decoding's DDTree input), when asked.
    top: Option<Vec<Vec<(f32, u32)>>>,
    /// Each row's log-probability of its true token, when asked.
    truth_log_probs: Option<Vec<f32>>,
}

/// Argmax, top-`k` log-probabilities and the true tokens' log-probabilities of `[rows, vocab]`
/// f32 logits, with decoding's own functions' numbers: on CUDA those functions (only small
/// results cross to the host); on the CPU one log-softmax and one copy of it and of the logits,
/// rows split over the available threads (the diagnosis replays ~10⁴ rows a variant).
fn summarize_rows(
    logits: &Tensor,
    k: Option<usize>,
    truth: Option<&[u32]>,
) -> Result<RowSummaries> {
    if !logits.device().is_cpu() {
        let ids = greedy_rows(logits)?;
        let top = match k {
            Some(k) => Some(dflash_core::decode_ops::top_k_log_probs(logits, k)?),
            None => None,
        };
        let truth_log_probs = match truth {
            Some(t) => {
                let idx = Tensor::from_slice(t, (t.len(), 1), logits.device())?;
                Some(
                    candle_nn::ops::log_softmax(logits, D::Minus1)?
                        .gather(&idx, 1)?
                        .flatten_all()?
                        .to_vec1::<f32>()?,
                )
            }
            None => None,
        };
        return Ok(RowSummaries {
            ids,
            top,
            truth_log_probs,
        });
    }
    let (rows, vocab) = logits.dims2()?;
    let raw: Vec<f32> = logits.flatten_all()?.to_vec1()?;
    let lp: Vec<f32> = if k.is_some() || truth.is_some() {
        candle_nn::ops::log_softmax(logits, D::Minus1)?
            .flatten_all()?
            .to_vec1()?
    } else {
        vec![]
    };
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(rows.max(1));
    let per = rows.div_ceil(threads.max(1)).max(1);
    let mut ids = vec![0u32; rows];
    let mut top: Vec<Vec<(f32, u32)>> = vec![vec![]; if k.is_some() { rows } else { 0 }];
    std::thread::scope(|scope| {
        let mut top_parts = top.chunks_mut(per);
        for (c, id_part) in ids.chunks_mut(per).enumerate() {
            let top_part = if k.is_some() { top_parts.next() } else { None };
            let (raw, lp) = (&raw, &lp);
            scope.spawn(move || {
                let first = c * per;
                for (j, id) in id_part.iter_mut().enumerate() {
                    let r = first + j;
                    *id = dflash_core::decode_ops::argmax(&raw[r * vocab..(r + 1) * vocab]);
                }
                if let (Some(part), Some(k)) = (top_part, k) {
                    for (j, t) in part.iter_mut().enumerate() {
                        let r = first + j;
                        *t = dflash_core::decode_ops::top_k_row(&lp[r * vocab..(r + 1) * vocab], k);
                    }
                }
            });
        }
    });
    let truth_log_probs = truth.map(|t| {
        t.iter()
            .enumerate()
            .map(|(r, &tok)| lp[r * vocab + tok as usize])
            .collect()
    });
    Ok(RowSummaries {
        ids,
        top: k.map(|_| top),
        truth_log_probs,
    })
}

/// The steps decoding takes over an output occupying `tokens[start..end]` (its first token comes
/// from the prefill, so the first block is anchored at `start`): each step's τ (accepted drafts +
/// the bonus token), for DFlash (`tree` None) or the DDTree of the `k`-th budget (`tree`
/// Some(k)). `acc` must hold every anchor in `start..end - 1`.
pub fn replay_steps(
    acc: &AnchorAcceptance,
    tree: Option<usize>,
    start: usize,
    end: usize,
) -> Vec<usize> {
    let mut steps = vec![];
    let mut a = start;
    while a + 1 < end {
        let accepted = acc.at(a, tree).min(end - 1 - a);
        steps.push(accepted + 1);
        a += accepted + 1;
    }
    steps
}

/// 95 % percentile-bootstrap interval of the pooled τ = Σ acceptance / Σ steps, resampling the
/// prompts (`(Σ acceptance, steps)` each) with replacement `rounds` times; deterministic (a fixed
/// seeded ChaCha8 stream), so the same results give the same interval. `eval` reports it beside τ and
/// `diagnose` compares replayed τ of convention variants against it.
pub fn bootstrap_ci95(per_prompt: &[(usize, usize)], rounds: usize) -> [f64; 2] {
    bootstrap_interval(per_prompt.len(), rounds, &|picks| {
        let (a, s) = picks.fold((0usize, 0usize), |(a, s), i| {
            (a + per_prompt[i].0, s + per_prompt[i].1)
        });
        a as f64 / s.max(1) as f64
    })
}

/// 95 % percentile-bootstrap interval of any statistic of `n` prompts: `stat` takes the indices
/// of one resample (with replacement, `n` of them); `rounds` resamples from the fixed seeded
/// stream of [`bootstrap_ci95`] (deterministic). With `n <= 1` the interval is the statistic.
pub fn bootstrap_interval(
    n: usize,
    rounds: usize,
    stat: &dyn Fn(&mut dyn Iterator<Item = usize>) -> f64,
) -> [f64; 2] {
    if n <= 1 {
        let t = stat(&mut (0..n));
        return [t, t];
    }
    // a fixed seed: the same results give the same interval, run after run
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x9E37_79B9_7F4A_7C15);
    let mut taus: Vec<f64> = (0..rounds.max(1))
        .map(|_| stat(&mut (0..n).map(|_| rng.random_range(0..n))))
        .collect();
    taus.sort_by(f64::total_cmp);
    let at = |q: f64| taus[((q * (taus.len() - 1) as f64).round() as usize).min(taus.len() - 1)];
    [at(0.025), at(0.975)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_jumps_past_accepted_drafts_and_stops_at_the_end() {
        // anchors 4..10 of an output in tokens[4..11]
        let acc = AnchorAcceptance {
            anchors: (4..10).collect(),
            dflash: vec![2, 0, 0, 3, 9, 1],
            ddtree: vec![vec![5, 0, 0, 0, 0, 0]],
        };
        // DFlash: anchor 4 accepts 2 (τ 3), anchor 7 accepts 3 (τ 4), anchor 11 is past the end
        assert_eq!(replay_steps(&acc, None, 4, 11), [3, 4]);
        // DDTree: anchor 4 accepts 5 (τ 6), anchor 10 is the last token: no step after it
        assert_eq!(replay_steps(&acc, Some(0), 4, 11), [6]);
        // a capped step: anchor 8 would accept 9 but only one token (9) is left before 10
        assert_eq!(replay_steps(&acc, None, 8, 10), [2]);
        // an output of one token (from the prefill) takes no step
        assert!(replay_steps(&acc, None, 4, 5).is_empty());
    }

    #[test]
    fn bootstrap_interval_brackets_the_pooled_tau_and_narrows_with_more_prompts() {
        // five prompts of τ 2, 3, 4, 5, 6 (ten steps each): pooled 4
        let five: Vec<(usize, usize)> = (2..7).map(|t| (10 * t, 10)).collect();
        let [lo, hi] = bootstrap_ci95(&five, 2000);
        assert!(lo < 4.0 && 4.0 < hi && lo >= 2.0 && hi <= 6.0, "{lo} {hi}");
        assert!(lo > 2.5 && hi < 5.5, "not the extremes: {lo} {hi}");
        // the same spread over 80 prompts: a narrower interval
        let many: Vec<(usize, usize)> = (0..80).map(|i| (10 * (2 + i % 5), 10)).collect();
        let [lo2, hi2] = bootstrap_ci95(&many, 2000);
        assert!(lo2 < 4.0 && 4.0 < hi2, "{lo2} {hi2}");
        assert!(hi2 - lo2 < 0.5 * (hi - lo), "{lo2}-{hi2} vs {lo}-{hi}");
        // identical prompts: no spread; one prompt: its τ; deterministic
        assert_eq!(bootstrap_ci95(&[(30, 10); 4], 500), [3.0, 3.0]);
        assert_eq!(bootstrap_ci95(&[(7, 2)], 500), [3.5, 3.5]);
        assert_eq!(bootstrap_ci95(&five, 2000), [lo, hi]);
    }
}
