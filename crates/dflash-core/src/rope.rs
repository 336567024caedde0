//! Rotary position embeddings (NeoX rotate-half layout) with Llama-3.1, linear and YaRN scaling.
//!
//! Invariants:
//! - Angles are computed exactly as transformers does: `inv_freq` in f32, `angle = f32(pos) *
//!   inv_freq` in f32, then cos/sin, cast to the model dtype. Matching this rounding matters at long
//!   positions.
//! - cos/sin are computed per forward for the explicit position ids (no table, no context limit);
//!   one `(cos, sin)` pair is shared by every layer of that forward.
//! - Only the first `rotary_dim` channels of a head rotate; the rest pass through.

use crate::{CoreError, Grad, Result};
use candle_core::{DType, Device, Tensor, D};

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Llama-3.1 frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// Positions divided by `factor`.
    Linear { factor: f64 },
    /// YaRN (NTK-by-parts with attention temperature).
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: Option<f64>,
        truncate: bool,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub scaling: Option<RopeScaling>,
}

#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    inv_freq: Vec<f32>,
    attention_factor: f32,
    rotary_dim: usize,
    head_dim: usize,
}

fn linear_ramp(min: f64, mut max: f64, n: usize) -> Vec<f64> {
    if min == max {
        max += 0.001;
    }
    (0..n)
        .map(|i| ((i as f64 - min) / (max - min)).clamp(0.0, 1.0))
        .collect()
}

impl RotaryEmbedding {
    pub fn new(cfg: &RopeConfig) -> Result<Self> {
        let dim = cfg.rotary_dim;
        if dim == 0 || !dim.is_multiple_of(2) || dim > cfg.head_dim {
            return Err(CoreError::InvalidInput(format!(
                "rotary dim {dim} must be even, > 0 and <= head_dim {}",
                cfg.head_dim
            )));
        }
        let base = cfg.theta as f32;
        let pos_freqs: Vec<f32> = (0..dim / 2)
            .map(|i| base.powf((2 * i) as f32 / dim as f32))
            .collect();
        let mut inv_freq: Vec<f32> = pos_freqs.iter().map(|p| 1.0 / p).collect();
        let mut attention_factor = 1.0f32;
        match &cfg.scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => {
                for f in &mut inv_freq {
                    *f /= *factor as f32;
                }
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            }) => {
                let (factor, lo, hi, old) = (
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                    *old as f32,
                );
                let low_wavelen = old / lo;
                let high_wavelen = old / hi;
                for f in &mut inv_freq {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    let scaled = if wavelen > low_wavelen {
                        *f / factor
                    } else {
                        *f
                    };
                    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    *f = if medium {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    };
                }
            }
            Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: old,
                beta_fast,
                beta_slow,
                attention_factor: af,
                truncate,
            }) => {
                let d = dim as f64;
                let correction = |rot: f64| {
                    d * (old / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * cfg.theta.ln())
                };
                let (mut low, mut high) = (correction(*beta_fast), correction(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let high = high.min(d - 1.0);
                let ramp = linear_ramp(low, high, dim / 2);
                for (i, f) in inv_freq.iter_mut().enumerate() {
                    let extrapolation = 1.0 / pos_freqs[i];
                    let interpolation = 1.0 / (*factor as f32 * pos_freqs[i]);
                    let extra_factor = 1.0 - ramp[i] as f32;
                    *f = interpolation * (1.0 - extra_factor) + extrapolation * extra_factor;
                }
                attention_factor = af.unwrap_or(if *factor > 1.0 {
                    0.1 * factor.ln() + 1.0
                } else {
                    1.0
                }) as f32;
            }
        }
        Ok(Self {
            inv_freq,
            attention_factor,
            rotary_dim: dim,
            head_dim: cfg.head_dim,
        })
    }

    /// How many leading channels of a head rotate.
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// `(cos, sin)`, each `[positions.len(), rotary_dim / 2]` in `dtype`.
    pub fn cos_sin(
        &self,
        positions: &[u32],
        device: &Device,
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos() * self.attention_factor);
                sin.push(a.sin() * self.attention_factor);
            }
        }
        let shape = (positions.len(), half);
        let cos = Tensor::from_vec(cos, shape, device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, shape, device)?.to_dtype(dtype)?;
        Ok((cos, sin))
    }

    /// Rotates `x` (`[b, heads, seq, head_dim]`) with the rows of `cos`/`sin` for its `seq` positions.
    pub fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, grad: Grad) -> Result<Tensor> {
        if self.rotary_dim < self.head_dim {
            let rot = x.narrow(D::Minus1, 0, self.rotary_dim)?;
            let pass = x.narrow(D::Minus1, self.rotary_dim, self.head_dim - self.rotary_dim)?;
            let rot = self.rotate(&rot.contiguous()?, cos, sin, grad)?;
            return Ok(Tensor::cat(&[&rot, &pass], D::Minus1)?);
        }
        self.rotate(&x.contiguous()?, cos, sin, grad)
    }

    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, grad: Grad) -> Result<Tensor> {
        match grad {
            Grad::Off => Ok(candle_nn::rotary_emb::rope(x, cos, sin)?),
            Grad::On => {
                if let Some(y) = crate::fused_grad::rope(x, cos, sin)? {
                    return Ok(y);
                }
                let half = x.dim(D::Minus1)? / 2;
                let x1 = x.narrow(D::Minus1, 0, half)?;
                let x2 = x.narrow(D::Minus1, half, half)?;
                let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
                // `[seq, d/2]` shared by the batch, or `[b, seq, d/2]` per sequence
                let lift = |t: &Tensor| -> Result<Tensor> {
                    let t = Tensor::cat(&[t, t], D::Minus1)?;
                    Ok(if t.rank() == 3 {
                        t.unsqueeze(1)?
                    } else {
                        t.unsqueeze(0)?.unsqueeze(0)?
                    })
                };
                let (cos, sin) = (lift(cos)?, lift(sin)?);
                Ok((x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_and_differentiable_rope_agree() {
        let cfg = RopeConfig {
            theta: 10000.0,
            head_dim: 8,
            rotary_dim: 8,
            scaling: None,
        };
        let r = RotaryEmbedding::new(&cfg).unwrap();
        let x = Tensor::randn(0f32, 1.0, (1, 2, 3, 8), &Device::Cpu).unwrap();
        let (c, s) = r.cos_sin(&[5, 9, 100], &Device::Cpu, DType::F32).unwrap();
        let a = r.apply(&x, &c, &s, Grad::Off).unwrap();
        let b = r.apply(&x, &c, &s, Grad::On).unwrap();
        let d = crate::test_util::max_abs_diff(&a, &b);
        assert!(d < 1e-5);
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let plain = RotaryEmbedding::new(&RopeConfig {
            theta: 500000.0,
            head_dim: 64,
            rotary_dim: 64,
            scaling: None,
        })
        .unwrap();
        let scaled = RotaryEmbedding::new(&RopeConfig {
            theta: 500000.0,
            head_dim: 64,
            rotary_dim: 64,
            scaling: Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            }),
        })
        .unwrap();
        assert_eq!(plain.inv_freq[0], scaled.inv_freq[0]);
        let last = plain.inv_freq.len() - 1;
        assert!((plain.inv_freq[last] / 8.0 - scaled.inv_freq[last]).abs() < 1e-12);
    }
}
