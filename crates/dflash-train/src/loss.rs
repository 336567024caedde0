//! The decay-weighted block cross-entropy and per-position accuracy.
//!
//! Invariants: row k of block b is labelled with `tokens[a_b + k]` (same position: the drafter
//! predicts the token *at* each block slot); weight `w_k = exp(−(k−1)/γ)` for k ≥ 1, 0 for k = 0,
//! 0 past the sequence end or where `loss_mask` is off; loss = Σ w·CE / Σ w; the log-softmax is
//! candle's differentiable composite.

use crate::{Result, TrainError};
use candle_core::{DType, Device, Tensor, D};

pub struct BlockLabels {
    /// `[nb·B]` label ids (0 where unweighted).
    pub labels: Vec<u32>,
    /// `[nb·B]` weights.
    pub weights: Vec<f32>,
}

pub fn block_labels(
    tokens: &[u32],
    loss_mask: &[bool],
    anchors: &[u32],
    block: usize,
    gamma: f64,
) -> BlockLabels {
    let mut labels = vec![0u32; anchors.len() * block];
    let mut weights = vec![0f32; anchors.len() * block];
    for (b, &a) in anchors.iter().enumerate() {
        for k in 1..block {
            let p = a as usize + k;
            if p < tokens.len() && loss_mask[p] {
                labels[b * block + k] = tokens[p];
                weights[b * block + k] = (-((k - 1) as f64) / gamma).exp() as f32;
            }
        }
    }
    BlockLabels { labels, weights }
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct LossReport {
    pub loss: f32,
    /// Argmax accuracy per block row k = 1..B−1 (weighted rows only).
    pub accuracy: Vec<f32>,
    /// Teacher-forced expected τ: 1 + mean leading run of correct rows per block.
    pub streak: f32,
}

/// `logits` `[nb, B, V]` → (differentiable scalar loss, report).
pub fn block_loss(logits: &Tensor, l: &BlockLabels) -> Result<(Tensor, LossReport)> {
    let (nb, bs, v) = logits.dims3()?;
    if l.labels.len() != nb * bs {
        return Err(TrainError::InvalidInput(format!(
            "{} labels for {nb}×{bs} rows",
            l.labels.len()
        )));
    }
    let dev = logits.device();
    let flat = logits.reshape((nb * bs, v))?.to_dtype(DType::F32)?;
    let logp = candle_nn::ops::log_softmax(&flat, D::Minus1)?;
    let idx = Tensor::from_slice(&l.labels, (nb * bs, 1), dev)?;
    let picked = logp.gather(&idx, 1)?.squeeze(1)?;
    let w = Tensor::from_slice(&l.weights, nb * bs, dev)?;
    let total: f32 = l.weights.iter().sum();
    let loss = ((picked * &w)?.sum_all()?.neg()? / total.max(1e-6) as f64)?;
    let pred: Vec<u32> = flat.argmax(D::Minus1)?.to_device(&Device::Cpu)?.to_vec1()?;
    let mut correct = vec![0f32; bs];
    let mut count = vec![0f32; bs];
    let mut streak_sum = 0f32;
    let mut blocks = 0f32;
    for b in 0..nb {
        let mut run = 0;
        let mut running = true;
        let mut any = false;
        for k in 1..bs {
            let i = b * bs + k;
            if l.weights[i] == 0.0 {
                running = false;
                continue;
            }
            any = true;
            count[k] += 1.0;
            let ok = pred[i] == l.labels[i];
            if ok {
                correct[k] += 1.0;
            }
            if running && ok {
                run += 1;
            } else {
                running = false;
            }
        }
        if any {
            streak_sum += run as f32;
            blocks += 1.0;
        }
    }
    let accuracy = (1..bs)
        .map(|k| {
            if count[k] > 0.0 {
                correct[k] / count[k]
            } else {
                0.0
            }
        })
        .collect();
    let report = LossReport {
        loss: loss.to_device(&Device::Cpu)?.to_scalar::<f32>()?,
        accuracy,
        streak: 1.0
            + if blocks > 0.0 {
                streak_sum / blocks
            } else {
                0.0
            },
    };
    Ok((loss, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_same_position_and_decay_weighted() {
        let tokens = [10, 11, 12, 13, 14, 15];
        let mask = [false, true, true, true, true, true];
        let l = block_labels(&tokens, &mask, &[1, 4], 3, 7.0);
        assert_eq!(l.labels, vec![0, 12, 13, 0, 15, 0]);
        assert_eq!(l.weights[0], 0.0);
        assert_eq!(l.weights[1], 1.0);
        assert!((l.weights[2] - (-1.0f32 / 7.0).exp()).abs() < 1e-6);
        assert_eq!(l.weights[5], 0.0, "past the end");
    }

    #[test]
    fn loss_is_weighted_ce_and_streak_counts_leading_hits() {
        let dev = Device::Cpu;
        // 1 block of 3 rows over vocab 2; row1 predicts 0 strongly, row2 predicts 1
        let logits = Tensor::new(&[[[0f32, 0.0], [5.0, 0.0], [0.0, 5.0]]], &dev).unwrap();
        let l = BlockLabels {
            labels: vec![0, 0, 0],
            weights: vec![0.0, 1.0, 0.5],
        };
        let (loss, r) = block_loss(&logits, &l).unwrap();
        let ce = |a: f32, b: f32| -(a - (a.exp() + b.exp()).ln());
        let want = (ce(5.0, 0.0) + 0.5 * ce(0.0, 5.0)) / 1.5;
        assert!((loss.to_scalar::<f32>().unwrap() - want).abs() < 1e-5);
        assert_eq!(r.accuracy, vec![1.0, 0.0]);
        assert_eq!(r.streak, 2.0);
    }
}
