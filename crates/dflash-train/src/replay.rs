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

use crate::Result;
use candle_core::{DType, Tensor};
use dflash_core::Grad;
use dflash_decoding::sampling::greedy_rows;
use dflash_decoding::tree::build_tree;
use dflash_models::{DFlashDrafter, TargetModel};

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
    let mut out = AnchorAcceptance {
        anchors: anchors.to_vec(),
        ddtree: vec![vec![]; budgets.len()],
        ..Default::default()
    };
    if anchors.is_empty() {
        return Ok(out);
    }
    for group in anchors.chunks(chunk.max(1)) {
        let logits = drafter.forward_train(target, taps, tokens, group, Grad::Off)?;
        let (n, b, v) = logits.dims3()?;
        // row 0 is the anchor's slot; rows 1.. draft the tokens after it
        let drafts = logits.narrow(1, 1, b - 1)?.to_dtype(DType::F32)?;
        let ids = greedy_rows(&drafts.reshape((n * (b - 1), v))?)?;
        // the same top-k decoding's tree takes (top_k_log_probs), once at the largest budget: a
        // smaller budget's top-k is its prefix
        let top: Option<Vec<Vec<(f32, u32)>>> = match budgets.iter().max() {
            None => None,
            Some(&kmax) => Some(dflash_core::decode_ops::top_k_log_probs(
                &drafts.reshape((n * (b - 1), v))?,
                kmax.max(1),
            )?),
        };
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
    Ok(out)
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
}
