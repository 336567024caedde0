//! The drafter's device step: one [`DFlashDrafter::draft`] whose every length and position lives
//! in device memory, so that it replays as a CUDA graph (one per number of newly committed
//! context rows) at any cache length (`dflash_core::step`, `dflash_core::step_graph`).
//!
//! Invariants:
//! - The same [`DFlashDrafter::blocks_forward`] as training and the host path, the same math;
//!   only the kernels and where the block finds its context keys differ. Each layer projects the
//!   new context rows and the block's rows together (one GEMM over the stacked q/k/v weights; under
//!   `DFLASH_DRAFT_ROWS_IN_PLACE=1` its input is one buffer a step — the context rows written once,
//!   each layer's normed block rows written after them by the add+norm before it — instead of a
//!   concatenation a layer), one kernel norms and rotates the heads and writes their K/V at the
//!   cache's device-held length — context rows first, the block's right after them (scratch rows
//!   past the committed length, never counted) — and the block's q (from the kernel under that
//!   switch, narrowed after it otherwise) attends over both: every block row sees every block row in
//!   non-causal layers, the rows before it in causal ones, and the cached keys within its window
//!   in sliding-window layers (the z-lab block layout; other block layouts take the host path).
//!   The residual adds, norms and the MLP take the decode step's fused kernels (add+norm, gate-up
//!   as one GEMM, silu·mul, the down projection; the activation folded into the streaming down
//!   projection under `DFLASH_SILU_EPILOGUE=1`).
//! - The stacked weights ([`FusedLayer`]) are made on the first device draft, never in training.
//! - The host cache length advances by the context rows only, after the step succeeded.
//! - Needs `len + m + B ≤ capacity` (the block's scratch rows); otherwise the host path runs.
//! - Heads of the dense targets' step, or 256-wide heads in bf16 (the hybrids' drafters; their
//!   block attends on the 256-wide tensor-core kernel); otherwise the host path runs.
//! - Non-causal layers without a window, causal layers (causal block bits) and sliding windows of
//!   at least the block (`tree_attention_in_window`); `DFLASH_DRAFT_STEP_WINDOWS=0` sends drafters
//!   with causal or windowed layers to the host path.

use super::model::{BlockKeys, BlockRows, DFlashDrafter, DraftCache, DraftLayer};
use crate::projection::project;
use crate::target::TargetModel;
use crate::{ModelError, Result};
use candle_core::Tensor;
use candle_nn::Linear;
use dflash_core::step::{
    add_rms_norm_into, qkv_heads_into_cache, step_attention_takes, tree_attention_in_window,
    StepMeta, MAX_STEP_ROWS,
};
use dflash_core::step_graph::StepKey;
use dflash_core::RmsNorm;

/// Whether drafters with causal or sliding-window layers (the z-lab Qwen3.6-27B drafter: four
/// causal 2,048-key windows and a full layer) draft on the device step: causal layers with the
/// causal block bits, windowed ones on the windowed attention (each block row sees the cached
/// keys within its window; a window of at least the block). The default since session 26 (its
/// H100 draft block at the Qwen3.6-27B shape, context 1,024: 5.07 ms on the host path, 2.47 on
/// the device step); `DFLASH_DRAFT_STEP_WINDOWS=0` (read once) keeps them on the host path.
fn windowed_layers_on_device() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DFLASH_DRAFT_STEP_WINDOWS").as_deref() != Ok("0"))
}

/// Whether the device step's q/k/v GEMM reads one buffer a step (the context rows written once,
/// each layer's normed block rows written after them by the add+norm before it) and the heads
/// kernel returns q of the block's rows alone — 2 copies a step instead of 3 a layer (session 37;
/// the same arithmetic). Opt-in (`DFLASH_DRAFT_ROWS_IN_PLACE=1`, read once) until measured on a
/// GPU: the default concatenates the context and block rows a layer and narrows q after the heads.
fn rows_in_place() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DFLASH_DRAFT_ROWS_IN_PLACE").as_deref() == Ok("1"))
}

/// `[B, MAX_STEP_ROWS / 32]` visibility bits over the block's rows: row r sees rows
/// `0..visible(r)`.
fn block_bits(
    bs: usize,
    visible: impl Fn(usize) -> usize,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let per_row = MAX_STEP_ROWS / 32;
    let bits: Vec<u32> = (0..bs * per_row)
        .map(|i| {
            let (r, w) = (i / per_row, i % per_row);
            match visible(r).saturating_sub(32 * w) {
                0 => 0,
                n if n >= 32 => u32::MAX,
                n => (1u32 << n) - 1,
            }
        })
        .collect();
    Ok(Tensor::from_vec(bits, (bs, per_row), device)?)
}

/// The device step's context keys (see the module invariants).
pub(crate) struct DeviceKeys<'a> {
    /// Word 0: the committed context length (where the new context rows go).
    meta_ctx: Tensor,
    /// Word 0: the committed length plus the new rows (where the block's rows go).
    meta_blk: Tensor,
    /// Every block row sees every block row (`[B, MAX_STEP_ROWS / 32]` bits).
    full_block: Tensor,
    /// Block row i sees block rows 0..=i (causal layers; the same layout).
    causal_block: Tensor,
    /// The new context rows, projected (`[1, m, H]`).
    ctx: Tensor,
    /// Under [`rows_in_place`], the q/k/v GEMM's input `[1, m + B, H]`: the context rows (written
    /// once a step), then the block's rows (each layer's normed input: written there by the
    /// add+norm before it, or copied in by the layer when `block_rows_ready` is false).
    rows: Option<Tensor>,
    /// The number of new context rows `m`.
    m: usize,
    /// Whether rows `m..` of `rows` hold this layer's normed input already.
    block_rows_ready: bool,
    /// cos then sin of the context rows and then the block's rows (`[2·(m + B), d/2]`).
    cos_sin: Tensor,
    cache: &'a mut DraftCache,
}

/// One drafter layer's weights stacked for the device step (see the module invariants).
#[derive(Clone)]
pub(crate) struct FusedLayer {
    /// `[q; k; v]` projection rows.
    qkv: Linear,
    /// q_norm then k_norm weights `[2, head_dim]`.
    qk_norms: Tensor,
    /// `[gate; up]` projection rows.
    gate_up: Linear,
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

    /// The stacked weights of every layer, made on the first call.
    pub(super) fn fused_layers(&self) -> Result<&[FusedLayer]> {
        if self.fused.get().is_none() {
            let cat = |ws: &[&Tensor]| -> Result<Tensor> { Ok(Tensor::cat(ws, 0)?) };
            let layers = self
                .layers
                .iter()
                .map(|l| {
                    Ok(FusedLayer {
                        qkv: Linear::new(
                            cat(&[l.q_proj.weight(), l.k_proj.weight(), l.v_proj.weight()])?,
                            None,
                        ),
                        qk_norms: Tensor::stack(&[l.q_norm.weight(), l.k_norm.weight()], 0)?,
                        gate_up: Linear::new(
                            cat(&[l.gate_proj.weight(), l.up_proj.weight()])?,
                            None,
                        ),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let _ = self.fused.set(layers);
        }
        Ok(self.fused.get().expect("set above"))
    }

    /// One layer's attention in the device step from its normed input `h` (`[1, B, H]`): q/k/v
    /// of the new context rows and the block's rows in one GEMM, their heads normed and rotated
    /// with k and v written into the cache (context rows at the committed length, the block's
    /// after them), then the block over everything before and including its own rows. Returns
    /// the o_proj input `[1, B, heads·d]`.
    pub(super) fn device_layer_attention(
        &self,
        li: usize,
        h: &Tensor,
        keys: &mut DeviceKeys,
    ) -> Result<Tensor> {
        let layer: &DraftLayer = &self.layers[li];
        let fused = &self.fused_layers()?[li];
        let (nh, nkv, hd) = (
            self.cfg.num_attention_heads,
            self.cfg.num_key_value_heads,
            self.cfg.head_dim,
        );
        let (m, bs) = (keys.m, h.dim(1)?);
        let y = match &keys.rows {
            Some(rows) => {
                if !keys.block_rows_ready {
                    rows.slice_set(h, 1, m)?;
                }
                project(&fused.qkv, rows)?
            }
            None => project(&fused.qkv, &Tensor::cat(&[&keys.ctx, h], 1)?)?,
        };
        keys.block_rows_ready = false;
        let y = y.reshape((m + bs, ()))?;
        let (kb, vb) = keys.cache.layers[li].buffers_for(nkv, hd, self.dtype, &self.device)?;
        // q of the block's rows alone (the context rows only give keys): from the kernel under
        // rows_in_place, else narrowed after it
        let q_from = if keys.rows.is_some() { m } else { 0 };
        let q = qkv_heads_into_cache(
            &y,
            &keys.cos_sin,
            Some(&fused.qk_norms),
            (nh, nkv, hd),
            self.rotary.rotary_dim(),
            layer.q_norm.eps(),
            &kb,
            &vb,
            &keys.meta_ctx,
            q_from,
        )?;
        let q = match q_from {
            0 => q.narrow(2, m, bs)?.contiguous()?,
            _ => q,
        };
        let scale = 1.0 / (hd as f32).sqrt();
        let a = self.cfg.layer_attention(li);
        let o = tree_attention_in_window(
            &q,
            &kb,
            &vb,
            &keys.meta_blk,
            if a.causal {
                &keys.causal_block
            } else {
                &keys.full_block
            },
            scale,
            a.window.unwrap_or(0),
        )?;
        Ok(o)
    }

    /// The residual add `x + d` and the next layer's input norm in the device step as one kernel:
    /// under [`rows_in_place`] the normed rows written straight into the next q/k/v GEMM's input
    /// after the context rows (no concatenation a layer). Returns the sum and the normed rows (a
    /// view of that input); `None` where the caller adds and norms itself.
    pub(super) fn device_add_norm_next(
        &self,
        x: &Tensor,
        d: &Tensor,
        norm: &RmsNorm,
        keys: &mut DeviceKeys,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let Some(rows) = &keys.rows else {
            return Ok(norm.add_forward(x, d)?);
        };
        let sum = add_rms_norm_into(x, d, norm.weight(), norm.eps(), rows, keys.m)?;
        keys.block_rows_ready = true;
        Ok(Some((sum, rows.narrow(1, keys.m, x.dim(1)?)?)))
    }

    /// The MLP in the device step: gate and up as one GEMM, then silu·mul and the down
    /// projection (one streaming kernel under `DFLASH_SILU_EPILOGUE=1`, where the policy takes the
    /// weight).
    pub(super) fn device_layer_mlp(&self, li: usize, h: &Tensor) -> Result<Tensor> {
        let gate_up = project(&self.fused_layers()?[li].gate_up, h)?;
        let down = &self.layers[li].down_proj;
        if let Some(y) = dflash_core::stream_gemm::stream_silu_matmul(&gate_up, down.weight())? {
            return Ok(y);
        }
        project(down, &dflash_core::decode_ops::silu_mul(&gate_up)?)
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
            // the dense targets' heads, or the hybrids' 256-wide ones in bf16 (their drafts ran on
            // the host path before session 25: 2.7–4.3 ms a block at Qwen3.5-4B on an H100)
            && step_attention_takes(&self.device, self.dtype, self.cfg.head_dim)
            && (1..=MAX_STEP_ROWS).contains(&m)
            && bs <= MAX_STEP_ROWS
            && len + m + bs <= capacity
            && start + bs <= table
            && self.block_convention() == Default::default()
            && (0..self.layers.len()).all(|i| {
                let a = self.cfg.layer_attention(i);
                (!a.causal && a.window.is_none())
                    || (windowed_layers_on_device() && a.window.is_none_or(|w| bs <= w))
            });
        if !supported {
            return Ok(None);
        }
        let mut words = Vec::with_capacity(2 + bs + 2 * (m + bs));
        words.push(len as u32);
        words.push((len + m) as u32);
        words.push(bonus);
        words.extend(std::iter::repeat_n(self.mask_token_id(), bs - 1));
        // rope-table rows: cos of the context rows and the block's (positions len .. start + B),
        // then their sin
        let all_pos = len as u32..(start + bs) as u32;
        words.extend(all_pos.clone());
        words.extend(all_pos.map(|p| p + table as u32));
        if cache.full_block.as_ref().map(|t| t.dims()[0]) != Some(bs) {
            cache.full_block = Some(block_bits(bs, |_| bs, &self.device)?);
            cache.causal_block = Some(block_bits(bs, |r| r + 1, &self.device)?);
            // graphs bake in the bits' address
            cache.graphs = Default::default();
        }
        let full_block = cache.full_block.clone().expect("made above");
        let causal_block = cache.causal_block.clone().expect("made above");
        let table_t = self.rope_table()?.clone();
        let key = StepKey {
            rows: m,
            outputs: 0,
            taps: vec![bs],
        };
        let device = self.device.clone();
        let mut graphs = std::mem::take(&mut cache.graphs);
        let out = graphs.run(key, &words, &[new_ctx], &device, &mut |meta, inputs| {
            let bits = (&full_block, &causal_block);
            self.device_draft_body(target, meta, &inputs[0], &table_t, bits, cache)
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
        (full_block, causal_block): (&Tensor, &Tensor),
        cache: &mut DraftCache,
    ) -> Result<Vec<Tensor>> {
        let bs = self.cfg.block_size;
        let m = new_ctx.dim(0)?;
        let ctx = self.project_context(new_ctx, dflash_core::Grad::Off)?;
        let qkv_rows = match rows_in_place() {
            true => {
                let shape = (1, m + bs, self.cfg.hidden_size);
                // SAFETY: rows 0..m are written now, rows m.. by each layer before its GEMM
                // reads them.
                let rows = unsafe { Tensor::empty(shape, self.dtype, &self.device)? };
                rows.slice_set(&ctx, 1, 0)?;
                Some(rows)
            }
            false => None,
        };
        let cos_sin = table.index_select(&meta.narrow(0, 2 + bs, 2 * (m + bs))?, 0)?;
        let ids = meta.narrow(0, 2, bs)?.reshape((1, bs))?;
        let x = self.block_embedding(target, &ids)?;
        let rows = BlockRows {
            b: 1,
            x,
            cos: cos_sin.narrow(0, m, bs)?.unsqueeze(0)?,
            sin: cos_sin.narrow(0, 2 * m + bs, bs)?.unsqueeze(0)?,
            anchors: &[],
        };
        let keys = BlockKeys::Device(DeviceKeys {
            meta_ctx: meta.narrow(0, 0, 1)?,
            meta_blk: meta.narrow(0, 1, 1)?,
            full_block: full_block.clone(),
            causal_block: causal_block.clone(),
            ctx,
            rows: qkv_rows,
            m,
            block_rows_ready: false,
            cos_sin,
            cache,
        });
        let hidden = self.blocks_hidden(rows, keys)?;
        Ok(vec![self.logits(target, &hidden.narrow(0, 1, bs - 1)?)?])
    }
}
