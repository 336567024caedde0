//! `dflash data regen`: the target answers every prompt (chat template, greedy or sampled, stop at
//! EOS), batched, and the conversations are written as training shards.
//!
//! Invariants: shard `k` holds exactly prompts `k·S .. (k+1)·S` (in prompt order; skipped prompts
//! leave no row), so a rerun resumes at the first missing shard and a finished shard is never
//! rewritten; shards are written atomically; the loss mask covers the answer tokens only. With
//! `--part I/N` a process owns the shards `k` with `k mod N = I` only, so N processes (one per GPU)
//! share one `--out`. Several processes on one GPU do not help: CUDA time-slices their contexts
//! (three on an H200 regenerated 0.88× as fast as one, docs/benchmarks.md session 8).

use crate::exit::UsageError;
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use dflash_decoding::{generate_ar_batch, BatchConfig, SamplingConfig};
use dflash_models::load_target;
use dflash_text::{ChatMessage, RenderOptions};
use dflash_train::data::{shard_path, write_shard, Example};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Subcommand, Debug)]
pub enum DataCommand {
    /// Have the target answer each prompt (chat template, stop at EOS) and write shards.
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
    /// Sequences decoded together.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Prompts per shard (the unit of resumption).
    #[arg(long, default_value_t = 1024)]
    shard_size: usize,
    /// Prompts longer than this (in tokens, after the chat template) are skipped.
    #[arg(long, default_value_t = 2048)]
    max_prompt_tokens: usize,
    /// Prompt tokens per prefill forward.
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// Text appended to every user prompt (e.g. a reasoning instruction).
    #[arg(long)]
    suffix: Option<String>,
    /// Use only the first N prompts.
    #[arg(long)]
    limit: Option<usize>,
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long)]
    dtype: Option<String>,
    /// `I/N`: regenerate only the shards k with k mod N = I (N processes share one --out).
    #[arg(long, value_parser = parse_part, default_value = "0/1")]
    part: (usize, usize),
}

fn parse_part(s: &str) -> std::result::Result<(usize, usize), String> {
    let bad = || format!("--part {s}: expected I/N with 0 <= I < N, such as 0/2");
    let (i, n) = s.split_once('/').ok_or_else(bad)?;
    let (i, n): (usize, usize) = (
        i.trim().parse().map_err(|_| bad())?,
        n.trim().parse().map_err(|_| bad())?,
    );
    if n == 0 || i >= n {
        return Err(bad());
    }
    Ok((i, n))
}

fn prompt_messages(v: &serde_json::Value, suffix: Option<&str>) -> Option<Vec<ChatMessage>> {
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
    Some(vec![ChatMessage::new(
        "user",
        format!("{text}{}", suffix.unwrap_or("")),
    )])
}

/// Reads a prompts JSONL file into chat conversations.
pub fn read_prompts(path: &std::path::Path, suffix: Option<&str>) -> Result<Vec<Vec<ChatMessage>>> {
    let raw =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut prompts = vec![];
    for (i, line) in raw
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| UsageError(format!("{}:{}: {e}", path.display(), i + 1)))?;
        prompts.push(prompt_messages(&v, suffix).ok_or_else(|| {
            UsageError(format!(
                "{}:{}: no prompt/question/turns/messages field",
                path.display(),
                i + 1
            ))
        })?);
    }
    Ok(prompts)
}

pub fn run(cmd: DataCommand) -> Result<()> {
    let DataCommand::Regen(a) = cmd;
    if a.batch == 0 || a.shard_size == 0 {
        return Err(UsageError("--batch and --shard-size must be at least 1".into()).into());
    }
    let sampling = SamplingConfig {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
    };
    sampling.validate().map_err(|e| UsageError(e.to_string()))?;
    let (device, dtype) = crate::defaults::device_and_dtype(&a.device, a.dtype.as_deref())?;
    let mut prompts = read_prompts(&a.prompts, a.suffix.as_deref())?;
    if let Some(l) = a.limit {
        prompts.truncate(l);
    }
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
    let opts = RenderOptions {
        add_generation_prompt: true,
        enable_thinking: Some(false),
        tools: None,
    };
    let cfg = BatchConfig {
        max_new_tokens: a.max_new_tokens,
        stop_tokens: target.eos_token_ids.clone(),
        sampling,
        prefill_chunk: a.prefill_chunk,
    };
    let n_shards = prompts.len().div_ceil(a.shard_size);
    let (part, parts) = a.part;
    let todo: Vec<usize> = (0..n_shards)
        .filter(|&k| k % parts == part && !shard_path(&a.out, k).is_file())
        .collect();
    let owned = (0..n_shards).filter(|&k| k % parts == part).count();
    eprintln!(
        "[dflash] {} prompts in {n_shards} shards; part {part}/{parts} owns {owned}, {} already done",
        prompts.len(),
        owned - todo.len()
    );
    let shard_range = |k: usize| {
        (
            k * a.shard_size,
            ((k + 1) * a.shard_size).min(prompts.len()),
        )
    };
    let pb = crate::progress::bar(
        todo.iter()
            .map(|&k| {
                let (lo, hi) = shard_range(k);
                hi - lo
            })
            .sum::<usize>() as u64,
        "prompts",
    );
    let (mut skipped, mut new_tokens) = (0usize, 0usize);
    let t0 = Instant::now();
    for &k in &todo {
        let (lo, hi) = shard_range(k);
        let mut encoded: Vec<(usize, Vec<u32>)> = vec![];
        for (i, msgs) in prompts[lo..hi].iter().enumerate() {
            let ids = text.tokenizer.encode(&tpl.render(msgs, &opts)?, false)?;
            if ids.len() > a.max_prompt_tokens || ids.len() >= target.config.max_position_embeddings
            {
                skipped += 1;
                continue;
            }
            encoded.push((lo + i, ids));
        }
        // longest first: similar lengths share a batch (little padding), the peak comes early
        encoded.sort_by_key(|(i, ids)| (std::cmp::Reverse(ids.len()), *i));
        let mut examples: Vec<(usize, Example)> = Vec::with_capacity(encoded.len());
        for group in encoded.chunks(a.batch) {
            let ps: Vec<Vec<u32>> = group.iter().map(|(_, ids)| ids.clone()).collect();
            let seeds: Vec<u64> = group
                .iter()
                .map(|(i, _)| a.seed.wrapping_add(*i as u64))
                .collect();
            let outs = generate_ar_batch(target.model.as_ref(), &ps, &cfg, &|j| seeds[j])?;
            for ((i, ids), o) in group.iter().zip(outs) {
                new_tokens += o.tokens.len();
                let mut loss_mask = vec![0u8; ids.len()];
                loss_mask.extend(std::iter::repeat_n(1u8, o.tokens.len()));
                let mut tokens = ids.clone();
                tokens.extend(&o.tokens);
                examples.push((*i, Example { tokens, loss_mask }));
            }
            pb.inc(group.len() as u64);
            pb.set_message(format!(
                "{:.0} new tok/s",
                new_tokens as f64 / t0.elapsed().as_secs_f64().max(1e-9)
            ));
        }
        pb.inc((hi - lo - encoded.len()) as u64);
        examples.sort_by_key(|(i, _)| *i);
        let rows: Vec<Example> = examples.into_iter().map(|(_, e)| e).collect();
        write_shard(&a.out, k, &rows)?;
        let line = format!(
            "[dflash] wrote shard {k} ({} examples, prompts {lo}..{hi}), {new_tokens} new tokens in {:.1} s",
            rows.len(),
            t0.elapsed().as_secs_f64()
        );
        if pb.is_hidden() {
            eprintln!("{line}");
        } else {
            pb.println(line);
        }
    }
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "[dflash] regenerated {new_tokens} tokens in {secs:.1} s ({:.0} tok/s); {skipped} prompts skipped (longer than {} tokens)",
        new_tokens as f64 / secs.max(1e-9),
        a.max_prompt_tokens
    );
    Ok(())
}
