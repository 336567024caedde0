//! `dflash draft init`: a fresh, randomly initialised drafter sized for a target, in z-lab format.

use crate::exit::UsageError;
use anyhow::{Context, Result};
use candle_core::{DType, Device};
use clap::{Args, Subcommand};
use dflash_models::drafter::{config_for_target, init_weights_for_target, save_drafter};
use dflash_models::{load_target, LoadedTarget};
use std::path::PathBuf;

#[derive(Subcommand, Debug)]
pub enum DraftCommand {
    /// Write a random drafter for a target.
    Init(InitArgs),
}

#[derive(Args, Debug)]
pub struct InitArgs {
    /// Target model (HF directory or .gguf); default as for `generate`.
    #[arg(long)]
    target: Option<PathBuf>,
    /// Number of drafter layers.
    #[arg(long, default_value_t = 5)]
    layers: usize,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Embedding row used as the mask token (default: first row past the tokenizer's vocabulary,
    /// else the highest special token that is not a stop or BOS token).
    #[arg(long)]
    mask_token_id: Option<u32>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Shard the safetensors above this many MiB.
    #[arg(long, default_value_t = 16)]
    shard_mib: usize,
}

/// The mask token rule documented on `--mask-token-id`.
pub fn default_mask_token(t: &LoadedTarget) -> u32 {
    let vocab = t.config.vocab_size as u32;
    let Some(text) = &t.text else {
        return vocab - 1;
    };
    let tok_vocab = text.tokenizer.vocab_size() as u32;
    if tok_vocab < vocab {
        return tok_vocab;
    }
    let bos = text
        .bos_token
        .as_deref()
        .and_then(|b| text.tokenizer.token_to_id(b));
    text.tokenizer
        .special_token_ids()
        .into_iter()
        .filter(|id| !t.eos_token_ids.contains(id) && Some(*id) != bos && *id < vocab)
        .max()
        .unwrap_or(vocab - 1)
}

pub fn run(cmd: DraftCommand) -> Result<()> {
    match cmd {
        DraftCommand::Init(a) => init(a),
    }
}

fn init(a: InitArgs) -> Result<()> {
    if a.layers == 0 {
        return Err(UsageError("--layers must be at least 1".into()).into());
    }
    if a.block_size < 2 {
        return Err(UsageError("--block-size must be at least 2".into()).into());
    }
    let path = crate::defaults::target_path(a.target.as_deref())?;
    let target = load_target(&path, &Device::Cpu, DType::F32)
        .with_context(|| format!("loading target {}", path.display()))?;
    let mask = a
        .mask_token_id
        .unwrap_or_else(|| default_mask_token(&target));
    if mask as usize >= target.config.vocab_size {
        return Err(UsageError(format!(
            "--mask-token-id {mask} is outside the target's {} embedding rows",
            target.config.vocab_size
        ))
        .into());
    }
    let cfg = config_for_target(&target, a.layers, a.block_size, mask);
    let weights = init_weights_for_target(&cfg, target.model.as_ref(), a.seed)?;
    save_drafter(&a.out, &cfg, &weights, a.shard_mib << 20)?;
    let params: usize = weights.values().map(|t| t.elem_count()).sum();
    eprintln!(
        "[dflash] wrote {} ({} layers, block {}, taps {:?}, mask token {mask}, {:.1} M parameters)",
        a.out.display(),
        a.layers,
        a.block_size,
        cfg.target_layer_ids(),
        params as f64 / 1e6
    );
    Ok(())
}
