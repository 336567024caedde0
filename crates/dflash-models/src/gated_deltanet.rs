//! The Gated DeltaNet layer (`linear_attn` of the Qwen3.5 / Qwen3.6 hybrids; ecosystem.md §3):
//! projections, a causal depthwise short convolution with its state, the gated delta rule
//! (`dflash_core::gated_delta`) with its recurrent state, and the gated RMSNorm before `out_proj`.
//! Modules mirror the checkpoint names (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`,
//! `conv1d`, `dt_bias`, `A_log`, `norm`, `out_proj`).
//!
//! Invariants:
//! - A sequence's layer state is a [`RecurrentState`]: the last `K − 1` convolution inputs and the
//!   f32 delta-rule state. A forward over n tokens equals n one-token forwards from the same state
//!   (chunked rule for long causal blocks, the recurrence otherwise; tested).
//! - A forward takes a causal chain or a token tree (`parents`): every token's convolution window
//!   and rule state follow its own ancestors, so a tree verify gives each node what a chain along
//!   its path gives (tested). It hands a [`RecurrentRecord`] of its per-token inputs to the
//!   layer's [`RecurrentCache`], which replays exactly the kept tokens on crop / path compaction.
//! - The convolution (its window state included), gates and the rule run in f32 whatever the
//!   compute dtype; the output is cast back before `out_proj`.
//! - Checked against transformers through the whole model (fixtures/tiny-qwen3.5, the reference
//!   tests) and the rule alone (dflash-core's fixture).

use crate::projection::{project, Projections};
use crate::{ModelError, Result};
use candle_core::{DType, Tensor, D};
use candle_nn::{Linear, VarBuilder};
use dflash_core::gated_delta::{self, DeltaInputs};
use dflash_core::gated_delta_layer;
use dflash_core::{RecurrentCache, RecurrentRecord, RecurrentState};

/// Off the CPU and without the rule's CUDA kernel, causal blocks of at least this many tokens run
/// the chunked form of the rule (prefill); shorter ones (decode steps, verify blocks) and trees
/// run the recurrence token by token. On the CPU everything runs the recurrence: its host loop is
/// faster than the chunked form at every length (16 heads of 128×128, 256 tokens: 66 ms against
/// 320 ms); on CUDA with the kernel (`gated_delta::kernel_available`) everything is one launch.
pub const CHUNKED_FROM: usize = 32;

/// One forward of the layer: its output `[n, H]`, the per-token inputs a cache keeps for exact
/// rollback, and the state after the last token when the tokens were a chain.
pub struct DeltaForward {
    pub out: Tensor,
    pub record: RecurrentRecord,
    pub end: Option<RecurrentState>,
}

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

/// The input projections of `x` `[n, H]`: qkv `[n, C]`, z `[n, Hv·dv]`, b and a `[n, Hv]`, in
/// the compute dtype; contiguous, or column views of one stacked output (`views`, for the layer
/// kernels, which read rows at a stride).
struct Projected {
    qkv: Tensor,
    z: Tensor,
    b: Tensor,
    a: Tensor,
}

impl Projected {
    /// The layer's four input projections (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
    /// `in_proj_a`, in that order) of `x`.
    fn of(in_proj: &Projections, x: &Tensor, views: bool) -> Result<Self> {
        let parts = in_proj.forward(x)?;
        let own =
            |t: &Tensor| -> Result<Tensor> { Ok(if views { t.clone() } else { t.contiguous()? }) };
        match parts.as_slice() {
            [qkv, z, b, a] => Ok(Self {
                qkv: own(qkv)?,
                z: own(z)?,
                b: own(b)?,
                a: own(a)?,
            }),
            _ => Err(ModelError::InvalidInput(
                "Gated DeltaNet: four input projections".into(),
            )),
        }
    }
}

pub struct GatedDeltaNet {
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`: as the checkpoint lays them out,
    /// or — where the layer kernels run (CUDA) — stacked into one weight, one GEMM a forward.
    in_proj: Projections,
    /// `[C, K]` f32 (the checkpoint's `[C, 1, K]`).
    conv1d: Tensor,
    /// `[Hv]` f32.
    dt_bias: Tensor,
    /// `−exp(A_log)` `[Hv]` f32.
    neg_a: Tensor,
    /// The gated norm's weight `[dv]` (applied as is), in f32 (as every use reads it).
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
            .reshape((c, shape.conv_kernel))?
            .to_dtype(DType::F32)?;
        let (qkv, z, b, a) = (
            linear(&vb, h, c, "in_proj_qkv")?,
            linear(&vb, h, vdim, "in_proj_z")?,
            linear(&vb, h, hv, "in_proj_b")?,
            linear(&vb, h, hv, "in_proj_a")?,
        );
        // `DFLASH_GDN_IN_PROJ=separate` (a documented override for A/B runs) keeps four GEMMs
        let stacked = gated_delta_layer::layer_kernels_available(
            vb.device(),
            shape.key_dim,
            vb.dtype(),
            shape.conv_kernel,
        ) && std::env::var("DFLASH_GDN_IN_PROJ").as_deref() != Ok("separate");
        let in_proj = Projections::new(vec![qkv, z, b, a], stacked)?;
        Ok(Self {
            in_proj,
            conv1d,
            dt_bias: vb.get(hv, "dt_bias")?.to_dtype(DType::F32)?,
            neg_a: vb.get(hv, "A_log")?.to_dtype(DType::F32)?.exp()?.neg()?,
            norm: vb
                .get(shape.value_dim, "norm.weight")?
                .to_dtype(DType::F32)?,
            out_proj: linear(&vb, vdim, h, "out_proj")?,
            shape,
            eps,
        })
    }

    /// A fresh state (zeros, f32) on the layer's device.
    pub fn new_state(&self) -> Result<RecurrentState> {
        let s = &self.shape;
        let dev = self.conv1d.device();
        Ok(RecurrentState {
            conv: Tensor::zeros(
                (s.conv_kernel - 1, s.conv_channels()),
                self.conv1d.dtype(),
                dev,
            )?,
            ssm: Tensor::zeros((s.value_heads, s.key_dim, s.value_dim), DType::F32, dev)?,
        })
    }

    /// The layer over the causal block `x` `[n, H]` (one sequence) from `state`, which it
    /// advances by n tokens.
    pub fn forward(&self, x: &Tensor, state: &mut RecurrentState) -> Result<Tensor> {
        let f = self.forward_tree(x, state, None)?;
        *state = f.end.expect("a chain has an end state");
        Ok(f.out)
    }

    /// The layer over `x` from the state `cache` holds, committing the forward to it (so a later
    /// crop or path compaction restores exactly the kept tokens' state).
    pub fn forward_cached(
        &self,
        x: &Tensor,
        cache: &mut RecurrentCache,
        parents: Option<&[i64]>,
    ) -> Result<Tensor> {
        let state = match cache.state()? {
            Some(s) => s,
            None => self.new_state()?,
        };
        let f = self.forward_tree(x, &state, parents)?;
        cache.commit(f.record, f.end)?;
        Ok(f.out)
    }

    /// The layer over the tokens `x` `[n, H]` from `state`: a causal chain (`parents` `None`) or a
    /// token tree (`parents[i] < i`, `-1` for a child of `state`), where each token's convolution
    /// window and delta-rule state follow its own ancestors.
    pub fn forward_tree(
        &self,
        x: &Tensor,
        state: &RecurrentState,
        parents: Option<&[i64]>,
    ) -> Result<DeltaForward> {
        let s = self.shape;
        let (n, _) = x.dims2()?;
        let (hk, hv, dk, dv, k) = (
            s.key_heads,
            s.value_heads,
            s.key_dim,
            s.value_dim,
            s.conv_kernel,
        );
        let chain: Vec<i64>;
        let parents = match parents {
            Some(p) => p,
            None => {
                chain = (0..n as i64).map(|i| i - 1).collect();
                &chain
            }
        };
        if parents.len() != n {
            return Err(ModelError::InvalidInput(format!(
                "Gated DeltaNet: {} parents for {n} tokens",
                parents.len()
            )));
        }
        gated_delta::tree_depths(parents)?;
        let is_chain = parents.iter().enumerate().all(|(i, &p)| p == i as i64 - 1);
        if gated_delta_layer::layer_kernels_available(x.device(), dk, x.dtype(), k) {
            return self.forward_tree_kernels(x, state, parents, is_chain);
        }
        let proj = Projected::of(&self.in_proj, x, false)?;
        // causal depthwise convolution over [state ; qkv] along each token's ancestors, then SiLU
        let qkv = proj.qkv.to_dtype(DType::F32)?; // [n, C]
        let padded = Tensor::cat(&[&state.conv, &qkv], 0)?; // [K − 1 + n, C] f32
        let conv = if is_chain {
            let mut conv = padded
                .narrow(0, 0, n)?
                .broadcast_mul(&self.conv1d.narrow(1, 0, 1)?.t()?)?;
            for j in 1..k {
                let w = self.conv1d.narrow(1, j, 1)?.t()?; // [1, C]
                conv = (conv + padded.narrow(0, j, n)?.broadcast_mul(&w)?)?;
            }
            conv
        } else {
            // window row j of token i (oldest first): an ancestor's input, else the state's
            let mut idx = vec![0u32; n * k];
            for i in 0..n {
                let mut node = i as i64;
                let mut back = 0usize; // state rows used so far
                for j in (0..k).rev() {
                    idx[i * k + j] = if node >= 0 {
                        let r = (k - 1 + node as usize) as u32;
                        node = parents[node as usize];
                        r
                    } else {
                        back += 1;
                        (k - 1 - back) as u32
                    };
                }
            }
            let idx = Tensor::from_slice(&idx, n * k, x.device())?;
            let win = padded.index_select(&idx, 0)?.reshape((n, k, ()))?;
            let mut conv = win
                .narrow(1, 0, 1)?
                .squeeze(1)?
                .broadcast_mul(&self.conv1d.narrow(1, 0, 1)?.t()?)?;
            for j in 1..k {
                let w = self.conv1d.narrow(1, j, 1)?.t()?;
                conv = (conv + win.narrow(1, j, 1)?.squeeze(1)?.broadcast_mul(&w)?)?;
            }
            conv
        };
        let u = candle_nn::ops::silu(&conv)?.to_dtype(DType::F32)?;
        let q = u.narrow(1, 0, hk * dk)?.reshape((n, hk, dk))?;
        let kk = u.narrow(1, hk * dk, hk * dk)?.reshape((n, hk, dk))?;
        let v = u
            .narrow(1, 2 * hk * dk, hv * dv)?
            .reshape((n, hv, dv))?
            .contiguous()?;
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
        let beta = candle_nn::ops::sigmoid(&proj.b.to_dtype(DType::F32)?)?;
        let a = proj.a.to_dtype(DType::F32)?.broadcast_add(&self.dt_bias)?;
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
        let chunk = is_chain
            && n >= CHUNKED_FROM
            && !x.device().is_cpu()
            && !gated_delta::kernel_available(x.device(), dk);
        let (o, last) = if chunk {
            gated_delta::chunked(&inputs, &state.ssm)?
        } else {
            gated_delta::tree_recurrent(&inputs, &state.ssm, parents)?
        };
        let end = if is_chain {
            Some(RecurrentState {
                conv: padded.narrow(0, n, k - 1)?.contiguous()?,
                ssm: last,
            })
        } else {
            None
        };
        let record = RecurrentRecord {
            start: state.clone(),
            conv_in: qkv,
            k: kk,
            v,
            g,
            beta,
            parents: parents.to_vec(),
        };
        // gated RMSNorm per value head (f32), weight applied as is, then SiLU(z)
        let ms = o.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = o.broadcast_mul(&(ms + self.eps)?.sqrt()?.recip()?)?;
        let normed = normed.broadcast_mul(&self.norm)?;
        let z = proj.z.to_dtype(DType::F32)?.reshape((n, hv, dv))?;
        let y = (normed * candle_nn::ops::silu(&z)?)?
            .reshape((n, hv * dv))?
            .to_dtype(x.dtype())?;
        Ok(DeltaForward {
            out: project(&self.out_proj, &y)?,
            record,
            end,
        })
    }
}

impl GatedDeltaNet {
    /// The head counts and dims the layer kernels take.
    fn layer_heads(&self) -> gated_delta_layer::LayerHeads {
        let s = self.shape;
        gated_delta_layer::LayerHeads {
            hk: s.key_heads,
            hv: s.value_heads,
            dk: s.key_dim,
            dv: s.value_dim,
        }
    }

    /// The layer's own weights the layer kernels read.
    fn layer_weights(&self) -> gated_delta_layer::LayerWeights<'_> {
        gated_delta_layer::LayerWeights {
            conv_w: &self.conv1d,
            dt_bias: &self.dt_bias,
            neg_a: &self.neg_a,
        }
    }

    /// The shapes of this layer's device-step buffers for steps of up to `rows` rows.
    pub fn step_shape(&self, rows: usize) -> dflash_core::recurrent_step::StepShape {
        let s = self.shape;
        dflash_core::recurrent_step::StepShape {
            heads: self.layer_heads(),
            channels: s.conv_channels(),
            conv_kernel: s.conv_kernel,
            rows,
        }
    }

    /// The layer in a hybrid device step (CUDA, layer kernels; launches only, so a CUDA graph
    /// captures it): `x` `[rows, H]`, the step's parents and kept flags already in
    /// `shared.tree`, the state in `bufs`' state buffers (left unchanged, unless the step folds
    /// the last verify's commit in: then first advanced over its pending rows, in place); the
    /// rule's inputs land in `bufs`' record rows `0..rows`, which the cache's commit replays. The
    /// same kernels, in the same order, as [`GatedDeltaNet::forward_tree`] on CUDA.
    pub fn forward_device(
        &self,
        x: &Tensor,
        bufs: &dflash_core::recurrent_step::RecurrentStepBuffers,
        shared: &dflash_core::recurrent_step::SharedStepBuffers,
    ) -> Result<Tensor> {
        let rows = x.dim(0)?;
        let shape = self.step_shape(shared.shape.rows);
        if shared.shape != shape || rows > shape.rows {
            return Err(ModelError::InvalidInput(format!(
                "Gated DeltaNet device step: buffers for {:?}, the layer needs {shape:?} ({rows} rows)",
                shared.shape
            )));
        }
        if !x.device().is_cuda() {
            return self.forward_device_emulated(x, bufs, shared);
        }
        let proj = Projected::of(&self.in_proj, x, true)?;
        gated_delta_layer::conv_and_rule_inputs_into(
            &proj.qkv,
            &bufs.conv,
            &proj.b,
            &proj.a,
            &shared.parents(rows)?,
            self.layer_weights(),
            shape.heads,
            &shared.u.narrow(0, 0, rows)?,
            &bufs.rule_inputs(shared, rows)?,
        )?;
        if shared.fold {
            // the last verify's commit first (0 rows when nothing is pending), then the step
            gated_delta_layer::rule_from_table_folding(
                &bufs.table,
                &bufs.fold_table,
                rows,
                shape.heads,
            )?;
        } else {
            gated_delta_layer::rule_from_table(&bufs.table, rows, shape.heads)?;
        }
        let o = shared.out.narrow(0, 0, rows)?;
        let y = gated_delta_layer::gated_norm(&o, &proj.z, &self.norm, self.eps)?;
        project(&self.out_proj, &y)
    }

    /// [`GatedDeltaNet::forward_device`] on the host (tests of the device step's bookkeeping on
    /// the CPU): the host forward from the state buffers along the step's parents, its record
    /// written into the buffers' rows as the kernels write it.
    fn forward_device_emulated(
        &self,
        x: &Tensor,
        bufs: &dflash_core::recurrent_step::RecurrentStepBuffers,
        shared: &dflash_core::recurrent_step::SharedStepBuffers,
    ) -> Result<Tensor> {
        let rows = x.dim(0)?;
        if shared.fold {
            // the folded commit: the pending rows the prologue copied aside, advanced into the
            // state buffer in place first (the host's advance, as the separate settle does)
            let n = shared.pending_count()?.to_vec1::<u32>()?[0] as usize;
            if n > 0 {
                let p = &bufs.pending;
                let head = |t: &Tensor| t.narrow(0, 0, n);
                let s = dflash_core::gated_delta::advance(
                    &head(&p.k)?,
                    &head(&p.v)?,
                    &head(&p.g)?,
                    &head(&p.beta)?,
                    &bufs.ssm,
                )?;
                bufs.ssm.slice_set(&s, 0, 0)?;
            }
        }
        let parents: Vec<i64> = shared
            .parents(rows)?
            .to_vec1::<u32>()?
            .iter()
            .map(|&p| p as i32 as i64)
            .collect();
        let state = RecurrentState {
            conv: bufs.conv.clone(),
            ssm: bufs.ssm.clone(),
        };
        let f = self.forward_tree(x, &state, Some(&parents))?;
        let r = &f.record;
        for (dst, src) in [
            (&bufs.conv_in, &r.conv_in),
            (&bufs.k, &r.k),
            (&bufs.v, &r.v),
            (&bufs.g, &r.g),
            (&bufs.beta, &r.beta),
        ] {
            dst.slice_set(&src.to_dtype(dst.dtype())?.contiguous()?, 0, 0)?;
        }
        Ok(f.out)
    }

    /// [`GatedDeltaNet::forward_tree`] on CUDA through the layer kernels
    /// (`dflash_core::gated_delta_layer`): the same map as kernels around the projections (the
    /// convolution with the rule's inputs, the rule, the gated norm), reading the stacked
    /// projection's blocks in place.
    fn forward_tree_kernels(
        &self,
        x: &Tensor,
        state: &RecurrentState,
        parents: &[i64],
        is_chain: bool,
    ) -> Result<DeltaForward> {
        let s = self.shape;
        let (n, _) = x.dims2()?;
        let (heads, weights) = (self.layer_heads(), self.layer_weights());
        let proj = Projected::of(&self.in_proj, x, true)?;
        let r = gated_delta_layer::conv_and_rule_inputs(
            &proj.qkv,
            &state.conv,
            &proj.b,
            &proj.a,
            parents,
            weights,
            heads,
        )?;
        let inputs = DeltaInputs {
            q: &r.q,
            k: &r.k,
            v: &r.v,
            g: &r.g,
            beta: &r.beta,
        };
        let (o, last) = gated_delta::tree_recurrent(&inputs, &state.ssm, parents)?;
        let end = if is_chain {
            let padded = Tensor::cat(&[&state.conv, &r.qkv], 0)?;
            Some(RecurrentState {
                conv: padded.narrow(0, n, s.conv_kernel - 1)?.contiguous()?,
                ssm: last,
            })
        } else {
            None
        };
        let y = gated_delta_layer::gated_norm(&o, &proj.z, &self.norm, self.eps)?;
        Ok(DeltaForward {
            out: project(&self.out_proj, &y)?,
            record: RecurrentRecord {
                start: state.clone(),
                conv_in: r.qkv,
                k: r.k,
                v: r.v,
                g: r.g,
                beta: r.beta,
                parents: parents.to_vec(),
            },
            end,
        })
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
        assert!(max_diff(&whole.ssm, &step.ssm) < 1e-4);
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
    fn a_cropped_verify_keeps_exactly_the_accepted_prefix() {
        let l = layer(SHAPE, 5);
        let x = Tensor::randn(0f32, 1.0, (30, SHAPE.hidden), &Device::Cpu).unwrap();
        let mut cache = RecurrentCache::new(64);
        l.forward_cached(&x.narrow(0, 0, 20).unwrap(), &mut cache, None)
            .unwrap();
        let st = cache.state().unwrap().unwrap();
        // verify a block of 10, accept 4 of them: the state must be that of 24 tokens
        l.forward_cached(&x.narrow(0, 20, 10).unwrap(), &mut cache, None)
            .unwrap();
        cache.crop(24);
        let kept = cache.state().unwrap().unwrap();
        let mut direct = st.clone();
        l.forward(&x.narrow(0, 20, 4).unwrap(), &mut direct)
            .unwrap();
        assert!(max_diff(&kept.ssm, &direct.ssm) < 1e-5);
        assert!(max_diff(&kept.conv, &direct.conv) < 1e-5); // the projection's rows round
                                                            // and continuing from the kept state gives what continuing from the direct one gives
        let ya = l
            .forward_cached(&x.narrow(0, 24, 6).unwrap(), &mut cache, None)
            .unwrap();
        let yb = l
            .forward(&x.narrow(0, 24, 6).unwrap(), &mut direct)
            .unwrap();
        assert!(max_diff(&ya, &yb) < 1e-5);
    }

    #[test]
    fn tree_tokens_follow_their_own_ancestors_and_a_kept_path_continues_like_a_chain() {
        let l = layer(SHAPE, 7);
        let x = Tensor::randn(0f32, 1.0, (12, SHAPE.hidden), &Device::Cpu).unwrap();
        let prompt = x.narrow(0, 0, 5).unwrap();
        let tree = x.narrow(0, 5, 7).unwrap();
        // deeper than the conv window, with branches at the root and below
        let parents = [-1i64, 0, 0, 1, 3, 4, 2];
        let mut cache = RecurrentCache::new(64);
        l.forward_cached(&prompt, &mut cache, None).unwrap();
        let s0 = cache.state().unwrap().unwrap();
        let y = l.forward_cached(&tree, &mut cache, Some(&parents)).unwrap();
        let path_of = |node: usize| {
            let mut p = vec![];
            let mut i = node as i64;
            while i >= 0 {
                p.push(i as u32);
                i = parents[i as usize];
            }
            p.reverse();
            p
        };
        for node in 0..parents.len() {
            let path = path_of(node);
            let idx = Tensor::from_slice(&path, path.len(), &Device::Cpu).unwrap();
            let mut s = s0.clone();
            let want = l
                .forward(&tree.index_select(&idx, 0).unwrap(), &mut s)
                .unwrap();
            let want = want.get(path.len() - 1).unwrap();
            let err = max_diff(&y.get(node).unwrap(), &want);
            assert!(err < 1e-5, "node {node}: {err}");
        }
        // keep root -> 1 -> 3 -> 4 -> 5, then one more token: as if the path had been fed alone
        cache.keep_rows(5, &[0, 1, 3, 4, 5]).unwrap();
        let next = x.narrow(0, 11, 1).unwrap();
        let got = l.forward_cached(&next, &mut cache, None).unwrap();
        let idx = Tensor::from_slice(&[0u32, 1, 3, 4, 5], 5, &Device::Cpu).unwrap();
        let mut s = s0.clone();
        l.forward(&tree.index_select(&idx, 0).unwrap(), &mut s)
            .unwrap();
        let want = l.forward(&next, &mut s).unwrap();
        assert!(max_diff(&got, &want) < 1e-5);
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
