//! `dflash diagnose`'s answers and its prompt-format check (issue 16, item 3): the target's greedy
//! answers to the benchmark prompts as `eval` renders them and, where the training data's format
//! differs in a way the chat template can render, as re-rendered in that format; the texts
//! dflash-diagnose profiles; and the drafter's replayed τ under each format.
//!
//! Invariants: the eval prompts are rendered exactly as `eval` renders them (bench_prompts'
//! render options, no system message; MT-Bench's second turn follows the target's own first
//! answer under the same rendering); a re-render changes only what dflash-diagnose's plan names
//! (a system message, a cut system turn, `enable_thinking`); prompt texts are decoded with
//! special tokens kept (the template's markers are what the profile reads); the training format
//! is profiled from the examples read (`--data`) or, under `--run` when the run's data directory
//! is gone, is the profile the run recorded ([`TrainingFormat`]).

use anyhow::Result;
use dflash_decoding::{generate_ar, GenerateConfig};
use dflash_diagnose::conventions::VariantResult;
use dflash_diagnose::prompt_format::measure::{
    declared_tau, prompt_len, FormatTau, PromptFormatReport, TauComparison, TrainingExamples,
};
use dflash_diagnose::prompt_format::{
    judge, mismatches, no_data, plan, strip_system_turn, FormatProfile, Plan, PromptText, Rerender,
    SystemChange, ANSWER_PREFIX_TOKENS,
};
use dflash_diagnose::{Check, Options, Sample};
use dflash_models::{DFlashDrafter, LoadedTarget};
use dflash_text::{ChatMessage, ChatTemplate, TextTokenizer};
use std::time::Instant;

/// Each benchmark's name and the user turns of its rows.
pub type Rows = [(String, Vec<Vec<String>>)];

/// The chat text of `history` as the eval renders it, or re-rendered by `rerender`.
fn render(
    tpl: &ChatTemplate,
    history: &[ChatMessage],
    rerender: Option<&Rerender>,
) -> Result<String> {
    let mut opts = crate::bench_prompts::render_options();
    let mut msgs = vec![];
    if let Some(r) = rerender {
        if r.enable_thinking.is_some() {
            opts.enable_thinking = r.enable_thinking;
        }
        if let SystemChange::Set(s) = &r.system {
            msgs.push(ChatMessage::new("system", s.clone()));
        }
    }
    msgs.extend(history.iter().cloned());
    let text = tpl.render(&msgs, &opts)?;
    Ok(match rerender {
        Some(r) if r.system == SystemChange::Remove => {
            strip_system_turn(&text, r.template).unwrap_or(text)
        }
        _ => text,
    })
}

/// The target's greedy answers to every row (`tag` labels the progress bars).
pub fn answers(
    target: &LoadedTarget,
    cfg: &GenerateConfig,
    rows: &Rows,
    rerender: Option<&Rerender>,
    tag: &str,
) -> Result<Vec<Sample>> {
    let text = target
        .text
        .as_ref()
        .ok_or_else(|| crate::exit::UsageError("target has no tokenizer".into()))?;
    let tpl = text
        .chat_template
        .as_ref()
        .ok_or_else(|| crate::exit::UsageError("target has no chat template".into()))?;
    let mut samples = vec![];
    for (bench, bench_rows) in rows {
        let pb = crate::progress::bar(bench_rows.len() as u64, &format!("{bench} answers{tag}"));
        for (i, user_turns) in bench_rows.iter().enumerate() {
            let mut history: Vec<ChatMessage> = vec![];
            for (k, turn) in user_turns.iter().enumerate() {
                history.push(ChatMessage::new("user", turn.clone()));
                let prompt = text
                    .tokenizer
                    .encode(&render(tpl, &history, rerender)?, false)?;
                if prompt.is_empty() {
                    return Err(crate::exit::UsageError(format!(
                        "{bench} row {}: empty prompt",
                        i + 1
                    ))
                    .into());
                }
                let g = generate_ar(target.model.as_ref(), &prompt, cfg, &mut |_| {})?;
                history.push(ChatMessage::new(
                    "assistant",
                    text.tokenizer.decode(&g.tokens, true)?,
                ));
                let mut tokens = prompt.clone();
                tokens.extend(&g.tokens);
                samples.push(Sample {
                    name: format!("{bench}:{}.{}", i + 1, k + 1),
                    tokens,
                    prompt_len: prompt.len(),
                });
            }
            pb.inc(1);
        }
        pb.finish_and_clear();
    }
    Ok(samples)
}

/// The text of `tokens[..prompt_len]` and of the answer's first tokens, special tokens kept.
pub(crate) fn prompt_text(
    tok: &TextTokenizer,
    tokens: &[u32],
    prompt_len: usize,
) -> Result<PromptText> {
    let end = tokens.len().min(prompt_len + ANSWER_PREFIX_TOKENS);
    Ok(PromptText {
        prompt: tok.decode(&tokens[..prompt_len], false)?,
        answer_prefix: tok.decode(&tokens[prompt_len..end], false)?,
    })
}

fn profile_samples(tok: &TextTokenizer, samples: &[Sample]) -> Result<FormatProfile> {
    let texts = samples
        .iter()
        .map(|s| prompt_text(tok, &s.tokens, s.prompt_len))
        .collect::<Result<Vec<_>>>()?;
    Ok(FormatProfile::measure(&texts))
}

/// The training data's format: read from its examples (`--data`), or the profile a run recorded
/// (`--run` when the run's data directory is gone).
pub enum TrainingFormat<'a> {
    Examples(&'a TrainingExamples),
    Recorded {
        profile: &'a FormatProfile,
        /// Where the profile comes from.
        source: String,
    },
}

/// The prompt-format check's verdict and what it measured.
pub struct FormatCheck {
    pub check: Check,
    pub report: PromptFormatReport,
    pub seconds: f64,
}

/// Profiles the eval samples and the training examples; where the formats differ renderably,
/// answers the prompts re-rendered in the training format and replays τ on them. `declared`: the
/// conventions scan's declared row over `samples` (τ under the eval format).
#[allow(clippy::too_many_arguments)]
pub fn check(
    target: &LoadedTarget,
    drafter: &DFlashDrafter,
    cfg: &GenerateConfig,
    rows: &Rows,
    samples: &[Sample],
    declared: &VariantResult,
    train: Option<TrainingFormat>,
    opts: &Options,
) -> Result<FormatCheck> {
    let t0 = Instant::now();
    let tok = &target
        .text
        .as_ref()
        .ok_or_else(|| crate::exit::UsageError("target has no tokenizer".into()))?
        .tokenizer;
    let eval = profile_samples(tok, samples)?;
    let mut report = PromptFormatReport {
        data: None,
        training_examples_read: 0,
        training_examples_skipped: 0,
        eval: eval.clone(),
        training: None,
        mismatches: vec![],
        rerender: None,
        rerendered: None,
        tau: None,
        tau_not_measured: None,
    };
    let Some(train) = train else {
        return Ok(FormatCheck {
            check: no_data(&eval),
            report,
            seconds: t0.elapsed().as_secs_f64(),
        });
    };
    let training = match train {
        TrainingFormat::Examples(train) => {
            let texts = train
                .examples
                .iter()
                .map(|e| prompt_text(tok, &e.tokens, prompt_len(e).unwrap_or(0)))
                .collect::<Result<Vec<_>>>()?;
            report.data = Some(train.dir.display().to_string());
            report.training_examples_read = train.examples.len() + train.skipped;
            report.training_examples_skipped = train.skipped;
            FormatProfile::measure(&texts)
        }
        TrainingFormat::Recorded { profile, source } => {
            report.data = Some(source);
            report.training_examples_read = profile.examples;
            profile.clone()
        }
    };
    report.mismatches = mismatches(&eval, &training);
    report.training = Some(training.clone());
    let mut tau = None;
    match plan(&eval, &training) {
        Plan::Matching => {}
        Plan::NotRenderable(why) => report.tau_not_measured = Some(why),
        Plan::Render(r) => {
            let again = answers(target, cfg, rows, Some(&r), " (training format)")?;
            let rerendered = profile_samples(tok, &again)?;
            let left = mismatches(&rerendered, &training);
            if left.is_empty() {
                let t = declared_tau(target.model.as_ref(), drafter, &again, opts)?;
                let e = FormatTau::of(declared, samples);
                tau = Some((e.ddtree_tau, t.ddtree_tau));
                report.tau = Some(TauComparison {
                    eval_format: e,
                    training_format: t,
                });
            } else {
                report.tau_not_measured = Some(format!(
                    "the re-rendered prompts still differ from the training data ({left:?}): {}",
                    rerendered.describe("prompts")
                ));
            }
            report.rerender = Some(r);
            report.rerendered = Some(rerendered);
        }
    }
    let mut c = judge(&eval, &training, tau);
    if let Some(why) = &report.tau_not_measured {
        c.evidence += &format!(" ({why})");
    }
    Ok(FormatCheck {
        check: c,
        report,
        seconds: t0.elapsed().as_secs_f64(),
    })
}
