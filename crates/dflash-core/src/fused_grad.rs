//! Fused kernels with a backward pass. candle's fused `rms_norm` and `rope` have none, so
//! gradients would stop there; the composites that can be differentiated cost many kernels each
//! way. Here the forward runs the fused kernel on detached inputs, a custom op makes its result
//! (copied) the output of a graph node, and that node's backward is the analytic gradient:
//! - RMSNorm `y = x·r·w`, `r = 1/√(mean x² + ε)`: `dx = r·(g·w − x̂·mean(g·w·x̂))`,
//!   `dw = Σ_rows g·x̂` with `x̂ = x·r`, in f32;
//! - rotary embedding (rotate-half): a rotation, so `dx = rope(g, cos, −sin)`.
//!
//! Invariants: values equal the composites' up to float rounding (tested, forward and every
//! gradient); a node's output never shares storage with the detached kernel output it copies;
//! tensors past the fused kernels' 32-bit indexing ([`crate::attention::FUSED_MAX_ELEMENTS`]) or
//! in layouts the kernels refuse take the composite in the caller, and so does everything when
//! `DFLASH_COMPOSITE_GRAD=1` (to measure the difference, or to step around a device problem).

use crate::Result;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, D};

/// Output = a copy of the last argument (the fused kernel's result).
macro_rules! copy_last_fwd {
    ($($arg:ident),*) => {
        fn cpu_fwd(
            &self,
            $($arg: &CpuStorage, _: &Layout,)*
            y: &CpuStorage,
            ly: &Layout,
        ) -> candle_core::Result<(CpuStorage, Shape)> {
            $(let _ = $arg;)*
            Ok((y.try_clone(ly)?, ly.shape().clone()))
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            $($arg: &candle_core::CudaStorage, _: &Layout,)*
            y: &candle_core::CudaStorage,
            ly: &Layout,
        ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
            $(let _ = $arg;)*
            Ok((y.try_clone(ly)?, ly.shape().clone()))
        }
    };
}

struct RmsNormNode {
    eps: f64,
}

impl CustomOp3 for RmsNormNode {
    fn name(&self) -> &'static str {
        "dflash-rms-norm"
    }

    copy_last_fwd!(x, w);

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let h = x.dim(D::Minus1)?;
        let xf = x.to_dtype(DType::F32)?;
        let gf = g.to_dtype(DType::F32)?;
        let wf = w.to_dtype(DType::F32)?;
        let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + self.eps)?
            .sqrt()?
            .recip()?;
        let xhat = xf.broadcast_mul(&r)?;
        let gw = gf.broadcast_mul(&wf)?;
        let dot = (&gw * &xhat)?.mean_keepdim(D::Minus1)?;
        let dx = (gw - xhat.broadcast_mul(&dot)?)?.broadcast_mul(&r)?;
        let dw = (gf * xhat)?.reshape(((), h))?.sum(0)?;
        Ok((
            Some(dx.to_dtype(x.dtype())?),
            Some(dw.to_dtype(w.dtype())?),
            None,
        ))
    }
}

/// True when `DFLASH_COMPOSITE_GRAD=1`: every caller takes its composite.
fn composite_forced() -> bool {
    static FORCED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FORCED.get_or_init(|| std::env::var("DFLASH_COMPOSITE_GRAD").as_deref() == Ok("1"))
}

/// RMSNorm over the last dimension with weight `w`: fused forward, differentiable in `x` and `w`.
/// `None` when the fused kernel cannot take `x` (the caller uses the composite).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Option<Tensor>> {
    if composite_forced()
        || !x.is_contiguous()
        || x.elem_count() > crate::attention::FUSED_MAX_ELEMENTS
        || w.dtype() != x.dtype()
        || w.dims() != [x.dim(D::Minus1)?]
    {
        return Ok(None);
    }
    let y = candle_nn::ops::rms_norm(&x.detach(), &w.detach(), eps as f32)?;
    Ok(Some(x.apply_op3(w, &y, RmsNormNode { eps })?))
}

struct RopeNode {
    cos: Tensor,
    neg_sin: Tensor,
}

impl CustomOp2 for RopeNode {
    fn name(&self) -> &'static str {
        "dflash-rope"
    }

    copy_last_fwd!(x);

    fn bwd(
        &self,
        _x: &Tensor,
        _y: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // the transpose of a rotation by θ is the rotation by −θ
        let dx = candle_nn::rotary_emb::rope(&g.contiguous()?, &self.cos, &self.neg_sin)?;
        Ok((Some(dx), None))
    }
}

/// Rotate-half rotary embedding of `x` `[b, h, t, d]` (contiguous) by `cos`/`sin` (`[t, d/2]` or
/// `[b, t, d/2]`): fused forward, differentiable in `x` (the angles are constants).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Option<Tensor>> {
    let (b, _, t, d) = x.dims4()?;
    let angles_fit = match cos.dims() {
        [ct, h] => *ct >= t && 2 * h == d,
        [cb, ct, h] => *cb == b && *ct == t && 2 * h == d,
        _ => false,
    };
    if composite_forced()
        || !x.is_contiguous()
        || x.elem_count() > crate::attention::FUSED_MAX_ELEMENTS
        || !angles_fit
        || cos.dims() != sin.dims()
        || cos.dtype() != x.dtype()
    {
        return Ok(None);
    }
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    let y = candle_nn::rotary_emb::rope(&x.detach(), &cos, &sin)?;
    let node = RopeNode {
        neg_sin: sin.neg()?,
        cos,
    };
    Ok(Some(x.apply_op2(&y, node)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Gradients of `Σ t ⊙ probe` (a fixed random direction through the output).
    fn grads_of(t: &Tensor, probe: &Tensor) -> candle_core::backprop::GradStore {
        (t * probe).unwrap().sum_all().unwrap().backward().unwrap()
    }

    fn composite_rms(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
        let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        x.broadcast_div(&(ms + eps).unwrap().sqrt().unwrap())
            .unwrap()
            .broadcast_mul(w)
            .unwrap()
    }

    fn composite_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let half = x.dim(D::Minus1).unwrap() / 2;
        let x1 = x.narrow(D::Minus1, 0, half).unwrap();
        let x2 = x.narrow(D::Minus1, half, half).unwrap();
        let rot = Tensor::cat(&[&x2.neg().unwrap(), &x1], D::Minus1).unwrap();
        let c = Tensor::cat(&[cos, cos], D::Minus1).unwrap();
        let s = Tensor::cat(&[sin, sin], D::Minus1).unwrap();
        (x.broadcast_mul(&c).unwrap() + rot.broadcast_mul(&s).unwrap()).unwrap()
    }

    #[test]
    fn fused_rms_norm_matches_the_composite_and_its_gradients() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 2.0, (3, 4, 24), &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&Tensor::randn(1f32, 0.3, 24, &dev).unwrap()).unwrap();
        let probe = Tensor::randn(0f32, 1.0, (3, 4, 24), &dev).unwrap();
        let a = rms_norm(x.as_tensor(), w.as_tensor(), 1e-5)
            .unwrap()
            .unwrap();
        let b = composite_rms(x.as_tensor(), w.as_tensor(), 1e-5);
        assert!(crate::test_util::max_abs_diff(&a, &b) < 1e-5);
        let ga = grads_of(&a, &probe);
        let gb = grads_of(&b, &probe);
        for v in [&x, &w] {
            let (p, q) = (ga.get(v).unwrap(), gb.get(v).unwrap());
            let scale = crate::test_util::max_abs_diff(q, &q.zeros_like().unwrap());
            assert!(scale > 1e-3, "gradient vanishes");
            assert!(crate::test_util::max_abs_diff(p, q) < 1e-4 * scale.max(1.0));
        }
        // a non-contiguous input is left to the caller's composite
        let t = x.as_tensor().transpose(0, 1).unwrap();
        assert!(rms_norm(&t, w.as_tensor(), 1e-5).unwrap().is_none());
    }

    #[test]
    fn fused_rope_matches_the_composite_and_its_gradient() {
        let dev = Device::Cpu;
        let (b, h, t, d) = (2, 3, 5, 8);
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap()).unwrap();
        let ang = Tensor::randn(0f32, 2.0, (b, t, d / 2), &dev).unwrap();
        let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
        let probe = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
        let a = rope(x.as_tensor(), &cos, &sin).unwrap().unwrap();
        let b4 = composite_rope(
            x.as_tensor(),
            &cos.unsqueeze(1).unwrap(),
            &sin.unsqueeze(1).unwrap(),
        );
        assert!(crate::test_util::max_abs_diff(&a, &b4) < 1e-5);
        let ga = grads_of(&a, &probe);
        let gb = grads_of(&b4, &probe);
        let (p, q) = (ga.get(&x).unwrap(), gb.get(&x).unwrap());
        assert!(crate::test_util::max_abs_diff(q, &q.zeros_like().unwrap()) > 1e-3);
        assert!(crate::test_util::max_abs_diff(p, q) < 1e-5);
    }
}
