//! The weight-streaming GEMM's CUDA launches (`stream_gemm.cu`, `stream_gemm_tiled.cu`, compiled
//! at run time by NVRTC): the narrow, wide, tiled and split kernels and the add+norm prologue,
//! behind [`crate::stream_gemm`]'s policy, which decides which calls reach them.
//!
//! Invariants: every launch runs on candle's stream; a call the kernels cannot take (shape,
//! alignment, no tensor cores, no PTX) returns `None` and stays on cuBLAS; the kernels' choice for a
//! call depends on its row count and the weight alone, never on data, so a row's bits are fixed
//! for the run.
use crate::step_cuda::address;
use crate::stream_gemm::Epilogue;
use crate::Result;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::cudarc::nvrtc::compile_ptx_with_opts;
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Tensor};
use std::sync::OnceLock;

/// The narrow kernels, then the tiled one (which uses their helpers).
const SOURCE: &str = concat!(
    include_str!("stream_gemm.cu"),
    include_str!("stream_gemm_tiled.cu")
);
const MODULE: &str = "dflash_stream_gemm";

/// The module's PTX (compute 8.0: `mma.sync` on bf16), or why there is none.
fn ptx() -> Option<&'static str> {
    static PTX: OnceLock<Option<String>> = OnceLock::new();
    PTX.get_or_init(|| {
        let opts = crate::pdl::nvrtc_options(Some("compute_80"));
        compile_ptx_with_opts(crate::pdl::with_prelude(SOURCE), opts)
            .map(|p| p.to_src())
            .ok()
    })
    .as_deref()
}

pub(crate) fn stream_matmul(x: &Tensor, w: &Tensor, epilogue: Epilogue) -> Result<Option<Tensor>> {
    let (m, width) = x.dims2()?;
    let (n, k) = w.dims2()?;
    let want = if epilogue == Epilogue::Silu { 2 * k } else { k };
    if width != want || !k.is_multiple_of(64) || !w.is_contiguous() || n >= i32::MAX as usize {
        return Ok(None);
    }
    let Some(ptx) = ptx() else { return Ok(None) };
    let x = x.contiguous()?;
    let (xp, dev) = address(&x, "stream_matmul x")?;
    let (wp, _) = address(w, "stream_matmul w")?;
    if wp % 16 != 0 || xp % 16 != 0 {
        return Ok(None);
    }
    static TENSOR_CORES: OnceLock<bool> = OnceLock::new();
    let capable = *TENSOR_CORES.get_or_init(|| {
        let cc = dev.cuda_stream().context().compute_capability();
        matches!(cc, Ok((major, _)) if major >= 8)
    });
    if !capable {
        return Ok(None);
    }
    // calls of 17–80 rows on the wide kernel (`--bit-exact`'s default): one block per 16
    // outputs for all rows
    let wide = m > 16
        && m <= crate::stream_gemm::WIDE_MAX_ROWS
        && epilogue != Epilogue::Silu
        && crate::stream_gemm::wide_calls()
        && crate::stream_gemm::wide_fills(n, crate::step_cuda::multiprocessors(&dev));
    let tiled = !wide && crate::stream_gemm::tiled_from_rows().is_some_and(|from| m >= from);
    if epilogue != Epilogue::Silu && crate::stream_gemm::split_call(m, w, epilogue == Epilogue::F32)
    {
        if let Some(y) = split_matmul(&x, w, epilogue == Epilogue::F32, &dev)? {
            return Ok(Some(y));
        }
    }
    // narrow calls with the weight's tiles brought in by the copy engine (the same bits)
    if !wide && !tiled && epilogue != Epilogue::Silu {
        if let Some(variant) =
            crate::stream_gemm::bulk_fetch().or_else(|| crate::stream_gemm::bulk_large_k(m, w))
        {
            let f32_out = epilogue == Epilogue::F32;
            if let Some(y) = crate::stream_gemm_bulk::matmul(&x, w, f32_out, variant)? {
                return Ok(Some(y));
            }
        }
    }
    let out_dtype = if epilogue == Epilogue::F32 {
        DType::F32
    } else {
        DType::BF16
    };
    // SAFETY: the kernel writes every one of the m·n outputs.
    let y = unsafe { Tensor::empty((m, n), out_dtype, x.device())? };
    let (yp, _) = address(&y, "stream_matmul y")?;
    let warps = crate::stream_gemm::k_warps(n, k);
    if tiled {
        // one block per 64 × 64 output tile, 8 warps, two shared-memory stages of the weight,
        // x (and up) tiles: 2 · 3 · 64 rows · 128 bytes
        let name = match epilogue {
            Epilogue::Bf16 => "stream_gemm_tiled_bf16",
            Epilogue::F32 => "stream_gemm_tiled_f32out",
            Epilogue::Silu => "stream_gemm_tiled_silu_bf16",
        };
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(64) as u32, m.div_ceil(64) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 2 * 3 * 64 * 128,
        };
        let f = dev.get_or_load_custom_func(name, MODULE, ptx)?;
        crate::pdl::mark(&f);
        let (mi, ni, ki, kwi) = (m as i32, n as i32, k as i32, warps as i32);
        let mut b = f.builder();
        b.arg(&xp)
            .arg(&wp)
            .arg(&mi)
            .arg(&ni)
            .arg(&ki)
            .arg(&kwi)
            .arg(&yp);
        // SAFETY: arguments in the kernel's order and types; x, w and y are live contiguous
        // tensors of the sizes the kernel reads and writes; the dynamic shared memory is the
        // kernel's two stages (48 KiB, no opt-in attribute needed).
        unsafe { b.launch(cfg) }.w()?;
        return Ok(Some(y));
    }
    let tiles = if m <= 8 { 8 } else { 16 };
    let (name, row_groups) = match (wide, epilogue) {
        (true, Epilogue::F32) => (format!("stream_gemm_wide_g{}_f32out", m.div_ceil(16)), 1),
        (true, _) => (format!("stream_gemm_wide_g{}_bf16", m.div_ceil(16)), 1),
        (false, Epilogue::Bf16) => (format!("stream_gemm_m{tiles}_bf16"), m.div_ceil(16)),
        (false, Epilogue::F32) => (format!("stream_gemm_m{tiles}_f32out"), m.div_ceil(16)),
        (false, Epilogue::Silu) => (format!("stream_gemm_silu_m{tiles}_bf16"), m.div_ceil(16)),
    };
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(16) as u32, row_groups as u32, 1),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = dev.get_or_load_custom_func(&name, MODULE, ptx)?;
    crate::pdl::mark(&f);
    let (mi, ni, ki) = (m as i32, n as i32, k as i32);
    let mut b = f.builder();
    b.arg(&xp).arg(&wp).arg(&mi).arg(&ni).arg(&ki).arg(&yp);
    // SAFETY: arguments in the kernel's order and types; x, w and y are live contiguous
    // tensors of the sizes the kernel reads and writes (the wide kernel: m ≤ 16 · groups).
    unsafe { b.launch(cfg) }.w()?;
    Ok(Some(y))
}

/// The split kernel's call (see [`crate::stream_gemm::split_call`]), or `None` when its counters
/// are not to be had (too many tiles, or none made yet while a graph is captured): the caller
/// takes the other kernels.
pub(crate) fn split_matmul(
    x: &Tensor,
    w: &Tensor,
    f32_out: bool,
    dev: &candle_core::cuda_backend::CudaDevice,
) -> Result<Option<Tensor>> {
    /// The kernel's pipeline depth (`SP_STAGES` in stream_gemm_tiled.cu).
    const STAGES: usize = 3;
    let Some(ptx) = ptx() else { return Ok(None) };
    let (m, _) = x.dims2()?;
    let (n, k) = w.dims2()?;
    let (xp, _) = address(x, "split_matmul x")?;
    let (wp, _) = address(w, "split_matmul w")?;
    let cc = dev.cuda_stream().context().compute_capability();
    if xp % 16 != 0 || wp % 16 != 0 || !matches!(cc, Ok((major, _)) if major >= 8) {
        return Ok(None);
    }
    let (bn, xt) = crate::stream_gemm::split_tile(m);
    let (x_tiles, w_tiles) = (m.div_ceil(16 * xt), n.div_ceil(bn));
    let kw = crate::stream_gemm::k_warps(n, k);
    let counters = if kw > 1 {
        match crate::step_cuda::block_counters(dev, x_tiles * w_tiles)? {
            Some(c) => c,
            None => return Ok(None),
        }
    } else {
        0
    };
    let out_dtype = if f32_out { DType::F32 } else { DType::BF16 };
    // SAFETY: the kernel writes every one of the m·n outputs, and (kw > 1) every partial it
    // reads.
    let y = unsafe { Tensor::empty((m, n), out_dtype, x.device())? };
    let part = if kw > 1 {
        Some(unsafe { Tensor::empty((kw, m, n), DType::F32, x.device())? })
    } else {
        None
    };
    let (yp, _) = address(&y, "split_matmul y")?;
    let pp = match &part {
        Some(p) => address(p, "split_matmul partials")?.0,
        None => 0,
    };
    let out = if f32_out { "f32out" } else { "bf16" };
    let name = match bn {
        64 => format!("stream_gemm_split_x{xt}_{out}"),
        _ => format!("stream_gemm_split_b{bn}_x{xt}_{out}"),
    };
    // a stage: bn weight rows and 16·xt x rows of 128 bytes
    let smem = STAGES * 128 * (bn + 16 * xt);
    let f = dev.get_or_load_custom_func(&name, MODULE, ptx)?;
    crate::step_cuda::allow_dynamic_shared_memory(&f, dev, &name, smem)?;
    crate::pdl::mark(&f);
    let cfg = LaunchConfig {
        grid_dim: (x_tiles as u32, w_tiles as u32, kw as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (mi, ni, ki, kwi) = (m as i32, n as i32, k as i32, kw as i32);
    let mut b = f.builder();
    b.arg(&xp).arg(&wp).arg(&mi).arg(&ni).arg(&ki).arg(&kwi);
    b.arg(&pp).arg(&counters).arg(&yp);
    // SAFETY: arguments in the kernel's order and types; x, w, y and the partials are live
    // contiguous tensors of the sizes the kernel reads and writes; the counters are the
    // process's zeroed buffer with a counter for each of the grid's (x tile, weight tile)
    // pairs; the dynamic shared memory was allowed above.
    unsafe { b.launch(cfg) }.w()?;
    Ok(Some(y))
}

pub(crate) fn stream_add_norm_matmul(
    x: &Tensor,
    d: &Tensor,
    norm_w: &Tensor,
    eps: f32,
    w: &Tensor,
) -> Result<Option<(Tensor, Tensor)>> {
    let (m, k) = x.dims2()?;
    let (n, kw) = w.dims2()?;
    if kw != k || norm_w.dims() != [k] || !k.is_multiple_of(64) || !w.is_contiguous() {
        return Ok(None);
    }
    if n >= i32::MAX as usize {
        return Ok(None);
    }
    let Some(ptx) = ptx() else { return Ok(None) };
    let (x, d, norm_w) = (x.contiguous()?, d.contiguous()?, norm_w.contiguous()?);
    let (xp, dev) = address(&x, "stream_add_norm_matmul x")?;
    let (dp, _) = address(&d, "stream_add_norm_matmul d")?;
    let (np, _) = address(&norm_w, "stream_add_norm_matmul norm")?;
    let (wp, _) = address(w, "stream_add_norm_matmul w")?;
    if [xp, dp, np, wp].iter().any(|p| p % 16 != 0) {
        return Ok(None);
    }
    let cc = dev.cuda_stream().context().compute_capability();
    if !matches!(cc, Ok((major, _)) if major >= 8) {
        return Ok(None);
    }
    // SAFETY: the kernel writes every one of the m·n outputs and the m·k sums.
    let y = unsafe { Tensor::empty((m, n), DType::BF16, x.device())? };
    let s = unsafe { Tensor::empty((m, k), DType::BF16, x.device())? };
    let (yp, _) = address(&y, "stream_add_norm_matmul y")?;
    let (sp, _) = address(&s, "stream_add_norm_matmul sum")?;
    let tiles = if m <= 8 { 8 } else { 16 };
    let warps = crate::stream_gemm::k_warps(n, k);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let f =
        dev.get_or_load_custom_func(&format!("stream_gemm_addnorm_m{tiles}_bf16"), MODULE, ptx)?;
    crate::pdl::mark(&f);
    let (mi, ni, ki) = (m as i32, n as i32, k as i32);
    let mut b = f.builder();
    b.arg(&xp).arg(&dp).arg(&np).arg(&eps).arg(&wp);
    b.arg(&mi).arg(&ni).arg(&ki).arg(&yp).arg(&sp);
    // SAFETY: arguments in the kernel's order and types; x, d, the norm weight, w, y and the
    // sums are live contiguous tensors of the sizes the kernel reads and writes.
    unsafe { b.launch(cfg) }.w()?;
    Ok(Some((s, y)))
}
