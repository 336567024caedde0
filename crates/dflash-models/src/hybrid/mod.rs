//! Qwen3.5 / Qwen3.6 dense hybrid text models (`Qwen3_5ForCausalLM`, and the text part of
//! `Qwen3_5ForConditionalGeneration`): Gated DeltaNet layers ([`crate::gated_deltanet`]) and
//! gated full-attention layers ([`layers::GatedAttention`]), each followed by a SiLU MLP, with
//! zero-centred norms; a [`TargetModel`] like the dense [`crate::Decoder`].
//!
//! Invariants:
//! - Weights are read under `model.language_model.` (multimodal checkpoints) or `model.`
//!   (causal-LM checkpoints), whichever holds the embeddings; `lm_head.weight` is the head unless
//!   the embeddings are tied or it is absent. Vision and MTP weights are ignored.
//! - A forward takes a causal block or a token tree (`AttentionMask::Causal` / `Tree`); attention
//!   layers see the cache and their visible keys, recurrent layers follow each token's
//!   ancestors, so every tree node's logits are those of a causal forward along its path.
//!   `Full` and additive masks are refused (a recurrent layer has no way to hide a token).
//! - The cache has a [`dflash_core::RecurrentCache`] per Gated DeltaNet layer and a KV cache per
//!   attention layer; `crop` / `keep_rows` after a verify restore exactly the accepted tokens'
//!   state in both, so the decoding loops drive this model unchanged.
//! - Taps are decoder-layer outputs (HF `hidden_states[l + 1]`, before the final norm); logits
//!   are f32. On CUDA the fused decode kernels and a device step replayed as a CUDA graph
//!   (`step.rs`).
//! - Batched forwards (data regeneration, training features) take causal rows behind left
//!   padding (`causal_from`); recurrent layers read padding as zeros, which leave their state at
//!   zero, so each sequence gets exactly its unpadded result. Each sequence's recurrence runs on
//!   its own.

pub mod layers;
mod step;

use crate::config::DecoderConfig;
use crate::decoder::Mlp;
use crate::gated_deltanet::GatedDeltaNet;
use crate::target::{
    BatchForwardRequest, ForwardOutput, ForwardRequest, LogitRows, TargetInfo, TargetModel,
};
use crate::{ModelError, Result};
use candle_core::{DType, Module, Tensor, D};
use candle_nn::{Embedding, VarBuilder};
use dflash_core::{AttentionMask, Grad, LayerCache, RmsNorm, RotaryEmbedding, SequenceCache};
use layers::{unsupported_mask, zero_centred_norm, GatedAttention, Rope, ZeroCentredNorm};

/// A layer's token mixer.
enum Mixer {
    Linear(GatedDeltaNet),
    Attention(GatedAttention),
}

struct HybridLayer {
    mixer: Mixer,
    mlp: Mlp,
    input_layernorm: ZeroCentredNorm,
    post_attention_layernorm: ZeroCentredNorm,
}

/// A Qwen3.5 / Qwen3.6 dense hybrid causal LM.
pub struct HybridDecoder {
    embed_tokens: Embedding,
    layers: Vec<HybridLayer>,
    norm: ZeroCentredNorm,
    /// `[vocab, hidden]` in the compute dtype.
    lm_head: Tensor,
    lm_head_f32: std::sync::OnceLock<Tensor>,
    rotary: RotaryEmbedding,
    recurrent: Vec<bool>,
    info: TargetInfo,
    /// Forwards of up to 129 rows run as device steps (`step.rs`).
    device_step: bool,
    /// Whether this model on this device can take them (CUDA, fused decode, the layer kernels).
    device_step_supported: bool,
    /// The device step's cos-then-sin table, made on first use.
    rope_table: std::sync::OnceLock<Tensor>,
    cache_pool: dflash_core::cache_pool::CachePool<SequenceCache>,
}

/// The prefix the text model's weights live under in `vb`.
pub fn text_prefix(vb: &VarBuilder) -> &'static str {
    if vb.contains_tensor("model.language_model.embed_tokens.weight") {
        "model.language_model"
    } else {
        "model"
    }
}

impl HybridDecoder {
    /// Builds the model from HF-named weights; `vb` is at the checkpoint root.
    pub fn new(cfg: &DecoderConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate().map_err(ModelError::InvalidInput)?;
        let m = vb.pp(text_prefix(&vb));
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let embed_w = m.get((cfg.vocab_size, h), "embed_tokens.weight")?;
        let recurrent = cfg.recurrent_layers();
        let heads = (cfg.num_attention_heads, cfg.num_kv_heads(), cfg.head_dim());
        // on CUDA, gate and up as one GEMM and one silu·mul kernel (the dense decoder's MLP)
        let fused_mlp = dflash_core::decode_ops::fused_decode(vb.device());
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (i, &rec) in recurrent.iter().enumerate() {
            let l = m.pp(format!("layers.{i}"));
            let mixer = if rec {
                Mixer::Linear(GatedDeltaNet::new(
                    cfg.delta_net_shape(),
                    eps,
                    l.pp("linear_attn"),
                )?)
            } else {
                Mixer::Attention(GatedAttention::new(
                    h,
                    heads,
                    cfg.attn_output_gate(),
                    eps,
                    l.pp("self_attn"),
                )?)
            };
            layers.push(HybridLayer {
                mixer,
                mlp: Mlp::new(cfg, l.pp("mlp"), fused_mlp)?,
                input_layernorm: zero_centred_norm(l.pp("input_layernorm"), h, eps)?,
                post_attention_layernorm: zero_centred_norm(
                    l.pp("post_attention_layernorm"),
                    h,
                    eps,
                )?,
            });
        }
        let norm = zero_centred_norm(m.pp("norm"), h, eps)?;
        let lm_head = if cfg.tie_word_embeddings || !vb.contains_tensor("lm_head.weight") {
            embed_w.clone()
        } else {
            vb.get((cfg.vocab_size, h), "lm_head.weight")?
        };
        let rotary = RotaryEmbedding::new(&cfg.rope().map_err(ModelError::InvalidInput)?)?;
        let shape = cfg.delta_net_shape();
        let device_step_supported = fused_mlp
            && dflash_core::gated_delta_layer::layer_kernels_available(
                vb.device(),
                shape.key_dim,
                vb.dtype(),
                shape.conv_kernel,
            );
        // on where supported; `DFLASH_HYBRID_STEP=0` (a documented override) keeps the host path
        let device_step =
            device_step_supported && std::env::var("DFLASH_HYBRID_STEP").as_deref() != Ok("0");
        Ok(Self {
            embed_tokens: Embedding::new(embed_w, h),
            layers,
            norm,
            lm_head,
            lm_head_f32: std::sync::OnceLock::new(),
            rotary,
            recurrent,
            info: TargetInfo {
                architecture: "qwen3_5",
                hidden_size: h,
                num_layers: cfg.num_hidden_layers,
                vocab_size: cfg.vocab_size,
                max_position_embeddings: cfg.max_position_embeddings,
                dtype: vb.dtype(),
                device: vb.device().clone(),
            },
            cache_pool: Default::default(),
            device_step,
            device_step_supported,
            rope_table: std::sync::OnceLock::new(),
        })
    }

    /// The LM head as f32 (the weight itself in f32, else a copy made once).
    fn lm_head_f32(&self) -> Result<&Tensor> {
        if self.lm_head.dtype() == DType::F32 {
            return Ok(&self.lm_head);
        }
        if self.lm_head_f32.get().is_none() {
            let _ = self.lm_head_f32.set(self.lm_head.to_dtype(DType::F32)?);
        }
        Ok(self.lm_head_f32.get().expect("set above"))
    }
}

/// A layer's token mixer over its normed input `h` (`[1, n, hidden]`) and its cache: the host
/// forward's, or the device step's.
type MixerFn<'a> = dyn FnMut(&Mixer, &mut LayerCache, &Tensor) -> Result<Tensor> + 'a;

impl HybridDecoder {
    /// The decoder stack over the embeddings `x` `[1, n, hidden]` of one sequence: each layer's
    /// mixer through `mixer`, then its MLP, every residual add fused with the norm after it (one
    /// kernel on CUDA). Returns the last residual stream and the tap layers' outputs (`[1, n,
    /// hidden]` each, in `taps` order).
    fn layers_forward(
        &self,
        mut x: Tensor,
        cache: &mut SequenceCache,
        taps: &[usize],
        mixer: &mut MixerFn,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let mut tap_out: Vec<Option<Tensor>> = vec![None; taps.len()];
        // `next` carries the next layer's normed input
        let mut next: Option<Tensor> = None;
        for (i, (layer, lc)) in self.layers.iter().zip(cache.layers.iter_mut()).enumerate() {
            let h = match next.take() {
                Some(h) => h,
                None => layer.input_layernorm.forward(&x, Grad::Off)?,
            };
            let a = mixer(&layer.mixer, lc, &h).map_err(|e| match e {
                ModelError::InvalidInput(m) => ModelError::InvalidInput(format!("layer {i}: {m}")),
                e => e,
            })?;
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
                    *slot = Some(x.clone());
                }
            }
        }
        let tap_out = tap_out
            .into_iter()
            .map(|t| t.expect("every tap layer ran"))
            .collect();
        Ok((x, tap_out))
    }
}

impl TargetModel for HybridDecoder {
    fn info(&self) -> &TargetInfo {
        &self.info
    }

    fn new_cache(&self, capacity: usize) -> Result<SequenceCache> {
        Ok(SequenceCache::hybrid(
            &self.recurrent,
            capacity,
            &self.info.device,
        ))
    }

    fn take_cache(&self, capacity: usize) -> Result<SequenceCache> {
        match self.cache_pool.take(capacity) {
            Some(c) => Ok(c),
            None => self.new_cache(dflash_core::cache_pool::pooled_capacity(capacity)),
        }
    }

    fn recycle_cache(&self, cache: SequenceCache) {
        self.cache_pool.give(cache);
    }

    fn forward(&self, req: &ForwardRequest, cache: &mut SequenceCache) -> Result<ForwardOutput> {
        let n = req.tokens.len();
        if n == 0 || req.positions.len() != n {
            return Err(ModelError::InvalidInput(format!(
                "forward: {} tokens with {} positions",
                n,
                req.positions.len()
            )));
        }
        if let Some(&t) = req.taps.iter().find(|&&t| t >= self.layers.len()) {
            return Err(ModelError::InvalidInput(format!(
                "tap layer {t} >= {} layers",
                self.layers.len()
            )));
        }
        if cache.layers.len() != self.layers.len() {
            return Err(ModelError::InvalidInput(format!(
                "a cache of {} layers for a model of {}",
                cache.layers.len(),
                self.layers.len()
            )));
        }
        let parents: Option<&[i64]> = match &req.mask {
            AttentionMask::Causal => None,
            AttentionMask::Tree { parents } => Some(parents),
            AttentionMask::Full => return Err(unsupported_mask("full")),
            AttentionMask::Additive(_) => return Err(unsupported_mask("additive")),
        };
        if let Some(p) = parents {
            dflash_core::gated_delta::tree_depths(p)?;
        }
        if let Some(out) = self.try_device_step(req, parents, cache)? {
            return Ok(out);
        }
        // every layer's pending replay (a crop or compaction after the last verify) at once
        cache.settle_recurrent()?;
        let dev = &self.info.device;
        let past = cache.len();
        let mask = req.mask.build(n, past + n, dev)?;
        let (cos, sin) = self.rotary.cos_sin(req.positions, dev, self.info.dtype)?;
        let rope = Rope {
            emb: &self.rotary,
            cos,
            sin,
            packed: None,
        };
        let ids = Tensor::from_slice(req.tokens, n, dev)?;
        let x = self.embed_tokens.forward(&ids)?.unsqueeze(0)?;
        let (x, taps) =
            self.layers_forward(x, cache, req.taps, &mut |mixer, lc, h| match (mixer, lc) {
                (Mixer::Linear(d), LayerCache::Recurrent(rc)) => Ok(d
                    .forward_cached(&h.squeeze(0)?, rc, parents)?
                    .unsqueeze(0)?),
                (Mixer::Attention(att), LayerCache::Attention(kv)) => {
                    att.forward(h, &rope, mask.as_ref(), kv)
                }
                _ => Err(ModelError::InvalidInput(
                    "the cache's layer kind does not match the model's".into(),
                )),
            })?;
        let taps = taps
            .iter()
            .map(|t| Ok(t.squeeze(0)?))
            .collect::<Result<_>>()?;
        let logits = match req.logits {
            LogitRows::None => None,
            rows => {
                let x = match rows {
                    LogitRows::Last => x.narrow(1, n - 1, 1)?,
                    _ => x,
                };
                let h = self.norm.forward(&x.squeeze(0)?, Grad::Off)?;
                Some(self.lm_head(&h)?)
            }
        };
        Ok(ForwardOutput::new(logits, taps))
    }

    fn forward_batch(
        &self,
        req: &BatchForwardRequest,
        cache: &mut SequenceCache,
    ) -> Result<ForwardOutput> {
        let b = req.batch;
        let total = req.tokens.len();
        if b == 0 || total == 0 || !total.is_multiple_of(b) || req.positions.len() != total {
            return Err(ModelError::InvalidInput(format!(
                "batched forward: {total} tokens, {} positions for a batch of {b}",
                req.positions.len()
            )));
        }
        let Some(first) = req.causal_from.filter(|f| f.len() == b) else {
            return Err(unsupported_mask("arbitrary batched"));
        };
        if let Some(&t) = req.taps.iter().find(|&&t| t >= self.layers.len()) {
            return Err(ModelError::InvalidInput(format!(
                "tap layer {t} >= {} layers",
                self.layers.len()
            )));
        }
        let n = total / b;
        let dev = &self.info.device;
        let past = cache.len();
        if req.mask.dims() != [b, n, past + n] {
            return Err(ModelError::InvalidInput(format!(
                "batched forward: mask {:?}, expected [{b}, {n}, {}]",
                req.mask.dims(),
                past + n
            )));
        }
        let (cos, sin) = self.rotary.cos_sin(req.positions, dev, self.info.dtype)?;
        let half = cos.dim(1)?;
        let rope = Rope {
            emb: &self.rotary,
            cos: cos.reshape((b, n, half))?,
            sin: sin.reshape((b, n, half))?,
            packed: None,
        };
        let mask = req.mask.to_dtype(DType::F32)?;
        // a recurrent layer reads left padding as zeros, which keep its state at zero (exact)
        let keep: Vec<f32> = (0..b)
            .flat_map(|r| (0..n).map(move |i| ((past + i) as u32 >= first[r]) as u8 as f32))
            .collect();
        let keep = Tensor::from_vec(keep, (b, n, 1), dev)?.to_dtype(self.info.dtype)?;
        let ids = Tensor::from_slice(req.tokens, (b, n), dev)?;
        let mut x = self.embed_tokens.forward(&ids)?;
        let mut taps: Vec<Option<Tensor>> = vec![None; req.taps.len()];
        for (i, (layer, lc)) in self.layers.iter().zip(cache.layers.iter_mut()).enumerate() {
            let h = layer.input_layernorm.forward(&x, Grad::Off)?;
            let a = match (&layer.mixer, lc) {
                (Mixer::Linear(d), LayerCache::Recurrent(rc)) => {
                    let h = h.broadcast_mul(&keep)?;
                    let mut outs = Vec::with_capacity(b);
                    let mut ends = Vec::with_capacity(b);
                    for (r, st) in rc.batch_states(b)?.into_iter().enumerate() {
                        let st = match st {
                            Some(s) => s,
                            None => d.new_state()?,
                        };
                        let f = d.forward_tree(&h.get(r)?, &st, None)?;
                        outs.push(f.out);
                        ends.push(f.end.expect("a chain has an end state"));
                    }
                    rc.commit_batch(n, ends)?;
                    Tensor::stack(&outs, 0)?
                }
                (Mixer::Attention(att), LayerCache::Attention(kv)) => {
                    att.forward(&h, &rope, Some(&mask), kv)?
                }
                _ => {
                    return Err(ModelError::InvalidInput(format!(
                        "layer {i}: the cache's layer kind does not match the model's"
                    )))
                }
            };
            x = (x + a)?;
            let h = layer.post_attention_layernorm.forward(&x, Grad::Off)?;
            x = (&x + layer.mlp.forward(&h)?)?;
            for (slot, &t) in taps.iter_mut().zip(req.taps) {
                if t == i {
                    *slot = Some(x.clone());
                }
            }
        }
        let taps = taps
            .into_iter()
            .map(|t| t.expect("every tap layer ran"))
            .collect();
        let x = match req.logits {
            LogitRows::None => return Ok(ForwardOutput::new(None, taps)),
            LogitRows::Last => x.narrow(1, n - 1, 1)?,
            LogitRows::All => x,
        };
        let rows = x.dim(1)?;
        let h = self.norm.forward(&x.contiguous()?, Grad::Off)?;
        let logits = self.lm_head(&h.reshape((b * rows, ()))?)?;
        Ok(ForwardOutput::new(
            Some(logits.reshape((b, rows, ()))?),
            taps,
        ))
    }

    fn final_norm(&self) -> Option<RmsNorm> {
        // the effective weight (1 + w, f32): what a plain-weight norm needs to compute the same
        Some(self.norm.as_plain().clone())
    }

    fn embed(&self, tokens: &Tensor) -> Result<Tensor> {
        Ok(self.embed_tokens.forward(tokens)?)
    }

    fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        let w = &self.lm_head;
        if let Some(y) = dflash_core::stream_gemm::stream_matmul(hidden, w, true)? {
            return Ok(y);
        }
        if hidden.device().is_cuda() && hidden.dtype() == w.dtype() && w.dtype() != DType::F32 {
            let (lead, h) = (&hidden.dims()[..hidden.rank() - 1], hidden.dim(D::Minus1)?);
            let mut shape = lead.to_vec();
            shape.push(w.dim(0)?);
            let x = hidden.reshape(((), h))?;
            return Ok(dflash_core::decode_ops::matmul_t_f32(&x, w)?.reshape(shape)?);
        }
        Ok(hidden
            .to_dtype(DType::F32)?
            .broadcast_matmul(&self.lm_head_f32()?.t()?)?)
    }

    fn lm_head_input_grad(&self, grad_logits: &Tensor) -> Result<Tensor> {
        Ok(grad_logits
            .to_dtype(DType::F32)?
            .contiguous()?
            .matmul(self.lm_head_f32()?)?)
    }
}
