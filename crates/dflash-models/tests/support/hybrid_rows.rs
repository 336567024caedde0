//! The Qwen3.5 / Qwen3.6 hybrids' share of the CPU bit-exactness tests (issue 18 for issue 17's
//! targets; used by `bit_exact_cpu.rs` and `bit_exact_cpu_default.rs`): each row of a bf16 or f32
//! tree verify and of a causal verify equals, bit for bit, the one-token AR steps along its path.
//! Row-invariant projections (the Gated DeltaNet's stacked input projections and `out_proj`
//! included), LM head and attention; the recurrent layers follow each node's ancestors token by
//! token, so their sums never depend on the row count.

use super::common::{forward_logits, max_abs_diff, path_to};
use candle_core::{DType, Device};
use dflash_core::AttentionMask;
use dflash_models::random::random_hybrid;
use dflash_models::{LogitRows, TargetModel};
use rand::{Rng, SeedableRng};

/// A random tree of `n` nodes whose parents are recent (deep paths, past the conv window).
fn random_tree(rng: &mut impl Rng, n: usize) -> Vec<i64> {
    let mut p = vec![-1i64];
    for i in 1..n {
        p.push(rng.random_range(i.saturating_sub(4)..i) as i64);
    }
    p
}

/// Every checked row of hybrid verifies (trees of 17/65/257 nodes, a 16-row chain, at two
/// context lengths) equals the one-token AR steps along its path, bit for bit, under the policy
/// the process runs (the caller sets it).
pub fn check_hybrid_verify_rows_equal_ar_steps(dtype: DType) {
    // both layer kinds, an output gate, two value heads per key head, partial rotary
    let cfg = super::common::tiny_hybrid(16);
    let m = random_hybrid(&cfg, dtype, &Device::Cpu, 21).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for past in [9usize, 150] {
        let prompt: Vec<u32> = (0..past).map(|_| rng.random_range(0..211)).collect();
        // a cache holding the prompt (a recurrent state cannot return past its last forward, so
        // each AR path starts from a cache of its own)
        let prefilled = || {
            let mut cache = m.new_cache(700).unwrap();
            let pos: Vec<u32> = (0..past as u32).collect();
            forward_logits(
                &m,
                &mut cache,
                &prompt,
                &pos,
                AttentionMask::Causal,
                LogitRows::None,
            );
            cache
        };
        let mut cases: Vec<(&str, Vec<i64>)> = [17usize, 65, 257]
            .iter()
            .map(|&n| ("tree", random_tree(&mut rng, n)))
            .collect();
        cases.push(("chain", (0..16i64).map(|i| i - 1).collect()));
        for (what, parents) in cases {
            let n = parents.len();
            let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..211)).collect();
            let positions: Vec<u32> = (0..n)
                .map(|r| (past + path_to(&parents, r).len() - 1) as u32)
                .collect();
            let mask = if what == "chain" {
                AttentionMask::Causal
            } else {
                AttentionMask::Tree {
                    parents: parents.clone(),
                }
            };
            let verify = forward_logits(
                &m,
                &mut prefilled(),
                &tokens,
                &positions,
                mask,
                LogitRows::All,
            )
            .expect("logits asked for");
            let deepest = (0..n).max_by_key(|&r| path_to(&parents, r).len()).unwrap();
            for r in [0, 1, n / 2, deepest, n - 1] {
                let path = path_to(&parents, r);
                let mut cache = prefilled();
                let mut last = None;
                for (t, &node) in path.iter().enumerate() {
                    last = forward_logits(
                        &m,
                        &mut cache,
                        &[tokens[node]],
                        &[(past + t) as u32],
                        AttentionMask::Causal,
                        LogitRows::Last,
                    );
                }
                let err = max_abs_diff(&verify.narrow(0, r, 1).unwrap(), &last.unwrap());
                assert_eq!(
                    err,
                    0.0,
                    "{dtype:?} {what} of {n} at past {past}: row {r} (depth {}) differs from AR",
                    path.len() - 1
                );
            }
        }
    }
}
