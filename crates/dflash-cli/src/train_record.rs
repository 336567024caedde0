//! What `dflash train` records for `dflash diagnose --run` (RUN/diagnosis_inputs.json, and the tap
//! statistics again in RUN/drafter/tap_stats.json), and the diagnosis it runs right after its
//! validation (issue 16, item 4).
//!
//! Invariants:
//! - The manifest is written before the first step (so a run stopped by its time limit has it)
//!   and again on every resume, from the same inputs: the target as loaded for training, the
//!   drafter config, the data as split for this run; its validation examples are the set
//!   `validate` walks (the held-out prompts, or the training examples when none is held out).
//! - Its costs are bounded whatever the data size: one target forward over each of at most
//!   `MAX_RECORDED_EXAMPLES` recorded examples (cut to `MAX_RECORDED_ANSWER` answer tokens) for
//!   the tap statistics, and the decoded prompts of at most `MAX_EXAMPLES` examples (spread
//!   evenly over the training data) for the prompt-format profile (none without a tokenizer).
//! - The diagnosis after validation runs only the checks that need no benchmark text: training
//!   vs evaluation on the first `--diagnose-prompts` recorded prompts (answers of at most
//!   [`DIAGNOSIS_TOKENS`] tokens) with the drafter loaded back from RUN/drafter as inference
//!   loads it, and target integrity on the same answers. It prints its table on stderr and writes
//!   RUN/diagnosis.json; it never changes what the run wrote or the exit code of a run whose
//!   checks FAIL (stdout stays the validation JSON).

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use dflash_diagnose::prompt_format::measure::MAX_EXAMPLES;
use dflash_diagnose::prompt_format::FormatProfile;
use dflash_diagnose::run_manifest::{
    prompt_len, recordable, DataFacts, DrafterFacts, RecordedValidation, RunManifest, TargetFacts,
    TrainingFacts, ValidationSet, ValidationSource, MANIFEST_VERSION,
};
use dflash_diagnose::{integrity, stats, train_eval, Sample};
use dflash_models::{DFlashConfig, LoadedTarget};
use dflash_train::data::Example;
use dflash_train::{TrainConfig, Validation};
use std::path::Path;
use std::time::Instant;

/// Answer tokens per prompt of the diagnosis after validation.
pub const DIAGNOSIS_TOKENS: usize = 32;
/// Its file in the run directory.
pub const DIAGNOSIS_FILE: &str = "diagnosis.json";

/// `path` made absolute (a diagnosis may run from another directory).
fn absolute(path: &Path) -> String {
    std::path::absolute(path)
        .unwrap_or_else(|_| path.to_path_buf())
        .display()
        .to_string()
}

fn dtype_name(d: DType) -> String {
    format!("{d:?}").to_lowercase()
}

/// The facts of `target` loaded from `path`.
pub fn target_facts(target: &LoadedTarget, path: &Path) -> TargetFacts {
    let info = target.model.info();
    TargetFacts {
        path: absolute(path),
        architecture: info.architecture.into(),
        model_type: target.config.model_type.clone(),
        num_layers: info.num_layers,
        hidden_size: info.hidden_size,
        vocab_size: info.vocab_size,
        dtype: dtype_name(info.dtype),
    }
}

/// What the manifest is made of.
pub struct RecordInputs<'a> {
    pub target: &'a LoadedTarget,
    pub target_path: &'a Path,
    pub draft_cfg: &'a DFlashConfig,
    pub cfg: &'a TrainConfig,
    pub data_dir: &'a Path,
    pub val_fraction: f64,
    pub init: &'a str,
    pub export_dtype: DType,
    pub val: &'a [Example],
    pub train: &'a [Example],
}

/// The training data's prompt-format profile, or why there is none.
fn format_profile(
    target: &LoadedTarget,
    examples: &[Example],
) -> Result<(Option<FormatProfile>, Option<String>)> {
    let Some(text) = &target.text else {
        return Ok((None, Some("the target has no tokenizer".into())));
    };
    let with_prompt: Vec<(&Example, usize)> = examples
        .iter()
        .filter_map(|e| prompt_len(e).map(|p| (e, p)))
        .collect();
    if with_prompt.is_empty() {
        return Ok((
            None,
            Some("no training example has a prompt before its first supervised token".into()),
        ));
    }
    let stride = with_prompt.len().div_ceil(MAX_EXAMPLES).max(1);
    let texts = with_prompt
        .iter()
        .step_by(stride)
        .map(|(e, p)| crate::diagnose_format::prompt_text(&text.tokenizer, &e.tokens, *p))
        .collect::<Result<Vec<_>>>()?;
    Ok((Some(FormatProfile::measure(&texts)), None))
}

/// The samples (prompt + training answer) of recorded examples.
pub fn recorded_samples(examples: &[Example]) -> Vec<Sample> {
    examples
        .iter()
        .enumerate()
        .filter_map(|(i, e)| {
            Some(Sample {
                name: format!("validation:{}", i + 1),
                tokens: e.tokens.clone(),
                prompt_len: prompt_len(e)?,
            })
        })
        .collect()
}

/// Measures and writes RUN/diagnosis_inputs.json.
pub fn record(run: &Path, r: &RecordInputs) -> Result<RunManifest> {
    let (set, source) = if r.val.is_empty() {
        (r.train, ValidationSource::Training)
    } else {
        (r.val, ValidationSource::HeldOut)
    };
    let recorded = recordable(set, r.cfg.max_length);
    let taps = r.draft_cfg.target_layer_ids();
    let tap_stats = stats::measure(r.target.model.as_ref(), &taps, &recorded_samples(&recorded))?;
    let (format, format_not_measured) = format_profile(r.target, r.train)?;
    let m = RunManifest {
        version: MANIFEST_VERSION,
        target: target_facts(r.target, r.target_path),
        drafter: DrafterFacts {
            path: "drafter".into(),
            target_layer_ids: taps,
            block_size: r.draft_cfg.block_size,
            num_layers: r.draft_cfg.num_hidden_layers,
            mask_token_id: r.draft_cfg.mask_token_id().unwrap_or(0),
            // training's forward lays blocks out as the drafter's config declares
            position_offset: r.draft_cfg.block_convention().position_offset,
            anchor_slot_masked: r.draft_cfg.block_convention().anchor_slot_masked,
            final_norm_on_last_tap: r.draft_cfg.final_norm_on_last_tap(),
            rope_theta: r.draft_cfg.rope_theta,
            export_dtype: dtype_name(r.export_dtype),
        },
        training: TrainingFacts {
            tree_budget: r.cfg.tree_budget,
            max_length: r.cfg.max_length,
            val_fraction: r.val_fraction,
            seed: r.cfg.seed,
            init: r.init.into(),
        },
        data: DataFacts {
            path: absolute(r.data_dir),
            examples: r.val.len() + r.train.len(),
            format,
            format_not_measured,
        },
        validation: ValidationSet {
            source,
            examples: set.len(),
            recorded,
        },
        tap_stats,
    };
    std::fs::create_dir_all(run).with_context(|| format!("creating {}", run.display()))?;
    dflash_diagnose::run_manifest::write_manifest(run, &m)?;
    Ok(m)
}

/// The run's validation as `diagnose` reads it from validation.json.
pub fn recorded_validation(v: &Validation) -> RecordedValidation {
    RecordedValidation {
        streak: v.streak as f64,
        ddtree_streak: v.ddtree_streak as f64,
        replayed_tau: v.replayed_tau as f64,
        replayed_ddtree_tau: v.replayed_ddtree_tau as f64,
        loss: v.loss as f64,
        blocks: v.blocks,
    }
}

/// The diagnosis after validation (see the module's invariants).
#[allow(clippy::too_many_arguments)]
pub fn diagnose_after_validation(
    target: &LoadedTarget,
    target_path: &Path,
    run: &Path,
    m: &RunManifest,
    v: &Validation,
    prompts: usize,
    device: &Device,
    dtype: DType,
) -> Result<()> {
    let t0 = Instant::now();
    let mut drafter = dflash_models::load_drafter(&m.drafter_dir(run), device, dtype)?;
    drafter.bind_target(target.model.as_ref())?;
    let settings = train_eval::Settings {
        prompts,
        max_new_tokens: DIAGNOSIS_TOKENS,
        stop_tokens: target.eos_token_ids.clone(),
    };
    let (te, _) = train_eval::measure(
        target.model.as_ref(),
        &drafter,
        m,
        &recorded_validation(v),
        target_facts(target, target_path),
        &settings,
    )?;
    let mut samples = recorded_samples(&m.validation.recorded);
    samples.truncate(prompts);
    let integ = integrity::measure(target.model.as_ref(), &samples, 16)?;
    let checks = vec![train_eval::judge(&te), integrity::judge(&integ)];
    eprintln!("[dflash] diagnosis of the exported drafter on the run's validation prompts:");
    crate::diagnose::print_checks(&checks);
    let json = serde_json::json!({
        "checks": checks,
        "train_vs_eval": te,
        "target_integrity": integ,
        "seconds": t0.elapsed().as_secs_f64(),
    });
    let path = run.join(DIAGNOSIS_FILE);
    crate::defaults::write_atomic(&path, serde_json::to_string_pretty(&json)?.as_bytes())?;
    eprintln!(
        "[dflash] diagnosis written to {} ({:.1} s; the full diagnosis: dflash diagnose --run {})",
        path.display(),
        t0.elapsed().as_secs_f64(),
        run.display()
    );
    Ok(())
}
