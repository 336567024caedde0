//! The hybrid's device step: a forward of up to 129 rows (an AR token, a DFlash block, a DDTree
//! tree) computed from device-side metadata only, so that it replays as a CUDA graph at any cache
//! length — the dense decoder's device step (`crate::decoder::step`) for Gated DeltaNet and
//! gated-attention layers.
//!
//! Invariants:
//! - On by default where it can run (CUDA with the fused decode and the Gated DeltaNet kernels);
//!   `DFLASH_HYBRID_STEP=0` (read at load) or [`HybridDecoder::set_device_step`] turns it off.
//!   Measured on an H100 (session 21, Qwen3.5-4B shape): AR step 8.14 → 6.87 ms, 16-row verify
//!   11.16 → 9.63, state commit 0.207 → 0.152.
//! - Recurrent layers read their state from fixed buffers (`dflash_core::recurrent_step`) and
//!   write their rows' rule inputs there; the cache's commit replays the kept tokens into the
//!   state buffers in place with the rule's one kernel, so the states are those of the host path
//!   bit for bit, and the step never reads a host-made tensor. With the fold on (CUDA,
//!   `DFLASH_GDN_FOLD=1`: opt-in, measured slower in loops in session 35) the next step folds that replay in
//!   (its metadata's last word counts the pending rows; the prologue moves the windows and copies
//!   the inputs aside; each layer's rule kernel replays them before its rows: one read of the
//!   state instead of two, no launch between steps).
//! - Attention layers write keys and values at the length held on the device and attend over the
//!   whole cache buffer through GEMMs of fixed shape under a device-built mask (committed keys
//!   and each row's own path), their heads and output gate as one kernel each after one q/k/v
//!   GEMM; the rest (projections, norms, MLP, LM head) are the host path's kernels. Outputs agree
//!   with the host path to rounding (a GPU test checks it).
//! - A tree is padded to a bucket size (root-level dummy rows no real row sees); the caches count
//!   only the real rows. Causal blocks are never padded.

use super::{HybridDecoder, Mixer};
use crate::decoder::step::{body_outputs, rope_table_in, StepPlan, MAX_DEVICE_ROWS};
use crate::hybrid::layers::{tensor_core_gated_attention, Rope, StepVisibility};
use crate::target::{ForwardOutput, ForwardRequest, LogitRows, TargetModel};
use crate::{ModelError, Result};
use candle_core::{Module, Tensor};
use dflash_core::step::StepMeta;
use dflash_core::{Grad, LayerCache, SequenceCache};

impl HybridDecoder {
    /// Turns the device step on or off (on only where it can run: see the module invariants).
    pub fn set_device_step(&mut self, on: bool) {
        self.device_step = on && self.device_step_supported;
    }

    /// Runs the device step's host emulation on the CPU (tests of its bookkeeping — buffers,
    /// metadata, masks, commits — where no GPU is: the same orchestration, host kernels).
    #[doc(hidden)]
    pub fn emulate_device_step_on_cpu(&mut self) {
        self.device_step = self.info.device.is_cpu();
    }

    /// Whether forwards of up to 129 rows run as device steps.
    pub fn device_step(&self) -> bool {
        self.device_step
    }

    fn rope_table(&self) -> Result<&Tensor> {
        rope_table_in(&self.rope_table, &self.rotary, &self.info)
    }

    /// The forward as a device step when it can be one (on, at most 129 rows, room in the cache
    /// and the rope table); `None` otherwise.
    pub(super) fn try_device_step(
        &self,
        req: &ForwardRequest,
        parents: Option<&[i64]>,
        cache: &mut SequenceCache,
    ) -> Result<Option<ForwardOutput>> {
        if !self.device_step {
            return Ok(None);
        }
        let past = cache.len();
        let table_rows = StepMeta::table_positions(self.info.max_position_embeddings);
        let Some(plan) = StepPlan::new(
            req,
            parents,
            past,
            cache.capacity(),
            table_rows,
            MAX_DEVICE_ROWS,
        ) else {
            return Ok(None);
        };
        let shape = self.layers.iter().find_map(|l| match &l.mixer {
            Mixer::Linear(d) => Some(d.step_shape(MAX_DEVICE_ROWS)),
            Mixer::Attention(_) => None,
        });
        // a pending chain commit is folded into this step's rule kernels where it can be, else
        // settled now
        let mut folded = None;
        if let Some(shape) = shape {
            cache.ensure_recurrent_step_buffers(shape)?;
            folded = cache.foldable_step_chain();
            if folded.is_none() {
                cache.load_recurrent_step_states()?;
            }
        }
        let rows = plan.rows;
        let chain = |k: usize| (0..k as i64).map(|i| i - 1).collect::<Vec<i64>>();
        let padded = plan.tree.clone().unwrap_or_else(|| chain(rows));
        let mut meta = plan.meta(past, table_rows)?;
        // the recurrent layers' kept-state flags after the parents (`SharedStepBuffers::load_tree`)
        meta.words.extend(
            dflash_core::gated_delta::kept_states(&padded)
                .iter()
                .map(|&k| k as u32),
        );
        // then the folded commit's pending count (`SharedStepBuffers::load_tree`)
        meta.words.push(folded.unwrap_or(0) as u32);
        let table = self.rope_table()?.clone();
        let run = plan.run(cache, &meta.words, &self.info.device, &mut |m, cache| {
            self.device_step_body(m, rows, &table, req.logits, req.taps, cache)
        });
        let outputs = match (run, folded) {
            (Ok(o), Some(_)) => {
                cache.count_folded_commit()?;
                o
            }
            (Ok(o), None) => o,
            (Err(e), Some(_)) => {
                cache.abandon_folded_commit(&e.to_string());
                return Err(e);
            }
            (Err(e), None) => return Err(e),
        };
        let real = parents.map(|p| p.to_vec()).unwrap_or_else(|| chain(plan.n));
        cache.commit_device_step(&real)?;
        Ok(Some(plan.output(outputs, req, self.info.hidden_size)?))
    }

    /// The step from `meta` alone, as the dense step's body: `[logits?, taps side by side?]`.
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
            cos: packed.narrow(0, 0, rows)?,
            sin: packed.narrow(0, rows, rows)?,
            packed: Some(packed.clone()),
        };
        let ids = StepMeta::tokens(meta, rows)?;
        let x = self.embed_tokens.forward(&ids)?.unsqueeze(0)?;
        let ancestors = dflash_core::step::tree_ancestors(meta, rows)?;
        // the gated attention's visibility: ancestor bits for the tensor-core kernel, else the
        // additive mask over the whole buffers
        let by_bits = self.layers.iter().any(|l| {
            matches!(&l.mixer, Mixer::Attention(att)
                if tensor_core_gated_attention(&x, att, rows))
        });
        let visible = if by_bits {
            ancestors
                .narrow(1, 0, dflash_core::step::MAX_STEP_ROWS / 32)?
                .contiguous()?
        } else {
            dflash_core::step::step_mask(meta, &ancestors, rows, cache.capacity())?
        };
        let shared = cache.recurrent_step.clone();
        if let Some(s) = &shared {
            s.load_tree(meta, rows)?;
            // the folded commit's windows and pending inputs, before any layer overwrites them
            cache.fold_prologue()?;
        }
        let (x, tap_out) = self.layers_forward(x, cache, taps, &mut |mixer, lc, h| match (
            mixer, lc, &shared,
        ) {
            (Mixer::Linear(d), LayerCache::Recurrent(rc), Some(s)) => {
                let bufs = rc
                    .step_buffers()
                    .ok_or_else(|| ModelError::InvalidInput("no device-step buffers".into()))?;
                Ok(d.forward_device(&h.squeeze(0)?, bufs, s)?.unsqueeze(0)?)
            }
            (Mixer::Attention(att), LayerCache::Attention(kv), _) => {
                let visibility = if by_bits {
                    StepVisibility::AncestorBits(&visible)
                } else {
                    StepVisibility::Mask(&visible)
                };
                att.forward_device(h, &rope, meta, visibility, kv)
            }
            _ => Err(ModelError::InvalidInput(
                "the cache's layer kind does not match the model's".into(),
            )),
        })?;
        body_outputs(x, logits, &tap_out, &|h| {
            let h = self.norm.forward(h, Grad::Off)?;
            self.lm_head(&h)
        })
    }
}
