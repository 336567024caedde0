//! `dflash generate`: one prompt, one answer, streamed (or one JSON object with `--json`).

use crate::auto_memory;
use crate::exit::UsageError;
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use dflash_decoding::{
    generate_ar, generate_ar_with_margins, generate_auto_remembered, generate_speculative,
    AutoRecord, DFlashRunner, GenerateConfig, SamplingConfig, SpecMode,
};
use dflash_models::{load_drafter, load_target};
use dflash_text::{ChatMessage, RenderOptions, StreamDecoder};
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, ValueEnum, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// DDTree while it is faster than AR on this device (measured as it runs), else AR; AR from
    /// the start when an earlier run here found DDTree at under half AR's rate (remembered in
    /// ~/.cache/dflash/auto-mode.json; DFLASH_AUTO_MEMORY=off or another file); AR when no
    /// drafter is given or ships for the target. The default.
    Auto,
    /// The target alone: the reference output.
    Ar,
    /// Single-path DFlash speculative decoding.
    Dflash,
    /// DDTree: verify the best tree of drafted prefixes.
    Ddtree,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Target model: an HF directory (config.json, safetensors, tokenizer.json) or a .gguf file.
    /// Default: $DFLASH_TARGET, else SmolLM2-135M-Instruct as fetched by scripts/fetch-smollm2.sh.
    #[arg(long)]
    target: Option<PathBuf>,
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
    #[arg(long, value_enum, default_value_t = Mode::Auto)]
    mode: Mode,
    /// Drafter directory (z-lab DFlash format), for --mode dflash / ddtree (default: the drafter
    /// shipped for the target, e.g. drafters/smollm2-135m-instruct for SmolLM2).
    #[arg(long)]
    draft: Option<PathBuf>,
    /// Block size at inference (default: the drafter's).
    #[arg(long)]
    block_size: Option<usize>,
    /// DDTree node budget (the same default as `dflash eval`).
    #[arg(long, default_value_t = dflash_decoding::tree::DEFAULT_TREE_BUDGET)]
    tree_budget: usize,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32, bf16 or f16 (default: f32 on CPU, bf16 on CUDA).
    #[arg(long)]
    dtype: Option<String>,
    /// Bit-exact: every projection (and on the CPU attention too) on row-invariant kernels, so a
    /// verified row computes exactly what the one-token AR step computes and speculative output
    /// equals AR's token for token in bf16 too (SmolLM2 on the H200: 80 of 80 generations, DDTree
    /// ~20 % slower; on the CPU decode steps are row-invariant by default, this adds prefills).
    #[arg(long)]
    bit_exact: bool,
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
    let (device, dtype) = crate::defaults::device_and_dtype(&args.device, args.dtype.as_deref())?;
    crate::defaults::apply_bit_exact(args.bit_exact, &device)?;
    let target_path = crate::defaults::target_path(args.target.as_deref())?;
    let target = load_target(&target_path, &device, dtype)
        .with_context(|| format!("loading target {}", target_path.display()))?;
    let text = target.text.as_ref().ok_or_else(|| {
        UsageError(format!(
            "{}: no tokenizer (tokenizer.json) next to the model",
            target_path.display()
        ))
    })?;
    let use_chat = !args.raw && (args.chat || text.chat_template.is_some());
    let prompt_text = if use_chat {
        let tpl = text.chat_template.as_ref().ok_or_else(|| {
            UsageError(format!(
                "{}: --chat asked for, but the model has no chat template",
                target_path.display()
            ))
        })?;
        let mut msgs = vec![];
        if let Some(s) = &args.system {
            msgs.push(ChatMessage::new("system", s.clone()));
        }
        msgs.push(ChatMessage::new("user", args.prompt.clone()));
        let opts = RenderOptions {
            add_generation_prompt: true,
            enable_thinking: Some(args.enable_thinking),
            tools: None,
        };
        tpl.render(&msgs, &opts)?
    } else {
        args.prompt.clone()
    };
    let mut prompt = text.tokenizer.encode(&prompt_text, false)?;
    if text.add_bos && !use_chat {
        if let Some(bos) = text
            .bos_token
            .as_deref()
            .and_then(|b| text.tokenizer.token_to_id(b))
        {
            if prompt.first() != Some(&bos) {
                prompt.insert(0, bos);
            }
        }
    }
    let cfg = GenerateConfig {
        cancel: None,
        max_new_tokens: args.max_new_tokens,
        stop_tokens: target.eos_token_ids.clone(),
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
    let mut drafter_dir = None;
    let drafter = match args.mode {
        Mode::Ar => None,
        Mode::Dflash | Mode::Ddtree | Mode::Auto => {
            // auto without a drafter decodes with AR; an explicit --draft must load
            let found = crate::defaults::drafter_path(args.draft.as_deref(), &target_path);
            match found {
                Err(_) if args.mode == Mode::Auto => None,
                found => {
                    let dir = &found?;
                    let mut d = load_drafter(dir, &device, dtype)
                        .with_context(|| format!("loading drafter {}", dir.display()))?;
                    d.bind_target(target.model.as_ref())?;
                    if let Some(b) = args.block_size {
                        d.set_block_size(b)?;
                    }
                    drafter_dir = Some(dir.clone());
                    Some(d)
                }
            }
        }
    };
    if args.tree_budget == 0 {
        return Err(UsageError("--tree-budget must be at least 1".into()).into());
    }
    let generation = match (&drafter, args.mode) {
        (Some(d), mode) => {
            let spec_mode = match mode {
                Mode::Dflash => SpecMode::DFlash,
                _ => SpecMode::DdTree {
                    budget: args.tree_budget,
                },
            };
            let mut runner = DFlashRunner::new(d);
            if mode == Mode::Auto {
                let key = auto_memory::RunKey {
                    device: args.device.clone(),
                    dtype: format!("{dtype:?}").to_lowercase(),
                    bit_exact: args.bit_exact,
                    target: target_path.clone(),
                    drafter: drafter_dir.clone().unwrap_or_default(),
                    mode: format!("ddtree:{}", args.tree_budget),
                    block_size: d.block_size(),
                    sampled: args.temperature > 0.0,
                };
                let memory = auto_memory::memory_path();
                let record = memory.as_deref().and_then(|p| auto_memory::recall(p, &key));
                let generation = generate_auto_remembered(
                    target.model.as_ref(),
                    &mut runner,
                    &prompt,
                    &cfg,
                    spec_mode,
                    record.as_ref(),
                    &mut on_token,
                )?;
                let measured = generation.spec.as_ref().and_then(|s| s.auto.as_ref());
                if let (Some(path), Some(r)) = (&memory, measured.and_then(AutoRecord::from_choice))
                {
                    // a cache: a run whose answer is out must not fail for want of a writable home
                    if let Err(e) = auto_memory::remember(path, &key, r) {
                        eprintln!("[dflash] warning: auto-mode memory not saved: {e:#}");
                    }
                }
                generation
            } else {
                generate_speculative(
                    target.model.as_ref(),
                    &mut runner,
                    &prompt,
                    &cfg,
                    spec_mode,
                    &mut on_token,
                )?
            }
        }
        (None, _) if args.ids => {
            generate_ar_with_margins(target.model.as_ref(), &prompt, &cfg, &mut on_token)?
        }
        (None, _) => generate_ar(target.model.as_ref(), &prompt, &cfg, &mut on_token)?,
    };
    let spec = generation.spec.clone();
    // steps that drafted and verified (auto mode may have decoded the rest, or all, with AR)
    let spec_steps = spec.as_ref().map_or(0, |s| s.acceptance.len());
    let block = drafter.as_ref().map(|d| d.block_size()).unwrap_or(1);
    let text_out = text.tokenizer.decode(&generation.tokens, true)?;
    let n = generation.tokens.len();
    let report = Report {
        text: text_out,
        prompt_tokens: generation.prompt_tokens,
        output_tokens: n,
        mode: args.mode,
        prefill_seconds: generation.prefill_seconds,
        decode_seconds: generation.decode_seconds,
        tokens_per_second: if generation.decode_seconds > 0.0 {
            n.saturating_sub(1) as f64 / generation.decode_seconds
        } else {
            0.0
        },
        steps: generation.steps,
        stop_reason: generation.stop_reason,
        device: args.device.clone(),
        dtype: format!("{dtype:?}").to_lowercase(),
        output_ids: args.ids.then(|| generation.tokens.clone()),
        logit_margins: (args.ids && args.mode == Mode::Ar).then(|| generation.margins.clone()),
        tree_budget: (drafter.is_some()
            && matches!(args.mode, Mode::Ddtree | Mode::Auto)
            && spec_steps > 0)
            .then_some(args.tree_budget),
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
