//! Training vs evaluation (issue 16, item 4): the τ a run's validation recorded against the τ the
//! exported drafter reaches when it decodes the same validation prompts now.
//!
//! Invariants:
//! - The prompts are the run manifest's recorded validation examples (the first of the set
//!   `validate` walked), in order; each is decoded live by `dflash_decoding::generate_speculative`
//!   — the inference path `eval` times — greedily, DDTree at the run's tree budget and single-path
//!   DFlash, for at most as many tokens as its training answer holds (capped by the caller): the
//!   live answer covers the same window of the same prompt as the recorded one.
//! - Beside the live τ two replays (the conventions scan's declared variant: the training-mode
//!   forward walked as decoding walks) split a disagreement into stages, each on the same prompts:
//!   live decoding vs the replay of the live answers (the decoding path vs training's forward on
//!   the same text), the replay of the live answers vs the replay of the training answers (the
//!   target's answers now vs the data's), and the replay of the training answers vs the recorded
//!   τ (the exported drafter on the run's own text vs what the run recorded; this stage also holds
//!   the difference between these prompts' windows and the whole validation set).
//! - The tap statistics of the replay of the training answers (declared taps, answer rows) are
//!   taken on exactly the tokens the manifest's statistics were taken on (the first `window`
//!   answer tokens of each), so a shift there is the target's, not the text's.
//! - [`judge`] is pure: FAIL when the target's model class, depth, width or vocabulary differs
//!   from the run's; FAIL when the live DDTree or DFlash τ differs from the recorded replayed τ by
//!   more than [`MAX_RELATIVE_GAP`] (relative to the recorded) and the recorded value lies outside
//!   the live τ's 95 % bootstrap interval over at least two prompts; a gap beyond the margin inside
//!   the interval or on a single prompt (no interval: one prompt's τ is no estimate of the
//!   validation set's), no prompt to decode, or a validation that replayed no step is a warn; ok
//!   otherwise. The cause names the stage with the largest relative gap. The streaks are evidence only: they average
//!   teacher-forced blocks at random anchors and run above decoding's τ by construction.

use crate::conventions::{scan_variants, VariantResult};
use crate::run_manifest::{prompt_len, RecordedValidation, RunManifest, TargetFacts};
use crate::run_manifest::{ValidationSource, VALIDATION_FILE};
use crate::stats::TapStatsFile;
use crate::{Check, DiagnoseError, Options, Result, Sample, Verdict};
use dflash_decoding::{
    generate_speculative, DFlashRunner, GenerateConfig, SamplingConfig, SpecMode,
};
use dflash_models::{DFlashDrafter, TargetModel};
use dflash_train::bootstrap_ci95;
use serde::Serialize;
use std::time::Instant;

/// The check's name in the table and the JSON.
pub const NAME: &str = "train_vs_eval";
/// Largest relative gap between the live and the recorded τ that is not a FAIL.
pub const MAX_RELATIVE_GAP: f64 = 0.10;

/// A pooled τ (Σ τ / steps over the prompts) and its 95 % bootstrap interval over the prompts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Tau {
    pub tau: f64,
    pub ci95: [f64; 2],
}

impl Tau {
    /// From per-prompt `(Σ τ, steps)`.
    pub fn of(per_prompt: &[(usize, usize)]) -> Tau {
        let (a, n) = per_prompt
            .iter()
            .fold((0, 0), |(a, n), &(x, m)| (a + x, n + m));
        Tau {
            tau: a as f64 / n.max(1) as f64,
            ci95: bootstrap_ci95(per_prompt, 2000),
        }
    }

    fn from_variant(v: &VariantResult) -> (Tau, Tau) {
        (
            Tau {
                tau: v.ddtree_tau,
                ci95: v.ddtree_tau_ci95,
            },
            Tau {
                tau: v.dflash_tau,
                ci95: v.dflash_tau_ci95,
            },
        )
    }
}

/// DDTree (the run's tree budget) and single-path DFlash τ of one measurement.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ModeTaus {
    pub ddtree: Tau,
    pub dflash: Tau,
}

/// One decoded prompt.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PromptResult {
    pub prompt_tokens: usize,
    pub answer_tokens: usize,
    pub live_ddtree_tau: f64,
    pub live_dflash_tau: f64,
    /// The live answer equals the training answer's first tokens.
    pub same_as_training_answer: bool,
}

/// What the check measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainEval {
    pub target_recorded: TargetFacts,
    pub target_now: TargetFacts,
    /// `RUN/validation.json`.
    pub validation: RecordedValidation,
    pub validation_source: ValidationSource,
    pub validation_examples: usize,
    pub tree_budget: usize,
    /// Prompts decoded now.
    pub prompts: usize,
    /// Live answer tokens over every prompt.
    pub answer_tokens: usize,
    /// Live answers equal to the training answer's first tokens.
    pub identical_answers: usize,
    /// Live decoding.
    pub live: ModeTaus,
    /// The training-mode forward replayed on the live answers …
    pub replayed_live_answers: ModeTaus,
    /// … and on the training answers of the same prompts (the same window).
    pub replayed_training_answers: ModeTaus,
    /// 1 + mean accepted DDTree drafts of a block at every position of the training answers
    /// (what the validation's DDTree streak samples at random anchors).
    pub teacher_forced_ddtree_tau: f64,
    pub per_prompt: Vec<PromptResult>,
    /// Seconds of the live DDTree and DFlash decoding, and of the two replays.
    pub seconds: Seconds,
}

/// Where the measurement's time went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Seconds {
    pub ddtree: f64,
    pub dflash: f64,
    pub replay: f64,
}

/// How to decode.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Recorded examples to decode (the first N).
    pub prompts: usize,
    /// Answer tokens at most (each prompt also stops at its training answer's length).
    pub max_new_tokens: usize,
    pub stop_tokens: Vec<u32>,
}

/// Decodes the manifest's first validation prompts live and replays both answers (see the
/// module's invariants); also returns the declared taps' statistics over the training answers'
/// rows (None when nothing was decoded).
pub fn measure(
    target: &dyn TargetModel,
    drafter: &DFlashDrafter,
    manifest: &RunManifest,
    validation: &RecordedValidation,
    target_now: TargetFacts,
    s: &Settings,
) -> Result<(TrainEval, Option<TapStatsFile>)> {
    let budget = manifest.training.tree_budget.max(1);
    let cfg = |n: usize| GenerateConfig {
        cancel: None,
        max_new_tokens: n,
        stop_tokens: s.stop_tokens.clone(),
        sampling: SamplingConfig::greedy(),
    };
    let (mut live_tree, mut live_single) = (vec![], vec![]);
    let (mut live_samples, mut train_samples, mut per_prompt) = (vec![], vec![], vec![]);
    let mut seconds = Seconds::default();
    for (i, e) in manifest
        .validation
        .recorded
        .iter()
        .take(s.prompts)
        .enumerate()
    {
        let p = prompt_len(e).ok_or_else(|| {
            DiagnoseError::InvalidInput(format!("recorded example {i} has no prompt"))
        })?;
        let window = (e.tokens.len() - p).min(s.max_new_tokens.max(1));
        let prompt = &e.tokens[..p];
        let run = |mode: SpecMode| -> Result<(Vec<u32>, (usize, usize))> {
            let mut runner = DFlashRunner::new(drafter);
            let g =
                generate_speculative(target, &mut runner, prompt, &cfg(window), mode, &mut |_| {})?;
            let acc = g.spec.map(|st| st.acceptance).unwrap_or_default();
            Ok((g.tokens, (acc.iter().sum(), acc.len())))
        };
        let t = Instant::now();
        let (answer, tree) = run(SpecMode::DdTree { budget })?;
        seconds.ddtree += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let (_, single) = run(SpecMode::DFlash)?;
        seconds.dflash += t.elapsed().as_secs_f64();
        let training = &e.tokens[..p + window];
        let same = answer.as_slice() == &training[p..];
        let ratio = |(a, n): (usize, usize)| a as f64 / n.max(1) as f64;
        per_prompt.push(PromptResult {
            prompt_tokens: p,
            answer_tokens: answer.len(),
            live_ddtree_tau: ratio(tree),
            live_dflash_tau: ratio(single),
            same_as_training_answer: same,
        });
        live_tree.push(tree);
        live_single.push(single);
        let mut tokens = prompt.to_vec();
        tokens.extend(&answer);
        live_samples.push(Sample {
            name: format!("validation:{}", i + 1),
            tokens,
            prompt_len: p,
        });
        train_samples.push(Sample {
            name: format!("validation:{} (training answer)", i + 1),
            tokens: training.to_vec(),
            prompt_len: p,
        });
    }
    let opts = Options {
        tree_budget: budget,
        integrity_positions: 0,
        recorded_stats: None,
        target_rope: None,
        mask_token_candidates: vec![],
    };
    let zero = Tau {
        tau: 0.0,
        ci95: [0.0, 0.0],
    };
    let (mut on_live, mut on_train, mut teacher_forced, mut stats) = (
        ModeTaus {
            ddtree: zero,
            dflash: zero,
        },
        ModeTaus {
            ddtree: zero,
            dflash: zero,
        },
        0.0,
        None,
    );
    let t = Instant::now();
    if !live_samples.is_empty() {
        let (scan, _) = scan_variants(target, drafter, &live_samples, &opts, true)?;
        let (ddtree, dflash) = Tau::from_variant(&scan.variants[0]);
        on_live = ModeTaus { ddtree, dflash };
        let (scan, measured) = scan_variants(target, drafter, &train_samples, &opts, true)?;
        let (ddtree, dflash) = Tau::from_variant(&scan.variants[0]);
        on_train = ModeTaus { ddtree, dflash };
        teacher_forced = scan.variants[0].teacher_forced_ddtree_tau;
        stats = Some(measured);
    }
    seconds.replay = t.elapsed().as_secs_f64();
    let m = TrainEval {
        target_recorded: manifest.target.clone(),
        target_now,
        validation: *validation,
        validation_source: manifest.validation.source,
        validation_examples: manifest.validation.examples,
        tree_budget: budget,
        prompts: per_prompt.len(),
        answer_tokens: per_prompt.iter().map(|p| p.answer_tokens).sum(),
        identical_answers: per_prompt
            .iter()
            .filter(|p| p.same_as_training_answer)
            .count(),
        live: ModeTaus {
            ddtree: Tau::of(&live_tree),
            dflash: Tau::of(&live_single),
        },
        replayed_live_answers: on_live,
        replayed_training_answers: on_train,
        teacher_forced_ddtree_tau: teacher_forced,
        per_prompt,
        seconds,
    };
    Ok((m, stats))
}

fn rel(now: f64, then: f64) -> f64 {
    (now - then).abs() / then.abs().max(1e-12)
}

/// The stage of the measurement chain a gap sits in (see the module's invariants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Live decoding vs the training forward replayed on the same (live) answers.
    Path,
    /// The live answers vs the training answers, both replayed.
    Text,
    /// The exported drafter on the run's own text vs the recorded number.
    Run,
}

/// One mode's four numbers: live, replayed on the live answers, replayed on the training
/// answers, recorded.
struct Chain {
    mode: String,
    live: Tau,
    on_live: f64,
    on_train: f64,
    recorded: f64,
}

impl Chain {
    fn gap(&self) -> f64 {
        rel(self.live.tau, self.recorded)
    }
    fn outside_interval(&self) -> bool {
        self.recorded < self.live.ci95[0] || self.recorded > self.live.ci95[1]
    }
    fn stage(&self) -> Stage {
        [
            (rel(self.live.tau, self.on_live), Stage::Path),
            (rel(self.on_live, self.on_train), Stage::Text),
            (rel(self.on_train, self.recorded), Stage::Run),
        ]
        .into_iter()
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|x| x.1)
        .expect("three stages")
    }
}

/// The verdict (see the module's invariants).
pub fn judge(m: &TrainEval) -> Check {
    let fail = |evidence: String, cause: String, fix: &str| Check {
        check: NAME.into(),
        verdict: Verdict::Fail,
        evidence,
        cause,
        fix: fix.into(),
    };
    let warn = |evidence: String, cause: String, fix: &str| Check {
        verdict: Verdict::Warn,
        ..fail(evidence, cause, fix)
    };
    let changes = m.target_recorded.structural_changes(&m.target_now);
    if !changes.is_empty() {
        return fail(
            format!(
                "target now {} ({}), at training {}",
                m.target_now.path,
                changes.join(", "),
                m.target_recorded.path
            ),
            "the target diagnosed is not the model the run trained the drafter on".into(),
            "pass the run's target (--target), or train a drafter for this one",
        );
    }
    let v = &m.validation;
    let n_val = format!("{} {} prompts", m.validation_examples, m.validation_source);
    if m.prompts == 0 {
        return warn(
            format!("the run recorded no validation example with a prompt and an answer ({n_val})"),
            "nothing to decode: the validation examples have no prompt before their first supervised token".into(),
            "train on data whose examples have a prompt (dflash data regen writes one)",
        );
    }
    if v.replayed_ddtree_tau <= 0.0 || v.replayed_tau <= 0.0 {
        return warn(
            format!(
                "{VALIDATION_FILE} records replayed τ {:.2} (DDTree {:.2}): its validation replayed no step",
                v.replayed_tau, v.replayed_ddtree_tau
            ),
            "the run's validation answers were too short to replay".into(),
            "validate on longer answers (more data, a larger --val-fraction)",
        );
    }
    let chains = [
        Chain {
            mode: format!("DDTree-{}", m.tree_budget),
            live: m.live.ddtree,
            on_live: m.replayed_live_answers.ddtree.tau,
            on_train: m.replayed_training_answers.ddtree.tau,
            recorded: v.replayed_ddtree_tau,
        },
        Chain {
            mode: "DFlash".into(),
            live: m.live.dflash,
            on_live: m.replayed_live_answers.dflash.tau,
            on_train: m.replayed_training_answers.dflash.tau,
            recorded: v.replayed_tau,
        },
    ];
    let mut evidence: Vec<String> = chains
        .iter()
        .map(|c| {
            format!(
                "{} τ: run's validation {:.2}, live decoding {:.2} [{:.2}-{:.2}] ({:+.0} %); replayed {:.2} on the live answers, {:.2} on the training answers",
                c.mode,
                c.recorded,
                c.live.tau,
                c.live.ci95[0],
                c.live.ci95[1],
                100.0 * (c.live.tau - c.recorded) / c.recorded,
                c.on_live,
                c.on_train
            )
        })
        .collect();
    evidence.push(format!(
        "on {} of the run's {n_val} (first ≤ {} answer tokens each, {} identical to the training answers; the validation covered every prompt's whole answer)",
        m.prompts,
        m.per_prompt.iter().map(|p| p.answer_tokens).max().unwrap_or(0),
        m.identical_answers
    ));
    evidence.push(format!(
        "streak {:.2}, DDTree streak {:.2} (teacher-forced, random anchors) vs all-positions DDTree τ {:.2} on the training answers now",
        v.streak, v.ddtree_streak, m.teacher_forced_ddtree_tau
    ));
    let evidence = evidence.join("; ");
    if let Some(c) = chains
        .iter()
        .find(|c| m.prompts >= 2 && c.gap() > MAX_RELATIVE_GAP && c.outside_interval())
    {
        let (l, p, t, r) = (c.live.tau, c.on_live, c.on_train, c.recorded);
        let (cause, fix) = match c.stage() {
            Stage::Path => (
                format!(
                    "{} τ {l:.2} live vs {r:.2} recorded; on the same answers decoding accepts {l:.2} per step where the training forward replays {p:.2}: the inference path feeds the drafter otherwise than training did (positions, taps, the mask token, RoPE, the fc input)",
                    c.mode
                ),
                "find the first diverging step with `dflash eval --replay` and the setting with the conventions check; make decoding's drafter inputs match training's",
            ),
            Stage::Text => (
                format!(
                    "{} τ {l:.2} live vs {r:.2} recorded; the drafter replays {p:.2} on the target's answers now but {t:.2} on the run's training answers to the same prompts ({} of {} identical): the training data's answers are not this target's greedy answers (sampled regeneration, another checkpoint, dtype or chat template)",
                    c.mode, m.identical_answers, m.prompts
                ),
                "regenerate the training data with this target (dflash data regen, greedy) and retrain, or evaluate with the target and dtype the data came from",
            ),
            Stage::Run => (
                format!(
                    "{} τ {l:.2} live vs {r:.2} recorded; the exported drafter replays {t:.2} on the run's own validation text, but {VALIDATION_FILE} records {r:.2}: the drafter in the run is not the one validated (another run's, a later export, --export-dtype rounding), {VALIDATION_FILE} is not this run's, or these {} prompts' first tokens are unlike the whole validation set",
                    c.mode, m.prompts
                ),
                "finish the run so train writes the drafter and validation.json together (dflash train … --resume), diagnose the drafter that was validated, or decode more prompts (--run-prompts, --max-new-tokens)",
            ),
        };
        return fail(evidence, cause, fix);
    }
    if let Some(c) = chains.iter().find(|c| c.gap() > MAX_RELATIVE_GAP) {
        let why = if m.prompts < 2 {
            "one prompt gives no interval".to_string()
        } else {
            format!(
                "the recorded value lies inside the live τ's 95 % interval over {} prompts",
                m.prompts
            )
        };
        return warn(
            evidence,
            format!(
                "{} τ differs from the run's by {:.0} %, but {why}: not resolved",
                c.mode,
                100.0 * c.gap(),
            ),
            "decode more of the run's validation prompts (--run-prompts) or longer answers (--max-new-tokens)",
        );
    }
    Check::ok(NAME, evidence)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tau(t: f64, spread: f64) -> Tau {
        Tau {
            tau: t,
            ci95: [t - spread, t + spread],
        }
    }

    fn modes(ddtree: f64, dflash: f64, spread: f64) -> ModeTaus {
        ModeTaus {
            ddtree: tau(ddtree, spread),
            dflash: tau(dflash, spread),
        }
    }

    fn facts() -> TargetFacts {
        TargetFacts {
            path: "t".into(),
            architecture: "llama".into(),
            model_type: None,
            num_layers: 30,
            hidden_size: 576,
            vocab_size: 49152,
            dtype: "f32".into(),
        }
    }

    /// A run whose validation recorded DDTree 3.0 / DFlash 2.0, measured at those numbers.
    fn agreeing() -> TrainEval {
        TrainEval {
            target_recorded: facts(),
            target_now: facts(),
            validation: RecordedValidation {
                streak: 2.4,
                ddtree_streak: 3.4,
                replayed_tau: 2.0,
                replayed_ddtree_tau: 3.0,
                loss: 2.0,
                blocks: 100,
            },
            validation_source: ValidationSource::HeldOut,
            validation_examples: 40,
            tree_budget: 64,
            prompts: 4,
            answer_tokens: 384,
            identical_answers: 4,
            live: modes(2.9, 2.05, 0.1),
            replayed_live_answers: modes(2.9, 2.05, 0.1),
            replayed_training_answers: modes(2.95, 2.0, 0.1),
            teacher_forced_ddtree_tau: 3.3,
            per_prompt: vec![],
            seconds: Seconds::default(),
        }
    }

    #[test]
    fn agreement_within_ten_percent_is_ok_with_every_number() {
        let c = judge(&agreeing());
        assert_eq!(c.verdict, Verdict::Ok, "{c:?}");
        for needle in [
            "DDTree-64 τ: run's validation 3.00, live decoding 2.90 [2.80-3.00]",
            "DFlash τ: run's validation 2.00, live decoding 2.05",
            "on 4 of the run's 40 held-out prompts",
            "streak 2.40, DDTree streak 3.40",
        ] {
            assert!(c.evidence.contains(needle), "{needle} in {}", c.evidence);
        }
    }

    #[test]
    fn a_recorded_tau_the_drafter_does_not_reproduce_fails_naming_the_run() {
        let mut m = agreeing();
        m.validation.replayed_ddtree_tau *= 3.0;
        m.validation.replayed_tau *= 3.0;
        let c = judge(&m);
        assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
        assert!(
            c.cause.contains("2.90 live vs 9.00 recorded"),
            "{}",
            c.cause
        );
        assert!(
            c.cause
                .contains("replays 2.95 on the run's own validation text"),
            "{}",
            c.cause
        );
        assert!(c.fix.contains("--resume"), "{}", c.fix);
    }

    #[test]
    fn decoding_below_its_own_replay_fails_naming_the_inference_path() {
        // the team's case: training metrics good, eval τ collapsed
        let mut m = agreeing();
        m.live = modes(1.1, 1.05, 0.05);
        let c = judge(&m);
        assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
        assert!(c.cause.contains("inference path"), "{}", c.cause);
        assert!(c.fix.contains("eval --replay"), "{}", c.fix);
    }

    #[test]
    fn other_answers_now_fail_naming_the_training_data() {
        let mut m = agreeing();
        m.live = modes(2.0, 1.4, 0.1);
        m.replayed_live_answers = modes(2.0, 1.4, 0.1);
        m.identical_answers = 0;
        let c = judge(&m);
        assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
        assert!(
            c.cause.contains("not this target's greedy answers") && c.cause.contains("0 of 4"),
            "{}",
            c.cause
        );
    }

    #[test]
    fn a_gap_inside_the_interval_is_a_warn_and_nothing_to_compare_is_a_warn() {
        let mut m = agreeing();
        m.live = modes(2.6, 2.0, 0.5);
        let c = judge(&m);
        assert_eq!(c.verdict, Verdict::Warn, "{c:?}");
        assert!(c.cause.contains("not resolved"), "{}", c.cause);
        // a tight interval over several prompts excludes it
        m.live = modes(2.6, 2.0, 0.05);
        assert_eq!(judge(&m).verdict, Verdict::Fail);
        // one prompt has no interval: a warn however far
        m.prompts = 1;
        m.live = modes(1.5, 2.0, 0.0);
        let c = judge(&m);
        assert_eq!(c.verdict, Verdict::Warn, "{c:?}");
        assert!(
            c.cause.contains("one prompt gives no interval"),
            "{}",
            c.cause
        );

        let mut m = agreeing();
        m.prompts = 0;
        assert_eq!(judge(&m).verdict, Verdict::Warn);
        let mut m = agreeing();
        m.validation.replayed_ddtree_tau = 0.0;
        let c = judge(&m);
        assert_eq!(c.verdict, Verdict::Warn);
        assert!(c.evidence.contains("replayed no step"), "{}", c.evidence);
    }

    #[test]
    fn another_target_fails_before_any_tau() {
        let mut m = agreeing();
        m.target_now.num_layers = 28;
        m.target_now.path = "other".into();
        let c = judge(&m);
        assert_eq!(c.verdict, Verdict::Fail);
        assert!(c.evidence.contains("layers: 30 → 28"), "{}", c.evidence);
    }

    #[test]
    fn pooled_tau_sums_steps_over_prompts() {
        let t = Tau::of(&[(6, 2), (2, 2)]);
        assert_eq!(t.tau, 2.0);
        assert!(t.ci95[0] <= 2.0 && t.ci95[1] >= 2.0);
        assert_eq!(Tau::of(&[]).tau, 0.0);
    }
}
