//! `dflash diagnose --run RUN`: a training run's recorded inputs and validation (what
//! crate::train_record wrote) turn into defaults for the diagnosis and into its train-vs-eval
//! check (issue 16, items 4 and 5).
//!
//! Invariants:
//! - RUN's manifest and validation.json are read, strictly, before any model loads: a missing or
//!   corrupt run is bad input (exit code 2) naming the file.
//! - Defaults only fill what the command line leaves out: the target is the run's (its recorded
//!   path, which must still exist), the drafter RUN/drafter, the training data the run's data
//!   directory when it still exists, else the prompt-format profile the run recorded.
//! - The train-vs-eval check decodes the first `--run-prompts` recorded validation prompts with
//!   the drafter as loaded for the diagnosis; the tap-statistics check then compares the
//!   manifest's statistics with those of the same answer tokens now (replacing the comparison on
//!   the benchmark answers, which are other text).

use crate::diagnose_format::TrainingFormat;
use crate::exit::UsageError;
use anyhow::Result;
use dflash_diagnose::prompt_format::measure::{read_training_examples, TrainingExamples};
use dflash_diagnose::run_manifest::{read_manifest, read_validation, RecordedValidation};
use dflash_diagnose::run_manifest::{RunManifest, MANIFEST_FILE};
use dflash_diagnose::stats::{self, StatsReport};
use dflash_diagnose::train_eval::{self, TrainEval};
use dflash_diagnose::Check;
use dflash_models::{DFlashDrafter, LoadedTarget};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A run directory's recorded inputs and validation.
pub struct RunInputs {
    pub dir: PathBuf,
    pub manifest: RunManifest,
    pub validation: RecordedValidation,
}

impl RunInputs {
    pub fn read(dir: &Path) -> Result<RunInputs> {
        let manifest = read_manifest(dir)?;
        let validation = read_validation(dir)?;
        Ok(RunInputs {
            dir: dir.to_path_buf(),
            manifest,
            validation,
        })
    }

    /// The run's target, when `--target` is not given.
    pub fn target(&self) -> Result<PathBuf> {
        let p = PathBuf::from(&self.manifest.target.path);
        if !p.exists() {
            return Err(UsageError(format!(
                "{}: the run's target ({} in {}) is not there: pass --target",
                self.dir.display(),
                p.display(),
                MANIFEST_FILE
            ))
            .into());
        }
        Ok(p)
    }

    /// RUN/drafter (or where the manifest says it was exported).
    pub fn drafter(&self) -> PathBuf {
        self.manifest.drafter_dir(&self.dir)
    }
}

/// The prompt-format check's training data under `--run`: `--data` if given, else the run's data
/// directory if it still exists, else the recorded profile (None when the run has none).
pub fn training_data(run: &RunInputs, data: Option<&Path>) -> Result<Option<TrainingExamples>> {
    let dir = match data {
        Some(d) => d.to_path_buf(),
        None => PathBuf::from(&run.manifest.data.path),
    };
    if data.is_none() && !dir.is_dir() {
        return Ok(None);
    }
    Ok(Some(read_training_examples(
        &dir,
        dflash_diagnose::prompt_format::measure::MAX_EXAMPLES,
    )?))
}

/// The prompt-format input: the examples read, else the run's recorded profile.
pub fn training_format<'a>(
    run: Option<&'a RunInputs>,
    examples: Option<&'a TrainingExamples>,
) -> Option<TrainingFormat<'a>> {
    if let Some(e) = examples {
        return Some(TrainingFormat::Examples(e));
    }
    let run = run?;
    let profile = run.manifest.data.format.as_ref()?;
    Some(TrainingFormat::Recorded {
        profile,
        source: format!(
            "{} (profile recorded in {}; the directory is gone)",
            run.manifest.data.path,
            run.dir.join(MANIFEST_FILE).display()
        ),
    })
}

/// The train-vs-eval check, the run-based tap-statistics check and what they measured.
pub struct RunCheck {
    pub check: Check,
    pub tap_check: Option<Check>,
    pub tap_report: Option<StatsReport>,
    pub report: TrainEval,
    pub seconds: f64,
}

/// Decodes the run's first `prompts` validation prompts (see the module's invariants).
pub fn check(
    target: &LoadedTarget,
    target_path: &Path,
    drafter: &DFlashDrafter,
    run: &RunInputs,
    prompts: usize,
    max_new_tokens: usize,
) -> Result<RunCheck> {
    let t0 = Instant::now();
    let settings = train_eval::Settings {
        prompts,
        max_new_tokens,
        stop_tokens: target.eos_token_ids.clone(),
    };
    let (report, measured) = train_eval::measure(
        target.model.as_ref(),
        drafter,
        &run.manifest,
        &run.validation,
        crate::train_record::target_facts(target, target_path),
        &settings,
    )?;
    let check = train_eval::judge(&report);
    let (tap_check, tap_report) = match measured {
        Some(measured) => {
            let recorded = run.manifest.tap_stats.clone();
            let mut c = stats::judge(&measured, Some(&recorded));
            c.evidence = format!(
                "on the answer tokens of {} of the run's validation examples, as recorded at training ({} rows then, {} now): {}",
                report.prompts, recorded.rows, measured.rows, c.evidence
            );
            (
                Some(c),
                Some(StatsReport {
                    measured,
                    recorded: Some(recorded),
                }),
            )
        }
        None => (None, None),
    };
    Ok(RunCheck {
        check,
        tap_check,
        tap_report,
        report,
        seconds: t0.elapsed().as_secs_f64(),
    })
}
