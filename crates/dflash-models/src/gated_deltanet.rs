//! The Gated DeltaNet layer (`linear_attn` of the Qwen3.5 / Qwen3.6 hybrids; ecosystem.md §3):
//! projections, a causal depthwise short convolution with its state, the gated delta rule
//! (`dflash_core::gated_delta`) with its recurrent state, and the gated RMSNorm before `out_proj`.
//! Modules mirror the checkpoint names (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`,
//! `conv1d`, `dt_bias`, `A_log`, `norm`, `out_proj`).
//!
//! Invariants:
//! - A sequence's layer state is [`DeltaState`]: the last `K − 1` convolution inputs and the f32
//!   recurrent state. A forward over n tokens equals n one-token forwards from the same state
//!   (chunked rule for n > 1, recurrent for one token; tested), and
//!   [`GatedDeltaNet::forward_checkpointed`] returns the state after every token, so a verify can
//!   keep exactly an accepted prefix (the state after token a is the state of a forward over
//!   tokens 0..=a alone).
//! - Gates and the rule run in f32 whatever the compute dtype; the output is cast back before
//!   `out_proj`.
//! - Not yet checked against transformers (the tiny Qwen3.5 fixture of `scripts/make_fixtures.py
//!   --only-hybrid` is written but was not run); the rule itself is (dflash-core's fixture).

use crate::{ModelError, Result};
use candle_core::{DType, Module, Tensor, D};
use candle_nn::{Linear, VarBuilder};
use dflash_core::gated_delta::{self, DeltaInputs};

/// The layer's shapes (Qwen3.5 `text_config` fields `linear_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaNetShape {
    pub hidden: usize,
    /// `linear_num_key_heads` (Hk).
    pub key_heads: usize,
    /// `linear_num_value_heads` (Hv, a multiple of Hk).
    pub value_heads: usize,
    /// `linear_key_head_dim` (dk).
    pub key_dim: usize,
    /// `linear_value_head_dim` (dv).
    pub value_dim: usize,
    /// `linear_conv_kernel_dim` (K).
    pub conv_kernel: usize,
}

impl DeltaNetShape {
    /// Channels of the convolved q/k/v projection: `2·Hk·dk + Hv·dv`.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    fn validate(&self) -> Result<()> {
        let s = self;
        if [
            s.hidden,
            s.key_heads,
            s.value_heads,
            s.key_dim,
            s.value_dim,
            s.conv_kernel,
        ]
        .contains(&0)
            || !s.value_heads.is_multiple_of(s.key_heads)
        {
            return Err(ModelError::InvalidInput(format!(
                "Gated DeltaNet shape {s:?}: sizes must be positive and value heads a multiple of key heads"
            )));
        }
        Ok(())
    }
}

/// One sequence's state of one Gated DeltaNet layer (see the module invariants).
#[derive(Debug, Clone)]
pub struct DeltaState {
    /// The last `K − 1` inputs of the convolution `[K − 1, C]` (compute dtype; zeros at start).
    pub conv: Tensor,
    /// The rule's state `[Hv, dk, dv]` (f32).
    pub recurrent: Tensor,
}

pub struct GatedDeltaNet {
    in_proj_qkv: Linear,
    in_proj_z: Linear,
    in_proj_b: Linear,
    in_proj_a: Linear,
    /// `[C, K]` (the checkpoint's `[C, 1, K]`).
    conv1d: Tensor,
    /// `[Hv]` f32.
    dt_bias: Tensor,
    /// `−exp(A_log)` `[Hv]` f32.
    neg_a: Tensor,
    /// The gated norm's weight `[dv]` (applied as is).
    norm: Tensor,
    out_proj: Linear,
    shape: DeltaNetShape,
    eps: f64,
}

fn linear(vb: &VarBuilder, in_dim: usize, out_dim: usize, name: &str) -> Result<Linear> {
    Ok(Linear::new(
        vb.get((out_dim, in_dim), &format!("{name}.weight"))?,
        None,
    ))
}

impl GatedDeltaNet {
    /// The layer from `vb` at its `linear_attn` prefix.
    pub fn new(shape: DeltaNetShape, eps: f64, vb: VarBuilder) -> Result<Self> {
        shape.validate()?;
        let (h, c, hv) = (shape.hidden, shape.conv_channels(), shape.value_heads);
        let vdim = hv * shape.value_dim;
        let conv1d = vb
            .get((c, 1, shape.conv_kernel), "conv1d.weight")?
            .reshape((c, shape.conv_kernel))?;
        Ok(Self {
            in_proj_qkv: linear(&vb, h, c, "in_proj_qkv")?,
            in_proj_z: linear(&vb, h, vdim, "in_proj_z")?,
            in_proj_b: linear(&vb, h, hv, "in_proj_b")?,
            in_proj_a: linear(&vb, h, hv, "in_proj_a")?,
            conv1d,
            dt_bias: vb.get(hv, "dt_bias")?.to_dtype(DType::F32)?,
            neg_a: vb.get(hv, "A_log")?.to_dtype(DType::F32)?.exp()?.neg()?,
            norm: vb.get(shape.value_dim, "norm.weight")?,
            out_proj: linear(&vb, vdim, h, "out_proj")?,
            shape,
            eps,
        })
    }

    /// A fresh state (zeros) in the layer's dtype and device.
    pub fn new_state(&self) -> Result<DeltaState> {
        let s = &self.shape;
        let dev = self.conv1d.device();
        Ok(DeltaState {
            conv: Tensor::zeros(
                (s.conv_kernel - 1, s.conv_channels()),
                self.conv1d.dtype(),
                dev,
            )?,
            recurrent: Tensor::zeros((s.value_heads, s.key_dim, s.value_dim), DType::F32, dev)?,
        })
    }

    /// The layer over `x` `[n, H]` (one sequence) from `state`, which it advances by n tokens.
    pub fn forward(&self, x: &Tensor, state: &mut DeltaState) -> Result<Tensor> {
        let (y, _) = self.run(x, state, false)?;
        Ok(y)
    }

    /// [`GatedDeltaNet::forward`] that also returns the state after each token (the per-token
    /// checkpoints of a speculative verify).
    pub fn forward_checkpointed(
        &self,
        x: &Tensor,
        state: &mut DeltaState,
    ) -> Result<(Tensor, Vec<DeltaState>)> {
        self.run(x, state, true)
    }

    fn run(
        &self,
        x: &Tensor,
        state: &mut DeltaState,
        checkpoints: bool,
    ) -> Result<(Tensor, Vec<DeltaState>)> {
        let s = self.shape;
        let (n, _) = x.dims2()?;
        let (hk, hv, dk, dv, k) = (
            s.key_heads,
            s.value_heads,
            s.key_dim,
            s.value_dim,
            s.conv_kernel,
        );
        let qkv = self.in_proj_qkv.forward(x)?; // [n, C]
                                                // causal depthwise convolution over [state ; qkv], then SiLU
        let padded = Tensor::cat(&[&state.conv, &qkv], 0)?; // [n + K − 1, C]
        let mut conv = padded
            .narrow(0, 0, n)?
            .broadcast_mul(&self.conv1d.narrow(1, 0, 1)?.t()?)?;
        for j in 1..k {
            let w = self.conv1d.narrow(1, j, 1)?.t()?; // [1, C]
            conv = (conv + padded.narrow(0, j, n)?.broadcast_mul(&w)?)?;
        }
        let u = candle_nn::ops::silu(&conv)?.to_dtype(DType::F32)?;
        let q = u.narrow(1, 0, hk * dk)?.reshape((n, hk, dk))?;
        let kk = u.narrow(1, hk * dk, hk * dk)?.reshape((n, hk, dk))?;
        let v = u.narrow(1, 2 * hk * dk, hv * dv)?.reshape((n, hv, dv))?;
        // value head h reads key head ⌊h·Hk/Hv⌋
        let rep = hv / hk;
        let expand = |t: Tensor| -> Result<Tensor> {
            Ok(if rep == 1 {
                t
            } else {
                t.unsqueeze(2)?
                    .broadcast_as((n, hk, rep, dk))?
                    .reshape((n, hv, dk))?
            })
        };
        let q = (gated_delta::l2norm(&expand(q)?)? * (dk as f64).powf(-0.5))?;
        let kk = gated_delta::l2norm(&expand(kk)?)?;
        let beta = candle_nn::ops::sigmoid(&self.in_proj_b.forward(x)?.to_dtype(DType::F32)?)?;
        let a = self
            .in_proj_a
            .forward(x)?
            .to_dtype(DType::F32)?
            .broadcast_add(&self.dt_bias)?;
        // softplus(a) = log(1 + e^a), stable for large a
        let softplus = (a.relu()? + (a.abs()?.neg()?.exp()? + 1.0)?.log()?)?;
        let g = softplus.broadcast_mul(&self.neg_a)?;
        let inputs = DeltaInputs {
            q: &q,
            k: &kk,
            v: &v,
            g: &g,
            beta: &beta,
        };
        let mut states = vec![];
        let o = if checkpoints || n == 1 {
            let r = gated_delta::recurrent(&inputs, &state.recurrent, checkpoints)?;
            if let Some(ck) = r.checkpoints {
                for t in 0..n {
                    states.push(DeltaState {
                        conv: padded.narrow(0, t + 1, k - 1)?,
                        recurrent: ck.get(t)?,
                    });
                }
            }
            state.recurrent = r.state;
            r.out
        } else {
            let (o, st) = gated_delta::chunked(&inputs, &state.recurrent)?;
            state.recurrent = st;
            o
        };
        state.conv = padded.narrow(0, n, k - 1)?.contiguous()?;
        // gated RMSNorm per value head (f32), weight applied as is, then SiLU(z)
        let ms = o.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = o.broadcast_mul(&(ms + self.eps)?.sqrt()?.recip()?)?;
        let normed = normed.broadcast_mul(&self.norm.to_dtype(DType::F32)?)?;
        let z = self
            .in_proj_z
            .forward(x)?
            .to_dtype(DType::F32)?
            .reshape((n, hv, dv))?;
        let y = (normed * candle_nn::ops::silu(&z)?)?
            .reshape((n, hv * dv))?
            .to_dtype(x.dtype())?;
        Ok((self.out_proj.forward(&y)?, states))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use std::collections::HashMap;

    fn layer(shape: DeltaNetShape, seed: u64) -> GatedDeltaNet {
        let dev = Device::Cpu;
        let (h, c, hv, dv) = (
            shape.hidden,
            shape.conv_channels(),
            shape.value_heads,
            shape.value_dim,
        );
        let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        let mut rnd = |dims: &[usize], scale: f32, offset: f32| -> Tensor {
            let n: usize = dims.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    offset + scale * ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
                })
                .collect();
            Tensor::from_vec(v, dims, &dev).unwrap()
        };
        let mut w = HashMap::new();
        w.insert("in_proj_qkv.weight".to_string(), rnd(&[c, h], 0.3, 0.0));
        w.insert("in_proj_z.weight".into(), rnd(&[hv * dv, h], 0.3, 0.0));
        w.insert("in_proj_b.weight".into(), rnd(&[hv, h], 0.3, 0.0));
        w.insert("in_proj_a.weight".into(), rnd(&[hv, h], 0.3, 0.0));
        w.insert(
            "conv1d.weight".into(),
            rnd(&[c, 1, shape.conv_kernel], 0.5, 0.0),
        );
        w.insert("dt_bias".into(), rnd(&[hv], 0.5, 0.0));
        w.insert("A_log".into(), rnd(&[hv], 0.5, 0.0));
        w.insert("norm.weight".into(), rnd(&[dv], 0.2, 1.0));
        w.insert("out_proj.weight".into(), rnd(&[h, hv * dv], 0.3, 0.0));
        GatedDeltaNet::new(shape, 1e-6, VarBuilder::from_tensors(w, DType::F32, &dev)).unwrap()
    }

    const SHAPE: DeltaNetShape = DeltaNetShape {
        hidden: 24,
        key_heads: 2,
        value_heads: 4,
        key_dim: 8,
        value_dim: 6,
        conv_kernel: 4,
    };

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    #[test]
    fn one_call_equals_token_by_token_and_blocks_continue_over_the_state() {
        let l = layer(SHAPE, 3);
        let x = Tensor::randn(0f32, 1.0, (75, SHAPE.hidden), &Device::Cpu).unwrap();
        let mut whole = l.new_state().unwrap();
        let y = l.forward(&x, &mut whole).unwrap();
        let mut step = l.new_state().unwrap();
        let ys: Vec<Tensor> = (0..75)
            .map(|t| l.forward(&x.narrow(0, t, 1).unwrap(), &mut step).unwrap())
            .collect();
        let y1 = Tensor::cat(&ys, 0).unwrap();
        assert!(max_diff(&y, &y1) < 1e-4, "{}", max_diff(&y, &y1));
        assert!(max_diff(&whole.recurrent, &step.recurrent) < 1e-4);
        assert!(max_diff(&whole.conv, &step.conv) < 1e-5); // the projection's row count rounds
                                                           // a prefill of 60 then a block of 15 over the state
        let mut split = l.new_state().unwrap();
        let a = l.forward(&x.narrow(0, 0, 60).unwrap(), &mut split).unwrap();
        let b = l
            .forward(&x.narrow(0, 60, 15).unwrap(), &mut split)
            .unwrap();
        let ab = Tensor::cat(&[a, b], 0).unwrap();
        assert!(max_diff(&y, &ab) < 1e-4);
    }

    #[test]
    fn a_checkpoint_is_the_state_of_its_prefix_so_rejected_drafts_roll_back_exactly() {
        let l = layer(SHAPE, 5);
        let x = Tensor::randn(0f32, 1.0, (30, SHAPE.hidden), &Device::Cpu).unwrap();
        let mut st = l.new_state().unwrap();
        l.forward(&x.narrow(0, 0, 20).unwrap(), &mut st).unwrap();
        // verify a block of 10, accept 4 of them: the state must be that of 24 tokens
        let mut verify = st.clone();
        let (_, ck) = l
            .forward_checkpointed(&x.narrow(0, 20, 10).unwrap(), &mut verify)
            .unwrap();
        assert_eq!(ck.len(), 10);
        let mut direct = st.clone();
        l.forward(&x.narrow(0, 20, 4).unwrap(), &mut direct)
            .unwrap();
        let kept = &ck[3];
        assert!(max_diff(&kept.recurrent, &direct.recurrent) < 1e-5);
        assert!(max_diff(&kept.conv, &direct.conv) < 1e-5);
        // and continuing from the kept state gives what continuing from the direct one gives
        let (mut a, mut b) = (kept.clone(), direct.clone());
        let ya = l.forward(&x.narrow(0, 24, 6).unwrap(), &mut a).unwrap();
        let yb = l.forward(&x.narrow(0, 24, 6).unwrap(), &mut b).unwrap();
        assert!(max_diff(&ya, &yb) < 1e-5);
    }

    #[test]
    fn bad_shapes_are_refused() {
        let bad = DeltaNetShape {
            value_heads: 3,
            ..SHAPE
        };
        assert!(bad.validate().is_err());
    }
}
