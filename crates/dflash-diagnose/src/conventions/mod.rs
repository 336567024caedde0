//! Conventions scan: the drafter's replayed τ under its declared conventions and under
//! alternatives that change only what it is fed.
//!
//! Invariants:
//! - The τ of a variant is decoding's walk ([`dflash_train::replay_steps`]) over blocks drafted at
//!   every answer position by the training-mode forward ([`dflash_train::anchor_likelihood`], the
//!   acceptance `eval --replay` walks plus each block's log-likelihood of the true text): DDTree
//!   at the scan's budget and single-path DFlash.
//! - Variants differ from the declared setting in one thing the drafter is fed or its config
//!   declares. In the taps tensor: the same rows of other layers (every tap shifted by −1 or +1,
//!   a shift leaving the target's layers skipped; the last tap moved to the target's last layer —
//!   the fc fed the last layer — or, declared there, moved off it to the default taps' last
//!   layer; the z-lab default taps for the target's depth); a list equal to an earlier
//!   variant's is not measured twice. The target runs once per sample for the union of the
//!   layers. The target's final RMSNorm on the last tap the other way round from the declared
//!   `final_norm_on_last_tap` (the drafter applies it itself, as declared). In the block's
//!   layout (`BlockConvention`): positions −1 / +1 (slot `j` at `anchor + j ± 1`) and slot 0
//!   holding the mask token. In the drafter (a copy with the same weights): the target's RoPE
//!   when the drafter declares another, another mask token (the candidates of
//!   [`crate::Options::mask_token_candidates`], at most [`MAX_MASK_VARIANTS`]), every layer's
//!   attention full when any is declared windowed or causal, or windowed when all are full and
//!   the config gives a `sliding_window`.
//! - [`judge`]: an alternative is a FAIL when (τ rule) its replayed DDTree τ beats the declared
//!   τ's 95 % bootstrap upper bound *and* the declared τ by at least [`FAIL_MARGIN`], or
//!   (likelihood rule) the drafter gives the true continuation a higher mean log-likelihood under
//!   it, by at least [`LL_MARGIN`] nats a row on average with the 95 % bootstrap interval of the
//!   per-prompt (paired) gain above 0, and a higher all-positions τ. The drafter was trained to
//!   maximise this likelihood on its training inputs, so an input it prefers consistently is the
//!   one it was trained on; the likelihood rule exists because argmax acceptance is too coarse
//!   for small shifts: on SmolLM2 a tap shift of one layer moves the walk's τ by only ~5 %
//!   (0.12 nats and ~9 % in all-positions τ). A better alternative meeting only part of a rule,
//!   or any rule on a single prompt (no interval), is a warn (inconclusive); otherwise ok.
//! - A drafter too weak to judge (declared DDTree τ below [`WEAK_TAU`]) is never judged by the
//!   likelihood rule: only an alternative reaching [`WEAK_TAU`] with its interval above the
//!   declared one is a FAIL; otherwise it is a warn saying the drafter is too weak (an
//!   under-trained drafter's small consistent preferences are not conventions).
//!
//! Files: [`variants`] (what each variant changes), [`judge`] (the verdict, cause and fix); this
//! file measures them.

mod judge;
mod variants;

pub use judge::{gain_ci95, judge, FAIL_MARGIN, LL_MARGIN, WEAK_TAU};
pub use variants::{drafter_variants, variants, Alteration, Attention, Variant, MAX_MASK_VARIANTS};

use crate::stats::{TapStatsAccumulator, TapStatsFile};
use crate::{Options, Result, Sample};
use candle_core::Tensor;
use dflash_models::{DFlashDrafter, TargetModel};
use dflash_train::{anchor_likelihood_with, bootstrap_ci95, replay_steps, sequence_taps};
use serde::Serialize;

/// The replayed τ of one variant over the samples.
#[derive(Debug, Clone, Serialize)]
pub struct VariantResult {
    #[serde(flatten)]
    pub variant: Variant,
    pub ddtree_tau: f64,
    pub ddtree_tau_ci95: [f64; 2],
    pub dflash_tau: f64,
    pub dflash_tau_ci95: [f64; 2],
    /// DDTree τ of each sample, in order.
    pub ddtree_tau_per_prompt: Vec<f64>,
    /// 1 + mean accepted DDTree drafts of a block at every answer position.
    pub teacher_forced_ddtree_tau: f64,
    /// Mean log-probability the drafter gives the true continuation (per draft row, every
    /// answer position).
    pub log_likelihood: f64,
    /// [`Self::log_likelihood`] of each sample, in order.
    pub log_likelihood_per_prompt: Vec<f64>,
}

/// The scan's results.
#[derive(Debug, Clone, Serialize)]
pub struct Scan {
    pub declared_target_layer_ids: Vec<usize>,
    pub declared_mask_token_id: u32,
    /// The block layout the drafter's config declares (`dflash_config.block_position_offset`,
    /// `anchor_slot_masked`).
    pub declared_position_offset: i64,
    pub declared_anchor_slot_masked: bool,
    /// `dflash_config.final_norm_on_last_tap` as declared.
    pub declared_final_norm_on_last_tap: bool,
    pub num_target_layers: usize,
    pub tree_budget: usize,
    /// Answer tokens replayed (over every sample).
    pub answer_tokens: usize,
    /// Declared first.
    pub variants: Vec<VariantResult>,
}

/// `[S, T·H]` taps of `v` from `all` (`[S, U·H]`, the layers of `union` in order).
fn variant_taps(all: &Tensor, union: &[usize], v: &Variant, hidden: usize) -> Result<Tensor> {
    let mut parts = vec![];
    for l in &v.target_layer_ids {
        let u = union.iter().position(|x| x == l).expect("union has it");
        parts.push(all.narrow(1, u * hidden, hidden)?.contiguous()?);
    }
    Ok(Tensor::cat(&parts, 1)?)
}

/// Replays every variant on every sample; also returns the declared taps' statistics over the
/// answer rows (from the same target forwards).
pub fn scan(
    target: &dyn TargetModel,
    drafter: &DFlashDrafter,
    samples: &[Sample],
    opts: &Options,
) -> Result<(Scan, TapStatsFile)> {
    scan_variants(target, drafter, samples, opts, false)
}

/// [`scan`]; with `declared_only` the declared setting alone (the prompt-format check's τ).
pub(crate) fn scan_variants(
    target: &dyn TargetModel,
    drafter: &DFlashDrafter,
    samples: &[Sample],
    opts: &Options,
    declared_only: bool,
) -> Result<(Scan, TapStatsFile)> {
    let info = target.info();
    let declared = drafter.target_layers().to_vec();
    // the target's RoPE, when the drafter declares another, and the drafter fed it
    let declared_rope = drafter.config().rope().ok();
    let target_rope = opts.target_rope.clone().filter(|(theta, scaling)| {
        declared_rope
            .as_ref()
            .is_some_and(|d| (d.theta - theta).abs() > 1e-9 * theta.abs() || d.scaling != *scaling)
    });
    let conv = drafter.block_convention();
    let declared_final_norm = drafter.config().final_norm_on_last_tap();
    let mut vars = variants(
        &declared,
        conv,
        info.num_layers,
        target.final_norm().is_some().then_some(declared_final_norm),
        target_rope.as_ref().map(|r| r.0),
    );
    let own = drafter_variants(
        &vars[0],
        drafter.mask_token_id(),
        &opts.mask_token_candidates,
        &drafter.layer_attention(),
        drafter.config().sliding_window,
    );
    vars.extend(own);
    if declared_only {
        vars.truncate(1);
    }
    // the drafter each variant is fed: the declared one, or a copy with its final norm on the
    // last tap, RoPE, mask token or attention changed (the same weights)
    let mut fed: Vec<Option<DFlashDrafter>> = vec![];
    for v in &vars {
        fed.push(if !v.alters_drafter() {
            None
        } else if v.alteration == Alteration::FinalNorm {
            Some(drafter.with_final_norm_on_last_tap(v.final_norm_on_last_tap))
        } else if let Some(id) = v.mask_token_id {
            Some(drafter.with_mask_token(id))
        } else if let Some(a) = v.attention {
            Some(drafter.with_attention(a.into()))
        } else {
            let (theta, scaling) = target_rope
                .clone()
                .expect("a RoPE variant has the target's");
            Some(drafter.with_rope(theta, scaling)?)
        });
    }
    let mut union: Vec<usize> = vars
        .iter()
        .flat_map(|v| v.target_layer_ids.clone())
        .collect();
    union.sort_unstable();
    union.dedup();
    let budget = opts.tree_budget.max(1);
    // per variant, per sample: (Σ τ, steps) for DDTree and DFlash
    let mut ddtree: Vec<Vec<(usize, usize)>> = vec![vec![]; vars.len()];
    let mut dflash: Vec<Vec<(usize, usize)>> = vec![vec![]; vars.len()];
    // per variant: Σ (accepted + 1) over every anchor, anchors; per sample: (Σ ll, anchors)
    let mut all_tau: Vec<(usize, usize)> = vec![(0, 0); vars.len()];
    let mut ll: Vec<Vec<(f64, usize)>> = vec![vec![]; vars.len()];
    let mut acc_stats = TapStatsAccumulator::new(&declared, info.dtype);
    let mut answer_tokens = 0;
    for s in samples {
        let (start, end) = (s.prompt_len, s.tokens.len());
        answer_tokens += end - start;
        let all = sequence_taps(target, &s.tokens, &union)?;
        for (vi, v) in vars.iter().enumerate() {
            let feats = variant_taps(&all, &union, v, info.hidden_size)?;
            if vi == 0 && end > start {
                for (i, &l) in declared.iter().enumerate() {
                    let rows = feats.narrow(0, start, end - start)?.narrow(
                        1,
                        i * info.hidden_size,
                        info.hidden_size,
                    )?;
                    acc_stats.add(l, &rows)?;
                }
            }
            let anchors: Vec<u32> = (start as u32..end.saturating_sub(1) as u32).collect();
            let fed = fed[vi].as_ref().unwrap_or(drafter);
            let (acc, lls) = anchor_likelihood_with(
                target,
                fed,
                &feats,
                &s.tokens,
                &anchors,
                &[budget],
                32,
                &v.convention(),
            )?;
            all_tau[vi].0 += acc.ddtree[0].iter().map(|x| x + 1).sum::<usize>();
            all_tau[vi].1 += acc.ddtree[0].len();
            ll[vi].push((lls.iter().sum(), lls.len()));
            let tree = replay_steps(&acc, Some(0), start, end);
            let single = replay_steps(&acc, None, start, end);
            ddtree[vi].push((tree.iter().sum(), tree.len()));
            dflash[vi].push((single.iter().sum(), single.len()));
        }
    }
    let pooled = |pp: &[(usize, usize)]| {
        let (a, n) = pp.iter().fold((0, 0), |(a, n), &(x, m)| (a + x, n + m));
        a as f64 / n.max(1) as f64
    };
    let results = vars
        .into_iter()
        .enumerate()
        .map(|(vi, variant)| VariantResult {
            variant,
            ddtree_tau: pooled(&ddtree[vi]),
            ddtree_tau_ci95: bootstrap_ci95(&ddtree[vi], 2000),
            dflash_tau: pooled(&dflash[vi]),
            dflash_tau_ci95: bootstrap_ci95(&dflash[vi], 2000),
            ddtree_tau_per_prompt: ddtree[vi]
                .iter()
                .map(|&(a, n)| a as f64 / n.max(1) as f64)
                .collect(),
            teacher_forced_ddtree_tau: all_tau[vi].0 as f64 / all_tau[vi].1.max(1) as f64,
            log_likelihood: ll[vi].iter().map(|x| x.0).sum::<f64>()
                / ll[vi].iter().map(|x| x.1).sum::<usize>().max(1) as f64,
            log_likelihood_per_prompt: ll[vi].iter().map(|&(s, n)| s / n.max(1) as f64).collect(),
        })
        .collect();
    Ok((
        Scan {
            declared_target_layer_ids: declared,
            declared_mask_token_id: drafter.mask_token_id(),
            declared_position_offset: conv.position_offset,
            declared_anchor_slot_masked: conv.anchor_slot_masked,
            declared_final_norm_on_last_tap: declared_final_norm,
            num_target_layers: info.num_layers,
            tree_budget: budget,
            answer_tokens,
            variants: results,
        },
        acc_stats.finish(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variant_taps_pick_the_layers_columns_in_order() {
        let dev = candle_core::Device::Cpu;
        // union [3, 4, 5], hidden 2: layer l's row r is [10l + r, −(10l + r)]
        let rows: Vec<f32> = (0..2)
            .flat_map(|r| {
                [3, 4, 5]
                    .into_iter()
                    .flat_map(move |l| [(10 * l + r) as f32, -((10 * l + r) as f32)])
            })
            .collect();
        let all = Tensor::from_vec(rows, (2, 6), &dev).unwrap();
        let v = Variant {
            name: "x".into(),
            target_layer_ids: vec![5, 3],
            final_norm_on_last_tap: true,
            shift: 0,
            position_offset: 0,
            anchor_slot_masked: false,
            target_rope_theta: None,
            mask_token_id: None,
            attention: None,
            alteration: Alteration::FinalNorm,
        };
        let got: Vec<Vec<f32>> = variant_taps(&all, &[3, 4, 5], &v, 2)
            .unwrap()
            .to_vec2()
            .unwrap();
        // the raw rows: the final norm is the drafter's to apply (as declared or varied)
        assert_eq!(
            got,
            [[50.0, -50.0, 30.0, -30.0], [51.0, -51.0, 31.0, -31.0]]
        );
    }
}
