//! Benchmark prompt sets as `eval` and `diagnose` read them: where a named benchmark lives, how a
//! row becomes the user turns of the DFlash paper's harness, and the chat-template options.
//!
//! Invariants: a row without a prompt or a line that is not JSON is a [`UsageError`] naming the
//! file and line; only the first `limit` non-empty lines are read; prompts are rendered with the
//! generation prompt on and thinking off.

use crate::exit::UsageError;
use anyhow::{Context, Result};
use dflash_text::RenderOptions;
use std::path::{Path, PathBuf};

/// The models and prompt sets `eval` and `diagnose` both take (flattened into their flags).
#[derive(clap::Args, Debug)]
pub struct PromptSetArgs {
    /// Target model (HF directory or .gguf); default as for `generate`.
    #[arg(long)]
    pub target: Option<PathBuf>,
    /// Drafter directory (default: the shipped drafter of the target, if any).
    #[arg(long)]
    pub draft: Option<PathBuf>,
    /// Benchmarks: gsm8k, humaneval, mt_bench (from --bench-dir) or paths to .jsonl files.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "gsm8k,humaneval,mt_bench"
    )]
    pub bench: Vec<String>,
    /// Directory of the benchmark files (default: data/benchmarks of this repository).
    #[arg(long)]
    pub bench_dir: Option<PathBuf>,
}

pub fn bench_file(name: &str, dir: Option<&Path>) -> Result<PathBuf> {
    let p = PathBuf::from(name);
    if p.extension().is_some_and(|e| e == "jsonl") {
        return Ok(p);
    }
    let file = match name {
        "gsm8k" => "gsm8k_test.jsonl",
        "humaneval" => "humaneval.jsonl",
        "mt_bench" => "mt_bench.jsonl",
        other => {
            return Err(UsageError(format!(
                "unknown benchmark {other:?} (gsm8k, humaneval, mt_bench or a .jsonl path)"
            ))
            .into())
        }
    };
    let dir = match dir {
        Some(d) => d.to_path_buf(),
        None => crate::defaults::find_upwards("data/benchmarks")
            .ok_or_else(|| UsageError("data/benchmarks not found: pass --bench-dir".into()))?,
    };
    Ok(dir.join(file))
}

/// One benchmark row as the paper's harness phrases it: a list of user turns.
pub fn turns(bench: &str, v: &serde_json::Value) -> Option<Vec<String>> {
    let s = |k: &str| v.get(k).and_then(|x| x.as_str()).map(String::from);
    if bench == "gsm8k" {
        return s("question").map(|q| {
            vec![format!(
                "{q}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
            )]
        });
    }
    if bench == "humaneval" {
        return s("prompt").map(|p| {
            vec![format!(
                "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{p}\n```"
            )]
        });
    }
    if let Some(t) = v.get("turns").and_then(|t| t.as_array()) {
        return Some(
            t.iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect(),
        );
    }
    s("prompt").or_else(|| s("question")).map(|p| vec![p])
}

/// The user turns of the first `limit` rows of benchmark `bench` (a name or a `.jsonl` path).
pub fn load_rows(bench: &str, dir: Option<&Path>, limit: usize) -> Result<Vec<Vec<String>>> {
    let path = bench_file(bench, dir)?;
    let raw =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    raw.lines()
        .filter(|l| !l.trim().is_empty())
        .take(limit)
        .enumerate()
        .map(|(i, l)| {
            let v: serde_json::Value = serde_json::from_str(l)
                .map_err(|e| UsageError(format!("{}:{}: {e}", path.display(), i + 1)))?;
            turns(bench, &v).ok_or_else(|| {
                UsageError(format!(
                    "{}:{}: no prompt in this row",
                    path.display(),
                    i + 1
                ))
                .into()
            })
        })
        .collect()
}

/// The chat-template options benchmark prompts are rendered with.
pub fn render_options() -> RenderOptions {
    RenderOptions {
        add_generation_prompt: true,
        enable_thinking: Some(false),
        tools: None,
    }
}
