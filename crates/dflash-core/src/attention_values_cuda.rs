//! The hybrids' gated-attention value product on CUDA, split over key chunks
//! (`gdn_attn_values_part` / `gdn_attn_values_sum` in `gated_delta_kernels.cu`, which holds the
//! hybrids' kernels): `o = p · v` per kv head over a whole cache buffer.
//!
//! Invariants: each output element is the sum, in chunk order, of its chunks' f32 partial sums,
//! each taken in key order — a fixed order whatever the row count; rounded once to the output
//! dtype; every partial and output element is written by exactly one thread (outputs allocated
//! uninitialised); everything runs on candle's stream.

use crate::gated_delta_cuda::ptx;
use crate::step_cuda::address;
use crate::{CoreError, Result};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Tensor};

/// Keys a chunk of [`attention_values`] sums (`AV_KEYS` in the kernels).
const AV_KEYS: usize = 64;
/// Rows a block of [`attention_values`] takes (`AV_ROWS`).
const AV_ROWS: usize = 8;

/// `p · v` per kv head: `p` `[1, kv, m, cap]` (attention probabilities, contiguous), `v` the cache
/// buffer `[1, kv, cap, d]`, both f32 or both bf16; returns `[1, kv, m, d]` in their dtype. Split
/// over chunks of 64 keys (f32 partial sums in key order, added in chunk order, rounded once):
/// two launches with work for every SM where cuBLAS's one product per kv head had 32 blocks.
pub(crate) fn attention_values(p: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (b, kv, m, cap) = p.dims4()?;
    let (bv, kvv, capv, d) = v.dims4()?;
    if b != 1 || bv != 1 || kv != kvv || cap != capv || p.dtype() != v.dtype() {
        return Err(CoreError::InvalidInput(format!(
            "attention values: p {:?} {:?} with v {:?} {:?}",
            p.dims(),
            p.dtype(),
            v.dims(),
            v.dtype()
        )));
    }
    let dtype = p.dtype();
    let sfx = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        other => {
            return Err(CoreError::InvalidInput(format!(
                "attention values: {other:?} (f32 or bf16)"
            )))
        }
    };
    let splits = cap.div_ceil(AV_KEYS);
    // SAFETY: phase one writes every (head, split, row, channel) partial; phase two every output
    let part = unsafe { Tensor::empty((kv, splits, m, d), DType::F32, p.device())? };
    let out = unsafe { Tensor::empty((1, kv, m, d), dtype, p.device())? };
    let (pp, dev) = address(p, "attention probabilities")?;
    let (vp, _) = address(v, "attention values")?;
    let (partp, _) = address(&part, "attention value partials")?;
    let (op, _) = address(&out, "attention output")?;
    let (mi, capi, di, kvi, si) = (m as i32, cap as i32, d as i32, kv as i32, splits as i32);
    let module = "dflash_gated_delta_dk16"; // these kernels do not depend on DK
    let src = ptx(16)?;
    let f = dev.get_or_load_custom_func(&format!("gdn_attn_values_part_{sfx}"), module, src)?;
    let mut b1 = f.builder();
    b1.arg(&pp)
        .arg(&vp)
        .arg(&mi)
        .arg(&capi)
        .arg(&di)
        .arg(&partp);
    let cfg = LaunchConfig {
        grid_dim: (splits as u32, kv as u32, m.div_ceil(AV_ROWS) as u32),
        block_dim: (d.clamp(32, 256) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: contiguous tensors of the sizes checked above, on this stream, in order.
    unsafe { b1.launch(cfg) }.w()?;
    let f = dev.get_or_load_custom_func(&format!("gdn_attn_values_sum_{sfx}"), module, src)?;
    let mut b2 = f.builder();
    b2.arg(&partp).arg(&kvi).arg(&si).arg(&mi).arg(&di).arg(&op);
    let total = kv * m * d;
    let cfg = LaunchConfig {
        grid_dim: (total.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: as above; `part` was written by the launch before on the same stream.
    unsafe { b2.launch(cfg) }.w()?;
    Ok(out)
}
