//! Fused DFlash block attention: the same function as [`crate::block_attention`] for the
//! standard DFlash layer (block rows see the context keys strictly before their anchor and every
//! key of their own block), computed without materialising a score tensor. One row at a time,
//! online softmax in f32, forward and analytic backward (flash-attention style: the backward
//! recomputes probabilities from the row's log-normaliser and uses `D = dO·O`).
//!
//! Invariants:
//! - Equals `block_attention` with the anchor mask and no block mask, in value and in every
//!   gradient, up to float rounding (tested on the CPU reference; `dflash bench attention`
//!   compares the CUDA kernels against the composite on the device).
//! - The CUDA kernels (`flash_block.cu`, NVRTC) mirror the CPU reference loop for loop, except
//!   that the default (split) backward sums each dot product over 4 threads and each context
//!   key's gradient over parts of the blocks before adding the parts in order; no kernel uses
//!   atomics, so results do not depend on scheduling (`DFLASH_FLASH_BWD=row` selects the
//!   one-thread-per-row backward).
//! - [`use_fused`] decides per call from a process-wide setting: the CUDA default for calls of many
//!   (query, key) pairs (where the H200 measured it faster, at the composite's f32 rounding),
//!   [`set_fused_attention`] or `DFLASH_FUSED_ATTENTION`
//!   overrides.
//! - [`flash_block_attention`] returns `None` for shapes outside the kernels' limits (block
//!   larger than 16, more than 128 rows per kv group, shared memory above 48 KiB, no context);
//!   the caller then takes the composite.

use crate::{CoreError, Result};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

/// Keys per tile of the row kernels, and the largest block size they take.
pub const MAX_BLOCK: usize = 16;
/// Context keys per thread block in the key-parallel backward kernel.
const KEYS_PER_CTA: usize = 32;
/// Shared memory a kernel may use without an opt-in.
const SHARED_LIMIT: usize = 48 * 1024;

/// (query row, key) pairs of a call (batch × query rows × keys) from which the fused kernels are
/// the CUDA default. Measured on the H200 (docs/benchmarks.md, session 7), causal attention: 1.8–2×
/// faster than the composite at 4 × 1,024 × 1,024 (4.2 M pairs: training taps, long prefills),
/// even at 8 × 200 × 200 (0.32 M), 2–6× slower at 1 × 256 × 256, 1 × 16 × 528 (a verify) and
/// 8 × 1 × 337 (a batched decode step), where one thread block per 16-row tile leaves most SMs
/// idle. Drafter training blocks (about 9 × 2,048 × 528 = 9.7 M pairs) measured 3.2× faster
/// forward and backward; a 16-row draft stays below the threshold at any context up to 64 k.
pub const FUSED_MIN_PAIRS: usize = 1 << 20;

/// The process-wide choice: 0 auto, 1 forced on, 2 forced off; `u8::MAX` until first read.
static FUSED_SETTING: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(u8::MAX);

/// Forces the fused attention on (`Some(true)`) or off (`Some(false)`) for the whole process, or
/// back to the automatic choice (`None`). Tests and benches call this to compare both paths;
/// `DFLASH_FUSED_ATTENTION=1`/`0` sets the same at start.
pub fn set_fused_attention(force: Option<bool>) {
    let v = match force {
        None => 0,
        Some(true) => 1,
        Some(false) => 2,
    };
    FUSED_SETTING.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// Whether an attention of `pairs` (query row, key) pairs on `device` takes the fused kernels:
/// forced on / off by [`set_fused_attention`] (or `DFLASH_FUSED_ATTENTION=1` / `=0`, read once,
/// not per layer); otherwise on for CUDA calls of at least [`FUSED_MIN_PAIRS`] pairs and off on
/// the CPU (its reference is single-threaded loops, slower than the composite's GEMMs).
pub fn use_fused(device: &candle_core::Device, pairs: usize) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    let mut v = FUSED_SETTING.load(Relaxed);
    if v == u8::MAX {
        v = match std::env::var("DFLASH_FUSED_ATTENTION").as_deref() {
            Ok("1") => 1,
            Ok("0") => 2,
            _ => 0,
        };
        let _ = FUSED_SETTING.compare_exchange(u8::MAX, v, Relaxed, Relaxed);
        v = FUSED_SETTING.load(Relaxed);
    }
    match v {
        1 => true,
        2 => false,
        _ => device.is_cuda() && pairs >= FUSED_MIN_PAIRS,
    }
}

static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many attentions the fused op has computed in this process (tests check the switch).
pub fn calls() -> usize {
    CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Problem sizes: `nb` sequences, `h`/`kv` heads, `r = n·B` block rows, `s` context rows, head
/// dim `d`, block `bs`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Dims {
    pub nb: usize,
    pub h: usize,
    pub kv: usize,
    pub r: usize,
    pub s: usize,
    pub d: usize,
    pub bs: usize,
    pub scale: f32,
    /// Own-block key `u` hidden from slot `j < u` (the target's causal attention; forward only).
    pub causal: bool,
    /// Rows per (sequence, kv group) of the block-key tensor, and the first block key's row.
    pub blk_rows: usize,
    pub blk_offset: usize,
}

impl Dims {
    /// The DFlash layout: full blocks, own keys in their own `[b, kv, r, d]` tensor.
    fn dflash(nb: usize, h: usize, kv: usize, r: usize, s: usize, d: usize, bs: usize) -> Dims {
        Dims {
            nb,
            h,
            kv,
            r,
            s,
            d,
            bs,
            scale: 1.0,
            causal: false,
            blk_rows: r,
            blk_offset: 0,
        }
    }
    pub fn rep(&self) -> usize {
        self.h / self.kv
    }
    /// Blocks per sequence (the last may be partial in causal attention).
    pub fn n(&self) -> usize {
        self.r.div_ceil(self.bs)
    }
    pub fn rows(&self) -> usize {
        self.rep() * self.bs
    }
    pub fn q_len(&self) -> usize {
        self.nb * self.h * self.r * self.d
    }
    /// Elements of one plane (keys or values) of the context / block tensors.
    pub fn ctx_plane(&self) -> usize {
        self.nb * self.kv * self.s * self.d
    }
    pub fn blk_plane(&self) -> usize {
        self.nb * self.kv * self.blk_rows * self.d
    }
    /// Shared memory (bytes) of each CUDA kernel: forward/row backward, block-key and
    /// context-key backward.
    pub fn shared_bytes(&self) -> [usize; 3] {
        let (d, rows, bs) = (self.d, self.rows(), self.bs);
        let row_kernel = 2 * MAX_BLOCK * d;
        let blk = 2 * rows * d + 2 * bs * (d + 1) + 2 * rows * bs + 2 * rows;
        let ctx = 2 * KEYS_PER_CTA * (d + 1) + 2 * rows * d + 2 * rows;
        [row_kernel * 4, blk * 4, ctx * 4]
    }
    /// Within the forward kernel's limits.
    fn fits_forward(&self) -> bool {
        self.bs >= 1
            && self.bs <= MAX_BLOCK
            && self.rows() <= 128
            && self.d <= 128
            && self.s > 0
            && self.shared_bytes()[0] <= SHARED_LIMIT
    }
    /// Within the limits of the forward and the three backward kernels.
    fn fits(&self) -> bool {
        self.fits_forward() && self.shared_bytes().iter().all(|&b| b <= SHARED_LIMIT)
    }
}

/// Fused block attention. `q` `[b, heads, n·B, d]`; `ctx_k`, `ctx_v` `[b, kv_heads, S, d]`;
/// `blk_k`, `blk_v` `[b, kv_heads, n·B, d]`; `visible[i·n + k]` the number of context rows block
/// `k` of sequence `i` sees (rows `0..visible`, clamped to `S`). Returns `[b, n·B, heads·d]` like
/// [`crate::block_attention`], or `None` when the shapes are outside the kernels' limits.
#[allow(clippy::too_many_arguments)]
pub fn flash_block_attention(
    q: &Tensor,
    ctx_k: &Tensor,
    ctx_v: &Tensor,
    blk_k: &Tensor,
    blk_v: &Tensor,
    visible: &[u32],
    block: usize,
    scale: f64,
) -> Result<Option<Tensor>> {
    let (nb, h, r, d) = q.dims4()?;
    let (_, kv, s, _) = ctx_k.dims4()?;
    if block == 0 || !r.is_multiple_of(block) || kv == 0 || !h.is_multiple_of(kv) {
        return Err(CoreError::InvalidInput(format!(
            "flash block attention: {r} rows, block {block}, {h}/{kv} heads"
        )));
    }
    let dims = Dims {
        scale: scale as f32,
        ..Dims::dflash(nb, h, kv, r, s, d, block)
    };
    if visible.len() != nb * dims.n()
        || ctx_v.dims() != ctx_k.dims()
        || blk_k.dims() != [nb, kv, r, d]
        || blk_v.dims() != blk_k.dims()
    {
        return Err(CoreError::InvalidInput(format!(
            "flash block attention: q {:?}, context {:?}/{:?}, block {:?}/{:?}, {} visibility entries",
            q.dims(),
            ctx_k.dims(),
            ctx_v.dims(),
            blk_k.dims(),
            blk_v.dims(),
            visible.len()
        )));
    }
    let dtype = q.dtype();
    if !dims.fits()
        || !matches!(dtype, DType::F32 | DType::BF16)
        || [ctx_k, ctx_v, blk_k, blk_v]
            .iter()
            .any(|t| t.dtype() != dtype)
    {
        return Ok(None);
    }
    let ctx_kv = Tensor::stack(&[ctx_k, ctx_v], 0)?;
    let blk_kv = Tensor::stack(&[blk_k, blk_v], 0)?;
    let op = FlashBlockOp {
        dims,
        visible: visible.iter().map(|&v| v.min(s as u32)).collect(),
        first: vec![0; nb],
    };
    let o = q.contiguous()?.apply_op3(&ctx_kv, &blk_kv, op)?;
    CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(Some(o.transpose(1, 2)?.reshape((nb, r, h * d))?))
}

/// Causal attention, forward only (the frozen target): `q` `[b, heads, T, d]` at positions
/// `past .. past + T` against `k`, `v` `[b, kv_heads, past + T, d]`; query `i` sees keys
/// `0 ..= past + i`, except that `first[b]` (left padding) hides sequence `b`'s keys before it
/// from every query but the key's own (a padding query sees only itself). Returns `[b, heads, T,
/// d]` like [`crate::attention`], or `None` when the shapes are outside the kernels' limits. No
/// gradient flows through it.
pub fn flash_causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    first: &[u32],
    scale: f64,
) -> Result<Option<Tensor>> {
    let (nb, h, t, d) = q.dims4()?;
    let (_, kv, s, _) = k.dims4()?;
    if kv == 0
        || !h.is_multiple_of(kv)
        || s < t
        || v.dims() != k.dims()
        || k.dim(0)? != nb
        || k.dim(3)? != d
        || first.len() != nb
    {
        return Err(CoreError::InvalidInput(format!(
            "causal attention: q {:?}, k {:?}, v {:?}, {} first keys",
            q.dims(),
            k.dims(),
            v.dims(),
            first.len()
        )));
    }
    let past = s - t;
    let dims = Dims {
        scale: scale as f32,
        causal: true,
        blk_rows: s,
        blk_offset: past,
        ..Dims::dflash(nb, h, kv, t, s, d, MAX_BLOCK)
    };
    let dtype = q.dtype();
    if !dims.fits_forward()
        || !matches!(dtype, DType::F32 | DType::BF16)
        || k.dtype() != dtype
        || v.dtype() != dtype
    {
        return Ok(None);
    }
    let n = dims.n();
    let visible: Vec<u32> = (0..nb * n)
        .map(|i| (past + (i % n) * MAX_BLOCK) as u32)
        .collect();
    let kv_t = Tensor::stack(&[k, v], 0)?;
    let op = FlashBlockOp {
        dims,
        visible,
        first: first.to_vec(),
    };
    let o = q.contiguous()?.apply_op3_no_bwd(&kv_t, &kv_t, &op)?;
    CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(Some(o))
}

/// The graph node: inputs `q`, `ctx_kv` `[2, b, kv, S, d]`, `blk_kv` `[2, b, kv, n·B, d]`;
/// output `o` `[b, heads, n·B, d]`.
struct FlashBlockOp {
    dims: Dims,
    visible: Vec<u32>,
    /// Per sequence: keys before it are hidden (left padding), except a row's own key.
    first: Vec<u32>,
}

/// The backward as a node without a backward: inputs `[q, dO, O]` stacked, `ctx_kv`, `blk_kv`;
/// output the flat `[dq | d ctx_kv | d blk_kv]`.
struct FlashBlockGradOp {
    dims: Dims,
    visible: Vec<u32>,
}

fn contiguous_f32(s: &CpuStorage, l: &Layout) -> candle_core::Result<Vec<f32>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("flash block attention: non-contiguous".into()))?;
    Ok(match s {
        CpuStorage::F32(v) => v[a..b].to_vec(),
        CpuStorage::BF16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
        _ => candle_core::bail!("flash block attention: f32 or bf16 only"),
    })
}

fn storage_of(v: Vec<f32>, dtype: DType) -> candle_core::Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(half::bf16::from_f32).collect()),
        _ => candle_core::bail!("flash block attention: f32 or bf16 only"),
    })
}

/// Where one row's data sits (mirrors `row_map` of the CUDA source).
struct Row {
    q: usize,
    ctx: usize,
    blk: usize,
    visible: usize,
    /// Own-block keys this row sees (before `first`'s rule), the context row of own key 0, the
    /// row's slot, and the sequence's first visible key.
    own: usize,
    own_base: usize,
    slot: usize,
    first: usize,
}

fn rows_of<'a>(dims: Dims, visible: &'a [u32], first: &'a [u32]) -> impl Iterator<Item = Row> + 'a {
    let (n, rep, d) = (dims.n(), dims.rep(), dims.d);
    (0..dims.nb).flat_map(move |bi| {
        (0..dims.h).flat_map(move |hh| {
            (0..dims.r).map(move |i| {
                let (g, k) = (hh / rep, i / dims.bs);
                let in_block = dims.bs.min(dims.r - k * dims.bs);
                Row {
                    q: ((bi * dims.h + hh) * dims.r + i) * d,
                    ctx: (bi * dims.kv + g) * dims.s * d,
                    blk: ((bi * dims.kv + g) * dims.blk_rows + dims.blk_offset + k * dims.bs) * d,
                    visible: (visible[bi * n + k] as usize).min(dims.s),
                    own: if dims.causal {
                        in_block.min(i % dims.bs + 1)
                    } else {
                        in_block
                    },
                    own_base: dims.blk_offset + k * dims.bs,
                    slot: i % dims.bs,
                    first: first[bi] as usize,
                }
            })
        })
    })
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The keys of a row: `(offset of the key in its plane, plane)`, context first.
fn keys(dims: &Dims, row: &Row) -> impl Iterator<Item = (usize, bool)> {
    let (d, ctx_off) = (dims.d, row.ctx);
    let ctx = (row.first.min(row.visible)..row.visible).map(move |t| (ctx_off + t * d, true));
    let (blk, base, slot, first) = (row.blk, row.own_base, row.slot, row.first);
    let own = (0..row.own).filter(move |&u| base + u >= first || u == slot);
    ctx.chain(own.map(move |u| (blk + u * d, false)))
}

/// CPU reference forward: `o` `[b, heads, r, d]` and the log-normaliser of every row.
pub(crate) fn forward_reference(
    dims: &Dims,
    visible: &[u32],
    first: &[u32],
    q: &[f32],
    ctx_kv: &[f32],
    blk_kv: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let d = dims.d;
    let (cp, bp) = (dims.ctx_plane(), dims.blk_plane());
    let mut o = vec![0f32; dims.q_len()];
    let mut lse = vec![0f32; dims.q_len() / d];
    for row in rows_of(*dims, visible, first) {
        let qv: Vec<f32> = q[row.q..row.q + d].iter().map(|x| x * dims.scale).collect();
        let key = |(off, ctx): (usize, bool)| {
            if ctx {
                &ctx_kv[off..off + d]
            } else {
                &blk_kv[off..off + d]
            }
        };
        let val = |(off, ctx): (usize, bool)| {
            if ctx {
                &ctx_kv[cp + off..cp + off + d]
            } else {
                &blk_kv[bp + off..bp + off + d]
            }
        };
        let scores: Vec<f32> = keys(dims, &row).map(|k| dot(&qv, key(k))).collect();
        let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0f32;
        let out = &mut o[row.q..row.q + d];
        for (sc, k) in scores.iter().zip(keys(dims, &row)) {
            let p = (sc - m).exp();
            z += p;
            for (oo, vv) in out.iter_mut().zip(val(k)) {
                *oo += p * vv;
            }
        }
        out.iter_mut().for_each(|x| *x /= z);
        lse[row.q / d] = m + z.ln();
    }
    (o, lse)
}

/// CPU reference backward: `(dq, d ctx_kv, d blk_kv)` from `dO` and the forward's output `o`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_reference(
    dims: &Dims,
    visible: &[u32],
    first: &[u32],
    q: &[f32],
    dout: &[f32],
    o: &[f32],
    ctx_kv: &[f32],
    blk_kv: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let d = dims.d;
    let (cp, bp) = (dims.ctx_plane(), dims.blk_plane());
    let (_, lse) = forward_reference(dims, visible, first, q, ctx_kv, blk_kv);
    let mut dq = vec![0f32; q.len()];
    let mut dctx = vec![0f32; ctx_kv.len()];
    let mut dblk = vec![0f32; blk_kv.len()];
    for row in rows_of(*dims, visible, first) {
        let qv: Vec<f32> = q[row.q..row.q + d].iter().map(|x| x * dims.scale).collect();
        let dov = &dout[row.q..row.q + d];
        let dd = dot(dov, &o[row.q..row.q + d]);
        let l = lse[row.q / d];
        for (off, ctx) in keys(dims, &row) {
            let (kvec, vvec) = if ctx {
                (&ctx_kv[off..off + d], &ctx_kv[cp + off..cp + off + d])
            } else {
                (&blk_kv[off..off + d], &blk_kv[bp + off..bp + off + d])
            };
            let p = (dot(&qv, kvec) - l).exp();
            let ds = p * (dot(dov, vvec) - dd);
            for (x, kk) in dq[row.q..row.q + d].iter_mut().zip(kvec) {
                *x += ds * kk * dims.scale;
            }
            let (g, plane) = if ctx {
                (&mut dctx, cp)
            } else {
                (&mut dblk, bp)
            };
            for j in 0..d {
                g[off + j] += ds * qv[j];
                g[plane + off + j] += p * dov[j];
            }
        }
    }
    (dq, dctx, dblk)
}

impl CustomOp3 for FlashBlockOp {
    fn name(&self) -> &'static str {
        "dflash-flash-block-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        c: &CpuStorage,
        lc: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (qv, cv, bv) = (
            contiguous_f32(q, lq)?,
            contiguous_f32(c, lc)?,
            contiguous_f32(b, lb)?,
        );
        let (o, _) = forward_reference(&self.dims, &self.visible, &self.first, &qv, &cv, &bv);
        Ok((storage_of(o, q.dtype())?, lq.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        c: &candle_core::CudaStorage,
        lc: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let o = crate::flash_block_cuda::forward(
            &self.dims,
            &self.visible,
            &self.first,
            (q, lq),
            (c, lc),
            (b, lb),
        )?;
        Ok((o, lq.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        ctx_kv: &Tensor,
        blk_kv: &Tensor,
        o: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = &self.dims;
        if d.causal || !d.r.is_multiple_of(d.bs) || d.blk_rows != d.r || d.blk_offset != 0 {
            candle_core::bail!("flash block attention: no backward for the causal layout");
        }
        let qdo = Tensor::stack(&[q, &grad.to_dtype(q.dtype())?, o], 0)?;
        let flat = qdo.apply_op3_no_bwd(
            &ctx_kv.contiguous()?,
            &blk_kv.contiguous()?,
            &FlashBlockGradOp {
                dims: self.dims,
                visible: self.visible.clone(),
            },
        )?;
        let (nq, nc, nbk) = (
            self.dims.q_len(),
            2 * self.dims.ctx_plane(),
            2 * self.dims.blk_plane(),
        );
        let dq = flat.narrow(0, 0, nq)?.reshape(q.shape())?;
        let dc = flat.narrow(0, nq, nc)?.reshape(ctx_kv.shape())?;
        let db = flat.narrow(0, nq + nc, nbk)?.reshape(blk_kv.shape())?;
        Ok((Some(dq), Some(dc), Some(db)))
    }
}

impl CustomOp3 for FlashBlockGradOp {
    fn name(&self) -> &'static str {
        "dflash-flash-block-attention-grad"
    }

    fn cpu_fwd(
        &self,
        qdo: &CpuStorage,
        lq: &Layout,
        c: &CpuStorage,
        lc: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let all = contiguous_f32(qdo, lq)?;
        let nq = self.dims.q_len();
        let (q, rest) = all.split_at(nq);
        let (dout, o) = rest.split_at(nq);
        let (cv, bv) = (contiguous_f32(c, lc)?, contiguous_f32(b, lb)?);
        let first = vec![0; self.dims.nb];
        let (mut dq, dc, db) =
            backward_reference(&self.dims, &self.visible, &first, q, dout, o, &cv, &bv);
        dq.extend(dc);
        dq.extend(db);
        let len = dq.len();
        Ok((storage_of(dq, qdo.dtype())?, Shape::from(len)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qdo: &candle_core::CudaStorage,
        lq: &Layout,
        c: &candle_core::CudaStorage,
        lc: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (g, len) = crate::flash_block_cuda::backward(
            &self.dims,
            &self.visible,
            (qdo, lq),
            (c, lc),
            (b, lb),
        )?;
        Ok((g, Shape::from(len)))
    }
}

#[cfg(test)]
#[path = "flash_block_tests.rs"]
mod tests;
