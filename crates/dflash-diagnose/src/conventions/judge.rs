//! The conventions scan's verdict: the τ rule and the likelihood rule of the parent module's
//! invariants, and the cause and fix naming the setting to change for a winning alternative.
//! A pure function of the measured numbers.

use super::{Alteration, Scan, VariantResult};
use crate::{Check, Verdict};
use dflash_train::bootstrap_interval;

/// Relative τ gain an alternative needs (beside beating the interval) to be a FAIL.
pub const FAIL_MARGIN: f64 = 0.10;
/// Mean log-likelihood gain (nats per draft row) an alternative needs for the likelihood rule.
pub const LL_MARGIN: f64 = 0.05;
/// Below this declared DDTree τ the drafter is too weak to judge by its preferences: only an
/// alternative that makes it draft (τ at least this, its 95 % interval above the declared one)
/// is a FAIL; the likelihood rule is not applied.
pub const WEAK_TAU: f64 = 1.5;

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
    // an under-trained drafter barely drafts under any input, and its small, consistent
    // preferences are noise of its training, not a convention: it needs a clear τ win
    let weak = declared.ddtree_tau < WEAK_TAU;
    let clear = |a: &VariantResult| a.ddtree_tau >= WEAK_TAU && a.ddtree_tau_ci95[0] > upper;
    let tau_rule =
        |a: &VariantResult| enough && a.ddtree_tau > upper && margin_ok(a) && (!weak || clear(a));
    let ll_rule = |a: &VariantResult| enough && !weak && likelihood_wins(declared, a) == Some(true);
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
    if weak {
        return Check {
            check: NAME.into(),
            verdict: Verdict::Warn,
            evidence,
            cause: format!(
                "drafter too weak to judge conventions: its declared DDTree tau {:.2} is below {WEAK_TAU} and no alternative drafts clearly better (tau >= {WEAK_TAU} with its 95 % interval above the declared {upper:.2})",
                declared.ddtree_tau
            ),
            fix: "train the drafter further (or diagnose a stronger checkpoint) before reading its conventions".into(),
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
            let (o, d) = (v.position_offset, scan.declared_position_offset);
            let layout = |o: i64| match o {
                0 => "slot j at anchor + j, the z-lab layout".to_string(),
                o if o > 0 => format!("slot j at anchor + j + {o}"),
                o => format!("slot j at anchor + j \u{2212} {}", -o),
            };
            return (
                format!(
                    "the drafter was trained with its block's position ids {} than those its config declares ({}; declared: {}), an off-by-one between training and inference positions",
                    if o < d { "one lower" } else { "one higher" },
                    layout(o),
                    layout(d)
                ),
                format!(
                    "set dflash_config.block_position_offset {d} \u{2192} {o} in the drafter's config.json{}",
                    if o == 0 { " (or remove it)" } else { "" }
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
            return if v.anchor_slot_masked {
                (
                    "the drafter was trained with the mask token in slot 0, not the anchor (bonus) token its config declares".into(),
                    "set dflash_config.anchor_slot_masked to true in the drafter's config.json, or retrain with the anchor token in slot 0 (the z-lab layout)".into(),
                )
            } else {
                (
                    "the drafter was trained with the anchor (bonus) token in slot 0 (the z-lab layout), but its config declares the mask token there".into(),
                    "remove dflash_config.anchor_slot_masked (or set it to false) in the drafter's config.json".into(),
                )
            };
        }
        Alteration::MaskToken => {
            let id = v.mask_token_id.unwrap_or(0);
            return (
                format!(
                    "the drafter was trained with mask token {id}, but its config declares {} (the block's unknown slots are embedded as another token)",
                    scan.declared_mask_token_id
                ),
                format!(
                    "set dflash_config.mask_token_id to {id} in the drafter's config.json (was {})",
                    scan.declared_mask_token_id
                ),
            );
        }
        Alteration::NotLastLayer => {
            return (
                format!(
                    "the config feeds the fc the target's last layer ({last}), but the drafter was trained on layer {}",
                    v.target_layer_ids.last().copied().unwrap_or(0)
                ),
                moved("do not feed the last layer"),
            );
        }
        Alteration::Attention => {
            return match v.attention.and_then(|a| a.window) {
                None => (
                    "the drafter was trained with full attention in every layer, but its config declares sliding-window (or causal) layers".into(),
                    "set every layer_types entry to \"full_attention\" (and drop is_causal / dflash_config.causal) in the drafter's config.json".into(),
                ),
                Some(w) => (
                    format!("the drafter was trained with sliding-window attention (window {w}), but its config declares full attention in every layer"),
                    "set layer_types to \"sliding_attention\" for the drafter's layers in its config.json (sliding_window as given)".into(),
                ),
            };
        }
        Alteration::FinalNorm if !v.final_norm_on_last_tap => {
            return (
                format!(
                    "the drafter was trained on the raw output of its last tap (layer {l}), but its config declares the target's final norm on it"
                ),
                "remove dflash_config.final_norm_on_last_tap (or set it to false) in the drafter's config.json".into(),
            );
        }
        Alteration::Declared | Alteration::Shift | Alteration::FinalNorm => {}
    }
    // the final norm on the last tap won
    let set = "set dflash_config.final_norm_on_last_tap to true in the drafter's config.json";
    if l == last {
        (
            format!(
                "the drafter was trained on the target's last layer ({l}) after the final norm (HF's hidden_states[-1] is normed), but is fed its raw output"
            ),
            format!("{set} (or retrain on the raw layer outputs)"),
        )
    } else {
        (
            format!(
                "the drafter's last tap (layer {l}) behaves like a final-normed hidden state: it was trained on another layer path (a model class whose hidden states are normed)"
            ),
            format!("{set}, or retrain on raw decoder-layer outputs"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::{variants, Variant};
    use super::*;

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
        let v = variants(
            &[2, 9, 15, 21, 28],
            Default::default(),
            30,
            Some(false),
            None,
        );
        Scan {
            declared_target_layer_ids: vec![2, 9, 15, 21, 28],
            declared_mask_token_id: 16,
            declared_position_offset: 0,
            declared_anchor_slot_masked: false,
            declared_final_norm_on_last_tap: false,
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
        assert!(
            c.fix
                .contains("set dflash_config.final_norm_on_last_tap to true"),
            "{}",
            c.fix
        );
        // declared with the norm, the variant without it winning names the field to remove
        let mut declared_normed = normed.clone();
        declared_normed.declared_final_norm_on_last_tap = true;
        for r in &mut declared_normed.variants {
            r.variant.final_norm_on_last_tap = r.variant.alteration != Alteration::FinalNorm;
        }
        let c = judge(&declared_normed);
        assert_eq!(c.verdict, Verdict::Fail);
        assert!(
            c.fix
                .contains("remove dflash_config.final_norm_on_last_tap"),
            "{}",
            c.fix
        );
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

    #[test]
    fn a_weak_drafter_is_a_warn_unless_an_alternative_clearly_drafts() {
        // the under-trained case: a consistent likelihood preference for taps -1, tau at the floor
        let mut s = scan_of(&[
            (1.04, [1.01, 1.08]),
            (1.06, [1.02, 1.10]),
            (1.02, [1.0, 1.05]),
            (1.0, [1.0, 1.0]),
        ]);
        s.variants[1].log_likelihood = -7.0;
        s.variants[1].log_likelihood_per_prompt = vec![-6.9, -7.1];
        s.variants[1].teacher_forced_ddtree_tau = 1.2;
        s.variants[0].log_likelihood = -7.3;
        s.variants[0].log_likelihood_per_prompt = vec![-7.2, -7.4];
        let c = judge(&s);
        assert_eq!(c.verdict, Verdict::Warn, "{c:?}");
        assert!(c.cause.contains("too weak"), "{}", c.cause);
        // the same preference from a drafter that drafts is a FAIL
        let mut strong = s.clone();
        for v in &mut strong.variants {
            v.ddtree_tau += 2.0;
            v.ddtree_tau_ci95 = [v.ddtree_tau_ci95[0] + 2.0, v.ddtree_tau_ci95[1] + 2.0];
        }
        assert_eq!(judge(&strong).verdict, Verdict::Fail);
        // 15 % better beyond the interval, but still barely drafting: a warn
        s.variants[1].ddtree_tau = 1.2;
        s.variants[1].ddtree_tau_ci95 = [1.1, 1.3];
        assert_eq!(judge(&s).verdict, Verdict::Warn);
        // an alternative that makes it draft, its interval above the declared one: a FAIL
        s.variants[1].ddtree_tau = 2.0;
        s.variants[1].ddtree_tau_ci95 = [1.8, 2.2];
        let c = judge(&s);
        assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
        assert!(c.fix.contains("shifted by \u{2212}1"), "{}", c.fix);
    }

    #[test]
    fn a_better_mask_token_or_attention_names_the_setting() {
        let taps = [2, 9, 15, 21, 28];
        let sliding = dflash_models::drafter::LayerAttention {
            causal: true,
            window: Some(4),
        };
        let mut vs = vec![variants(&taps, Default::default(), 30, Some(false), None).remove(0)];
        vs.extend(super::super::drafter_variants(
            &vs[0].clone(),
            16,
            &[("eos".into(), 2)],
            &[sliding],
            Some(4),
        ));
        let mut s = scan_of(&[(1.6, [1.4, 1.8]), (1.5, [1.3, 1.7]), (1.7, [1.5, 1.9])]);
        s.variants = vs
            .iter()
            .zip(&s.variants)
            .map(|(v, r)| VariantResult {
                variant: v.clone(),
                ..r.clone()
            })
            .collect();
        // the mask token wins
        s.variants[1].ddtree_tau = 3.0;
        s.variants[1].ddtree_tau_ci95 = [2.7, 3.3];
        let c = judge(&s);
        assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
        assert!(c.fix.contains("mask_token_id to 2"), "{}", c.fix);
        assert!(c.cause.contains("mask token 2"), "{}", c.cause);
        // full attention wins
        s.variants[1].ddtree_tau = 1.5;
        s.variants[1].ddtree_tau_ci95 = [1.3, 1.7];
        s.variants[2].ddtree_tau = 3.0;
        s.variants[2].ddtree_tau_ci95 = [2.7, 3.3];
        let c = judge(&s);
        assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
        assert!(c.fix.contains("full_attention"), "{}", c.fix);
    }

    #[test]
    fn a_better_layout_names_the_config_field_from_the_declared_value() {
        // the config declares slot j at anchor + j + 1 and the mask token in slot 0
        let conv = dflash_models::drafter::BlockConvention {
            position_offset: 1,
            anchor_slot_masked: true,
        };
        let taps = [2, 9, 15, 21, 28];
        let vs = variants(&taps, conv, 30, Some(false), None);
        let mut s = scan_of(&[(2.0, [1.8, 2.2])]);
        s.declared_position_offset = 1;
        s.declared_anchor_slot_masked = true;
        s.variants = vs.iter().map(|v| result(v, 1.5, [1.3, 1.7])).collect();
        s.variants[0] = result(&vs[0], 2.0, [1.8, 2.2]);
        let at = |name: &str| vs.iter().position(|v| v.name == name).unwrap();
        // positions −1 from the declared +1: the z-lab layout
        let i = at("positions -1");
        s.variants[i] = result(&vs[i], 3.0, [2.7, 3.3]);
        let c = judge(&s);
        assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
        assert!(
            c.fix.contains(
                "block_position_offset 1 \u{2192} 0 in the drafter's config.json (or remove it)"
            ),
            "{}",
            c.fix
        );
        assert!(c.cause.contains("one lower"), "{}", c.cause);
        // slot 0 the anchor's token instead of the declared mask
        s.variants[i] = result(&vs[i], 1.5, [1.3, 1.7]);
        let j = at("slot 0 anchor token");
        s.variants[j] = result(&vs[j], 3.0, [2.7, 3.3]);
        let c = judge(&s);
        assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
        assert!(
            c.fix.contains("remove dflash_config.anchor_slot_masked"),
            "{}",
            c.fix
        );
    }
}
