//! The decoder's device step: a forward of up to 129 rows (AR token, DFlash block, DDTree tree)
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
pub(crate) const TREE_BUCKETS: [usize; 11] = [1, 2, 5, 9, 17, 25, 33, 49, 65, 97, 129];

/// The widest step taken on the device. Wider trees run the host path (cuBLAS attention over a
/// device-built mask, no graph), which beats the SIMT tree-attention kernel there: Qwen3-8B shape,
/// 257-node tree at context 2048, 37.6 ms on the device path against 22.4 ms (docs/benchmarks.md
/// session 11).
pub(crate) const MAX_DEVICE_ROWS: usize = 129;

pub(crate) fn logits_code(rows: LogitRows) -> u8 {
    match rows {
        LogitRows::All => 0,
        LogitRows::Last => 1,
        LogitRows::None => 2,
    }
}

impl Decoder {
    fn table_positions(&self) -> usize {
        StepMeta::table_positions(self.info.max_position_embeddings)
    }

    fn rope_table(&self) -> Result<&Tensor> {
        if self.rope_table.get().is_none() {
            let t = StepMeta::rope_table(
                &self.rotary,
                self.table_positions(),
                &self.info.device,
                self.info.dtype,
            )?;
            let _ = self.rope_table.set(t);
        }
        Ok(self.rope_table.get().expect("set above"))
    }

    /// The forward as a device step when it can be one (CUDA, fused kernels, at most 129 rows,
    /// a causal or tree mask, room in the cache and the rope table); `None` otherwise.
    pub(super) fn try_device_step(
        &self,
        req: &ForwardRequest,
        cache: &mut SequenceCache,
    ) -> Result<Option<ForwardOutput>> {
        let n = req.tokens.len();
        if !self.device_step || n > MAX_DEVICE_ROWS.min(MAX_STEP_ROWS) {
            return Ok(None);
        }
        let parents = match &req.mask {
            AttentionMask::Causal => None,
            AttentionMask::Tree { parents } => Some(parents.as_slice()),
            _ => return Ok(None),
        };
        let rows = match parents {
            Some(_) if req.logits != LogitRows::Last => {
                TREE_BUCKETS.iter().copied().find(|&b| b >= n).unwrap_or(n)
            }
            _ => n,
        };
        let past = cache.len();
        let table = self.table_positions();
        if past + rows > cache.capacity() || req.positions.iter().any(|&p| p as usize >= table) {
            return Ok(None);
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
        let meta = StepMeta::new(past, &tokens, &positions, tree.as_deref(), table)?;
        let key = StepKey {
            rows,
            outputs: logits_code(req.logits),
            taps: req.taps.to_vec(),
        };
        let table = self.rope_table()?.clone();
        let device = self.info.device.clone();
        let mut graphs = std::mem::take(&mut cache.step_graphs);
        let outputs = graphs.run(key, &meta.words, &[], &device, &mut |m, _| {
            self.device_step_body(m, rows, &table, req.logits, req.taps, cache)
                .map_err(ModelError::into_core)
        });
        cache.step_graphs = graphs;
        let mut outputs = outputs?;
        cache.advance(n)?;
        let cut =
            |t: Tensor| -> Result<Tensor> { Ok(if rows > n { t.narrow(0, 0, n)? } else { t }) };
        let logits = match req.logits {
            LogitRows::None => None,
            _ => Some(cut(outputs.remove(0))?),
        };
        // the taps come side by side from the step (one copy); each tap is a view of them
        let taps_concat = outputs.pop().map(cut).transpose()?;
        let hidden = self.info.hidden_size;
        let taps = match &taps_concat {
            Some(t) => (0..req.taps.len())
                .map(|i| Ok(t.narrow(1, i * hidden, hidden)?))
                .collect::<Result<_>>()?,
            None => vec![],
        };
        Ok(Some(ForwardOutput {
            logits,
            taps,
            taps_concat,
        }))
    }

    /// The step itself, from the device metadata `meta` alone: `[logits?, taps?]`, each with
    /// `rows` rows (logits `[rows | 1, vocab]` f32, the taps side by side `[rows, T·hidden]`).
    fn device_step_body(
        &self,
        meta: &Tensor,
        rows: usize,
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
        };
        let (x, tap_out) = self.layers_forward(x, &rope, &keys, cache, taps)?;
        let mut out = Vec::with_capacity(1 + taps.len());
        match logits {
            LogitRows::None => {}
            r => {
                let x = if r == LogitRows::Last {
                    x.narrow(1, rows - 1, 1)?
                } else {
                    x
                };
                let h = self.norm.forward(&x.squeeze(0)?, Grad::Off)?;
                out.push(crate::target::TargetModel::lm_head(self, &h)?);
            }
        }
        if !tap_out.is_empty() {
            let taps: Vec<Tensor> = tap_out
                .iter()
                .map(|t| t.squeeze(0))
                .collect::<candle_core::Result<_>>()?;
            out.push(Tensor::cat(&taps, 1)?);
        }
        Ok(out)
    }
}
