//! Prompt format: the chat template, system prompt and thinking mode of the eval prompts vs those
//! of the training data, measured from the prompts' text (issue 16, item 3).
//!
//! Invariants:
//! - A [`FormatProfile`] is a pure function of each example's [`PromptText`]: the decoded text
//!   (special tokens kept) of its prompt region and of the first [`ANSWER_PREFIX_TOKENS`] tokens
//!   of its answer. For training data the prompt region is the tokens before the first supervised
//!   (loss-mask 1) token ([`measure`] reads and splits the shards; this module is model-free).
//! - Template family: the earliest turn marker of the prompt (ChatML `<|im_start|>`, Llama-3
//!   `<|start_header_id|>`, Gemma `<start_of_turn>`, Mistral `[INST]`); none is `plain`.
//! - System prompt: the trimmed content of a system turn opening a ChatML or Llama-3 conversation;
//!   a template's default system prompt (SmolLM2's) counts like any other. Gemma and Mistral
//!   templates fold a system prompt into the first user turn, so there it is never detected (and
//!   never a mismatch).
//! - Thinking: on when a `<think>` opens a non-empty block in the text after the prompt's last
//!   assistant-turn opener (the last 64 bytes of a plain prompt) followed by the answer prefix; an
//!   empty `<think></think>` block (Qwen3's thinking off) or no `<think>` at all is off.
//! - Each profile gives the most common value of each aspect and the share of examples with each
//!   value. [`judge`] calls an aspect a mismatch when fewer than [`MIN_TRAIN_SHARE`] of the
//!   training examples follow the eval prompts' (most common) value, so a mixed training set that
//!   covers the eval format is ok. A mismatch is a warn, never a FAIL (the format moves τ, it
//!   breaks nothing), with both profiles and, when measured, the replayed DDTree τ under both
//!   formats as evidence; matching is ok. Without training data the check is reported as ok with
//!   the evidence "no training data given (--data)" and the eval profile ([`no_data`]).
//! - τ under the training format is measured only where [`plan`] can render it: same template
//!   family; the training data's most common system prompt set as the system turn, or (ChatML,
//!   Llama-3) the eval prompts' system turn cut from the rendered text ([`strip_system_turn`],
//!   template defaults included); thinking switched with `enable_thinking`. The re-rendered
//!   prompts must then profile as the training data does, or no τ is reported. Both τ are the
//!   conventions scan's declared variant ([`measure::declared_tau`]) on the target's greedy
//!   answers: the drafter's forward is never re-implemented.

pub mod measure;

use crate::{Check, Verdict};
use serde::{Deserialize, Serialize};

/// The check's name in the table and the JSON.
pub const NAME: &str = "prompt_format";
/// Answer tokens decoded beside the prompt region (where a thinking block would open).
pub const ANSWER_PREFIX_TOKENS: usize = 16;
/// Share of training examples that must follow the eval prompts' value of an aspect for it to
/// count as matching (a format a quarter of the data shows is one the drafter learned).
pub const MIN_TRAIN_SHARE: f64 = 0.25;
/// System prompts listed in a profile (the most common first).
pub const MAX_SYSTEM_PROMPTS: usize = 8;

/// One example's text: its prompt region and the start of its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptText {
    pub prompt: String,
    pub answer_prefix: String,
}

/// The chat template's family, from its turn markers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TemplateFamily {
    ChatMl,
    Llama3,
    Gemma,
    Mistral,
    Plain,
}

impl std::fmt::Display for TemplateFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TemplateFamily::ChatMl => "ChatML",
            TemplateFamily::Llama3 => "Llama-3",
            TemplateFamily::Gemma => "Gemma",
            TemplateFamily::Mistral => "Mistral [INST]",
            TemplateFamily::Plain => "no template",
        })
    }
}

impl TemplateFamily {
    /// (turn marker, assistant-turn opener) of each family with markers.
    const MARKERS: [(TemplateFamily, &'static str, &'static str); 4] = [
        (
            TemplateFamily::ChatMl,
            "<|im_start|>",
            "<|im_start|>assistant",
        ),
        (
            TemplateFamily::Llama3,
            "<|start_header_id|>",
            "<|start_header_id|>assistant<|end_header_id|>",
        ),
        (
            TemplateFamily::Gemma,
            "<start_of_turn>",
            "<start_of_turn>model",
        ),
        (TemplateFamily::Mistral, "[INST]", "[/INST]"),
    ];

    /// The family whose turn marker comes first in `prompt`.
    pub fn detect(prompt: &str) -> TemplateFamily {
        Self::MARKERS
            .iter()
            .filter_map(|&(f, m, _)| prompt.find(m).map(|i| (i, f)))
            .min_by_key(|&(i, _)| i)
            .map_or(TemplateFamily::Plain, |(_, f)| f)
    }

    fn assistant_opener(self) -> Option<&'static str> {
        Self::MARKERS
            .iter()
            .find(|m| m.0 == self)
            .map(|&(_, _, a)| a)
    }

    /// (opening of a system turn, its end) where the family has system turns of its own.
    fn system_turn(self) -> Option<(&'static str, &'static str)> {
        match self {
            TemplateFamily::ChatMl => Some(("<|im_start|>system", "<|im_end|>")),
            TemplateFamily::Llama3 => {
                Some(("<|start_header_id|>system<|end_header_id|>", "<|eot_id|>"))
            }
            _ => None,
        }
    }
}

/// The byte range of the system turn opening `prompt` (from its opener through its end marker
/// and one following newline) and its trimmed content.
fn system_turn_span(prompt: &str, family: TemplateFamily) -> Option<(usize, usize, String)> {
    let (open, close) = family.system_turn()?;
    let &(_, marker, _) = TemplateFamily::MARKERS.iter().find(|m| m.0 == family)?;
    // the conversation's first turn must be the system turn
    let first = prompt.find(marker)?;
    if !prompt[first..].starts_with(open) {
        return None;
    }
    let body = first + open.len();
    let end = body + prompt[body..].find(close)?;
    let mut stop = end + close.len();
    if prompt[stop..].starts_with('\n') {
        stop += 1;
    }
    Some((first, stop, prompt[body..end].trim().to_string()))
}

/// `rendered` without the system turn opening it (ChatML, Llama-3); `None` when it has none.
pub fn strip_system_turn(rendered: &str, family: TemplateFamily) -> Option<String> {
    let (a, b, _) = system_turn_span(rendered, family)?;
    Some(format!("{}{}", &rendered[..a], &rendered[b..]))
}

/// Whether thinking is on in one example (see the module's invariants).
fn thinking_on(t: &PromptText, family: TemplateFamily) -> bool {
    let tail = match family.assistant_opener() {
        Some(o) => t.prompt.rfind(o).map(|i| &t.prompt[i + o.len()..]),
        None => None,
    }
    .unwrap_or_else(|| {
        let mut i = t.prompt.len().saturating_sub(64);
        while !t.prompt.is_char_boundary(i) {
            i += 1;
        }
        &t.prompt[i..]
    });
    let s = format!("{tail}{}", t.answer_prefix);
    match s.find("<think>") {
        None => false,
        Some(i) => !s[i + "<think>".len()..]
            .trim_start()
            .starts_with("</think>"),
    }
}

/// One example's format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExampleFormat {
    pub template: TemplateFamily,
    pub system_prompt: Option<String>,
    pub thinking: bool,
}

impl ExampleFormat {
    pub fn detect(t: &PromptText) -> ExampleFormat {
        let template = TemplateFamily::detect(&t.prompt);
        ExampleFormat {
            template,
            system_prompt: system_turn_span(&t.prompt, template).map(|s| s.2),
            thinking: thinking_on(t, template),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateCount {
    pub template: TemplateFamily,
    pub examples: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SystemPromptCount {
    /// `None`: no system turn.
    pub text: Option<String>,
    pub examples: usize,
}

/// The format of a set of prompts (see the module's invariants).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FormatProfile {
    pub examples: usize,
    /// The most common template family, and the share of examples using it.
    pub template: TemplateFamily,
    pub template_share: f64,
    /// Examples per family, the most common first.
    pub templates: Vec<TemplateCount>,
    /// The most common system prompt (`None`: most examples have none) and its share.
    pub system_prompt: Option<String>,
    pub system_prompt_share: f64,
    /// Share of examples with any system turn.
    pub with_system_prompt_share: f64,
    /// Examples per system prompt, the most common first, at most [`MAX_SYSTEM_PROMPTS`].
    pub system_prompts: Vec<SystemPromptCount>,
    /// Examples whose system prompt is not in [`Self::system_prompts`].
    pub other_system_prompt_examples: usize,
    /// Whether most examples think, and the share of examples that do as most do.
    pub thinking: bool,
    pub thinking_share: f64,
    pub thinking_examples: usize,
}

/// Values by count, the most common first (ties in order of first appearance).
fn counts<T: PartialEq + Clone>(xs: impl Iterator<Item = T>) -> Vec<(T, usize)> {
    let mut out: Vec<(T, usize)> = vec![];
    for x in xs {
        match out.iter_mut().find(|(y, _)| *y == x) {
            Some(c) => c.1 += 1,
            None => out.push((x, 1)),
        }
    }
    out.sort_by_key(|c| std::cmp::Reverse(c.1));
    out
}

impl FormatProfile {
    pub fn measure(texts: &[PromptText]) -> FormatProfile {
        let fmts: Vec<ExampleFormat> = texts.iter().map(ExampleFormat::detect).collect();
        let n = fmts.len();
        let share = |k: usize| k as f64 / n.max(1) as f64;
        let templates = counts(fmts.iter().map(|f| f.template));
        let systems = counts(fmts.iter().map(|f| f.system_prompt.clone()));
        let on = fmts.iter().filter(|f| f.thinking).count();
        let thinking = 2 * on > n;
        let (template, t_n) = templates
            .first()
            .copied()
            .unwrap_or((TemplateFamily::Plain, 0));
        let (system_prompt, s_n) = systems.first().cloned().unwrap_or((None, 0));
        let listed: Vec<SystemPromptCount> = systems
            .iter()
            .take(MAX_SYSTEM_PROMPTS)
            .map(|(text, examples)| SystemPromptCount {
                text: text.clone(),
                examples: *examples,
            })
            .collect();
        FormatProfile {
            examples: n,
            template,
            template_share: share(t_n),
            templates: templates
                .into_iter()
                .map(|(template, examples)| TemplateCount { template, examples })
                .collect(),
            system_prompt,
            system_prompt_share: share(s_n),
            with_system_prompt_share: share(
                fmts.iter().filter(|f| f.system_prompt.is_some()).count(),
            ),
            other_system_prompt_examples: n - listed.iter().map(|c| c.examples).sum::<usize>(),
            system_prompts: listed,
            thinking,
            thinking_share: share(if thinking { on } else { n - on }),
            thinking_examples: on,
        }
    }

    fn share(&self, k: usize) -> f64 {
        k as f64 / self.examples.max(1) as f64
    }

    /// Share of examples using `template`.
    pub fn template_share_of(&self, template: TemplateFamily) -> f64 {
        self.share(
            self.templates
                .iter()
                .find(|c| c.template == template)
                .map_or(0, |c| c.examples),
        )
    }

    /// Share of examples with system prompt `text` (`None`: none); 0 for a prompt not listed.
    pub fn system_share_of(&self, text: Option<&str>) -> f64 {
        self.share(
            self.system_prompts
                .iter()
                .find(|c| c.text.as_deref() == text)
                .map_or(0, |c| c.examples),
        )
    }

    /// Share of examples with thinking `on`.
    pub fn thinking_share_of(&self, on: bool) -> f64 {
        self.share(if on {
            self.thinking_examples
        } else {
            self.examples - self.thinking_examples
        })
    }

    /// One line: family, system prompt and thinking with their shares.
    pub fn describe(&self, unit: &str) -> String {
        format!(
            "{} ({}), {} ({}), thinking {} ({}); {} {unit}",
            self.template,
            pct(self.template_share),
            system_label(self.system_prompt.as_deref()),
            pct(self.system_prompt_share),
            on_off(self.thinking),
            pct(self.thinking_share),
            self.examples,
        )
    }
}

fn pct(x: f64) -> String {
    format!("{:.0} %", 100.0 * x)
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// `'text'`, cut to 72 characters.
fn quote(text: &str) -> String {
    let cut: String = text.chars().take(72).collect();
    if cut.len() < text.len() {
        format!("'{cut}\u{2026}'")
    } else {
        format!("'{cut}'")
    }
}

fn system_label(s: Option<&str>) -> String {
    match s {
        Some(t) => format!("system prompt {}", quote(t)),
        None => "no system prompt".into(),
    }
}

/// An aspect of the format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Aspect {
    Template,
    SystemPrompt,
    Thinking,
}

/// The aspects on which fewer than [`MIN_TRAIN_SHARE`] of the training examples follow the eval
/// prompts' most common value.
pub fn mismatches(eval: &FormatProfile, train: &FormatProfile) -> Vec<Aspect> {
    if eval.examples == 0 || train.examples == 0 {
        return vec![];
    }
    let mut out = vec![];
    if train.template_share_of(eval.template) < MIN_TRAIN_SHARE {
        out.push(Aspect::Template);
    }
    if train.system_share_of(eval.system_prompt.as_deref()) < MIN_TRAIN_SHARE {
        out.push(Aspect::SystemPrompt);
    }
    if train.thinking_share_of(eval.thinking) < MIN_TRAIN_SHARE {
        out.push(Aspect::Thinking);
    }
    out
}

/// What to change in the eval prompts' system turn to render them in the training format.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SystemChange {
    Keep,
    /// Render with this system message.
    Set(String),
    /// Cut the system turn from the rendered text (a template default included).
    Remove,
}

/// How to render the eval prompts in the training data's format.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rerender {
    pub template: TemplateFamily,
    pub system: SystemChange,
    /// `enable_thinking` for the chat template (`None`: as the eval prompts).
    pub enable_thinking: Option<bool>,
}

/// Whether and how the eval prompts can be rendered in the training format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Nothing differs.
    Matching,
    Render(Rerender),
    /// The formats differ in a way the eval prompts cannot be rendered in (why).
    NotRenderable(String),
}

pub fn plan(eval: &FormatProfile, train: &FormatProfile) -> Plan {
    let m = mismatches(eval, train);
    if m.is_empty() {
        return Plan::Matching;
    }
    if m.contains(&Aspect::Template) {
        return Plan::NotRenderable(format!(
            "the template families differ ({} vs {}): the target's template cannot render the training format",
            eval.template, train.template
        ));
    }
    let system = if !m.contains(&Aspect::SystemPrompt) {
        SystemChange::Keep
    } else if let Some(s) = &train.system_prompt {
        SystemChange::Set(s.clone())
    } else if eval.template.system_turn().is_some() {
        SystemChange::Remove
    } else {
        return Plan::NotRenderable(format!(
            "a {} prompt's system turn cannot be removed",
            eval.template
        ));
    };
    Plan::Render(Rerender {
        template: eval.template,
        system,
        enable_thinking: m.contains(&Aspect::Thinking).then_some(train.thinking),
    })
}

/// The verdict (see the module's invariants); `tau`: replayed DDTree τ under the eval format and
/// under the training format, when measured.
pub fn judge(eval: &FormatProfile, train: &FormatProfile, tau: Option<(f64, f64)>) -> Check {
    let mut evidence = format!(
        "eval prompts: {}; training data: {}",
        eval.describe("prompts"),
        train.describe("examples")
    );
    let m = mismatches(eval, train);
    if m.is_empty() {
        return Check::ok(NAME, evidence);
    }
    match tau {
        Some((e, t)) => {
            evidence += &format!(
                "; replayed DDTree tau {e:.2} under the eval format vs {t:.2} under the training format ({:+.0} %)",
                100.0 * (t / e.max(1e-9) - 1.0)
            )
        }
        None => evidence += "; tau under the training format not measured",
    }
    let mut causes = vec![];
    let mut fixes = vec![];
    for a in &m {
        match a {
            Aspect::Template => {
                causes.push(format!(
                    "eval prompts use the {} template; training data used {} in {} of examples",
                    eval.template,
                    train.template,
                    pct(train.template_share)
                ));
                fixes.push(
                    "regenerate the training data with the target's own chat template (dflash data regen), or render eval prompts as the training data was".to_string(),
                );
            }
            Aspect::SystemPrompt => {
                let used = match &train.system_prompt {
                    Some(s) => format!("used {} in", quote(s)),
                    None => "had no system prompt in".into(),
                };
                let eval_has = match &eval.system_prompt {
                    Some(s) => format!("eval prompts carry the system prompt {}", quote(s)),
                    None => "eval prompts have no system prompt".into(),
                };
                causes.push(format!(
                    "{eval_has}; training data {used} {} of examples",
                    pct(train.system_prompt_share)
                ));
                fixes.push(match (&train.system_prompt, &eval.system_prompt) {
                    (Some(s), None) => format!(
                        "render eval prompts with the system prompt {}, or retrain on data without it",
                        quote(s)
                    ),
                    (Some(s), Some(e)) => format!(
                        "render eval prompts with the system prompt {}, or retrain on data rendered with {}",
                        quote(s),
                        quote(e)
                    ),
                    _ => "render eval prompts without a system prompt (a template default counts), or retrain on data rendered with it".into(),
                });
            }
            Aspect::Thinking => {
                causes.push(format!(
                    "eval prompts have thinking {}; training data has thinking {} in {} of examples",
                    on_off(eval.thinking),
                    on_off(train.thinking),
                    pct(train.thinking_share)
                ));
                fixes.push(format!(
                    "render eval prompts with enable_thinking={}, or retrain on data regenerated with thinking {}",
                    train.thinking,
                    on_off(eval.thinking)
                ));
            }
        }
    }
    Check {
        check: NAME.into(),
        verdict: Verdict::Warn,
        evidence,
        cause: causes.join("; "),
        fix: fixes.join("; "),
    }
}

/// The check without training data: ok, saying nothing was compared.
pub fn no_data(eval: &FormatProfile) -> Check {
    Check::ok(
        NAME,
        format!(
            "no training data given (--data); eval prompts: {}",
            eval.describe("prompts")
        ),
    )
}

#[cfg(test)]
mod tests;
