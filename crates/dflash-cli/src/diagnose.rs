//! `dflash diagnose`: find a train/eval mismatch of a drafter by measurement (issue 16's first
//! slice): the target answers benchmark prompts greedily, then dflash-diagnose runs its checks
//! (conventions scan through the taps, target integrity, tap statistics) on those answers, and
//! the prompt-format check compares the prompts' format with the training data's (`--data`,
//! crate::diagnose_format); with `--run RUN` a training run's recorded inputs give the defaults
//! and the train-vs-eval check decodes its validation prompts (crate::diagnose_run).
//!
//! Invariants: target and drafter resolve exactly as in `eval` (crate::defaults), prompts load and
//! render as in `eval` (crate::bench_prompts; MT-Bench's second turn follows the target's own
//! first answer); every input (run directory, drafter directory, benchmark files, `--data`) is
//! checked before the models load; the table goes to stderr, the JSON to stdout (and
//! `--json-out`, atomically); exit code 0 when no check FAILs, 1 when one does (no "error:" line:
//! the table said it), 2 on bad input.

use crate::diagnose_run::RunInputs;
use crate::exit::{Reported, UsageError};
use anyhow::{Context, Result};
use clap::Args;
use dflash_decoding::{GenerateConfig, SamplingConfig};
use dflash_diagnose::prompt_format::measure::{read_training_examples, MAX_EXAMPLES};
use dflash_diagnose::{diagnose, stats, Check, Diagnosis, Options, Verdict};
use dflash_models::{load_drafter, load_target};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args, Debug)]
pub struct DiagnoseArgs {
    #[command(flatten)]
    set: crate::bench_prompts::PromptSetArgs,
    /// Prompts per benchmark (the first N). The default's four prompts (one of each benchmark,
    /// MT-Bench's two turns) take ~100 s on 2 CPU cores; more give tighter intervals.
    #[arg(long, default_value_t = 1)]
    limit: usize,
    /// Length of the target's answers the checks run on.
    #[arg(long, default_value_t = 96)]
    max_new_tokens: usize,
    /// DDTree node budget of the replayed τ.
    #[arg(long, default_value_t = dflash_decoding::tree::DEFAULT_TREE_BUDGET)]
    tree_budget: usize,
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long)]
    dtype: Option<String>,
    /// Also write the JSON here.
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// Draw the replayed τ of each conventions variant into this PNG.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Write the measured tap statistics to the drafter directory's tap_stats.json (what later
    /// diagnoses compare against).
    #[arg(long)]
    record_stats: bool,
    /// The drafter's training data (a `dflash data regen` directory of shard-*.jsonl): the
    /// prompt-format check compares its chat template, system prompt and thinking mode with the
    /// eval prompts' (reads at most 256 examples).
    #[arg(long)]
    data: Option<PathBuf>,
    /// A `dflash train` run directory: its drafter (RUN/drafter), target and training data become
    /// the defaults, and the train-vs-eval check compares its validation τ with the τ of the
    /// drafter decoding the same validation prompts now.
    #[arg(long)]
    run: Option<PathBuf>,
    /// Recorded validation prompts of `--run` to decode (at most the 8 it records).
    #[arg(long, default_value_t = 4)]
    run_prompts: usize,
}

pub fn run(a: DiagnoseArgs) -> Result<()> {
    if a.max_new_tokens == 0 || a.limit == 0 || a.tree_budget == 0 || a.run_prompts == 0 {
        return Err(UsageError(
            "--max-new-tokens, --limit, --tree-budget and --run-prompts must be at least 1".into(),
        )
        .into());
    }
    let t0 = Instant::now();
    let (device, dtype) = crate::defaults::device_and_dtype(&a.device, a.dtype.as_deref())?;
    // a run's recorded inputs first: they give the defaults below
    let run_inputs = match &a.run {
        Some(dir) => Some(RunInputs::read(dir)?),
        None => None,
    };
    let target_path = match (&a.set.target, &run_inputs) {
        (None, Some(r)) => r.target()?,
        _ => crate::defaults::target_path(a.set.target.as_deref())?,
    };
    let draft_dir = match (&a.set.draft, &run_inputs) {
        (None, Some(r)) => r.drafter(),
        _ => crate::defaults::drafter_path(a.set.draft.as_deref(), &target_path)?,
    };
    if !draft_dir.is_dir() {
        return Err(UsageError(format!(
            "{}: drafter directory not found",
            draft_dir.display()
        ))
        .into());
    }
    // every benchmark file exists before the models load (bad input fails fast, with code 2)
    let mut rows = vec![];
    for bench in &a.set.bench {
        let p = crate::bench_prompts::bench_file(bench, a.set.bench_dir.as_deref())?;
        if !p.is_file() {
            return Err(UsageError(format!("{}: benchmark file not found", p.display())).into());
        }
        rows.push((
            bench.clone(),
            crate::bench_prompts::load_rows(bench, a.set.bench_dir.as_deref(), a.limit)?,
        ));
    }
    let train_data = match (&run_inputs, &a.data) {
        (Some(r), data) => crate::diagnose_run::training_data(r, data.as_deref())?,
        (None, Some(dir)) => Some(read_training_examples(dir, MAX_EXAMPLES)?),
        (None, None) => None,
    };
    let target = load_target(&target_path, &device, dtype)
        .with_context(|| format!("loading target {}", target_path.display()))?;
    let mut drafter = load_drafter(&draft_dir, &device, dtype)
        .with_context(|| format!("loading drafter {}", draft_dir.display()))?;
    drafter.bind_target(target.model.as_ref())?;
    let recorded = stats::read_tap_stats(&draft_dir)?;
    let cfg = GenerateConfig {
        cancel: None,
        max_new_tokens: a.max_new_tokens,
        stop_tokens: target.eos_token_ids.clone(),
        sampling: SamplingConfig::greedy(),
    };
    let load_seconds = t0.elapsed().as_secs_f64();

    // the target's own greedy answers
    let t1 = Instant::now();
    let samples = crate::diagnose_format::answers(&target, &cfg, &rows, None, "")?;
    let answer_seconds = t1.elapsed().as_secs_f64();

    let opts = Options {
        tree_budget: a.tree_budget,
        integrity_positions: 32,
        recorded_stats: recorded,
        target_rope: target.config.rope().ok().map(|r| (r.theta, r.scaling)),
        mask_token_candidates: mask_token_candidates(&target),
    };
    let mut d = diagnose(target.model.as_ref(), &drafter, &samples, &opts)?;
    let declared = d
        .conventions
        .variants
        .first()
        .context("the conventions scan measured no variant")?;
    let format = crate::diagnose_format::check(
        &target,
        &drafter,
        &cfg,
        &rows,
        &samples,
        declared,
        crate::diagnose_run::training_format(run_inputs.as_ref(), train_data.as_ref()),
        &opts,
    )?;
    d.checks.push(format.check);
    let run_check = match &run_inputs {
        Some(r) => {
            let rc = crate::diagnose_run::check(
                &target,
                &target_path,
                &drafter,
                r,
                a.run_prompts,
                a.max_new_tokens,
            )?;
            d.checks.push(rc.check.clone());
            // the tap statistics against the run's, on the tokens they were recorded on
            if let (Some(c), Some(report)) = (&rc.tap_check, &rc.tap_report) {
                for old in d.checks.iter_mut().filter(|x| x.check == "tap_statistics") {
                    *old = c.clone();
                }
                d.tap_statistics = report.clone();
            }
            Some(rc)
        }
        None => None,
    };
    if a.record_stats {
        stats::write_tap_stats(&draft_dir, &d.tap_statistics.measured)?;
        eprintln!(
            "recorded tap statistics in {}",
            draft_dir.join(stats::TAP_STATS_FILE).display()
        );
    }
    print_table(&d);
    let json = serde_json::json!({
        "target": target_path.display().to_string(),
        "draft": draft_dir.display().to_string(),
        "device": a.device,
        "dtype": format!("{dtype:?}").to_lowercase(),
        "benches": a.set.bench,
        "prompts": samples.len(),
        "max_new_tokens": a.max_new_tokens,
        "verdict": d.verdict(),
        "checks": d.checks,
        "conventions": d.conventions,
        "target_integrity": d.target_integrity,
        "tap_statistics": d.tap_statistics,
        "prompt_format": format.report,
        "run": run_check.as_ref().map(|rc| serde_json::json!({
            "dir": a.run.as_ref().map(|p| p.display().to_string()),
            "train_vs_eval": rc.report,
        })),
        "seconds": {
            "load": load_seconds,
            "answers": answer_seconds,
            "conventions": d.seconds.conventions,
            "target_integrity": d.seconds.target_integrity,
            "prompt_format": format.seconds,
            "train_vs_eval": run_check.as_ref().map(|rc| rc.seconds),
            "total": t0.elapsed().as_secs_f64(),
        },
    });
    let out = serde_json::to_string_pretty(&json)?;
    if let Some(p) = &a.json_out {
        crate::defaults::write_atomic(p, out.as_bytes())?;
    }
    if let Some(p) = &a.plot {
        plot_variants(&d, p).with_context(|| format!("writing {}", p.display()))?;
    }
    println!("{out}");
    if d.verdict() == Verdict::Fail {
        return Err(Reported(1).into());
    }
    Ok(())
}

/// The mask tokens the conventions scan tries instead of the declared one, most plausible first:
/// the token `dflash draft init` would choose ("init rule"), the target's first EOS, the
/// vocabulary's last id, the BOS token.
fn mask_token_candidates(t: &dflash_models::LoadedTarget) -> Vec<(String, u32)> {
    let vocab = t.config.vocab_size as u32;
    let mut out = vec![("init rule".to_string(), crate::draft::default_mask_token(t))];
    if let Some(&e) = t.eos_token_ids.first() {
        out.push(("eos".into(), e));
    }
    out.push(("last id".into(), vocab.saturating_sub(1)));
    if let Some(text) = &t.text {
        if let Some(b) = text
            .bos_token
            .as_deref()
            .and_then(|b| text.tokenizer.token_to_id(b))
        {
            out.push(("bos".into(), b));
        }
    }
    out.retain(|&(_, id)| id < vocab);
    out
}

/// The checks (verdict, evidence, cause and fix), on stderr.
pub fn print_checks(checks: &[Check]) {
    eprintln!("{:<17} {:<7} evidence / cause / fix", "check", "verdict");
    for c in checks {
        eprintln!(
            "{:<17} {:<7} {}",
            c.check,
            c.verdict.to_string(),
            c.evidence
        );
        if !c.cause.is_empty() {
            eprintln!("{:<25} cause: {}", "", c.cause);
        }
        if !c.fix.is_empty() {
            eprintln!("{:<25} fix:   {}", "", c.fix);
        }
    }
}

/// The checks and the τ of each variant, on stderr.
fn print_table(d: &Diagnosis) {
    print_checks(&d.checks);
    let s = &d.conventions;
    let w = s
        .variants
        .iter()
        .map(|v| v.variant.name.chars().count())
        .max()
        .unwrap_or(0)
        .max(24);
    eprintln!(
        "\n{:<w$} {:<24} {:>10} {:>11} {:>10} {:>11} {:>9} {:>8}",
        "variant",
        "taps",
        format!("ddtree-{}", s.tree_budget),
        "95%",
        "dflash",
        "95%",
        "all-pos",
        "log-lik"
    );
    for v in &s.variants {
        let taps = format!(
            "{:?}{}",
            v.variant.target_layer_ids,
            if v.variant.final_norm_on_last_tap {
                "+norm"
            } else {
                ""
            }
        );
        eprintln!(
            "{:<w$} {:<24} {:>10.2} {:>11} {:>10.2} {:>11} {:>9.2} {:>8.3}",
            v.variant.name,
            taps,
            v.ddtree_tau,
            format!("{:.2}-{:.2}", v.ddtree_tau_ci95[0], v.ddtree_tau_ci95[1]),
            v.dflash_tau,
            format!("{:.2}-{:.2}", v.dflash_tau_ci95[0], v.dflash_tau_ci95[1]),
            v.teacher_forced_ddtree_tau,
            v.log_likelihood,
        );
    }
}

/// `--plot`: replayed DDTree τ per variant as labelled bars, the declared setting highlighted.
fn plot_variants(d: &Diagnosis, path: &Path) -> Result<()> {
    let bars: Vec<(String, f64, bool)> = d
        .conventions
        .variants
        .iter()
        .map(|v| {
            let name = v.variant.name.clone();
            let declared = name == "declared";
            (name, v.ddtree_tau, declared)
        })
        .collect();
    let chart = dflash_plot::BarChart {
        title: format!(
            "dflash diagnose: replayed DDTree-{} tau per conventions variant",
            d.conventions.tree_budget
        ),
        y_label: "replayed tau".into(),
        height: (140 + 38 * bars.len() as u32).max(300),
        bars,
        width: 1100,
    };
    chart.save_png(path)?;
    Ok(())
}
