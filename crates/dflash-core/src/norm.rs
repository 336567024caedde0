//! RMSNorm `x * rsqrt(mean(x^2) + eps) * w` (plain `w`, as Llama, Qwen3 and the DFlash drafter).
//!
//! Invariant: [`Grad::On`] is differentiable: the fused kernel with an analytic backward
//! ([`crate::fused_grad`]) where it applies, else a composite that normalises in f32;
//! [`Grad::Off`] may use candle's fused kernel alone, which has no backward pass.

use crate::{Grad, Result};
use candle_core::{DType, Tensor, D};

#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self { weight, eps }
    }

    pub fn load(vb: candle_nn::VarBuilder, size: usize, eps: f64) -> Result<Self> {
        Ok(Self::new(vb.get(size, "weight")?, eps))
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Inference only: `(x + d, norm(x + d))` as one kernel where the decode step has one (CUDA,
    /// `decode_ops::add_rms_norm`); `None` where the caller adds and norms itself.
    pub fn add_forward(&self, x: &Tensor, d: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
        crate::decode_ops::add_rms_norm(x, d, &self.weight, self.eps)
    }

    pub fn forward(&self, x: &Tensor, grad: Grad) -> Result<Tensor> {
        match grad {
            Grad::Off
                if x.is_contiguous() && x.elem_count() <= crate::attention::FUSED_MAX_ELEMENTS =>
            {
                Ok(candle_nn::ops::rms_norm(x, &self.weight, self.eps as f32)?)
            }
            _ => {
                if let Some(y) = crate::fused_grad::rms_norm(x, &self.weight, self.eps)? {
                    return Ok(y);
                }
                let dtype = x.dtype();
                let xf = x.to_dtype(DType::F32)?;
                let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
                let normed = xf.broadcast_div(&(ms + self.eps)?.sqrt()?)?;
                Ok(normed.to_dtype(dtype)?.broadcast_mul(&self.weight)?)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn fused_and_differentiable_agree_and_grad_flows() {
        let dev = Device::Cpu;
        let w = Var::from_tensor(&Tensor::randn(1f32, 0.1, 16, &dev).unwrap()).unwrap();
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 16), &dev).unwrap()).unwrap();
        let n = RmsNorm::new(w.as_tensor().clone(), 1e-6);
        let a = n.forward(x.as_tensor(), Grad::Off).unwrap();
        let b = n.forward(x.as_tensor(), Grad::On).unwrap();
        let diff = crate::test_util::max_abs_diff(&a, &b);
        assert!(diff < 1e-5);
        let grads = b.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        assert!(grads.get(&w).is_some() && grads.get(&x).is_some());
    }
}
