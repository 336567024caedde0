//! The decay-weighted block cross-entropy and per-position accuracy.
//!
//! Invariants: row k of block b is labelled with `tokens[a_b + k]` (same position: the drafter
//! predicts the token *at* each block slot); weight `w_k = exp(−(k−1)/γ)` for k ≥ 1, 0 for k = 0,
//! 0 past the sequence end or where `loss_mask` is off; loss = Σ w·CE / Σ w; the log-softmax is
//! candle's differentiable composite. With soft labels (self-distillation) a row's CE mixes the
//! label with the target's own distribution for that token; α = 0 is exactly the plain loss.

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
    let stats = BlockStats::of(&pred, l, bs);
    let report = stats.report(loss.to_device(&Device::Cpu)?.to_scalar::<f32>()?);
    Ok((loss, report))
}

/// Argmax hits per block row and leading runs, summable over micro-batches.
#[derive(Debug, Clone, Default)]
pub struct BlockStats {
    /// `[B]` weighted rows and hits per block row (row 0 unused).
    pub count: Vec<f64>,
    pub correct: Vec<f64>,
    /// Sum of leading runs over blocks with at least one weighted row, and how many such blocks.
    pub run_sum: f64,
    pub blocks: f64,
}

impl BlockStats {
    /// `pred` `[nb·B]` argmax ids (any value where the weight is 0).
    pub fn of(pred: &[u32], l: &BlockLabels, bs: usize) -> Self {
        let mut st = BlockStats {
            count: vec![0.0; bs],
            correct: vec![0.0; bs],
            ..Default::default()
        };
        for b in 0..pred.len() / bs {
            let (mut run, mut running, mut any) = (0, true, false);
            for k in 1..bs {
                let i = b * bs + k;
                if l.weights[i] == 0.0 {
                    running = false;
                    continue;
                }
                any = true;
                st.count[k] += 1.0;
                let ok = pred[i] == l.labels[i];
                if ok {
                    st.correct[k] += 1.0;
                }
                if running && ok {
                    run += 1;
                } else {
                    running = false;
                }
            }
            if any {
                st.run_sum += run as f64;
                st.blocks += 1.0;
            }
        }
        st
    }

    pub fn add(&mut self, o: &BlockStats) {
        if self.count.is_empty() {
            *self = o.clone();
            return;
        }
        for k in 0..self.count.len() {
            self.count[k] += o.count[k];
            self.correct[k] += o.correct[k];
        }
        self.run_sum += o.run_sum;
        self.blocks += o.blocks;
    }

    pub fn report(&self, loss: f32) -> LossReport {
        LossReport {
            loss,
            accuracy: (1..self.count.len())
                .map(|k| {
                    if self.count[k] > 0.0 {
                        (self.correct[k] / self.count[k]) as f32
                    } else {
                        0.0
                    }
                })
                .collect(),
            streak: 1.0
                + if self.blocks > 0.0 {
                    (self.run_sum / self.blocks) as f32
                } else {
                    0.0
                },
        }
    }
}

/// The target's own next-token distribution as a soft label (self-distillation): `probs`
/// `[P, V]` f32 are the target's probabilities at P sequence positions (detached), `position[i]`
/// the row of `probs` whose prediction block row `i` learns (for the token at `anchor + k` that is
/// the target's output at `anchor + k − 1`), and `alpha` the soft term's share: each row's loss is
/// `(1 − α)·CE(label) + α·H(p_target, q)`.
pub struct SoftLabels<'a> {
    pub probs: &'a Tensor,
    pub position: &'a [u32],
    pub alpha: f64,
}

/// The loss of hidden rows through the target's LM head, computed in row chunks so the f32 logits
/// never exceed `max_logits` elements. `hidden` `[nb·B, H]` (graph attached), `labels` its layout,
/// `norm` the divisor of the weighted sum (the whole step's label weight). Returns
/// `(surrogate, loss, pred)`: `surrogate.backward()` gives exactly the gradients of
/// `Σ w·CE / norm` (the LM head's input gradient is computed chunk by chunk, then pushed through the
/// drafter once); `pred` holds argmax ids (`u32::MAX` on unweighted rows).
/// The LM head as the loss sees it: the forward, and the frozen head's input gradient from a
/// logits gradient (`TargetModel::lm_head_input_grad`).
pub struct LmHead<'a> {
    pub forward: &'a dyn Fn(&Tensor) -> Result<Tensor>,
    pub input_grad: &'a dyn Fn(&Tensor) -> Result<Tensor>,
}

/// Where the fused loss is on (`dflash_core::cross_entropy::enabled`) the plain loss takes the
/// fused cross-entropy kernel and the head's explicit input gradient (no graph through the logits:
/// one GEMM each way, no weight gradient).
pub fn chunked_block_loss(
    head: &LmHead,
    hidden: &Tensor,
    labels: &BlockLabels,
    norm: f32,
    max_logits: usize,
    soft: Option<&SoftLabels>,
) -> Result<(Option<Tensor>, f64, Vec<u32>)> {
    let fused = soft.is_none() && dflash_core::cross_entropy::enabled();
    chunked_loss_with(fused, head, hidden, labels, norm, max_logits, soft)
}

/// [`chunked_block_loss`] with the loss path chosen by the caller (`fused` needs `soft = None`).
fn chunked_loss_with(
    fused: bool,
    head: &LmHead,
    hidden: &Tensor,
    labels: &BlockLabels,
    norm: f32,
    max_logits: usize,
    soft: Option<&SoftLabels>,
) -> Result<(Option<Tensor>, f64, Vec<u32>)> {
    let lm_head = head.forward;
    let rows = hidden.dim(0)?;
    if let Some(sl) = soft {
        if sl.position.len() != rows || !(0.0..=1.0).contains(&sl.alpha) {
            return Err(TrainError::InvalidInput(format!(
                "soft labels: {} positions for {rows} rows, alpha {}",
                sl.position.len(),
                sl.alpha
            )));
        }
    }
    if labels.labels.len() != rows {
        return Err(TrainError::InvalidInput(format!(
            "{} labels for {rows} rows",
            labels.labels.len()
        )));
    }
    let dev = hidden.device();
    let mut pred = vec![u32::MAX; rows];
    let picked: Vec<u32> = (0..rows as u32)
        .filter(|&i| labels.weights[i as usize] > 0.0)
        .collect();
    if picked.is_empty() {
        return Ok((None, 0.0, pred));
    }
    let idx = Tensor::from_slice(&picked, picked.len(), dev)?;
    let sel = hidden.index_select(&idx, 0)?;
    let leaf = candle_core::Var::from_tensor(&sel.detach())?;
    let probe = lm_head(&leaf.as_tensor().narrow(0, 0, 1)?)?;
    let vocab = probe.dim(1)?;
    let chunk = (max_logits / vocab).max(1);
    // each chunk's rows of the head-input gradient, in order
    let mut grads: Vec<Tensor> = vec![];
    // the loss and the argmax stay on the device until every chunk is queued: one read-back
    let mut loss: Option<Tensor> = None;
    let mut argmax: Vec<Tensor> = vec![];
    for (c, rows_c) in picked.chunks(chunk).enumerate() {
        let x = leaf.as_tensor().narrow(0, c * chunk, rows_c.len())?;
        let logits = lm_head(&x)?.to_dtype(DType::F32)?;
        let lab: Vec<u32> = rows_c.iter().map(|&i| labels.labels[i as usize]).collect();
        let (part, am, g) = if fused && soft.is_none() {
            // one fused pass: Σ w·CE / norm, its logits gradient and the argmax; then the
            // frozen head's transpose
            let w: Vec<f32> = rows_c
                .iter()
                .map(|&i| labels.weights[i as usize] / norm.max(1e-6))
                .collect();
            let (out, dlogits) =
                dflash_core::cross_entropy::weighted_cross_entropy_and_grad(&logits, &lab, &w)?;
            let am = out.narrow(1, 2, 1)?.squeeze(1)?.to_dtype(DType::U32)?;
            let g = (head.input_grad)(&dlogits)?;
            (out.narrow(1, 0, 1)?.sum_all()?, am, g)
        } else {
            let (part, am) = composite_chunk_loss(&logits, lab, rows_c, labels, norm, soft)?;
            let g = part.backward()?;
            let g = g.get(leaf.as_tensor()).cloned().ok_or_else(|| {
                TrainError::InvalidInput("no gradient reaches the LM head input".into())
            })?;
            // the leaf's gradient is zero outside this chunk
            (part, am, g.narrow(0, c * chunk, rows_c.len())?)
        };
        let part_value = part.detach();
        loss = Some(match loss {
            Some(acc) => (acc + part_value)?,
            None => part_value,
        });
        argmax.push(am);
        grads.push(g.to_dtype(DType::F32)?);
    }
    let am: Vec<u32> = Tensor::cat(&argmax, 0)?
        .to_device(&Device::Cpu)?
        .to_vec1()?;
    for (&i, p) in picked.iter().zip(am) {
        pred[i as usize] = p;
    }
    let loss = match loss {
        Some(l) => l.to_device(&Device::Cpu)?.to_scalar::<f32>()? as f64,
        None => 0.0,
    };
    let grad = Tensor::cat(&grads, 0)?.detach();
    let surrogate = (sel * grad.to_dtype(hidden.dtype())?)?.sum_all()?;
    Ok((Some(surrogate), loss, pred))
}

/// One chunk's `Σ w·CE / norm` (graph attached) and argmax with candle's composites (the only
/// path for soft labels).
fn composite_chunk_loss(
    logits: &Tensor,
    lab: Vec<u32>,
    rows_c: &[u32],
    labels: &BlockLabels,
    norm: f32,
    soft: Option<&SoftLabels>,
) -> Result<(Tensor, Tensor)> {
    let dev = logits.device();
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let lse = (logits
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + max)?
        .squeeze(1)?;
    let w: Vec<f32> = rows_c.iter().map(|&i| labels.weights[i as usize]).collect();
    let lab = Tensor::from_vec(lab, (rows_c.len(), 1), dev)?;
    let mut target_logit = logits.gather(&lab, 1)?.squeeze(1)?;
    if let Some(sl) = soft {
        // H(p, q) = lse − Σ p·logits (Σ p = 1): mix the label's logit with p's expectation
        let pos: Vec<u32> = rows_c.iter().map(|&i| sl.position[i as usize]).collect();
        let pos = Tensor::from_vec(pos, rows_c.len(), dev)?;
        let p = sl.probs.index_select(&pos, 0)?;
        let expected = (p * logits)?.sum(D::Minus1)?;
        target_logit = ((target_logit * (1.0 - sl.alpha))? + (expected * sl.alpha)?)?;
    }
    let w = Tensor::from_vec(w, rows_c.len(), dev)?;
    let part = (((lse - target_logit)? * w)?.sum_all()? / norm.max(1e-6) as f64)?;
    Ok((part, logits.argmax(D::Minus1)?))
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

    /// Soft labels: the chunked loss equals `Σ w·[(1−α)·CE(label) + α·H(p, q)] / Σ w` computed on
    /// whole tensors (value and gradient), and α = 1 with one-hot targets is the plain loss.
    #[test]
    fn soft_labels_mix_the_label_with_the_target_distribution() {
        let dev = Device::Cpu;
        let (nb, bs, h, v, npos) = (3usize, 4usize, 5usize, 7usize, 6usize);
        let (hidden, head) = hidden_and_head(nb * bs, h, v);
        let lm_head = |x: &Tensor| Ok(x.matmul(&head.t()?)?);
        let input_grad = |g: &Tensor| Ok(g.matmul(&head)?);
        let lm = LmHead {
            forward: &lm_head,
            input_grad: &input_grad,
        };
        let tokens: Vec<u32> = (0..12).map(|i| (i * 3 + 1) % v as u32).collect();
        let mask = [true; 12];
        let l = block_labels(&tokens, &mask, &[0, 4, 7], bs, 2.0);
        let raw: Vec<f32> = (0..npos * v)
            .map(|i| ((i * 31) % 11) as f32 + 0.5)
            .collect();
        let raw = Tensor::from_vec(raw, (npos, v), &dev).unwrap();
        let probs = raw.broadcast_div(&raw.sum_keepdim(1).unwrap()).unwrap();
        let position: Vec<u32> = (0..nb * bs).map(|i| (i * 5 % npos) as u32).collect();
        let total: f32 = l.weights.iter().sum();
        let alpha = 0.3;
        let soft = SoftLabels {
            probs: &probs,
            position: &position,
            alpha,
        };
        let (sur, loss, _) =
            chunked_block_loss(&lm, hidden.as_tensor(), &l, total, 2 * v, Some(&soft)).unwrap();
        let g_chunk = sur.unwrap().backward().unwrap();
        // the same on whole tensors
        let logp =
            candle_nn::ops::log_softmax(&lm_head(hidden.as_tensor()).unwrap(), D::Minus1).unwrap();
        let pos = Tensor::from_slice(&position, position.len(), &dev).unwrap();
        let p = probs.index_select(&pos, 0).unwrap();
        let soft_ce = (p * &logp).unwrap().sum(1).unwrap().neg().unwrap();
        let lab = Tensor::from_slice(&l.labels, (nb * bs, 1), &dev).unwrap();
        let hard_ce = logp
            .gather(&lab, 1)
            .unwrap()
            .squeeze(1)
            .unwrap()
            .neg()
            .unwrap();
        let row = ((hard_ce * (1.0 - alpha)).unwrap() + (soft_ce * alpha).unwrap()).unwrap();
        let w = Tensor::from_slice(&l.weights, nb * bs, &dev).unwrap();
        let whole = ((row * w).unwrap().sum_all().unwrap() / total as f64).unwrap();
        let g_whole = whole.backward().unwrap();
        let want = whole.to_scalar::<f32>().unwrap();
        assert!((loss as f32 - want).abs() < 1e-5, "{loss} vs {want}");
        assert_same_gradient(&g_whole, &g_chunk, hidden.as_tensor());
        // α = 1 with the labels as one-hot targets is the plain loss
        let labels = &l.labels;
        let onehot: Vec<f32> = (0..nb * bs)
            .flat_map(|i| (0..v).map(move |j| (j as u32 == labels[i]) as u8 as f32))
            .collect();
        let onehot = Tensor::from_vec(onehot, (nb * bs, v), &dev).unwrap();
        let own: Vec<u32> = (0..(nb * bs) as u32).collect();
        let one = SoftLabels {
            probs: &onehot,
            position: &own,
            alpha: 1.0,
        };
        let (_, soft_loss, _) =
            chunked_block_loss(&lm, hidden.as_tensor(), &l, total, 2 * v, Some(&one)).unwrap();
        let (_, hard_loss, _) =
            chunked_block_loss(&lm, hidden.as_tensor(), &l, total, 2 * v, None).unwrap();
        assert!(
            (soft_loss - hard_loss).abs() < 1e-5,
            "{soft_loss} vs {hard_loss}"
        );
        // a position list of the wrong length is refused
        let bad = SoftLabels {
            probs: &probs,
            position: &position[1..],
            alpha,
        };
        assert!(chunked_block_loss(&lm, hidden.as_tensor(), &l, total, 2 * v, Some(&bad)).is_err());
    }

    /// Deterministic drafter rows `[rows, h]` (a variable) and an LM head `[v, h]`.
    fn hidden_and_head(rows: usize, h: usize, v: usize) -> (candle_core::Var, Tensor) {
        let dev = Device::Cpu;
        let hv: Vec<f32> = (0..rows * h)
            .map(|i| ((i * 7919) % 23) as f32 / 7.0 - 1.5)
            .collect();
        let wv: Vec<f32> = (0..v * h)
            .map(|i| ((i * 104729) % 19) as f32 / 9.0 - 1.0)
            .collect();
        let hidden =
            candle_core::Var::from_tensor(&Tensor::from_vec(hv, (rows, h), &dev).unwrap()).unwrap();
        (hidden, Tensor::from_vec(wv, (v, h), &dev).unwrap())
    }

    /// Both gradient stores hold the same, non-vanishing gradient for `x`.
    fn assert_same_gradient(
        a: &candle_core::backprop::GradStore,
        b: &candle_core::backprop::GradStore,
        x: &Tensor,
    ) {
        let (a, b) = (a.get(x).unwrap(), b.get(x).unwrap());
        let (err, scale) = (max_diff(a, b), max_diff(a, &a.zeros_like().unwrap()));
        assert!(
            scale > 1e-3 && err < 1e-5,
            "gradient err {err} (scale {scale})"
        );
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    #[test]
    fn chunked_loss_matches_the_whole_loss_and_its_gradients() {
        let (nb, bs, h, v) = (3usize, 4usize, 5usize, 7usize);
        let (hidden, head) = hidden_and_head(nb * bs, h, v);
        let lm_head = |x: &Tensor| Ok(x.matmul(&head.t()?)?);
        let input_grad = |g: &Tensor| Ok(g.matmul(&head)?);
        let lm = LmHead {
            forward: &lm_head,
            input_grad: &input_grad,
        };
        let tokens: Vec<u32> = (0..12).map(|i| (i * 3 + 1) % v as u32).collect();
        let mask = [
            false, true, true, true, true, true, true, true, true, false, true, true,
        ];
        let l = block_labels(&tokens, &mask, &[0, 4, 9], bs, 2.0);
        let logits = lm_head(hidden.as_tensor())
            .unwrap()
            .reshape((nb, bs, v))
            .unwrap();
        let (whole, report) = block_loss(&logits, &l).unwrap();
        let g_whole = whole.backward().unwrap();
        let total: f32 = l.weights.iter().sum();
        // 2 rows per chunk: several chunks, one partial
        let (sur, loss, pred) =
            chunked_block_loss(&lm, hidden.as_tensor(), &l, total, 2 * v, None).unwrap();
        let g_chunk = sur.unwrap().backward().unwrap();
        assert!((loss as f32 - whole.to_scalar::<f32>().unwrap()).abs() < 1e-5);
        let stats = BlockStats::of(&pred, &l, bs).report(loss as f32);
        assert_eq!(stats.accuracy, report.accuracy);
        assert_eq!(stats.streak, report.streak);
        assert_same_gradient(&g_whole, &g_chunk, hidden.as_tensor());
        // the fused cross-entropy kernel gives the same loss, gradient and argmax
        let (sur_f, loss_f, pred_f) =
            chunked_loss_with(true, &lm, hidden.as_tensor(), &l, total, 2 * v, None).unwrap();
        let g_fused = sur_f.unwrap().backward().unwrap();
        assert!(
            (loss_f - loss).abs() < 1e-5,
            "fused loss {loss_f} vs {loss}"
        );
        assert_eq!(pred_f, pred);
        assert_same_gradient(&g_chunk, &g_fused, hidden.as_tensor());
    }
}
