//! One training step on one sequence: frozen target taps (no graph), anchors, the drafter's
//! training forward, decay-weighted loss, backward, clipped AdamW update.

use crate::anchors::sample_anchors;
use crate::loss::{block_labels, block_loss, LossReport};
use crate::optim::{AdamW, LrSchedule};
use crate::Result;
use candle_core::Tensor;
use dflash_core::{AttentionMask, Grad};
use dflash_models::{DFlashDrafter, ForwardRequest, LogitRows, TargetModel};
use rand_chacha::ChaCha8Rng;

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

pub struct TrainStep {
    pub anchors_per_sequence: usize,
    pub gamma: f64,
    pub schedule: LrSchedule,
}

impl TrainStep {
    /// Runs one step; returns the loss report and the pre-clip gradient norm.
    pub fn run(
        &self,
        target: &dyn TargetModel,
        drafter: &DFlashDrafter,
        opt: &mut AdamW,
        tokens: &[u32],
        loss_mask: &[bool],
        rng: &mut ChaCha8Rng,
    ) -> Result<(LossReport, f64)> {
        let taps = sequence_taps(target, tokens, drafter.target_layers())?;
        let anchors = sample_anchors(loss_mask, self.anchors_per_sequence, rng);
        if anchors.is_empty() {
            return Err(crate::TrainError::InvalidInput(
                "sequence has no supervised anchor".into(),
            ));
        }
        let logits = drafter.forward_train(target, &taps, tokens, &anchors, Grad::On)?;
        let labels = block_labels(
            tokens,
            loss_mask,
            &anchors,
            drafter.block_size(),
            self.gamma,
        );
        let (loss, report) = block_loss(&logits, &labels)?;
        let grads = loss.backward()?;
        let lr = self.schedule.at(opt.step);
        let norm = opt.step(&grads, lr)?;
        Ok((report, norm))
    }
}
