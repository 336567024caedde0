//! One optimizer step over a group of sequences: anchors per sequence, then micro-batches of
//! length-sorted, right-padded sequences, each with one batched frozen-target forward for the taps
//! (no graph; with self-distillation it also yields the target's next-token probabilities), one
//! batched drafter training forward, the decay-weighted loss through the target's LM head in row
//! chunks, and one backward; gradients summed over micro-batches (accumulation); one clipped AdamW
//! update. A [`PhaseTimer`] may time each phase.
//!
//! Invariants: the step's loss is the label-weight-weighted mean over its sequences (a group of one
//! is exactly the single-sequence loss); gradients reach the f32 master weights through the
//! compute-dtype casts of [`compute_drafter`]; the target is never differentiated.

use crate::anchors::sample_anchors;
use crate::loss::{
    block_labels, chunked_block_loss, BlockLabels, BlockStats, LmHead, LossReport, SoftLabels,
};
use crate::optim::{AdamW, LrSchedule};
use crate::profile::PhaseTimer;
use crate::Result;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use dflash_core::{AttentionMask, Grad};
use dflash_models::{
    BatchForwardRequest, DFlashConfig, DFlashDrafter, ForwardRequest, LogitRows, TargetModel,
};
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

/// One batched frozen-target forward over `b` right-padded sequences (`tokens` `[b·S]` row-major,
/// positions `0..S` in every row): taps `[b, S, T·H]` of `layers` (detached) and, when `probs`,
/// the next-token probabilities at every position `[b·S, V]` f32 (detached). Padding sits after
/// each sequence, so under the causal mask no real row ever sees it; padded rows are garbage the
/// caller never reads.
pub fn batch_target_forward(
    target: &dyn TargetModel,
    b: usize,
    tokens: &[u32],
    layers: &[usize],
    probs: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let s = tokens.len() / b.max(1);
    let dev = target.info().device.clone();
    let mut causal = vec![0f32; s * s];
    for i in 0..s {
        causal[i * s + i + 1..(i + 1) * s].fill(f32::NEG_INFINITY);
    }
    let mask = Tensor::from_vec(causal, (1, s, s), &dev)?.broadcast_as((b, s, s))?;
    let pos: Vec<u32> = (0..b).flat_map(|_| 0..s as u32).collect();
    let mut cache = target.new_cache(s)?;
    let first = vec![0u32; b];
    let req = BatchForwardRequest {
        batch: b,
        tokens,
        positions: &pos,
        mask,
        // right-padded sequences under the plain causal mask
        causal_from: Some(&first),
        taps: layers,
        logits: if probs {
            LogitRows::All
        } else {
            LogitRows::None
        },
    };
    let out = target.forward_batch(&req, &mut cache)?;
    let taps = if out.taps.is_empty() {
        Tensor::zeros((b, s, 0), DType::F32, &dev)?
    } else {
        Tensor::cat(&out.taps, 2)?.detach()
    };
    let probs = match out.logits {
        Some(logits) if probs => {
            let v = logits.dim(D::Minus1)?;
            let logits = logits.reshape((b * s, v))?.to_dtype(DType::F32)?;
            let p = if logits.elem_count() <= dflash_core::attention::FUSED_MAX_ELEMENTS {
                candle_nn::ops::softmax_last_dim(&logits)?
            } else {
                candle_nn::ops::softmax(&logits, D::Minus1)?
            };
            Some(p.detach())
        }
        _ if probs => {
            return Err(crate::TrainError::InvalidInput(
                "the target returned no logits".into(),
            ))
        }
        _ => None,
    };
    Ok((taps, probs))
}

/// The frozen target's next-token probabilities at every position of `b` right-padded sequences
/// → `[b·S, V]` f32, detached: the soft labels of self-distillation.
pub fn batch_probs(target: &dyn TargetModel, b: usize, tokens: &[u32]) -> Result<Tensor> {
    batch_target_forward(target, b, tokens, &[], true)?
        .1
        .ok_or_else(|| crate::TrainError::InvalidInput("the target returned no logits".into()))
}

/// For block rows laid out as in [`TrainStep::run`]'s micro-batch (`anchors` `[b·n]`, sequences
/// of `s` positions), the row of [`batch_probs`] each block row learns from: row `k` of a block
/// at anchor `a` in sequence `r` predicts the token at `a + k`, which is the target's output at
/// position `a + k − 1` (clamped into the sequence; such rows carry no weight).
pub fn soft_label_positions(s: usize, n: usize, bs: usize, anchors: &[u32]) -> Vec<u32> {
    (0..anchors.len() * bs)
        .map(|i| {
            let (r, a, k) = (i / (n * bs), anchors[i / bs] as usize, i % bs);
            (r * s + (a + k).saturating_sub(1).min(s - 1)) as u32
        })
        .collect()
}

/// The drafter that computes in `dtype` over the f32 masters in `varmap`: each weight is a cast of
/// its master `Var` (a graph edge), so backward lands on the masters. For f32 it is the masters.
pub fn compute_drafter(
    cfg: &DFlashConfig,
    varmap: &VarMap,
    dtype: DType,
    target: &dyn TargetModel,
) -> Result<DFlashDrafter> {
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
    let mut d = DFlashDrafter::new(cfg, VarBuilder::from_tensors(weights, dtype, &dev))?;
    d.bind_target(target)?;
    Ok(d)
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
    /// Padded sequence tokens per micro-batch (one batched target + drafter forward); a step's
    /// sequences are sorted by length and cut into micro-batches under this cap.
    pub micro_batch_tokens: usize,
    /// Share of the soft (target-distribution) term in each row's loss; 0 = labels only.
    pub distill: f64,
    /// The blocks' layout in the drafter's forward (the default is decoding's).
    pub convention: dflash_models::drafter::BlockConvention,
}

/// The largest f32 logits tensor the loss materialises at once (rows × vocab elements).
pub const MAX_LOGITS: usize = 1 << 28;

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
    /// Seconds per phase, when the step ran with an enabled [`PhaseTimer`] (else empty).
    pub phases: Vec<(String, f64)>,
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

/// Cuts `lengths` (indices sorted longest first) into groups whose padded size `count × longest`
/// stays within `cap` (a group always takes at least one sequence).
fn micro_batches(lengths: &[usize], cap: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    let mut out: Vec<Vec<usize>> = vec![];
    let mut cur: Vec<usize> = vec![];
    for i in order {
        let longest = cur.first().map(|&j| lengths[j]).unwrap_or(lengths[i]);
        if !cur.is_empty() && (cur.len() + 1) * longest > cap {
            out.push(std::mem::take(&mut cur));
        }
        cur.push(i);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

struct Planned<'a> {
    seq: &'a Sequence<'a>,
    anchors: Vec<u32>,
    labels: BlockLabels,
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
        timer: &mut PhaseTimer,
    ) -> Result<StepReport> {
        let bs = drafter.block_size();
        let mut planned = vec![];
        for seq in group {
            let anchors = sample_anchors(seq.loss_mask, self.anchors_per_sequence, rng);
            if anchors.is_empty() {
                continue;
            }
            let labels = block_labels(seq.tokens, seq.loss_mask, &anchors, bs, self.gamma);
            planned.push(Planned {
                seq,
                anchors,
                labels,
            });
        }
        let total_weight: f32 = planned
            .iter()
            .map(|p| p.labels.weights.iter().sum::<f32>())
            .sum();
        if planned.is_empty() || total_weight <= 0.0 {
            return Err(crate::TrainError::InvalidInput(
                "no sequence of the step has a supervised anchor".into(),
            ));
        }
        let params = opt.param_tensors();
        let mut grads: Option<GradStore> = None;
        let mut report = StepReport::default();
        let mut stats = BlockStats::default();
        let mut loss = 0f64;
        let lengths: Vec<usize> = planned.iter().map(|p| p.seq.tokens.len()).collect();
        for mb in micro_batches(&lengths, self.micro_batch_tokens) {
            let b = mb.len();
            let s = lengths[mb[0]];
            let n = mb
                .iter()
                .map(|&i| planned[i].anchors.len())
                .max()
                .unwrap_or(1);
            let mut tokens = vec![0u32; b * s];
            let mut anchors = Vec::with_capacity(b * n);
            let mut labels = BlockLabels {
                labels: vec![0; b * n * bs],
                weights: vec![0.0; b * n * bs],
            };
            for (r, &i) in mb.iter().enumerate() {
                let p = &planned[i];
                tokens[r * s..r * s + p.seq.tokens.len()].copy_from_slice(p.seq.tokens);
                let k = p.anchors.len();
                anchors.extend_from_slice(&p.anchors);
                anchors.extend(std::iter::repeat_n(p.anchors[0], n - k));
                let at = r * n * bs;
                labels.labels[at..at + k * bs].copy_from_slice(&p.labels.labels);
                labels.weights[at..at + k * bs].copy_from_slice(&p.labels.weights);
                report.blocks += k;
                report.tokens += p.seq.tokens.len();
            }
            timer.mark("plan")?;
            let (taps, probs) = batch_target_forward(
                target,
                b,
                &tokens,
                drafter.target_layers(),
                self.distill > 0.0,
            )?;
            timer.mark("target_taps")?;
            let hidden = drafter.forward_train_batch_with(
                target,
                &taps,
                &tokens,
                &anchors,
                Grad::On,
                &self.convention,
            )?;
            timer.mark("drafter_forward")?;
            let lm_head = |x: &Tensor| Ok(target.lm_head(x)?);
            let input_grad = |g: &Tensor| Ok(target.lm_head_input_grad(g)?);
            let head = LmHead {
                forward: &lm_head,
                input_grad: &input_grad,
            };
            // soft-label rows only when distilling (the positions are per micro-batch host work)
            let position = match probs {
                Some(_) => soft_label_positions(s, n, bs, &anchors),
                None => vec![],
            };
            let soft = probs.as_ref().map(|p| SoftLabels {
                probs: p,
                position: &position,
                alpha: self.distill,
            });
            let (surrogate, part, pred) = chunked_block_loss(
                &head,
                &hidden,
                &labels,
                total_weight,
                MAX_LOGITS,
                soft.as_ref(),
            )?;
            timer.mark("lm_head_loss")?;
            if let Some(sur) = surrogate {
                let g = sur.backward()?;
                timer.mark("drafter_backward")?;
                add_grads(&mut grads, g, &params)?;
                timer.mark("grad_accumulate")?;
            }
            loss += part;
            stats.add(&BlockStats::of(&pred, &labels, bs));
        }
        report.loss = stats.report(loss as f32);
        let lr = self.schedule.at(opt.step);
        let grads = grads.ok_or_else(|| {
            crate::TrainError::InvalidInput("no gradient reached the drafter".into())
        })?;
        report.grad_norm = opt.step(&grads, lr)?;
        timer.mark("optimizer")?;
        report.phases = timer.phases().to_vec();
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::micro_batches;

    #[test]
    fn micro_batches_sort_longest_first_and_respect_the_cap() {
        let got = micro_batches(&[5, 9, 3, 9, 4], 20);
        assert_eq!(got, vec![vec![1, 3], vec![0, 4, 2]]);
        // one sequence longer than the cap still gets its own micro-batch
        assert_eq!(micro_batches(&[30, 2], 20), vec![vec![0], vec![1]]);
    }
}
