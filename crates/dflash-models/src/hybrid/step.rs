//! The hybrid's device step: a forward of up to 129 rows (an AR token, a DFlash block, a DDTree
//! tree) computed from device-side metadata only, so that it replays as a CUDA graph at any cache
//! length — the dense decoder's device step (`crate::decoder::step`) for Gated DeltaNet and
//! gated-attention layers.
//!
//! Invariants:
//! - Opt-in (`DFLASH_HYBRID_STEP=1`, read at load, or [`HybridDecoder::set_device_step`]) until
//!   it has been measured on a GPU; CUDA with the fused decode and the Gated DeltaNet kernels.
//! - Recurrent layers read their state from fixed buffers (`dflash_core::recurrent_step`) and
//!   write their rows' rule inputs there; the cache's commit replays the kept tokens into the
//!   state buffers in place with the rule's one kernel, so the states are those of the host path
//!   bit for bit, and the step never reads a host-made tensor.
//! - Attention layers write keys and values at the length held on the device and attend over the
//!   whole cache buffer through GEMMs of fixed shape under a device-built mask (committed keys
//!   and each row's own path); the rest (projections, norms, MLP, LM head) are the host path's
//!   kernels. Outputs agree with the host path to rounding (a GPU test checks it).
//! - A tree is padded to a bucket size (root-level dummy rows no real row sees); the caches count
//!   only the real rows. Causal blocks are never padded.

use super::{HybridDecoder, Mixer};
use crate::decoder::step::{logits_code, MAX_DEVICE_ROWS, TREE_BUCKETS};
use crate::hybrid::layers::Rope;
use crate::target::{ForwardOutput, ForwardRequest, LogitRows, TargetModel};
use crate::{ModelError, Result};
use candle_core::{Module, Tensor};
use dflash_core::step::StepMeta;
use dflash_core::step_graph::StepKey;
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
        if self.rope_table.get().is_none() {
            let t = StepMeta::rope_table(
                &self.rotary,
                StepMeta::table_positions(self.info.max_position_embeddings),
                &self.info.device,
                self.info.dtype,
            )?;
            let _ = self.rope_table.set(t);
        }
        Ok(self.rope_table.get().expect("set above"))
    }

    /// The forward as a device step when it can be one (on, at most 129 rows, room in the cache
    /// and the rope table); `None` otherwise.
    pub(super) fn try_device_step(
        &self,
        req: &ForwardRequest,
        parents: Option<&[i64]>,
        cache: &mut SequenceCache,
    ) -> Result<Option<ForwardOutput>> {
        let n = req.tokens.len();
        if !self.device_step || n > MAX_DEVICE_ROWS {
            return Ok(None);
        }
        let rows = match parents {
            Some(_) if req.logits != LogitRows::Last => {
                TREE_BUCKETS.iter().copied().find(|&b| b >= n).unwrap_or(n)
            }
            _ => n,
        };
        let past = cache.len();
        let table_rows = StepMeta::table_positions(self.info.max_position_embeddings);
        if past + rows > cache.capacity() || req.positions.iter().any(|&p| p as usize >= table_rows)
        {
            return Ok(None);
        }
        let shape = self.layers.iter().find_map(|l| match &l.mixer {
            Mixer::Linear(d) => Some(d.step_shape(MAX_DEVICE_ROWS)),
            Mixer::Attention(_) => None,
        });
        if let Some(shape) = shape {
            cache.ensure_recurrent_step_buffers(shape)?;
            cache.load_recurrent_step_states()?;
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
        let chain = |k: usize| (0..k as i64).map(|i| i - 1).collect::<Vec<i64>>();
        let padded = tree.clone().unwrap_or_else(|| chain(rows));
        let mut meta = StepMeta::new(past, &tokens, &positions, tree.as_deref(), table_rows)?;
        // the recurrent layers' kept-state flags after the parents (`SharedStepBuffers::load_tree`)
        meta.words.extend(
            dflash_core::gated_delta::kept_states(&padded)
                .iter()
                .map(|&k| k as u32),
        );
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
        let real = parents.map(|p| p.to_vec()).unwrap_or_else(|| chain(n));
        cache.commit_device_step(&real)?;
        let cut =
            |t: Tensor| -> Result<Tensor> { Ok(if rows > n { t.narrow(0, 0, n)? } else { t }) };
        let logits = match req.logits {
            LogitRows::None => None,
            _ => Some(cut(outputs.remove(0))?),
        };
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
            cos: packed.narrow(0, 0, rows)?,
            sin: packed.narrow(0, rows, rows)?,
        };
        let ids = StepMeta::tokens(meta, rows)?;
        let mut x = self.embed_tokens.forward(&ids)?.unsqueeze(0)?;
        let ancestors = dflash_core::step::tree_ancestors(meta, rows)?;
        let mask = dflash_core::step::step_mask(meta, &ancestors, rows, cache.capacity())?;
        let shared = cache.recurrent_step.clone();
        if let Some(s) = &shared {
            s.load_tree(meta, rows)?;
        }
        let mut tap_out: Vec<Option<Tensor>> = vec![None; taps.len()];
        let mut next: Option<Tensor> = None;
        for (i, (layer, lc)) in self.layers.iter().zip(cache.layers.iter_mut()).enumerate() {
            let h = match next.take() {
                Some(h) => h,
                None => layer.input_layernorm.forward(&x, Grad::Off)?,
            };
            let a = match (&layer.mixer, lc, &shared) {
                (Mixer::Linear(d), LayerCache::Recurrent(rc), Some(s)) => {
                    let bufs = rc.step_buffers().ok_or_else(|| {
                        ModelError::InvalidInput(format!("layer {i}: no device-step buffers"))
                    })?;
                    d.forward_device(&h.squeeze(0)?, bufs, s)?.unsqueeze(0)?
                }
                (Mixer::Attention(att), LayerCache::Attention(kv), _) => {
                    att.forward_device(&h, &rope, meta, &mask, kv)?
                }
                _ => {
                    return Err(ModelError::InvalidInput(format!(
                        "layer {i}: the cache's layer kind does not match the model's"
                    )))
                }
            };
            let h = layer
                .post_attention_layernorm
                .add_then_forward(&mut x, &a)?;
            let m = layer.mlp.forward(&h)?;
            match self.layers.get(i + 1) {
                Some(nl) => next = Some(nl.input_layernorm.add_then_forward(&mut x, &m)?),
                None => x = (&x + m)?,
            }
            for (slot, &t) in tap_out.iter_mut().zip(taps) {
                if t == i {
                    *slot = Some(x.squeeze(0)?);
                }
            }
        }
        let mut out = Vec::with_capacity(2);
        match logits {
            LogitRows::None => {}
            r => {
                let x = if r == LogitRows::Last {
                    x.narrow(1, rows - 1, 1)?
                } else {
                    x
                };
                let h = self.norm.forward(&x.squeeze(0)?, Grad::Off)?;
                out.push(self.lm_head(&h)?);
            }
        }
        if !taps.is_empty() {
            let t: Vec<Tensor> = tap_out
                .into_iter()
                .map(|t| t.expect("every tap layer ran"))
                .collect();
            out.push(Tensor::cat(&t, 1)?);
        }
        Ok(out)
    }
}
