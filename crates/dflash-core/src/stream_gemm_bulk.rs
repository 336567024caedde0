//! The streaming GEMM's bulk-copy kernels (`stream_gemm_bulk.cu`, compute 9.0): the weight's
//! 16-row tiles brought into shared memory by the copy engine (`cp.async.bulk`, one producer warp,
//! `NST` stages of `SPAN` elements a row) instead of each lane's scattered 16-byte loads, for the
//! narrow calls (up to 16 rows a block, any number of 16-row groups).
//!
//! Invariants:
//! - Every output is bit-identical to the narrow kernel's (`stream_gemm_m{8,16}_*`): the same
//!   warps take the same 64-wide chunks in the same order, with the same fragments and mma chain,
//!   and the partials meet in warp order (GPU test `bulk_weight_fetch_gives_the_narrow_kernels_bits`).
//!   So switching it on or off never changes a row's numbers, only where its bytes come from.
//! - Used only on devices of compute 9.0 and up, with the shared-memory attribute set per
//!   (device, kernel) before the first launch; anything else falls back to the narrow kernel.
//! - Which calls take it is the caller's choice (`stream_gemm::bulk_fetch`, read once).

use crate::step_cuda::address;
use crate::Result;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::cudarc::nvrtc::compile_ptx_with_opts;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{DType, Tensor};
use std::sync::OnceLock;

const SOURCE: &str = concat!(
    "#define SG_HELPERS_ONLY\n",
    include_str!("stream_gemm.cu"),
    include_str!("stream_gemm_bulk.cu")
);
const MODULE: &str = "dflash_stream_gemm_bulk";

use crate::stream_gemm::BULK_VARIANTS as VARIANTS;

/// Dynamic shared memory of a stage shape: `nst` stages of 16 rows of `span` bf16 and 64 bytes
/// of padding (`SGB_PAD`).
fn shared_bytes((span, nst): (usize, usize)) -> usize {
    nst * 16 * (2 * span + 64)
}

fn ptx() -> Option<&'static str> {
    static PTX: OnceLock<Option<String>> = OnceLock::new();
    PTX.get_or_init(|| {
        let mut opts = crate::pdl::nvrtc_options(Some("compute_90"));
        opts.arch = Some("compute_90");
        compile_ptx_with_opts(crate::pdl::with_prelude(SOURCE), opts)
            .map(|p| p.to_src())
            .ok()
    })
    .as_deref()
}

/// Whether `dev` runs the bulk kernels (compute 9.0+ and the module compiled).
fn capable(dev: &CudaDevice) -> bool {
    static CAP: OnceLock<bool> = OnceLock::new();
    *CAP.get_or_init(|| {
        let cc = dev.cuda_stream().context().compute_capability();
        matches!(cc, Ok((major, _)) if major >= 9) && ptx().is_some()
    })
}

/// Whether `t`'s device runs the bulk kernels.
pub(crate) fn runs_on(t: &Tensor) -> bool {
    match t.device() {
        candle_core::Device::Cuda(dev) => capable(dev),
        _ => false,
    }
}

/// `x · wᵀ` on the bulk kernel with stage shape `variant` (`x` `[m, k]` contiguous bf16, `w`
/// `[n, k]` contiguous bf16, `k % 64 == 0`, 16-byte aligned; the caller checked these), bf16 or
/// f32 out; `None` where the device cannot run it.
pub(crate) fn matmul(
    x: &Tensor,
    w: &Tensor,
    f32_out: bool,
    variant: (usize, usize),
) -> Result<Option<Tensor>> {
    let (m, k) = x.dims2()?;
    let (n, _) = w.dims2()?;
    let (xp, dev) = address(x, "stream_matmul_bulk x")?;
    let (wp, _) = address(w, "stream_matmul_bulk w")?;
    if !capable(&dev) || !VARIANTS.contains(&variant) {
        return Ok(None);
    }
    let Some(ptx) = ptx() else { return Ok(None) };
    let out_dtype = if f32_out { DType::F32 } else { DType::BF16 };
    // SAFETY: the kernel writes every one of the m·n outputs.
    let y = unsafe { Tensor::empty((m, n), out_dtype, x.device())? };
    let (yp, _) = address(&y, "stream_matmul_bulk y")?;
    let warps = crate::stream_gemm::k_warps(n, k);
    let (span, nst) = variant;
    let name = format!(
        "stream_gemm_bulk_m{}_s{span}_n{nst}_{}",
        if m <= 8 { 1 } else { 2 },
        if f32_out { "f32out" } else { "bf16" }
    );
    let f = dev.get_or_load_custom_func(&name, MODULE, ptx)?;
    let smem = shared_bytes(variant);
    crate::step_cuda::allow_dynamic_shared_memory(&f, &dev, &name, smem)?;
    crate::pdl::mark(&f);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
        block_dim: (32 * (warps as u32 + 1), 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (mi, ni, ki, kwi) = (m as i32, n as i32, k as i32, warps as i32);
    let mut b = f.builder();
    b.arg(&xp)
        .arg(&wp)
        .arg(&mi)
        .arg(&ni)
        .arg(&ki)
        .arg(&kwi)
        .arg(&yp);
    // SAFETY: arguments in the kernel's order and types; x, w and y are live contiguous tensors
    // of the sizes the kernel reads and writes; the dynamic shared memory was allowed above.
    unsafe { b.launch(cfg) }.w()?;
    Ok(Some(y))
}
