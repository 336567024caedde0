//! `dflash generate`: one prompt, one answer, streamed (or one JSON object with `--json`).

use crate::auto_memory;
pub use crate::engine::Mode;
use crate::engine::{Engine, EngineArgs};
use crate::exit::UsageError;
use anyhow::Result;
use clap::Args;
use dflash_decoding::{GenerateConfig, SamplingConfig};
use dflash_text::{ChatMessage, StreamDecoder};
use serde::Serialize;
use std::io::Write;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// The prompt (a user message with --chat, raw text with --raw).
    #[arg(long)]
    prompt: String,
    /// Render the prompt with the model's chat template (default when the model has one).
    #[arg(long, conflicts_with = "raw")]
    chat: bool,
    /// Feed the prompt as raw text, no chat template.
    #[arg(long)]
    raw: bool,
    /// System message for --chat (otherwise the template's default).
    #[arg(long)]
    system: Option<String>,
    /// Chat templates that support it (Qwen3): turn thinking on.
    #[arg(long)]
    enable_thinking: bool,
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// 0 = no top-k filter.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
    /// With --json: include the output token ids (and, for --mode ar, each token's top-1 − top-2
    /// logit margin, to diagnose near-tie flips between modes).
    #[arg(long)]
    ids: bool,
}

#[derive(Serialize)]
struct Report {
    text: String,
    prompt_tokens: usize,
    output_tokens: usize,
    mode: Mode,
    prefill_seconds: f64,
    decode_seconds: f64,
    tokens_per_second: f64,
    steps: usize,
    stop_reason: dflash_decoding::StopReason,
    #[serde(skip_serializing_if = "Option::is_none")]
    output_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    logit_margins: Option<Vec<f32>>,
    /// DDTree's node budget (`--mode ddtree`, or auto with a drafter).
    #[serde(skip_serializing_if = "Option::is_none")]
    tree_budget: Option<usize>,
    /// Auto mode: the AR step it measured, the speculative rate, and whether it switched to AR.
    #[serde(skip_serializing_if = "Option::is_none")]
    auto: Option<dflash_decoding::AutoChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    acceptance_length_mean: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    acceptance_histogram: Option<Vec<usize>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    verify_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tree_build_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_prefill_seconds: Option<f64>,
    device: String,
    dtype: String,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    if args.max_new_tokens == 0 {
        return Err(UsageError("--max-new-tokens must be at least 1".into()).into());
    }
    let engine = Engine::load(&args.engine)?;
    let text = engine.text()?;
    let use_chat = !args.raw && (args.chat || engine.has_chat_template());
    let prompt = if use_chat {
        let mut msgs = vec![];
        if let Some(s) = &args.system {
            msgs.push(ChatMessage::new("system", s.clone()));
        }
        msgs.push(ChatMessage::new("user", args.prompt.clone()));
        engine.chat_prompt(&msgs, args.enable_thinking)?
    } else {
        engine.raw_prompt(&args.prompt)?
    };
    let cfg = GenerateConfig {
        cancel: None,
        max_new_tokens: args.max_new_tokens,
        stop_tokens: engine.target.eos_token_ids.clone(),
        sampling: SamplingConfig {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            seed: args.seed,
        },
    };
    let mut stream = StreamDecoder::new(&text.tokenizer, true);
    let mut stdout = std::io::stdout();
    let mut on_token = |id: u32| {
        if !args.json {
            if let Ok(Some(piece)) = stream.push(id) {
                let _ = stdout.write_all(piece.as_bytes());
                let _ = stdout.flush();
            }
        }
    };
    let generation = engine.decode(&prompt, &cfg, args.ids, &mut on_token)?;
    let drafter = &engine.drafter;
    let mode = args.engine.mode;
    let spec = generation.spec.clone();
    // steps that drafted and verified (auto mode may have decoded the rest, or all, with AR)
    let spec_steps = spec.as_ref().map_or(0, |s| s.acceptance.len());
    let block = engine.block_size();
    let text_out = text.tokenizer.decode(&generation.tokens, true)?;
    let n = generation.tokens.len();
    let report = Report {
        text: text_out,
        prompt_tokens: generation.prompt_tokens,
        output_tokens: n,
        mode,
        prefill_seconds: generation.prefill_seconds,
        decode_seconds: generation.decode_seconds,
        tokens_per_second: if generation.decode_seconds > 0.0 {
            n.saturating_sub(1) as f64 / generation.decode_seconds
        } else {
            0.0
        },
        steps: generation.steps,
        stop_reason: generation.stop_reason,
        device: args.engine.device.clone(),
        dtype: engine.dtype_name(),
        output_ids: args.ids.then(|| generation.tokens.clone()),
        logit_margins: (args.ids && mode == Mode::Ar).then(|| generation.margins.clone()),
        tree_budget: (drafter.is_some()
            && matches!(mode, Mode::Ddtree | Mode::Auto)
            && spec_steps > 0)
            .then_some(args.engine.tree_budget),
        auto: spec.as_ref().and_then(|s| s.auto.clone()),
        acceptance_length_mean: spec
            .as_ref()
            .filter(|_| spec_steps > 0)
            .map(|s| s.mean_acceptance()),
        acceptance_histogram: spec.as_ref().map(|s| s.histogram(block)),
        draft_seconds: spec.as_ref().map(|s| s.draft_seconds),
        verify_seconds: spec.as_ref().map(|s| s.verify_seconds),
        tree_build_seconds: spec.as_ref().map(|s| s.tree_build_seconds),
        draft_prefill_seconds: spec.as_ref().map(|s| s.draft_prefill_seconds),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        if let Ok(Some(rest)) = stream.finish() {
            print!("{rest}");
        }
        println!();
        let _ = std::io::stdout().flush();
        let nodes = report
            .tree_budget
            .map(|b| format!(" ({b} nodes)"))
            .unwrap_or_default();
        let tau = report
            .acceptance_length_mean
            .map(|t| format!(", tau {t:.2} over {spec_steps} speculative steps"))
            .unwrap_or_default();
        let mode = match (&report.auto, report.mode) {
            (_, Mode::Auto) if drafter.is_none() => "auto -> ar (no drafter)".to_string(),
            (Some(a), _) => match a.switched_to_ar_at_step {
                Some(0) => format!(
                    "auto -> ar (an earlier run here: speculative {:.1} tok/s < AR step {:.1} tok/s; remembered in {}, delete it to measure again)",
                    a.spec_tokens_per_second,
                    a.ar_tokens_per_second,
                    auto_memory::memory_path().unwrap_or_default().display()
                ),
                Some(k) => format!(
                    "auto -> ddtree, then ar after step {k} (speculative {:.1} tok/s < AR step {:.1} tok/s)",
                    a.spec_tokens_per_second, a.ar_tokens_per_second
                ),
                None if a.spec_tokens_per_second == 0.0 => "auto -> ddtree".to_string(),
                None => format!(
                    "auto -> ddtree (speculative {:.1} tok/s, AR step {:.1} tok/s)",
                    a.spec_tokens_per_second, a.ar_tokens_per_second
                ),
            },
            (None, m) => format!("{m:?}").to_lowercase(),
        };
        eprintln!(
            "[dflash] mode {mode}{nodes}: {} prompt + {} new tokens, prefill {:.3}s, decode {:.3}s ({:.1} tok/s){tau}, stop: {:?}",
            report.prompt_tokens, n, report.prefill_seconds, report.decode_seconds, report.tokens_per_second, report.stop_reason
        );
    }
    Ok(())
}
