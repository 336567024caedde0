//! The hybrids' gated attention output on CUDA (`gate_mul` in `decode_kernels.cu`): the
//! attention output times the sigmoid of its gates, read in place from the stacked q/k/v
//! projection's rows — one launch instead of a copy of the gates, a sigmoid and a product.
//!
//! Invariants: the same arithmetic as candle's `sigmoid` then `mul` (f32, the sigmoid rounded to
//! the dtype before the product); every output element is written by exactly one thread, so the
//! output is allocated uninitialised; runs on candle's stream, in order with the ops around it.

use crate::step_cuda::address;
use crate::{CoreError, Result};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Tensor};

/// See [`crate::decode_ops::gate_mul`].
pub(crate) fn gate_mul(o: &Tensor, y: &Tensor, heads: usize, head_dim: usize) -> Result<Tensor> {
    let width = heads * head_dim;
    let rows = o.elem_count() / width.max(1);
    let (yr, ld) = y.dims2()?;
    if o.dims().last() != Some(&width)
        || yr != rows
        || ld < 2 * width
        || o.dtype() != y.dtype()
        || !matches!(o.dtype(), DType::F32 | DType::BF16)
    {
        return Err(CoreError::InvalidInput(format!(
            "gate_mul: o {:?}, y {:?} ({:?}) for {heads} heads of {head_dim}",
            o.dims(),
            y.dims(),
            y.dtype()
        )));
    }
    let (o, y) = (o.contiguous()?, y.contiguous()?);
    let (op, dev) = address(&o, "gate_mul o")?;
    let (yp, _) = address(&y, "gate_mul y")?;
    // SAFETY: one thread per output element writes it.
    let out = unsafe { Tensor::empty(o.dims(), o.dtype(), o.device())? };
    let (outp, _) = address(&out, "gate_mul out")?;
    let sfx = if o.dtype() == DType::F32 {
        "f32"
    } else {
        "bf16"
    };
    let f = dev.get_or_load_custom_func(
        &format!("gate_mul_{sfx}"),
        crate::decode_ops_cuda::MODULE,
        crate::decode_ops_cuda::ptx()?,
    )?;
    crate::pdl::mark(&f);
    let mut b = f.builder();
    let (r, h, d, l) = (rows as i32, heads as i32, head_dim as i32, ld as i64);
    b.arg(&op)
        .arg(&yp)
        .arg(&r)
        .arg(&h)
        .arg(&d)
        .arg(&l)
        .arg(&outp);
    let cfg = LaunchConfig {
        grid_dim: ((rows * width).div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: arguments in the kernel's order and types; live contiguous tensors of the checked
    // sizes; the grid covers every output element.
    unsafe { b.launch(cfg) }.w()?;
    Ok(out)
}
