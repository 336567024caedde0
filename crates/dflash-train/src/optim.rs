//! AdamW (decoupled weight decay) with global-norm gradient clipping and a warmup + cosine
//! schedule, with state that saves and restores exactly.
//!
//! Invariants: parameters and moments are f32; parameters are visited in name order, so the
//! update is deterministic; `save`/`load` round-trip every bit of state (moments, step count).

use crate::{Result, TrainError};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub max_grad_norm: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 6e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: 1.0,
        }
    }
}

/// Linear warmup to the peak, then cosine decay to 0 at `total` steps.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct LrSchedule {
    pub peak: f64,
    pub warmup: usize,
    pub total: usize,
}

impl LrSchedule {
    pub fn at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = (self.total.saturating_sub(self.warmup)).max(1) as f64;
        let t = ((step - self.warmup) as f64 / span).min(1.0);
        self.peak * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

pub struct AdamW {
    pub cfg: AdamWConfig,
    params: BTreeMap<String, Var>,
    m: BTreeMap<String, Tensor>,
    v: BTreeMap<String, Tensor>,
    pub step: usize,
}

impl AdamW {
    pub fn new(params: HashMap<String, Var>, cfg: AdamWConfig) -> Result<Self> {
        let params: BTreeMap<String, Var> = params.into_iter().collect();
        let mut m = BTreeMap::new();
        let mut v = BTreeMap::new();
        for (k, p) in &params {
            if p.dtype() != DType::F32 {
                return Err(TrainError::InvalidInput(format!(
                    "parameter {k} is {:?}; master weights must be f32",
                    p.dtype()
                )));
            }
            m.insert(k.clone(), p.zeros_like()?);
            v.insert(k.clone(), p.zeros_like()?);
        }
        Ok(Self {
            cfg,
            params,
            m,
            v,
            step: 0,
        })
    }

    /// Clips by global norm, applies one update at learning rate `lr`; returns the pre-clip norm.
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<f64> {
        let mut sq = 0f64;
        for p in self.params.values() {
            if let Some(g) = grads.get(p.as_tensor()) {
                sq += g
                    .sqr()?
                    .sum_all()?
                    .to_dtype(DType::F64)?
                    .to_scalar::<f64>()?;
            }
        }
        let norm = sq.sqrt();
        let clip = if norm > self.cfg.max_grad_norm && norm > 0.0 {
            self.cfg.max_grad_norm / norm
        } else {
            1.0
        };
        self.step += 1;
        let (b1, b2) = (self.cfg.beta1, self.cfg.beta2);
        let bc1 = 1.0 - b1.powi(self.step as i32);
        let bc2 = 1.0 - b2.powi(self.step as i32);
        for (k, p) in &self.params {
            let Some(g) = grads.get(p.as_tensor()) else {
                continue;
            };
            let g = (g * clip)?;
            let m = ((&self.m[k] * b1)? + (&g * (1.0 - b1))?)?;
            let v = ((&self.v[k] * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let update = ((&m / bc1)? / ((&v / bc2)?.sqrt()? + self.cfg.eps)?)?;
            let decayed = (p.as_tensor() * (1.0 - lr * self.cfg.weight_decay))?;
            p.set(&(decayed - (update * lr)?)?)?;
            self.m.insert(k.clone(), m);
            self.v.insert(k.clone(), v);
        }
        Ok(norm)
    }

    /// The master tensors, in name order (the keys of a [`GradStore`]).
    pub fn param_tensors(&self) -> Vec<Tensor> {
        self.params
            .values()
            .map(|v| v.as_tensor().clone())
            .collect()
    }

    pub fn params(&self) -> &BTreeMap<String, Var> {
        &self.params
    }

    /// Writes moments to `path` (safetensors) with the step count in its metadata file `path.json`.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut t: HashMap<String, Tensor> = HashMap::new();
        for (k, m) in &self.m {
            t.insert(format!("m.{k}"), m.clone());
            t.insert(format!("v.{k}"), self.v[k].clone());
        }
        dflash_core::fs::write_atomic_with(path, |tmp| {
            candle_core::safetensors::save(&t, tmp).map_err(std::io::Error::other)
        })
        .map_err(|e| TrainError::Io {
            path: path.display().to_string(),
            source: e,
        })
    }

    pub fn load(&mut self, path: &Path, step: usize) -> Result<()> {
        let t = candle_core::safetensors::load(
            path,
            &self
                .params
                .values()
                .next()
                .map(|p| p.device().clone())
                .unwrap_or(candle_core::Device::Cpu),
        )?;
        for k in self.params.keys() {
            let get = |n: String| {
                t.get(&n).cloned().ok_or_else(|| {
                    TrainError::InvalidInput(format!("{}: missing {n}", path.display()))
                })
            };
            self.m.insert(k.clone(), get(format!("m.{k}"))?);
            self.v.insert(k.clone(), get(format!("v.{k}"))?);
        }
        self.step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_zero() {
        let s = LrSchedule {
            peak: 1.0,
            warmup: 4,
            total: 20,
        };
        assert!((s.at(0) - 0.25).abs() < 1e-12 && (s.at(3) - 1.0).abs() < 1e-12);
        assert!(s.at(10) < 1.0 && s.at(10) > 0.0);
        assert!(s.at(20).abs() < 1e-12);
    }

    #[test]
    fn adamw_minimises_a_quadratic_and_clips() {
        let x = Var::from_tensor(&Tensor::new(&[3f32, -2.0], &candle_core::Device::Cpu).unwrap())
            .unwrap();
        let mut opt = AdamW::new(
            HashMap::from([("x".to_string(), x.clone())]),
            AdamWConfig {
                weight_decay: 0.0,
                ..Default::default()
            },
        )
        .unwrap();
        let mut first = 0.0;
        for i in 0..300 {
            let loss = x.as_tensor().sqr().unwrap().sum_all().unwrap();
            let g = loss.backward().unwrap();
            let n = opt.step(&g, 0.05).unwrap();
            if i == 0 {
                first = n;
            }
        }
        assert!(
            (first - (36f64 + 16.0).sqrt()).abs() < 1e-4,
            "pre-clip norm reported"
        );
        let v: Vec<f32> = x.as_tensor().to_vec1().unwrap();
        assert!(v.iter().all(|a| a.abs() < 0.05), "{v:?}");
    }
}
