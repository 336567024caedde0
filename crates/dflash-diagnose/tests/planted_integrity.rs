//! Target integrity against planted faults of a target's multi-token (verify-shaped) forward, on
//! the tiny Llama fixture in f32: a verify whose positions are one off (cache / position
//! corruption) and one whose logits carry a draft's noise (drafts leaking into the target) are each
//! a FAIL naming that cause; the same target unaltered is ok — so the FAILs come from the plants.

use candle_core::{DType, Device, Tensor};
use dflash_core::SequenceCache;
use dflash_diagnose::{integrity, Sample, Verdict};
use dflash_models::{load_target, ForwardOutput, ForwardRequest, Result, TargetInfo, TargetModel};

/// What a planted target does to its forwards of more than one token.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    None,
    /// Every position of a multi-token forward one higher.
    PositionsOffByOne,
    /// A multi-token forward's logits perturbed by a small deterministic "draft" signal.
    LeakedNoise,
}

struct Planted {
    inner: Box<dyn TargetModel>,
    fault: Fault,
}

impl TargetModel for Planted {
    fn info(&self) -> &TargetInfo {
        self.inner.info()
    }
    fn new_cache(&self, capacity: usize) -> Result<SequenceCache> {
        self.inner.new_cache(capacity)
    }
    fn forward(&self, req: &ForwardRequest, cache: &mut SequenceCache) -> Result<ForwardOutput> {
        if req.tokens.len() < 2 || self.fault == Fault::None {
            return self.inner.forward(req, cache);
        }
        if self.fault == Fault::PositionsOffByOne {
            let shifted: Vec<u32> = req.positions.iter().map(|p| p + 1).collect();
            let r = ForwardRequest {
                positions: &shifted,
                ..req.clone()
            };
            return self.inner.forward(&r, cache);
        }
        let mut out = self.inner.forward(req, cache)?;
        if let Some(l) = out.logits.take() {
            let (rows, vocab) = l.dims2()?;
            let noise: Vec<f32> = (0..rows * vocab)
                .map(|i| 0.05 * ((i * 7919 % 101) as f32 / 50.0 - 1.0))
                .collect();
            let noise = Tensor::from_vec(noise, (rows, vocab), l.device())?;
            out.logits = Some((l + noise)?);
        }
        Ok(out)
    }
    fn embed(&self, tokens: &Tensor) -> Result<Tensor> {
        self.inner.embed(tokens)
    }
    fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        self.inner.lm_head(hidden)
    }
    fn lm_head_input_grad(&self, grad_logits: &Tensor) -> Result<Tensor> {
        self.inner.lm_head_input_grad(grad_logits)
    }
}

fn planted(fault: Fault) -> Planted {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama");
    let t = load_target(&dir, &Device::Cpu, DType::F32).unwrap();
    Planted {
        inner: t.model,
        fault,
    }
}

#[test]
fn planted_verify_faults_fail_target_integrity_and_the_unaltered_target_passes() {
    let samples: Vec<Sample> = (0..2)
        .map(|s| Sample {
            name: format!("sample {s}"),
            tokens: (0..40)
                .map(|i| ((i * 37 + 11 + 97 * s) % 263) as u32)
                .collect(),
            prompt_len: 12,
        })
        .collect();
    let honest =
        integrity::judge(&integrity::measure(&planted(Fault::None), &samples, 16).unwrap());
    assert_eq!(honest.verdict, Verdict::Ok, "{honest:?}");
    for fault in [Fault::PositionsOffByOne, Fault::LeakedNoise] {
        let m = integrity::measure(&planted(fault), &samples, 16).unwrap();
        let c = integrity::judge(&m);
        assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
        assert!(m.max_abs_diff > integrity::F32_MAX_DIFF, "{m:?}");
        assert!(
            c.cause.contains("position corruption") && c.cause.contains("leaking"),
            "{}",
            c.cause
        );
    }
}
