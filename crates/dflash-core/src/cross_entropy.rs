//! Fused weighted cross-entropy with argmax over rows of f32 logits: one pass over the logits
//! forward, one backward, instead of candle's max / subtract / exp / sum / log / gather chain and
//! its backward (each a pass over `rows × vocab` f32).
//!
//! Invariants:
//! - `weighted_cross_entropy(logits, labels, w)` is `[rows, 3]` f32: column 0 is
//!   `w·(logsumexp(row) − row[label])`, column 1 the log-sum-exp, column 2 the argmax id (the
//!   lowest id among equal maxima, exact as f32 below 2²⁴). Only column 0 is differentiable: its
//!   gradient is `g·w·(softmax(row) − onehot(label))`; gradients reaching columns 1 and 2 are
//!   ignored (callers never use them).
//! - Equals the composite (tested on the CPU reference); the CUDA kernels (`cross_entropy.cu`,
//!   NVRTC) mirror the reference and use no atomics.
//! - `DFLASH_FUSED_LOSS=0` turns it off (read once per process); otherwise on (measured 1.9× faster on
//!   the CPU's loss phase and 7.4× on the H200's, same losses; docs/benchmarks.md).

use crate::{CoreError, Result};
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Shape, Tensor};

/// Whether the fused loss runs (see the module invariants; the variable is read once per process).
pub fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("DFLASH_FUSED_LOSS").as_deref() != Ok("0"))
}

/// See the module invariants. `logits` `[rows, V]` f32; `labels` and `weights` one per row.
pub fn weighted_cross_entropy(logits: &Tensor, labels: &[u32], weights: &[f32]) -> Result<Tensor> {
    let (rows, v) = logits.dims2()?;
    if logits.dtype() != DType::F32
        || labels.len() != rows
        || weights.len() != rows
        || labels.iter().any(|&l| l as usize >= v)
    {
        return Err(CoreError::InvalidInput(format!(
            "weighted cross-entropy: {:?} {:?} logits, {} labels (max {:?}), {} weights",
            logits.dims(),
            logits.dtype(),
            labels.len(),
            labels.iter().max(),
            weights.len()
        )));
    }
    let op = CrossEntropyOp {
        labels: labels.to_vec(),
        weights: weights.to_vec(),
    };
    Ok(logits.contiguous()?.apply_op1(op)?)
}

/// The forward of [`weighted_cross_entropy`] and the gradient of its column-0 sum w.r.t. the
/// logits, `w·(softmax − onehot)` `[rows, V]` f32, without a graph (for a caller that applies the
/// frozen LM head's transpose itself).
pub fn weighted_cross_entropy_and_grad(
    logits: &Tensor,
    labels: &[u32],
    weights: &[f32],
) -> Result<(Tensor, Tensor)> {
    let out = weighted_cross_entropy(&logits.detach(), labels, weights)?.detach();
    let ones = Tensor::ones(out.shape(), DType::F32, out.device())?;
    let op = CrossEntropyGradOp {
        labels: labels.to_vec(),
        weights: weights.to_vec(),
    };
    let grad = logits
        .detach()
        .contiguous()?
        .apply_op3_no_bwd(&out, &ones, &op)?;
    Ok((out, grad))
}

struct CrossEntropyOp {
    labels: Vec<u32>,
    weights: Vec<f32>,
}

struct CrossEntropyGradOp {
    labels: Vec<u32>,
    weights: Vec<f32>,
}

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("cross-entropy: non-contiguous input".into()))?;
    match s {
        CpuStorage::F32(v) => Ok(&v[a..b]),
        _ => candle_core::bail!("cross-entropy: f32 only"),
    }
}

/// CPU reference forward: `[rows, 3]` as in the module invariants.
pub(crate) fn forward_reference(x: &[f32], v: usize, labels: &[u32], weights: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(3 * labels.len());
    for (r, row) in x.chunks(v).enumerate() {
        let (mut best, mut arg) = (f32::NEG_INFINITY, 0usize);
        for (j, &val) in row.iter().enumerate() {
            if val > best {
                best = val;
                arg = j;
            }
        }
        let z: f32 = row.iter().map(|&val| (val - best).exp()).sum();
        let lse = best + z.ln();
        out.extend([
            weights[r] * (lse - row[labels[r] as usize]),
            lse,
            arg as f32,
        ]);
    }
    out
}

/// CPU reference backward: `g·w·(softmax − onehot)` with `g` the gradient of column 0.
pub(crate) fn backward_reference(
    x: &[f32],
    v: usize,
    labels: &[u32],
    weights: &[f32],
    res: &[f32],
    gout: &[f32],
) -> Vec<f32> {
    let mut dx = vec![0f32; x.len()];
    for (r, (row, drow)) in x.chunks(v).zip(dx.chunks_mut(v)).enumerate() {
        let (lse, g) = (res[3 * r + 1], gout[3 * r] * weights[r]);
        for (j, (&val, d)) in row.iter().zip(drow.iter_mut()).enumerate() {
            let onehot = if j == labels[r] as usize { 1.0 } else { 0.0 };
            *d = g * ((val - lse).exp() - onehot);
        }
    }
    dx
}

impl CustomOp1 for CrossEntropyOp {
    fn name(&self) -> &'static str {
        "dflash-weighted-cross-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, v) = l.shape().dims2()?;
        let out = forward_reference(f32_slice(s, l)?, v, &self.labels, &self.weights);
        Ok((CpuStorage::F32(out), Shape::from((rows, 3))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (rows, v) = l.shape().dims2()?;
        let out = cuda::forward(s, l, rows, v, &self.labels, &self.weights)?;
        Ok((out, Shape::from((rows, 3))))
    }

    fn bwd(&self, x: &Tensor, res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let op = CrossEntropyGradOp {
            labels: self.labels.clone(),
            weights: self.weights.clone(),
        };
        let g = x.apply_op3_no_bwd(&res.contiguous()?, &grad.contiguous()?, &op)?;
        Ok(Some(g))
    }
}

impl CustomOp3 for CrossEntropyGradOp {
    fn name(&self) -> &'static str {
        "dflash-weighted-cross-entropy-grad"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        res: &CpuStorage,
        lr: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (_, v) = lx.shape().dims2()?;
        let (x, res, g) = (f32_slice(x, lx)?, f32_slice(res, lr)?, f32_slice(g, lg)?);
        let dx = backward_reference(x, v, &self.labels, &self.weights, res, g);
        Ok((CpuStorage::F32(dx), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        res: &candle_core::CudaStorage,
        lr: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (rows, v) = lx.shape().dims2()?;
        let dx = cuda::backward(
            (x, lx),
            (res, lr),
            (g, lg),
            rows,
            v,
            &self.labels,
            &self.weights,
        )?;
        Ok((dx, lx.shape().clone()))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! Launches of `cross_entropy.cu` (one 256-thread block per row).
    use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, Layout};
    use std::sync::OnceLock;

    const SOURCE: &str = include_str!("cross_entropy.cu");
    const MODULE: &str = "dflash_cross_entropy";

    fn ptx() -> candle_core::Result<&'static str> {
        static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
        PTX.get_or_init(|| {
            candle_core::cuda_backend::cudarc::nvrtc::compile_ptx(SOURCE)
                .map(|p| p.to_src())
                .map_err(|e| format!("cross-entropy: NVRTC failed: {e:?}"))
        })
        .as_deref()
        .map_err(|e| candle_core::Error::Msg(e.clone()))
    }

    fn view<'a>(s: &'a CudaStorage, l: &Layout) -> candle_core::Result<CudaView<'a, f32>> {
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("cross-entropy: non-contiguous input".into()))?;
        Ok(s.as_cuda_slice::<f32>()?.slice(a..b))
    }

    fn config(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    pub(super) fn forward(
        s: &CudaStorage,
        l: &Layout,
        rows: usize,
        v: usize,
        labels: &[u32],
        weights: &[f32],
    ) -> candle_core::Result<CudaStorage> {
        let dev = s.device.clone();
        let x = view(s, l)?;
        let (lab, w) = (dev.clone_htod(labels)?, dev.clone_htod(weights)?);
        // SAFETY: thread 0 of each row's block writes the row's three values.
        let out = unsafe { dev.alloc::<f32>(3 * rows)? };
        let f = dev.get_or_load_custom_func("ce_fwd_f32", MODULE, ptx()?)?;
        let mut b = f.builder();
        let v = v as i32;
        b.arg(&x).arg(&lab).arg(&w).arg(&out).arg(&v);
        // SAFETY: matches the kernel's signature; one block per row.
        unsafe { b.launch(config(rows)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }

    type Arg<'a> = (&'a CudaStorage, &'a Layout);

    pub(super) fn backward(
        x: Arg,
        res: Arg,
        g: Arg,
        rows: usize,
        v: usize,
        labels: &[u32],
        weights: &[f32],
    ) -> candle_core::Result<CudaStorage> {
        let dev = x.0.device.clone();
        let (xv, rv, gv) = (view(x.0, x.1)?, view(res.0, res.1)?, view(g.0, g.1)?);
        let (lab, w) = (dev.clone_htod(labels)?, dev.clone_htod(weights)?);
        // SAFETY: every element is written (one block per row, threads stride the row).
        let dx = unsafe { dev.alloc::<f32>(rows * v)? };
        let f = dev.get_or_load_custom_func("ce_bwd_f32", MODULE, ptx()?)?;
        let mut b = f.builder();
        let vi = v as i32;
        b.arg(&xv)
            .arg(&lab)
            .arg(&w)
            .arg(&rv)
            .arg(&gv)
            .arg(&dx)
            .arg(&vi);
        // SAFETY: matches the kernel's signature; one block per row.
        unsafe { b.launch(config(rows)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(dx, dev))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    fn logits(rows: usize, v: usize) -> Tensor {
        let x: Vec<f32> = (0..rows * v)
            .map(|i| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 9.0)
            .collect();
        Tensor::from_vec(x, (rows, v), &Device::Cpu).unwrap()
    }

    #[test]
    fn equals_the_composite_loss_gradient_and_argmax() {
        let (rows, v) = (5, 37);
        let x = Var::from_tensor(&logits(rows, v)).unwrap();
        let labels = [3u32, 0, 36, 17, 17];
        let weights = [1.0f32, 0.5, 0.0, 0.25, 2.0];
        let fused = weighted_cross_entropy(x.as_tensor(), &labels, &weights).unwrap();
        let loss_f = fused.narrow(1, 0, 1).unwrap().sum_all().unwrap();
        let g_f = loss_f
            .backward()
            .unwrap()
            .get(x.as_tensor())
            .unwrap()
            .clone();
        // composite
        let logp = candle_nn::ops::log_softmax(x.as_tensor(), D::Minus1).unwrap();
        let idx = Tensor::from_slice(&labels, (rows, 1), &Device::Cpu).unwrap();
        let w = Tensor::from_slice(&weights, rows, &Device::Cpu).unwrap();
        let picked = logp.gather(&idx, 1).unwrap().squeeze(1).unwrap();
        let loss_c = (picked * &w).unwrap().sum_all().unwrap().neg().unwrap();
        let g_c = loss_c
            .backward()
            .unwrap()
            .get(x.as_tensor())
            .unwrap()
            .clone();
        let (a, b) = (
            loss_f.to_scalar::<f32>().unwrap(),
            loss_c.to_scalar::<f32>().unwrap(),
        );
        assert!((a - b).abs() < 1e-4 * b.abs().max(1.0), "loss {a} vs {b}");
        let err = crate::test_util::max_abs_diff(&g_f, &g_c);
        assert!(err < 1e-5, "gradient differs by {err}");
        let am: Vec<u32> = x.as_tensor().argmax(D::Minus1).unwrap().to_vec1().unwrap();
        let got: Vec<u32> = fused
            .narrow(1, 2, 1)
            .unwrap()
            .squeeze(1)
            .unwrap()
            .to_dtype(DType::U32)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(got, am);
    }

    #[test]
    fn the_explicit_gradient_equals_the_graph_gradient() {
        let x = Var::from_tensor(&logits(4, 23)).unwrap();
        let (labels, weights) = ([1u32, 22, 0, 5], [0.5f32, 1.0, 2.0, 0.0]);
        let out = weighted_cross_entropy(x.as_tensor(), &labels, &weights).unwrap();
        let g = out
            .narrow(1, 0, 1)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (out2, g2) = weighted_cross_entropy_and_grad(x.as_tensor(), &labels, &weights).unwrap();
        assert_eq!(crate::test_util::max_abs_diff(&out, &out2), 0.0);
        let err = crate::test_util::max_abs_diff(g.get(x.as_tensor()).unwrap(), &g2);
        assert!(err == 0.0, "explicit gradient differs by {err}");
    }

    #[test]
    fn ties_take_the_lowest_id_and_bad_labels_are_refused() {
        let x = Tensor::from_vec(vec![1f32, 3.0, 3.0, 0.0], (1, 4), &Device::Cpu).unwrap();
        let out = weighted_cross_entropy(&x, &[0], &[1.0]).unwrap();
        let v: Vec<f32> = out.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(v[2], 1.0);
        let lse = (1f32.exp() + 2.0 * 3f32.exp() + 1.0).ln();
        assert!((v[1] - lse).abs() < 1e-5 && (v[0] - (lse - 1.0)).abs() < 1e-5);
        assert!(weighted_cross_entropy(&x, &[4], &[1.0]).is_err());
        assert!(weighted_cross_entropy(&x, &[0, 1], &[1.0, 1.0]).is_err());
    }
}
