//! The drafter's inference cache: each layer's committed-context K/V, the CUDA graphs of its
//! device drafts and the block's attention bits.
//!
//! Invariants: every layer holds the same number of committed rows (crops apply to all); the
//! graphs bake in this cache's buffers, so they live and die with it.

use candle_core::Tensor;
use dflash_core::KvCache;

/// Committed-context K/V for inference, one cache per drafter layer.
pub struct DraftCache {
    pub(super) layers: Vec<KvCache>,
    /// CUDA graphs of this cache's device drafts (they bake in its buffers).
    pub(super) graphs: dflash_core::step_graph::StepGraphs,
    /// Every block row sees every block row: the tree-attention bits of a full block.
    pub(super) full_block: Option<Tensor>,
    /// The device step's bits for causal layers: block row i sees block rows 0..=i (`[B,
    /// MAX_STEP_ROWS / 32]`).
    pub(super) causal_block: Option<Tensor>,
}

impl dflash_core::cache_pool::PooledCache for DraftCache {
    fn capacity(&self) -> usize {
        self.layers.first().map(|c| c.capacity()).unwrap_or(0)
    }
    fn clear(&mut self) {
        self.crop(0);
    }
}

impl DraftCache {
    /// How many draft shapes replay from a captured CUDA graph (0 where drafts take the host
    /// path, or without CUDA).
    pub fn captured_graphs(&self) -> usize {
        self.graphs.captured()
    }

    pub fn len(&self) -> usize {
        self.layers.first().map(|c| c.len()).unwrap_or(0)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Forgets every committed row at or past `len` in every layer (no reallocation), so the next
    /// [`DFlashDrafter::draft`] starts at position `len` again (benchmarks repeat one draft).
    pub fn crop(&mut self, len: usize) {
        for c in &mut self.layers {
            c.crop(len);
        }
    }
}
