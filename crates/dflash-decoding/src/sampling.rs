//! Token choice from logits: greedy, or temperature with top-k / top-p, from a seeded ChaCha RNG.
//!
//! Invariants:
//! - `temperature == 0` is greedy argmax; ties go to the lowest id (as `torch.argmax`), on the host
//!   ([`argmax`]) and on the device ([`greedy_rows`], which reads back one id per row instead of
//!   the rows of logits).
//! - The same seed and the same sequence of calls give the same tokens on every machine
//!   (ChaCha8, not `StdRng`, whose algorithm may change between rand versions).
//! - Filtering follows transformers' order: temperature, then top-k, then top-p; the most likely
//!   token always survives top-p. The host sorts and keeps the lower ids at a tie on a cut; the
//!   CUDA path (no sort, only ids cross) keeps every tied token there and walks the kept mass in
//!   id order — the same distribution whenever the cut falls between distinct logits.

use crate::{DecodeError, Result};
use candle_core::{DType, Device, Tensor};
use rand::Rng;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub seed: u64,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

impl SamplingConfig {
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(DecodeError::InvalidInput(format!(
                "temperature {} must be >= 0",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(DecodeError::InvalidInput(format!(
                "top-p {} must be in (0, 1]",
                self.top_p
            )));
        }
        Ok(())
    }
}

pub struct Sampler {
    cfg: SamplingConfig,
    rng: ChaCha8Rng,
}

/// The greedy token of every row of `[rows, vocab]` logits, computed where the logits are: the
/// lowest id among each row's maxima (as [`argmax`]), so only `rows` ids cross to the host (one
/// kernel on CUDA). A row without a maximum (NaN) falls back to the host [`argmax`] of that row.
pub fn greedy_rows(logits: &Tensor) -> Result<Vec<u32>> {
    Ok(dflash_core::decode_ops::argmax_rows(logits)?)
}

pub use dflash_core::decode_ops::argmax;

/// Largest minus second-largest value.
pub fn top2_margin(xs: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in xs {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

impl Sampler {
    pub fn new(cfg: SamplingConfig) -> Result<Self> {
        cfg.validate()?;
        let rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        Ok(Self { cfg, rng })
    }

    pub fn config(&self) -> &SamplingConfig {
        &self.cfg
    }

    /// The filtered, normalised distribution `(ids, probs)` for one row (sampled mode).
    pub fn distribution(&self, logits: &[f32]) -> (Vec<u32>, Vec<f32>) {
        let t = self.cfg.temperature;
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        idx.sort_unstable_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        if self.cfg.top_k > 0 && self.cfg.top_k < idx.len() {
            idx.truncate(self.cfg.top_k);
        }
        let max = logits[idx[0] as usize] / t;
        let mut p: Vec<f32> = idx
            .iter()
            .map(|&i| (logits[i as usize] / t - max).exp())
            .collect();
        let z: f32 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= z);
        if self.cfg.top_p < 1.0 {
            let mut cum = 0.0;
            let mut keep = p.len();
            for (i, &x) in p.iter().enumerate() {
                cum += x;
                if cum >= self.cfg.top_p {
                    keep = i + 1;
                    break;
                }
            }
            idx.truncate(keep);
            p.truncate(keep);
            let z: f32 = p.iter().sum();
            p.iter_mut().for_each(|x| *x /= z);
        }
        (idx, p)
    }

    /// One token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.is_greedy() {
            return argmax(logits);
        }
        let (ids, probs) = self.distribution(logits);
        let u: f32 = self.rng.random();
        let mut cum = 0.0;
        for (id, p) in ids.iter().zip(&probs) {
            cum += p;
            if u < cum {
                return *id;
            }
        }
        *ids.last().expect("distribution is never empty")
    }

    /// One token per row plus each row's top-1 − top-2 logit margin (how near a tie it was).
    pub fn sample_rows_with_margin(&mut self, logits: &Tensor) -> Result<(Vec<u32>, Vec<f32>)> {
        let logits = logits.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        let rows: Vec<Vec<f32>> = logits.to_vec2()?;
        let margins = rows.iter().map(|r| top2_margin(r)).collect();
        Ok((rows.iter().map(|r| self.sample(r)).collect(), margins))
    }

    /// One token per row of `[rows, vocab]` logits, rows in order (greedy: [`greedy_rows`]). On
    /// CUDA the filtering and the draw run on the device (one uniform per row from this RNG, as
    /// on the host; `dflash_core::decode_ops::sample_rows`): the same distribution, only the ids
    /// cross to the host, and no full-vocabulary sort.
    pub fn sample_rows(&mut self, logits: &Tensor) -> Result<Vec<u32>> {
        if self.cfg.is_greedy() {
            return greedy_rows(logits);
        }
        if logits.device().is_cuda() {
            let rows = logits.dim(0)?;
            let u: Vec<f32> = (0..rows).map(|_| self.rng.random()).collect();
            let c = &self.cfg;
            return Ok(dflash_core::decode_ops::sample_rows(
                logits,
                c.temperature,
                c.top_k,
                c.top_p,
                &u,
            )?);
        }
        let logits = logits.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        let rows: Vec<Vec<f32>> = logits.to_vec2()?;
        Ok(rows.iter().map(|r| self.sample(r)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_rows_is_the_host_argmax_with_ties_to_the_lowest_id() {
        let rows = vec![
            vec![0.5f32, 2.0, -1.0, 2.0, 1.0],
            vec![3.0, 3.0, 3.0, 3.0, 3.0],
            vec![-5.0, -4.0, -3.0, -2.0, -1.0],
            vec![f32::NAN, 1.0, 7.0, 0.0, 7.0],
        ];
        let t = Tensor::new(rows.clone(), &Device::Cpu).unwrap();
        let got = greedy_rows(&t).unwrap();
        let want: Vec<u32> = rows.iter().map(|r| argmax(r)).collect();
        assert_eq!(&got[..3], &[1, 0, 4]);
        assert_eq!(&got[..3], &want[..3]);
        // a NaN row takes the host path, whatever it answers
        assert_eq!(got[3], want[3]);
    }

    #[test]
    fn greedy_takes_first_max() {
        let mut s = Sampler::new(SamplingConfig::greedy()).unwrap();
        assert_eq!(s.sample(&[0.0, 3.0, 3.0, 1.0]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_follows_the_distribution() {
        let cfg = SamplingConfig {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: 7,
        };
        let logits = [0.0f32, (2.0f32).ln(), (5.0f32).ln()]; // p = 1/8, 2/8, 5/8
        let mut a = Sampler::new(cfg.clone()).unwrap();
        let mut b = Sampler::new(cfg).unwrap();
        let mut counts = [0usize; 3];
        for _ in 0..8000 {
            let x = a.sample(&logits);
            assert_eq!(x, b.sample(&logits));
            counts[x as usize] += 1;
        }
        let want = [1000.0, 2000.0, 5000.0];
        let chi2: f64 = counts
            .iter()
            .zip(want)
            .map(|(&c, w)| (c as f64 - w).powi(2) / w)
            .sum();
        assert!(chi2 < 13.8, "chi2 {chi2} counts {counts:?}"); // p = 0.001, 2 dof
    }

    #[test]
    fn top_k_and_top_p_filter() {
        let s = Sampler::new(SamplingConfig {
            temperature: 1.0,
            top_p: 0.7,
            top_k: 0,
            seed: 0,
        })
        .unwrap();
        let (ids, _) = s.distribution(&[0.0, (2.0f32).ln(), (5.0f32).ln()]);
        assert_eq!(ids, vec![2, 1]);
        let s = Sampler::new(SamplingConfig {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 1,
            seed: 0,
        })
        .unwrap();
        assert_eq!(s.distribution(&[0.0, 1.0, 0.5]).0, vec![1]);
        assert!(Sampler::new(SamplingConfig {
            temperature: -1.0,
            ..Default::default()
        })
        .is_err());
        assert!(Sampler::new(SamplingConfig {
            top_p: 0.0,
            temperature: 1.0,
            ..Default::default()
        })
        .is_err());
    }
}
