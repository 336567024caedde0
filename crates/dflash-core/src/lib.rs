//! dflash-core: the pieces every model and decoding loop shares.
//!
//! Invariants: nothing here knows about a particular architecture; tensors follow candle's
//! `[batch, heads, seq, head_dim]` layout for attention; every fused (no-backward) op has a
//! differentiable twin, selected by [`Grad`], so training code can never silently lose gradients.

pub mod attention;
#[cfg(feature = "cuda")]
mod attention_values_cuda;
pub mod block_attention;
pub mod cache;
pub mod cache_pool;
pub mod cross_entropy;
pub mod decode_ops;
#[cfg(feature = "cuda")]
mod decode_ops_cuda;
#[cfg(feature = "cuda")]
mod decode_sampling_cuda;
pub mod device;
pub mod error;
pub mod flash_block;
#[cfg(feature = "cuda")]
mod flash_block_cuda;
pub mod fs;
pub mod fused_grad;
#[cfg(feature = "cuda")]
mod gated_attention_cuda;
pub mod gated_delta;
#[cfg(feature = "cuda")]
mod gated_delta_commit_cuda;
#[cfg(feature = "cuda")]
mod gated_delta_cuda;
pub mod gated_delta_layer;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod graph_arena;
#[cfg(feature = "cuda")]
mod graph_rebuild;
pub mod norm;
#[cfg(feature = "cuda")]
pub mod pdl;
pub mod recurrent_cache;
pub mod recurrent_step;
pub mod rope;
pub mod rowwise;
pub mod step;
#[cfg(feature = "cuda")]
mod step_copies_cuda;
#[cfg(feature = "cuda")]
mod step_cuda;
pub mod step_graph;
#[cfg(feature = "cuda")]
mod step_graph_cuda;
pub mod stream_gemm;
#[cfg(feature = "cuda")]
mod stream_gemm_bulk;
#[cfg(feature = "cuda")]
mod stream_gemm_cuda;
#[cfg(test)]
mod test_util;
#[cfg(feature = "cuda")]
mod tree_attn_rows_cuda;

pub use attention::{attention, AttentionMask};
pub use block_attention::block_attention;
pub use cache::{KvCache, LayerCache, SequenceCache};
pub use device::{parse_device, parse_dtype};
pub use error::{CoreError, Result};
pub use norm::RmsNorm;
pub use recurrent_cache::{RecurrentCache, RecurrentRecord, RecurrentState};
pub use rope::{RopeConfig, RopeScaling, RotaryEmbedding};

/// Whether a forward must keep gradients (training) or may use candle's fused no-backward kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grad {
    /// Inference: fused kernels allowed.
    Off,
    /// Training: only differentiable composites.
    On,
}
