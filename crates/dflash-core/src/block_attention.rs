//! Two-part attention for DFlash blocks: each block of `B` query rows attends to a shared context
//! (the projected target hidden states of its sequence, under a per-block visibility mask) and to
//! the `B` keys of its own block — never to other blocks.
//!
//! Invariants:
//! - The result equals plain softmax attention over `[context keys, own block keys]` with the same
//!   additive masks: both parts share one row maximum and one normaliser, so probabilities sum to
//!   one over the visible keys of both parts (tested against [`crate::attention`]).
//! - The block part costs `n·B×B` scores per head instead of the `n·B×n·B` of one packed mask,
//!   which is what lets training run hundreds of blocks per sequence.
//! - Every op is differentiable (explicit exp/sum, the row maximum is a detached shift); scores and
//!   probabilities are f32 whatever the input dtype; every row sees its own block, so no row is
//!   empty. GQA never copies keys.

use crate::{CoreError, Result};
use candle_core::{DType, Tensor, D};

/// Additive value that hides a key (finite, so `0 · hidden` never makes NaN).
pub const HIDDEN: f32 = -1e30;

/// `q` `[b, heads, n·B, d]` (row `k·B + j` is slot `j` of block `k`); `ctx_k`, `ctx_v` `[b, kv_heads,
/// S, d]`; `blk_k`, `blk_v` `[b, kv_heads, n·B, d]`; `ctx_mask` additive f32 `[b, n, 1 | B, S]`
/// (per block, or per block slot); `blk_mask` additive f32 `[B, B]`. Returns `[b, n·B, heads·d]`
/// (heads concatenated, ready for the output projection).
#[allow(clippy::too_many_arguments)]
pub fn block_attention(
    q: &Tensor,
    ctx_k: &Tensor,
    ctx_v: &Tensor,
    blk_k: &Tensor,
    blk_v: &Tensor,
    ctx_mask: Option<&Tensor>,
    blk_mask: Option<&Tensor>,
    block: usize,
    scale: f64,
) -> Result<Tensor> {
    let (b, heads, rows, d) = q.dims4()?;
    let (_, kv_heads, s, _) = ctx_k.dims4()?;
    if block == 0 || rows % block != 0 || heads % kv_heads != 0 || blk_k.dim(2)? != rows {
        return Err(CoreError::InvalidInput(format!(
            "block attention: {rows} query rows, {} block keys, block {block}, {heads}/{kv_heads} heads",
            blk_k.dim(2)?
        )));
    }
    let n = rows / block;
    let rep = heads / kv_heads;
    let dtype = q.dtype();
    // [b, kv, rep, n, B, d] -> [b, kv, n, rep, B, d]: one block's rows of one kv group are adjacent
    let qg = q
        .reshape((b, kv_heads, rep, n, block, d))?
        .permute((0, 1, 3, 2, 4, 5))?
        .contiguous()?;
    // the softmax scale goes on the queries (rows × d) rather than on both score tensors
    // (rows × (S + B), f32), forward and backward
    let qg = (qg * scale)?;
    let group_rows = rep * block;
    let six = (b, kv_heads, n, rep, block);
    let mut ctx_scores = None;
    if s > 0 {
        let sc = qg
            .reshape((b, kv_heads, n * group_rows, d))?
            .matmul(&ctx_k.t()?)?
            .to_dtype(DType::F32)?;
        let sc = sc.reshape((six.0, six.1, six.2, six.3, six.4, s))?;
        let sc = match ctx_mask {
            Some(m) => {
                let (mb, mn, ms, mk) = m.dims4()?;
                if mb != b || mn != n || (ms != 1 && ms != block) || mk != s {
                    return Err(CoreError::InvalidInput(format!(
                        "block attention: context mask {:?}, expected [{b}, {n}, 1|{block}, {s}]",
                        m.dims()
                    )));
                }
                sc.broadcast_add(&m.reshape((b, 1, n, 1, ms, s))?)?
            }
            None => sc,
        };
        ctx_scores = Some(sc);
    }
    let bk = blk_k.reshape((b * kv_heads * n, block, d))?;
    let bv = blk_v.reshape((b * kv_heads * n, block, d))?;
    let sb = qg
        .reshape((b * kv_heads * n, group_rows, d))?
        .matmul(&bk.t()?)?
        .to_dtype(DType::F32)?;
    let sb = sb.reshape((six.0, six.1, six.2, six.3, six.4, block))?;
    let sb = match blk_mask {
        Some(m) => sb.broadcast_add(&m.reshape((1, 1, 1, 1, block, block))?)?,
        None => sb,
    };
    // one shared shift and normaliser over both parts
    let mut max = sb.max_keepdim(D::Minus1)?;
    if let Some(sc) = &ctx_scores {
        max = max.maximum(&sc.max_keepdim(D::Minus1)?)?;
    }
    let max = max.detach();
    let eb = sb.broadcast_sub(&max)?.exp()?;
    let mut z = eb.sum_keepdim(D::Minus1)?;
    let ec = match &ctx_scores {
        Some(sc) => {
            let e = sc.broadcast_sub(&max)?.exp()?;
            z = (z + e.sum_keepdim(D::Minus1)?)?;
            Some(e)
        }
        None => None,
    };
    let pb = eb.broadcast_div(&z)?.to_dtype(dtype)?;
    let mut out = pb
        .reshape((b * kv_heads * n, group_rows, block))?
        .matmul(&bv.contiguous()?)?
        .reshape((b, kv_heads, n * group_rows, d))?;
    if let Some(e) = ec {
        let pc = e.broadcast_div(&z)?.to_dtype(dtype)?;
        let oc = pc
            .reshape((b, kv_heads, n * group_rows, s))?
            .matmul(&ctx_v.contiguous()?)?;
        out = (out + oc)?;
    }
    // [b, kv, n, rep, B, d] -> [b, n, B, kv, rep, d] -> [b, n·B, heads·d]
    Ok(out
        .reshape((b, kv_heads, n, rep, block, d))?
        .permute((0, 2, 4, 1, 3, 5))?
        .reshape((b, rows, heads * d))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{attention, Grad};
    use candle_core::Device;

    /// Two sequences, three blocks of 4 each, 3 context rows visible up to each block's anchor,
    /// causal inside the block: equals plain attention with the packed `[ctx, all blocks]` mask.
    #[test]
    fn equals_packed_attention_with_the_block_mask() {
        let dev = Device::Cpu;
        let (b, h, kvh, n, bs, s, d) = (2, 4, 2, 3, 4, 5, 8);
        let q = Tensor::randn(0f32, 1.0, (b, h, n * bs, d), &dev).unwrap();
        let ck = Tensor::randn(0f32, 1.0, (b, kvh, s, d), &dev).unwrap();
        let cv = Tensor::randn(0f32, 1.0, (b, kvh, s, d), &dev).unwrap();
        let bk = Tensor::randn(0f32, 1.0, (b, kvh, n * bs, d), &dev).unwrap();
        let bv = Tensor::randn(0f32, 1.0, (b, kvh, n * bs, d), &dev).unwrap();
        let anchors = [[0usize, 2, 5], [1, 3, 4]];
        let mut cm = vec![HIDDEN; b * n * s];
        let mut packed = vec![f32::NEG_INFINITY; b * n * bs * (s + n * bs)];
        for (bi, an) in anchors.iter().enumerate() {
            for (k, &a) in an.iter().enumerate() {
                for j in 0..a {
                    cm[(bi * n + k) * s + j] = 0.0;
                }
                for slot in 0..bs {
                    let row = (bi * n * bs + k * bs + slot) * (s + n * bs);
                    for j in 0..a {
                        packed[row + j] = 0.0;
                    }
                    for kslot in 0..=slot {
                        packed[row + s + k * bs + kslot] = 0.0;
                    }
                }
            }
        }
        let cm = Tensor::from_vec(cm, (b, n, 1, s), &dev).unwrap();
        let mut causal = vec![0f32; bs * bs];
        for i in 0..bs {
            for j in i + 1..bs {
                causal[i * bs + j] = HIDDEN;
            }
        }
        let causal = Tensor::from_vec(causal, (bs, bs), &dev).unwrap();
        let got =
            block_attention(&q, &ck, &cv, &bk, &bv, Some(&cm), Some(&causal), bs, 0.3).unwrap();
        let k = Tensor::cat(&[&ck, &bk], 2).unwrap();
        let v = Tensor::cat(&[&cv, &bv], 2).unwrap();
        let packed = Tensor::from_vec(packed, (b, n * bs, s + n * bs), &dev).unwrap();
        let want = attention(&q, &k, &v, Some(&packed), 0.3, Grad::On)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b, n * bs, h * d))
            .unwrap();
        let err = crate::test_util::max_abs_diff(&got, &want);
        assert!(err < 1e-5, "err {err}");
    }
}
