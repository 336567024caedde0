//! dflash-diagnose: find a train/eval mismatch of a DFlash drafter by measurement, not by
//! reading code. Each check gives a [`Verdict`] with its evidence (numbers), the likely cause and
//! the fix:
//! - [`conventions`]: the drafter's replayed τ (decoding's walk over blocks drafted at every
//!   position of the target's own answers) and its log-likelihood of that text, under its declared
//!   conventions and under alternatives made by changing only what the drafter is fed (tap layers
//!   shifted, the target's final norm on the last tap, block positions, the mask token, the RoPE,
//!   full vs sliding-window attention); an alternative clearly better than the declared setting is
//!   a FAIL naming the setting to change (a drafter too weak to judge is a warn).
//! - [`integrity`]: the target's logits from a verify-shaped forward equal the AR path's.
//! - [`stats`]: per-tap hidden-state statistics now vs those recorded at training time.
//! - [`prompt_format`]: the chat template, system prompt and thinking mode of the eval prompts vs
//!   the training data's, with the replayed τ under each format (run by the CLI beside
//!   [`diagnose`]: it needs the target's tokenizer and chat template to render the prompts).
//! - [`train_eval`]: a training run's recorded validation τ against the τ its exported drafter
//!   reaches decoding the same validation prompts live, from the run's [`run_manifest`] (what
//!   `dflash train` records for the diagnosis; run by the CLI with `diagnose --run`).
//!
//! Invariants:
//! - The drafter's forward is dflash-models' (through dflash-train's replay), never re-implemented:
//!   a variant differs from the declared setting only in the taps tensor, the block layout or a
//!   setting of a copy of the drafter with the same weights.
//! - The target runs once per sample for every variant's taps (the union of their layers).
//! - Every verdict is a pure function of the measured numbers ([`conventions::judge`],
//!   [`integrity::judge`], [`stats::judge`], [`prompt_format::judge`], [`train_eval::judge`]),
//!   unit-tested without a model.

pub mod conventions;
pub mod error;
pub mod integrity;
pub mod prompt_format;
pub mod run_manifest;
pub mod stats;
pub mod train_eval;

pub use error::{DiagnoseError, Result};

use dflash_models::{DFlashDrafter, TargetModel};
use serde::Serialize;
use std::time::Instant;

/// A check's outcome; `Fail` makes `dflash diagnose` exit with code 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Verdict {
    #[serde(rename = "ok")]
    Ok,
    #[serde(rename = "warn")]
    Warn,
    #[serde(rename = "FAIL")]
    Fail,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::Fail => "FAIL",
        })
    }
}

/// One check's verdict and why.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub check: String,
    pub verdict: Verdict,
    /// The numbers the verdict rests on.
    pub evidence: String,
    /// The likely cause (empty when ok).
    pub cause: String,
    /// What to change (empty when ok).
    pub fix: String,
}

impl Check {
    pub fn ok(check: &str, evidence: String) -> Check {
        Check {
            check: check.into(),
            verdict: Verdict::Ok,
            evidence,
            cause: String::new(),
            fix: String::new(),
        }
    }
}

/// A prompt with the target's own answer: `tokens[..prompt_len]` the rendered prompt,
/// `tokens[prompt_len..]` the answer (greedy AR).
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
}

/// Settings of a diagnosis.
#[derive(Debug, Clone)]
pub struct Options {
    /// DDTree node budget of the replayed τ (decoding's default 64).
    pub tree_budget: usize,
    /// Answer positions whose logits the integrity check compares.
    pub integrity_positions: usize,
    /// Training-time tap statistics, if recorded (`tap_stats.json` of the drafter).
    pub recorded_stats: Option<stats::TapStatsFile>,
    /// The target's RoPE base and scaling (its config), for the drafter-fed-the-target's-RoPE
    /// variant.
    pub target_rope: Option<(f64, Option<dflash_core::RopeScaling>)>,
    /// Mask tokens to try instead of the drafter's declared one, labelled by where they come
    /// from (the target's EOS, `dflash draft init`'s rule, the vocabulary's last id…), in order of
    /// preference; the scan measures the first [`conventions::MAX_MASK_VARIANTS`] distinct ones.
    pub mask_token_candidates: Vec<(String, u32)>,
}

/// Everything a diagnosis measured, and the verdicts.
#[derive(Debug, Clone, Serialize)]
pub struct Diagnosis {
    pub checks: Vec<Check>,
    pub conventions: conventions::Scan,
    pub target_integrity: integrity::Integrity,
    pub tap_statistics: stats::StatsReport,
    /// Seconds spent in each check.
    pub seconds: Seconds,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Seconds {
    pub conventions: f64,
    pub target_integrity: f64,
}

impl Diagnosis {
    /// The worst verdict of any check.
    pub fn verdict(&self) -> Verdict {
        self.checks
            .iter()
            .map(|c| c.verdict)
            .max()
            .unwrap_or(Verdict::Ok)
    }
}

/// Runs every check on `samples` (each with a non-empty prompt).
pub fn diagnose(
    target: &dyn TargetModel,
    drafter: &DFlashDrafter,
    samples: &[Sample],
    opts: &Options,
) -> Result<Diagnosis> {
    if samples.is_empty() {
        return Err(DiagnoseError::InvalidInput("no prompts to diagnose".into()));
    }
    if let Some(s) = samples
        .iter()
        .find(|s| s.prompt_len == 0 || s.prompt_len > s.tokens.len())
    {
        return Err(DiagnoseError::InvalidInput(format!(
            "sample {}: prompt of {} tokens in a sequence of {}",
            s.name,
            s.prompt_len,
            s.tokens.len()
        )));
    }
    let t0 = Instant::now();
    let (scan, measured) = conventions::scan(target, drafter, samples, opts)?;
    let conventions_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let integ = integrity::measure(target, samples, opts.integrity_positions)?;
    let integrity_seconds = t1.elapsed().as_secs_f64();
    let tap_statistics = stats::StatsReport {
        measured,
        recorded: opts.recorded_stats.clone(),
    };
    let checks = vec![
        conventions::judge(&scan),
        integrity::judge(&integ),
        stats::judge(&tap_statistics.measured, tap_statistics.recorded.as_ref()),
    ];
    Ok(Diagnosis {
        checks,
        conventions: scan,
        target_integrity: integ,
        tap_statistics,
        seconds: Seconds {
            conventions: conventions_seconds,
            target_integrity: integrity_seconds,
        },
    })
}
