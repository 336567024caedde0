//! `dflash train` and `dflash plot`: drafter training from target-regenerated data. What the run
//! records for `dflash diagnose --run`, and the diagnosis after its validation, are
//! crate::train_record's.

use crate::exit::UsageError;
use anyhow::{Context, Result};
use clap::Args;
use dflash_models::drafter::config_for_target;
use dflash_models::load_target;
use dflash_train::data::{read_dir, split_held_out};
use dflash_train::{plan_steps, AdamWConfig, TrainConfig, Trainer};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct TrainArgs {
    #[arg(long)]
    target: Option<PathBuf>,
    /// Directory of shard-*.jsonl written by `dflash data regen`.
    #[arg(long)]
    data: PathBuf,
    /// Run directory (checkpoint/, log.jsonl, curves.png, validation.json).
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 5)]
    layers: usize,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Anchors (blocks) sampled per sequence.
    #[arg(long, default_value_t = 512)]
    anchors: usize,
    /// Tokens per optimizer step (whole sequences are packed; 0 = one sequence per step).
    #[arg(long, default_value_t = 0)]
    batch_tokens: usize,
    /// Padded tokens per batched forward inside a step: the memory cap (activations grow with it
    /// times the anchors per sequence; with --anchors 128, 16384 ran out of an H200's memory and
    /// 4096 fit). 0 = --batch-tokens.
    #[arg(long, default_value_t = 4096)]
    micro_batch_tokens: usize,
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
    /// Share of prompts held out for validation (chosen by a hash of the prompt, so the same
    /// prompts in every run and data set).
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
    /// Compute dtype of the drafter and the frozen target (masters and optimizer stay f32).
    /// Default: bf16 on CUDA, f32 on CPU.
    #[arg(long)]
    dtype: Option<String>,
    /// Device peak FLOP/s in TFLOP/s, for the drafter MFU in the log (default: 989 on CUDA,
    /// the H200's dense bf16 peak; 0 on CPU = not reported).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Dtype of the exported drafter in RUN/drafter (the checkpoint keeps f32 masters).
    #[arg(long, default_value = "bf16")]
    export_dtype: String,
    /// Stop after this many steps of the plan (the LR schedule then spans these steps).
    #[arg(long)]
    max_steps: Option<usize>,
    /// Stop after this many seconds of training (checkpointed; continue with --resume).
    #[arg(long)]
    time_limit: Option<f64>,
    /// Starting weights of a new run: `random` (N(0, 0.02²), the target's final norm),
    /// `target-layers` (the target's top layers — a hybrid's top full-attention layers — fc =
    /// the deepest tap), or a drafter directory
    /// (a warm start: its weights, with a fresh optimizer and schedule).
    #[arg(long, default_value = "random")]
    init: String,
    /// Log the seconds of each phase of every step (synchronises the device between phases).
    #[arg(long)]
    profile: bool,
    /// Self-distillation: the share α of the target's own next-token distribution in each block
    /// row's loss, `(1 − α)·CE(label) + α·H(p_target, q)` (0 = labels only, as the paper).
    #[arg(long, default_value_t = 0.0)]
    distill: f64,
    /// Validation prompts the end-of-run diagnosis decodes with the exported drafter (training
    /// vs evaluation, target integrity; RUN/diagnosis.json); 0 skips it.
    #[arg(long, default_value_t = 2)]
    diagnose_prompts: usize,
    /// Train with every block slot's position moved by this much (slot `j` at `anchor + j + N`),
    /// declared in the drafter's config (`dflash_config.block_position_offset`), so that its
    /// validation and decoding use the same layout; 0 is the z-lab layout, the only one z-lab's
    /// code runs. For reproducing drafters trained elsewhere and testing `dflash diagnose`.
    #[arg(long, default_value_t = 0, hide = true, allow_hyphen_values = true)]
    block_position_offset: i64,
    /// Train with the target's final RMSNorm on the last tap, declared in the drafter's config
    /// (`dflash_config.final_norm_on_last_tap`) so that its validation and decoding feed it the
    /// same; off is the z-lab convention (raw layer outputs), the only one z-lab's code runs.
    /// For reproducing drafters trained elsewhere and testing `dflash diagnose`.
    #[arg(long, hide = true)]
    final_norm_on_last_tap: bool,
}

pub fn train(a: TrainArgs) -> Result<()> {
    if !(0.0..=1.0).contains(&a.distill) {
        return Err(UsageError(format!("--distill {} must be in [0, 1]", a.distill)).into());
    }
    let (device, dtype) = crate::defaults::device_and_dtype(&a.device, a.dtype.as_deref())?;
    let path = crate::defaults::target_path(a.target.as_deref())?;
    let target = load_target(&path, &device, dtype)
        .with_context(|| format!("loading target {}", path.display()))?;
    if !(0.0..=1.0).contains(&a.val_fraction) {
        return Err(UsageError(format!(
            "--val-fraction {} must be in [0, 1]",
            a.val_fraction
        ))
        .into());
    }
    // held out by a hash of each prompt: the same prompts in every run (see split_held_out)
    let (val, train) = split_held_out(read_dir(&a.data)?, a.val_fraction);
    let (val, train) = (&val[..], &train[..]);
    let mask = a
        .mask_token_id
        .unwrap_or_else(|| crate::draft::default_mask_token(&target));
    let mut draft_cfg = config_for_target(&target, a.layers, a.block_size, mask);
    draft_cfg.set_block_convention(dflash_models::drafter::BlockConvention {
        position_offset: a.block_position_offset,
        anchor_slot_masked: false,
    });
    draft_cfg.set_final_norm_on_last_tap(a.final_norm_on_last_tap);
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
        batch_tokens: a.batch_tokens,
        micro_batch_tokens: a.micro_batch_tokens,
        distill: a.distill,
    };
    let lengths: Vec<usize> = train.iter().map(|e| e.tokens.len()).collect();
    let mut plan = plan_steps(&lengths, &cfg);
    if let Some(m) = a.max_steps {
        plan.truncate(m.max(1));
    }
    let export_dtype = dflash_core::parse_dtype(&a.export_dtype)?;
    let total = plan.len();
    if total == 0 {
        return Err(UsageError("nothing to train on (no examples or --epochs 0)".into()).into());
    }
    let resuming = a.resume && a.out.join("checkpoint").join("state.json").is_file();
    let initial = match a.init.as_str() {
        _ if resuming => None,
        "random" => None,
        "target-layers" => Some(
            dflash_models::drafter::init_from_target_layers(
                &draft_cfg,
                &dflash_models::target_tensors(&path)?,
                cfg.seed,
            )
            .map_err(|e| UsageError(format!("--init target-layers: {e}")))?,
        ),
        dir => {
            let dir = std::path::Path::new(dir);
            if !dir.is_dir() {
                return Err(UsageError(format!(
                    "--init {}: not random, target-layers or a drafter directory",
                    dir.display()
                ))
                .into());
            }
            Some(
                dflash_models::drafter::warm_start_weights(dir, &draft_cfg)
                    .map_err(|e| UsageError(format!("--init: {e}")))?,
            )
        }
    };
    let mut trainer = Trainer::open(
        target.model.as_ref(),
        draft_cfg,
        cfg,
        &a.out,
        total,
        a.resume,
        dtype,
        initial,
    )?;
    // what `dflash diagnose --run` needs, recorded before the first step
    let manifest = crate::train_record::record(
        &a.out,
        &crate::train_record::RecordInputs {
            target: &target,
            target_path: &path,
            draft_cfg: &trainer.draft_cfg,
            cfg: &trainer.cfg,
            data_dir: &a.data,
            val_fraction: a.val_fraction,
            init: if resuming { "resumed" } else { a.init.as_str() },
            export_dtype,
            val,
            train,
        },
    )
    .context("recording the diagnosis inputs")?;
    trainer.profile = a.profile;
    trainer.peak_flops = 1e12
        * a.peak_tflops
            .unwrap_or(if device.is_cuda() { 989.0 } else { 0.0 });
    trainer.time_limit = a.time_limit.map(std::time::Duration::from_secs_f64);
    if device.is_cuda() {
        // TF32 for the f32 GEMMs of training (the f32 LM head over the vocabulary)
        candle_core::cuda::set_gemm_reduced_precision_f32(true);
    }
    let start = trainer.state.step;
    eprintln!(
        "[dflash] training on {} examples × {} epochs = {total} steps (from step {start}), {} held out, {dtype:?} compute, init {}",
        train.len(),
        a.epochs,
        val.len(),
        if resuming { "from the checkpoint" } else { a.init.as_str() }
    );
    let pb = crate::progress::bar(total as u64, "steps");
    pb.set_position(start as u64);
    let quiet = pb.is_hidden();
    let finished = trainer.run(train, &plan, &mut |l| {
        pb.set_position(l.step as u64);
        pb.set_message(format!(
            "loss {:.3} acc1 {:.2} streak {:.2} {:.0} tok/s mfu {:.1}%",
            l.loss,
            l.accuracy.first().copied().unwrap_or(0.0),
            l.streak,
            l.tokens_per_second,
            100.0 * l.drafter_mfu
        ));
        if quiet && (l.step % 50 == 0 || l.step == l.total_steps) {
            eprintln!(
                "step {}/{} loss {:.4} streak {:.2} lr {:.2e} {:.0} tok/s mfu {:.1}%",
                l.step,
                l.total_steps,
                l.loss,
                l.streak,
                l.lr,
                l.tokens_per_second,
                100.0 * l.drafter_mfu
            );
        }
    })?;
    pb.finish_and_clear();
    trainer.export(&a.out.join("drafter"), export_dtype)?;
    // so a diagnosis of the exported drafter alone compares against the training-time taps
    dflash_diagnose::stats::write_tap_stats(&a.out.join("drafter"), &manifest.tap_stats)?;
    eprintln!(
        "[dflash] drafter written to {}",
        a.out.join("drafter").display()
    );
    if !finished {
        eprintln!(
            "[dflash] time limit reached at step {}/{total}; checkpoint written, continue with --resume",
            trainer.state.step
        );
        return Ok(());
    }
    let v = trainer.validate(if val.is_empty() { train } else { val })?;
    let json = serde_json::to_string_pretty(&v)?;
    crate::defaults::write_atomic(&a.out.join("validation.json"), json.as_bytes())?;
    println!("{json}");
    if a.diagnose_prompts > 0 {
        crate::train_record::diagnose_after_validation(
            &target,
            &path,
            &a.out,
            &manifest,
            &v,
            a.diagnose_prompts,
            &device,
            dtype,
        )
        .context("diagnosing the exported drafter after validation")?;
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct PlotArgs {
    /// A run directory (its log.jsonl) or a log.jsonl file.
    run: PathBuf,
    /// Where to write the PNG (default: curves.png beside the log).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// `dflash plot RUN`: the training curves of a run as a PNG.
pub fn plot(a: PlotArgs) -> Result<()> {
    let log = if a.run.is_dir() {
        a.run.join("log.jsonl")
    } else {
        a.run.clone()
    };
    if !log.is_file() {
        return Err(UsageError(format!("no training log at {}", log.display())).into());
    }
    let out = a.out.unwrap_or_else(|| log.with_file_name("curves.png"));
    let title = format!("DFlash drafter training ({})", log.display());
    dflash_train::write_curves(&log, &out, &title)?;
    eprintln!("[dflash] curves written to {}", out.display());
    Ok(())
}
