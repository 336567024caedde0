//! The decoder's device step: a forward of up to 129 rows (AR token, DFlash block, DDTree tree;
//! under `--bit-exact` up to `dflash_core::step::MAX_STEP_ROWS`, see [`dense_max_device_rows`])
//! computed from device-side metadata only, so that it replays as a CUDA graph at any cache
//! length (`dflash_core::step`, `dflash_core::step_graph`).
//!
//! Invariants:
//! - Same weights, same fused kernels as the host path; only the attention differs (the cache is
//!   written and read at lengths held on the device, masks built there from tree parents), so
//!   outputs agree with the host path to f32 rounding and greedy tokens are the same (tested on
//!   the GPU).
//! - A tree is padded to a bucket size (root-level dummy rows no real row sees) so that few
//!   shapes are captured; the padding's cache rows lie past the committed length and its outputs
//!   are cut off. Causal blocks are never padded.
//! - The host cache length advances by the real rows only after the step succeeded.

use super::{Decoder, KeyLayout, Rope};
use crate::target::{ForwardOutput, ForwardRequest, LogitRows};
use crate::{ModelError, Result};
use candle_core::{Module, Tensor};
use dflash_core::step::{StepMeta, MAX_STEP_ROWS};
use dflash_core::step_graph::StepKey;
use dflash_core::{AttentionMask, Grad, SequenceCache};

/// Tree sizes a DDTree step is padded up to: a budget of 2^k nodes plus the root, and steps
/// between them.
const TREE_BUCKETS: [usize; 14] = [1, 2, 5, 9, 17, 25, 33, 49, 65, 97, 129, 193, 257, 288];

/// The widest step taken on the device. Wider trees run the host path (cuBLAS attention over a
/// device-built mask, no graph), which beats the SIMT tree-attention kernel there: Qwen3-8B shape,
/// 257-node tree at context 2048, 37.6 ms on the device path against 22.4 ms (docs/benchmarks.md
/// session 11).
pub(crate) const MAX_DEVICE_ROWS: usize = 129;

/// The widest step the dense decoder takes on the device: [`MAX_DEVICE_ROWS`], or under
/// `--bit-exact` (`StreamPolicy::All`) every step of up to `MAX_STEP_ROWS` rows — the host path's
/// cuBLAS attention is not row-invariant (a 257-node tree's root differed from the AR step by
/// 3.6e-3, H200, session 14), while the device step's is, on the AR step's 64-key splits
/// (`step_cuda::chunk_for`). Session 30; the GPU test
/// `bit_exact_bf16_verify_rows_equal_sequential_ar_steps` asks it of 256-node trees (passed on an
/// H100, session 31).
pub(crate) fn dense_max_device_rows() -> usize {
    use dflash_core::stream_gemm::{stream_policy, StreamPolicy};
    if stream_policy() == StreamPolicy::All {
        MAX_STEP_ROWS
    } else {
        MAX_DEVICE_ROWS
    }
}

fn logits_code(rows: LogitRows) -> u8 {
    match rows {
        LogitRows::All => 0,
        LogitRows::Last => 1,
        LogitRows::None => 2,
    }
}

/// A forward request laid out as a device step (shared by the dense and the hybrid step): a tree
/// padded to its bucket with root-level dummy rows, a causal block as it is, and the step's graph
/// key.
pub(crate) struct StepPlan {
    /// The request's rows.
    pub n: usize,
    /// The step's rows (`n`, or a tree's bucket).
    pub rows: usize,
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    /// The padded tree (`None`: a causal block).
    pub tree: Option<Vec<i64>>,
    pub key: StepKey,
}

impl StepPlan {
    /// The plan for `req` (tree `parents`, or causal) after `past` positions of a cache of
    /// `capacity`, with a rope table of `table_rows` positions; `None` where it cannot be a
    /// device step (more than `max_rows` rows — at most `MAX_STEP_ROWS` —, no room, a position
    /// past the table). A tree's bucket never exceeds `max_rows`.
    pub fn new(
        req: &ForwardRequest,
        parents: Option<&[i64]>,
        past: usize,
        capacity: usize,
        table_rows: usize,
        max_rows: usize,
    ) -> Option<Self> {
        let n = req.tokens.len();
        let max_rows = max_rows.min(MAX_STEP_ROWS);
        if n == 0 || n > max_rows {
            return None;
        }
        let rows = match parents {
            Some(_) if req.logits != LogitRows::Last => TREE_BUCKETS
                .iter()
                .copied()
                .find(|&b| b >= n && b <= max_rows)
                .unwrap_or(n),
            _ => n,
        };
        if past + rows > capacity || req.positions.iter().any(|&p| p as usize >= table_rows) {
            return None;
        }
        let mut tokens = req.tokens.to_vec();
        let mut positions = req.positions.to_vec();
        let mut tree: Option<Vec<i64>> = parents.map(|p| p.to_vec());
        if rows > n {
            tokens.resize(rows, req.tokens[0]);
            positions.resize(rows, req.positions[0]);
            if let Some(t) = tree.as_mut() {
                t.resize(rows, -1);
            }
        }
        let key = StepKey {
            rows,
            // a causal block and a tree of as many rows are captured apart (their attention
            // may take different kernels: `dflash_core::step::causal_block_attention`)
            outputs: logits_code(req.logits) | if parents.is_some() { 0x80 } else { 0 },
            taps: req.taps.to_vec(),
        };
        Some(Self {
            n,
            rows,
            tokens,
            positions,
            tree,
            key,
        })
    }

    /// The step's metadata after `past` positions ([`StepMeta`]).
    pub fn meta(&self, past: usize, table_rows: usize) -> Result<StepMeta> {
        Ok(StepMeta::new(
            past,
            &self.tokens,
            &self.positions,
            self.tree.as_deref(),
            table_rows,
        )?)
    }

    /// Runs `body` (the step from its device metadata) as this plan's step on `cache`: eagerly,
    /// captured or replayed as a CUDA graph ([`dflash_core::step_graph::StepGraphs::run`]).
    pub fn run(
        &self,
        cache: &mut SequenceCache,
        words: &[u32],
        device: &candle_core::Device,
        body: &mut dyn FnMut(&Tensor, &mut SequenceCache) -> Result<Vec<Tensor>>,
    ) -> Result<Vec<Tensor>> {
        let mut graphs = std::mem::take(&mut cache.step_graphs);
        let outputs = graphs.run(self.key.clone(), words, &[], device, &mut |m, _| {
            body(m, cache).map_err(ModelError::into_core)
        });
        cache.step_graphs = graphs;
        Ok(outputs?)
    }

    /// The forward's output from the step's (`[logits?, taps side by side?]`, `rows` rows each):
    /// cut to the real rows, each tap a view of the side-by-side copy.
    pub fn output(
        &self,
        mut outputs: Vec<Tensor>,
        req: &ForwardRequest,
        hidden: usize,
    ) -> Result<ForwardOutput> {
        let (logits, taps) = (req.logits, req.taps.len());
        let (n, rows) = (self.n, self.rows);
        let cut =
            |t: Tensor| -> Result<Tensor> { Ok(if rows > n { t.narrow(0, 0, n)? } else { t }) };
        let logits = match logits {
            LogitRows::None => None,
            _ => Some(cut(outputs.remove(0))?),
        };
        let taps_concat = outputs.pop().map(cut).transpose()?;
        let tap_views = match &taps_concat {
            Some(t) => (0..taps)
                .map(|i| Ok(t.narrow(1, i * hidden, hidden)?))
                .collect::<Result<_>>()?,
            None => vec![],
        };
        Ok(ForwardOutput {
            logits,
            taps: tap_views,
            taps_concat,
        })
    }
}

/// The device step's cos-then-sin table ([`StepMeta::rope_table`]) of a model, made on first use
/// in `cell`.
pub(crate) fn rope_table_in<'a>(
    cell: &'a std::sync::OnceLock<Tensor>,
    rotary: &dflash_core::RotaryEmbedding,
    info: &crate::target::TargetInfo,
) -> Result<&'a Tensor> {
    if cell.get().is_none() {
        let positions = StepMeta::table_positions(info.max_position_embeddings);
        let t = StepMeta::rope_table(rotary, positions, &info.device, info.dtype)?;
        let _ = cell.set(t);
    }
    Ok(cell.get().expect("set above"))
}

/// A step body's outputs from its last residual stream `x` (`[1, rows, hidden]`) and its taps
/// (`[1, rows, hidden]` each): `[logits?, taps side by side?]`, the logits from `head` (final norm
/// and LM head) of every row or the last.
pub(crate) fn body_outputs(
    x: Tensor,
    logits: LogitRows,
    taps: &[Tensor],
    head: &dyn Fn(&Tensor) -> Result<Tensor>,
) -> Result<Vec<Tensor>> {
    let rows = x.dim(1)?;
    let mut out = Vec::with_capacity(2);
    match logits {
        LogitRows::None => {}
        r => {
            let x = if r == LogitRows::Last {
                x.narrow(1, rows - 1, 1)?
            } else {
                x
            };
            out.push(head(&x.squeeze(0)?)?);
        }
    }
    if !taps.is_empty() {
        let taps: Vec<Tensor> = taps
            .iter()
            .map(|t| t.squeeze(0))
            .collect::<candle_core::Result<_>>()?;
        out.push(Tensor::cat(&taps, 1)?);
    }
    Ok(out)
}

impl Decoder {
    fn table_positions(&self) -> usize {
        StepMeta::table_positions(self.info.max_position_embeddings)
    }

    fn rope_table(&self) -> Result<&Tensor> {
        rope_table_in(&self.rope_table, &self.rotary, &self.info)
    }

    /// The forward as a device step when it can be one (CUDA, fused kernels, at most 129 rows —
    /// 288 under `--bit-exact`, [`dense_max_device_rows`] —, a causal or tree mask, room in the
    /// cache and the rope table); `None` otherwise.
    pub(super) fn try_device_step(
        &self,
        req: &ForwardRequest,
        cache: &mut SequenceCache,
    ) -> Result<Option<ForwardOutput>> {
        if !self.device_step {
            return Ok(None);
        }
        let parents = match &req.mask {
            AttentionMask::Causal => None,
            AttentionMask::Tree { parents } => Some(parents.as_slice()),
            _ => return Ok(None),
        };
        let past = cache.len();
        let table = self.table_positions();
        let max_rows = dense_max_device_rows();
        let Some(plan) = StepPlan::new(req, parents, past, cache.capacity(), table, max_rows)
        else {
            return Ok(None);
        };
        let meta = plan.meta(past, table)?;
        let rows = plan.rows;
        let table = self.rope_table()?.clone();
        let causal = plan.tree.is_none();
        let outputs = plan.run(cache, &meta.words, &self.info.device, &mut |m, cache| {
            self.device_step_body(m, (rows, causal), &table, req.logits, req.taps, cache)
        })?;
        cache.advance(plan.n)?;
        Ok(Some(plan.output(outputs, req, self.info.hidden_size)?))
    }

    /// The step itself, from the device metadata `meta` alone: `[logits?, taps?]`, each with
    /// `rows` rows (logits `[rows | 1, vocab]` f32, the taps side by side `[rows, T·hidden]`);
    /// `causal`: a causal block, not a tree.
    fn device_step_body(
        &self,
        meta: &Tensor,
        (rows, causal): (usize, bool),
        table: &Tensor,
        logits: LogitRows,
        taps: &[usize],
        cache: &mut SequenceCache,
    ) -> Result<Vec<Tensor>> {
        let packed = table.index_select(&StepMeta::rope_rows(meta, rows)?, 0)?;
        let rope = Rope {
            emb: &self.rotary,
            cos: packed.clone(),
            sin: packed.clone(),
            packed: Some(packed),
        };
        let ids = StepMeta::tokens(meta, rows)?;
        let x = self.embed_tokens.forward(&ids)?.unsqueeze(0)?;
        let ancestors = dflash_core::step::tree_ancestors(meta, rows)?;
        let keys = KeyLayout::Device {
            meta,
            ancestors: &ancestors,
            causal,
        };
        let (x, tap_out) = self.layers_forward(x, &rope, &keys, cache, taps)?;
        body_outputs(x, logits, &tap_out, &|h| {
            let h = self.norm.forward(h, Grad::Off)?;
            crate::target::TargetModel::lm_head(self, &h)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{StepPlan, MAX_DEVICE_ROWS};
    use crate::target::{ForwardRequest, LogitRows};
    use dflash_core::step::MAX_STEP_ROWS;
    use dflash_core::AttentionMask;

    /// The step rows of an `n`-node tree (a chain of parents) under `max_rows`, or `None`.
    fn tree_rows(n: usize, max_rows: usize, logits: LogitRows) -> Option<usize> {
        let tokens = vec![7u32; n];
        let positions: Vec<u32> = (0..n as u32).collect();
        let parents: Vec<i64> = (0..n as i64).map(|i| i - 1).collect();
        let req = ForwardRequest {
            tokens: &tokens,
            positions: &positions,
            mask: AttentionMask::Tree {
                parents: parents.clone(),
            },
            taps: &[],
            logits,
        };
        StepPlan::new(&req, Some(&parents), 10, 4096, 8192, max_rows).map(|p| {
            assert_eq!(p.tokens.len(), p.rows);
            assert_eq!(p.tree.as_ref().map(Vec::len), Some(p.rows));
            p.rows
        })
    }

    #[test]
    fn trees_pad_to_buckets_no_wider_than_the_step_allows() {
        let all = LogitRows::All;
        // the default: up to 129 rows, trees padded to their bucket
        assert_eq!(tree_rows(1, MAX_DEVICE_ROWS, all), Some(1));
        assert_eq!(tree_rows(65, MAX_DEVICE_ROWS, all), Some(65));
        assert_eq!(tree_rows(66, MAX_DEVICE_ROWS, all), Some(97));
        assert_eq!(tree_rows(100, MAX_DEVICE_ROWS, all), Some(129));
        assert_eq!(tree_rows(130, MAX_DEVICE_ROWS, all), None);
        // --bit-exact's device steps: up to 288 rows (a 256-node tree and its root: 257)
        assert_eq!(tree_rows(130, MAX_STEP_ROWS, all), Some(193));
        assert_eq!(tree_rows(257, MAX_STEP_ROWS, all), Some(257));
        assert_eq!(tree_rows(258, MAX_STEP_ROWS, all), Some(288));
        assert_eq!(tree_rows(289, MAX_STEP_ROWS, all), None);
        // a wider limit than the step's own is cut to it
        assert_eq!(tree_rows(289, 1000, all), None);
        // a bucket never passes the limit: 150 rows under a 160-row limit stay 150
        assert_eq!(tree_rows(150, 160, all), Some(150));
        // only the last row's logits: no padding
        assert_eq!(tree_rows(66, MAX_DEVICE_ROWS, LogitRows::Last), Some(66));
    }
}
