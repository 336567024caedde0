//! Scaled dot-product attention with grouped-query heads and explicit visibility layouts.
//!
//! Invariants:
//! - Queries are the last `q_len` positions of a key sequence of length `kv_len` (`past = kv_len -
//!   q_len` committed rows come first), except for [`AttentionMask::Full`], where every query sees
//!   every key (the DFlash drafter's non-causal block).
//! - Every query row sees at least one key, so softmax never produces NaN.
//! - Scores and softmax run in f32 whatever the input dtype; the mask is additive (0 / -inf).
//! - GQA never copies keys: query heads `g*rep .. (g+1)*rep` share key head `g`.
//! - On CUDA without gradients ([`crate::decode_ops::fused_decode`]) scale, mask and softmax are
//!   one kernel with the same f32 arithmetic; on the CPU without gradients, for the calls
//!   [`crate::stream_gemm::cpu_row_invariant`] takes (decode steps by default, every
//!   call under `--bit-exact`), the whole attention is `crate::rowwise::attention` (row-invariant);
//!   elsewhere candle's composite.

use crate::{CoreError, Grad, Result};
use candle_core::{DType, Device, Tensor, D};

/// Which keys each query may see.
#[derive(Debug, Clone)]
pub enum AttentionMask {
    /// Query `i` sees keys `0 ..= past + i`.
    Causal,
    /// Every query sees every key.
    Full,
    /// A tree of `q_len` tokens: node `i` sees all past keys, its ancestors and itself.
    /// `parents[i] < i` is the parent node index, or `-1` for a root.
    Tree { parents: Vec<i64> },
    /// A ready additive mask `[q_len, kv_len]` (f32, 0 or -inf).
    Additive(Tensor),
}

impl AttentionMask {
    /// The additive `[q_len, kv_len]` f32 mask, or `None` when every key is visible.
    pub fn build(&self, q_len: usize, kv_len: usize, device: &Device) -> Result<Option<Tensor>> {
        if kv_len < q_len {
            return Err(CoreError::InvalidInput(format!(
                "attention: {q_len} queries but only {kv_len} keys"
            )));
        }
        let past = kv_len - q_len;
        match self {
            AttentionMask::Full => Ok(None),
            AttentionMask::Causal if q_len == 1 => Ok(None),
            // a causal block is the chain tree parents[i] = i − 1
            AttentionMask::Causal => {
                let chain: Vec<i64> = (0..q_len as i64).map(|i| i - 1).collect();
                Ok(Some(crate::decode_ops::visibility_mask(
                    &chain, past, device,
                )?))
            }
            AttentionMask::Tree { parents } => {
                if parents.len() != q_len {
                    return Err(CoreError::InvalidInput(format!(
                        "tree mask: {} parents for {q_len} queries",
                        parents.len()
                    )));
                }
                Ok(Some(crate::decode_ops::visibility_mask(
                    parents, past, device,
                )?))
            }
            AttentionMask::Additive(t) => {
                let dims = t.dims2()?;
                if dims != (q_len, kv_len) {
                    return Err(CoreError::InvalidInput(format!(
                        "additive mask is {dims:?}, expected ({q_len}, {kv_len})"
                    )));
                }
                Ok(Some(t.to_dtype(DType::F32)?))
            }
        }
    }
}

/// candle's fused softmax/rms-norm CUDA kernels index with 32-bit `int` (`row * ncols`): past
/// this many elements they read out of bounds (CUDA_ERROR_ILLEGAL_ADDRESS, seen in batch-1024
/// regen prefill). Larger tensors take the composite path, whose kernels index with `size_t`.
pub const FUSED_MAX_ELEMENTS: usize = i32::MAX as usize;

fn softmax_last(x: &Tensor, grad: Grad) -> Result<Tensor> {
    softmax_last_within(x, grad, FUSED_MAX_ELEMENTS)
}

fn softmax_last_within(x: &Tensor, grad: Grad, fused_max: usize) -> Result<Tensor> {
    Ok(match grad {
        Grad::Off if x.elem_count() <= fused_max => candle_nn::ops::softmax_last_dim(x)?,
        _ => candle_nn::ops::softmax(x, D::Minus1)?,
    })
}

/// `q`: `[b, n_heads, q_len, d]`; `k`, `v`: `[b, kv_heads, kv_len, d]`; `mask`: additive f32,
/// either `[q_len, kv_len]` shared by the batch (from [`AttentionMask::build`]) or `[b, q_len,
/// kv_len]` per sequence (batched decoding of left-padded rows). Returns `[b, n_heads, q_len, d]`.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    grad: Grad,
) -> Result<Tensor> {
    let (b, n_heads, q_len, d) = q.dims4()?;
    let (_, kv_heads, kv_len, _) = k.dims4()?;
    if n_heads % kv_heads != 0 {
        return Err(CoreError::InvalidInput(format!(
            "{n_heads} query heads are not a multiple of {kv_heads} kv heads"
        )));
    }
    let rep = n_heads / kv_heads;
    let dtype = q.dtype();
    if grad == Grad::Off
        && q.device().is_cpu()
        && !q.track_op()
        && crate::stream_gemm::cpu_row_invariant(b * q_len, dtype)
    {
        // decoding on the CPU: a row's result does not depend on the rows beside it
        return crate::rowwise::attention(q, k, v, mask, scale);
    }
    if grad == Grad::Off && crate::decode_ops::fused_decode(q.device()) {
        // V read in place (the cache's strided view)
        if let Some(p) = fused_probs(q, k, mask, scale)? {
            return Ok(p.matmul(v)?.reshape((b, n_heads, q_len, d))?);
        }
    }
    let qg = q.contiguous()?.reshape((b, kv_heads, rep * q_len, d))?;
    let scores = qg.matmul(&k.t()?)?.to_dtype(DType::F32)?;
    let scores = (scores * scale)?;
    let scores = match mask {
        Some(m) => {
            let m = match m.rank() {
                3 => m.reshape((b, 1, 1, q_len, kv_len))?,
                _ => m.clone(),
            };
            scores
                .reshape((b, kv_heads, rep, q_len, kv_len))?
                .broadcast_add(&m)?
                .reshape((b, kv_heads, rep * q_len, kv_len))?
        }
        None => scores,
    };
    let probs = softmax_last(&scores, grad)?.to_dtype(dtype)?;
    let out = probs.matmul(&v.contiguous()?)?;
    Ok(out.reshape((b, n_heads, q_len, d))?)
}

/// The probabilities of [`attention`]'s fused path: the scores' GEMM over grouped query heads,
/// then scale, mask and softmax as one kernel — `[b, kv_heads, rep·q_len, kv_len]` in `q`'s dtype,
/// or `None` where that kernel does not run (the caller takes the composite).
fn fused_probs(
    q: &Tensor,
    k: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
) -> Result<Option<Tensor>> {
    let (b, n_heads, q_len, d) = q.dims4()?;
    let (_, kv_heads, kv_len, _) = k.dims4()?;
    let rows = n_heads / kv_heads * q_len;
    let qg = q.contiguous()?.reshape((b, kv_heads, rows, d))?;
    let flat = qg.matmul(&k.t()?)?.reshape((b, kv_heads * rows, kv_len))?;
    Ok(
        crate::decode_ops::softmax_scaled(&flat, mask, q_len, scale as f32)?
            .map(|p| p.reshape((b, kv_heads, rows, kv_len)))
            .transpose()?,
    )
}

/// [`attention`] for the hybrids' device step over a whole cache buffer (`b` = 1): `attention`
/// itself, or under `DFLASH_ATTN_VALUES=split` (opt-in: measured in session 23 faster for the
/// isolated 27B AR step, 23.04 → 22.09 ms, but not in the decoding loops; read once) on
/// CUDA without gradients the scores' GEMM and the masked softmax kernel as in `attention`'s fused
/// path, then the value product split over chunks of 64 keys (`attention_values_cuda`: f32
/// partial sums in key order, added in chunk order — cuBLAS runs it on 32 blocks, 70 µs a layer
/// at Qwen3.6-27B's shape on an H100 at some buffer lengths, session 23's profile of the AR step).
pub fn attention_over_buffer(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    static SPLIT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let split = *SPLIT
        .get_or_init(|| std::env::var("DFLASH_ATTN_VALUES").is_ok_and(|x| x.trim() == "split"));
    if split {
        if let Some(out) = attention_split_values(q, k, v, mask, scale)? {
            return Ok(out);
        }
    }
    attention(q, k, v, mask, scale, Grad::Off)
}

/// [`attention_over_buffer`]'s split value product whatever the environment says (`None` where it
/// cannot run: off CUDA, a batch, gradients, a dtype other than f32 / bf16): the GPU test's entry.
#[doc(hidden)]
pub fn attention_split_values(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    {
        let (b, n_heads, q_len, d) = q.dims4()?;
        let kv_heads = k.dim(1)?;
        if b == 1
            && n_heads.is_multiple_of(kv_heads)
            && crate::decode_ops::fused_decode(q.device())
            && matches!(q.dtype(), DType::F32 | DType::BF16)
            && !q.track_op()
        {
            if let Some(p) = fused_probs(q, k, mask, scale)? {
                let out = crate::attention_values_cuda::attention_values(&p, &v.contiguous()?)?;
                return Ok(Some(out.reshape((1, n_heads, q_len, d))?));
            }
        }
    }
    let _ = (q, k, v, mask, scale);
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_mask_sees_ancestors_only() {
        // root 0, children 1 and 2 of 0, 3 child of 1
        let m = AttentionMask::Tree {
            parents: vec![-1, 0, 0, 1],
        };
        let t = m.build(4, 6, &Device::Cpu).unwrap().unwrap();
        let v: Vec<Vec<f32>> = t.to_vec2().unwrap();
        let vis = |r: usize| -> Vec<usize> { (0..6).filter(|&j| v[r][j] == 0.0).collect() };
        assert_eq!(vis(0), vec![0, 1, 2]);
        assert_eq!(vis(2), vec![0, 1, 2, 4]);
        assert_eq!(vis(3), vec![0, 1, 2, 3, 5]);
        assert!(AttentionMask::Tree {
            parents: vec![-1, 1]
        }
        .build(2, 2, &Device::Cpu)
        .is_err());
    }

    #[test]
    fn causal_gqa_matches_naive() {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1.0, (1, 4, 3, 8), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (1, 2, 5, 8), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (1, 2, 5, 8), &dev).unwrap();
        let mask = AttentionMask::Causal.build(3, 5, &dev).unwrap();
        let out = attention(&q, &k, &v, mask.as_ref(), 0.3, Grad::Off).unwrap();
        for h in 0..4 {
            let kh = k.narrow(1, h / 2, 1).unwrap();
            let vh = v.narrow(1, h / 2, 1).unwrap();
            let qh = q.narrow(1, h, 1).unwrap();
            let s: Vec<Vec<f32>> = (qh.matmul(&kh.t().unwrap()).unwrap() * 0.3)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec2()
                .unwrap();
            let vv: Vec<Vec<f32>> = vh
                .squeeze(0)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec2()
                .unwrap();
            let got: Vec<Vec<f32>> = out
                .narrow(1, h, 1)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec2()
                .unwrap();
            for i in 0..3 {
                let vis = 2 + i + 1;
                let mx = s[i][..vis].iter().cloned().fold(f32::MIN, f32::max);
                let e: Vec<f32> = s[i][..vis].iter().map(|x| (x - mx).exp()).collect();
                let z: f32 = e.iter().sum();
                for c in 0..8 {
                    let want: f32 = (0..vis).map(|j| e[j] / z * vv[j][c]).sum();
                    assert!((want - got[i][c]).abs() < 1e-5, "head {h} row {i}");
                }
            }
        }
    }

    #[test]
    fn softmax_past_the_fused_limit_takes_the_composite_path_with_the_same_result() {
        let x = Tensor::arange(0f32, 24.0, &Device::Cpu)
            .unwrap()
            .reshape((2, 3, 4))
            .unwrap();
        let fused = super::softmax_last_within(&x, Grad::Off, 1 << 20).unwrap();
        let composite = super::softmax_last_within(&x, Grad::Off, 8).unwrap();
        let err = crate::test_util::max_abs_diff(&fused, &composite);
        assert!(err < 1e-6, "{err}");
    }
}
