//! Linear projections (no bias) of the models' forwards.
//!
//! Invariants: with gradients off, bf16 rows (up to 288) on CUDA go through the weight-streaming
//! tensor-core GEMM (`dflash_core::stream_gemm`) when its policy takes the weight, and then a
//! row's result does not depend on how many rows share the call; on the CPU the calls of up to 288
//! rows go to the row-invariant host kernels (`dflash_core::rowwise`, same policy function);
//! everything else (training, wider calls, large weights) is candle's matmul. All compute `x · wᵀ`
//! with f32 accumulation.

use crate::Result;
use candle_core::{Module, Tensor};
use candle_nn::Linear;
use dflash_core::Grad;

/// `lin(x)` for an inference forward.
pub(crate) fn project(lin: &Linear, x: &Tensor) -> Result<Tensor> {
    if let Some(y) = dflash_core::stream_gemm::stream_matmul(x, lin.weight(), false)? {
        return Ok(y);
    }
    Ok(lin.forward(x)?)
}

/// `lin(x)`, differentiable when `grad` is on.
pub(crate) fn project_with(lin: &Linear, x: &Tensor, grad: Grad) -> Result<Tensor> {
    match grad {
        Grad::On => Ok(lin.forward(x)?),
        Grad::Off => project(lin, x),
    }
}
