//! `dflash bench decode`: the parts of one decoding step at a real model's shapes, with random
//! weights made on the device: the AR step (greedy and sampled), the verify forward of a block
//! and of DDTree trees, one drafter block, the tree build, and the memory-bandwidth floor of an
//! AR step (bytes it must read ÷ copy bandwidth measured in the same run). JSON on stdout (and
//! `--out`), a table on stderr.
//!
//! Invariants:
//! - Every op is the code the decoding loops run (`TargetModel::forward` with the requests
//!   `ar.rs` and `spec.rs` make, `DFlashDrafter::draft`, `greedy_rows`, `Sampler::sample_rows`,
//!   `tree_from_draft_logits`, the cache's `crop` / `keep_rows`), never a re-implementation.
//! - Before every run of an op the target cache holds exactly `--context` positions and the
//!   drafter cache `context − 4`; each op restores that state (a crop, inside its timed region),
//!   so every round sees the same context.
//! - Times are wall-clock between device synchronisations, after `--warmup` untimed runs; the
//!   median of `--rounds` runs is the headline, min and p90 beside it.
//! - The loop rows (`loop_step_ms`) time whole decoding loops (`generate_ar`,
//!   `generate_speculative`) over the context as the prompt, per step, prefill excluded: what
//!   the isolated ops leave out (host syncs, acceptance, commits, the drafter's context update).
//!   Random weights accept about one token a step, so they are step costs, not speedups.
//! - Bad flags (unknown shape, zero rounds, bad widths, a context the model cannot hold) exit
//!   with code 2 before any model is built.

use crate::bench::{timings, write_report, Timing};
use crate::bench_commit::{folded_commit, state_commit};
use crate::bench_shapes::{
    copy_bandwidth, named_shape, step_bytes, target_params, DrafterLayout, SHAPE_NAMES,
};
use crate::exit::UsageError;
use anyhow::{Context, Result};
use candle_core::{DType, Device, DeviceLocation, Tensor};
use clap::Args;
use dflash_core::AttentionMask;
use dflash_decoding::sampling::greedy_rows;
use dflash_decoding::tree::{tree_from_draft_logits, DraftTree, DEFAULT_TREE_BUDGET};
use dflash_decoding::{
    generate_ar, generate_speculative, DFlashRunner, GenerateConfig, Generation, Sampler,
    SamplingConfig, SpecMode,
};
use dflash_models::drafter::io::config_for_decoder;
use dflash_models::drafter::parameter_shapes;
use dflash_models::{DecoderConfig, ForwardRequest, LogitRows, TargetModel};
use serde_json::{json, Map};
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

mod report;
use report::{print_table, report, ReportIn};

/// Committed positions the drafter receives before the timed block (a step's accepted tokens).
const NEW_CTX: usize = 4;
/// Prefill chunk (bounds the prefill's attention scores at long contexts).
pub(crate) const PREFILL_CHUNK: usize = 1024;
/// New tokens of each timed decoding loop.
const LOOP_TOKENS: usize = 48;
/// Timed decoding loops of each mode (after two untimed ones, which capture the step graphs).
const LOOP_ROUNDS: usize = 3;

#[derive(Args, Debug)]
pub struct DecodeArgs {
    /// Named shape: tiny, smollm2-135m, qwen3-0.6b, qwen3-8b, qwen3.5-4b, qwen3.6-27b (default
    /// smollm2-135m).
    #[arg(long, conflicts_with = "target")]
    shape: Option<String>,
    /// An HF model directory whose config.json gives the shape (its weights are not read).
    #[arg(long)]
    target: Option<PathBuf>,
    /// Cached positions before every timed op.
    #[arg(long, default_value_t = 512)]
    context: usize,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32, bf16 or f16 (default: bf16 on CUDA, f32 on the CPU).
    #[arg(long)]
    dtype: Option<String>,
    /// Bit-exact: every projection (and on the CPU attention too) on row-invariant kernels, so a
    /// verified row computes exactly what the one-token AR step computes and speculative output
    /// equals AR's token for token in bf16 too (SmolLM2 on the H200: 80 of 80 generations, DDTree
    /// ~20 % slower; on the CPU decode steps are row-invariant by default, this adds prefills).
    #[arg(long)]
    bit_exact: bool,
    /// Timed runs of each op (the median is reported).
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// Untimed runs of each op first.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// DDTree node budgets to verify (comma-separated).
    #[arg(long, default_value = "16,64,256")]
    widths: String,
    /// Drafted block size (the chain verify's length).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Drafter layers.
    #[arg(long, default_value_t = 5)]
    draft_layers: usize,
    /// The drafter's attention layout: `zlab` (the published drafter's for the shape where it has
    /// its own — Qwen3.6-27B: 32 / 8 heads of 128, four 2,048-key sliding windows and a full
    /// layer) or `target` (the target's heads, every layer full: what `draft init` makes).
    #[arg(long, default_value = "zlab", value_parser = ["zlab", "target"])]
    drafter_layout: String,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write the JSON here (atomically).
    #[arg(long)]
    out: Option<PathBuf>,
}

fn usage(msg: String) -> anyhow::Error {
    UsageError(msg).into()
}

/// The tree budgets of `--widths`: positive, distinct, in the order given.
fn parse_widths(s: &str) -> Result<Vec<usize>> {
    let mut out = vec![];
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let w: usize = part
            .parse()
            .ok()
            .filter(|&w| w > 0)
            .ok_or_else(|| usage(format!("--widths: '{part}' is not a positive integer")))?;
        if !out.contains(&w) {
            out.push(w);
        }
    }
    if out.is_empty() {
        return Err(usage("--widths needs at least one tree size".into()));
    }
    Ok(out)
}

/// A resolved shape: name for the report, config, mask token id, and the published drafter's
/// layout where it has one and `--drafter-layout zlab` asks for it.
type Shape = (String, DecoderConfig, u32, Option<DrafterLayout>);

/// The [`Shape`] of `--shape` / `--target`.
fn resolve_shape(a: &DecodeArgs) -> Result<Shape> {
    if let Some(dir) = &a.target {
        let cfg = dflash_models::loader::read_config(dir)?;
        let mask = cfg.vocab_size.saturating_sub(1) as u32;
        return Ok((dir.display().to_string(), cfg, mask, None));
    }
    let name = a.shape.as_deref().unwrap_or("smollm2-135m");
    let zlab = a.drafter_layout == "zlab";
    match named_shape(name)? {
        Some(s) => Ok((
            s.name.to_string(),
            s.config,
            s.mask_token_id,
            s.zlab_drafter.filter(|_| zlab),
        )),
        None => Err(usage(format!(
            "unknown --shape '{name}' (expected one of {})",
            SHAPE_NAMES.join(", ")
        ))),
    }
}

fn device_name(dev: &Device) -> String {
    match dev.location() {
        DeviceLocation::Cpu => "cpu".into(),
        DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "other",
    }
}

/// The short commit of the working directory's repository, if git answers.
fn git_commit() -> Option<String> {
    let o = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let s = String::from_utf8(o.stdout).ok()?.trim().to_string();
    (o.status.success() && !s.is_empty()).then_some(s)
}

/// A plausible accepted path through `t`: root to the highest-index node at depth
/// min(3, deepest), so the compaction moves rows (an all-first-children path would be the
/// identity, which `keep_rows` skips).
pub(crate) fn accepted_path(t: &DraftTree) -> Vec<u32> {
    let depth = t.depths.iter().copied().max().unwrap_or(0).min(3);
    let leaf = (0..t.tokens.len())
        .rev()
        .find(|&i| t.depths[i] == depth)
        .unwrap_or(0);
    let mut path = vec![];
    let mut cur = leaf as i64;
    while cur >= 0 {
        path.push(cur as u32);
        cur = t.parents[cur as usize];
    }
    path.reverse();
    path
}

/// One measured op: its report key and times.
struct Op {
    key: String,
    label: String,
    t: Timing,
}

/// Runs `f` inside the CUDA profiler's range when `DFLASH_PROFILE_OP` names `key` (a documented
/// knob for `ncu --profile-from-start off`, scripts/gpu-profile-step.sh's `PROFILE_OP`: only that
/// op's runs are profiled, whatever ran before them); otherwise just runs it.
pub(crate) fn in_profile<T>(key: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let on = std::env::var("DFLASH_PROFILE_OP").is_ok_and(|v| v == key);
    if on {
        profiler(true)?;
    }
    let out = f();
    if on {
        profiler(false)?;
    }
    out
}

/// Starts or stops the CUDA profiler's range (no-op without CUDA).
fn profiler(start: bool) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::sys;
        // SAFETY: plain driver calls with no arguments; the bench's CUDA context is current on
        // this thread (candle made it here).
        let r = unsafe {
            match start {
                true => sys::cuProfilerStart(),
                false => sys::cuProfilerStop(),
            }
        };
        anyhow::ensure!(
            r == sys::CUresult::CUDA_SUCCESS,
            "cuProfilerStart/Stop: {r:?}"
        );
    }
    let _ = start;
    Ok(())
}

fn push(ops: &mut Vec<Op>, key: String, label: String, t: Timing) {
    ops.push(Op { key, label, t });
}

/// A hybrid's state commit rows under `key` after a verify of `block` (`tree`: of that tree, its
/// accepted path kept): the separate commit (`label`), the host's share of it and of that the
/// crop or path compaction's ([`state_commit`]); where the cache folds commits into the next step (hybrids on CUDA with the
/// fold on), the verify (`verify`) that folds it in against the same verify with nothing pending
/// ([`folded_commit`]: `{key}_folding` / `{key}_alone` — the commit's cost is the difference).
/// Nothing for attention-only targets.
fn push_commit_rows(
    ops: &mut Vec<Op>,
    target: &dyn TargetModel,
    (ids, block, taps): (&[u32], &[u32], &[usize]),
    tree: Option<&DraftTree>,
    rounds: (usize, usize),
    key: &str,
    (label, verify): (String, &str),
) -> Result<()> {
    if let Some([t, submit, keep]) = state_commit(target, ids, block, tree, taps, rounds, key)? {
        push(ops, key.into(), label, t);
        push(
            ops,
            format!("{key}_submit"),
            "  of which host until submitted".into(),
            submit,
        );
        push(
            ops,
            format!("{key}_keep"),
            "    of which the crop / path compaction".into(),
            keep,
        );
    }
    if let Some((folding, alone)) = folded_commit(target, ids, block, tree, taps, rounds)? {
        push(
            ops,
            format!("{key}_folding"),
            format!("{verify}, folding the commit in"),
            folding,
        );
        push(
            ops,
            format!("{key}_alone"),
            format!("{verify}, nothing pending"),
            alone,
        );
    }
    Ok(())
}

pub fn run(a: DecodeArgs) -> Result<()> {
    // every flag is checked before anything heavy happens
    let dev = dflash_core::parse_device(&a.device)?;
    crate::defaults::apply_bit_exact(a.bit_exact, &dev)?;
    let dtype = match &a.dtype {
        Some(d) => dflash_core::parse_dtype(d)?,
        None if dev.is_cpu() => DType::F32,
        None => DType::BF16,
    };
    let (shape, cfg, mask, layout) = resolve_shape(&a)?;
    let widths = parse_widths(&a.widths)?;
    if a.rounds == 0 || a.warmup == 0 {
        return Err(usage("--rounds and --warmup must be at least 1".into()));
    }
    if a.block_size < 2 || a.draft_layers == 0 {
        return Err(usage(
            "--block-size must be at least 2 and --draft-layers at least 1".into(),
        ));
    }
    if a.context < 2 * NEW_CTX {
        return Err(usage(format!("--context must be at least {}", 2 * NEW_CTX)));
    }
    let max_w = widths.iter().copied().max().expect("non-empty");
    let rows = (max_w + 1).max(a.block_size);
    let needed = a.context + rows.max(LOOP_TOKENS + DEFAULT_TREE_BUDGET + 1) + a.block_size;
    if needed > cfg.max_position_embeddings {
        return Err(usage(format!(
            "--context {} + a verify of {rows} rows + a block of {} needs {needed} positions; \
             the model holds {}",
            a.context, a.block_size, cfg.max_position_embeddings
        )));
    }
    if mask as usize >= cfg.vocab_size {
        return Err(usage(format!(
            "mask token {mask} outside the vocabulary of {}",
            cfg.vocab_size
        )));
    }
    let context = a.context;
    let devname = device_name(&dev);
    eprintln!(
        "[dflash] bench decode: {shape} on {devname} in {}, context {context}",
        dtype_name(dtype)
    );

    // the floor's bandwidth first, while the device is empty
    let bw = copy_bandwidth(&dev, a.rounds)?;
    let (weight_bytes, kv_bytes) = step_bytes(&cfg, dtype, context)?;
    let bytes = weight_bytes + kv_bytes;
    let floor = bytes as f64 / (bw.gbps * 1e9);

    let t0 = Instant::now();
    let target = dflash_models::random::random_target_model(&cfg, dtype, &dev, a.seed)?;
    let target = target.as_ref();
    let mut dcfg = config_for_decoder(&cfg, a.draft_layers, a.block_size, mask);
    if let Some(l) = &layout {
        l.apply(&mut dcfg).map_err(|e| usage(e.to_string()))?;
    }
    let mut drafter = dflash_models::random_drafter(&dcfg, dtype, &dev, a.seed + 1)?;
    drafter.bind_target(target)?;
    dev.synchronize()?;
    let build_s = t0.elapsed().as_secs_f64();
    let params_target = target_params(&cfg)?;
    let params_drafter: usize = parameter_shapes(&dcfg)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    eprintln!(
        "[dflash] random weights: target {:.1} M, drafter {:.1} M parameters ({build_s:.1} s)",
        params_target as f64 / 1e6,
        params_drafter as f64 / 1e6
    );

    // prefill the context (taps for the drafter, as the decoding loop's prefill)
    let t1 = Instant::now();
    let taps: Vec<usize> = drafter.target_layers().to_vec();
    let vocab = cfg.vocab_size;
    let ids: Vec<u32> = (0..context)
        .map(|i| ((i * 7919 + 13) % vocab) as u32)
        .collect();
    let positions: Vec<u32> = (0..context as u32).collect();
    let mut cache = target.new_cache(context + rows)?;
    let mut ctx_rows = vec![];
    let mut last = None;
    for s in (0..context).step_by(PREFILL_CHUNK) {
        let e = (s + PREFILL_CHUNK).min(context);
        let req = ForwardRequest {
            tokens: &ids[s..e],
            positions: &positions[s..e],
            mask: AttentionMask::Causal,
            taps: &taps,
            logits: LogitRows::Last,
        };
        let out = target.forward(&req, &mut cache)?;
        ctx_rows.push(Tensor::cat(&out.taps, 1)?);
        last = out.logits;
    }
    let ctx = Tensor::cat(&ctx_rows, 0)?;
    drop(ctx_rows);
    let bonus = greedy_rows(last.as_ref().context("prefill logits")?)?[0];
    // room for the block after the context, as the decoding loop's cache has (the device draft
    // writes the block's rows there)
    let mut dcache = drafter.new_cache(context + drafter.block_size());
    let base = context - NEW_CTX;
    drafter.draft(target, &mut dcache, &ctx.narrow(0, 0, base)?, bonus, base)?;
    let new_ctx = ctx.narrow(0, base, NEW_CTX)?.contiguous()?;
    let draft_logits = drafter.draft(target, &mut dcache, &new_ctx, bonus, context)?;
    dcache.crop(base);
    dev.synchronize()?;
    eprintln!(
        "[dflash] prefill of {context} positions: {:.1} s",
        t1.elapsed().as_secs_f64()
    );

    let time = |f: &mut dyn FnMut() -> Result<()>| timings(&dev, a.warmup, a.rounds, f);
    let mut ops: Vec<Op> = vec![];
    let one_pos = [context as u32];
    let next_tok = [bonus];

    // AR step: one token, only its id crosses to the host
    let t = in_profile("ar_step", || {
        time(&mut || {
            let out = target.forward(
                &ForwardRequest::causal(&next_tok, &one_pos, LogitRows::Last),
                &mut cache,
            )?;
            black_box(greedy_rows(out.logits.as_ref().context("logits")?)?);
            cache.crop(context);
            Ok(())
        })
    })?;
    push(&mut ops, "ar_step".into(), "AR step (greedy)".into(), t);

    let mut sampler = Sampler::new(SamplingConfig {
        temperature: 0.7,
        top_p: 0.9,
        top_k: 0,
        seed: 1,
    })?;
    let t = time(&mut || {
        let out = target.forward(
            &ForwardRequest::causal(&next_tok, &one_pos, LogitRows::Last),
            &mut cache,
        )?;
        black_box(sampler.sample_rows(out.logits.as_ref().context("logits")?)?);
        cache.crop(context);
        Ok(())
    })?;
    push(
        &mut ops,
        "sampled_step".into(),
        "AR step (T 0.7, top-p 0.9)".into(),
        t,
    );

    // verify of the drafted block, as spec.rs's DFlash step
    let mut block = vec![bonus];
    block.extend(greedy_rows(&draft_logits)?);
    let block_pos: Vec<u32> = (context as u32..(context + block.len()) as u32).collect();
    let chain = format!("chain{}", a.block_size);
    let t = in_profile(&format!("verify.{chain}"), || {
        time(&mut || {
            let req = ForwardRequest {
                tokens: &block,
                positions: &block_pos,
                mask: AttentionMask::Causal,
                taps: &taps,
                logits: LogitRows::All,
            };
            let out = target.forward(&req, &mut cache)?;
            black_box(greedy_rows(out.logits.as_ref().context("logits")?)?);
            cache.crop(context);
            Ok(())
        })
    })?;
    push(
        &mut ops,
        format!("verify.{chain}"),
        format!("verify {chain} (causal)"),
        t,
    );

    // hybrids: the state commit after that verify — half the block accepted, every Gated
    // DeltaNet layer's state made that of exactly the kept tokens (replayed), timed alone
    push_commit_rows(
        &mut ops,
        target,
        (&ids, &block, &taps),
        None,
        (a.warmup, a.rounds),
        "state_commit",
        (
            format!("state commit ({} of {} kept)", block.len() / 2, block.len()),
            &format!("verify {chain}"),
        ),
    )?;

    // verify of DDTree trees, as spec.rs's DDTree step (compaction included)
    let mut tree_info = Map::new();
    for &w in &widths {
        let tree = tree_from_draft_logits(&draft_logits, bonus, w)?;
        let path = accepted_path(&tree);
        let t = in_profile(&format!("verify.tree{w}"), || {
            time(&mut || {
                let pos = tree.positions(context);
                let out = target.forward(&tree.verify_request(&pos, &taps), &mut cache)?;
                black_box(greedy_rows(out.logits.as_ref().context("logits")?)?);
                cache.keep_rows(context, &path)?;
                cache.crop(context);
                Ok(())
            })
        })?;
        tree_info.insert(
            format!("tree{w}"),
            json!({"nodes": tree.tokens.len(),
                   "depth": tree.depths.iter().max().copied().unwrap_or(0),
                   "accepted_path": path.len()}),
        );
        push(
            &mut ops,
            format!("verify.tree{w}"),
            format!("verify tree{w} ({} nodes)", tree.tokens.len()),
            t,
        );
    }

    // hybrids: the state commit after a DDTree-64 verify — its accepted path kept (the
    // records' path gathered, then replayed), timed alone
    if widths.contains(&64) {
        let tree = tree_from_draft_logits(&draft_logits, bonus, 64)?;
        let kept = accepted_path(&tree).len();
        push_commit_rows(
            &mut ops,
            target,
            (&ids, &block, &taps),
            Some(&tree),
            (a.warmup, a.rounds),
            "tree_commit",
            (
                format!("state commit, tree64 path ({kept} kept)"),
                "verify tree64",
            ),
        )?;
    }

    // one drafter block after NEW_CTX newly committed positions
    let t = in_profile("draft_block", || {
        time(&mut || {
            let l = drafter.draft(target, &mut dcache, &new_ctx, bonus, context)?;
            black_box(greedy_rows(&l)?);
            dcache.crop(base);
            Ok(())
        })
    })?;
    push(
        &mut ops,
        "draft_block".into(),
        format!("draft block ({} layers)", a.draft_layers),
        t,
    );

    // the device part of the default tree build alone: log-softmax and top-k of the drafter's
    // rows, and the copy of the (log-prob, id) pairs to the host
    let t = time(&mut || {
        black_box(dflash_core::decode_ops::top_k_log_probs(
            &draft_logits,
            DEFAULT_TREE_BUDGET,
        )?);
        Ok(())
    })?;
    push(
        &mut ops,
        format!("tree_topk.{DEFAULT_TREE_BUDGET}"),
        format!("  of which top-k ({DEFAULT_TREE_BUDGET})"),
        t,
    );

    // tree builds: the default budget, then each width
    let mut budgets = vec![DEFAULT_TREE_BUDGET];
    budgets.extend(widths.iter().filter(|&&w| w != DEFAULT_TREE_BUDGET));
    for &b in &budgets {
        let t = time(&mut || {
            black_box(tree_from_draft_logits(&draft_logits, bonus, b)?);
            Ok(())
        })?;
        push(
            &mut ops,
            format!("tree_build.{b}"),
            format!("tree build ({b} nodes)"),
            t,
        );
    }

    time_loops(target, &drafter, &ids, &mut ops)?;

    let report = report(&ReportIn {
        a: &a,
        shape: &shape,
        cfg: &cfg,
        devname: &devname,
        dtype,
        widths: &widths,
        params: (params_target, params_drafter),
        bytes: (weight_bytes, kv_bytes),
        bw: &bw,
        floor,
        ops: &ops,
        trees: tree_info,
        build_s,
        drafter_layout: format!(
            "{}: {} / {} heads of {}, layers {:?}, window {:?}",
            if layout.is_some() { "zlab" } else { "target" },
            dcfg.num_attention_heads,
            dcfg.num_key_value_heads,
            dcfg.head_dim,
            dcfg.layer_types.as_deref().unwrap_or_default(),
            dcfg.sliding_window
        ),
    });
    print_table(&ops, floor, bytes, &bw);
    write_report(&report, a.out.as_deref())
}

/// The loop rows (see the module invariants): seconds per step of AR, DFlash and DDTree-64
/// loops, prompt = `ids`, [`LOOP_TOKENS`] new tokens, no stop token.
fn time_loops(
    target: &dyn TargetModel,
    drafter: &dflash_models::DFlashDrafter,
    ids: &[u32],
    ops: &mut Vec<Op>,
) -> Result<()> {
    let cfg = GenerateConfig {
        cancel: None,
        max_new_tokens: LOOP_TOKENS,
        stop_tokens: vec![],
        sampling: SamplingConfig::greedy(),
    };
    // the drafter's prefill of the prompt is not a step
    let per_step = |g: &Generation| {
        let prefill = g.spec.as_ref().map_or(0.0, |s| s.draft_prefill_seconds);
        (g.decode_seconds - prefill) / g.steps.max(1) as f64
    };
    let modes = [
        ("ar", "AR loop, per step", None),
        ("dflash", "DFlash loop, per step", Some(SpecMode::DFlash)),
        (
            "ddtree64",
            "DDTree-64 loop, per step",
            Some(SpecMode::DdTree {
                budget: DEFAULT_TREE_BUDGET,
            }),
        ),
    ];
    for (key, label, mode) in modes {
        let mut v = vec![];
        for round in 0..2 + LOOP_ROUNDS {
            let g = match mode {
                None => generate_ar(target, ids, &cfg, &mut |_| {})?,
                Some(m) => {
                    let mut runner = DFlashRunner::new(drafter);
                    generate_speculative(target, &mut runner, ids, &cfg, m, &mut |_| {})?
                }
            };
            if round >= 2 {
                v.push(per_step(&g));
            }
        }
        push(ops, format!("loop.{key}"), label.into(), Timing::of(v));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widths_parse_and_refuse_bad_values() {
        assert_eq!(parse_widths("16, 64,256,64").unwrap(), vec![16, 64, 256]);
        assert!(parse_widths("").is_err());
        assert!(parse_widths("0").is_err());
        assert!(parse_widths("16,x").is_err());
    }

    #[test]
    fn accepted_path_follows_parents_and_is_not_the_identity() {
        let top = vec![
            vec![(-0.5f32, 1), (-1.0, 2)],
            vec![(-0.1f32, 3), (-2.0, 4)],
            vec![(-0.1f32, 5), (-2.0, 6)],
        ];
        let t = dflash_decoding::tree::build_tree(0, &top, 6);
        let p = accepted_path(&t);
        assert_eq!(p[0], 0);
        for w in p.windows(2) {
            assert_eq!(t.parents[w[1] as usize], w[0] as i64);
        }
        assert!(p.iter().enumerate().any(|(i, &r)| i as u32 != r));
    }
}
