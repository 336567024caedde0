//! The pieces of a Qwen3.5 / Qwen3.6 decoder layer other than Gated DeltaNet and the MLP (the
//! dense decoder's, gate and up stacked on CUDA): the zero-centred RMSNorm and the gated
//! full-attention layer.
//!
//! Invariants:
//! - Every norm of these models (decoder, q/k, final) computes `rmsnorm(x)·(1 + w)` with a
//!   zero-initialised checkpoint weight `w`, in f32 ([`ZeroCentredNorm`]: the `1 +` folded into
//!   an f32 weight once at load). The Gated DeltaNet's own gated norm is not of this kind (its
//!   weight applies as is).
//! - Gated attention: `q_proj` yields, per head, `head_dim` query channels followed by
//!   `head_dim` gate channels; the attention output is multiplied by `sigmoid(gate)` before
//!   `o_proj`. q and k are normed per head before a partial NeoX rotary (the first
//!   `rotary_dim` channels; for text, Qwen3.5's interleaved M-RoPE is exactly this). Causal GQA,
//!   scale `head_dim^-½`, keys and values in a croppable [`KvCache`].
//! - On CUDA (f32, bf16, heads a multiple of 32 wide) q/k/v are one stacked GEMM, and the device
//!   step computes the heads in one kernel (`dflash_core::step::gated_qkv_heads_into_cache`: the
//!   norms in f32 with the `1 + w` weights, the partial RoPE, k and v into the cache) and the gate
//!   in one more (`dflash_core::decode_ops::gate_mul`, reading the gates in place) — the same map,
//!   rounded in other places than the op-by-op heads, which the host forwards keep (over the
//!   stacked GEMM's columns) and `DFLASH_GATED_HEADS=0` restores everywhere.

use crate::projection::{project, Projections};
use crate::{ModelError, Result};
use candle_core::{DType, Tensor};
use candle_nn::{Linear, VarBuilder};
use dflash_core::{attention, Grad, KvCache, RmsNorm, RotaryEmbedding};

fn linear(vb: &VarBuilder, in_dim: usize, out_dim: usize, name: &str) -> Result<Linear> {
    Ok(Linear::new(
        vb.get((out_dim, in_dim), &format!("{name}.weight"))?,
        None,
    ))
}

/// A Qwen3.5 norm `rmsnorm(x)·(1 + w)`, computed in f32 whatever the input dtype (as
/// transformers does), with the effective weight `1 + w` kept in f32.
#[derive(Debug, Clone)]
pub struct ZeroCentredNorm(RmsNorm);

impl ZeroCentredNorm {
    pub fn forward(&self, x: &Tensor, grad: Grad) -> Result<Tensor> {
        if x.dtype() == DType::F32 {
            return Ok(self.0.forward(x, grad)?);
        }
        Ok(self
            .0
            .forward(&x.to_dtype(DType::F32)?, grad)?
            .to_dtype(x.dtype())?)
    }

    /// Inference only: `(x + d, norm(x + d))` as one kernel on CUDA with the fused decode
    /// (`decode_ops::add_rms_norm`: the sum rounded to the dtype as candle's add, the norm in f32
    /// with the f32 weight, rounded once — what [`ZeroCentredNorm::forward`] computes after the
    /// add); `None` where the caller adds and norms itself.
    pub fn add_forward(&self, x: &Tensor, d: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
        if !dflash_core::decode_ops::fused_decode(x.device()) {
            return Ok(None);
        }
        Ok(self.0.add_forward(x, d)?)
    }

    /// `x += d`, then the norm of `x`: one kernel where [`ZeroCentredNorm::add_forward`] has it.
    pub fn add_then_forward(&self, x: &mut Tensor, d: &Tensor) -> Result<Tensor> {
        if let Some((sum, normed)) = self.add_forward(x, d)? {
            *x = sum;
            return Ok(normed);
        }
        *x = (&*x + d)?;
        self.forward(x, Grad::Off)
    }

    /// The effective weight `1 + w` (f32).
    pub fn weight(&self) -> &Tensor {
        self.0.weight()
    }

    /// The same norm as a plain RMSNorm over the effective weight (f32).
    pub fn as_plain(&self) -> &RmsNorm {
        &self.0
    }
}

/// The norm from the checkpoint weight `w` at `vb`.
pub fn zero_centred_norm(vb: VarBuilder, size: usize, eps: f64) -> Result<ZeroCentredNorm> {
    let w = (vb.get(size, "weight")?.to_dtype(DType::F32)? + 1.0)?;
    Ok(ZeroCentredNorm(RmsNorm::new(w, eps)))
}

/// The rotary tables of one forward, shared by every attention layer.
pub struct Rope<'a> {
    pub emb: &'a RotaryEmbedding,
    pub cos: Tensor,
    pub sin: Tensor,
    /// A device step's cos rows then sin rows (`[2·n, rotary_dim / 2]`), which the fused
    /// heads kernel reads; `None` elsewhere.
    pub packed: Option<Tensor>,
}

/// The gated full-attention layer (`self_attn`).
pub struct GatedAttention {
    /// q (with its gates), k and v: stacked where the device step's fused heads kernel runs.
    qkv: Projections,
    /// q's then k's effective norm weight (`[2, head_dim]` f32) where the device step's fused
    /// heads kernel runs (the projections then stacked).
    qk_norms: Option<Tensor>,
    o_proj: Linear,
    q_norm: ZeroCentredNorm,
    k_norm: ZeroCentredNorm,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    gated: bool,
}

impl GatedAttention {
    /// The width of a head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    pub fn new(
        hidden: usize,
        (n_heads, n_kv_heads, head_dim): (usize, usize, usize),
        gated: bool,
        eps: f64,
        vb: VarBuilder,
    ) -> Result<Self> {
        let q_rows = n_heads * head_dim * if gated { 2 } else { 1 };
        let kv_rows = n_kv_heads * head_dim;
        let (q, k, v) = (
            linear(&vb, hidden, q_rows, "q_proj")?,
            linear(&vb, hidden, kv_rows, "k_proj")?,
            linear(&vb, hidden, kv_rows, "v_proj")?,
        );
        let (q_norm, k_norm) = (
            zero_centred_norm(vb.pp("q_norm"), head_dim, eps)?,
            zero_centred_norm(vb.pp("k_norm"), head_dim, eps)?,
        );
        // the device step's fused heads (`DFLASH_GATED_HEADS=0`, read at load, keeps the
        // separate projections and the op-by-op heads: a documented override for A/B runs)
        let fused = gated
            && vb.device().is_cuda()
            && matches!(vb.dtype(), DType::F32 | DType::BF16)
            && head_dim.is_multiple_of(32)
            && head_dim <= 1024
            && std::env::var("DFLASH_GATED_HEADS").as_deref() != Ok("0");
        let qk_norms = match fused {
            true => Some(Tensor::stack(&[q_norm.weight(), k_norm.weight()], 0)?),
            false => None,
        };
        let qkv = Projections::new(vec![q, k, v], fused)?;
        Ok(Self {
            qkv,
            qk_norms,
            o_proj: linear(&vb, n_heads * head_dim, hidden, "o_proj")?,
            q_norm,
            k_norm,
            n_heads,
            n_kv_heads,
            head_dim,
            gated,
        })
    }

    /// q (`[b, heads, n, d]`, normed and rotated), k and v (`[b, kv_heads, n, d]`, k normed and
    /// rotated) and the output gate (`[b, n, heads·d]`, if the layer has one), contiguous.
    fn heads(&self, x: &Tensor, rope: &Rope) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
        let (b, n, _) = x.dims3()?;
        let hd = self.head_dim;
        let [qg, k, v]: [Tensor; 3] = self
            .qkv
            .forward(x)?
            .try_into()
            .map_err(|_| ModelError::InvalidInput("q/k/v: three projections".into()))?;
        let (q, gate) = if self.gated {
            let qg = qg.reshape((b, n, self.n_heads, 2 * hd))?;
            let gate = qg.narrow(3, hd, hd)?.reshape((b, n, self.n_heads * hd))?;
            (qg.narrow(3, 0, hd)?, Some(gate))
        } else {
            (qg.reshape((b, n, self.n_heads, hd))?, None)
        };
        let heads = |t: Tensor, norm: Option<&ZeroCentredNorm>| -> Result<Tensor> {
            let t = match norm {
                Some(nm) => nm.forward(&t.contiguous()?, Grad::Off)?,
                None => t,
            };
            Ok(t.transpose(1, 2)?.contiguous()?)
        };
        let q = heads(q, Some(&self.q_norm))?;
        let k = k.reshape((b, n, self.n_kv_heads, hd))?;
        let k = heads(k, Some(&self.k_norm))?;
        let v = v.reshape((b, n, self.n_kv_heads, hd))?;
        let v = heads(v, None)?;
        let q = rope.emb.apply(&q, &rope.cos, &rope.sin, Grad::Off)?;
        let k = rope.emb.apply(&k, &rope.cos, &rope.sin, Grad::Off)?;
        Ok((q, k, v, gate))
    }

    /// The attention output `o` (`[b, heads, n, d]`) gated and projected.
    fn output(&self, o: Tensor, gate: Gate) -> Result<Tensor> {
        let (b, _, n, hd) = o.dims4()?;
        self.output_rows(o.transpose(1, 2)?.reshape((b, n, self.n_heads * hd))?, gate)
    }

    /// The attention output in the o_proj layout (`[b, n, heads·d]`) gated and projected.
    fn output_rows(&self, o: Tensor, gate: Gate) -> Result<Tensor> {
        let o = match gate {
            Gate::Separate(Some(g)) => (o * candle_nn::ops::sigmoid(&g)?)?,
            Gate::Separate(None) => o,
            Gate::InRows(y) => {
                dflash_core::decode_ops::gate_mul(&o, &y, self.n_heads, self.head_dim)?
            }
        };
        project(&self.o_proj, &o)
    }

    /// The layer over `x` `[1, n, H]` seeing the cached keys and its own under `mask` (additive
    /// `[n, past + n]`, `None`: all visible); appends its keys and values to `cache`.
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        mask: Option<&Tensor>,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let (q, k, v, gate) = self.heads(x, rope)?;
        let (k_all, v_all) = cache.append(&k, &v)?;
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let o = attention(&q, &k_all, &v_all, mask, scale, Grad::Off)?;
        self.output(o, Gate::Separate(gate))
    }

    /// The layer in a hybrid device step (one sequence): keys and values written into the
    /// cache buffers at the length `meta` holds ([`dflash_core::step::kv_append_at`]), then
    /// attention over them under `visibility` (committed keys and each row's own path), so a CUDA
    /// graph replays it at any cache length. The cache's length is advanced by the caller.
    pub fn forward_device(
        &self,
        x: &Tensor,
        rope: &Rope,
        meta: &Tensor,
        visibility: StepVisibility,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let hd = self.head_dim;
        let (kb, vb) = cache.buffers_for(self.n_kv_heads, hd, x.dtype(), x.device())?;
        let (q, gate) = match (self.qkv.stacked(), &self.qk_norms, &rope.packed) {
            // one GEMM, then one kernel: q normed and rotated, k and v into the cache
            (Some(w), Some(norms), Some(cs)) => {
                let (b, n, _) = x.dims3()?;
                let y = project(w, x)?.reshape((b * n, ()))?;
                let q = dflash_core::step::gated_qkv_heads_into_cache(
                    &y,
                    cs,
                    norms,
                    (self.n_heads, self.n_kv_heads, hd),
                    rope.emb.rotary_dim(),
                    self.q_norm.as_plain().eps(),
                    &kb,
                    &vb,
                    meta,
                )?;
                (q, Gate::InRows(y))
            }
            _ => {
                let (q, k, v, gate) = self.heads(x, rope)?;
                // the partial rotary leaves k strided (rotated and pass-through halves side by side)
                dflash_core::step::kv_append_at(
                    &kb,
                    &vb,
                    &k.contiguous()?,
                    &v.contiguous()?,
                    meta,
                )?;
                (q, Gate::Separate(gate))
            }
        };
        let scale = 1.0 / (hd as f64).sqrt();
        match visibility {
            // attention over the whole buffers (fixed shapes): on CUDA the scores' GEMM, the
            // masked softmax and the value product split over key chunks, on the CPU the
            // row-invariant host kernels, where the masked keys add exactly nothing
            StepVisibility::Mask(mask) => {
                let o =
                    dflash_core::attention::attention_over_buffer(&q, &kb, &vb, Some(mask), scale)?;
                self.output(o, gate)
            }
            StepVisibility::AncestorBits(bits) => {
                let o = dflash_core::step::tree_attention(
                    &q.contiguous()?,
                    &kb,
                    &vb,
                    meta,
                    bits,
                    scale as f32,
                )?;
                self.output_rows(o, gate)
            }
        }
    }
}

/// Where the gated attention's output gate comes from: its own tensor (`[b, n, heads·d]`, or
/// none), or the rows of the stacked q/k/v projection (`[n, width]`; the device step's fused
/// heads), read in place by [`dflash_core::decode_ops::gate_mul`].
enum Gate {
    Separate(Option<Tensor>),
    InRows(Tensor),
}

/// What a hybrid device step's gated attention reads a row's visible keys from: the additive mask
/// over the whole cache buffers (`[n, capacity]`, [`dflash_core::step::step_mask`]; GEMMs), or the
/// step rows' ancestor bits (`[n, MAX_STEP_ROWS / 32]`, keys by step row; the bf16 tensor-core
/// attention, [`tensor_core_gated_attention`]).
#[derive(Clone, Copy)]
pub enum StepVisibility<'a> {
    Mask(&'a Tensor),
    AncestorBits(&'a Tensor),
}

/// Whether the hybrids' gated attention of a `rows`-row CUDA device step runs on the bf16
/// tensor-core attention of the dense targets (`group_attn_mma`, one kernel a layer) instead of
/// the GEMMs over the whole buffers: a bf16 CUDA step, heads the step's attention takes (a multiple
/// of 32 up to [`dflash_core::step::MAX_STEP_HEAD_DIM`], or 256 on the tensor cores; the tiny test
/// hybrids' 32-wide heads run the general kernel, which checks the wiring), and at most
/// [`HYBRID_ATTN_VECTORS`] query vectors (`rows ·` query heads a KV head). Measured on an H100
/// (session 25, random weights, bf16): the Qwen3.6-27B AR step at context 2048 22.20 → 21.07 ms and
/// its 16-row verify 23.92 → 23.37 (96 vectors), the Qwen3.5-4B ones 4.69 → 4.58 and 5.53 → 5.37
/// (64), while 64-node trees lose (27B: 30.33 → 31.58 ms, 384 vectors; 4B: even at 256).
/// Overrides, read once: `DFLASH_HYBRID_ATTN=mma` (every width) or `=mask` (never).
pub fn tensor_core_gated_attention(x: &Tensor, att: &GatedAttention, rows: usize) -> bool {
    static CHOICE: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let forced = *CHOICE.get_or_init(|| match std::env::var("DFLASH_HYBRID_ATTN").as_deref() {
        Ok("mma") => Some(true),
        Ok("mask") => Some(false),
        _ => None,
    });
    let vectors = rows * (att.n_heads / att.n_kv_heads.max(1));
    forced.unwrap_or(vectors <= HYBRID_ATTN_VECTORS)
        && x.dtype() == DType::BF16
        && dflash_core::step::step_attention_takes(x.device(), DType::BF16, att.head_dim)
}

/// The most query vectors (rows · query heads a KV head) for which a hybrid step's gated attention
/// takes the tensor-core kernel by default ([`tensor_core_gated_attention`]).
pub const HYBRID_ATTN_VECTORS: usize = 128;

/// An error for a mask a recurrent layer cannot follow.
pub fn unsupported_mask(what: &str) -> ModelError {
    ModelError::InvalidInput(format!(
        "Qwen3.5 hybrids take causal blocks and token trees only ({what} masks would let a \
         recurrent layer see tokens it cannot)"
    ))
}
