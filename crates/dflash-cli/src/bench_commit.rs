//! `bench decode`'s state-commit timings for targets with recurrent layers (Qwen3.5 / Qwen3.6
//! hybrids): the commit after a causal block's verify (a crop) and after a tree's (its accepted
//! path kept).
//!
//! Invariants: each timing runs on a cache of its own (a state settled in place cannot return
//! into the verify it ended); a round is timed between device synchronisations, from the crop or
//! path compaction to the settled states; `None` for attention-only targets. The folded commit
//! (CUDA's default: the next step replays the kept rows inside its rule kernels) has no launch of
//! its own: [`folded_commit`] times the verify that folds it against the same verify with nothing
//! pending, alternating, and reports the difference.

use crate::bench::Timing;
use crate::bench_decode::{accepted_path, in_profile, PREFILL_CHUNK};
use anyhow::Result;
use dflash_core::{AttentionMask, SequenceCache};
use dflash_decoding::tree::DraftTree;
use dflash_models::{ForwardRequest, LogitRows, TargetModel};
use std::hint::black_box;
use std::time::Instant;

/// What a commit timing verifies and keeps: `block` (or `tree`) after the committed positions,
/// then half the block (or the tree's accepted path) kept.
struct CommitBench<'a> {
    target: &'a dyn TargetModel,
    block: &'a [u32],
    tree: Option<&'a DraftTree>,
    path: Option<Vec<u32>>,
    taps: &'a [usize],
}

impl<'a> CommitBench<'a> {
    fn new(
        target: &'a dyn TargetModel,
        block: &'a [u32],
        tree: Option<&'a DraftTree>,
        taps: &'a [usize],
    ) -> Self {
        let path = tree.map(accepted_path);
        Self {
            target,
            block,
            tree,
            path,
            taps,
        }
    }

    /// The rows each round keeps.
    fn kept(&self) -> usize {
        self.path.as_ref().map_or(self.block.len() / 2, Vec::len)
    }

    /// An empty cache of its own, room for the context `ids` and `rounds` rounds.
    fn cache(&self, ids: &[u32], rounds: usize) -> Result<SequenceCache> {
        let rows = self.tree.map_or(self.block.len(), |t| t.tokens.len());
        Ok(self
            .target
            .new_cache(ids.len() + rows + rounds * self.kept())?)
    }

    /// The context `ids` prefilled into `cache`.
    fn prefill(&self, cache: &mut SequenceCache, ids: &[u32]) -> Result<()> {
        let positions: Vec<u32> = (0..ids.len() as u32).collect();
        for s in (0..ids.len()).step_by(PREFILL_CHUNK) {
            let e = (s + PREFILL_CHUNK).min(ids.len());
            let req = ForwardRequest::causal(&ids[s..e], &positions[s..e], LogitRows::None);
            self.target.forward(&req, cache)?;
        }
        Ok(())
    }

    /// The verify after the committed positions; the length it started at.
    fn verify(&self, cache: &mut SequenceCache) -> Result<usize> {
        let base = cache.len();
        let pos: Vec<u32> = match self.tree {
            Some(t) => t.positions(base),
            None => (base as u32..(base + self.block.len()) as u32).collect(),
        };
        let req = match self.tree {
            Some(t) => t.verify_request(&pos, self.taps),
            None => ForwardRequest {
                tokens: self.block,
                positions: &pos,
                mask: AttentionMask::Causal,
                taps: self.taps,
                logits: LogitRows::All,
            },
        };
        black_box(self.target.forward(&req, cache)?);
        Ok(base)
    }

    /// The verify at `base` cut to its kept rows (bookkeeping; the states settle later).
    fn keep(&self, cache: &mut SequenceCache, base: usize) -> Result<()> {
        match &self.path {
            Some(p) => cache.keep_rows(base, p)?,
            None => cache.crop(base + self.kept()),
        }
        Ok(())
    }
}

/// For a target with recurrent layers: on a cache of its own holding the context `ids`, per
/// round, the verify of `block` after the committed positions (untimed), then the crop to half of
/// it and every recurrent layer's state settled as the next forward settles it
/// (`SequenceCache::settle_recurrent`; timed, between device synchronisations); the next round
/// verifies after the kept half. (A state settled in place — the hybrid device step's buffers —
/// cannot be cropped back into the verify it ended, so the rounds move on instead of returning
/// to the context.) Also the host's share: the time until `settle_recurrent` returns, its kernels
/// queued (the rest is the device's), and of that the crop or path compaction's (the rest is the
/// settling's). `None` for attention-only targets.
///
/// With `tree`, the verify is of that tree instead and the kept rows are `tree`'s accepted path
/// (`SequenceCache::keep_rows`, then `settle_recurrent`, timed together).
///
/// `profile_key`: the `DFLASH_PROFILE_OP` name whose profiler range covers the commits alone
/// (not the prefill and verifies around them).
pub(crate) fn state_commit(
    target: &dyn TargetModel,
    ids: &[u32],
    block: &[u32],
    tree: Option<&DraftTree>,
    taps: &[usize],
    (warmup, timed): (usize, usize),
    profile_key: &str,
) -> Result<Option<[Timing; 3]>> {
    use dflash_core::LayerCache;
    let bench = CommitBench::new(target, block, tree, taps);
    let rounds = warmup + timed;
    let mut cache = bench.cache(ids, rounds)?;
    if !cache
        .layers
        .iter()
        .any(|l| matches!(l, LayerCache::Recurrent(_)))
    {
        return Ok(None);
    }
    bench.prefill(&mut cache, ids)?;
    let dev = cache.device().clone();
    let (mut v, mut submit, mut kept) = (vec![], vec![], vec![]);
    for round in 0..rounds {
        let base = bench.verify(&mut cache)?;
        dev.synchronize()?;
        let (keep, queued, t0) = in_profile(profile_key, || {
            let t0 = Instant::now();
            bench.keep(&mut cache, base)?;
            let keep = t0.elapsed().as_secs_f64();
            cache.settle_recurrent()?;
            let queued = t0.elapsed().as_secs_f64();
            dev.synchronize()?;
            Ok((keep, queued, t0))
        })?;
        if round >= warmup {
            v.push(t0.elapsed().as_secs_f64());
            submit.push(queued);
            kept.push(keep);
        }
    }
    Ok(Some([Timing::of(v), Timing::of(submit), Timing::of(kept)]))
}

/// The folded state commit's cost, for a target whose cache folds it (hybrids on CUDA with the
/// fold on; `None` otherwise): on a cache of its own, per round pair, the verify of `block` (or
/// `tree`) after a crop to half of it (or its accepted path kept) — which folds that commit in —
/// and, after the same crop settled separately (untimed), the same verify with nothing pending;
/// each timed between device synchronisations. Returns (verify folding a commit, verify alone).
/// Fails if a verify that should fold did not.
pub(crate) fn folded_commit(
    target: &dyn TargetModel,
    ids: &[u32],
    block: &[u32],
    tree: Option<&DraftTree>,
    taps: &[usize],
    (warmup, timed): (usize, usize),
) -> Result<Option<(Timing, Timing)>> {
    let bench = CommitBench::new(target, block, tree, taps);
    let rounds = 2 * (warmup + timed) + 1;
    let mut cache = bench.cache(ids, rounds)?;
    if !cache.fold_commit() {
        return Ok(None);
    }
    bench.prefill(&mut cache, ids)?;
    let dev = cache.device().clone();
    let mut base = bench.verify(&mut cache)?;
    let (mut folding, mut alone) = (vec![], vec![]);
    for round in 0..rounds - 1 {
        bench.keep(&mut cache, base)?;
        let fold = round % 2 == 0;
        if !fold {
            cache.settle_recurrent()?;
        }
        dev.synchronize()?;
        let before = cache.folded_commits();
        let t0 = Instant::now();
        base = bench.verify(&mut cache)?;
        dev.synchronize()?;
        let t = t0.elapsed().as_secs_f64();
        let folded = cache.folded_commits() - before;
        if folded != usize::from(fold) {
            anyhow::bail!(
                "folded commit: a verify folded {folded} commits (expected {})",
                fold as u8
            );
        }
        if round >= 2 * warmup {
            match fold {
                true => folding.push(t),
                false => alone.push(t),
            }
        }
    }
    Ok(Some((Timing::of(folding), Timing::of(alone))))
}
