//! Launch of the gated delta rule's tree kernel (`gated_delta_kernels.cu`, NVRTC, one module per
//! key head dim, compiled on first use): [`crate::gated_delta::tree_recurrent`] and
//! [`crate::gated_delta::advance`] on CUDA, one launch instead of a dozen candle ops per tree
//! depth or per token; and the layer kernels around it ([`crate::gated_delta_layer`]).
//!
//! Invariants: inputs are made contiguous f32 here; the parents and the kept-state flags
//! ([`crate::gated_delta::kept_states`]) cross to the device in one upload — except in the
//! hybrids' device step, whose launches (`conv_and_rule_inputs_into`, `launch_table`) read fixed
//! buffers and a pointer table uploaded once (`upload_rule_table`), so a CUDA graph captures them;
//! every output element is written by exactly one thread, so outputs are allocated
//! uninitialised; the scratch holds only kept nodes' states; a replay may write its state over
//! its input (`AdvanceJob::into`) and the conv windows over their start (per channel, in row
//! order); everything runs on candle's stream, in order with the ops around it.

use crate::gated_delta::{kept_states, DeltaInputs, RuleKernel};
use crate::step_cuda::address;
use crate::{CoreError, Result};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Tensor};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// The module: the rule (`gated_delta_kernels.cu`), then the layer kernels around it
/// (`gated_delta_layer_kernels.cu`, which use the former's definitions).
const SOURCE: &str = concat!(
    include_str!("gated_delta_kernels.cu"),
    include_str!("gated_delta_layer_kernels.cu")
);
/// Threads of a block: one warp, a state column each (more blocks over the SMs for a few heads).
const THREADS: usize = 32;

/// The kernel module compiled for key head dim `dk` (cached per process).
pub(crate) fn ptx(dk: usize) -> candle_core::Result<&'static str> {
    ptx_variant(dk, RuleKernel::OneLane)
}

/// The module for `dk` with `kernel` as its rule (the layer kernels are the same in every one).
fn ptx_variant(dk: usize, kernel: RuleKernel) -> candle_core::Result<&'static str> {
    // compiled once per (DK, kernel) and kept for the process (a handful of modules): a launch
    // borrows it instead of copying 100–145 KB of PTX (an allocation and a copy per launch)
    type Cache = HashMap<(usize, RuleKernel), std::result::Result<&'static str, String>>;
    static PTX: OnceLock<Mutex<Cache>> = OnceLock::new();
    let mut map = PTX
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .expect("the PTX cache lock is never poisoned");
    map.entry((dk, kernel))
        .or_insert_with(|| {
            let define = match kernel {
                RuleKernel::OneLane => "",
                RuleKernel::FourLanes => "#define RULE_LANES4\n",
                RuleKernel::FourLanesStaged => "#define RULE_LANES4\n#define RULE_STAGED\n",
                RuleKernel::FourLanesStagedReplay => {
                    "#define RULE_LANES4\n#define RULE_STAGED\n#define RULE_REPLAY\n"
                }
                RuleKernel::FourLanesStagedReplayPrefetch => {
                    "#define RULE_LANES4\n#define RULE_STAGED\n#define RULE_REPLAY\n#define RULE_PREFETCH\n"
                }
                RuleKernel::FourLanesStagedReplayVec => {
                    "#define RULE_LANES4\n#define RULE_STAGED\n#define RULE_REPLAY\n#define RULE_KVEC\n"
                }
            };
            let chunk = fold_chunk_define();
            candle_core::cuda_backend::cudarc::nvrtc::compile_ptx(format!(
                "#define DK {dk}\n{define}{chunk}{SOURCE}"
            ))
            .map(|p| &*Box::leak(p.to_src().into_boxed_str()))
            .map_err(|e| format!("gated delta kernel (DK {dk}): NVRTC failed: {e:?}"))
        })
        .clone()
        .map_err(candle_core::Error::Msg)
}

/// The rule's kernel in force: four lanes a state column by default (the same bits as one lane
/// a column — see `gated_delta_kernels.cu`, and the GPU test
/// `the_rules_kernels_give_the_same_bits` — with four times the warps and 64 registers a thread
/// instead of 168; measured on an H100 in session 22: Qwen3.6-27B at 2048 tree64 verify 44.98 →
/// 41.85 ms, tree256 111.4 → 102.0, chain16 27.38 → 26.83; Qwen3.5-4B tree64 14.92 → 13.52).
/// `DFLASH_GDN_RULE_LANES=1` keeps one lane a column, `DFLASH_GDN_RULE_STAGE=1` takes the
/// shared-memory staging (read once; documented overrides for A/B runs).
fn rule_kernel() -> RuleKernel {
    static KERNEL: OnceLock<RuleKernel> = OnceLock::new();
    *KERNEL.get_or_init(|| {
        let on = |name: &str, v: &str| std::env::var(name).is_ok_and(|x| x.trim() == v);
        if on("DFLASH_GDN_RULE_LANES", "1") {
            RuleKernel::OneLane
        } else if on("DFLASH_GDN_RULE_STAGE", "1") {
            RuleKernel::FourLanesStaged
        } else {
            RuleKernel::FourLanes
        }
    })
}

/// The rule's kernel for the state commit's replays: the staged kernel sized for replays (the
/// same bits; measured on an H100 in session 23: the chain commit at Qwen3.6-27B 0.319 → 0.207 ms,
/// Qwen3.5-4B 0.146 → 0.090), or [`rule_kernel`]'s under `DFLASH_GDN_REPLAY=rule` or
/// `DFLASH_GDN_RULE_LANES=1`, or its loads batched under `DFLASH_GDN_REPLAY=prefetch` (session
/// 29; the same bits, no faster on an H200 in session 30), or with its keys read four floats at a
/// time under `DFLASH_GDN_REPLAY=vec` (session 31; the same bits, no faster on an H100: chain
/// commit 0.205 against 0.208 ms, tree commit 0.52 against 0.28) (documented overrides, read once;
/// A/B).
pub(crate) fn replay_kernel() -> RuleKernel {
    static KERNEL: OnceLock<RuleKernel> = OnceLock::new();
    *KERNEL.get_or_init(|| {
        let replay = std::env::var("DFLASH_GDN_REPLAY").unwrap_or_default();
        if replay.trim() == "rule" || rule_kernel() == RuleKernel::OneLane {
            rule_kernel()
        } else if replay.trim() == "prefetch" {
            RuleKernel::FourLanesStagedReplayPrefetch
        } else if replay.trim() == "vec" {
            RuleKernel::FourLanesStagedReplayVec
        } else {
            RuleKernel::FourLanesStagedReplay
        }
    })
}

/// One layer's arguments of the rule's kernel (device addresses; 0 for null).
pub(crate) struct LayerArgs {
    pub(crate) q: u64,
    pub(crate) k: u64,
    pub(crate) v: u64,
    pub(crate) g: u64,
    pub(crate) beta: u64,
    pub(crate) state: u64,
    pub(crate) parents: u64,
    pub(crate) keep: u64,
    pub(crate) out: u64,
    pub(crate) scratch: u64,
    pub(crate) last: u64,
}

/// The pointer table of `layers` (22 words each) followed by `extra`.
pub(crate) fn table_words(layers: &[LayerArgs], extra: &[u32]) -> Vec<u32> {
    let mut words = Vec::with_capacity(22 * layers.len() + extra.len());
    for l in layers {
        for p in [
            l.q, l.k, l.v, l.g, l.beta, l.state, l.parents, l.keep, l.out, l.scratch, l.last,
        ] {
            words.push(p as u32);
            words.push((p >> 32) as u32);
        }
    }
    words.extend_from_slice(extra);
    words
}

/// Launches `gated_delta_tree_layers_f32` over `layers` (one pointer table upload, one launch):
/// each layer's tree of `t` tokens, `h` heads, key dim `dk`, value dim `dv`. `meta` is a u32
/// buffer of at least `22 · L + extra.len()` words; `extra` (parents and kept flags) is copied
/// right after the table, at the addresses `layers` name.
fn launch_layers(
    meta: &Tensor,
    layers: &[LayerArgs],
    extra: &[u32],
    dims: (usize, usize, usize, usize),
    kernel: RuleKernel,
) -> Result<()> {
    crate::step_cuda::upload_meta(meta, &table_words(layers, extra))?;
    launch_table_as(meta, layers.len(), dims, kernel)
}

/// The launch alone of `gated_delta_tree_layers_f32` over the `layers` tables in `table`
/// (already on the device): no upload, so a CUDA graph can capture it.
pub(crate) fn launch_table(
    table: &Tensor,
    layers: usize,
    dims: (usize, usize, usize, usize),
) -> Result<()> {
    launch_table_as(table, layers, dims, rule_kernel())
}

/// Whether the rule's kernel in force takes a folded commit (`gated_delta_tree_fold_f32`: the
/// one-lane and the four-lane kernels; the staged ones do not).
pub(crate) fn fold_supported() -> bool {
    matches!(rule_kernel(), RuleKernel::OneLane | RuleKernel::FourLanes)
}

/// Whether the four-lane fold kernel stages the pending tokens in shared memory (the default;
/// `gated_delta_pending_staged`: the same bits) — `DFLASH_GDN_FOLD_STAGE=0` walks them from
/// global memory (documented override for A/B runs, read once).
fn fold_staged() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("DFLASH_GDN_FOLD_STAGE").map_or(true, |v| v.trim() != "0"))
}

/// The staged fold's chunk (`FOLD_CHUNK`: pending tokens staged at a time, 8 by default) under
/// `DFLASH_GDN_FOLD_CHUNK=4` (documented override for A/B runs, read once; other values keep 8):
/// a `#define` for every module, which only the fold kernel reads (the same bits at any chunk: the
/// same floats in the same order). ptxas sm_90, DK 128: 214 registers at 4 against 254 at 8 (16
/// spills).
fn fold_chunk_define() -> &'static str {
    static DEFINE: OnceLock<&'static str> = OnceLock::new();
    DEFINE.get_or_init(|| match std::env::var("DFLASH_GDN_FOLD_CHUNK") {
        Ok(v) if v.trim() == "4" => "#define FOLD_CHUNK 4\n",
        _ => "",
    })
}

/// One layer's device-step rule ([`launch_table`], `layers` = 1) with the last verify's commit
/// folded in: `fold` is the layer's table of [`upload_fold_table`] (its pending inputs and the
/// step's pending count, which may be 0). Only where [`fold_supported`].
pub(crate) fn launch_table_folding(
    table: &Tensor,
    fold: &Tensor,
    dims: (usize, usize, usize, usize),
) -> Result<()> {
    if !fold_supported() {
        return Err(CoreError::InvalidInput(
            "the staged rule kernels take no folded commit".into(),
        ));
    }
    let (fp, _) = address(fold, "folded commit table")?;
    launch_rule(table, 1, dims, rule_kernel(), Some(fp))
}

/// [`launch_table`] with the rule's kernel chosen here.
pub(crate) fn launch_table_as(
    table: &Tensor,
    layers: usize,
    dims: (usize, usize, usize, usize),
    kernel: RuleKernel,
) -> Result<()> {
    launch_rule(table, layers, dims, kernel, None)
}

/// The rule's launch: `gated_delta_tree_layers_f32`, or with `fold` (a folded commit table's
/// address; one layer) `gated_delta_tree_fold_f32`.
fn launch_rule(
    table: &Tensor,
    layers: usize,
    (t, h, dk, dv): (usize, usize, usize, usize),
    kernel: RuleKernel,
    fold: Option<u64>,
) -> Result<()> {
    let (mp, dev) = address(table, "gated delta pointer table")?;
    let (ti, hi, dvi) = (t as i32, h as i32, dv as i32);
    let kernel = if dk % 4 == 0 {
        kernel
    } else {
        RuleKernel::OneLane
    };
    let lanes4 = kernel != RuleKernel::OneLane;
    // one lane a column: THREADS columns a block; four: THREADS / 4
    let columns = if lanes4 { THREADS / 4 } else { THREADS };
    let cfg = LaunchConfig {
        grid_dim: (dv.div_ceil(columns) as u32, h as u32, layers as u32),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let suffix = match kernel {
        RuleKernel::OneLane => "",
        RuleKernel::FourLanes => "_l4",
        RuleKernel::FourLanesStaged => "_l4s",
        RuleKernel::FourLanesStagedReplay => "_l4r",
        RuleKernel::FourLanesStagedReplayPrefetch => "_l4rp",
        RuleKernel::FourLanesStagedReplayVec => "_l4rv",
    };
    let module = format!("dflash_gated_delta_dk{dk}{suffix}");
    let entry = match fold {
        Some(_) => "gated_delta_tree_fold_f32",
        None => "gated_delta_tree_layers_f32",
    };
    let f = dev.get_or_load_custom_func(entry, &module, ptx_variant(dk, kernel)?)?;
    let mut b = f.builder();
    b.arg(&mp);
    if let Some(fp) = &fold {
        b.arg(fp);
    }
    b.arg(&ti).arg(&hi).arg(&dvi);
    let staged = fold.map(|_| i32::from(fold_staged()));
    if let Some(staged) = &staged {
        b.arg(staged);
    }
    // SAFETY: the table holds, per layer, device addresses of live contiguous tensors of the sizes
    // the kernel reads and writes (or 0 where the kernel checks for null); `table` outlives the
    // launch on this stream.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Writes one layer's pointer table (22 u32 words) over the fixed buffers of a hybrid device
/// step into `table` (see [`crate::gated_delta_layer::StepRuleBuffers`]).
pub(crate) fn upload_rule_table(
    table: &Tensor,
    b: &crate::gated_delta_layer::StepRuleBuffers,
) -> Result<()> {
    let ptr = |t: &Tensor, what: &str| address(t, what).map(|p| p.0);
    let args = LayerArgs {
        q: ptr(b.q, "step q")?,
        k: ptr(b.k, "step k")?,
        v: ptr(b.v, "step v")?,
        g: ptr(b.g, "step g")?,
        beta: ptr(b.beta, "step beta")?,
        state: ptr(b.state, "step state")?,
        parents: ptr(b.parents, "step parents")?,
        keep: ptr(b.keep, "step kept flags")?,
        out: ptr(b.out, "step outputs")?,
        scratch: ptr(b.scratch, "step scratch")?,
        last: 0, // the state moves on at the commit
    };
    crate::step_cuda::upload_meta(table, &table_words(&[args], &[]))
}

/// The rule over the tree `parents` from `state` on the device: the outputs `[T, H, dv]` and the
/// state after the last node `[H, dk, dv]`. `parents` must already be checked (`tree_depths`).
pub(crate) fn tree_recurrent(
    x: &DeltaInputs,
    state: &Tensor,
    parents: &[i64],
) -> Result<(Tensor, Tensor)> {
    tree_recurrent_as(x, state, parents, rule_kernel())
}

/// [`tree_recurrent`] with the rule's kernel chosen here (a GPU test compares the kernels).
pub(crate) fn tree_recurrent_as(
    x: &DeltaInputs,
    state: &Tensor,
    parents: &[i64],
    kernel: RuleKernel,
) -> Result<(Tensor, Tensor)> {
    let (t, h, dk) = x.k.dims3()?;
    let dv = x.v.dim(2)?;
    if t == 0 || parents.len() != t || state.dims() != [h, dk, dv] {
        return Err(CoreError::InvalidInput(format!(
            "gated delta kernel: {} parents, k {:?}, state {:?}",
            parents.len(),
            x.k.dims(),
            state.dims()
        )));
    }
    let dev_t = state.device();
    let c = |a: &Tensor| a.to_dtype(DType::F32).and_then(|a| a.contiguous());
    let (q, k, v, g, beta, s0) = (c(x.q)?, c(x.k)?, c(x.v)?, c(x.g)?, c(x.beta)?, c(state)?);
    let keep = kept_states(parents);
    let any_kept = keep.iter().any(|&b| b);
    // SAFETY (all four): every element a reader sees is written first (the table and flags by
    // the upload, the rest by the kernel).
    let out = unsafe { Tensor::empty((t, h, dv), DType::F32, dev_t)? };
    let scratch = if any_kept {
        Some(unsafe { Tensor::empty((t, h, dk, dv), DType::F32, dev_t)? })
    } else {
        None
    };
    let last = unsafe { Tensor::empty((h, dk, dv), DType::F32, dev_t)? };
    let meta = unsafe { Tensor::empty(22 + 2 * t, DType::U32, dev_t)? };
    let (base, _) = address(&meta, "gated delta pointer table")?;
    let ptr = |x: &Tensor, what: &str| address(x, what).map(|p| p.0);
    let opt = |x: &Option<Tensor>, what: &str| x.as_ref().map_or(Ok(0), |x| ptr(x, what));
    let args = LayerArgs {
        q: ptr(&q, "gated delta q")?,
        k: ptr(&k, "gated delta k")?,
        v: ptr(&v, "gated delta v")?,
        g: ptr(&g, "gated delta g")?,
        beta: ptr(&beta, "gated delta beta")?,
        state: ptr(&s0, "gated delta state")?,
        parents: base + 88,
        keep: base + 88 + 4 * t as u64,
        out: ptr(&out, "gated delta out")?,
        scratch: opt(&scratch, "gated delta scratch")?,
        last: ptr(&last, "gated delta state out")?,
    };
    let extra: Vec<u32> = parents
        .iter()
        .map(|&p| p as i32 as u32)
        .chain(keep.iter().map(|&b| b as u32))
        .collect();
    launch_layers(&meta, &[args], &extra, (t, h, dk, dv), kernel)?;
    Ok((out, last))
}

/// See [`crate::gated_delta::advance_layers`]: every job's chain of `t` tokens in one launch.
pub(crate) fn advance_layers(jobs: &[crate::gated_delta::AdvanceJob]) -> Result<Vec<Tensor>> {
    let first = jobs.first().expect("the caller passes at least one job");
    let (t, h, dk) = first.k.dims3()?;
    let dv = first.v.dim(2)?;
    let dev_t = first.state.device();
    let c = |a: &Tensor| a.to_dtype(DType::F32).and_then(|a| a.contiguous());
    let mut kept = Vec::with_capacity(jobs.len()); // the inputs, alive until the launch is queued
    let mut outs = Vec::with_capacity(jobs.len());
    let mut args = Vec::with_capacity(jobs.len());
    for j in jobs {
        if j.k.dims() != [t, h, dk] || j.v.dims() != [t, h, dv] || j.state.dims() != [h, dk, dv] {
            return Err(CoreError::InvalidInput(format!(
                "advance_layers: k {:?}, v {:?}, state {:?} beside k {:?}",
                j.k.dims(),
                j.v.dims(),
                j.state.dims(),
                first.k.dims()
            )));
        }
        let (k, v, g, beta, s0) = (c(j.k)?, c(j.v)?, c(j.g)?, c(j.beta)?, c(j.state)?);
        let last = match j.into {
            // in place is safe: each thread reads its state column before it writes it
            Some(t) if t.dims() == [h, dk, dv] && t.dtype() == DType::F32 && t.is_contiguous() => {
                t.clone()
            }
            Some(t) => {
                return Err(CoreError::InvalidInput(format!(
                    "advance_layers: an output {:?} {:?} for a state [{h}, {dk}, {dv}] f32",
                    t.dims(),
                    t.dtype()
                )))
            }
            // SAFETY: written by the kernel before anything reads it.
            None => unsafe { Tensor::empty((h, dk, dv), DType::F32, dev_t)? },
        };
        let ptr = |x: &Tensor| address(x, "advance_layers").map(|p| p.0);
        args.push(LayerArgs {
            q: ptr(&k)?,
            k: ptr(&k)?,
            v: ptr(&v)?,
            g: ptr(&g)?,
            beta: ptr(&beta)?,
            state: ptr(&s0)?,
            parents: 0,
            keep: 0,
            out: 0,
            scratch: 0,
            last: ptr(&last)?,
        });
        kept.push((k, v, g, beta, s0));
        outs.push(last);
    }
    // SAFETY: the upload writes the whole table before the kernel reads it.
    let meta = unsafe { Tensor::empty(22 * jobs.len(), DType::U32, dev_t)? };
    launch_layers(&meta, &args, &[], (t, h, dk, dv), replay_kernel())?;
    drop(kept);
    Ok(outs)
}

/// Launch configuration of a thread per item (`items` threads in blocks of 128).
fn per_item(items: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (items.div_ceil(128) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn dtype_suffix(t: &Tensor, what: &str) -> Result<&'static str> {
    match t.dtype() {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        d => Err(CoreError::InvalidInput(format!(
            "{what}: {d:?} (the layer kernels take f32 or bf16)"
        ))),
    }
}

/// See [`crate::gated_delta_layer::conv_and_rule_inputs`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv_and_rule_inputs(
    qkv: &Tensor,
    conv_state: &Tensor,
    b: &Tensor,
    a: &Tensor,
    parents: &[i64],
    w: crate::gated_delta_layer::LayerWeights,
    heads: crate::gated_delta_layer::LayerHeads,
    fused: bool,
) -> Result<crate::gated_delta_layer::RuleInputs> {
    let crate::gated_delta_layer::LayerHeads { hv, dk, dv, .. } = heads;
    let (n, c) = qkv.dims2()?;
    if parents.len() != n {
        return Err(CoreError::InvalidInput(format!(
            "conv_and_rule_inputs: {} parents for {n} rows",
            parents.len()
        )));
    }
    let dev_t = qkv.device();
    let words: Vec<u32> = parents.iter().map(|&p| p as i32 as u32).collect();
    let parents_t = Tensor::from_vec(words, n, dev_t)?;
    // SAFETY (all): every element is written by exactly one thread before anything reads it.
    let empty = |shape: &[usize]| unsafe { Tensor::empty(shape, DType::F32, dev_t) };
    let u = empty(&[n, c])?;
    let outs = crate::gated_delta_layer::RuleInputs {
        qkv: empty(&[n, c])?,
        q: empty(&[n, hv, dk])?,
        k: empty(&[n, hv, dk])?,
        v: empty(&[n, hv, dv])?,
        g: empty(&[n, hv])?,
        beta: empty(&[n, hv])?,
    };
    conv_and_rule_inputs_into(
        qkv, conv_state, b, a, &parents_t, w, heads, &u, &outs, fused,
    )?;
    Ok(outs)
}

/// [`conv_and_rule_inputs`] into caller-given buffers (launches only, so a CUDA graph can
/// capture it): `parents` a u32 device tensor of at least n words (i32 bits, as the step's
/// metadata holds them), `u` `[n, C]` f32 scratch (of the two kernels only), `outs` the outputs
/// (contiguous f32 of the shapes [`conv_and_rule_inputs`] returns; views into larger buffers are
/// fine); `fused`: the one kernel (`gdn_conv_rule_inputs`, which reads `qkv`, `b`, `a` at their
/// row strides) or the two.
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv_and_rule_inputs_into(
    qkv: &Tensor,
    conv_state: &Tensor,
    b: &Tensor,
    a: &Tensor,
    parents: &Tensor,
    w: crate::gated_delta_layer::LayerWeights,
    heads: crate::gated_delta_layer::LayerHeads,
    u: &Tensor,
    outs: &crate::gated_delta_layer::RuleInputs,
    fused: bool,
) -> Result<()> {
    let crate::gated_delta_layer::LayerHeads { hk, hv, dk, dv } = heads;
    let (conv_w, dt_bias, neg_a) = (w.conv_w, w.dt_bias, w.neg_a);
    let (n, c) = qkv.dims2()?;
    let k = conv_w.dim(1)?;
    let sfx = dtype_suffix(qkv, "conv_and_rule_inputs")?;
    let f32_of = |t: &Tensor, dims: &[usize]| {
        t.dims() == dims && t.dtype() == DType::F32 && t.is_contiguous()
    };
    if c != 2 * hk * dk + hv * dv
        || conv_w.dims() != [c, k]
        || conv_state.dims() != [k - 1, c]
        || !(2..=8).contains(&k)
        || b.dims() != [n, hv]
        || a.dims() != [n, hv]
        || b.dtype() != qkv.dtype()
        || a.dtype() != qkv.dtype()
        || parents.dtype() != DType::U32
        || parents.elem_count() < n
        || hk == 0
        || !hv.is_multiple_of(hk)
        || !f32_of(u, &[n, c])
        || !f32_of(&outs.qkv, &[n, c])
        || !f32_of(&outs.q, &[n, hv, dk])
        || !f32_of(&outs.k, &[n, hv, dk])
        || !f32_of(&outs.v, &[n, hv, dv])
        || !f32_of(&outs.g, &[n, hv])
        || !f32_of(&outs.beta, &[n, hv])
    {
        return Err(CoreError::InvalidInput(format!(
            "conv_and_rule_inputs: qkv {:?}, conv {:?} / {:?}, gates {:?} {:?}, {} parents, \
             outputs q {:?} k {:?} v {:?}, {heads:?}",
            qkv.dims(),
            conv_w.dims(),
            conv_state.dims(),
            b.dims(),
            a.dims(),
            parents.elem_count(),
            outs.q.dims(),
            outs.k.dims(),
            outs.v.dims()
        )));
    }
    let f32c = |t: &Tensor| t.to_dtype(DType::F32).and_then(|t| t.contiguous());
    let (cs, cw, dtb, na) = (
        f32c(conv_state)?,
        f32c(conv_w)?,
        f32c(dt_bias)?,
        f32c(neg_a)?,
    );
    let ptr = |t: &Tensor, what: &str| address(t, what).map(|p| p.0);
    let (csp, cwp, pp) = (
        ptr(&cs, "conv state")?,
        ptr(&cw, "conv weight")?,
        ptr(parents, "parents")?,
    );
    let (dtp, nap) = (ptr(&dtb, "dt_bias")?, ptr(&na, "-exp(A_log)")?);
    let (qp, kp, vp, gp, betap) = (
        ptr(&outs.q, "q")?,
        ptr(&outs.k, "k")?,
        ptr(&outs.v, "v")?,
        ptr(&outs.g, "g")?,
        ptr(&outs.beta, "beta")?,
    );
    let q32p = ptr(&outs.qkv, "qkv f32")?;
    let (ni, ci, ki, hki, hvi, dvi) = (
        n as i32, c as i32, k as i32, hk as i32, hv as i32, dv as i32,
    );
    let module = format!("dflash_gated_delta_dk{dk}");
    let src = ptx(dk)?;
    if fused {
        // one launch over the rows as they are (column views of a stacked projection included)
        let (xp, ld, dev) = rows_address(qkv, "qkv")?;
        let (bp, bld, _) = rows_address(b, "beta projection")?;
        let (ap, ald, _) = rows_address(a, "decay projection")?;
        if bld != ald && n > 1 {
            return Err(CoreError::InvalidInput(format!(
                "conv_and_rule_inputs: gate rows {bld} and {ald} elements apart (one stride)"
            )));
        }
        let (ldi, gldi) = (ld as i32, bld as i32);
        let f =
            dev.get_or_load_custom_func(&format!("gdn_conv_rule_inputs_{sfx}"), &module, src)?;
        let mut l = f.builder();
        l.arg(&xp)
            .arg(&ldi)
            .arg(&csp)
            .arg(&cwp)
            .arg(&pp)
            .arg(&ki)
            .arg(&bp)
            .arg(&ap)
            .arg(&gldi)
            .arg(&dtp)
            .arg(&nap)
            .arg(&hki)
            .arg(&hvi)
            .arg(&dvi)
            .arg(&q32p)
            .arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&gp)
            .arg(&betap);
        let cfg = LaunchConfig {
            grid_dim: ((n * hv) as u32, 1, 1),
            block_dim: (dk.max(dv) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel's arguments in order; live tensors of the checked sizes, rows of
        // `qkv`, `b`, `a` at the strides read off their layouts.
        unsafe { l.launch(cfg) }.w()?;
        return Ok(());
    }
    let (qkv, b, a) = (qkv.contiguous()?, b.contiguous()?, a.contiguous()?);
    let (xp, dev) = address(&qkv, "qkv")?;
    let up = ptr(u, "u")?;
    let f = dev.get_or_load_custom_func(&format!("gdn_conv_silu_{sfx}"), &module, src)?;
    let mut l = f.builder();
    l.arg(&xp)
        .arg(&csp)
        .arg(&cwp)
        .arg(&pp)
        .arg(&ni)
        .arg(&ci)
        .arg(&ki)
        .arg(&up)
        .arg(&q32p);
    // SAFETY: the kernel's arguments in order, live contiguous tensors of the checked sizes.
    unsafe { l.launch(per_item(n * c)) }.w()?;
    let (bp, ap) = (ptr(&b, "beta projection")?, ptr(&a, "decay projection")?);
    let f = dev.get_or_load_custom_func(&format!("gdn_rule_inputs_{sfx}"), &module, src)?;
    let mut l = f.builder();
    l.arg(&up)
        .arg(&bp)
        .arg(&ap)
        .arg(&dtp)
        .arg(&nap)
        .arg(&ni)
        .arg(&hki)
        .arg(&hvi)
        .arg(&dvi)
        .arg(&qp)
        .arg(&kp)
        .arg(&vp)
        .arg(&gp)
        .arg(&betap);
    // SAFETY: as above.
    unsafe { l.launch(per_item(n * hv * dk.max(dv))) }.w()?;
    Ok(())
}

/// Whether the convolution and the rule's inputs run as one kernel (`gdn_conv_rule_inputs`, the
/// same bits as the two; the default): not when `DFLASH_GDN_FUSED_INPUTS=0` (read once; a
/// documented override for A/B runs).
pub(crate) fn fused_inputs() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("DFLASH_GDN_FUSED_INPUTS").as_deref() != Ok("0"))
}

/// The address of a 2-D tensor's first row and its row stride in elements: contiguous rows, or
/// a column view of wider rows (`narrow` on the last dim: stride `[ld, 1]`).
fn rows_address(t: &Tensor, what: &str) -> Result<(u64, usize, candle_core::CudaDevice)> {
    let (rows, cols) = t.dims2()?;
    let stride = t.stride().to_vec();
    let ld = if rows <= 1 { cols } else { stride[0] };
    if t.is_contiguous() {
        let (p, dev) = address(t, what)?;
        return Ok((p, cols.max(ld), dev));
    }
    if stride[1] != 1 || ld < cols {
        return Err(CoreError::InvalidInput(format!(
            "{what}: rows of stride {stride:?} (the layer kernels take contiguous rows)"
        )));
    }
    // the view's start: the address of its first row as a one-row contiguous view
    let (p, dev) = address(&t.narrow(0, 0, 1)?, what)?;
    Ok((p, ld, dev))
}

/// See [`crate::gated_delta_layer::gated_norm`].
pub(crate) fn gated_norm(o: &Tensor, z: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let (n, hv, dv) = o.dims3()?;
    let sfx = dtype_suffix(z, "gated_norm")?;
    if z.dims() != [n, hv * dv] || w.dims() != [dv] || o.dtype() != DType::F32 {
        return Err(CoreError::InvalidInput(format!(
            "gated_norm: o {:?} ({:?}), z {:?}, weight {:?}",
            o.dims(),
            o.dtype(),
            z.dims(),
            w.dims()
        )));
    }
    let dk_module = 16; // the norm does not depend on DK: any compiled module holds it
    let o = o.contiguous()?;
    let w = w.to_dtype(DType::F32)?.contiguous()?;
    // SAFETY: every element is written by exactly one thread.
    let y = unsafe { Tensor::empty((n, hv * dv), z.dtype(), z.device())? };
    let (op, dev) = address(&o, "gated norm input")?;
    let (zp, zld, _) = rows_address(z, "gate")?;
    let zld = zld as i32;
    let (wp, _) = address(&w, "norm weight")?;
    let (yp, _) = address(&y, "gated norm output")?;
    let (ni, hvi, dvi, e) = (n as i32, hv as i32, dv as i32, eps as f32);
    let module = format!("dflash_gated_delta_dk{dk_module}");
    let f =
        dev.get_or_load_custom_func(&format!("gdn_gated_norm_{sfx}"), &module, ptx(dk_module)?)?;
    let mut l = f.builder();
    l.arg(&op)
        .arg(&zp)
        .arg(&zld)
        .arg(&wp)
        .arg(&ni)
        .arg(&hvi)
        .arg(&dvi)
        .arg(&e)
        .arg(&yp);
    // SAFETY: the kernel's arguments in order, live contiguous tensors of the checked sizes.
    unsafe { l.launch(per_item(n * hv * dv)) }.w()?;
    Ok(y)
}
