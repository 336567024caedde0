//! The loaded decoding engine `generate` and `serve` share: a target, the drafter when the mode
//! wants one, and the one function that decodes a prompt in the chosen mode (auto mode's
//! remembered verdicts included), so both commands decode identically.
//!
//! Invariants: `--mode auto` without a drafter found decodes with AR (an explicit `--draft` must
//! load); every speculative mode is lossless against `--mode ar` (the decoding crate's loops).

use crate::auto_memory;
use crate::exit::UsageError;
use anyhow::{Context, Result};
use candle_core::DType;
use clap::{Args, ValueEnum};
use dflash_decoding::{
    generate_ar, generate_ar_with_margins, generate_auto_remembered, generate_speculative,
    AutoRecord, DFlashRunner, GenerateConfig, Generation, SpecMode,
};
use dflash_models::{load_drafter, load_target, DFlashDrafter, LoadedTarget};
use dflash_text::{ChatMessage, RenderOptions};
use serde::Serialize;
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

/// The model and decoding flags `generate` and `serve` share.
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// Target model: an HF directory (config.json, safetensors, tokenizer.json) or a .gguf file.
    /// Default: $DFLASH_TARGET, else SmolLM2-135M-Instruct as fetched by scripts/fetch-smollm2.sh.
    #[arg(long)]
    pub target: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Mode::Auto)]
    pub mode: Mode,
    /// Drafter directory (z-lab DFlash format), for --mode dflash / ddtree (default: the drafter
    /// shipped for the target, e.g. drafters/smollm2-135m-instruct for SmolLM2).
    #[arg(long)]
    pub draft: Option<PathBuf>,
    /// Block size at inference (default: the drafter's).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// DDTree node budget (the same default as `dflash eval`).
    #[arg(long, default_value_t = dflash_decoding::tree::DEFAULT_TREE_BUDGET)]
    pub tree_budget: usize,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// f32, bf16 or f16 (default: f32 on CPU, bf16 on CUDA).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Bit-exact: every projection (and on the CPU attention too) on row-invariant kernels, so a
    /// verified row computes exactly what the one-token AR step computes and speculative output
    /// equals AR's token for token in bf16 too (SmolLM2 on the H200: 80 of 80 generations, DDTree
    /// ~20 % slower; on the CPU decode steps are row-invariant by default, this adds prefills).
    #[arg(long)]
    pub bit_exact: bool,
}

/// A target (and drafter) loaded for decoding.
pub struct Engine {
    pub target: LoadedTarget,
    pub target_path: PathBuf,
    pub drafter: Option<DFlashDrafter>,
    drafter_dir: Option<PathBuf>,
    pub args: EngineArgs,
    pub dtype: DType,
}

impl Engine {
    /// Loads what `args` name.
    pub fn load(args: &EngineArgs) -> Result<Self> {
        if args.tree_budget == 0 {
            return Err(UsageError("--tree-budget must be at least 1".into()).into());
        }
        let (device, dtype) =
            crate::defaults::device_and_dtype(&args.device, args.dtype.as_deref())?;
        crate::defaults::apply_bit_exact(args.bit_exact, &device)?;
        let target_path = crate::defaults::target_path(args.target.as_deref())?;
        let target = load_target(&target_path, &device, dtype)
            .with_context(|| format!("loading target {}", target_path.display()))?;
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
        Ok(Self {
            target,
            target_path,
            drafter,
            drafter_dir,
            args: args.clone(),
            dtype,
        })
    }

    /// The target's tokenizer and chat template, or a usage error naming the model.
    pub fn text(&self) -> Result<&dflash_text::TextAssets> {
        self.target.text.as_ref().ok_or_else(|| {
            UsageError(format!(
                "{}: no tokenizer (tokenizer.json) next to the model",
                self.target_path.display()
            ))
            .into()
        })
    }

    /// Whether the model has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.target
            .text
            .as_ref()
            .is_some_and(|t| t.chat_template.is_some())
    }

    /// `messages` rendered with the model's chat template (generation prompt added), as ids.
    pub fn chat_prompt(&self, messages: &[ChatMessage], enable_thinking: bool) -> Result<Vec<u32>> {
        let text = self.text()?;
        let tpl = text.chat_template.as_ref().ok_or_else(|| {
            UsageError(format!(
                "{}: a chat asked for, but the model has no chat template",
                self.target_path.display()
            ))
        })?;
        let opts = RenderOptions {
            add_generation_prompt: true,
            enable_thinking: Some(enable_thinking),
            tools: None,
        };
        Ok(text
            .tokenizer
            .encode(&tpl.render(messages, &opts)?, false)?)
    }

    /// Raw text as ids, with the BOS token the tokenizer config asks for.
    pub fn raw_prompt(&self, raw: &str) -> Result<Vec<u32>> {
        let text = self.text()?;
        let mut prompt = text.tokenizer.encode(raw, false)?;
        if text.add_bos {
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
        Ok(prompt)
    }

    /// The dtype's name (`f32`, `bf16`, …).
    pub fn dtype_name(&self) -> String {
        format!("{:?}", self.dtype).to_lowercase()
    }

    /// The drafter's block size (1 without a drafter).
    pub fn block_size(&self) -> usize {
        self.drafter.as_ref().map(|d| d.block_size()).unwrap_or(1)
    }

    /// Decodes `prompt` in the loaded mode; `with_margins` (AR only) records each token's
    /// top-1 − top-2 logit margin.
    pub fn decode(
        &self,
        prompt: &[u32],
        cfg: &GenerateConfig,
        with_margins: bool,
        on_token: &mut dyn FnMut(u32),
    ) -> Result<Generation> {
        let target = self.target.model.as_ref();
        let (d, mode) = match (&self.drafter, self.args.mode) {
            (Some(d), mode) => (d, mode),
            (None, _) if with_margins => {
                return Ok(generate_ar_with_margins(target, prompt, cfg, on_token)?)
            }
            (None, _) => return Ok(generate_ar(target, prompt, cfg, on_token)?),
        };
        let spec_mode = match mode {
            Mode::Dflash => SpecMode::DFlash,
            _ => SpecMode::DdTree {
                budget: self.args.tree_budget,
            },
        };
        let mut runner = DFlashRunner::new(d);
        if mode != Mode::Auto {
            return Ok(generate_speculative(
                target,
                &mut runner,
                prompt,
                cfg,
                spec_mode,
                on_token,
            )?);
        }
        let key = auto_memory::RunKey {
            device: self.args.device.clone(),
            dtype: self.dtype_name(),
            bit_exact: self.args.bit_exact,
            target: self.target_path.clone(),
            drafter: self.drafter_dir.clone().unwrap_or_default(),
            mode: format!("ddtree:{}", self.args.tree_budget),
            block_size: d.block_size(),
            sampled: cfg.sampling.temperature > 0.0,
        };
        let memory = auto_memory::memory_path();
        let record = memory.as_deref().and_then(|p| auto_memory::recall(p, &key));
        let generation = generate_auto_remembered(
            target,
            &mut runner,
            prompt,
            cfg,
            spec_mode,
            record.as_ref(),
            on_token,
        )?;
        let measured = generation.spec.as_ref().and_then(|s| s.auto.as_ref());
        if let (Some(path), Some(r)) = (&memory, measured.and_then(AutoRecord::from_choice)) {
            // a cache: a run whose answer is out must not fail for want of a writable home
            if let Err(e) = auto_memory::remember(path, &key, r) {
                eprintln!("[dflash] warning: auto-mode memory not saved: {e:#}");
            }
        }
        Ok(generation)
    }
}
