//! What the prompt-format check reads and measures: training examples from a data directory, and
//! the drafter's replayed τ on a set of samples.
//!
//! Invariants:
//! - [`read_training_examples`] reads at most `max` examples, spread over the shards in name order
//!   (the first `⌈max / shards⌉` lines of each, so a directory of many shards costs a few lines of
//!   each, not the whole set); a missing directory, a directory without `shard-*.jsonl`, a line
//!   that is not an example or whose arrays differ in length, or no example with a prompt before
//!   its first supervised token is [`DiagnoseError::BadFile`] (exit code 2), naming the file and
//!   line. Examples without a prompt region (no supervised token, or one at position 0) are
//!   skipped and counted.
//! - [`declared_tau`] is the conventions scan restricted to the declared variant: the same target
//!   taps, training-mode drafter forward and decoding walk as the scan's first row.

use super::{FormatProfile, Rerender};
use crate::conventions::{scan_variants, VariantResult};
use crate::{DiagnoseError, Options, Result, Sample};
use dflash_models::{DFlashDrafter, TargetModel};
use dflash_train::data::Example;
use serde::Serialize;
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// Training examples `dflash diagnose --data` profiles.
pub const MAX_EXAMPLES: usize = 256;

/// Examples read from a training data directory.
#[derive(Debug, Clone)]
pub struct TrainingExamples {
    pub dir: PathBuf,
    /// Each with a prompt region (its first supervised token after position 0).
    pub examples: Vec<Example>,
    pub shards: usize,
    /// Examples read but skipped (no prompt region).
    pub skipped: usize,
}

/// The number of prompt tokens of `e`: the index of its first supervised token, when positive.
pub fn prompt_len(e: &Example) -> Option<usize> {
    e.loss_mask.iter().position(|&m| m != 0).filter(|&n| n > 0)
}

fn bad(path: &Path, msg: impl Into<String>) -> DiagnoseError {
    DiagnoseError::BadFile {
        path: path.display().to_string(),
        msg: msg.into(),
    }
}

/// Reads at most `max` examples of the training data in `dir` (see the module's invariants).
pub fn read_training_examples(dir: &Path, max: usize) -> Result<TrainingExamples> {
    if !dir.is_dir() {
        return Err(bad(dir, "training data directory not found (--data)"));
    }
    let shards = dflash_train::data::shard_files(dir).map_err(|e| bad(dir, e.to_string()))?;
    if shards.is_empty() {
        return Err(bad(
            dir,
            "no shard-*.jsonl files (--data takes a directory written by dflash data regen)",
        ));
    }
    let per_shard = max.div_ceil(shards.len()).max(1);
    let (mut examples, mut skipped) = (vec![], 0);
    for s in &shards {
        if examples.len() + skipped >= max {
            break;
        }
        let f = std::fs::File::open(s).map_err(|e| bad(s, e.to_string()))?;
        let mut taken = 0;
        for (n, line) in std::io::BufReader::new(f).lines().enumerate() {
            if taken == per_shard || examples.len() + skipped >= max {
                break;
            }
            let line = line.map_err(|e| bad(s, format!("line {}: {e}", n + 1)))?;
            if line.trim().is_empty() {
                continue;
            }
            let at = |msg: String| bad(s, format!("line {}: {msg}", n + 1));
            let e: Example = serde_json::from_str(&line).map_err(|e| {
                at(format!(
                    "not a training example ({{\"tokens\": [..], \"loss_mask\": [..]}}): {e}"
                ))
            })?;
            if e.tokens.len() != e.loss_mask.len() {
                return Err(at(format!(
                    "{} tokens but {} mask entries",
                    e.tokens.len(),
                    e.loss_mask.len()
                )));
            }
            taken += 1;
            if prompt_len(&e).is_some() {
                examples.push(e);
            } else {
                skipped += 1;
            }
        }
    }
    if examples.is_empty() {
        return Err(bad(
            dir,
            format!("no example with a prompt before its first supervised token ({skipped} read)"),
        ));
    }
    Ok(TrainingExamples {
        dir: dir.to_path_buf(),
        examples,
        shards: shards.len(),
        skipped,
    })
}

/// The replayed τ of the declared setting on one set of samples.
#[derive(Debug, Clone, Serialize)]
pub struct FormatTau {
    pub prompts: usize,
    pub answer_tokens: usize,
    pub ddtree_tau: f64,
    pub ddtree_tau_ci95: [f64; 2],
    pub dflash_tau: f64,
    pub dflash_tau_ci95: [f64; 2],
}

impl FormatTau {
    /// From the conventions scan's declared row over `samples`.
    pub fn of(v: &VariantResult, samples: &[Sample]) -> FormatTau {
        FormatTau {
            prompts: samples.len(),
            answer_tokens: samples.iter().map(|s| s.tokens.len() - s.prompt_len).sum(),
            ddtree_tau: v.ddtree_tau,
            ddtree_tau_ci95: v.ddtree_tau_ci95,
            dflash_tau: v.dflash_tau,
            dflash_tau_ci95: v.dflash_tau_ci95,
        }
    }
}

/// The drafter's replayed τ on `samples` under its declared conventions.
pub fn declared_tau(
    target: &dyn TargetModel,
    drafter: &DFlashDrafter,
    samples: &[Sample],
    opts: &Options,
) -> Result<FormatTau> {
    if samples.is_empty() {
        return Err(DiagnoseError::InvalidInput("no samples to replay".into()));
    }
    let (scan, _) = scan_variants(target, drafter, samples, opts, true)?;
    let declared = scan
        .variants
        .first()
        .ok_or_else(|| DiagnoseError::InvalidInput("no declared variant".into()))?;
    Ok(FormatTau::of(declared, samples))
}

/// τ of the eval prompts as rendered and as re-rendered in the training format.
#[derive(Debug, Clone, Serialize)]
pub struct TauComparison {
    pub eval_format: FormatTau,
    pub training_format: FormatTau,
}

/// Everything the prompt-format check measured (the JSON's `prompt_format`).
#[derive(Debug, Clone, Serialize)]
pub struct PromptFormatReport {
    /// The training data directory (`--data`), if given.
    pub data: Option<String>,
    pub training_examples_read: usize,
    pub training_examples_skipped: usize,
    pub eval: FormatProfile,
    pub training: Option<FormatProfile>,
    pub mismatches: Vec<super::Aspect>,
    /// How the eval prompts were re-rendered in the training format, if they were.
    pub rerender: Option<Rerender>,
    /// The re-rendered prompts' profile.
    pub rerendered: Option<FormatProfile>,
    pub tau: Option<TauComparison>,
    /// Why τ under the training format was not measured (when the formats differ).
    pub tau_not_measured: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).unwrap();
    }

    fn line(tokens: &[u32], mask: &[u8]) -> String {
        serde_json::json!({ "tokens": tokens, "loss_mask": mask }).to_string()
    }

    #[test]
    fn reads_a_few_lines_of_each_shard_and_skips_examples_without_a_prompt() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let ok = line(&[1, 2, 3], &[0, 1, 1]);
        let no_prompt = line(&[1, 2], &[1, 1]);
        let unsupervised = line(&[1, 2], &[0, 0]);
        write(
            d,
            "shard-00000.jsonl",
            &[ok.clone(), no_prompt, ok.clone()].join("\n"),
        );
        write(
            d,
            "shard-00001.jsonl",
            &[unsupervised, ok.clone(), ok.clone()].join("\n"),
        );
        write(d, "notes.txt", "ignored");
        let r = read_training_examples(d, 4).unwrap();
        // two lines of each shard
        assert_eq!((r.examples.len(), r.skipped, r.shards), (2, 2, 2));
        assert_eq!(prompt_len(&r.examples[0]), Some(1));
        let r = read_training_examples(d, 100).unwrap();
        assert_eq!((r.examples.len(), r.skipped), (4, 2));
    }

    #[test]
    fn bad_directories_are_bad_input_naming_the_problem() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let e = read_training_examples(&d.join("missing"), 10).unwrap_err();
        assert!(
            e.is_bad_input() && e.to_string().contains("not found"),
            "{e}"
        );
        let e = read_training_examples(d, 10).unwrap_err();
        assert!(
            e.is_bad_input() && e.to_string().contains("no shard-"),
            "{e}"
        );
        write(d, "shard-00000.jsonl", "{\"tokens\": [1, 2]}\n");
        let e = read_training_examples(d, 10).unwrap_err();
        assert!(e.is_bad_input() && e.to_string().contains("line 1"), "{e}");
        write(d, "shard-00000.jsonl", &line(&[1, 2, 3], &[0, 1]));
        let e = read_training_examples(d, 10).unwrap_err();
        assert!(e.to_string().contains("3 tokens but 2 mask entries"), "{e}");
        write(d, "shard-00000.jsonl", &line(&[1, 2], &[0, 0]));
        let e = read_training_examples(d, 10).unwrap_err();
        assert!(
            e.is_bad_input() && e.to_string().contains("no example"),
            "{e}"
        );
    }
}
