//! Launches of the fused block-attention kernels (`flash_block.cu`), compiled by NVRTC once per
//! head dim and cached for the process.
//!
//! Invariants: every input is read through its contiguous offsets (an input that is not
//! contiguous is an error, never a silent misread); every output element is written by exactly
//! one thread, so outputs are allocated uninitialised; launches go on candle's stream, in order,
//! so the backward's scratch (log-normalisers and `D`) is complete before its readers run.

use crate::flash_block::{Dims, MAX_BLOCK};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout};
use std::collections::HashMap;
use std::sync::Mutex;

const SOURCE: &str = include_str!("flash_block.cu");
const KEYS_PER_CTA: u32 = 32;
/// Threads sharing a row or a context key in the split backward kernels (`KP` in the source).
const THREADS_PER_ROW: usize = 4;
/// Thread blocks the split context-key kernel aims for (about 8 per SM of an H200's 132): the
/// blocks a key's gradient sums over are split into parts until the grid has this many.
const TARGET_CTAS: usize = 1024;

/// The split backward kernels (4 threads a row, blocks split into parts) unless
/// `DFLASH_FLASH_BWD=row` asks for the one-thread-per-row kernels (kept to compare; both are
/// checked against the composite by `dflash bench attention`).
fn split_backward(d: usize) -> bool {
    static ROW: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let row = *ROW.get_or_init(|| std::env::var("DFLASH_FLASH_BWD").as_deref() == Ok("row"));
    d.is_multiple_of(THREADS_PER_ROW) && !row
}

/// PTX for head dim `d` (compiled on first use and kept for the process: a launch borrows it
/// instead of copying it).
fn ptx(d: usize) -> candle_core::Result<&'static str> {
    static CACHE: Mutex<Option<HashMap<usize, &'static str>>> = Mutex::new(None);
    let mut cache = CACHE.lock().expect("ptx cache poisoned");
    let map = cache.get_or_insert_with(HashMap::new);
    if let Some(p) = map.get(&d) {
        return Ok(p);
    }
    let src = format!("#define HD {d}\n{SOURCE}");
    let ptx = candle_core::cuda_backend::cudarc::nvrtc::compile_ptx(src).map_err(|e| {
        candle_core::Error::Msg(format!("flash block attention: NVRTC failed: {e:?}"))
    })?;
    let p: &'static str = Box::leak(ptx.to_src().into_boxed_str());
    map.insert(d, p);
    Ok(p)
}

/// Loads kernel `$name` for head dim `$d` on `$dev` (a macro: candle does not export the type).
macro_rules! func {
    ($dev:expr, $d:expr, $name:expr) => {
        $dev.get_or_load_custom_func(&$name, &format!("dflash_flash_block_hd{}", $d), ptx($d)?)
    };
}

fn view<'a, T: CudaDType + DeviceRepr>(
    s: &'a CudaStorage,
    l: &Layout,
) -> candle_core::Result<CudaView<'a, T>> {
    let (a, b) = l.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::Msg("flash block attention: non-contiguous input".into())
    })?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

fn suffix(dtype: DType) -> candle_core::Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        d => candle_core::bail!("flash block attention: {d:?} not supported"),
    }
}

/// Grid `(n blocks, b·kv)`, one thread per row of a kv group (rounded up to a warp).
fn row_config(dims: &Dims, shared: usize) -> LaunchConfig {
    let threads = dims.rows().div_ceil(32) * 32;
    LaunchConfig {
        grid_dim: (dims.n() as u32, (dims.nb * dims.kv) as u32, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

type Arg<'a> = (&'a CudaStorage, &'a Layout);

pub(crate) fn forward(
    dims: &Dims,
    visible: &[u32],
    first: &[u32],
    q: Arg,
    ctx_kv: Arg,
    blk_kv: Arg,
) -> candle_core::Result<CudaStorage> {
    match q.0.dtype() {
        DType::F32 => forward_t::<f32>(dims, visible, first, q, ctx_kv, blk_kv),
        DType::BF16 => forward_t::<half::bf16>(dims, visible, first, q, ctx_kv, blk_kv),
        d => candle_core::bail!("flash block attention: {d:?} not supported"),
    }
}

fn forward_t<T: CudaDType + DeviceRepr>(
    dims: &Dims,
    visible: &[u32],
    first: &[u32],
    q: Arg,
    ctx_kv: Arg,
    blk_kv: Arg,
) -> candle_core::Result<CudaStorage> {
    let dev = q.0.device().clone();
    let sfx = suffix(q.0.dtype())?;
    let (qv, cv, bv) = (
        view::<T>(q.0, q.1)?,
        view::<T>(ctx_kv.0, ctx_kv.1)?,
        view::<T>(blk_kv.0, blk_kv.1)?,
    );
    let vis: CudaSlice<u32> = dev.clone_htod(visible)?;
    let first: CudaSlice<u32> = dev.clone_htod(first)?;
    // SAFETY: every element is written by the kernel (one thread per row and dim).
    let out = unsafe { dev.alloc::<T>(dims.q_len())? };
    let f = func!(dev, dims.d, format!("flash_block_fwd_{sfx}"))?;
    let mut b = f.builder();
    b.arg(&qv).arg(&cv).arg(&bv).arg(&vis).arg(&first).arg(&out);
    let ints = [
        dims.nb,
        dims.h,
        dims.kv,
        dims.r,
        dims.s,
        dims.bs,
        dims.blk_rows,
        dims.blk_offset,
        dims.causal as usize,
    ]
    .map(|x| x as i32);
    for x in &ints {
        b.arg(x);
    }
    b.arg(&dims.scale);
    // SAFETY: the arguments match the kernel's signature; the grid covers every row.
    unsafe { b.launch(row_config(dims, 2 * MAX_BLOCK * dims.d * 4)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

pub(crate) fn backward(
    dims: &Dims,
    visible: &[u32],
    qdo: Arg,
    ctx_kv: Arg,
    blk_kv: Arg,
) -> candle_core::Result<(CudaStorage, usize)> {
    match qdo.0.dtype() {
        DType::F32 => backward_t::<f32>(dims, visible, qdo, ctx_kv, blk_kv),
        DType::BF16 => backward_t::<half::bf16>(dims, visible, qdo, ctx_kv, blk_kv),
        d => candle_core::bail!("flash block attention: {d:?} not supported"),
    }
}

fn backward_t<T: CudaDType + DeviceRepr>(
    dims: &Dims,
    visible: &[u32],
    qdo: Arg,
    ctx_kv: Arg,
    blk_kv: Arg,
) -> candle_core::Result<(CudaStorage, usize)> {
    let dev = qdo.0.device().clone();
    let sfx = suffix(qdo.0.dtype())?;
    let nq = dims.q_len();
    let all = view::<T>(qdo.0, qdo.1)?;
    let (q, dout, o) = (
        all.slice(0..nq),
        all.slice(nq..2 * nq),
        all.slice(2 * nq..3 * nq),
    );
    let (cv, bv) = (
        view::<T>(ctx_kv.0, ctx_kv.1)?,
        view::<T>(blk_kv.0, blk_kv.1)?,
    );
    let vis: CudaSlice<u32> = dev.clone_htod(visible)?;
    let (nc, nbk) = (2 * dims.ctx_plane(), 2 * dims.blk_plane());
    let len = nq + nc + nbk;
    // SAFETY: the three gradient kernels together write every element once.
    let mut out = unsafe { dev.alloc::<T>(len)? };
    // SAFETY: written by the row kernel before the other two read them.
    let lse = unsafe { dev.alloc::<f32>(nq / dims.d)? };
    let dd = unsafe { dev.alloc::<f32>(nq / dims.d)? };
    let ints = [dims.nb, dims.h, dims.kv, dims.r, dims.s, dims.bs].map(|x| x as i32);
    let [_, shared_blk, shared_ctx] = dims.shared_bytes();
    let split = split_backward(dims.d);
    {
        let mut dq = out.slice_mut(0..nq);
        let name = if split {
            "flash_block_bwd_q4"
        } else {
            "flash_block_bwd_q"
        };
        let f = func!(dev, dims.d, format!("{name}_{sfx}"))?;
        let mut b = f.builder();
        b.arg(&q).arg(&dout).arg(&o).arg(&cv).arg(&bv).arg(&vis);
        b.arg(&mut dq).arg(&lse).arg(&dd);
        for x in &ints {
            b.arg(x);
        }
        b.arg(&dims.scale);
        let mut cfg = row_config(dims, 2 * MAX_BLOCK * dims.d * 4);
        if split {
            cfg.block_dim.0 = ((dims.rows() * THREADS_PER_ROW).div_ceil(32) * 32) as u32;
        }
        // SAFETY: matches the kernel's signature; the grid covers every row.
        unsafe { b.launch(cfg) }.w()?;
    }
    {
        let mut dblk = out.slice_mut(nq + nc..len);
        let f = func!(dev, dims.d, format!("flash_block_bwd_blk_{sfx}"))?;
        let mut b = f.builder();
        b.arg(&q)
            .arg(&dout)
            .arg(&bv)
            .arg(&lse)
            .arg(&dd)
            .arg(&mut dblk);
        let blk_ints = [dims.nb, dims.h, dims.kv, dims.r, dims.bs].map(|x| x as i32);
        for x in &blk_ints {
            b.arg(x);
        }
        b.arg(&dims.scale);
        let cfg = LaunchConfig {
            grid_dim: (dims.n() as u32, (dims.nb * dims.kv) as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: shared_blk as u32,
        };
        // SAFETY: matches the kernel's signature; one thread block per block and kv group.
        unsafe { b.launch(cfg) }.w()?;
    }
    let mut dctx = out.slice_mut(nq..nq + nc);
    let key_tiles = (dims.s as u32).div_ceil(KEYS_PER_CTA);
    if split {
        let base = key_tiles as usize * dims.nb * dims.kv;
        let n = dims.n();
        let per = n.div_ceil(TARGET_CTAS.div_ceil(base).clamp(1, n.min(16)));
        let parts = n.div_ceil(per);
        // SAFETY: every thread block writes its part's partial sums for all its keys.
        let part = unsafe { dev.alloc::<f32>(parts * nc)? };
        let f = func!(dev, dims.d, format!("flash_block_bwd_kv4_{sfx}"))?;
        let mut b = f.builder();
        b.arg(&q)
            .arg(&dout)
            .arg(&cv)
            .arg(&vis)
            .arg(&lse)
            .arg(&dd)
            .arg(&part);
        for x in &ints {
            b.arg(x);
        }
        let per = per as i32;
        b.arg(&per).arg(&dims.scale);
        let rows = dims.rows();
        let cfg = LaunchConfig {
            grid_dim: (key_tiles, (dims.nb * dims.kv) as u32, parts as u32),
            block_dim: (KEYS_PER_CTA * THREADS_PER_ROW as u32, 1, 1),
            shared_mem_bytes: ((2 * rows * dims.d + 2 * rows) * 4) as u32,
        };
        // SAFETY: matches the kernel's signature; the grid covers every key and part.
        unsafe { b.launch(cfg) }.w()?;
        let f = func!(dev, dims.d, format!("flash_block_sum_{sfx}"))?;
        let mut b = f.builder();
        let (len, parts) = (nc as i64, parts as i32);
        b.arg(&part).arg(&mut dctx).arg(&len).arg(&parts);
        let cfg = LaunchConfig {
            grid_dim: (nc.div_ceil(256).min(8192) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches the kernel's signature; the grid-stride loop covers all `len`.
        unsafe { b.launch(cfg) }.w()?;
    } else {
        let f = func!(dev, dims.d, format!("flash_block_bwd_kv_{sfx}"))?;
        let mut b = f.builder();
        b.arg(&q)
            .arg(&dout)
            .arg(&cv)
            .arg(&vis)
            .arg(&lse)
            .arg(&dd)
            .arg(&mut dctx);
        for x in &ints {
            b.arg(x);
        }
        b.arg(&dims.scale);
        let cfg = LaunchConfig {
            grid_dim: (key_tiles, (dims.nb * dims.kv) as u32, 1),
            block_dim: (KEYS_PER_CTA, 1, 1),
            shared_mem_bytes: shared_ctx as u32,
        };
        // SAFETY: matches the kernel's signature; the grid covers every context key.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), len))
}
