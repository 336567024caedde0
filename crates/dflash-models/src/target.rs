//! The target-model trait the decoding loops drive, and the request/response of one forward.
//!
//! Invariants:
//! - One forward appends exactly `tokens.len()` rows to the cache, at explicit `positions`, under an
//!   explicit [`AttentionMask`] relative to the rows already cached; the caller crops or compacts the
//!   cache afterwards (speculative tails), the model never does.
//! - `taps` are decoder-layer *outputs* (residual stream before the final norm): tap `l` is HF
//!   `hidden_states[l + 1]`. They come back in request order as `[n, hidden]` tensors.
//! - Logits are f32 `[rows, vocab]`.
//! - `embed` and `lm_head` expose the target's own weights (shared with the drafter, never copied).

use crate::Result;
use candle_core::{DType, Device, Tensor};
use dflash_core::{AttentionMask, RmsNorm, SequenceCache};

/// Which rows of a forward need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    All,
    Last,
    None,
}

#[derive(Debug, Clone)]
pub struct ForwardRequest<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    pub mask: AttentionMask,
    pub taps: &'a [usize],
    pub logits: LogitRows,
}

impl<'a> ForwardRequest<'a> {
    /// A causal block of `tokens` at consecutive positions from `start`.
    pub fn causal(tokens: &'a [u32], positions: &'a [u32], logits: LogitRows) -> Self {
        Self {
            tokens,
            positions,
            mask: AttentionMask::Causal,
            taps: &[],
            logits,
        }
    }
}

/// One forward over `batch` sequences that each feed `tokens.len() / batch` new tokens (row-major),
/// for batched decoding (data regeneration). All sequences share one cache length; shorter prompts
/// are left-padded and their padding hidden by `mask`.
#[derive(Debug, Clone)]
pub struct BatchForwardRequest<'a> {
    pub batch: usize,
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    /// Additive f32 mask `[batch, n, past + n]` (0 visible, -inf hidden); every row sees a key.
    pub mask: Tensor,
    /// `Some(first)`: `mask` is causal with sequence `b`'s keys before `first[b]` hidden (left
    /// padding; a padding query sees only its own key), so a fused causal kernel may stand in for
    /// it. `None`: any other mask.
    pub causal_from: Option<&'a [u32]>,
    /// Decoder layers whose outputs come back, as `[batch, n, hidden]` each (training taps).
    pub taps: &'a [usize],
    /// `Last` or `All` (logits `[batch, rows, vocab]`), or `None`.
    pub logits: LogitRows,
}

#[derive(Debug, Clone)]
pub struct ForwardOutput {
    pub logits: Option<Tensor>,
    pub taps: Vec<Tensor>,
    /// The taps side by side (`[.., T·hidden]`) when the forward made them so (the device step,
    /// whose `taps` are then views of it); read through [`ForwardOutput::concat_taps`].
    pub taps_concat: Option<Tensor>,
}

impl ForwardOutput {
    pub fn new(logits: Option<Tensor>, taps: Vec<Tensor>) -> Self {
        Self {
            logits,
            taps,
            taps_concat: None,
        }
    }

    /// The taps side by side along the last dimension (`[n, T·hidden]`, or `[b, n, T·hidden]`
    /// from a batched forward) — the drafter's context features — without a copy where the
    /// forward produced them so.
    pub fn concat_taps(&self) -> Result<Tensor> {
        if let Some(t) = &self.taps_concat {
            return Ok(t.clone());
        }
        let last = self.taps.first().map_or(1, |t| t.rank().saturating_sub(1));
        Ok(Tensor::cat(&self.taps, last)?)
    }
}

/// Static facts about a loaded target.
#[derive(Debug, Clone)]
pub struct TargetInfo {
    pub architecture: &'static str,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub dtype: DType,
    pub device: Device,
}

pub trait TargetModel: Send {
    fn info(&self) -> &TargetInfo;
    /// A fresh cache able to hold `capacity` positions.
    fn new_cache(&self, capacity: usize) -> Result<SequenceCache>;
    /// An empty cache for one sequence of at least `capacity` positions, from the model's pool of
    /// caches handed back by [`TargetModel::recycle_cache`] when one is large enough (its CUDA step
    /// graphs replay instead of being captured again; `dflash_core::cache_pool`), else a new one.
    fn take_cache(&self, capacity: usize) -> Result<SequenceCache> {
        self.new_cache(capacity)
    }
    /// Hands a single-sequence cache back after a generation, for a later [`TargetModel::take_cache`].
    fn recycle_cache(&self, cache: SequenceCache) {
        drop(cache);
    }
    fn forward(&self, req: &ForwardRequest, cache: &mut SequenceCache) -> Result<ForwardOutput>;
    /// Batched forward; logits `[batch, rows, vocab]` f32 (`None` when not asked for) and taps
    /// `[batch, n, hidden]`.
    fn forward_batch(
        &self,
        req: &BatchForwardRequest,
        cache: &mut SequenceCache,
    ) -> Result<ForwardOutput> {
        let _ = (req, cache);
        Err(crate::ModelError::InvalidInput(format!(
            "{} targets do not support batched forwards",
            self.info().architecture
        )))
    }
    /// The final norm as a plain RMSNorm with an f32 weight `[hidden]` (a zero-centred norm's
    /// effective weight `1 + w`) and the model's epsilon, if the model has one: a drafter starts
    /// from it, and applies it to its last tap when its config declares
    /// `final_norm_on_last_tap`.
    fn final_norm(&self) -> Option<RmsNorm> {
        None
    }
    /// Token embeddings `[n] -> [n, hidden]`.
    fn embed(&self, tokens: &Tensor) -> Result<Tensor>;
    /// The LM head alone (no final norm): `[n, hidden] -> [n, vocab]` f32.
    fn lm_head(&self, hidden: &Tensor) -> Result<Tensor>;
    /// The gradient of a loss w.r.t. the LM head's input from its gradient w.r.t. the logits
    /// (`[n, vocab]` f32 → `[n, hidden]` f32). The head is frozen, so no weight gradient is formed
    /// (candle's matmul backward would compute one and throw it away).
    fn lm_head_input_grad(&self, grad_logits: &Tensor) -> Result<Tensor>;
}
