//! Target integrity: the logits the verify path computes equal the AR path's for the same tokens.
//!
//! Invariants:
//! - Per sample, both paths prefill the prompt into a fresh cache; the verify path then feeds the
//!   whole answer as one causal block (every row's logits), the AR path one token at a time, and
//!   row `i` of the block is compared with the AR step that fed answer token `i` (both predict
//!   token `i + 1`), for the first `positions` answer tokens.
//! - [`judge`] in f32: FAIL unless every argmax agrees and the max |Δlogit| ≤ [`F32_MAX_DIFF`]
//!   (the two paths differ only in summation order). In bf16/f16 the logits round at ~1/128 of
//!   their magnitude and the paths accumulate differently, so: warn when argmax agreement is
//!   below 100 % (near-ties flip) or max |Δ| > [`HALF_WARN_DIFF`]; FAIL below
//!   [`HALF_FAIL_AGREEMENT`] agreement (no rounding explains that).

use crate::{Check, Result, Sample, Verdict};
use candle_core::{DType, Tensor, D};
use dflash_models::{ForwardRequest, LogitRows, TargetModel};
use serde::Serialize;

/// f32: the largest |verify − AR| logit difference that is rounding.
pub const F32_MAX_DIFF: f64 = 1e-3;
/// bf16/f16: above this |Δlogit| is a warn.
pub const HALF_WARN_DIFF: f64 = 1.0;
/// bf16/f16: argmax agreement below this is a FAIL.
pub const HALF_FAIL_AGREEMENT: f64 = 0.9;

#[derive(Debug, Clone, Serialize)]
pub struct Integrity {
    pub dtype: String,
    pub answers: usize,
    /// Answer positions compared (over every sample).
    pub positions: usize,
    pub max_abs_diff: f64,
    /// Share of compared positions whose argmax agrees.
    pub argmax_agreement: f64,
    /// Positions whose argmax differs.
    pub argmax_disagreements: usize,
}

/// Compares the two paths on the first `positions` answer tokens of each sample.
pub fn measure(
    target: &dyn TargetModel,
    samples: &[Sample],
    positions: usize,
) -> Result<Integrity> {
    let dtype = target.info().dtype;
    let mut out = Integrity {
        dtype: format!("{dtype:?}").to_lowercase(),
        answers: 0,
        positions: 0,
        max_abs_diff: 0.0,
        argmax_agreement: 1.0,
        argmax_disagreements: 0,
    };
    for s in samples {
        let prompt = &s.tokens[..s.prompt_len];
        let answer = &s.tokens[s.prompt_len..];
        let n = answer.len().min(positions);
        if n == 0 {
            continue;
        }
        let prefill = |cache: &mut dflash_core::SequenceCache| -> Result<()> {
            let pos: Vec<u32> = (0..prompt.len() as u32).collect();
            target.forward(
                &ForwardRequest::causal(prompt, &pos, LogitRows::None),
                cache,
            )?;
            Ok(())
        };
        // verify-shaped: the whole answer in one causal block
        let mut cache = target.new_cache(s.tokens.len())?;
        prefill(&mut cache)?;
        let pos: Vec<u32> = (s.prompt_len as u32..s.tokens.len() as u32).collect();
        let verify = target
            .forward(
                &ForwardRequest::causal(answer, &pos, LogitRows::All),
                &mut cache,
            )?
            .logits
            .ok_or_else(|| crate::DiagnoseError::InvalidInput("verify returned no logits".into()))?
            .narrow(0, 0, n)?;
        // AR: one token at a time
        let mut cache = target.new_cache(s.tokens.len())?;
        prefill(&mut cache)?;
        let mut rows = Vec::with_capacity(n);
        for (i, &t) in answer[..n].iter().enumerate() {
            let p = [(s.prompt_len + i) as u32];
            let o = target.forward(
                &ForwardRequest::causal(&[t], &p, LogitRows::Last),
                &mut cache,
            )?;
            rows.push(o.logits.ok_or_else(|| {
                crate::DiagnoseError::InvalidInput("AR step returned no logits".into())
            })?);
        }
        let ar = Tensor::cat(&rows, 0)?.to_dtype(DType::F32)?;
        let verify = verify.to_dtype(DType::F32)?;
        let diff = (&verify - &ar)?.abs()?.max_all()?.to_scalar::<f32>()? as f64;
        // a NaN anywhere is as bad as any difference
        let diff = if diff.is_nan() { f64::INFINITY } else { diff };
        out.max_abs_diff = out.max_abs_diff.max(diff);
        let va: Vec<u32> = verify.argmax(D::Minus1)?.to_vec1()?;
        let aa: Vec<u32> = ar.argmax(D::Minus1)?.to_vec1()?;
        out.argmax_disagreements += va.iter().zip(&aa).filter(|(x, y)| x != y).count();
        out.positions += n;
        out.answers += 1;
    }
    if out.positions > 0 {
        out.argmax_agreement = 1.0 - out.argmax_disagreements as f64 / out.positions as f64;
    }
    Ok(out)
}

/// The verdict (see the module's invariants).
pub fn judge(m: &Integrity) -> Check {
    const NAME: &str = "target_integrity";
    let evidence = format!(
        "verify vs AR logits over {} positions of {} answers ({}): max |diff| {:.2e}, argmax agreement {:.1} %",
        m.positions,
        m.answers,
        m.dtype,
        m.max_abs_diff,
        100.0 * m.argmax_agreement
    );
    if m.positions == 0 {
        return Check {
            check: NAME.into(),
            verdict: Verdict::Warn,
            evidence,
            cause: "no answer tokens to compare".into(),
            fix: "use prompts the target answers (raise --max-new-tokens)".into(),
        };
    }
    let cause = "the verify forward computes other logits than the AR step for the same tokens: \
                 drafts or noise leaking into the target, a wrong attention mask, or cache / \
                 position corruption";
    let fix = "decode with --mode ar to confirm, then check the target's multi-token forward \
               (mask, positions, cache append) against single-token steps";
    let verdict = if m.dtype == "f32" {
        if m.argmax_disagreements > 0 || m.max_abs_diff > F32_MAX_DIFF {
            Verdict::Fail
        } else {
            Verdict::Ok
        }
    } else if m.argmax_agreement < HALF_FAIL_AGREEMENT {
        Verdict::Fail
    } else if m.argmax_disagreements > 0 || m.max_abs_diff > HALF_WARN_DIFF {
        Verdict::Warn
    } else {
        Verdict::Ok
    };
    if verdict == Verdict::Ok {
        return Check::ok(NAME, evidence);
    }
    Check {
        check: NAME.into(),
        verdict,
        evidence,
        cause: if verdict == Verdict::Warn {
            format!(
                "{} rounding can flip near-ties; larger gaps point to: {cause}",
                m.dtype
            )
        } else {
            cause.into()
        },
        fix: if verdict == Verdict::Warn {
            format!("rerun with --dtype f32 to separate rounding from a bug; {fix}")
        } else {
            fix.into()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(dtype: &str, diff: f64, dis: usize) -> Integrity {
        Integrity {
            dtype: dtype.into(),
            answers: 2,
            positions: 64,
            max_abs_diff: diff,
            argmax_agreement: 1.0 - dis as f64 / 64.0,
            argmax_disagreements: dis,
        }
    }

    #[test]
    fn thresholds_depend_on_the_dtype() {
        assert_eq!(judge(&m("f32", 2e-5, 0)).verdict, Verdict::Ok);
        assert_eq!(judge(&m("f32", 2e-3, 0)).verdict, Verdict::Fail);
        assert_eq!(judge(&m("f32", 1e-5, 1)).verdict, Verdict::Fail);
        assert_eq!(judge(&m("f32", f64::INFINITY, 0)).verdict, Verdict::Fail);
        assert_eq!(judge(&m("bf16", 0.3, 0)).verdict, Verdict::Ok);
        assert_eq!(judge(&m("bf16", 0.3, 1)).verdict, Verdict::Warn);
        assert_eq!(judge(&m("bf16", 2.0, 0)).verdict, Verdict::Warn);
        assert_eq!(judge(&m("bf16", 2.0, 10)).verdict, Verdict::Fail);
        let none = Integrity {
            positions: 0,
            answers: 0,
            ..m("f32", 0.0, 0)
        };
        assert_eq!(judge(&none).verdict, Verdict::Warn);
    }
}
