//! The sampled step's device kernel launch (`sample_rows` in `decode_kernels.cu`, the decode
//! module of [`crate::decode_ops_cuda`]): temperature, top-k, top-p and one uniform a row, one
//! block a row, only the ids back to the host.
//!
//! Invariants: the logits are read through their contiguous offsets (anything else is an error);
//! exactly one thread of each row's block writes its id; everything runs on candle's stream.

use crate::decode_ops_cuda::{not_on_cpu, ptx, slice_of, MODULE, TPB};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, Layout, Result, Shape, Tensor};

struct SampleRows<'a> {
    inv_t: f32,
    top_k: i32,
    top_p: f32,
    u: &'a [f32],
}
impl CustomOp1 for SampleRows<'_> {
    fn name(&self) -> &'static str {
        "sample-rows"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        not_on_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (rows, vocab) = l.shape().dims2()?;
        let dev = s.device().clone();
        let x = slice_of::<f32>(s, l, "decode kernels")?;
        let u = dev.clone_htod(self.u)?;
        // SAFETY: exactly one thread of each row's block writes its id.
        let out = unsafe { dev.alloc::<u32>(rows)? };
        let f = dev.get_or_load_custom_func("sample_rows", MODULE, ptx()?)?;
        crate::pdl::mark(&f);
        let mut b = f.builder();
        let v = vocab as i32;
        b.arg(&x)
            .arg(&v)
            .arg(&self.inv_t)
            .arg(&self.top_k)
            .arg(&self.top_p)
            .arg(&u)
            .arg(&out);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (TPB, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match the kernel's signature; one block per row.
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(rows)))
    }
}

/// One id a row of `logits` `[rows, V]` (f32), sampled with `u[r]` at temperature
/// `temperature`, top-k `top_k` and top-p `top_p`.
pub(crate) fn sample_rows(
    logits: &Tensor,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    u: &[f32],
) -> crate::Result<Vec<u32>> {
    let op = SampleRows {
        inv_t: 1.0 / temperature,
        top_k: top_k.min(i32::MAX as usize) as i32,
        top_p,
        u,
    };
    Ok(logits.apply_op1_no_bwd(&op)?.to_vec1()?)
}
