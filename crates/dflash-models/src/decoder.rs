//! Llama-family and Qwen3 dense decoders, written for speculative decoding: explicit positions,
//! arbitrary attention layouts over a croppable cache, and hidden-state taps.
//!
//! Invariants: modules mirror the HF checkpoint names (`model.layers.N.self_attn.q_proj` …); Qwen3
//! differs from Llama only by per-head `q_norm`/`k_norm` applied before RoPE; a tied LM head reads
//! `model.embed_tokens.weight`; logits are always f32 with f32 accumulation, so they never carry
//! bf16 ties: on CUDA the bf16/f16 head multiplies in cuBLAS with f32 compute and output (no f32
//! weight copy); an f32 copy of the head is made only on first need (the CPU in a low dtype, an
//! f32 input against a low-precision head, training's input gradient).

use crate::config::{Architecture, DecoderConfig};
use crate::projection::{project, Projections};
use crate::target::{
    BatchForwardRequest, ForwardOutput, ForwardRequest, LogitRows, TargetInfo, TargetModel,
};
use crate::{ModelError, Result};
use candle_core::{DType, Module, Tensor, D};
use candle_nn::{Embedding, Linear, VarBuilder};
pub(crate) mod step;

use dflash_core::{
    attention, flash_block, AttentionMask, Grad, KvCache, LayerCache, RmsNorm, RotaryEmbedding,
    SequenceCache,
};

fn linear(vb: &VarBuilder, in_dim: usize, out_dim: usize, name: &str) -> Result<Linear> {
    Ok(Linear::new(
        vb.get((out_dim, in_dim), &format!("{name}.weight"))?,
        None,
    ))
}

struct Attention {
    /// q, k, v: three GEMMs (the checkpoint's layout), or on CUDA one GEMM over their rows
    /// stacked `[q; k; v]` (decided at load, [`dflash_core::decode_ops::fused_decode`]).
    qkv: Projections,
    /// q_norm then k_norm weights `[2, head_dim]` (Qwen3, fused decode only).
    qk_norms: Option<Tensor>,
    /// The one-kernel q/k/v heads path applies (fused projection, a supported head shape).
    fast_heads: bool,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    fn new(cfg: &DecoderConfig, arch: Architecture, vb: VarBuilder, fused: bool) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_kv_heads());
        let norms = arch == Architecture::Qwen3;
        let (q_proj, k_proj, v_proj) = (
            linear(&vb, h, nh * hd, "q_proj")?,
            linear(&vb, h, nkv * hd, "k_proj")?,
            linear(&vb, h, nkv * hd, "v_proj")?,
        );
        let qkv = Projections::new(vec![q_proj, k_proj, v_proj], fused)?;
        let q_norm = if norms {
            Some(RmsNorm::load(vb.pp("q_norm"), hd, cfg.rms_norm_eps)?)
        } else {
            None
        };
        let k_norm = if norms {
            Some(RmsNorm::load(vb.pp("k_norm"), hd, cfg.rms_norm_eps)?)
        } else {
            None
        };
        let qk_norms = match (&q_norm, &k_norm, fused) {
            (Some(q), Some(k), true) => Some(Tensor::stack(&[q.weight(), k.weight()], 0)?),
            _ => None,
        };
        let fast_heads =
            fused && hd % 32 == 0 && hd <= 1024 && matches!(vb.dtype(), DType::F32 | DType::BF16);
        Ok(Self {
            qkv,
            qk_norms,
            fast_heads,
            o_proj: linear(&vb, nh * hd, h, "o_proj")?,
            q_norm,
            k_norm,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
        })
    }

    /// Queries, keys and values `[b, n, heads·head_dim]` of `x`.
    fn project(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        match self.qkv.forward(x)?.as_slice() {
            [q, k, v] => Ok((q.clone(), k.clone(), v.clone())),
            _ => Err(ModelError::InvalidInput("q/k/v: three projections".into())),
        }
    }

    /// `causal_from`: `mask` is causal with each sequence's keys before its entry hidden (see
    /// `BatchForwardRequest::causal_from`), so the fused kernel may replace it
    /// (`DFLASH_FUSED_ATTENTION=1`).
    fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        keys: &KeyLayout,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let (mask, causal_from) = match keys {
            KeyLayout::Host { mask, causal_from } => (*mask, *causal_from),
            KeyLayout::Device {
                meta,
                ancestors,
                causal,
            } => return self.forward_device(x, rope, meta, (ancestors, *causal), cache),
        };
        let heads = |t: Tensor, nh: usize, norm: &Option<RmsNorm>| -> Result<Tensor> {
            let t = t.reshape((b, n, nh, self.head_dim))?;
            let t = match norm {
                Some(nm) => nm.forward(&t, Grad::Off)?,
                None => t,
            };
            Ok(t.transpose(1, 2)?.contiguous()?)
        };
        let one_kernel = match (self.qkv.stacked(), &rope.packed) {
            (Some(w), Some(cs)) if self.fast_heads && b == 1 => {
                let y = project(w, x)?.reshape((n, ()))?;
                let eps = self.q_norm.as_ref().map(|q| q.eps()).unwrap_or(0.0);
                dflash_core::decode_ops::qkv_heads(
                    &y,
                    cs,
                    self.qk_norms.as_ref(),
                    self.n_heads,
                    self.n_kv_heads,
                    self.head_dim,
                    rope.emb.rotary_dim(),
                    eps,
                )?
            }
            _ => None,
        };
        let (q, k, v) = match one_kernel {
            Some(qkv) => qkv,
            None => {
                let (q, k, v) = self.project(x)?;
                let q = heads(q, self.n_heads, &self.q_norm)?;
                let k = heads(k, self.n_kv_heads, &self.k_norm)?;
                let v = heads(v, self.n_kv_heads, &None)?;
                let q = rope.emb.apply(&q, &rope.cos, &rope.sin, Grad::Off)?;
                let k = rope.emb.apply(&k, &rope.cos, &rope.sin, Grad::Off)?;
                (q, k, v)
            }
        };
        let (k_all, v_all) = cache.append(&k, &v)?;
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let fused = match causal_from {
            Some(first) if flash_block::use_fused(x.device(), b * n * k_all.dim(2)?) => {
                flash_block::flash_causal_attention(&q, &k_all, &v_all, first, scale)?
            }
            _ => None,
        };
        let o = match fused {
            Some(o) => o,
            None => attention(&q, &k_all, &v_all, mask, scale, Grad::Off)?,
        };
        let o = o
            .transpose(1, 2)?
            .reshape((b, n, self.n_heads * self.head_dim))?;
        project(&self.o_proj, &o)
    }

    /// The device step's attention: one kernel for the q/k/v heads that also writes k and v at
    /// the cache rows the metadata names, the tree attention over the cache buffers (lengths and
    /// masks read on the device), then o_proj.
    fn forward_device(
        &self,
        x: &Tensor,
        rope: &Rope,
        meta: &Tensor,
        ancestors: (&Tensor, bool),
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let (Some(w), Some(_)) = (self.qkv.stacked(), &rope.packed) else {
            return Err(ModelError::InvalidInput(
                "device step without the fused q/k/v projection".into(),
            ));
        };
        let n = x.dim(1)?;
        let y = project(w, x)?.reshape((n, ()))?;
        self.forward_device_from_qkv(y, rope, meta, ancestors, cache)
    }

    /// The fused q/k/v projection's weight, when the device step can take this layer.
    fn fused_qkv_weight(&self, rope: &Rope) -> Option<&Tensor> {
        match (self.qkv.stacked(), &rope.packed) {
            (Some(w), Some(_)) => Some(w.weight()),
            _ => None,
        }
    }

    /// [`Self::forward_device`] from the q/k/v projection's output `y` (`[n, (H + 2·KV)·d]`);
    /// `ancestors`: the step's ancestor records and whether the step is a causal block.
    fn forward_device_from_qkv(
        &self,
        y: Tensor,
        rope: &Rope,
        meta: &Tensor,
        (ancestors, causal): (&Tensor, bool),
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let Some(cs) = &rope.packed else {
            return Err(ModelError::InvalidInput(
                "device step without the packed rope table".into(),
            ));
        };
        let eps = self.q_norm.as_ref().map(|q| q.eps()).unwrap_or(0.0);
        let (kb, vb) = cache.buffers_for(self.n_kv_heads, self.head_dim, y.dtype(), y.device())?;
        let q = dflash_core::step::qkv_heads_into_cache(
            &y,
            cs,
            self.qk_norms.as_ref(),
            (self.n_heads, self.n_kv_heads, self.head_dim),
            rope.emb.rotary_dim(),
            eps,
            &kb,
            &vb,
            meta,
            0,
        )?;
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        let o = if causal {
            dflash_core::step::causal_block_attention(&q, &kb, &vb, meta, ancestors, scale)?
        } else {
            dflash_core::step::tree_attention(&q, &kb, &vb, meta, ancestors, scale)?
        };
        project(&self.o_proj, &o)
    }
}

/// Where attention finds its keys' visibility: a mask built on the host (any forward), or the
/// device step's metadata (lengths, positions and tree parents in device memory).
pub(crate) enum KeyLayout<'a> {
    Host {
        mask: Option<&'a Tensor>,
        causal_from: Option<&'a [u32]>,
    },
    Device {
        meta: &'a Tensor,
        /// Each row's ancestors-or-self: bits, depth and path (`dflash_core::step::tree_ancestors`).
        ancestors: &'a Tensor,
        /// A causal block (its rows at consecutive positions, each seeing the ones before it), not
        /// a tree: `dflash_core::step::causal_block_attention`.
        causal: bool,
    },
}

/// The MLP: gate and up as two GEMMs (the checkpoint's layout), or on CUDA one GEMM over their
/// rows stacked `[gate; up]` followed by one silu·mul kernel (under `DFLASH_SILU_EPILOGUE=1`, for
/// bf16 rows on the streaming GEMM, folded into the down projection's streaming GEMM).
enum GateUp {
    Separate { gate_proj: Linear, up_proj: Linear },
    Fused(Linear),
}

pub(crate) struct Mlp {
    gate_up: GateUp,
    down_proj: Linear,
}

impl Mlp {
    pub(crate) fn new(cfg: &DecoderConfig, vb: VarBuilder, fused: bool) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (gate_proj, up_proj) = (
            linear(&vb, h, i, "gate_proj")?,
            linear(&vb, h, i, "up_proj")?,
        );
        let gate_up = if fused {
            let w = Tensor::cat(&[gate_proj.weight(), up_proj.weight()], 0)?;
            GateUp::Fused(Linear::new(w, None))
        } else {
            GateUp::Separate { gate_proj, up_proj }
        };
        Ok(Self {
            gate_up,
            down_proj: linear(&vb, i, h, "down_proj")?,
        })
    }
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = match &self.gate_up {
            GateUp::Separate { gate_proj, up_proj } => {
                (candle_nn::ops::silu(&project(gate_proj, x)?)? * project(up_proj, x)?)?
            }
            GateUp::Fused(w) => return self.forward_from_gate_up(project(w, x)?),
        };
        project(&self.down_proj, &h)
    }

    /// The MLP after its fused gate-up projection (`gate_up = [gate | up]`).
    fn forward_from_gate_up(&self, gate_up: Tensor) -> Result<Tensor> {
        let down = self.down_proj.weight();
        if let Some(y) = dflash_core::stream_gemm::stream_silu_matmul(&gate_up, down)? {
            return Ok(y);
        }
        project(
            &self.down_proj,
            &dflash_core::decode_ops::silu_mul(&gate_up)?,
        )
    }

    /// The fused gate-up projection's weight, if the MLP has one.
    fn fused_gate_up_weight(&self) -> Option<&Tensor> {
        match &self.gate_up {
            GateUp::Fused(w) => Some(w.weight()),
            GateUp::Separate { .. } => None,
        }
    }
}

struct DecoderLayer {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

struct Rope<'a> {
    emb: &'a RotaryEmbedding,
    cos: Tensor,
    sin: Tensor,
    /// cos then sin `[2·n, rot/2]` for [`dflash_core::decode_ops::qkv_heads`] (one sequence, fused
    /// decode only).
    packed: Option<Tensor>,
}

/// A Llama or Qwen3 causal LM.
pub struct Decoder {
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// `[vocab, hidden]` in the compute dtype.
    lm_head: Tensor,
    lm_head_f32: std::sync::OnceLock<Tensor>,
    /// Decode-step fusions on (CUDA; fixed at load, see `dflash_core::decode_ops::fused_decode`).
    fused: bool,
    /// Forwards of up to 129 rows (288 under `--bit-exact`) run as device steps (CUDA graphs; see
    /// `step.rs`).
    device_step: bool,
    /// cos then sin for every position `[2·P, rot/2]`, made on the first device step.
    rope_table: std::sync::OnceLock<Tensor>,
    rotary: RotaryEmbedding,
    info: TargetInfo,
    /// Single-sequence caches handed back after generations (`take_cache` / `recycle_cache`).
    cache_pool: dflash_core::cache_pool::CachePool<SequenceCache>,
}

impl Decoder {
    /// Builds the model from HF-named weights. `vb` is at the checkpoint root.
    pub fn new(cfg: &DecoderConfig, arch: Architecture, vb: VarBuilder) -> Result<Self> {
        let m = vb.pp("model");
        let fused = dflash_core::decode_ops::fused_decode(vb.device());
        let embed_w = m.get((cfg.vocab_size, cfg.hidden_size), "embed_tokens.weight")?;
        let embed_tokens = Embedding::new(embed_w.clone(), cfg.hidden_size);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = m.pp(format!("layers.{i}"));
            layers.push(DecoderLayer {
                self_attn: Attention::new(cfg, arch, l.pp("self_attn"), fused)?,
                mlp: Mlp::new(cfg, l.pp("mlp"), fused)?,
                input_layernorm: RmsNorm::load(
                    l.pp("input_layernorm"),
                    cfg.hidden_size,
                    cfg.rms_norm_eps,
                )?,
                post_attention_layernorm: RmsNorm::load(
                    l.pp("post_attention_layernorm"),
                    cfg.hidden_size,
                    cfg.rms_norm_eps,
                )?,
            });
        }
        let norm = RmsNorm::load(m.pp("norm"), cfg.hidden_size, cfg.rms_norm_eps)?;
        let head_w = if cfg.tie_word_embeddings || !vb.contains_tensor("lm_head.weight") {
            embed_w
        } else {
            vb.get((cfg.vocab_size, cfg.hidden_size), "lm_head.weight")?
        };
        // Logits are computed in f32 whatever the compute dtype: bf16 logits are so coarse (steps
        // of 0.125 near 20) that greedy argmax meets exact ties on real prompts.
        let lm_head = head_w;
        let rotary = RotaryEmbedding::new(&cfg.rope().map_err(ModelError::InvalidInput)?)?;
        let info = TargetInfo {
            architecture: arch.as_str(),
            hidden_size: cfg.hidden_size,
            num_layers: cfg.num_hidden_layers,
            vocab_size: cfg.vocab_size,
            max_position_embeddings: cfg.max_position_embeddings,
            dtype: vb.dtype(),
            device: vb.device().clone(),
        };
        let device_step = fused
            && layers.iter().all(|l| l.self_attn.fast_heads)
            && dflash_core::step::device_step_supported(vb.device(), vb.dtype(), cfg.head_dim());
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            lm_head_f32: std::sync::OnceLock::new(),
            fused,
            device_step,
            rope_table: std::sync::OnceLock::new(),
            cache_pool: Default::default(),
            rotary,
            info,
        })
    }
}

impl Decoder {
    /// The LM head as f32 (the weight itself when the compute dtype is f32, else a copy made once).
    fn lm_head_f32(&self) -> Result<&Tensor> {
        if self.lm_head.dtype() == DType::F32 {
            return Ok(&self.lm_head);
        }
        if self.lm_head_f32.get().is_none() {
            let _ = self.lm_head_f32.set(self.lm_head.to_dtype(DType::F32)?);
        }
        Ok(self.lm_head_f32.get().expect("set above"))
    }

    /// The decoder stack over embeddings `x` `[b, n, hidden]`; returns the last residual stream and
    /// the requested taps (`[b, n, hidden]` each).
    fn layers_forward(
        &self,
        mut x: Tensor,
        rope: &Rope,
        keys: &KeyLayout,
        cache: &mut SequenceCache,
        tap_layers: &[usize],
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let mut taps: Vec<Option<Tensor>> = vec![None; tap_layers.len()];
        // fused decode: each residual add and the norm after it are one kernel; `next` carries
        // the next layer's normed input
        let add_norm =
            |x: &Tensor, d: &Tensor, norm: &RmsNorm| -> Result<Option<(Tensor, Tensor)>> {
                match self.fused {
                    true => Ok(norm.add_forward(x, d)?),
                    false => Ok(None),
                }
            };
        // `x += d`, then `norm(x)`: one kernel where the fused decode has it
        let add_then_norm = |x: &mut Tensor, d: &Tensor, norm: &RmsNorm| -> Result<Tensor> {
            match add_norm(x, d, norm)? {
                Some((sum, normed)) => {
                    *x = sum;
                    Ok(normed)
                }
                None => {
                    *x = (&*x + d)?;
                    Ok(norm.forward(x, Grad::Off)?)
                }
            }
        };
        let mut next: Option<Tensor> = None;
        // with DFLASH_FUSED_ADD_NORM=1, in device steps: an MLP output not yet added to `x`, whose
        // add and norm run as the prologue of the next layer's q/k/v projection
        let fuse = self.fused && dflash_core::stream_gemm::fused_add_norm();
        let device = match keys {
            KeyLayout::Device {
                meta,
                ancestors,
                causal,
            } if fuse => Some((*meta, (*ancestors, *causal))),
            _ => None,
        };
        let mut pending: Option<Tensor> = None;
        for (i, (layer, lc)) in self.layers.iter().zip(cache.layers.iter_mut()).enumerate() {
            let LayerCache::Attention(kv) = lc else {
                return Err(ModelError::InvalidInput(
                    "a dense decoder was given a cache with recurrent layers".into(),
                ));
            };
            let fused_qkv = match (&pending, device, layer.self_attn.fused_qkv_weight(rope)) {
                (Some(d), Some(_), Some(w)) => {
                    let norm = &layer.input_layernorm;
                    dflash_core::stream_gemm::stream_add_norm_matmul(
                        &x,
                        d,
                        norm.weight(),
                        norm.eps(),
                        w,
                    )?
                }
                _ => None,
            };
            let a = match (fused_qkv, device) {
                (Some((sum, y)), Some((meta, ancestors))) => {
                    pending = None;
                    x = sum;
                    let n = y.dim(1)?;
                    let y = y.reshape((n, ()))?;
                    layer
                        .self_attn
                        .forward_device_from_qkv(y, rope, meta, ancestors, kv)?
                }
                _ => {
                    let h = match (next.take(), pending.take()) {
                        (Some(h), _) => h,
                        (None, Some(d)) => add_then_norm(&mut x, &d, &layer.input_layernorm)?,
                        (None, None) => layer.input_layernorm.forward(&x, Grad::Off)?,
                    };
                    layer.self_attn.forward(&h, rope, keys, kv)?
                }
            };
            let fused_mlp = match (device, layer.mlp.fused_gate_up_weight()) {
                (Some(_), Some(w)) => {
                    let norm = &layer.post_attention_layernorm;
                    dflash_core::stream_gemm::stream_add_norm_matmul(
                        &x,
                        &a,
                        norm.weight(),
                        norm.eps(),
                        w,
                    )?
                }
                _ => None,
            };
            let m = match fused_mlp {
                Some((sum, gate_up)) => {
                    x = sum;
                    layer.mlp.forward_from_gate_up(gate_up)?
                }
                None => {
                    let h = add_then_norm(&mut x, &a, &layer.post_attention_layernorm)?;
                    layer.mlp.forward(&h)?
                }
            };
            let tapped = tap_layers.contains(&i);
            if device.is_some() && i + 1 < self.layers.len() && !tapped {
                pending = Some(m);
                continue;
            }
            let fused_next = match self.layers.get(i + 1) {
                Some(nl) => add_norm(&x, &m, &nl.input_layernorm)?,
                None => None,
            };
            match fused_next {
                Some((sum, normed)) => {
                    x = sum;
                    next = Some(normed);
                }
                None => x = (&x + m)?,
            }
            for (slot, &t) in taps.iter_mut().zip(tap_layers) {
                if t == i {
                    *slot = Some(x.clone());
                }
            }
        }
        if let Some(d) = pending {
            x = (&x + d)?; // unreachable: the last layer never defers its add
        }
        let taps = taps
            .into_iter()
            .map(|t| t.expect("every tap layer ran"))
            .collect();
        Ok((x, taps))
    }
}

impl TargetModel for Decoder {
    fn info(&self) -> &TargetInfo {
        &self.info
    }

    fn new_cache(&self, capacity: usize) -> Result<SequenceCache> {
        Ok(SequenceCache::attention_only(
            self.layers.len(),
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
        if let Some(out) = self.try_device_step(req, cache)? {
            return Ok(out);
        }
        let dev = &self.info.device;
        let past = cache.len();
        let mask = req.mask.build(n, past + n, dev)?;
        let (cos, sin) = self.rotary.cos_sin(req.positions, dev, self.info.dtype)?;
        // only the one-kernel heads path reads the packed table (every layer has the same shape)
        let packed = if self.layers.first().is_some_and(|l| l.self_attn.fast_heads) {
            Some(Tensor::cat(&[&cos, &sin], 0)?)
        } else {
            None
        };
        let rope = Rope {
            emb: &self.rotary,
            cos,
            sin,
            packed,
        };
        let ids = Tensor::from_slice(req.tokens, n, dev)?;
        let x = self.embed_tokens.forward(&ids)?.unsqueeze(0)?;
        let causal_from: Option<&[u32]> = match req.mask {
            AttentionMask::Causal => Some(&[0]),
            _ => None,
        };
        let keys = KeyLayout::Host {
            mask: mask.as_ref(),
            causal_from,
        };
        let (x, taps) = self.layers_forward(x, &rope, &keys, cache, req.taps)?;
        let taps = taps
            .iter()
            .map(|t| t.squeeze(0))
            .collect::<candle_core::Result<_>>()?;
        let logits = match req.logits {
            LogitRows::None => None,
            rows => {
                let x = if rows == LogitRows::Last {
                    x.narrow(1, n - 1, 1)?
                } else {
                    x
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
        let n = total / b;
        let dev = &self.info.device;
        let kv_len = cache.len() + n;
        if req.mask.dims() != [b, n, kv_len] {
            return Err(ModelError::InvalidInput(format!(
                "batched forward: mask {:?}, expected [{b}, {n}, {kv_len}]",
                req.mask.dims()
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
        let ids = Tensor::from_slice(req.tokens, (b, n), dev)?;
        let x = self.embed_tokens.forward(&ids)?;
        let mask = req.mask.to_dtype(DType::F32)?;
        if let Some(&t) = req.taps.iter().find(|&&t| t >= self.layers.len()) {
            return Err(ModelError::InvalidInput(format!(
                "tap layer {t} >= {} layers",
                self.layers.len()
            )));
        }
        let keys = KeyLayout::Host {
            mask: Some(&mask),
            causal_from: req.causal_from,
        };
        let (x, taps) = self.layers_forward(x, &rope, &keys, cache, req.taps)?;
        let x = match req.logits {
            LogitRows::None => return Ok(ForwardOutput::new(None, taps)),
            LogitRows::Last => x.narrow(1, n - 1, 1)?,
            LogitRows::All => x,
        };
        let rows = x.dim(1)?;
        let h = self.norm.forward(&x, Grad::Off)?;
        let logits = self.lm_head(&h.reshape((b * rows, ()))?)?;
        Ok(ForwardOutput::new(
            Some(logits.reshape((b, rows, ()))?),
            taps,
        ))
    }

    fn final_norm(&self) -> Option<RmsNorm> {
        let w = self.norm.weight().to_dtype(DType::F32).ok()?;
        Some(RmsNorm::new(w, self.norm.eps()))
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
        // logits = h·Wᵀ, so dh = dlogits·W
        Ok(grad_logits
            .to_dtype(DType::F32)?
            .contiguous()?
            .matmul(self.lm_head_f32()?)?)
    }
}
