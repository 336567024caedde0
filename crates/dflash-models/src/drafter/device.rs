//! The drafter's device step: one [`DFlashDrafter::draft`] whose every length and position lives
//! in device memory, so that it replays as a CUDA graph (one per number of newly committed
//! context rows) at any cache length (`dflash_core::step`, `dflash_core::step_graph`).
//!
//! Invariants:
//! - The same [`DFlashDrafter::blocks_forward`] as training and the host path; only where the
//!   block finds its context keys differs: each layer writes the new context rows' K/V at the
//!   cache's device-held length, then the block's own K/V right after them (scratch rows past the
//!   committed length, never counted), and attends over both with every block row seeing every
//!   block row — the standard DFlash layer (non-causal, no window; other layouts take the host
//!   path).
//! - The host cache length advances by the context rows only, after the step succeeded.
//! - Needs `len + m + B ≤ capacity` (the block's scratch rows); otherwise the host path runs.

use super::model::{BlockKeys, BlockRows, DFlashDrafter, DraftCache, Kv};
use crate::target::TargetModel;
use crate::{ModelError, Result};
use candle_core::Tensor;
use dflash_core::step::{
    device_step_supported, kv_append_at, tree_attention, StepMeta, MAX_STEP_ROWS,
};
use dflash_core::step_graph::StepKey;
use dflash_core::Grad;

/// The device step's context keys (see the module invariants).
pub(crate) struct DeviceKeys<'a> {
    /// Word 0: the committed context length (where the new context rows go).
    meta_ctx: Tensor,
    /// Word 0: the committed length plus the new rows (where the block's rows go).
    meta_blk: Tensor,
    /// Every block row sees every block row (`[B, MAX_STEP_ROWS / 32]` bits).
    full_block: Tensor,
    /// The new context rows, projected (`[1, m, H]`), and their rotary tables (`[1, m, d/2]`).
    ctx: Tensor,
    ctx_cos: Tensor,
    ctx_sin: Tensor,
    cache: &'a mut DraftCache,
}

impl DFlashDrafter {
    fn table_positions(&self) -> usize {
        StepMeta::table_positions(self.cfg.max_position_embeddings)
    }

    fn rope_table(&self) -> Result<&Tensor> {
        if self.rope_table.get().is_none() {
            let t = StepMeta::rope_table(
                &self.rotary,
                self.table_positions(),
                &self.device,
                self.dtype,
            )?;
            let _ = self.rope_table.set(t);
        }
        Ok(self.rope_table.get().expect("set above"))
    }

    /// One layer's attention in the device step: new context rows and the block's rows into the
    /// cache at device-held rows, then the block over everything before and including them.
    pub(super) fn device_block_attention(
        &self,
        li: usize,
        q: &Tensor,
        blk: &Kv,
        keys: &mut DeviceKeys,
        scale: f64,
    ) -> Result<Tensor> {
        let (nkv, hd) = (self.cfg.num_key_value_heads, self.cfg.head_dim);
        let ctx = self.kv_at(
            &self.layers[li],
            &keys.ctx,
            &keys.ctx_cos,
            &keys.ctx_sin,
            Grad::Off,
        )?;
        let (kb, vb) = keys.cache.layers[li].buffers_for(nkv, hd, self.dtype, &self.device)?;
        kv_append_at(&kb, &vb, &ctx.k, &ctx.v, &keys.meta_ctx)?;
        kv_append_at(&kb, &vb, &blk.k, &blk.v, &keys.meta_blk)?;
        Ok(tree_attention(
            q,
            &kb,
            &vb,
            &keys.meta_blk,
            &keys.full_block,
            scale as f32,
        )?)
    }

    /// [`DFlashDrafter::draft`] as a device step when it can be one (CUDA with the fused decode
    /// kernels, standard DFlash layers, new context rows, room for the block's scratch rows);
    /// `None` otherwise.
    pub(super) fn try_draft_on_device(
        &self,
        target: &dyn TargetModel,
        cache: &mut DraftCache,
        new_ctx: &Tensor,
        bonus: u32,
        start: usize,
    ) -> Result<Option<Tensor>> {
        let bs = self.cfg.block_size;
        let m = new_ctx.dim(0)?;
        let len = cache.len();
        let capacity = cache.layers.first().map(|c| c.capacity()).unwrap_or(0);
        let table = self.table_positions();
        let supported = dflash_core::decode_ops::fused_decode(&self.device)
            && device_step_supported(&self.device, self.dtype, self.cfg.head_dim)
            && (1..=MAX_STEP_ROWS).contains(&m)
            && bs <= MAX_STEP_ROWS
            && len + m + bs <= capacity
            && start + bs <= table
            && (0..self.layers.len()).all(|i| {
                let a = self.cfg.layer_attention(i);
                !a.causal && a.window.is_none()
            });
        if !supported {
            return Ok(None);
        }
        let mut words = Vec::with_capacity(2 + bs + 2 * m + 2 * bs);
        words.push(len as u32);
        words.push((len + m) as u32);
        words.push(bonus);
        words.extend(std::iter::repeat_n(self.mask_token_id(), bs - 1));
        let ctx_pos = len as u32..start as u32;
        let blk_pos = start as u32..(start + bs) as u32;
        words.extend(ctx_pos.clone());
        words.extend(ctx_pos.map(|p| p + table as u32));
        words.extend(blk_pos.clone());
        words.extend(blk_pos.map(|p| p + table as u32));
        if cache.full_block.as_ref().map(|t| t.dims()[0]) != Some(bs) {
            let per_row = MAX_STEP_ROWS / 32;
            let bits: Vec<u32> = (0..bs * per_row)
                .map(|i| {
                    let w = i % per_row;
                    let lo = 32 * w;
                    match bs.saturating_sub(lo) {
                        0 => 0,
                        n if n >= 32 => u32::MAX,
                        n => (1u32 << n) - 1,
                    }
                })
                .collect();
            cache.full_block = Some(Tensor::from_vec(bits, (bs, per_row), &self.device)?);
            // graphs bake in the bits' address
            cache.graphs = Default::default();
        }
        let full_block = cache.full_block.clone().expect("made above");
        let table_t = self.rope_table()?.clone();
        let key = StepKey {
            rows: m,
            outputs: 0,
            taps: vec![bs],
        };
        let device = self.device.clone();
        let mut graphs = std::mem::take(&mut cache.graphs);
        let out = graphs.run(key, &words, &[new_ctx], &device, &mut |meta, inputs| {
            self.device_draft_body(target, meta, &inputs[0], &table_t, &full_block, cache)
                .map_err(ModelError::into_core)
        });
        cache.graphs = graphs;
        let mut out = out?;
        for c in &mut cache.layers {
            c.advance(m)?;
        }
        Ok(Some(out.remove(0)))
    }

    /// The draft from the device metadata alone: `[B−1, V]` f32 logits of block rows `1..B`.
    fn device_draft_body(
        &self,
        target: &dyn TargetModel,
        meta: &Tensor,
        new_ctx: &Tensor,
        table: &Tensor,
        full_block: &Tensor,
        cache: &mut DraftCache,
    ) -> Result<Vec<Tensor>> {
        let bs = self.cfg.block_size;
        let m = new_ctx.dim(0)?;
        let ctx = self.project_context(new_ctx, Grad::Off)?;
        let ctx_tab = table.index_select(&meta.narrow(0, 2 + bs, 2 * m)?, 0)?;
        let blk_tab = table.index_select(&meta.narrow(0, 2 + bs + 2 * m, 2 * bs)?, 0)?;
        let ids = meta.narrow(0, 2, bs)?.reshape((1, bs))?;
        let x = self.block_embedding(target, &ids)?;
        let rows = BlockRows {
            b: 1,
            x,
            cos: blk_tab.narrow(0, 0, bs)?.unsqueeze(0)?,
            sin: blk_tab.narrow(0, bs, bs)?.unsqueeze(0)?,
            anchors: &[],
        };
        let keys = BlockKeys::Device(DeviceKeys {
            meta_ctx: meta.narrow(0, 0, 1)?,
            meta_blk: meta.narrow(0, 1, 1)?,
            full_block: full_block.clone(),
            ctx,
            ctx_cos: ctx_tab.narrow(0, 0, m)?.unsqueeze(0)?,
            ctx_sin: ctx_tab.narrow(0, m, m)?.unsqueeze(0)?,
            cache,
        });
        let hidden = self.blocks_hidden(rows, keys)?;
        Ok(vec![self.logits(target, &hidden.narrow(0, 1, bs - 1)?)?])
    }
}
