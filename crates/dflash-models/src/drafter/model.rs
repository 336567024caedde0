//! The DFlash drafter: Qwen3-style layers whose queries come from a block `[anchor, mask × (B−1)]`
//! and whose keys/values are the projected target context followed by the block (KV injection).
//!
//! One implementation serves inference and training:
//! - [`DFlashDrafter::draft`] (inference) appends the newly committed context rows to a per-layer
//!   cache of context K/V and runs one block; block K/V are never cached.
//! - [`DFlashDrafter::forward_train_batch`] runs many blocks of many sequences at once (a block
//!   sees context strictly before its anchor plus its own block, through the two-part
//!   [`block_attention`]), with differentiable ops; [`DFlashDrafter::forward_train`] is one sequence.
//!
//! Both go through [`DFlashDrafter::blocks_forward`], so the same anchors give the same logits
//! (tested). Slot 0 of a block is the anchor token's *target embedding*; the embedding and LM head
//! are the target's (borrowed per call, never copied), with the checkpoint's
//! `input_embedding_scale`, `output_multiplier` and `final_logit_softcapping` applied where z-lab's
//! reference applies them (identities by default); positions are absolute token positions.
//! Both lay the block out by the config's declared [`BlockConvention`] (default: the z-lab layout,
//! slot `j` at `anchor + j`, slot 0 the anchor's token), so a drafter trained with another
//! layout is decoded with the one it was trained with.

pub use super::cache::DraftCache;
use super::config::{BlockConvention, DFlashConfig, LayerAttention};
use crate::projection::project_with;
use crate::target::TargetModel;
use crate::{ModelError, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, VarBuilder};
use dflash_core::block_attention::{block_attention, HIDDEN};
use dflash_core::flash_block::{self, flash_block_attention};
use dflash_core::{Grad, KvCache, RmsNorm, RotaryEmbedding};

fn linear(vb: &VarBuilder, in_dim: usize, out_dim: usize, name: &str) -> Result<Linear> {
    Ok(Linear::new(
        vb.get((out_dim, in_dim), &format!("{name}.weight"))?,
        None,
    ))
}

#[derive(Clone)]
pub(super) struct DraftLayer {
    pub(super) q_proj: Linear,
    pub(super) k_proj: Linear,
    pub(super) v_proj: Linear,
    pub(super) o_proj: Linear,
    pub(super) q_norm: RmsNorm,
    pub(super) k_norm: RmsNorm,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pub(super) gate_proj: Linear,
    pub(super) up_proj: Linear,
    pub(super) down_proj: Linear,
    attn: LayerAttention,
}

/// Context (or block) rows projected to one layer's keys and values, normed and rotated.
pub(super) struct Kv {
    pub(super) k: Tensor,
    pub(super) v: Tensor,
}

/// The query side of [`DFlashDrafter::blocks_forward`]: `b` sequences of blocks, embedded
/// (`[b, n·B, H]` in the compute dtype), with their rotary tables (`[b, n·B, d/2]`).
pub(super) struct BlockRows<'a> {
    pub(super) b: usize,
    pub(super) x: Tensor,
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
    /// Block starts (host paths: context masks and the fused kernel's visibility).
    pub(super) anchors: &'a [u32],
}

/// Where the blocks' context keys come from.
pub(super) enum BlockKeys<'a> {
    /// Per-layer context K/V (training; the host inference path), rows `0..ctx_len`.
    Host {
        ctx_kv: &'a mut dyn FnMut(usize) -> Result<Kv>,
        ctx_len: usize,
    },
    /// The device step (`device.rs`).
    Device(super::device::DeviceKeys<'a>),
}

#[derive(Clone)]
pub struct DFlashDrafter {
    pub(super) cfg: DFlashConfig,
    fc: Linear,
    hidden_norm: RmsNorm,
    pub(super) layers: Vec<DraftLayer>,
    norm: RmsNorm,
    pub(super) rotary: RotaryEmbedding,
    taps: Vec<usize>,
    pub(super) device: Device,
    pub(super) dtype: DType,
    /// cos then sin for every position `[2·P, d/2]`, made on the first device draft.
    pub(super) rope_table: std::sync::OnceLock<Tensor>,
    /// Caches handed back after generations ([`DFlashDrafter::take_cache`]); empty in a clone.
    cache_pool: dflash_core::cache_pool::CachePool<DraftCache>,
    /// Each layer's weights stacked for the device step, made on the first device draft.
    pub(super) fused: std::sync::OnceLock<Vec<super::device::FusedLayer>>,
    /// The target's final norm (f32), taken by [`DFlashDrafter::bind_target`]; applied to the
    /// last tap when the config declares `final_norm_on_last_tap`.
    target_final_norm: Option<RmsNorm>,
}

impl DraftLayer {
    fn new(cfg: &DFlashConfig, i: usize, vb: VarBuilder) -> Result<Self> {
        let (h, hd, nh, nkv, eps) = (
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.rms_norm_eps,
        );
        let a = vb.pp("self_attn");
        let m = vb.pp("mlp");
        Ok(Self {
            q_proj: linear(&a, h, nh * hd, "q_proj")?,
            k_proj: linear(&a, h, nkv * hd, "k_proj")?,
            v_proj: linear(&a, h, nkv * hd, "v_proj")?,
            o_proj: linear(&a, nh * hd, h, "o_proj")?,
            q_norm: RmsNorm::load(a.pp("q_norm"), hd, eps)?,
            k_norm: RmsNorm::load(a.pp("k_norm"), hd, eps)?,
            input_layernorm: RmsNorm::load(vb.pp("input_layernorm"), h, eps)?,
            post_attention_layernorm: RmsNorm::load(vb.pp("post_attention_layernorm"), h, eps)?,
            gate_proj: linear(&m, h, cfg.intermediate_size, "gate_proj")?,
            up_proj: linear(&m, h, cfg.intermediate_size, "up_proj")?,
            down_proj: linear(&m, cfg.intermediate_size, h, "down_proj")?,
            attn: cfg.layer_attention(i),
        })
    }
}

impl DFlashDrafter {
    pub fn new(cfg: &DFlashConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()
            .map_err(|m| ModelError::InvalidInput(format!("drafter config: {m}")))?;
        let taps = cfg.target_layer_ids();
        let h = cfg.hidden_size;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DraftLayer::new(cfg, i, vb.pp(format!("layers.{i}"))))
            .collect::<Result<_>>()?;
        Ok(Self {
            fc: linear(&vb, taps.len() * h, h, "fc")?,
            hidden_norm: RmsNorm::load(vb.pp("hidden_norm"), h, cfg.rms_norm_eps)?,
            norm: RmsNorm::load(vb.pp("norm"), h, cfg.rms_norm_eps)?,
            layers,
            rotary: RotaryEmbedding::new(&cfg.rope().map_err(ModelError::InvalidInput)?)?,
            taps,
            device: vb.device().clone(),
            dtype: vb.dtype(),
            cfg: cfg.clone(),
            rope_table: std::sync::OnceLock::new(),
            cache_pool: Default::default(),
            fused: std::sync::OnceLock::new(),
            target_final_norm: None,
        })
    }

    pub fn config(&self) -> &DFlashConfig {
        &self.cfg
    }

    /// The same weights with another RoPE base and scaling (`dflash diagnose` feeds a drafter the
    /// target's RoPE when its config declares another).
    pub fn with_rope(&self, theta: f64, scaling: Option<dflash_core::RopeScaling>) -> Result<Self> {
        let mut rope = self.cfg.rope().map_err(ModelError::InvalidInput)?;
        rope.theta = theta;
        rope.scaling = scaling;
        let mut d = self.clone();
        d.cfg.rope_theta = theta;
        d.rotary = RotaryEmbedding::new(&rope)?;
        d.rope_table = std::sync::OnceLock::new();
        Ok(d)
    }
    /// The same weights with another mask token (`dflash diagnose` measures the alternatives).
    pub fn with_mask_token(&self, id: u32) -> Self {
        let mut d = self.clone();
        d.cfg.dflash_config.mask_token_id = Some(id);
        d.cfg.mask_token_id = None;
        d
    }

    /// The same weights with every layer's attention set to `attn` (`dflash diagnose` measures
    /// full attention against a declared sliding window, and the reverse).
    pub fn with_attention(&self, attn: LayerAttention) -> Self {
        let mut d = self.clone();
        for l in &mut d.layers {
            l.attn = attn;
        }
        d.fused = std::sync::OnceLock::new();
        d
    }
    /// The same weights with the target's final norm on the last tap (`on`) or not, whatever
    /// the config declares (`dflash diagnose` measures the other way round).
    pub fn with_final_norm_on_last_tap(&self, on: bool) -> Self {
        let mut d = self.clone();
        d.cfg.set_final_norm_on_last_tap(on);
        d
    }

    /// The block layout the config declares, which training, validation and decoding all use.
    pub fn block_convention(&self) -> BlockConvention {
        self.cfg.block_convention()
    }

    /// Each layer's attention (causality and window), in order.
    pub fn layer_attention(&self) -> Vec<LayerAttention> {
        self.layers.iter().map(|l| l.attn).collect()
    }

    pub fn block_size(&self) -> usize {
        self.cfg.block_size
    }
    /// Drafts blocks of `b` tokens at inference (`2 <= b`; a drafter trained at B is best used at
    /// B or below).
    pub fn set_block_size(&mut self, b: usize) -> Result<()> {
        if b < 2 {
            return Err(ModelError::InvalidInput(format!(
                "block size {b} must be at least 2"
            )));
        }
        self.cfg.block_size = b;
        Ok(())
    }
    /// Target layers whose outputs feed the drafter, in concatenation order.
    pub fn target_layers(&self) -> &[usize] {
        &self.taps
    }
    pub fn mask_token_id(&self) -> u32 {
        self.cfg.mask_token_id().expect("validated in new")
    }

    /// Refuses a target this drafter was not built for, naming both values, and takes what the
    /// declared conventions need from it (its final norm, for `final_norm_on_last_tap`). Every
    /// caller pairing a drafter with a target binds it first; a drafter declaring the final norm
    /// and never bound refuses to draft.
    pub fn bind_target(&mut self, target: &dyn TargetModel) -> Result<()> {
        self.check_target(target)?;
        self.target_final_norm = target
            .final_norm()
            .map(|n| -> Result<RmsNorm> {
                let w = n.weight().to_dtype(DType::F32)?.to_device(&self.device)?;
                Ok(RmsNorm::new(w, n.eps()))
            })
            .transpose()?;
        if self.cfg.final_norm_on_last_tap() && self.target_final_norm.is_none() {
            return Err(ModelError::Mismatch(
                "the drafter declares dflash_config.final_norm_on_last_tap, but the target has no final norm".into(),
            ));
        }
        Ok(())
    }

    fn check_target(&self, target: &dyn TargetModel) -> Result<()> {
        let t = target.info();
        let c = &self.cfg;
        let mismatch = |what: &str, d: usize, tv: usize| {
            Err(ModelError::Mismatch(format!(
                "{what}: drafter {d}, target {tv}"
            )))
        };
        if c.hidden_size != t.hidden_size {
            return mismatch("hidden size", c.hidden_size, t.hidden_size);
        }
        if c.num_target_layers != t.num_layers {
            return mismatch("number of target layers", c.num_target_layers, t.num_layers);
        }
        if c.vocab_size != t.vocab_size {
            return mismatch("vocabulary size", c.vocab_size, t.vocab_size);
        }
        if self.mask_token_id() as usize >= t.vocab_size {
            return mismatch(
                "mask token id (must be < target embedding rows)",
                self.mask_token_id() as usize,
                t.vocab_size,
            );
        }
        Ok(())
    }

    /// An empty cache of at least `capacity` positions from the pool of caches handed back by
    /// [`DFlashDrafter::recycle_cache`] (its CUDA graphs replay instead of being captured again),
    /// else a new one (`dflash_core::cache_pool`).
    pub fn take_cache(&self, capacity: usize) -> DraftCache {
        self.cache_pool
            .take(capacity)
            .unwrap_or_else(|| self.new_cache(dflash_core::cache_pool::pooled_capacity(capacity)))
    }

    /// Hands a cache back after a generation, for a later [`DFlashDrafter::take_cache`].
    pub fn recycle_cache(&self, cache: DraftCache) {
        self.cache_pool.give(cache);
    }

    pub fn new_cache(&self, capacity: usize) -> DraftCache {
        DraftCache {
            layers: self.layers.iter().map(|_| KvCache::new(capacity)).collect(),
            graphs: Default::default(),
            full_block: None,
            causal_block: None,
        }
    }

    /// `hidden_norm(fc(concat taps))`: `[n, T·H] -> [1, n, H]`, or `[b, n, T·H] -> [b, n, H]`;
    /// with `final_norm_on_last_tap` declared, the last tap goes through the target's final
    /// norm first (in f32).
    pub(super) fn project_context(&self, feats: &Tensor, grad: Grad) -> Result<Tensor> {
        let feats = if self.cfg.final_norm_on_last_tap() {
            let norm = self.target_final_norm.as_ref().ok_or_else(|| {
                ModelError::InvalidInput(
                    "the drafter declares dflash_config.final_norm_on_last_tap but was never bound to a target's final norm (DFlashDrafter::bind_target)".into(),
                )
            })?;
            let (last, width) = (feats.rank() - 1, feats.dim(feats.rank() - 1)?);
            let h = self.cfg.hidden_size;
            let head = feats.narrow(last, 0, width - h)?;
            let tail = feats.narrow(last, width - h, h)?.to_dtype(DType::F32)?;
            let tail = norm.forward(&tail.contiguous()?, grad)?;
            Tensor::cat(
                &[head.to_dtype(self.dtype)?, tail.to_dtype(self.dtype)?],
                last,
            )?
        } else {
            feats.to_dtype(self.dtype)?
        };
        let x = project_with(&self.fc, &feats, grad)?;
        let x = self.hidden_norm.forward(&x, grad)?;
        Ok(if x.rank() == 2 { x.unsqueeze(0)? } else { x })
    }

    /// Keys and values of rows `x` `[b, m, H]` at `positions` (`[m]`, shared by the batch).
    fn kv(&self, layer: &DraftLayer, x: &Tensor, positions: &[u32], grad: Grad) -> Result<Kv> {
        let (cos, sin) = self.rotary.cos_sin(positions, &self.device, self.dtype)?;
        self.kv_at(layer, x, &cos, &sin, grad)
    }

    /// Keys and values of rows `x` rotated by `cos`/`sin` (`[m, d/2]` or `[b, m, d/2]`).
    pub(super) fn kv_at(
        &self,
        layer: &DraftLayer,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        grad: Grad,
    ) -> Result<Kv> {
        let (b, n, _) = x.dims3()?;
        let (nkv, hd) = (self.cfg.num_key_value_heads, self.cfg.head_dim);
        let k = project_with(&layer.k_proj, x, grad)?.reshape((b, n, nkv, hd))?;
        let k = layer
            .k_norm
            .forward(&k, grad)?
            .transpose(1, 2)?
            .contiguous()?;
        let v = project_with(&layer.v_proj, x, grad)?
            .reshape((b, n, nkv, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        Ok(Kv {
            k: self.rotary.apply(&k, cos, sin, grad)?,
            v,
        })
    }

    /// Context visibility `[b, n, 1 | B, S]` for blocks at `anchors` (`[b·n]`): a block sees the
    /// context rows strictly before its anchor (and, in a windowed layer, within the window of each
    /// slot). `None` when every row is visible (inference: one block right after its context).
    fn context_mask(
        &self,
        attn: LayerAttention,
        b: usize,
        anchors: &[u32],
        s: usize,
    ) -> Result<Option<Tensor>> {
        let n = anchors.len() / b;
        let bs = self.cfg.block_size;
        let before_anchor_only = anchors.iter().all(|&a| a as usize >= s);
        let window_hides = attn.window.is_some_and(|w| s + bs > w);
        if before_anchor_only && !window_hides {
            return Ok(None);
        }
        let dev = &self.device;
        let anc: Vec<f32> = anchors.iter().map(|&a| a as f32).collect();
        let anc = Tensor::from_vec(anc, (b, n, 1, 1), dev)?;
        let kpos = Tensor::arange(0f32, s as f32, dev)?.reshape((1, 1, 1, s))?;
        let mut hidden = kpos.broadcast_ge(&anc)?;
        if let Some(w) = attn.window {
            let slot = Tensor::arange(0f32, bs as f32, dev)?.reshape((1, 1, bs, 1))?;
            let qpos = anc.broadcast_add(&slot)?;
            // hidden where q_pos − k_pos ≥ w
            let far = qpos.broadcast_sub(&kpos)?.ge(w as f64)?;
            hidden = hidden.broadcast_maximum(&far)?;
        }
        Ok(Some((hidden.to_dtype(DType::F32)? * HIDDEN as f64)?))
    }

    /// Visibility inside a block `[B, B]` (causal and/or windowed layers), `None` when full.
    fn block_mask(&self, attn: LayerAttention) -> Result<Option<Tensor>> {
        let bs = self.cfg.block_size;
        let mut m = vec![0f32; bs * bs];
        let mut all = true;
        for i in 0..bs {
            for j in 0..bs {
                let d = i as i64 - j as i64;
                let mut visible = !attn.causal || d >= 0;
                if let Some(w) = attn.window {
                    visible &= d < w as i64 && (attn.causal || -d < w as i64);
                }
                if !visible {
                    m[i * bs + j] = HIDDEN;
                    all = false;
                }
            }
        }
        if all {
            return Ok(None);
        }
        Ok(Some(Tensor::from_vec(m, (bs, bs), &self.device)?))
    }

    /// Token ids and rotary tables of `b` sequences of blocks (`tokens` `[b·n·B]`, `anchors`
    /// `[b·n]`, row-major), made on the host.
    fn host_block_rows<'a>(
        &self,
        target: &dyn TargetModel,
        b: usize,
        tokens: &[u32],
        anchors: &'a [u32],
        position_offset: i64,
    ) -> Result<BlockRows<'a>> {
        let bs = self.cfg.block_size;
        let rows = tokens.len() / b;
        let q_pos: Vec<u32> = (0..tokens.len())
            .map(|i| {
                let p = anchors[i / bs] as i64 + (i % bs) as i64 + position_offset;
                p.max(0) as u32
            })
            .collect();
        let ids = Tensor::from_slice(tokens, (b, rows), &self.device)?;
        let x = self.block_embedding(target, &ids)?;
        let (cos, sin) = self.rotary.cos_sin(&q_pos, &self.device, self.dtype)?;
        let half = cos.dim(1)?;
        Ok(BlockRows {
            b,
            x,
            cos: cos.reshape((b, rows, half))?,
            sin: sin.reshape((b, rows, half))?,
            anchors,
        })
    }

    /// The shared core: `rows.b` sequences of blocks (embedded block tokens `[b, n·B, H]` and
    /// their rotary tables) against context keys from `keys`: per-layer context K/V `[b,
    /// kv_heads, S, d]` whose row `j` sits at position `j` (training, the host inference path),
    /// or the drafter cache read at device-held lengths (the device step). Returns the final
    /// hidden states `[b·n·B, H]` (after `norm`).
    fn blocks_forward(&self, rows: BlockRows, mut keys: BlockKeys, grad: Grad) -> Result<Tensor> {
        let bs = self.cfg.block_size;
        let (nh, hd) = (self.cfg.num_attention_heads, self.cfg.head_dim);
        let BlockRows {
            b,
            mut x,
            cos,
            sin,
            anchors,
        } = rows;
        let n_rows = x.dim(1)?;
        let scale = 1.0 / (hd as f64).sqrt();
        // masks per distinct layer visibility (layers usually share them)
        type Masks = (Option<Tensor>, Option<Tensor>);
        let mut masks: Vec<(LayerAttention, Masks)> = vec![];
        // the device step: each residual add and the norm after it are one kernel (`next`
        // carries the next layer's normed input), the MLP's gate and up one GEMM
        let device_step = matches!(keys, BlockKeys::Device(_));
        let add_norm =
            |x: &Tensor, d: &Tensor, norm: &RmsNorm| -> Result<Option<(Tensor, Tensor)>> {
                match device_step {
                    true => Ok(norm.add_forward(x, d)?),
                    false => Ok(None),
                }
            };
        let mut next: Option<Tensor> = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let h = match next.take() {
                Some(h) => h,
                None => layer.input_layernorm.forward(&x, grad)?,
            };
            let o = match &mut keys {
                BlockKeys::Device(dk) => self.device_layer_attention(li, &h, dk)?,
                BlockKeys::Host { ctx_kv, ctx_len } => {
                    let q = project_with(&layer.q_proj, &h, grad)?.reshape((b, n_rows, nh, hd))?;
                    let q = layer
                        .q_norm
                        .forward(&q, grad)?
                        .transpose(1, 2)?
                        .contiguous()?;
                    let q = self.rotary.apply(&q, &cos, &sin, grad)?;
                    let blk = self.kv_at(layer, &h, &cos, &sin, grad)?;
                    let ctx_len = *ctx_len;
                    let ctx = ctx_kv(li)?;
                    // context rows each block sees, for the fused kernel
                    let visible: Vec<u32> =
                        anchors.iter().map(|&a| a.min(ctx_len as u32)).collect();
                    // the fused kernels take the standard DFlash layer: context before the
                    // anchor, the whole own block
                    let fused = if flash_block::use_fused(&self.device, b * n_rows * (ctx_len + bs))
                        && layer.attn.window.is_none()
                        && !layer.attn.causal
                    {
                        flash_block_attention(
                            &q, &ctx.k, &ctx.v, &blk.k, &blk.v, &visible, bs, scale,
                        )?
                    } else {
                        None
                    };
                    match fused {
                        Some(o) => o,
                        None => {
                            let (cm, bm) = match masks.iter().find(|(a, _)| *a == layer.attn) {
                                Some((_, m)) => m.clone(),
                                None => {
                                    let m = (
                                        self.context_mask(layer.attn, b, anchors, ctx_len)?,
                                        self.block_mask(layer.attn)?,
                                    );
                                    masks.push((layer.attn, m.clone()));
                                    m
                                }
                            };
                            block_attention(
                                &q,
                                &ctx.k,
                                &ctx.v,
                                &blk.k,
                                &blk.v,
                                cm.as_ref(),
                                bm.as_ref(),
                                bs,
                                scale,
                            )?
                        }
                    }
                }
            };
            let a = project_with(&layer.o_proj, &o, grad)?;
            let h = match add_norm(&x, &a, &layer.post_attention_layernorm)? {
                Some((sum, normed)) => {
                    x = sum;
                    normed
                }
                None => {
                    x = (x + a)?;
                    layer.post_attention_layernorm.forward(&x, grad)?
                }
            };
            let mlp = if device_step {
                self.device_layer_mlp(li, &h)?
            } else {
                let g = candle_nn::ops::silu(&project_with(&layer.gate_proj, &h, grad)?)?;
                let u = project_with(&layer.up_proj, &h, grad)?;
                project_with(&layer.down_proj, &(g * u)?, grad)?
            };
            let fused_next = match (self.layers.get(li + 1), &mut keys) {
                (Some(nl), BlockKeys::Device(dk)) => {
                    self.device_add_norm_next(&x, &mlp, &nl.input_layernorm, dk)?
                }
                // the host path adds and norms itself (`add_norm` fuses on the device step only)
                _ => None,
            };
            match fused_next {
                Some((sum, normed)) => {
                    x = sum;
                    next = Some(normed);
                }
                None => x = (&x + mlp)?,
            }
        }
        let hidden = x.reshape((b * n_rows, ()))?;
        Ok(self.norm.forward(&hidden, grad)?)
    }

    /// The final norm over the blocks' hidden states (see [`DFlashDrafter::blocks_forward`]).
    pub(super) fn blocks_hidden(&self, rows: BlockRows, keys: BlockKeys) -> Result<Tensor> {
        self.blocks_forward(rows, keys, Grad::Off)
    }

    /// Inference: commit `new_ctx` (`[m, T·H]` taps of the tokens at positions `start−m .. start`)
    /// to `cache`, then draft the block `[bonus, mask × (B−1)]` at positions `start ..` (as the
    /// declared [`BlockConvention`] lays it out). Returns the
    /// logits `[B−1, V]` (f32) for block rows `1..B`.
    pub fn draft(
        &self,
        target: &dyn TargetModel,
        cache: &mut DraftCache,
        new_ctx: &Tensor,
        bonus: u32,
        start: usize,
    ) -> Result<Tensor> {
        let m = new_ctx.dim(0)?;
        if cache.len() + m != start {
            return Err(ModelError::InvalidInput(format!(
                "drafter cache holds {} rows + {m} new, but the block starts at {start}",
                cache.len()
            )));
        }
        if let Some(logits) = self.try_draft_on_device(target, cache, new_ctx, bonus, start)? {
            return Ok(logits);
        }
        let new_pos: Vec<u32> = (cache.len() as u32..start as u32).collect();
        let projected = if m > 0 {
            Some(self.project_context(new_ctx, Grad::Off)?)
        } else {
            None
        };
        let mut fill = |li: usize| -> Result<Kv> {
            let c = &mut cache.layers[li];
            let (k, v) = match &projected {
                Some(p) => {
                    let kv = self.kv(&self.layers[li], p, &new_pos, Grad::Off)?;
                    c.append(&kv.k, &kv.v)?
                }
                None => c
                    .view()?
                    .ok_or_else(|| ModelError::InvalidInput("drafter has no context".into()))?,
            };
            Ok(Kv { k, v })
        };
        let conv = self.block_convention();
        let mut tokens = vec![self.mask_token_id(); self.cfg.block_size];
        if !conv.anchor_slot_masked {
            tokens[0] = bonus;
        }
        let anchors = [start as u32];
        let rows = self.host_block_rows(target, 1, &tokens, &anchors, conv.position_offset)?;
        let keys = BlockKeys::Host {
            ctx_kv: &mut fill,
            ctx_len: start,
        };
        let hidden = self.blocks_forward(rows, keys, Grad::Off)?;
        self.logits(target, &hidden.narrow(0, 1, self.cfg.block_size - 1)?)
    }

    /// Training: all blocks of one sequence at once. `ctx` `[S, T·H]` are the taps of the whole
    /// sequence (positions `0..S`), `tokens` `[S]` the sequence, `anchors` the block starts. Returns
    /// logits `[nb, B, V]` (f32); row `k` of block `b` predicts the token at `anchors[b] + k`.
    pub fn forward_train(
        &self,
        target: &dyn TargetModel,
        ctx: &Tensor,
        tokens: &[u32],
        anchors: &[u32],
        grad: Grad,
    ) -> Result<Tensor> {
        let conv = self.block_convention();
        self.forward_train_with(target, ctx, tokens, anchors, grad, &conv)
    }

    /// The drafter's logits of `hidden`: the target's LM head, then the checkpoint's output
    /// multiplier and soft cap (z-lab's `compute_logits`; both identities unless configured).
    pub fn logits(&self, target: &dyn TargetModel, hidden: &Tensor) -> Result<Tensor> {
        let mut logits = target.lm_head(hidden)?;
        let m = self.cfg.output_multiplier();
        if m != 1.0 {
            logits = (logits * m)?;
        }
        if let Some(c) = self.cfg.final_logit_softcapping() {
            logits = ((logits / c)?.tanh()? * c)?;
        }
        Ok(logits)
    }

    /// Whether [`DFlashDrafter::logits`] is the target's LM head as is (training's loss, which
    /// multiplies the head in chunks itself, needs it to be).
    pub fn plain_logits(&self) -> bool {
        self.cfg.output_multiplier() == 1.0 && self.cfg.final_logit_softcapping().is_none()
    }

    /// The block rows' input: the target's embeddings of `ids` in the drafter's dtype, times the
    /// checkpoint's `input_embedding_scale` (when not 1).
    pub(super) fn block_embedding(&self, target: &dyn TargetModel, ids: &Tensor) -> Result<Tensor> {
        let x = target.embed(ids)?.to_dtype(self.dtype)?;
        let scale = self.cfg.input_embedding_scale();
        Ok(if scale != 1.0 { (x * scale)? } else { x })
    }

    /// [`DFlashDrafter::forward_train`] with the blocks laid out by `conv`.
    pub fn forward_train_with(
        &self,
        target: &dyn TargetModel,
        ctx: &Tensor,
        tokens: &[u32],
        anchors: &[u32],
        grad: Grad,
        conv: &BlockConvention,
    ) -> Result<Tensor> {
        let ctx = ctx.unsqueeze(0)?;
        let hidden = self.forward_train_batch_with(target, &ctx, tokens, anchors, grad, conv)?;
        Ok(self
            .logits(target, &hidden)?
            .reshape((anchors.len(), self.cfg.block_size, ()))?)
    }

    /// Training over `b` right-padded sequences at once: `ctx` `[b, S, T·H]` their taps (row `j` at
    /// position `j`), `tokens` `[b·S]` row-major, `anchors` `[b·n]` (`n` block starts per sequence,
    /// each `< S`; a sequence with fewer real blocks repeats any anchor and gives those rows no loss
    /// weight). Slot 0 of each block is the anchor's token, the rest the mask token (the declared
    /// [`BlockConvention`]). Returns the
    /// normed hidden states `[b·n·B, H]` in the compute dtype, row `(i·n + k)·B + j` for slot `j` of
    /// block `k` of sequence `i` (it predicts the token at `anchor + j`); the caller applies the
    /// target's LM head to the rows it trains on.
    pub fn forward_train_batch(
        &self,
        target: &dyn TargetModel,
        ctx: &Tensor,
        tokens: &[u32],
        anchors: &[u32],
        grad: Grad,
    ) -> Result<Tensor> {
        let conv = self.block_convention();
        self.forward_train_batch_with(target, ctx, tokens, anchors, grad, &conv)
    }

    /// [`DFlashDrafter::forward_train_batch`] with the blocks laid out by `conv`.
    pub fn forward_train_batch_with(
        &self,
        target: &dyn TargetModel,
        ctx: &Tensor,
        tokens: &[u32],
        anchors: &[u32],
        grad: Grad,
        conv: &BlockConvention,
    ) -> Result<Tensor> {
        let (b, s, _) = ctx.dims3()?;
        if tokens.len() != b * s || b == 0 || anchors.is_empty() || !anchors.len().is_multiple_of(b)
        {
            return Err(ModelError::InvalidInput(format!(
                "{} tokens and {} anchors for {b} sequences of {s} context rows",
                tokens.len(),
                anchors.len()
            )));
        }
        let n = anchors.len() / b;
        let bs = self.cfg.block_size;
        let mut block_tokens = vec![self.mask_token_id(); anchors.len() * bs];
        for (k, &a) in anchors.iter().enumerate() {
            let a = a as usize;
            if a >= s {
                return Err(ModelError::InvalidInput(format!(
                    "anchor {a} outside the sequence of {s}"
                )));
            }
            if !conv.anchor_slot_masked {
                block_tokens[k * bs] = tokens[(k / n) * s + a];
            }
        }
        let ctx_pos: Vec<u32> = (0..s as u32).collect();
        let projected = self.project_context(ctx, grad)?;
        // one rotary table for the context rows, shared by every layer
        let (cos, sin) = self.rotary.cos_sin(&ctx_pos, &self.device, self.dtype)?;
        let mut ctx_kv = |li: usize| self.kv_at(&self.layers[li], &projected, &cos, &sin, grad);
        let rows = self.host_block_rows(target, b, &block_tokens, anchors, conv.position_offset)?;
        let keys = BlockKeys::Host {
            ctx_kv: &mut ctx_kv,
            ctx_len: s,
        };
        self.blocks_forward(rows, keys, grad)
    }
}
