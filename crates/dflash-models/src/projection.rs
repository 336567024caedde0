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

/// Several projections of one input (a checkpoint's `q_proj`, `k_proj`, `v_proj`, …): separate
/// weights, or — where the fused decode runs — their rows stacked into one weight, one GEMM a
/// forward instead of one a part, each part's output a column block of it (the same sums per
/// output).
pub(crate) enum Projections {
    Separate(Vec<Linear>),
    Stacked {
        w: Linear,
        /// each part's output width, in order
        widths: Vec<usize>,
    },
}

impl Projections {
    /// `parts` as they are, or stacked into one weight when `stack`.
    pub(crate) fn new(parts: Vec<Linear>, stack: bool) -> Result<Self> {
        if !stack {
            return Ok(Self::Separate(parts));
        }
        let weights: Vec<&Tensor> = parts.iter().map(|p| p.weight()).collect();
        let widths = weights
            .iter()
            .map(|w| w.dim(0))
            .collect::<candle_core::Result<_>>()?;
        let w = Linear::new(Tensor::cat(&weights, 0)?, None);
        Ok(Self::Stacked { w, widths })
    }

    /// Each part's output of `x`, along the last dim (column views of one output when stacked).
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        match self {
            Self::Separate(parts) => parts.iter().map(|p| project(p, x)).collect(),
            Self::Stacked { w, widths } => {
                let y = project(w, x)?;
                let last = y.rank() - 1;
                let mut start = 0;
                let mut out = Vec::with_capacity(widths.len());
                for &width in widths {
                    out.push(y.narrow(last, start, width)?);
                    start += width;
                }
                Ok(out)
            }
        }
    }

    /// The stacked weight's projection, when stacked.
    pub(crate) fn stacked(&self) -> Option<&Linear> {
        match self {
            Self::Stacked { w, .. } => Some(w),
            Self::Separate(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// Stacked parts give each separate part's output as a column block, in order.
    #[test]
    fn stacked_projections_are_the_separate_ones_side_by_side() {
        let dev = Device::Cpu;
        let w = |rows: usize, seed: f64| {
            let t = Tensor::arange(0f32, (rows * 8) as f32, &dev).unwrap();
            Linear::new(
                ((t * 0.01).unwrap() + seed)
                    .unwrap()
                    .reshape((rows, 8))
                    .unwrap(),
                None,
            )
        };
        let parts = || vec![w(6, 0.1), w(2, -0.3), w(4, 0.7)];
        let x = Tensor::randn(0f32, 1.0, (1, 3, 8), &dev).unwrap();
        let sep = Projections::new(parts(), false)
            .unwrap()
            .forward(&x)
            .unwrap();
        let stacked = Projections::new(parts(), true).unwrap();
        assert!(stacked.stacked().is_some());
        let st = stacked.forward(&x).unwrap();
        assert_eq!(st.len(), 3);
        for (a, b) in sep.iter().zip(&st) {
            assert_eq!(a.dims(), b.dims());
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
            assert!(d.to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap() < 1e-5);
        }
    }
}
