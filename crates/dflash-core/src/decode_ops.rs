//! What a decoding step needs from the logits and for its masks, computed where the tensors are,
//! so that only O(rows · k) numbers cross to the host: greedy argmax per row, each row's top-k
//! log-probabilities (DDTree's tree), attention visibility masks built from tree parents, and the
//! LM head's `x · wᵀ` with f32 accumulation and f32 output from bf16/f16 operands.
//!
//! Invariants:
//! - The CPU path is the reference; on CUDA the kernels of `decode_kernels.cu` give the same ids:
//!   argmax ties go to the lowest id (as `torch.argmax`), top-k keeps the k largest values with
//!   ties to the lower id and returns them best first; a row whose argmax is undefined (all NaN)
//!   is answered by the host for that row alone.
//! - Top-k values are log-probabilities `x − logsumexp(row)` computed in f32.
//! - Masks are additive f32 `[n, past + n]`: 0 visible, −inf hidden; every query sees every past
//!   key and itself, so no softmax row is empty. `parents[i] < i`, −1 for a root.
//! - [`matmul_t_f32`] never materialises an f32 copy of a bf16/f16 weight on CUDA (cuBLAS GemmEx,
//!   f32 compute); elsewhere it upcasts (the CPU is the development path).

use crate::{CoreError, Result};
use candle_core::{DType, Device, Tensor};
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// Index of the largest value; the first one on ties (NaN never wins over index 0).
pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as u32
}

/// The greedy token of every row of `[rows, vocab]` logits; only `rows` ids cross to the host.
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    let l = logits.to_dtype(DType::F32)?;
    let (rows, _) = l.dims2()?;
    #[cfg(feature = "cuda")]
    if l.device().is_cuda() {
        let mut out = crate::decode_ops_cuda::argmax_rows(&l.contiguous()?)?;
        for (r, id) in out.iter_mut().enumerate() {
            if *id == u32::MAX {
                *id = argmax(&l.get(r)?.to_device(&Device::Cpu)?.to_vec1()?);
            }
        }
        return Ok(out);
    }
    let host: Vec<Vec<f32>> = l.to_device(&Device::Cpu)?.to_vec2()?;
    debug_assert_eq!(host.len(), rows);
    Ok(host.iter().map(|r| argmax(r)).collect())
}

#[derive(Clone, Copy, PartialEq)]
struct Ordered(f32);
impl Eq for Ordered {}
impl PartialOrd for Ordered {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Ordered {
    fn cmp(&self, o: &Self) -> Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// Sorts (value, id) pairs best first: larger value, then lower id.
pub fn sort_best_first(v: &mut [(f32, u32)]) {
    v.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
}

/// Top-`k` (value, id) of each host row, best first (ties: lower id first). One pass per row
/// with a size-`k` min-heap: most values are rejected by one comparison with the heap's minimum.
pub fn top_k_host<R: AsRef<[f32]>>(rows: &[R], k: usize) -> Vec<Vec<(f32, u32)>> {
    rows.iter().map(|row| top_k_row(row.as_ref(), k)).collect()
}

/// [`top_k_host`] of one row.
pub fn top_k_row(row: &[f32], k: usize) -> Vec<(f32, u32)> {
    let k = k.min(row.len());
    // min-heap on (value, Reverse(id)): the root is the weakest kept entry
    let mut heap: BinaryHeap<Reverse<(Ordered, Reverse<u32>)>> = BinaryHeap::with_capacity(k + 1);
    for (i, &x) in row.iter().enumerate() {
        let item = (Ordered(x), Reverse(i as u32));
        if heap.len() < k {
            heap.push(Reverse(item));
        } else if let Some(min) = heap.peek() {
            if item > min.0 {
                heap.pop();
                heap.push(Reverse(item));
            }
        }
    }
    let mut v: Vec<(f32, u32)> = heap.into_iter().map(|r| (r.0 .0 .0, r.0 .1 .0)).collect();
    sort_best_first(&mut v);
    v
}

/// Each row's top-`k` log-probabilities (value, id), best first, from `[rows, vocab]` logits.
pub fn top_k_log_probs(logits: &Tensor, k: usize) -> Result<Vec<Vec<(f32, u32)>>> {
    top_k_log_probs_with(logits, k, top_k_split())
}

/// Whether the device top-k spreads each long row over several blocks: the default (Qwen3-8B's
/// 15-row, 64-node tree build 0.27 → 0.16 ms on an H100, docs/benchmarks.md session 19);
/// `DFLASH_TOPK_SPLIT=0` keeps each row in one block (read once).
pub fn top_k_split() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DFLASH_TOPK_SPLIT").as_deref() != Ok("0"))
}

/// [`top_k_log_probs`] with the device kernel chosen by `split` (one block a row, or several
/// where the rows are long enough); the same (log-prob, id) sets either way. On the CPU `split`
/// changes nothing.
pub fn top_k_log_probs_with(
    logits: &Tensor,
    k: usize,
    split: bool,
) -> Result<Vec<Vec<(f32, u32)>>> {
    let l = logits.to_dtype(DType::F32)?;
    let (_, vocab) = l.dims2()?;
    let k = k.clamp(1, vocab.max(1));
    #[cfg(feature = "cuda")]
    if l.device().is_cuda() {
        let mut rows = crate::decode_ops_cuda::top_k_rows(&l.contiguous()?, k, split)?;
        rows.iter_mut().for_each(|r| sort_best_first(r));
        return Ok(rows);
    }
    let _ = split;
    let lp: Vec<f32> = candle_nn::ops::log_softmax(&l, candle_core::D::Minus1)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1()?;
    Ok(lp.chunks(vocab.max(1)).map(|r| top_k_row(r, k)).collect())
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
/// The split plan of the device's split top-k (the default; `DFLASH_TOPK_SPLIT=0` turns it off) for `rows` rows of `vocab` and `k`: (splits, slice length), or
/// `None` when a row is better left to one block (short rows, too many candidates to merge).
/// `DFLASH_TOPK_SPLITS=N` (read once; a documented override for A/B runs, 2–64) asks for N splits
/// a row instead of `128 / rows` within 2..16 (built in session 28: a DDTree draft's top-64 of 15
/// rows of Qwen3's 151,936 logits took 0.13 ms on 8 splits, a twelfth of the 8B drafter's block;
/// measured on an H100 in session 29: 16 and 32 splits slow the tree build 0.15 → 0.34 / 1.01 ms).
pub(crate) fn topk_split_plan(rows: usize, vocab: usize, k: usize) -> Option<(usize, usize)> {
    static WANTED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let wanted = *WANTED.get_or_init(|| {
        std::env::var("DFLASH_TOPK_SPLITS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map(|n| n.clamp(2, 64))
    });
    topk_split_plan_for(rows, vocab, k, wanted)
}

/// [`topk_split_plan`] with `wanted` splits a row (`None`: the rule's).
fn topk_split_plan_for(
    rows: usize,
    vocab: usize,
    k: usize,
    wanted: Option<usize>,
) -> Option<(usize, usize)> {
    const MAX_CANDIDATES: usize = 4096; // TOPK_SPLIT_MAX_CAND of decode_kernels.cu
    let mut splits = wanted
        .unwrap_or_else(|| (128 / rows.max(1)).clamp(2, 16))
        .min(MAX_CANDIDATES / k.max(1));
    while splits >= 2 {
        let len = vocab.div_ceil(splits).next_multiple_of(4);
        let last = vocab as i64 - (splits as i64 - 1) * len as i64;
        if len >= 1024 && last >= k as i64 {
            return Some((splits, len));
        }
        splits -= 1;
    }
    None
}

fn check_parents(parents: &[i64]) -> Result<()> {
    for (i, &p) in parents.iter().enumerate() {
        if p >= i as i64 || p < -1 {
            return Err(CoreError::InvalidInput(format!(
                "tree mask: parent {p} of node {i} is not earlier"
            )));
        }
    }
    Ok(())
}

/// The additive `[n, past + n]` mask of a tree of `n = parents.len()` query tokens after `past`
/// cached keys: query `i` sees every past key, itself and its ancestors.
pub fn visibility_mask(parents: &[i64], past: usize, device: &Device) -> Result<Tensor> {
    check_parents(parents)?;
    let n = parents.len();
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return crate::decode_ops_cuda::visibility_mask(parents, past, device);
    }
    let kv = past + n;
    let mut m = vec![f32::NEG_INFINITY; n * kv];
    for i in 0..n {
        m[i * kv..i * kv + past].fill(0.0);
        let mut node = i as i64;
        while node >= 0 {
            m[i * kv + past + node as usize] = 0.0;
            node = parents[node as usize];
        }
    }
    Ok(Tensor::from_vec(m, (n, kv), device)?)
}

/// Whether the decode-step fusions (fused QKV and gate-up projections, one-kernel scaled masked
/// softmax, silu·mul) run on `device`: on CUDA by default, never on the CPU (whose numerics the
/// reference tests pin). Read once per process; `DFLASH_FUSED_DECODE=0` turns them off to
/// compare (an A/B override, documented in the README).
pub fn fused_decode(device: &Device) -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    device.is_cuda()
        && *ENABLED.get_or_init(|| std::env::var("DFLASH_FUSED_DECODE").as_deref() != Ok("0"))
}

/// `silu(gate) · up` for `x = [gate | up]` along the last dimension (one kernel on CUDA).
pub fn silu_mul(x: &Tensor) -> Result<Tensor> {
    let two = x.dim(candle_core::D::Minus1)?;
    if two % 2 != 0 {
        return Err(CoreError::InvalidInput(format!(
            "silu_mul: last dimension {two} is odd"
        )));
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && matches!(x.dtype(), DType::F32 | DType::BF16) {
        return crate::decode_ops_cuda::silu_mul(x);
    }
    let d = x.rank() - 1;
    let gate = x.narrow(d, 0, two / 2)?;
    let up = x.narrow(d, two / 2, two / 2)?;
    Ok((candle_nn::ops::silu(&gate)? * up)?)
}

/// The hybrids' gated attention output `o · sigmoid(gate)`, `o` `[…, heads·head_dim]`, each
/// head's gates read in place from `y` `[rows, ≥ 2·heads·head_dim]` — the stacked q/k/v
/// projection, whose q heads each carry their `head_dim` gate channels after their queries — as
/// candle's `sigmoid` then `mul` compute it (f32, the sigmoid rounded to the dtype). One kernel on
/// CUDA (f32, bf16); elsewhere the same ops over a copy of the gates.
pub fn gate_mul(o: &Tensor, y: &Tensor, heads: usize, head_dim: usize) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if o.device().is_cuda() && matches!(o.dtype(), DType::F32 | DType::BF16) {
        return crate::gated_attention_cuda::gate_mul(o, y, heads, head_dim);
    }
    let rows = y.dim(0)?;
    let gate = y
        .narrow(1, 0, 2 * heads * head_dim)?
        .reshape((rows, heads, 2 * head_dim))?
        .narrow(2, head_dim, head_dim)?
        .reshape(o.shape())?;
    Ok((o * candle_nn::ops::sigmoid(&gate)?)?)
}

/// Attention probabilities `softmax(scale·scores + mask)` in f32, returned in the scores' dtype:
/// `scores` `[b, rows_per_b, kv]` whose row `r` is query `(r mod rows_per_b) mod q_len`; `mask`
/// additive f32 `[q_len, kv]` or `[b, q_len, kv]`. One kernel on CUDA (f32, bf16); `None` where
/// the caller must take the composite.
pub fn softmax_scaled(
    scores: &Tensor,
    mask: Option<&Tensor>,
    q_len: usize,
    scale: f32,
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if scores.device().is_cuda() && matches!(scores.dtype(), DType::F32 | DType::BF16) {
        return Ok(Some(crate::decode_ops_cuda::softmax_scaled(
            scores, mask, q_len, scale,
        )?));
    }
    let _ = (scores, mask, q_len, scale);
    Ok(None)
}

/// Order key of an f32: larger value, larger key (as `fkey` in the kernels).
fn order_key(x: f32) -> u32 {
    let u = x.to_bits();
    if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    }
}

/// How [`sample_rows`] filters and samples one row, on the host: temperature, then top-k (keys ≥
/// the k-th largest, ties all kept), then top-p (the largest keys whose mass reaches `top_p` of
/// the rest, ties at the cut all kept), masses `exp((x − max)/T)` in fixed point (2^-40 units);
/// the token is where the kept mass accumulated in id order passes `u ·` the kept mass. The
/// reference the CUDA kernel is tested against.
pub fn sample_row_host(row: &[f32], temperature: f32, top_k: usize, top_p: f32, u: f32) -> u32 {
    let inv_t = 1.0 / temperature;
    let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mass = |x: f32| ((x - m) * inv_t).exp() * (1u64 << 40) as f32;
    let mut keys: Vec<u32> = row.iter().map(|&x| order_key(x)).collect();
    keys.sort_unstable_by_key(|&k| std::cmp::Reverse(k));
    let mut thr = if top_k > 0 && top_k < row.len() {
        keys[top_k - 1]
    } else {
        0
    };
    if top_p < 1.0 {
        let z: u64 = row
            .iter()
            .filter(|&&x| order_key(x) >= thr)
            .map(|&x| mass(x) as u64)
            .sum();
        let want = top_p as f64 * z as f64;
        let need = want.ceil() as u64;
        // mass per distinct key, from the largest: the first key where it reaches `need`
        let mut by_key: Vec<(u32, u64)> = row
            .iter()
            .filter(|&&x| order_key(x) >= thr)
            .map(|&x| (order_key(x), mass(x) as u64))
            .collect();
        by_key.sort_unstable_by_key(|k| std::cmp::Reverse(k.0));
        let mut cum = 0u64;
        for (k, w) in by_key {
            cum += w;
            thr = k;
            if cum >= need {
                break;
            }
        }
    }
    let kept = |x: f32| order_key(x) >= thr;
    let total: u64 = row
        .iter()
        .filter(|&&x| kept(x))
        .map(|&x| mass(x) as u64)
        .sum();
    let r = ((u as f64 * total as f64) as u64).min(total.saturating_sub(1));
    let mut acc = 0u64;
    for (i, &x) in row.iter().enumerate() {
        if kept(x) {
            acc += mass(x) as u64;
            if r < acc {
                return i as u32;
            }
        }
    }
    argmax(row)
}

/// One sampled token per row of `[rows, vocab]` logits (see [`sample_row_host`] for the rule),
/// `u[r]` uniform in [0, 1) from the caller's seeded RNG; on CUDA one kernel, only the ids cross
/// to the host.
pub fn sample_rows(
    logits: &Tensor,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    u: &[f32],
) -> Result<Vec<u32>> {
    let l = logits.to_dtype(DType::F32)?;
    let (rows, _) = l.dims2()?;
    if u.len() != rows || temperature <= 0.0 {
        return Err(CoreError::InvalidInput(format!(
            "sample_rows: {} uniforms for {rows} rows at temperature {temperature}",
            u.len()
        )));
    }
    #[cfg(feature = "cuda")]
    if l.device().is_cuda() {
        return crate::decode_sampling_cuda::sample_rows(
            &l.contiguous()?,
            temperature,
            top_k,
            top_p,
            u,
        );
    }
    let host: Vec<Vec<f32>> = l.to_device(&Device::Cpu)?.to_vec2()?;
    Ok(host
        .iter()
        .zip(u)
        .map(|(r, &x)| sample_row_host(r, temperature, top_k, top_p, x))
        .collect())
}

/// Head-major `(q, k, v)` (`[1, heads, n, head_dim]` each) from the fused projection's rows `y`
/// `[n, (h + 2·kv)·head_dim]`: Qwen3's per-head q/k RMSNorm when `norms` (`[2, head_dim]`, q_norm
/// then k_norm weights) is given, then rotate-half RoPE of the first `rot` channels of q and k with
/// `cos_sin` (cos then sin, `[2·n, rot/2]`), as one kernel on CUDA (f32, bf16; head_dim a multiple
/// of 32 up to 1024). `None` where the caller must take the composite.
#[allow(clippy::too_many_arguments)]
pub fn qkv_heads(
    y: &Tensor,
    cos_sin: &Tensor,
    norms: Option<&Tensor>,
    h: usize,
    kv: usize,
    head_dim: usize,
    rot: usize,
    eps: f64,
) -> Result<Option<(Tensor, Tensor, Tensor)>> {
    let supported = head_dim.is_multiple_of(32)
        && head_dim <= 1024
        && rot.is_multiple_of(2)
        && rot <= head_dim
        && matches!(y.dtype(), DType::F32 | DType::BF16);
    #[cfg(feature = "cuda")]
    if y.device().is_cuda() && supported {
        // without norms the kernel never reads the weights: `y` (at least 3 heads wide) fills
        // the slot, so no placeholder is allocated per layer
        let w = norms.unwrap_or(y);
        let out = crate::decode_ops_cuda::qkv_heads(
            y,
            cos_sin,
            w,
            h,
            kv,
            head_dim,
            rot,
            norms.is_some(),
            eps as f32,
        )?;
        return Ok(Some((
            out.narrow(0, 0, h)?.unsqueeze(0)?,
            out.narrow(0, h, kv)?.unsqueeze(0)?,
            out.narrow(0, h + kv, kv)?.unsqueeze(0)?,
        )));
    }
    let _ = (y, cos_sin, norms, h, kv, head_dim, rot, eps, supported);
    Ok(None)
}

/// `(x + d, rms_norm(x + d)·w)` over the last dimension (the residual add and the next norm) as
/// one kernel on CUDA (f32, bf16); `None` where the caller must take the composite.
pub fn add_rms_norm(
    x: &Tensor,
    d: &Tensor,
    w: &Tensor,
    eps: f64,
) -> Result<Option<(Tensor, Tensor)>> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && matches!(x.dtype(), DType::F32 | DType::BF16) && x.dims() == d.dims()
    {
        let out = crate::decode_ops_cuda::add_rms_norm(x, d, w, eps as f32)?;
        return Ok(Some((out.get(0)?, out.get(1)?)));
    }
    let _ = (x, d, w, eps);
    Ok(None)
}

/// `x · wᵀ` as f32 (`x`: `[n, k]`, `w`: `[v, k]`, same dtype) with f32 accumulation.
pub fn matmul_t_f32(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    let (_, kw) = w.dims2()?;
    if k != kw || x.dtype() != w.dtype() {
        return Err(CoreError::InvalidInput(format!(
            "matmul_t_f32: x {:?} {:?} against w {:?} {:?}",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        )));
    }
    if x.dtype() == DType::F32 {
        return Ok(x.matmul(&w.t()?)?);
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F16) {
        return crate::decode_ops_cuda::matmul_t_f32(&x.contiguous()?, &w.contiguous()?);
    }
    Ok(x.to_dtype(DType::F32)?
        .matmul(&w.to_dtype(DType::F32)?.t()?)?)
}

#[cfg(test)]
mod tests {

    #[test]
    fn split_top_k_plans_keep_every_slice_long_enough_and_the_merge_in_bounds() {
        for rows in [1usize, 3, 15, 40, 129, 300] {
            for vocab in [300usize, 4096, 32768, 49152, 151936, 248320] {
                for k in [1usize, 16, 64, 256, 1024] {
                    let Some((splits, len)) = topk_split_plan(rows, vocab, k) else {
                        continue;
                    };
                    assert!(splits >= 2 && splits * k <= 4096, "{rows} {vocab} {k}");
                    assert!(len.is_multiple_of(4) && len >= 1024 && len >= k);
                    assert!(vocab >= (splits - 1) * len + k, "the last slice holds k");
                    assert!(splits * len >= vocab, "the slices cover the row");
                }
            }
        }
        assert_eq!(
            topk_split_plan_for(15, 151936, 64, None).map(|p| p.0),
            Some(8)
        );
        assert!(topk_split_plan_for(3, 300, 64, None).is_none());
        // an asked-for count, within the candidates' bound (4096 / k) and the slices' length
        assert_eq!(
            topk_split_plan_for(15, 151936, 64, Some(32)).map(|p| p.0),
            Some(32)
        );
        assert_eq!(
            topk_split_plan_for(15, 151936, 128, Some(64)).map(|p| p.0),
            Some(32)
        );
        assert_eq!(
            topk_split_plan_for(1, 4096, 8, Some(64)).map(|p| p.0),
            Some(4)
        );
    }

    use super::*;

    #[test]
    fn argmax_rows_ties_go_to_the_lowest_id() {
        let rows = vec![vec![0.5f32, 2.0, -1.0, 2.0], vec![3.0, 3.0, 3.0, 3.0]];
        let t = Tensor::new(rows, &Device::Cpu).unwrap();
        assert_eq!(argmax_rows(&t).unwrap(), vec![1, 0]);
    }

    #[test]
    fn top_k_log_probs_matches_a_full_sort_with_ties() {
        let row: Vec<f32> = (0..1000u32)
            .map(|i| ((i * 7919) % 101) as f32 * 0.1 - 3.0)
            .collect();
        let t = Tensor::new(vec![row.clone()], &Device::Cpu).unwrap();
        let got = top_k_log_probs(&t, 37).unwrap();
        let mut idx: Vec<u32> = (0..1000).collect();
        idx.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        assert_eq!(
            got[0].iter().map(|x| x.1).collect::<Vec<_>>(),
            idx[..37].to_vec()
        );
        let z: f32 = row.iter().map(|x| x.exp()).sum();
        assert!((got[0][0].0 - (row[idx[0] as usize] - z.ln())).abs() < 1e-4);
    }

    #[test]
    fn visibility_mask_sees_past_self_and_ancestors() {
        let m = visibility_mask(&[-1, 0, 0, 1], 2, &Device::Cpu).unwrap();
        let v: Vec<Vec<f32>> = m.to_vec2().unwrap();
        let vis = |r: usize| -> Vec<usize> { (0..6).filter(|&j| v[r][j] == 0.0).collect() };
        assert_eq!(vis(0), vec![0, 1, 2]);
        assert_eq!(vis(2), vec![0, 1, 2, 4]);
        assert_eq!(vis(3), vec![0, 1, 2, 3, 5]);
        assert!(visibility_mask(&[-1, 1], 0, &Device::Cpu).is_err());
    }

    #[test]
    fn matmul_t_f32_upcasts_low_precision_operands() {
        let x = Tensor::randn(0f32, 1.0, (3, 8), &Device::Cpu).unwrap();
        let w = Tensor::randn(0f32, 1.0, (5, 8), &Device::Cpu).unwrap();
        let (xb, wb) = (
            x.to_dtype(DType::BF16).unwrap(),
            w.to_dtype(DType::BF16).unwrap(),
        );
        let got = matmul_t_f32(&xb, &wb).unwrap();
        assert_eq!(got.dtype(), DType::F32);
        let want = xb
            .to_dtype(DType::F32)
            .unwrap()
            .matmul(&wb.to_dtype(DType::F32).unwrap().t().unwrap())
            .unwrap();
        let d: f32 = (got - want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        assert!(d < 1e-5, "{d}");
    }
}
