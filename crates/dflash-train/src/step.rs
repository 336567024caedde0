//! One optimizer step over a group of sequences: frozen target taps (no graph), anchors, the
//! drafter's training forward, decay-weighted loss, backward per sequence with gradients summed
//! (accumulation), one clipped AdamW update.
//!
//! Invariants: the step's loss is the label-weight-weighted mean over its sequences (a group of one
//! is exactly the single-sequence loss); gradients reach the f32 master weights through the
//! compute-dtype casts of [`compute_drafter`]; the target is never differentiated.

use crate::anchors::sample_anchors;
use crate::loss::{block_labels, block_loss, LossReport};
use crate::optim::{AdamW, LrSchedule};
use crate::Result;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use candle_nn::{VarBuilder, VarMap};
use dflash_core::{AttentionMask, Grad};
use dflash_models::{DFlashConfig, DFlashDrafter, ForwardRequest, LogitRows, TargetModel};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

/// Target taps of a whole sequence `[S, T·H]`, detached (the target never trains).
pub fn sequence_taps(target: &dyn TargetModel, tokens: &[u32], layers: &[usize]) -> Result<Tensor> {
    let mut cache = target.new_cache(tokens.len())?;
    let pos: Vec<u32> = (0..tokens.len() as u32).collect();
    let req = ForwardRequest {
        tokens,
        positions: &pos,
        mask: AttentionMask::Causal,
        taps: layers,
        logits: LogitRows::None,
    };
    let out = target.forward(&req, &mut cache)?;
    Ok(Tensor::cat(&out.taps, 1)?.detach())
}

/// The drafter that computes in `dtype` over the f32 masters in `varmap`: each weight is a cast of
/// its master `Var` (a graph edge), so backward lands on the masters. For f32 it is the masters.
pub fn compute_drafter(cfg: &DFlashConfig, varmap: &VarMap, dtype: DType) -> Result<DFlashDrafter> {
    let data = varmap.data().lock().expect("varmap");
    let dev = data
        .values()
        .next()
        .map(|v| v.device().clone())
        .unwrap_or(candle_core::Device::Cpu);
    let weights: HashMap<String, Tensor> = data
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.as_tensor().to_dtype(dtype)?)))
        .collect::<Result<_>>()?;
    drop(data);
    Ok(DFlashDrafter::new(
        cfg,
        VarBuilder::from_tensors(weights, dtype, &dev),
    )?)
}

/// A sequence of one step's group.
pub struct Sequence<'a> {
    pub tokens: &'a [u32],
    pub loss_mask: &'a [bool],
}

pub struct TrainStep {
    pub anchors_per_sequence: usize,
    pub gamma: f64,
    pub schedule: LrSchedule,
}

/// What one step did.
#[derive(Debug, Clone, Default)]
pub struct StepReport {
    pub loss: LossReport,
    /// Pre-clip global gradient norm.
    pub grad_norm: f64,
    /// Blocks (anchors) trained on.
    pub blocks: usize,
    /// Sequence tokens the target ran over.
    pub tokens: usize,
}

fn add_grads(acc: &mut Option<GradStore>, g: GradStore, params: &[Tensor]) -> Result<()> {
    match acc {
        None => *acc = Some(g),
        Some(a) => {
            for p in params {
                if let Some(new) = g.get(p) {
                    let sum = match a.get(p) {
                        Some(old) => (old + new)?,
                        None => new.clone(),
                    };
                    a.insert(p, sum);
                }
            }
        }
    }
    Ok(())
}

impl TrainStep {
    /// Runs one step over `group` with `drafter` (from [`compute_drafter`] over the optimizer's
    /// masters). Sequences without a supervised anchor are skipped; a group with none is an error.
    pub fn run(
        &self,
        target: &dyn TargetModel,
        drafter: &DFlashDrafter,
        opt: &mut AdamW,
        group: &[Sequence],
        rng: &mut ChaCha8Rng,
    ) -> Result<StepReport> {
        let mut planned = vec![];
        for seq in group {
            let anchors = sample_anchors(seq.loss_mask, self.anchors_per_sequence, rng);
            if anchors.is_empty() {
                continue;
            }
            let labels = block_labels(
                seq.tokens,
                seq.loss_mask,
                &anchors,
                drafter.block_size(),
                self.gamma,
            );
            let weight: f32 = labels.weights.iter().sum();
            planned.push((seq, anchors, labels, weight));
        }
        let total_weight: f32 = planned.iter().map(|p| p.3).sum();
        if planned.is_empty() || total_weight <= 0.0 {
            return Err(crate::TrainError::InvalidInput(
                "no sequence of the step has a supervised anchor".into(),
            ));
        }
        let params = opt.param_tensors();
        let mut grads: Option<GradStore> = None;
        let mut report = StepReport::default();
        let (mut loss_sum, mut streak_sum) = (0f64, 0f64);
        let mut acc_sum = vec![0f64; drafter.block_size() - 1];
        for (seq, anchors, labels, weight) in &planned {
            let taps = sequence_taps(target, seq.tokens, drafter.target_layers())?;
            let logits = drafter.forward_train(target, &taps, seq.tokens, anchors, Grad::On)?;
            let (loss, r) = block_loss(&logits, labels)?;
            let share = (*weight / total_weight) as f64;
            add_grads(&mut grads, (loss * share)?.backward()?, &params)?;
            loss_sum += r.loss as f64 * share;
            let nb = anchors.len() as f64;
            streak_sum += r.streak as f64 * nb;
            for (a, x) in acc_sum.iter_mut().zip(&r.accuracy) {
                *a += *x as f64 * nb;
            }
            report.blocks += anchors.len();
            report.tokens += seq.tokens.len();
        }
        let nb = report.blocks as f64;
        report.loss = LossReport {
            loss: loss_sum as f32,
            accuracy: acc_sum.iter().map(|a| (a / nb) as f32).collect(),
            streak: (streak_sum / nb) as f32,
        };
        let lr = self.schedule.at(opt.step);
        report.grad_norm = opt.step(&grads.expect("at least one sequence"), lr)?;
        Ok(report)
    }
}
