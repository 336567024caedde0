//! The device step's writes into fixed buffers on CUDA (`step_kernels.cu` and
//! `decode_kernels.cu`): metadata uploads, copies into step inputs, the KV caches' kept-row
//! compaction, and an attention layer's q/k/v heads normed, rotated and written into its cache.
//!
//! Invariants: as [`crate::step_cuda`]'s — every tensor at its contiguous offset, the cache
//! buffers written in place through their device addresses, on candle's stream, in order.

use crate::step_cuda::{address, ptx, suffix, MODULE};
use crate::{CoreError, Result};
use candle_core::cuda_backend::cudarc::driver::{self, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Tensor};

/// Copies `words` into the device tensor `meta` (u32, at least as long), on candle's stream.
pub(crate) fn upload_meta(meta: &Tensor, words: &[u32]) -> Result<()> {
    if meta.elem_count() < words.len() {
        return Err(CoreError::InvalidInput(format!(
            "device step: metadata of {} words into a buffer of {}",
            words.len(),
            meta.elem_count()
        )));
    }
    let (ptr, dev) = address(meta, "step metadata")?;
    let stream = dev.cuda_stream();
    // SAFETY: `ptr` is a live u32 buffer of at least `words.len()` elements on this stream;
    // a copy from pageable memory has left `words` before the call returns.
    unsafe { driver::result::memcpy_htod_async(ptr, words, stream.cu_stream()) }.w()?;
    Ok(())
}

/// Copies `src` into `dst` (same shape and dtype; `dst` contiguous), on candle's stream.
pub(crate) fn copy_into(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.dims() != src.dims() || dst.dtype() != src.dtype() {
        return Err(CoreError::InvalidInput(format!(
            "device step: input {:?} {:?} for a shape captured with {:?} {:?}",
            src.dims(),
            src.dtype(),
            dst.dims(),
            dst.dtype()
        )));
    }
    let src = src.contiguous()?;
    let (dp, dev) = address(dst, "step input")?;
    let (sp, _) = address(&src, "step input")?;
    let bytes = dst.elem_count() * dst.dtype().size_in_bytes();
    let stream = dev.cuda_stream();
    // SAFETY: both are live contiguous buffers of `bytes` bytes on this stream.
    unsafe { driver::result::memcpy_dtod_async(dp, sp, bytes, stream.cu_stream()) }.w()?;
    Ok(())
}

/// Moves rows `base + rows[i]` to `base + i` in every buffer (`[1, kv_heads, capacity, d]`,
/// one dtype), one kernel for all of them. `rows` must be strictly increasing (a tree path).
pub(crate) fn keep_rows_all(buffers: &[Tensor], base: usize, rows: &[u32]) -> Result<()> {
    let Some(first) = buffers.first() else {
        return Ok(());
    };
    let (_, kv, cap, d) = first.dims4()?;
    let dtype = first.dtype();
    if buffers
        .iter()
        .any(|b| b.dims() != first.dims() || b.dtype() != dtype)
        || rows.windows(2).any(|w| w[0] >= w[1])
    {
        return Err(CoreError::InvalidInput(
            "keep_rows: buffers of one shape and increasing rows expected".into(),
        ));
    }
    let mut addrs = Vec::with_capacity(buffers.len());
    let mut dev = None;
    for b in buffers {
        let (p, dv) = address(b, "keep_rows buffer")?;
        addrs.push(p as i64);
        dev = Some(dv);
    }
    let dev = dev.expect("at least one buffer");
    let table = Tensor::from_slice(&addrs, addrs.len(), first.device())?;
    let idx = Tensor::from_slice(rows, rows.len(), first.device())?;
    let (tp, _) = address(&table, "keep_rows address table")?;
    let (ip, _) = address(&idx, "keep_rows rows")?;
    let (mi, bi, kvi, ci, di) = (
        rows.len() as i32,
        base as i32,
        kv as i32,
        cap as i32,
        d as i32,
    );
    let cfg = LaunchConfig {
        grid_dim: ((buffers.len() * kv) as u32, 1, 1),
        block_dim: (d.clamp(32, 256) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let name = format!("kv_keep_rows_{}", suffix(dtype)?);
    let f = dev.get_or_load_custom_func(&name, MODULE, ptx()?)?;
    crate::pdl::mark(&f);
    let mut b = f.builder();
    b.arg(&tp)
        .arg(&ip)
        .arg(&mi)
        .arg(&bi)
        .arg(&kvi)
        .arg(&ci)
        .arg(&di);
    // SAFETY: the table holds live cache buffers of `cap` rows of `kv` heads of `d`, the rows
    // are below `cap`; the arguments in the kernel's order and types.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn qkv_heads_into_cache(
    y: &Tensor,
    cos_sin: &Tensor,
    norms: Option<&Tensor>,
    (h, kv, hd): (usize, usize, usize),
    rot: usize,
    eps: f32,
    kbuf: &Tensor,
    vbuf: &Tensor,
    meta: &Tensor,
    gated: bool,
    q_from: usize,
) -> Result<Tensor> {
    let (n, width) = y.dims2()?;
    let (_, kvb, cap, db) = kbuf.dims4()?;
    let dtype = y.dtype();
    // gated: each q head followed by its gate, and f32 norm weights (the hybrids')
    let q_width = if gated { 2 * h * hd } else { h * hd };
    let norm_dtype = if gated { DType::F32 } else { dtype };
    if width != q_width + 2 * kv * hd
        || norms.is_some_and(|w| w.elem_count() != 2 * hd || w.dtype() != norm_dtype)
        || kvb != kv
        || db != hd
        || vbuf.dims() != kbuf.dims()
        || cos_sin.dims2()? != (2 * n, rot / 2)
        || !hd.is_multiple_of(32)
        || hd > 1024
        || !rot.is_multiple_of(2)
        || rot > hd
        || q_from >= n
        || [cos_sin.dtype(), kbuf.dtype(), vbuf.dtype()]
            .iter()
            .any(|&t| t != dtype)
    {
        return Err(CoreError::InvalidInput(format!(
            "qkv_heads_into_cache: y {:?}, cos/sin {:?}, cache {:?} for {h}/{kv} heads of {hd}, \
             q from row {q_from}",
            y.dims(),
            cos_sin.dims(),
            kbuf.dims()
        )));
    }
    let half = rot / 2;
    let (yp, dev) = address(y, "qkv_heads_into_cache y")?;
    let (cp, _) = address(cos_sin, "qkv_heads_into_cache cos/sin")?;
    let sp = cp + (n * half * dtype.size_in_bytes()) as u64;
    // without norms the kernel never reads the weights: any live address fills the slot
    let (qw, kw) = match norms {
        Some(w) => {
            let (wp, _) = address(w, "qkv_heads_into_cache norms")?;
            (wp, wp + (hd * norm_dtype.size_in_bytes()) as u64)
        }
        None => (yp, yp),
    };
    let (kbp, _) = address(kbuf, "qkv_heads_into_cache cache")?;
    let (vbp, _) = address(vbuf, "qkv_heads_into_cache cache")?;
    let (mp, _) = address(meta, "qkv_heads_into_cache meta")?;
    // SAFETY: one thread per (row from q_from, q head, channel) writes every element of q.
    let q = unsafe { Tensor::empty((1, h, n - q_from, hd), dtype, y.device())? };
    let (qp, _) = address(&q, "qkv_heads_into_cache q")?;
    let ints = [n, h, kv, hd, rot, norms.is_some() as usize].map(|x| x as i32);
    let (capi, q_from) = (cap as i32, q_from as i32);
    let cfg = LaunchConfig {
        grid_dim: (n as u32, (h + 2 * kv) as u32, 1),
        block_dim: (hd as u32, 1, 1),
        shared_mem_bytes: ((hd + 33) * 4) as u32,
    };
    let name = format!(
        "{}qkv_heads_cache_{}",
        if gated { "gated_" } else { "" },
        suffix(dtype)?
    );
    let f = dev.get_or_load_custom_func(
        &name,
        crate::decode_ops_cuda::MODULE,
        crate::decode_ops_cuda::ptx()?,
    )?;
    crate::pdl::mark(&f);
    let mut b = f.builder();
    b.arg(&yp).arg(&cp).arg(&sp).arg(&qw).arg(&kw);
    for x in &ints {
        b.arg(x);
    }
    b.arg(&eps)
        .arg(&qp)
        .arg(&kbp)
        .arg(&vbp)
        .arg(&mp)
        .arg(&capi)
        .arg(&q_from);
    // SAFETY: arguments in the kernel's order and types; every pointer is a live contiguous
    // tensor of the size the kernel reads or writes (checked above).
    unsafe { b.launch(cfg) }.w()?;
    Ok(q)
}

/// `x + d` (returned, `[rows, W]`) and its RMSNorm times `w`, written into `dst` (contiguous,
/// `[.., W]`) at rows `row..row + rows` — `decode_ops::add_rms_norm`'s kernel and arithmetic with
/// the normed rows in a buffer of the caller's.
pub(crate) fn add_rms_norm_into(
    x: &Tensor,
    d: &Tensor,
    w: &Tensor,
    eps: f32,
    dst: &Tensor,
    row: usize,
) -> Result<Tensor> {
    let width = x.dims().last().copied().unwrap_or(0);
    let rows = x.elem_count() / width.max(1);
    let dtype = x.dtype();
    let dst_rows = dst.elem_count() / width.max(1);
    if width == 0
        || d.dims() != x.dims()
        || w.dims() != [width]
        || dst.dims().last() != Some(&width)
        || row + rows > dst_rows
        || [d.dtype(), w.dtype(), dst.dtype()]
            .iter()
            .any(|&t| t != dtype)
    {
        return Err(CoreError::InvalidInput(format!(
            "add_rms_norm_into: x {:?}, d {:?}, w {:?} into {:?} at row {row}",
            x.dims(),
            d.dims(),
            w.dims(),
            dst.dims()
        )));
    }
    let (x, d) = (x.contiguous()?, d.contiguous()?);
    let (xp, dev) = address(&x, "add_rms_norm_into x")?;
    let (dp, _) = address(&d, "add_rms_norm_into d")?;
    let (wp, _) = address(w, "add_rms_norm_into w")?;
    let (np, _) = address(dst, "add_rms_norm_into dst")?;
    let np = np + (row * width * dtype.size_in_bytes()) as u64;
    // SAFETY: each row's block writes its sum.
    let sum = unsafe { Tensor::empty(x.dims(), dtype, x.device())? };
    let (sp, _) = address(&sum, "add_rms_norm_into sum")?;
    let (r, wd) = (rows as i32, width as i32);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (width.clamp(32, 1024).div_ceil(32) as u32 * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    let name = format!("add_rms_norm_into_{}", suffix(dtype)?);
    let f = dev.get_or_load_custom_func(
        &name,
        crate::decode_ops_cuda::MODULE,
        crate::decode_ops_cuda::ptx()?,
    )?;
    crate::pdl::mark(&f);
    let mut b = f.builder();
    b.arg(&xp)
        .arg(&dp)
        .arg(&wp)
        .arg(&r)
        .arg(&wd)
        .arg(&eps)
        .arg(&sp)
        .arg(&np);
    // SAFETY: arguments in the kernel's order and types; x, d and sum hold `rows` rows of
    // `width`, dst holds rows `row..row + rows` (checked above), w one row.
    unsafe { b.launch(cfg) }.w()?;
    Ok(sum)
}
