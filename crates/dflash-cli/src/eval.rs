//! `dflash eval`: acceptance length τ, speed-up over autoregressive decoding and losslessness on
//! benchmark prompt sets, per benchmark and mode, as JSON and a table.
//!
//! Invariants: every prompt runs in `ar` first (the reference); each other mode is compared with
//! it token for token, and a difference is reported with the AR logit margin at the first
//! differing token (never hidden); speed-up is Σ AR decode time / Σ mode decode time over the same
//! prompts in one process; prompts are formatted as in the DFlash paper's harness; τ comes with a
//! 95 % bootstrap interval over the prompts (a handful of prompts is a noisy estimate).
//! `--replay` measures train/inference parity on the benchmark text itself: the drafter's
//! training-mode forward drafts a block at every position of each AR output, the walk decoding
//! would take through those blocks must give the measured steps (all but the last, see
//! `dflash_train::replay`), and the mean over every position is what `train`'s validation
//! streak estimates, so the gap between a run's validation and its eval τ can be split into
//! data (streak on other text), anchor placement (all positions vs decoding's) and mismatch.

use crate::exit::UsageError;
use crate::generate::Mode;
use anyhow::{Context, Result};
use clap::Args;
use dflash_decoding::{
    generate_ar, generate_ar_with_margins, generate_auto, generate_speculative, DFlashRunner,
    GenerateConfig, Generation, SamplingConfig, SpecMode,
};
use dflash_models::{load_drafter, load_target};
use dflash_text::ChatMessage;
use dflash_train::{
    anchor_acceptance, bootstrap_ci95, replay_steps, sequence_taps, AnchorAcceptance,
};
use serde::Serialize;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct EvalArgs {
    #[command(flatten)]
    set: crate::bench_prompts::PromptSetArgs,
    /// Prompts per benchmark (the first N).
    #[arg(long, default_value_t = 20)]
    limit: usize,
    #[arg(long, value_delimiter = ',', default_value = "ar,dflash,ddtree")]
    modes: Vec<Mode>,
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    #[arg(long)]
    block_size: Option<usize>,
    /// DDTree node budgets: one `ddtree-N` run per budget when several are given (AR runs once).
    #[arg(long, value_delimiter = ',', default_values_t = [dflash_decoding::tree::DEFAULT_TREE_BUDGET])]
    tree_budget: Vec<usize>,
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long)]
    dtype: Option<String>,
    /// Bit-exact: every projection (and on the CPU attention too) on row-invariant kernels, so a
    /// verified row computes exactly what the one-token AR step computes and speculative output
    /// equals AR's token for token in bf16 too (SmolLM2 on the H200: 80 of 80 generations, DDTree
    /// ~20 % slower; on the CPU decode steps are row-invariant by default, this adds prefills).
    #[arg(long)]
    bit_exact: bool,
    /// Write the full results (per prompt too) here as JSON.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replay each AR output with the drafter's training-mode forward (a block at every
    /// position): replayed τ, how many prompts' measured steps it reproduces, and the
    /// teacher-forced τ over all positions (what `train` validates with).
    #[arg(long)]
    replay: bool,
    /// Draw each benchmark's acceptance histograms (share of steps per accepted length, a line
    /// per speculative mode) into this PNG.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Serialize, Default, Clone)]
struct ModeSummary {
    mode: String,
    /// DDTree's node budget.
    #[serde(skip_serializing_if = "Option::is_none")]
    tree_budget: Option<usize>,
    prompts: usize,
    output_tokens: usize,
    steps: usize,
    decode_seconds: f64,
    tokens_per_second: f64,
    /// Σ (accepted + bonus) / Σ steps over the benchmark.
    acceptance_length_mean: Option<f64>,
    /// 95 % percentile-bootstrap interval of τ, resampling prompts (turns) with replacement.
    #[serde(skip_serializing_if = "Option::is_none")]
    acceptance_length_ci95: Option<[f64; 2]>,
    /// τ of each prompt (turn), in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    acceptance_length_per_prompt: Vec<f64>,
    acceptance_histogram: Option<Vec<usize>>,
    speedup_vs_ar: Option<f64>,
    identical_to_ar: Option<usize>,
    /// (prompt index, first differing token, AR top1 − top2 logit margin there)
    divergences: Vec<(usize, usize, f32)>,
    /// Speculative modes: where the decode time went, summed over the benchmark (seconds; the
    /// rest of `decode_seconds` is the loop's own bookkeeping).
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    verify_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tree_build_seconds: Option<f64>,
    /// `--replay`: τ of the steps the training-mode forward predicts for the AR outputs.
    #[serde(skip_serializing_if = "Option::is_none")]
    replayed_tau: Option<f64>,
    /// `--replay`: prompts (identical to AR) whose measured steps the replay reproduces, all but
    /// the last step; anything below `identical_to_ar` is a train/inference mismatch.
    #[serde(skip_serializing_if = "Option::is_none")]
    replay_matches: Option<usize>,
    /// `--replay`: 1 + mean accepted drafts of a block at every output position.
    #[serde(skip_serializing_if = "Option::is_none")]
    teacher_forced_tau: Option<f64>,
}

/// `--replay` sums of one mode over a benchmark.
#[derive(Default, Clone)]
struct ReplayTally {
    steps_tau: usize,
    steps: usize,
    all_tau: usize,
    anchors: usize,
    matches: usize,
}

#[derive(Serialize)]
struct BenchResult {
    bench: String,
    modes: Vec<ModeSummary>,
}

pub fn run(a: EvalArgs) -> Result<()> {
    if a.max_new_tokens == 0 || a.limit == 0 {
        return Err(UsageError("--max-new-tokens and --limit must be at least 1".into()).into());
    }
    if a.tree_budget.is_empty() || a.tree_budget.contains(&0) {
        return Err(UsageError("--tree-budget: every budget must be at least 1".into()).into());
    }
    if a.modes.first() != Some(&Mode::Ar) {
        return Err(UsageError("--modes must start with ar (the reference)".into()).into());
    }
    let (device, dtype) = crate::defaults::device_and_dtype(&a.device, a.dtype.as_deref())?;
    crate::defaults::apply_bit_exact(a.bit_exact, &device)?;
    let target_path = crate::defaults::target_path(a.set.target.as_deref())?;
    let target = load_target(&target_path, &device, dtype)
        .with_context(|| format!("loading target {}", target_path.display()))?;
    let text = target
        .text
        .as_ref()
        .ok_or_else(|| UsageError("target has no tokenizer".into()))?;
    let tpl = text
        .chat_template
        .as_ref()
        .ok_or_else(|| UsageError("target has no chat template".into()))?;
    let needs_draft = a.modes.iter().any(|m| *m != Mode::Ar);
    let drafter = if needs_draft {
        let dir = crate::defaults::drafter_path(a.set.draft.as_deref(), &target_path)?;
        let mut d = load_drafter(&dir, &device, dtype)
            .with_context(|| format!("loading drafter {}", dir.display()))?;
        d.bind_target(target.model.as_ref())?;
        if let Some(b) = a.block_size {
            d.set_block_size(b)?;
        }
        Some(d)
    } else {
        None
    };
    let cfg = GenerateConfig {
        cancel: None,
        max_new_tokens: a.max_new_tokens,
        stop_tokens: target.eos_token_ids.clone(),
        sampling: SamplingConfig::greedy(),
    };
    let opts = crate::bench_prompts::render_options();
    // (mode, DDTree budget, name): ddtree once per budget
    let runs: Vec<(Mode, Option<usize>, String)> = a
        .modes
        .iter()
        .flat_map(|&m| {
            let name = format!("{m:?}").to_lowercase();
            if m == Mode::Ddtree {
                let several = a.tree_budget.len() > 1;
                a.tree_budget
                    .iter()
                    .map(|&b| {
                        let n = if several {
                            format!("{name}-{b}")
                        } else {
                            name.clone()
                        };
                        (m, Some(b), n)
                    })
                    .collect::<Vec<_>>()
            } else {
                vec![(m, None, name)]
            }
        })
        .collect();
    let run_mode = |mode: Mode, budget: Option<usize>, prompt: &[u32]| -> Result<Generation> {
        Ok(match (mode, &drafter) {
            (Mode::Ar, _) | (_, None) => {
                generate_ar(target.model.as_ref(), prompt, &cfg, &mut |_| {})?
            }
            (m, Some(d)) => {
                let spec = match m {
                    Mode::Ddtree | Mode::Auto => SpecMode::DdTree {
                        budget: budget.unwrap_or(a.tree_budget[0]),
                    },
                    _ => SpecMode::DFlash,
                };
                let mut r = DFlashRunner::new(d);
                let run = if m == Mode::Auto {
                    generate_auto
                } else {
                    generate_speculative
                };
                run(
                    target.model.as_ref(),
                    &mut r,
                    prompt,
                    &cfg,
                    spec,
                    &mut |_| {},
                )?
            }
        })
    };
    // the DDTree budgets of the runs, in order (`--replay` builds each one's tree per anchor)
    let budgets: Vec<usize> = runs.iter().filter_map(|r| r.1).collect();
    // warm up (CUDA kernels load on first use) outside every timing
    let warm = text.tokenizer.encode("Hello", false)?;
    for (m, b, _) in &runs {
        let _ = run_mode(*m, *b, &warm)?;
    }
    let mut results = vec![];
    let block = drafter.as_ref().map(|d| d.block_size()).unwrap_or(1);
    for bench in &a.set.bench {
        let rows = crate::bench_prompts::load_rows(bench, a.set.bench_dir.as_deref(), a.limit)?;
        let mut sums: Vec<ModeSummary> = runs
            .iter()
            .map(|(_, b, name)| ModeSummary {
                mode: name.clone(),
                tree_budget: *b,
                ..Default::default()
            })
            .collect();
        let mut accepted: Vec<Vec<usize>> = vec![vec![]; runs.len()];
        let mut tallies: Vec<ReplayTally> = vec![ReplayTally::default(); runs.len()];
        // per mode, per prompt: (Σ acceptance, steps)
        let mut per_prompt: Vec<Vec<(usize, usize)>> = vec![vec![]; runs.len()];
        let pb = crate::progress::bar(rows.len() as u64, &format!("{bench} prompts"));
        let mut idx = 0;
        for user_turns in rows {
            let mut history: Vec<ChatMessage> = vec![];
            for turn in user_turns {
                history.push(ChatMessage::new("user", turn));
                let prompt = text
                    .tokenizer
                    .encode(&tpl.render(&history, &opts)?, false)?;
                let mut ar: Option<Generation> = None;
                let mut replay: Option<AnchorAcceptance> = None;
                for (mi, (m, b, _)) in runs.iter().enumerate() {
                    let g = run_mode(*m, *b, &prompt)?;
                    // auto's acceptance covers only its speculative steps: no replay for it
                    let replayable = a.replay && *m != Mode::Auto;
                    if let (true, Some(d), Some(r), Some(spec)) =
                        (replayable, &drafter, &ar, &g.spec)
                    {
                        if g.tokens == r.tokens {
                            if replay.is_none() {
                                let mut seq = prompt.clone();
                                seq.extend(&r.tokens);
                                let anchors: Vec<u32> =
                                    (prompt.len() as u32..seq.len() as u32 - 1).collect();
                                let taps =
                                    sequence_taps(target.model.as_ref(), &seq, d.target_layers())?;
                                replay = Some(anchor_acceptance(
                                    target.model.as_ref(),
                                    d,
                                    &taps,
                                    &seq,
                                    &anchors,
                                    &budgets,
                                    32,
                                )?);
                            }
                            let acc = replay.as_ref().expect("computed above");
                            let tree = b.map(|b| budgets.iter().position(|&x| x == b).unwrap());
                            tally_replay(
                                &mut tallies[mi],
                                acc,
                                tree,
                                (prompt.len(), prompt.len() + r.tokens.len()),
                                &spec.acceptance,
                            );
                        }
                    }
                    let s = &mut sums[mi];
                    s.prompts += 1;
                    s.output_tokens += g.tokens.len();
                    s.steps += g.steps;
                    s.decode_seconds += g.decode_seconds;
                    if let Some(spec) = &g.spec {
                        accepted[mi].extend(&spec.acceptance);
                        per_prompt[mi].push((spec.acceptance.iter().sum(), spec.acceptance.len()));
                        *s.draft_seconds.get_or_insert(0.0) += spec.draft_seconds;
                        *s.verify_seconds.get_or_insert(0.0) += spec.verify_seconds;
                        *s.tree_build_seconds.get_or_insert(0.0) += spec.tree_build_seconds;
                    }
                    match &ar {
                        None => ar = Some(g),
                        Some(r) => {
                            if g.tokens == r.tokens {
                                *s.identical_to_ar.get_or_insert(0) += 1;
                            } else {
                                s.identical_to_ar.get_or_insert(0);
                                let k = g
                                    .tokens
                                    .iter()
                                    .zip(&r.tokens)
                                    .position(|(x, y)| x != y)
                                    .unwrap_or(g.tokens.len().min(r.tokens.len()));
                                // the timed AR run copies no logits to the host; the margins
                                // come from an untimed rerun, once per diverging prompt
                                if r.margins.is_empty() {
                                    let with = generate_ar_with_margins(
                                        target.model.as_ref(),
                                        &prompt,
                                        &cfg,
                                        &mut |_| {},
                                    )?;
                                    ar.as_mut().expect("matched Some").margins = with.margins;
                                }
                                let margins = &ar.as_ref().expect("matched Some").margins;
                                s.divergences.push((
                                    idx,
                                    k,
                                    margins.get(k).copied().unwrap_or(f32::NAN),
                                ));
                            }
                        }
                    }
                }
                let answer = ar.expect("ar ran first");
                history.push(ChatMessage::new(
                    "assistant",
                    text.tokenizer.decode(&answer.tokens, true)?,
                ));
                idx += 1;
            }
            pb.inc(1);
        }
        pb.finish_and_clear();
        let ar_secs = sums[0].decode_seconds;
        for (s, t) in sums.iter_mut().zip(&tallies) {
            if a.replay && s.mode != "ar" {
                s.replayed_tau = Some(t.steps_tau as f64 / t.steps.max(1) as f64);
                s.replay_matches = Some(t.matches);
                s.teacher_forced_tau = Some(t.all_tau as f64 / t.anchors.max(1) as f64);
            }
        }
        for ((s, acc), pp) in sums.iter_mut().zip(&accepted).zip(&per_prompt) {
            if !pp.is_empty() {
                s.acceptance_length_ci95 = Some(bootstrap_ci95(pp, 2000));
                s.acceptance_length_per_prompt = pp
                    .iter()
                    .map(|&(a, n)| a as f64 / n.max(1) as f64)
                    .collect();
            }
            s.tokens_per_second = s.output_tokens as f64 / s.decode_seconds.max(1e-9);
            if s.mode != "ar" {
                s.speedup_vs_ar = Some(ar_secs / s.decode_seconds.max(1e-9));
                if !acc.is_empty() {
                    s.acceptance_length_mean =
                        Some(acc.iter().sum::<usize>() as f64 / acc.len() as f64);
                    let mut h = vec![0usize; block];
                    for &x in acc {
                        h[x.clamp(1, block) - 1] += 1;
                    }
                    s.acceptance_histogram = Some(h);
                }
            }
        }
        results.push(BenchResult {
            bench: bench.clone(),
            modes: sums,
        });
    }
    eprintln!(
        "{:<12} {:<10} {:>7} {:>8} {:>9} {:>7} {:>11} {:>8} {:>10}",
        "bench", "mode", "prompts", "tokens", "tok/s", "tau", "tau 95%", "speedup", "same-as-AR"
    );
    for r in &results {
        for s in &r.modes {
            eprintln!(
                "{:<12} {:<10} {:>7} {:>8} {:>9.1} {:>7} {:>11} {:>8} {:>10}",
                r.bench,
                s.mode,
                s.prompts,
                s.output_tokens,
                s.tokens_per_second,
                s.acceptance_length_mean
                    .map(|t| format!("{t:.2}"))
                    .unwrap_or("-".into()),
                s.acceptance_length_ci95
                    .map(|[lo, hi]| format!("{lo:.2}-{hi:.2}"))
                    .unwrap_or("-".into()),
                s.speedup_vs_ar
                    .map(|t| format!("{t:.2}x"))
                    .unwrap_or("-".into()),
                s.identical_to_ar
                    .map(|n| format!("{n}/{}", s.prompts))
                    .unwrap_or("-".into()),
            );
        }
    }
    if a.replay {
        eprintln!(
            "\n{:<12} {:<10} {:>7} {:>12} {:>13} {:>18}",
            "bench", "mode", "tau", "replayed tau", "steps match", "all positions tau"
        );
        for r in &results {
            for s in r.modes.iter().filter(|s| s.replayed_tau.is_some()) {
                let f = |x: Option<f64>| x.map(|t| format!("{t:.2}")).unwrap_or("-".into());
                eprintln!(
                    "{:<12} {:<10} {:>7} {:>12} {:>13} {:>18}",
                    r.bench,
                    s.mode,
                    f(s.acceptance_length_mean),
                    f(s.replayed_tau),
                    format!(
                        "{}/{}",
                        s.replay_matches.unwrap_or(0),
                        s.identical_to_ar.unwrap_or(0)
                    ),
                    f(s.teacher_forced_tau),
                );
            }
        }
    }
    let json = serde_json::json!({
        "target": target_path.display().to_string(),
        "device": a.device, "dtype": format!("{dtype:?}").to_lowercase(), "bit_exact": a.bit_exact,
        "max_new_tokens": a.max_new_tokens, "block_size": block, "tree_budget": if a.tree_budget.len() == 1 {
            serde_json::json!(a.tree_budget[0])
        } else {
            serde_json::json!(a.tree_budget)
        },
        "results": results,
    });
    let text = serde_json::to_string_pretty(&json)?;
    if let Some(p) = &a.out {
        crate::defaults::write_atomic(p, text.as_bytes())?;
    }
    if let Some(p) = &a.plot {
        plot_histograms(&results, p).with_context(|| format!("writing {}", p.display()))?;
    }
    println!("{text}");
    Ok(())
}

/// `--plot`: a panel per benchmark with the share of steps that emitted each number of tokens
/// (accepted drafts + bonus), one line per speculative mode, its τ in the legend.
fn plot_histograms(results: &[BenchResult], path: &Path) -> Result<()> {
    use dflash_plot::{Figure, Panel, Series};
    let panels: Vec<Panel> = results
        .iter()
        .map(|r| Panel {
            title: r.bench.clone(),
            x_label: "tokens per step".into(),
            y_label: "share of steps".into(),
            series: r
                .modes
                .iter()
                .filter_map(|m| {
                    let (h, tau) = (m.acceptance_histogram.as_ref()?, m.acceptance_length_mean?);
                    let steps = h.iter().sum::<usize>().max(1) as f64;
                    let points = h
                        .iter()
                        .enumerate()
                        .map(|(i, &c)| ((i + 1) as f64, c as f64 / steps))
                        .collect();
                    Some(Series::new(format!("{} tau {tau:.2}", m.mode), points))
                })
                .collect(),
            log_y: false,
        })
        .collect();
    let fig = Figure {
        title: "dflash eval: tokens per speculative step".into(),
        columns: panels.len().clamp(1, 3),
        panels,
        ..Figure::default()
    };
    fig.save_png(path)?;
    Ok(())
}

/// Adds one prompt's replay to `t`: the steps through the output at `span` (start, end) and
/// whether they reproduce `measured` (all but the last step, which may accept past the end).
fn tally_replay(
    t: &mut ReplayTally,
    acc: &AnchorAcceptance,
    tree: Option<usize>,
    span: (usize, usize),
    measured: &[usize],
) {
    let steps = replay_steps(acc, tree, span.0, span.1);
    let n = steps.len();
    if n == measured.len() && steps[..n.saturating_sub(1)] == measured[..n.saturating_sub(1)] {
        t.matches += 1;
    }
    t.steps_tau += steps.iter().sum::<usize>();
    t.steps += n;
    let all = match tree {
        None => &acc.dflash,
        Some(k) => &acc.ddtree[k],
    };
    t.all_tau += all.iter().map(|x| x + 1).sum::<usize>();
    t.anchors += all.len();
}
