//! A training run's diagnosis inputs: what `dflash train` records in `RUN/diagnosis_inputs.json`
//! for `dflash diagnose --run RUN` (issue 16, items 4 and 5), and the run's validation metrics
//! (`RUN/validation.json`, written by `Trainer::validate`).
//!
//! Invariants:
//! - The manifest is self-contained: the target's facts and path, the drafter's taps and block
//!   conventions, the training data's path and prompt-format profile, the first examples of the
//!   set the run validated on (their tokens, so a diagnosis decodes the same prompts without
//!   rereading or re-splitting the data), and per-tap hidden-state statistics of the target on
//!   exactly those examples' answer rows ([`crate::stats::TapStatsFile`], the struct
//!   `diagnose --record-stats` writes).
//! - Recorded examples each have a prompt (a first supervised token after position 0) and an
//!   answer of at least two tokens, cut to the run's `max_length` and to
//!   [`MAX_RECORDED_ANSWER`] answer tokens; at most [`MAX_RECORDED_EXAMPLES`] of them, in the
//!   validation set's order (the order `validate` walks).
//! - Both files are written atomically ([`dflash_core::fs::write_atomic`]) and read strictly: a
//!   missing run directory or file, malformed JSON, a missing field, another version, a
//!   non-finite metric or an inconsistent example is [`DiagnoseError::BadFile`] naming the file
//!   and the problem (exit code 2), never silently defaulted.

use crate::prompt_format::FormatProfile;
use crate::stats::TapStatsFile;
use crate::{DiagnoseError, Result};
use dflash_train::data::Example;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The manifest's file name in a run directory.
pub const MANIFEST_FILE: &str = "diagnosis_inputs.json";
/// The run's validation metrics (written by `dflash train` at the end of a run).
pub const VALIDATION_FILE: &str = "validation.json";
/// The version this build writes and reads.
pub const MANIFEST_VERSION: u32 = 1;
/// Validation examples the manifest keeps.
pub const MAX_RECORDED_EXAMPLES: usize = 8;
/// Answer tokens kept of each recorded example.
pub const MAX_RECORDED_ANSWER: usize = 256;

/// The target the run trained against.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetFacts {
    pub path: String,
    /// The model class the loader built (`TargetInfo::architecture`).
    pub architecture: String,
    pub model_type: Option<String>,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    /// The compute dtype of the run's target forwards.
    pub dtype: String,
}

impl TargetFacts {
    /// What differs structurally between the target a run recorded and `now` (the model class,
    /// depth, width, vocabulary), as `what: then → now` lines; the path and dtype are left out
    /// (the same model may load from another file, and dtype shifts are the tap statistics'
    /// business).
    pub fn structural_changes(&self, now: &TargetFacts) -> Vec<String> {
        let mut out = vec![];
        if self.architecture != now.architecture {
            out.push(format!(
                "architecture: {} → {}",
                self.architecture, now.architecture
            ));
        }
        if self.num_layers != now.num_layers {
            out.push(format!("layers: {} → {}", self.num_layers, now.num_layers));
        }
        if self.hidden_size != now.hidden_size {
            out.push(format!(
                "hidden size: {} → {}",
                self.hidden_size, now.hidden_size
            ));
        }
        if self.vocab_size != now.vocab_size {
            out.push(format!(
                "vocabulary: {} → {}",
                self.vocab_size, now.vocab_size
            ));
        }
        out
    }
}

/// The drafter the run trained and how its blocks are laid out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrafterFacts {
    /// The exported drafter, relative to the run directory (absolute paths are kept as given).
    pub path: String,
    pub target_layer_ids: Vec<usize>,
    pub block_size: usize,
    pub num_layers: usize,
    pub mask_token_id: u32,
    /// Added to every block slot's position by training's forward: 0, slot `j` at the absolute
    /// position `anchor + j` (`BlockConvention::position_offset`).
    pub position_offset: i64,
    /// Slot 0 holds the mask token (false: the anchor's token, decoding's bonus token).
    pub anchor_slot_masked: bool,
    /// The target's final norm on the last tap (`dflash_config.final_norm_on_last_tap`; absent
    /// in manifests written before it existed: false).
    #[serde(default)]
    pub final_norm_on_last_tap: bool,
    pub rope_theta: f64,
    /// Dtype of the exported weights (`--export-dtype`).
    pub export_dtype: String,
}

/// Training settings the diagnosis measures with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingFacts {
    /// DDTree node budget of the validation's replayed τ.
    pub tree_budget: usize,
    /// Sequences are cut to this many tokens in training and validation.
    pub max_length: usize,
    pub val_fraction: f64,
    pub seed: u64,
    /// `--init` of a new run.
    pub init: String,
}

/// The training data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataFacts {
    pub path: String,
    /// Examples read (held out and training).
    pub examples: usize,
    /// The prompt-format profile of (up to 256 of) the training examples' prompts.
    pub format: Option<FormatProfile>,
    /// Why there is no profile (e.g. the target has no tokenizer).
    pub format_not_measured: Option<String>,
}

/// Which examples `validate` ran on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ValidationSource {
    /// The held-out prompts (`--val-fraction`, chosen by a hash of each prompt).
    HeldOut,
    /// No prompt was held out, so the run validated on its training examples.
    Training,
}

impl std::fmt::Display for ValidationSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ValidationSource::HeldOut => "held-out",
            ValidationSource::Training => "training (none held out)",
        })
    }
}

/// The validation set and its first examples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValidationSet {
    pub source: ValidationSource,
    /// Examples the run validated on.
    pub examples: usize,
    /// The first of them (see the module's invariants).
    pub recorded: Vec<Example>,
}

/// `RUN/diagnosis_inputs.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunManifest {
    pub version: u32,
    pub target: TargetFacts,
    pub drafter: DrafterFacts,
    pub training: TrainingFacts,
    pub data: DataFacts,
    pub validation: ValidationSet,
    /// The target's tap statistics over the recorded examples' answer rows.
    pub tap_stats: TapStatsFile,
}

/// The number of prompt tokens of `e`: the index of its first supervised token, when positive.
pub fn prompt_len(e: &Example) -> Option<usize> {
    crate::prompt_format::measure::prompt_len(e)
}

/// The examples of `set` a manifest keeps (see the module's invariants).
pub fn recordable(set: &[Example], max_length: usize) -> Vec<Example> {
    set.iter()
        .filter_map(|e| {
            let p = prompt_len(e)?;
            let end = e.tokens.len().min(max_length).min(p + MAX_RECORDED_ANSWER);
            (end >= p + 2).then(|| Example {
                tokens: e.tokens[..end].to_vec(),
                loss_mask: e.loss_mask[..end].to_vec(),
            })
        })
        .take(MAX_RECORDED_EXAMPLES)
        .collect()
}

/// The run's validation metrics (`RUN/validation.json`, `dflash_train::Validation`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RecordedValidation {
    /// Teacher-forced τ of single-path blocks at random anchors.
    pub streak: f64,
    /// The same with the DDTree walked along the true continuation.
    pub ddtree_streak: f64,
    /// Decoding's walk replayed on each validation answer: DFlash …
    pub replayed_tau: f64,
    /// … and DDTree of the run's tree budget.
    pub replayed_ddtree_tau: f64,
    pub loss: f64,
    pub blocks: usize,
}

fn bad(path: &Path, msg: impl Into<String>) -> DiagnoseError {
    DiagnoseError::BadFile {
        path: path.display().to_string(),
        msg: msg.into(),
    }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path, missing: &str) -> Result<T> {
    if !path.is_file() {
        return Err(bad(path, missing));
    }
    let text = std::fs::read_to_string(path).map_err(|e| bad(path, e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| bad(path, e.to_string()))
}

impl RunManifest {
    /// The inconsistencies that make a manifest unusable (empty: usable).
    fn problems(&self) -> Vec<String> {
        let mut out = vec![];
        if self.version != MANIFEST_VERSION {
            out.push(format!(
                "version {} (this build reads {MANIFEST_VERSION})",
                self.version
            ));
        }
        if self.tap_stats.version != 1 {
            out.push(format!(
                "tap_stats: version {} (this build reads 1)",
                self.tap_stats.version
            ));
        }
        let d = &self.drafter;
        if d.target_layer_ids.is_empty() || d.block_size < 2 {
            out.push(format!(
                "drafter: {} taps, block size {} (needs taps and a block of at least 2)",
                d.target_layer_ids.len(),
                d.block_size
            ));
        }
        if let Some(l) = d
            .target_layer_ids
            .iter()
            .find(|&&l| l >= self.target.num_layers)
        {
            out.push(format!(
                "drafter: tap {l} beyond the target's {} layers",
                self.target.num_layers
            ));
        }
        if self.training.tree_budget == 0 {
            out.push("training: tree_budget 0".into());
        }
        for (i, e) in self.validation.recorded.iter().enumerate() {
            if e.tokens.len() != e.loss_mask.len() {
                out.push(format!(
                    "validation.recorded[{i}]: {} tokens but {} mask entries",
                    e.tokens.len(),
                    e.loss_mask.len()
                ));
            } else if prompt_len(e).is_none_or(|p| p + 2 > e.tokens.len()) {
                out.push(format!(
                    "validation.recorded[{i}]: no prompt before its first supervised token, or \
                     an answer of fewer than 2 tokens"
                ));
            }
        }
        out
    }

    /// The exported drafter's directory.
    pub fn drafter_dir(&self, run: &Path) -> PathBuf {
        run.join(&self.drafter.path)
    }
}

impl RecordedValidation {
    fn problems(&self) -> Vec<String> {
        [
            ("streak", self.streak),
            ("ddtree_streak", self.ddtree_streak),
            ("replayed_tau", self.replayed_tau),
            ("replayed_ddtree_tau", self.replayed_ddtree_tau),
        ]
        .iter()
        .filter(|(_, x)| !x.is_finite() || *x < 0.0)
        .map(|(k, x)| format!("{k} is {x} (a τ is finite and not negative)"))
        .collect()
    }
}

/// Reads `run/diagnosis_inputs.json` (see the module's invariants).
pub fn read_manifest(run: &Path) -> Result<RunManifest> {
    if !run.is_dir() {
        return Err(bad(run, "run directory not found (--run)"));
    }
    let path = run.join(MANIFEST_FILE);
    let m: RunManifest = read_json(
        &path,
        "not found: the run was trained before `dflash train` recorded its diagnosis inputs, or \
         --run is not a run directory (diagnose its drafter with --draft RUN/drafter --data DATA)",
    )?;
    let problems = m.problems();
    if !problems.is_empty() {
        return Err(bad(&path, problems.join("; ")));
    }
    Ok(m)
}

/// Reads `run/validation.json` (see the module's invariants).
pub fn read_validation(run: &Path) -> Result<RecordedValidation> {
    let path = run.join(VALIDATION_FILE);
    let v: RecordedValidation = read_json(
        &path,
        "not found: the run has not finished (train writes it after its last step; continue the \
         run with --resume)",
    )?;
    let problems = v.problems();
    if !problems.is_empty() {
        return Err(bad(&path, problems.join("; ")));
    }
    Ok(v)
}

/// Writes `m` to `run/diagnosis_inputs.json` atomically.
pub fn write_manifest(run: &Path, m: &RunManifest) -> Result<()> {
    let path = run.join(MANIFEST_FILE);
    let text = serde_json::to_string_pretty(m).expect("plain data serialises") + "\n";
    dflash_core::fs::write_atomic(&path, text.as_bytes()).map_err(|source| DiagnoseError::Io {
        path: path.display().to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::TapStat;

    fn example(prompt: usize, answer: usize) -> Example {
        Example {
            tokens: (0..(prompt + answer) as u32).map(|t| t + 3).collect(),
            loss_mask: (0..prompt + answer)
                .map(|i| u8::from(i >= prompt))
                .collect(),
        }
    }

    pub(crate) fn manifest() -> RunManifest {
        RunManifest {
            version: MANIFEST_VERSION,
            target: TargetFacts {
                path: "/models/t".into(),
                architecture: "llama".into(),
                model_type: Some("llama".into()),
                num_layers: 30,
                hidden_size: 576,
                vocab_size: 49152,
                dtype: "f32".into(),
            },
            drafter: DrafterFacts {
                path: "drafter".into(),
                target_layer_ids: vec![1, 8, 14, 20, 27],
                block_size: 16,
                num_layers: 5,
                mask_token_id: 2,
                position_offset: 0,
                anchor_slot_masked: false,
                final_norm_on_last_tap: false,
                rope_theta: 100000.0,
                export_dtype: "bf16".into(),
            },
            training: TrainingFacts {
                tree_budget: 64,
                max_length: 3072,
                val_fraction: 0.02,
                seed: 1,
                init: "random".into(),
            },
            data: DataFacts {
                path: "/data".into(),
                examples: 100,
                format: None,
                format_not_measured: Some("no tokenizer".into()),
            },
            validation: ValidationSet {
                source: ValidationSource::HeldOut,
                examples: 3,
                recorded: vec![example(4, 6)],
            },
            tap_stats: TapStatsFile {
                version: 1,
                dtype: "f32".into(),
                rows: 6,
                layers: [(
                    "1".to_string(),
                    TapStat {
                        mean: 0.0,
                        std: 1.0,
                        norm: 20.0,
                    },
                )]
                .into(),
            },
        }
    }

    fn validation_json() -> serde_json::Value {
        serde_json::json!({
            "streak": 1.5, "ddtree_streak": 2.5, "replayed_tau": 1.4,
            "replayed_ddtree_tau": 2.2, "loss": 3.0, "blocks": 40
        })
    }

    #[test]
    fn recordable_examples_have_a_prompt_and_a_cut_answer() {
        let long = example(5, MAX_RECORDED_ANSWER + 50);
        let set = vec![
            example(0, 8), // no prompt region
            example(4, 1), // answer too short
            long,
            example(3, 4),
        ];
        let r = recordable(&set, 3072);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].tokens.len(), 5 + MAX_RECORDED_ANSWER);
        assert_eq!(r[1], example(3, 4));
        // the run's max_length cuts first, and may leave no answer
        assert_eq!(recordable(&set, 6).len(), 1);
        let many: Vec<Example> = (0..20).map(|_| example(2, 3)).collect();
        assert_eq!(recordable(&many, 100).len(), MAX_RECORDED_EXAMPLES);
    }

    #[test]
    fn a_manifest_and_validation_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let m = manifest();
        write_manifest(dir.path(), &m).unwrap();
        assert_eq!(read_manifest(dir.path()).unwrap(), m);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary file left behind"
        );
        std::fs::write(
            dir.path().join(VALIDATION_FILE),
            validation_json().to_string(),
        )
        .unwrap();
        let v = read_validation(dir.path()).unwrap();
        assert_eq!((v.replayed_ddtree_tau, v.blocks), (2.2, 40));
        assert_eq!(m.drafter_dir(dir.path()), dir.path().join("drafter"));
    }

    #[test]
    fn missing_or_bad_files_and_fields_are_bad_input_naming_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        let err = |e: DiagnoseError| {
            assert!(e.is_bad_input(), "{e}");
            e.to_string()
        };
        let e = err(read_manifest(&run.join("nope")).unwrap_err());
        assert!(e.contains("run directory not found"), "{e}");
        let e = err(read_manifest(run).unwrap_err());
        assert!(
            e.contains(MANIFEST_FILE) && e.contains("trained before"),
            "{e}"
        );
        let e = err(read_validation(run).unwrap_err());
        assert!(
            e.contains(VALIDATION_FILE) && e.contains("not finished"),
            "{e}"
        );

        let mut v = serde_json::to_value(manifest()).unwrap();
        v.as_object_mut().unwrap().remove("tap_stats");
        std::fs::write(run.join(MANIFEST_FILE), v.to_string()).unwrap();
        let e = err(read_manifest(run).unwrap_err());
        assert!(e.contains("missing field `tap_stats`"), "{e}");
        std::fs::write(run.join(MANIFEST_FILE), "{not json").unwrap();
        let e = err(read_manifest(run).unwrap_err());
        assert!(e.contains(MANIFEST_FILE), "{e}");

        let mut m = manifest();
        m.version = 7;
        m.drafter.target_layer_ids = vec![1, 30];
        m.validation.recorded.push(Example {
            tokens: vec![1, 2, 3],
            loss_mask: vec![0, 1],
        });
        m.validation.recorded.push(example(0, 5));
        write_manifest(run, &m).unwrap();
        let e = err(read_manifest(run).unwrap_err());
        for needle in [
            "version 7 (this build reads 1)",
            "tap 30 beyond the target's 30 layers",
            "recorded[1]: 3 tokens but 2 mask entries",
            "recorded[2]: no prompt",
        ] {
            assert!(e.contains(needle), "{needle} in {e}");
        }

        let mut v = validation_json();
        v.as_object_mut().unwrap().remove("replayed_ddtree_tau");
        std::fs::write(run.join(VALIDATION_FILE), v.to_string()).unwrap();
        let e = err(read_validation(run).unwrap_err());
        assert!(e.contains("missing field `replayed_ddtree_tau`"), "{e}");
        let mut v = validation_json();
        v["replayed_tau"] = serde_json::json!(-1.0);
        std::fs::write(run.join(VALIDATION_FILE), v.to_string()).unwrap();
        let e = err(read_validation(run).unwrap_err());
        assert!(e.contains("replayed_tau is -1"), "{e}");
    }

    #[test]
    fn structural_target_changes_are_named_and_path_or_dtype_are_not() {
        let then = manifest().target;
        let mut now = then.clone();
        now.path = "/elsewhere/t.gguf".into();
        now.dtype = "bf16".into();
        assert!(then.structural_changes(&now).is_empty());
        now.num_layers = 28;
        now.architecture = "qwen3".into();
        assert_eq!(
            then.structural_changes(&now),
            ["architecture: llama → qwen3", "layers: 30 → 28"]
        );
    }
}
