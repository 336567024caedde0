//! Conventions scan: the drafter's replayed τ under its declared conventions and under
//! alternatives that change only what it is fed.
//!
//! Invariants:
//! - The τ of a variant is decoding's walk ([`dflash_train::replay_steps`]) over blocks drafted at
//!   every answer position by the training-mode forward ([`dflash_train::anchor_likelihood`], the
//!   acceptance `eval --replay` walks plus each block's log-likelihood of the true text): DDTree
//!   at the scan's budget and single-path DFlash.
//! - Variants differ from the declared setting only in the taps tensor: the same rows of other
//!   layers (every tap shifted by −1 or +1, a shift leaving the target's layers skipped; the last
//!   tap moved to the target's last layer — the fc fed the last layer; the z-lab default taps for
//!   the target's depth), or the declared taps with the target's final RMSNorm applied to the last
//!   one; a list equal to an earlier variant's is not measured twice. The target runs once per
//!   sample for the union of the layers. Three more variants keep the declared taps and change
//!   the block's layout instead (`BlockConvention`): positions −1 / +1 (slot `j` at `anchor + j
//!   ± 1`) and slot 0 holding the mask token.
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

use crate::stats::{TapStatsAccumulator, TapStatsFile};
use crate::{Check, Options, Result, Sample, Verdict};
use candle_core::Tensor;
use dflash_core::{Grad, RmsNorm};
use dflash_models::drafter::BlockConvention;
use dflash_models::{DFlashDrafter, TargetModel};
use dflash_train::{
    anchor_likelihood_with, bootstrap_ci95, bootstrap_interval, replay_steps, sequence_taps,
};
use serde::Serialize;

/// Relative τ gain an alternative needs (beside beating the interval) to be a FAIL.
pub const FAIL_MARGIN: f64 = 0.10;
/// Mean log-likelihood gain (nats per draft row) an alternative needs for the likelihood rule.
pub const LL_MARGIN: f64 = 0.05;

/// Per-prompt log-likelihood gains of `a` over `declared`.
fn gains(declared: &VariantResult, a: &VariantResult) -> Vec<f64> {
    declared
        .log_likelihood_per_prompt
        .iter()
        .zip(&a.log_likelihood_per_prompt)
        .map(|(d, x)| x - d)
        .collect()
}

/// 95 % bootstrap interval (over prompts) of the mean log-likelihood gain of `a` over `declared`.
pub fn gain_ci95(declared: &VariantResult, a: &VariantResult) -> [f64; 2] {
    let g = gains(declared, a);
    bootstrap_interval(g.len(), 2000, &|picks| {
        let (s, n) = picks.fold((0.0, 0usize), |(s, n), i| (s + g[i], n + 1));
        s / n.max(1) as f64
    })
}

/// The likelihood rule: `Some(true)` when `a` beats `declared` by [`LL_MARGIN`] on average, the
/// 95 % bootstrap interval of the per-prompt gain lies above 0, and its all-positions τ is
/// higher; `Some(false)` when it beats it by the margin on average but not the rest; `None`
/// otherwise.
fn likelihood_wins(declared: &VariantResult, a: &VariantResult) -> Option<bool> {
    if a.log_likelihood < declared.log_likelihood + LL_MARGIN {
        return None;
    }
    Some(
        gain_ci95(declared, a)[0] > 0.0
            && a.teacher_forced_ddtree_tau > declared.teacher_forced_ddtree_tau,
    )
}

/// What the drafter is fed in one variant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Variant {
    pub name: String,
    /// The tap layers, in concatenation order.
    pub target_layer_ids: Vec<usize>,
    /// The target's final RMSNorm applied to the last tap.
    pub final_norm_on_last_tap: bool,
    /// Every tap shifted by this many layers from the declared ones.
    pub shift: i64,
    /// Added to every block slot's position (the declared layout: slot `j` at `anchor + j`).
    pub position_offset: i64,
    /// Slot 0 holds the mask token instead of the anchor's token.
    pub anchor_slot_masked: bool,
    /// The drafter's RoPE replaced by the target's (base θ here; scaling too).
    pub target_rope_theta: Option<f64>,
    /// What the variant changes.
    pub alteration: Alteration,
}

impl Variant {
    fn convention(&self) -> BlockConvention {
        BlockConvention {
            position_offset: self.position_offset,
            anchor_slot_masked: self.anchor_slot_masked,
        }
    }
}

/// What a [`Variant`] changes from the declared setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Alteration {
    Declared,
    /// Every tap moved by [`Variant::shift`] layers.
    Shift,
    /// The target's final RMSNorm on the last tap.
    FinalNorm,
    /// The last tap moved to the target's last layer (the fc fed the target's last layer).
    LastLayer,
    /// The z-lab default taps for the target's depth and the declared tap count (a config saved
    /// with other layers than the drafter was trained on).
    DefaultLayout,
    /// Block positions moved by [`Variant::position_offset`].
    Positions,
    /// The mask token in slot 0.
    AnchorSlot,
    /// The target's RoPE (θ and scaling) instead of the drafter's declared one.
    TargetRope,
}

/// The declared setting (first) and each applicable alternative.
/// `target_rope`: the target's RoPE θ when it differs from the drafter's declared RoPE (θ or
/// scaling), which adds the target-RoPE variant.
pub fn variants(
    declared: &[usize],
    num_layers: usize,
    has_final_norm: bool,
    target_rope: Option<f64>,
) -> Vec<Variant> {
    let mut out = vec![Variant {
        name: "declared".into(),
        target_layer_ids: declared.to_vec(),
        final_norm_on_last_tap: false,
        shift: 0,
        position_offset: 0,
        anchor_slot_masked: false,
        target_rope_theta: None,
        alteration: Alteration::Declared,
    }];
    for shift in [-1i64, 1] {
        let moved: Option<Vec<usize>> = declared
            .iter()
            .map(|&l| {
                let m = l as i64 + shift;
                (0..num_layers as i64).contains(&m).then_some(m as usize)
            })
            .collect();
        if let Some(layers) = moved {
            out.push(Variant {
                name: format!("taps {shift:+}"),
                target_layer_ids: layers,
                final_norm_on_last_tap: false,
                shift,
                position_offset: 0,
                anchor_slot_masked: false,
                target_rope_theta: None,
                alteration: Alteration::Shift,
            });
        }
    }
    if has_final_norm && !declared.is_empty() {
        out.push(Variant {
            name: "final norm on last tap".into(),
            target_layer_ids: declared.to_vec(),
            final_norm_on_last_tap: true,
            shift: 0,
            position_offset: 0,
            anchor_slot_masked: false,
            target_rope_theta: None,
            alteration: Alteration::FinalNorm,
        });
    }
    // taps-only alternatives not already in the list
    let mut push_new = |name: &str, layers: Vec<usize>, alteration: Alteration| {
        if !out
            .iter()
            .any(|v| v.target_layer_ids == layers && !v.final_norm_on_last_tap)
        {
            out.push(Variant {
                name: name.into(),
                target_layer_ids: layers,
                final_norm_on_last_tap: false,
                shift: 0,
                position_offset: 0,
                anchor_slot_masked: false,
                target_rope_theta: None,
                alteration,
            });
        }
    };
    if let Some((&l, rest)) = declared.split_last() {
        let last = num_layers.saturating_sub(1);
        if l != last && num_layers > 0 {
            let mut layers = rest.to_vec();
            layers.push(last);
            push_new("last tap on last layer", layers, Alteration::LastLayer);
        }
        let default = dflash_models::drafter::default_target_layers(num_layers, declared.len());
        if default.iter().all(|&x| x < num_layers) {
            push_new("default taps", default, Alteration::DefaultLayout);
        }
    }
    // the block's layout: positions off by one, slot 0 masked
    for offset in [-1i64, 1] {
        out.push(Variant {
            name: format!("positions {offset:+}"),
            target_layer_ids: declared.to_vec(),
            final_norm_on_last_tap: false,
            shift: 0,
            position_offset: offset,
            anchor_slot_masked: false,
            target_rope_theta: None,
            alteration: Alteration::Positions,
        });
    }
    out.push(Variant {
        name: "slot 0 masked".into(),
        target_layer_ids: declared.to_vec(),
        final_norm_on_last_tap: false,
        shift: 0,
        position_offset: 0,
        anchor_slot_masked: true,
        target_rope_theta: None,
        alteration: Alteration::AnchorSlot,
    });
    if let Some(theta) = target_rope {
        out.push(Variant {
            name: format!("target's RoPE (theta {theta})"),
            target_layer_ids: declared.to_vec(),
            final_norm_on_last_tap: false,
            shift: 0,
            position_offset: 0,
            anchor_slot_masked: false,
            target_rope_theta: Some(theta),
            alteration: Alteration::TargetRope,
        });
    }
    out
}

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
    pub num_target_layers: usize,
    pub tree_budget: usize,
    /// Answer tokens replayed (over every sample).
    pub answer_tokens: usize,
    /// Declared first.
    pub variants: Vec<VariantResult>,
}

/// `[S, T·H]` taps of `v` from `all` (`[S, U·H]`, the layers of `union` in order).
fn variant_taps(
    all: &Tensor,
    union: &[usize],
    v: &Variant,
    hidden: usize,
    norm: Option<&RmsNorm>,
) -> Result<Tensor> {
    let mut parts = vec![];
    for (i, l) in v.target_layer_ids.iter().enumerate() {
        let u = union.iter().position(|x| x == l).expect("union has it");
        let mut t = all.narrow(1, u * hidden, hidden)?.contiguous()?;
        if v.final_norm_on_last_tap && i + 1 == v.target_layer_ids.len() {
            if let Some(n) = norm {
                t = n.forward(&t, Grad::Off)?;
            }
        }
        parts.push(t);
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
    let norm = target
        .final_norm_weight()
        .map(|w| RmsNorm::new(w, opts.final_norm_eps));
    // the target's RoPE, when the drafter declares another, and the drafter fed it
    let declared_rope = drafter.config().rope().ok();
    let target_rope = opts.target_rope.clone().filter(|(theta, scaling)| {
        declared_rope
            .as_ref()
            .is_some_and(|d| (d.theta - theta).abs() > 1e-9 * theta.abs() || d.scaling != *scaling)
    });
    let rope_drafter = match &target_rope {
        Some((theta, scaling)) => Some(drafter.with_rope(*theta, scaling.clone())?),
        None => None,
    };
    let mut vars = variants(
        &declared,
        info.num_layers,
        norm.is_some(),
        target_rope.as_ref().map(|r| r.0),
    );
    if declared_only {
        vars.truncate(1);
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
            let feats = variant_taps(&all, &union, v, info.hidden_size, norm.as_ref())?;
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
            let fed = match (&rope_drafter, v.target_rope_theta) {
                (Some(d), Some(_)) => d,
                _ => drafter,
            };
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
            num_target_layers: info.num_layers,
            tree_budget: budget,
            answer_tokens,
            variants: results,
        },
        acc_stats.finish(),
    ))
}

fn fmt_layers(l: &[usize]) -> String {
    format!(
        "[{}]",
        l.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// The verdict of a scan (see the module's invariants).
pub fn judge(scan: &Scan) -> Check {
    const NAME: &str = "conventions";
    let Some((declared, alts)) = scan.variants.split_first() else {
        return Check {
            check: NAME.into(),
            verdict: Verdict::Warn,
            evidence: "no variants measured".into(),
            cause: String::new(),
            fix: String::new(),
        };
    };
    let b = scan.tree_budget;
    let mut evidence = format!(
        "DDTree-{b} tau: declared {:.2} [{:.2}-{:.2}]",
        declared.ddtree_tau, declared.ddtree_tau_ci95[0], declared.ddtree_tau_ci95[1]
    );
    for a in alts {
        evidence += &format!(", {} {:.2}", a.variant.name, a.ddtree_tau);
    }
    evidence += &format!("; DFlash tau: declared {:.2}", declared.dflash_tau);
    for a in alts {
        evidence += &format!(", {} {:.2}", a.variant.name, a.dflash_tau);
    }
    evidence += &format!(
        "; all-positions DDTree tau / log-likelihood: declared {:.2} / {:.3}",
        declared.teacher_forced_ddtree_tau, declared.log_likelihood
    );
    for a in alts {
        evidence += &format!(
            ", {} {:.2} / {:.3}",
            a.variant.name, a.teacher_forced_ddtree_tau, a.log_likelihood
        );
    }
    evidence += &format!(
        " ({} answer tokens, {} prompts)",
        scan.answer_tokens,
        declared.ddtree_tau_per_prompt.len()
    );
    let upper = declared.ddtree_tau_ci95[1];
    let margin_ok = |a: &VariantResult| a.ddtree_tau >= (1.0 + FAIL_MARGIN) * declared.ddtree_tau;
    // one prompt gives no interval (the bootstrap of one is a point): never conclusive
    let enough = declared.ddtree_tau_per_prompt.len() >= 2;
    let tau_rule = |a: &VariantResult| enough && a.ddtree_tau > upper && margin_ok(a);
    let ll_rule = |a: &VariantResult| enough && likelihood_wins(declared, a) == Some(true);
    let best = |pred: &dyn Fn(&VariantResult) -> bool| {
        alts.iter()
            .filter(|a| pred(a))
            .max_by(|x, y| x.log_likelihood.total_cmp(&y.log_likelihood))
    };
    if let Some(a) = best(&|a| tau_rule(a) || ll_rule(a)) {
        let (cause, fix) = explain(scan, a);
        let why = if tau_rule(a) {
            format!(
                "'{}' replays DDTree tau {:.2} vs declared {:.2} (above its 95 % bound {upper:.2} and by >= {:.0} %)",
                a.variant.name,
                a.ddtree_tau,
                declared.ddtree_tau,
                FAIL_MARGIN * 100.0
            )
        } else {
            format!(
                "'{}' gives the true text a higher log-likelihood than the declared setting ({:+.3} nats a token, 95 % interval {:+.3} to {:+.3} over {} prompts) and a higher all-positions tau ({:.2} vs {:.2})",
                a.variant.name,
                a.log_likelihood - declared.log_likelihood,
                gain_ci95(declared, a)[0],
                gain_ci95(declared, a)[1],
                declared.log_likelihood_per_prompt.len(),
                a.teacher_forced_ddtree_tau,
                declared.teacher_forced_ddtree_tau
            )
        };
        return Check {
            check: NAME.into(),
            verdict: Verdict::Fail,
            evidence,
            cause: format!("{why}: {cause}"),
            fix,
        };
    }
    // better, but short of a rule (or of the prompts a rule needs)
    let inconclusive = |a: &VariantResult| {
        a.ddtree_tau > upper
            || (a.ddtree_tau > declared.ddtree_tau && margin_ok(a))
            || likelihood_wins(declared, a).is_some()
    };
    if let Some(a) = best(&inconclusive) {
        return Check {
            check: NAME.into(),
            verdict: Verdict::Warn,
            evidence,
            cause: format!(
                "'{}' scores better than the declared setting, but not conclusively (one prompt; or tau: not by {:.0} % beyond the declared interval; log-likelihood: its gain's 95 % interval reaches 0)",
                a.variant.name,
                FAIL_MARGIN * 100.0,
            ),
            fix: "rerun with more prompts (--limit) to separate the two".into(),
        };
    }
    Check::ok(NAME, evidence)
}

/// Cause and fix naming the setting to change for an alternative that won.
fn explain(scan: &Scan, a: &VariantResult) -> (String, String) {
    let declared = &scan.declared_target_layer_ids;
    let last = scan.num_target_layers.saturating_sub(1);
    let v = &a.variant;
    if v.shift != 0 {
        let sign = if v.shift < 0 { "\u{2212}1" } else { "+1" };
        let cause = format!(
            "the drafter was trained on the outputs of the layers {} those its config declares (an off-by-one between HF hidden_states[l] and the output of layer l)",
            if v.shift < 0 { "one before" } else { "one after" }
        );
        let fix = format!(
            "tap layers look shifted by {sign}: target_layer_ids {} \u{2192} {} (dflash_config.target_layer_ids in the drafter's config.json)",
            fmt_layers(declared),
            fmt_layers(&v.target_layer_ids)
        );
        return (cause, fix);
    }
    let moved = |what: &str| {
        format!(
            "{what}: target_layer_ids {} \u{2192} {} (dflash_config.target_layer_ids in the drafter's config.json)",
            fmt_layers(declared),
            fmt_layers(&v.target_layer_ids)
        )
    };
    let l = declared.last().copied().unwrap_or(0);
    match v.alteration {
        Alteration::LastLayer => {
            return (
                format!(
                    "the drafter was trained with its fc fed the target's last layer ({last}), but its config declares layer {l} as the last tap"
                ),
                moved("feed the last layer"),
            );
        }
        Alteration::DefaultLayout => {
            let only_last = declared.len() == v.target_layer_ids.len()
                && declared[..declared.len() - 1] == v.target_layer_ids[..declared.len() - 1];
            let cause = if only_last && l == last {
                format!(
                    "the config feeds the fc the target's last layer ({last}), but the drafter was trained on layer {} (the z-lab default taps)",
                    v.target_layer_ids.last().copied().unwrap_or(0)
                )
            } else {
                "the drafter was trained on the z-lab default taps for this target, but its config declares other layers (a config saved from another run or edited)".into()
            };
            return (cause, moved("use the default taps"));
        }
        Alteration::Positions => {
            let o = v.position_offset;
            return (
                format!(
                    "the drafter was trained with its block's position ids shifted by {o:+} (slot j at anchor + j {o:+}; an off-by-one between training and inference positions)"
                ),
                format!(
                    "lay blocks out at anchor + j {o:+} when drafting, or retrain with slot j at anchor + j (the z-lab layout)"
                ),
            );
        }
        Alteration::TargetRope => {
            let theta = v.target_rope_theta.unwrap_or(0.0);
            return (
                format!(
                    "the drafter was trained with the target's RoPE (theta {theta}), but its config declares another (rope_theta / rope_scaling)"
                ),
                format!(
                    "set the drafter's rope_theta to {theta} (and its rope_scaling to the target's) in its config.json"
                ),
            );
        }
        Alteration::AnchorSlot => {
            return (
                "the drafter was trained with the mask token in slot 0, not the anchor (bonus) token".into(),
                "retrain with the anchor token in slot 0 (the z-lab layout), or feed the mask token there when drafting".into(),
            );
        }
        _ => {}
    }
    if l == last {
        (
            format!(
                "the drafter was trained on the target's last layer ({l}) after the final norm (HF's hidden_states[-1] is normed), but is fed its raw output"
            ),
            format!("feed tap {l} through the target's final RMSNorm (or retrain on the raw layer outputs)"),
        )
    } else {
        (
            format!(
                "the drafter's last tap (layer {l}) behaves like a final-normed hidden state: it was trained on another layer path (a model class whose hidden states are normed)"
            ),
            format!(
                "retrain on raw decoder-layer outputs, or feed tap {l} through the target's final RMSNorm"
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_skip_shifts_that_leave_the_target() {
        let v = variants(&[1, 8, 14, 20, 27], 30, true, None);
        let names: Vec<&str> = v.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "declared",
                "taps -1",
                "taps +1",
                "final norm on last tap",
                "last tap on last layer",
                "positions -1",
                "positions +1",
                "slot 0 masked"
            ]
        );
        assert_eq!(v[1].target_layer_ids, [0, 7, 13, 19, 26]);
        assert_eq!(v[2].target_layer_ids, [2, 9, 15, 21, 28]);
        assert_eq!(v[4].target_layer_ids, [1, 8, 14, 20, 29]);
        // a config whose fc is fed the last layer: the default taps are the alternative
        let v = variants(&[1, 8, 14, 20, 29], 30, true, Some(10000.0));
        let names: Vec<&str> = v.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(
            &names[..4],
            [
                "declared",
                "taps -1",
                "final norm on last tap",
                "default taps"
            ]
        );
        assert_eq!(v[3].target_layer_ids, [1, 8, 14, 20, 27]);
        let rope = v.last().unwrap();
        assert_eq!(rope.alteration, Alteration::TargetRope);
        assert_eq!(rope.target_rope_theta, Some(10000.0));
        assert_eq!(rope.target_layer_ids, [1, 8, 14, 20, 29]);
        // layer 0 has no −1; layer 29 of 30 has no +1; no final norm, no norm variant; the last
        // tap is the last layer already; the default taps for two taps of 30 layers are [1, 27]
        let v = variants(&[0, 29], 30, false, None);
        let names: Vec<&str> = v.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(&names[..2], ["declared", "default taps"]);
        assert_eq!(v[2].position_offset, -1);
        assert!(v[4].anchor_slot_masked && v[4].target_layer_ids == [0, 29]);
        assert_eq!(v[1].target_layer_ids, [1, 27]);
    }

    #[test]
    fn variant_taps_pick_the_layers_columns_and_norm_only_the_last() {
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
            alteration: Alteration::FinalNorm,
        };
        let norm = RmsNorm::new(Tensor::new(&[2f32, 2.0], &dev).unwrap(), 0.0);
        let got: Vec<Vec<f32>> = variant_taps(&all, &[3, 4, 5], &v, 2, Some(&norm))
            .unwrap()
            .to_vec2()
            .unwrap();
        // layer 5 as is; layer 3 RMS-normed (|x| / rms = 1) times the weight 2
        assert_eq!(got, [[50.0, -50.0, 2.0, -2.0], [51.0, -51.0, 2.0, -2.0]]);
    }

    fn result(v: &Variant, tau: f64, ci: [f64; 2]) -> VariantResult {
        VariantResult {
            variant: v.clone(),
            ddtree_tau: tau,
            ddtree_tau_ci95: ci,
            dflash_tau: tau / 2.0,
            dflash_tau_ci95: [ci[0] / 2.0, ci[1] / 2.0],
            ddtree_tau_per_prompt: vec![tau, tau],
            teacher_forced_ddtree_tau: tau,
            log_likelihood: -1.0,
            log_likelihood_per_prompt: vec![-1.0, -1.0],
        }
    }

    fn scan_of(taus: &[(f64, [f64; 2])]) -> Scan {
        let v = variants(&[2, 9, 15, 21, 28], 30, true, None);
        Scan {
            declared_target_layer_ids: vec![2, 9, 15, 21, 28],
            num_target_layers: 30,
            tree_budget: 64,
            answer_tokens: 100,
            variants: v
                .iter()
                .zip(taus)
                .map(|(v, &(t, ci))| result(v, t, ci))
                .collect(),
        }
    }

    #[test]
    fn a_clearly_better_shift_fails_and_names_the_layers() {
        let s = scan_of(&[
            (1.1, [1.0, 1.2]),
            (3.5, [3.0, 4.0]),
            (1.05, [1.0, 1.1]),
            (1.0, [1.0, 1.0]),
        ]);
        let c = judge(&s);
        assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
        assert!(c.fix.contains("shifted by \u{2212}1"), "{}", c.fix);
        assert!(
            c.fix
                .contains("[2, 9, 15, 21, 28] \u{2192} [1, 8, 14, 20, 27]"),
            "{}",
            c.fix
        );
        assert!(c.evidence.contains("taps -1 3.50"), "{}", c.evidence);
        // the same numbers from one prompt: no interval, inconclusive
        let mut one = s.clone();
        for v in &mut one.variants {
            v.ddtree_tau_per_prompt.truncate(1);
            v.log_likelihood_per_prompt.truncate(1);
        }
        assert_eq!(judge(&one).verdict, Verdict::Warn);
    }

    #[test]
    fn worse_alternatives_are_ok_and_marginal_ones_warn() {
        let ok = scan_of(&[
            (3.0, [2.8, 3.2]),
            (1.2, [1.1, 1.3]),
            (1.3, [1.2, 1.4]),
            (2.9, [2.7, 3.1]),
        ]);
        assert_eq!(judge(&ok).verdict, Verdict::Ok);
        // beyond the interval but by less than 10 %: inconclusive
        let marginal = scan_of(&[
            (3.0, [2.9, 3.1]),
            (3.2, [3.1, 3.3]),
            (1.3, [1.2, 1.4]),
            (2.9, [2.7, 3.1]),
        ]);
        assert_eq!(judge(&marginal).verdict, Verdict::Warn);
        // 20 % better but inside a wide declared interval: inconclusive
        let wide = scan_of(&[
            (3.0, [2.0, 4.0]),
            (3.6, [3.0, 4.2]),
            (1.3, [1.2, 1.4]),
            (2.9, [2.7, 3.1]),
        ]);
        assert_eq!(judge(&wide).verdict, Verdict::Warn);
        // the final-norm variant winning names the norm
        let normed = scan_of(&[
            (1.2, [1.1, 1.3]),
            (1.1, [1.0, 1.2]),
            (1.1, [1.0, 1.2]),
            (3.0, [2.8, 3.2]),
        ]);
        let c = judge(&normed);
        assert_eq!(c.verdict, Verdict::Fail);
        assert!(c.fix.contains("final RMSNorm"), "{}", c.fix);
    }

    #[test]
    fn a_consistently_likelier_shift_fails_even_when_tau_is_close() {
        // the planted SmolLM2 case: the walk's τ differs by ~5 %, the likelihood on every prompt
        let mut s = scan_of(&[
            (4.09, [3.62, 4.70]),
            (4.32, [3.62, 5.33]),
            (1.85, [1.71, 2.00]),
            (1.30, [1.30, 1.31]),
        ]);
        let lls = [
            (-4.37, vec![-4.3, -4.44], 3.24),
            (-4.25, vec![-4.2, -4.30], 3.53),
            (-7.1, vec![-7.0, -7.2], 1.59),
            (-8.7, vec![-8.6, -8.8], 1.26),
        ];
        for (v, (ll, per, tf)) in s.variants.iter_mut().zip(lls.clone()) {
            v.log_likelihood = ll;
            v.log_likelihood_per_prompt = per;
            v.teacher_forced_ddtree_tau = tf;
        }
        let c = judge(&s);
        assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
        assert!(c.fix.contains("shifted by \u{2212}1"), "{}", c.fix);
        assert!(c.cause.contains("over 2 prompts"), "{}", c.cause);
        // better on average but on one prompt of two only: inconclusive
        s.variants[1].log_likelihood_per_prompt = vec![-4.0, -4.5];
        assert_eq!(judge(&s).verdict, Verdict::Warn);
        // a gain below the margin is no evidence
        s.variants[1].log_likelihood_per_prompt = vec![-4.29, -4.43];
        s.variants[1].log_likelihood = -4.36;
        assert_eq!(judge(&s).verdict, Verdict::Ok);
    }
}
