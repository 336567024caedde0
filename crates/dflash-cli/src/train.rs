//! `dflash train` and `dflash data regen`: drafter training from target-regenerated data.

use crate::exit::UsageError;
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use dflash_decoding::{generate_ar, GenerateConfig, SamplingConfig};
use dflash_models::drafter::config_for_target;
use dflash_models::load_target;
use dflash_text::{ChatMessage, RenderOptions};
use dflash_train::data::{read_dir, shard_path, write_shard, Example};
use dflash_train::{AdamWConfig, TrainConfig, Trainer};
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct TrainArgs {
    #[arg(long)]
    target: Option<PathBuf>,
    /// Directory of shard-*.jsonl written by `dflash data regen`.
    #[arg(long)]
    data: PathBuf,
    /// Run directory (checkpoint/, log.jsonl, validation.json).
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 5)]
    layers: usize,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[arg(long, default_value_t = 512)]
    anchors: usize,
    #[arg(long, default_value_t = 7.0)]
    gamma: f64,
    #[arg(long, default_value_t = 6e-4)]
    lr: f64,
    #[arg(long, default_value_t = 6)]
    epochs: usize,
    #[arg(long, default_value_t = 3072)]
    max_length: usize,
    #[arg(long, default_value_t = 0.04)]
    warmup_ratio: f64,
    #[arg(long, default_value_t = 500)]
    checkpoint_every: usize,
    /// Fraction of examples held out for validation.
    #[arg(long, default_value_t = 0.02)]
    val_fraction: f64,
    #[arg(long, default_value_t = 64)]
    tree_budget: usize,
    #[arg(long)]
    mask_token_id: Option<u32>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Continue from RUN/checkpoint if it exists.
    #[arg(long)]
    resume: bool,
    #[arg(long, default_value = "cpu")]
    device: String,
}

pub fn train(a: TrainArgs) -> Result<()> {
    let device = dflash_core::parse_device(&a.device)?;
    let path = crate::defaults::target_path(a.target.as_deref())?;
    // training computes in f32 (f32 master weights); the frozen target runs in f32 too
    let target = load_target(&path, &device, candle_core::DType::F32)
        .with_context(|| format!("loading target {}", path.display()))?;
    let data = read_dir(&a.data)?;
    let n_val =
        ((data.len() as f64 * a.val_fraction).round() as usize).min(data.len().saturating_sub(1));
    let (val, train) = data.split_at(n_val);
    let mask = a
        .mask_token_id
        .unwrap_or_else(|| crate::draft::default_mask_token(&target));
    let draft_cfg = config_for_target(&target, a.layers, a.block_size, mask);
    let cfg = TrainConfig {
        anchors: a.anchors,
        gamma: a.gamma,
        lr: a.lr,
        epochs: a.epochs,
        max_length: a.max_length,
        warmup_ratio: a.warmup_ratio,
        checkpoint_every: a.checkpoint_every,
        seed: a.seed,
        tree_budget: a.tree_budget,
        adamw: AdamWConfig {
            lr: a.lr,
            ..Default::default()
        },
    };
    let total = train.len() * a.epochs;
    if total == 0 {
        return Err(UsageError("nothing to train on (no examples or --epochs 0)".into()).into());
    }
    let mut trainer = Trainer::open(
        target.model.as_ref(),
        draft_cfg,
        cfg,
        &a.out,
        total,
        a.resume,
    )?;
    let tty = std::io::stderr().is_terminal();
    let start = trainer.state.step;
    eprintln!("[dflash] training {} examples × {} epochs = {total} steps (from step {start}), {} held out", train.len(), a.epochs, val.len());
    let t0 = std::time::Instant::now();
    trainer.run(train, &mut |s, total, loss| {
        if tty || s % 50 == 0 || s == total {
            let rate = (s - start) as f64 / t0.elapsed().as_secs_f64().max(1e-9);
            eprint!(
                "{}step {s}/{total} loss {loss:.4} ({rate:.2} steps/s){}",
                if tty { "\r" } else { "" },
                if tty { "" } else { "\n" }
            );
        }
    })?;
    eprintln!();
    let v = trainer.validate(if val.is_empty() { train } else { val })?;
    let json = serde_json::to_string_pretty(&v)?;
    std::fs::write(a.out.join("validation.json"), &json).context("writing validation.json")?;
    println!("{json}");
    Ok(())
}

#[derive(Subcommand, Debug)]
pub enum DataCommand {
    /// Have the target answer each prompt (chat template, greedy, stop at EOS) and write shards.
    Regen(RegenArgs),
}

#[derive(Args, Debug)]
pub struct RegenArgs {
    #[arg(long)]
    target: Option<PathBuf>,
    /// JSONL: each line {"prompt": ..} or {"question": ..} or {"turns": [..]} or {"messages": [..]}.
    #[arg(long)]
    prompts: PathBuf,
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 1024)]
    max_new_tokens: usize,
    #[arg(long, default_value_t = 256)]
    shard_size: usize,
    /// Use only the first N prompts.
    #[arg(long)]
    limit: Option<usize>,
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long)]
    dtype: Option<String>,
}

fn prompt_messages(v: &serde_json::Value) -> Option<Vec<ChatMessage>> {
    if let Some(m) = v
        .get("messages")
        .and_then(|m| serde_json::from_value::<Vec<ChatMessage>>(m.clone()).ok())
    {
        return Some(m);
    }
    let text = ["prompt", "question", "instruction"]
        .iter()
        .find_map(|k| v.get(*k).and_then(|x| x.as_str()).map(String::from))
        .or_else(|| {
            v.get("turns")
                .and_then(|t| t.get(0))
                .and_then(|x| x.as_str())
                .map(String::from)
        })?;
    Some(vec![ChatMessage::new("user", text)])
}

pub fn data(cmd: DataCommand) -> Result<()> {
    let DataCommand::Regen(a) = cmd;
    let device = dflash_core::parse_device(&a.device)?;
    let dtype = match &a.dtype {
        Some(d) => dflash_core::parse_dtype(d)?,
        None if device.is_cuda() => candle_core::DType::BF16,
        None => candle_core::DType::F32,
    };
    let path = crate::defaults::target_path(a.target.as_deref())?;
    let target = load_target(&path, &device, dtype)
        .with_context(|| format!("loading target {}", path.display()))?;
    let text = target
        .text
        .as_ref()
        .ok_or_else(|| UsageError("target has no tokenizer".into()))?;
    let tpl = text
        .chat_template
        .as_ref()
        .ok_or_else(|| UsageError("target has no chat template".into()))?;
    let raw = std::fs::read_to_string(&a.prompts)
        .with_context(|| format!("reading {}", a.prompts.display()))?;
    let mut prompts = vec![];
    for (i, line) in raw
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| UsageError(format!("{}:{}: {e}", a.prompts.display(), i + 1)))?;
        prompts.push(prompt_messages(&v).ok_or_else(|| {
            UsageError(format!(
                "{}:{}: no prompt/question/turns/messages field",
                a.prompts.display(),
                i + 1
            ))
        })?);
    }
    if let Some(l) = a.limit {
        prompts.truncate(l);
    }
    let mut shard = 0;
    while shard_path(&a.out, shard).is_file() {
        shard += 1;
    }
    let done = (shard * a.shard_size).min(prompts.len());
    eprintln!(
        "[dflash] {} prompts, {done} already done (resuming at shard {shard})",
        prompts.len()
    );
    let cfg = GenerateConfig {
        max_new_tokens: a.max_new_tokens,
        stop_tokens: target.eos_token_ids.clone(),
        sampling: SamplingConfig::greedy(),
    };
    let opts = RenderOptions {
        add_generation_prompt: true,
        enable_thinking: Some(false),
        tools: None,
    };
    let mut buf = vec![];
    for (i, msgs) in prompts.iter().enumerate().skip(done) {
        let rendered = tpl.render(msgs, &opts)?;
        let ids = text.tokenizer.encode(&rendered, false)?;
        let g = generate_ar(target.model.as_ref(), &ids, &cfg, &mut |_| {})?;
        let mut loss_mask = vec![0u8; ids.len()];
        loss_mask.extend(std::iter::repeat_n(1u8, g.tokens.len()));
        let mut tokens = ids;
        tokens.extend(&g.tokens);
        buf.push(Example { tokens, loss_mask });
        if buf.len() == a.shard_size || i + 1 == prompts.len() {
            write_shard(&a.out, shard, &buf)?;
            eprintln!(
                "[dflash] wrote shard {shard} ({} examples, {} of {} prompts)",
                buf.len(),
                i + 1,
                prompts.len()
            );
            shard += 1;
            buf.clear();
        }
    }
    Ok(())
}
