//! DDTree construction: the `budget` most probable prefixes under the drafter's per-position
//! marginals, found best-first with a heap (DDTree Alg. 1).
//!
//! Invariants: node order is pop order, so every parent index is smaller than its child's; node 0
//! of the verify input is the root (the bonus token), tree nodes are `1..=n`; the tree is
//! prefix-closed; a node's depth is its distance from the root (its position is `start + depth`).

use crate::Result;
use candle_core::Tensor;
use dflash_core::AttentionMask;
use dflash_models::{ForwardRequest, LogitRows};
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// The node budget `dflash generate` and `dflash eval` use without `--tree-budget`. Measured on the
/// H200 with SmolLM2-135M (docs/benchmarks.md, sessions 8 and 9): 64 nodes are as fast as 128 or 256
/// on gsm8k and a few per cent faster on humaneval and mt_bench, where larger trees buy τ (256: +0.4
/// to +0.5) but not speed.
pub const DEFAULT_TREE_BUDGET: usize = 64;

/// Top-`k` (log-prob, token) per drafted position from host rows of logits, best first (ties:
/// lower id first): [`top_k_rows`] after a log-softmax on the host.
pub fn top_k_log_probs(logits: &[Vec<f32>], k: usize) -> Vec<Vec<(f32, u32)>> {
    let log_probs: Vec<Vec<f32>> = logits
        .iter()
        .map(|row| {
            let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
            row.iter().map(|x| x - lse).collect()
        })
        .collect();
    top_k_rows(&log_probs, k)
}

/// Top-`k` (value, token) per host row of log-probabilities, best first (ties: lower id first).
pub use dflash_core::decode_ops::top_k_host as top_k_rows;

/// A token tree rooted at the bonus token (index 0).
#[derive(Debug, Clone, Default)]
pub struct DraftTree {
    /// Token of each node; `tokens[0]` is the root.
    pub tokens: Vec<u32>,
    /// Parent index (−1 for the root).
    pub parents: Vec<i64>,
    /// Depth (root 0).
    pub depths: Vec<usize>,
    /// `children[i][token] = child index`.
    pub children: Vec<HashMap<u32, usize>>,
}

#[derive(PartialEq)]
struct Candidate {
    score: f32,
    seq: usize,
    parent: usize,
    depth: usize,
    rank: usize,
}
impl Eq for Candidate {}
impl Ord for Candidate {
    fn cmp(&self, o: &Self) -> Ordering {
        self.score.total_cmp(&o.score).then(o.seq.cmp(&self.seq))
    }
}
impl PartialOrd for Candidate {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// Builds the best-`budget`-node tree below `root` from `top[d]` = top-k of drafted position d.
impl DraftTree {
    /// Each node's position when the root sits at `start` (`start + depth`).
    pub fn positions(&self, start: usize) -> Vec<u32> {
        self.depths.iter().map(|d| (start + d) as u32).collect()
    }

    /// The target forward that verifies the tree in one pass: every node at its `positions`,
    /// seeing the cache, its ancestors and itself, with logits for every node and `taps`.
    pub fn verify_request<'a>(
        &'a self,
        positions: &'a [u32],
        taps: &'a [usize],
    ) -> ForwardRequest<'a> {
        ForwardRequest {
            tokens: &self.tokens,
            positions,
            mask: AttentionMask::Tree {
                parents: self.parents.clone(),
            },
            taps,
            logits: LogitRows::All,
        }
    }

    /// How many drafted tokens a verifier whose choices are `continuation` (the tokens after the
    /// root) accepts: the depth of the deepest node on the path that follows it.
    pub fn accepted_depth(&self, continuation: &[u32]) -> usize {
        let (mut cur, mut depth) = (0usize, 0usize);
        while let Some(&c) = continuation
            .get(depth)
            .and_then(|t| self.children[cur].get(t))
        {
            cur = c;
            depth += 1;
        }
        depth
    }
}

/// The DDTree step's tree from the drafter's block logits `[rows, vocab]` (on their device): each
/// row is log-softmaxed and cut to its top-`budget` entries where the logits are, and only those
/// `rows × budget` (log-prob, id) pairs cross to the host for the best-first expansion.
pub fn tree_from_draft_logits(
    draft_logits: &Tensor,
    root: u32,
    budget: usize,
) -> Result<DraftTree> {
    let top = dflash_core::decode_ops::top_k_log_probs(draft_logits, budget.max(1))?;
    Ok(build_tree(root, &top, budget))
}

pub fn build_tree(root: u32, top: &[Vec<(f32, u32)>], budget: usize) -> DraftTree {
    let mut t = DraftTree {
        tokens: vec![root],
        parents: vec![-1],
        depths: vec![0],
        children: vec![HashMap::new()],
    };
    if top.is_empty() || top[0].is_empty() || budget == 0 {
        return t;
    }
    let mut heap = BinaryHeap::new();
    let mut seq = 0;
    heap.push(Candidate {
        score: top[0][0].0,
        seq,
        parent: 0,
        depth: 1,
        rank: 0,
    });
    while let Some(c) = heap.pop() {
        if t.tokens.len() > budget {
            break;
        }
        let level = &top[c.depth - 1];
        let token = level[c.rank].1;
        let id = t.tokens.len();
        t.tokens.push(token);
        t.parents.push(c.parent as i64);
        t.depths.push(c.depth);
        t.children.push(HashMap::new());
        t.children[c.parent].insert(token, id);
        if c.rank + 1 < level.len() {
            seq += 1;
            let score = c.score - level[c.rank].0 + level[c.rank + 1].0;
            heap.push(Candidate {
                score,
                seq,
                parent: c.parent,
                depth: c.depth,
                rank: c.rank + 1,
            });
        }
        if c.depth < top.len() && !top[c.depth].is_empty() {
            seq += 1;
            heap.push(Candidate {
                score: c.score + top[c.depth][0].0,
                seq,
                parent: id,
                depth: c.depth + 1,
                rank: 0,
            });
        }
        if t.tokens.len() > budget {
            break;
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_first_tree_picks_the_most_probable_prefixes() {
        let ln = |p: f32| p.ln();
        // depth 1: A=.6 B=.4 ; depth 2: C=.9 D=.1
        let top = vec![
            vec![(ln(0.6), 1), (ln(0.4), 2)],
            vec![(ln(0.9), 3), (ln(0.1), 4)],
        ];
        let t = build_tree(0, &top, 3);
        // prefixes by probability: A .6, AC .54, B .4, BC .36, ...
        assert_eq!(t.tokens, vec![0, 1, 3, 2]);
        assert_eq!(t.parents, vec![-1, 0, 1, 0]);
        assert_eq!(t.depths, vec![0, 1, 2, 1]);
        assert_eq!(t.children[0][&2], 3);
        let t = build_tree(0, &top, 100);
        assert_eq!(t.tokens.len(), 7); // 2 + 4 prefixes + root
        for (i, &p) in t.parents.iter().enumerate().skip(1) {
            assert!((p as usize) < i);
        }
    }

    #[test]
    fn top_k_matches_a_full_sort() {
        let row: Vec<f32> = (0..1000u32)
            .map(|i| ((i * 7919) % 1009) as f32 * 0.01 - 3.0)
            .collect();
        let mut idx: Vec<u32> = (0..1000).collect();
        idx.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        let got: Vec<u32> = top_k_log_probs(std::slice::from_ref(&row), 37)[0]
            .iter()
            .map(|x| x.1)
            .collect();
        assert_eq!(got, idx[..37].to_vec());
    }

    #[test]
    fn top_k_is_sorted_log_softmax() {
        let rows = vec![vec![0.0f32, 2.0, 1.0, 2.0]];
        let t = top_k_log_probs(&rows, 2);
        assert_eq!(t[0].iter().map(|x| x.1).collect::<Vec<_>>(), vec![1, 3]);
        let z: f32 = [0.0f32, 2.0, 1.0, 2.0].iter().map(|x| x.exp()).sum();
        assert!((t[0][0].0 - (2.0f32.exp() / z).ln()).abs() < 1e-6);
        // rows normalised elsewhere (the device) give the same entries through top_k_rows
        let lp: Vec<Vec<f32>> = vec![rows[0].iter().map(|x| x - z.ln()).collect()];
        let u = top_k_rows(&lp, 2);
        assert_eq!(u[0].iter().map(|x| x.1).collect::<Vec<_>>(), vec![1, 3]);
        assert!((u[0][0].0 - t[0][0].0).abs() < 1e-6 && (u[0][1].0 - t[0][1].0).abs() < 1e-6);
    }
}
