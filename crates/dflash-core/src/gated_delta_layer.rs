//! The Gated DeltaNet layer's ops around the gated delta rule ([`crate::gated_delta`]) as CUDA
//! kernels (`gated_delta_kernels.cu`): the short convolution, q/k/v heads and gates before the
//! rule, the gated RMSNorm after it — the host composite of `dflash_models::gated_deltanet` in
//! two launches (three with `DFLASH_GDN_FUSED_INPUTS=0`) instead of some thirty candle ops.
//!
//! Invariants:
//! - The same map as the host composite, computed in f32 whatever the compute dtype (bf16 inputs
//!   widened exactly, outputs rounded to nearest even); checked against a host reference by
//!   compiling the kernels as C++ (tests/gated_delta_kernel_emulated.rs) and, through the model,
//!   against transformers on the GPU (reference fixtures).
//! - CUDA only: [`layer_kernels_available`] says when they run; elsewhere the functions refuse.

use crate::{CoreError, Result};
use candle_core::{DType, Tensor};

/// A Gated DeltaNet layer's head counts and dims (`linear_num_key_heads`, `…value_heads`,
/// `…key_head_dim`, `…value_head_dim`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerHeads {
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

/// What [`conv_and_rule_inputs`] gives: the convolution's inputs in f32 (`[n, C]`, what a
/// recurrent record keeps) and the rule's inputs (see [`crate::gated_delta::DeltaInputs`]).
pub struct RuleInputs {
    pub qkv: Tensor,
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub g: Tensor,
    pub beta: Tensor,
}

/// The layer's own weights the kernels read: the convolution `[C, K]`, `dt_bias` and
/// `−exp(A_log)` `[Hv]` (any float dtype; read in f32).
#[derive(Clone, Copy)]
pub struct LayerWeights<'a> {
    pub conv_w: &'a Tensor,
    pub dt_bias: &'a Tensor,
    pub neg_a: &'a Tensor,
}

/// Whether the layer kernels ([`conv_and_rule_inputs`], [`gated_norm`]) and the rule's kernel run
/// for this device, key head dim and compute dtype (f32 or bf16) and convolution width (≤ 8).
pub fn layer_kernels_available(
    device: &candle_core::Device,
    dk: usize,
    dtype: DType,
    conv_kernel: usize,
) -> bool {
    crate::gated_delta::kernel_available(device, dk)
        && matches!(dtype, DType::F32 | DType::BF16)
        && (2..=8).contains(&conv_kernel)
}

/// The Gated DeltaNet layer's ops between its input projections and the rule, in one CUDA
/// launch (`gdn_conv_rule_inputs`; two — the convolution, then the rule's inputs — under
/// `DFLASH_GDN_FUSED_INPUTS=0`, the same bits): `qkv`, `b`, `a` contiguous or column views of
/// one stacked projection (rows at a stride, read in place); the causal depthwise convolution of `qkv` (`[n, C]`, compute dtype) along each
/// token's ancestors (`parents`, as [`crate::gated_delta::tree_recurrent`] takes them; rows before a root come from
/// `conv_state` `[K−1, C]`, newest last) with the weight `w.conv_w` `[C, K]`, then SiLU; q and
/// k l2-normalised per key head (q times `dk^-½`) and repeated to the value heads; v; β =
/// sigmoid(`b`); g = softplus(`a` + `w.dt_bias`) · `w.neg_a` (`b`, `a` `[n, Hv]`). The same map as
/// the host composite in `dflash_models::gated_deltanet` (tested against it on the GPU through
/// the model, and against a host reference by emulation). CUDA only
/// ([`layer_kernels_available`]).
pub fn conv_and_rule_inputs(
    qkv: &Tensor,
    conv_state: &Tensor,
    b: &Tensor,
    a: &Tensor,
    parents: &[i64],
    w: LayerWeights,
    heads: LayerHeads,
) -> Result<RuleInputs> {
    conv_and_rule_inputs_as(qkv, conv_state, b, a, parents, w, heads, None)
}

/// [`conv_and_rule_inputs`] on its two kernels (the convolution, then the rule's inputs from
/// its output) whatever the default — the reference the fused kernel's bits are tested against.
/// CUDA only.
pub fn conv_and_rule_inputs_two_kernels(
    qkv: &Tensor,
    conv_state: &Tensor,
    b: &Tensor,
    a: &Tensor,
    parents: &[i64],
    w: LayerWeights,
    heads: LayerHeads,
) -> Result<RuleInputs> {
    conv_and_rule_inputs_as(qkv, conv_state, b, a, parents, w, heads, Some(false))
}

/// [`conv_and_rule_inputs`] on the fused kernel or the two (`None`: the default).
#[allow(clippy::too_many_arguments)]
fn conv_and_rule_inputs_as(
    qkv: &Tensor,
    conv_state: &Tensor,
    b: &Tensor,
    a: &Tensor,
    parents: &[i64],
    w: LayerWeights,
    heads: LayerHeads,
    fused: Option<bool>,
) -> Result<RuleInputs> {
    crate::gated_delta::tree_depths(parents)?;
    #[cfg(feature = "cuda")]
    if layer_kernels_available(qkv.device(), heads.dk, qkv.dtype(), w.conv_w.dim(1)?) {
        let fused = fused.unwrap_or_else(crate::gated_delta_cuda::fused_inputs);
        return crate::gated_delta_cuda::conv_and_rule_inputs(
            qkv, conv_state, b, a, parents, w, heads, fused,
        );
    }
    let _ = (qkv, conv_state, b, a, w, heads, fused);
    Err(CoreError::InvalidInput(
        "conv_and_rule_inputs: the layer kernels run on CUDA only".into(),
    ))
}

/// [`conv_and_rule_inputs`] into caller-given buffers, launches only (the hybrid device step:
/// a CUDA graph captures it): `parents` a u32 device tensor of at least n words (i32 bits, −1 for
/// a root, as the step's metadata holds them), `u` `[n, C]` f32 scratch, `outs` contiguous f32
/// views of the shapes [`conv_and_rule_inputs`] returns. CUDA only.
#[allow(clippy::too_many_arguments)]
pub fn conv_and_rule_inputs_into(
    qkv: &Tensor,
    conv_state: &Tensor,
    b: &Tensor,
    a: &Tensor,
    parents: &Tensor,
    w: LayerWeights,
    heads: LayerHeads,
    u: &Tensor,
    outs: &RuleInputs,
) -> Result<()> {
    #[cfg(feature = "cuda")]
    if layer_kernels_available(qkv.device(), heads.dk, qkv.dtype(), w.conv_w.dim(1)?) {
        let fused = crate::gated_delta_cuda::fused_inputs();
        return crate::gated_delta_cuda::conv_and_rule_inputs_into(
            qkv, conv_state, b, a, parents, w, heads, u, outs, fused,
        );
    }
    let _ = (qkv, conv_state, b, a, parents, w, heads, u, outs);
    Err(CoreError::InvalidInput(
        "conv_and_rule_inputs_into: the layer kernels run on CUDA only".into(),
    ))
}

/// The buffers the rule reads and writes in a hybrid device step, at addresses that stay fixed
/// from step to step (the layer's state and record buffers, the sequence's shared scratch), so
/// that its pointer table is uploaded once ([`upload_rule_table`]) and the launch
/// ([`rule_from_table`]) replays in a CUDA graph. Shapes as [`crate::gated_delta::tree_recurrent`]
/// takes them for up to R rows (`q`, `k` `[R, H, dk]`, `v`, `out` `[R, H, dv]`, `g`, `beta`
/// `[R, H]`, `scratch` `[R, H, dk, dv]`, `state` `[H, dk, dv]`, f32; `parents`, `keep` u32
/// `[R]`). The rule writes no end state: the state buffer moves on at the commit (a replay).
pub struct StepRuleBuffers<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub g: &'a Tensor,
    pub beta: &'a Tensor,
    pub state: &'a Tensor,
    pub parents: &'a Tensor,
    pub keep: &'a Tensor,
    pub out: &'a Tensor,
    pub scratch: &'a Tensor,
}

/// Writes the rule's pointer table over `b` into `table` (u32, at least 22 words). CUDA only.
pub fn upload_rule_table(table: &Tensor, b: &StepRuleBuffers) -> Result<()> {
    #[cfg(feature = "cuda")]
    if table.device().is_cuda() {
        return crate::gated_delta_cuda::upload_rule_table(table, b);
    }
    let _ = (table, b);
    Err(CoreError::InvalidInput(
        "upload_rule_table: the layer kernels run on CUDA only".into(),
    ))
}

/// The rule over the first `rows` tokens of the buffers `table` points at (one launch of the
/// kernel every forward and replay runs, no upload). CUDA only.
pub fn rule_from_table(table: &Tensor, rows: usize, heads: LayerHeads) -> Result<()> {
    #[cfg(feature = "cuda")]
    if table.device().is_cuda() {
        return crate::gated_delta_cuda::launch_table(
            table,
            1,
            (rows, heads.hv, heads.dk, heads.dv),
        );
    }
    let _ = (table, rows, heads);
    Err(CoreError::InvalidInput(
        "rule_from_table: the layer kernels run on CUDA only".into(),
    ))
}

/// [`rule_from_table`] with the last verify's state commit folded in (see
/// [`crate::recurrent_step`]): `fold` is the layer's [`RecurrentStepBuffers::fold_table`]; the
/// state buffer first moves over the step's pending count of pending rows (0: not at all).
///
/// [`RecurrentStepBuffers::fold_table`]: crate::recurrent_step::RecurrentStepBuffers
pub fn rule_from_table_folding(
    table: &Tensor,
    fold: &Tensor,
    rows: usize,
    heads: LayerHeads,
) -> Result<()> {
    #[cfg(feature = "cuda")]
    if table.device().is_cuda() {
        return crate::gated_delta_cuda::launch_table_folding(
            table,
            fold,
            (rows, heads.hv, heads.dk, heads.dv),
        );
    }
    let _ = (table, fold, rows, heads);
    Err(CoreError::InvalidInput(
        "rule_from_table_folding: the layer kernels run on CUDA only".into(),
    ))
}

/// Whether device steps fold the state commit into their rule kernels by default: opt-in
/// (`DFLASH_GDN_FOLD=1`, read once) where [`fold_commit_supported`]. Measured on an H100 (session
/// 35, Qwen3.6-27B at 2048; the same bits as the separate commit): ~0.04 ms a pending row, since
/// each layer advances its state over them serially before its own rows (8 rows 0.32 ms against
/// 0.24–0.28 separately, 2 rows 0.08–0.10 against 0.32–0.50), and no decode loop faster (DDTree
/// +1.2 %). So the separate commit stays the default.
pub fn fold_commit_default() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("DFLASH_GDN_FOLD").is_ok_and(|v| v.trim() == "1") && fold_commit_supported()
    })
}

/// Whether this build's rule kernel takes a folded commit: CUDA builds, unless a staged rule
/// kernel is in force (`DFLASH_GDN_RULE_STAGE=1`).
pub fn fold_commit_supported() -> bool {
    #[cfg(feature = "cuda")]
    return crate::gated_delta_cuda::fold_supported();
    #[cfg(not(feature = "cuda"))]
    false
}

/// The gated RMSNorm after the rule, one CUDA launch: `o` `[n, Hv, dv]` (f32) normed per value
/// head (`1/sqrt(mean o² + eps)`), times `w` `[dv]`, times SiLU of the gate `z` `[n, Hv·dv]`;
/// returned `[n, Hv·dv]` in `z`'s dtype. CUDA only ([`layer_kernels_available`]).
pub fn gated_norm(o: &Tensor, z: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if z.device().is_cuda() {
        return crate::gated_delta_cuda::gated_norm(o, z, w, eps);
    }
    let _ = (o, z, w, eps);
    Err(CoreError::InvalidInput(
        "gated_norm: the layer kernels run on CUDA only".into(),
    ))
}

/// The convolution windows `[K−1, C]` the first `n` tokens of each job leave: the last `K−1`
/// rows of `[start; conv_in[..n]]` (`start` `[K−1, C]`, `conv_in` `[≥ n, C]`, f32) — for many
/// recurrent layers at once (the state commit): one launch on CUDA, a concatenation per job
/// elsewhere. Exact copies either way.
pub fn conv_windows(jobs: &[(&Tensor, &Tensor)], n: usize) -> Result<Vec<Tensor>> {
    conv_windows_into(jobs, n, None)
}

/// [`conv_windows`] written into `outs` (one contiguous f32 `[K−1, C]` per job, which may be the
/// job's own `start`: the hybrid device step commits its window buffers in place); returns them.
pub fn conv_windows_into(
    jobs: &[(&Tensor, &Tensor)],
    n: usize,
    outs: Option<&[&Tensor]>,
) -> Result<Vec<Tensor>> {
    let Some(&(first, _)) = jobs.first() else {
        return Ok(vec![]);
    };
    if outs.is_some_and(|o| o.len() != jobs.len()) {
        return Err(CoreError::InvalidInput(
            "conv_windows_into: one output per job".into(),
        ));
    }
    #[cfg(feature = "cuda")]
    if first.device().is_cuda() && first.dim(0)? > 0 && crate::gated_delta::kernels_enabled() {
        return crate::gated_delta_commit_cuda::conv_windows(jobs, n, outs);
    }
    let w = first.dim(0)?;
    jobs.iter()
        .enumerate()
        .map(|(i, &(start, conv_in))| {
            let all = Tensor::cat(&[start, &conv_in.narrow(0, 0, n)?], 0)?;
            let window = all.narrow(0, all.dim(0)? - w, w)?.contiguous()?;
            match outs.map(|o| o[i]) {
                Some(t) => {
                    t.slice_set(&window, 0, 0)?;
                    Ok(t.clone())
                }
                None => Ok(window),
            }
        })
        .collect()
}
