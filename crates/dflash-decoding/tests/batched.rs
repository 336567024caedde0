//! Batched decoding (left padding, chunked prefill, sequences leaving the batch) equals decoding
//! each prompt alone, greedy and sampled, on every tiny architecture (the Qwen3.5 hybrid included:
//! its recurrent layers must ignore left padding).

mod support;
use dflash_decoding::{
    generate_ar, generate_ar_batch, BatchConfig, GenerateConfig, SamplingConfig,
};
use rand::{Rng, SeedableRng};
use support::*;

fn prompts(vocab: u32, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    // very different lengths so padding, chunk boundaries and early finishers all occur
    [1usize, 9, 3, 17, 5, 12, 2]
        .iter()
        .map(|&n| (0..n).map(|_| rng.random_range(0..vocab)).collect())
        .collect()
}

#[test]
fn batched_greedy_and_sampled_equal_one_prompt_at_a_time() {
    for name in ["tiny-llama", "tiny-llama31", "tiny-qwen3", "tiny-qwen3.5"] {
        let t = tiny(name);
        let target = t.model.as_ref();
        let vocab = t.config.vocab_size as u32;
        let ps = prompts(vocab, 3);
        // stop on a token that greedy decoding actually produces, so some rows end early
        let probe = generate_ar(
            target,
            &ps[1],
            &GenerateConfig {
                cancel: None,
                max_new_tokens: 6,
                stop_tokens: vec![],
                sampling: SamplingConfig::greedy(),
            },
            &mut |_| {},
        )
        .unwrap();
        let stop = vec![probe.tokens[3]];
        for sampling in [
            SamplingConfig::greedy(),
            SamplingConfig {
                temperature: 0.9,
                top_p: 0.95,
                top_k: 0,
                seed: 0,
            },
        ] {
            let cfg = BatchConfig {
                max_new_tokens: 11,
                stop_tokens: stop.clone(),
                sampling: sampling.clone(),
                prefill_chunk: 4,
            };
            let got = generate_ar_batch(target, &ps, &cfg, &|i| 100 + i as u64).unwrap();
            assert_eq!(got.len(), ps.len());
            let mut early = 0;
            for (i, (p, g)) in ps.iter().zip(&got).enumerate() {
                let mut s = sampling.clone();
                s.seed = 100 + i as u64;
                let want = generate_ar(
                    target,
                    p,
                    &GenerateConfig {
                        cancel: None,
                        max_new_tokens: 11,
                        stop_tokens: stop.clone(),
                        sampling: s,
                    },
                    &mut |_| {},
                )
                .unwrap();
                assert_eq!(g.tokens, want.tokens, "{name} prompt {i} ({sampling:?})");
                assert_eq!(g.stop_reason, want.stop_reason, "{name} prompt {i}");
                early += (g.tokens.len() < 11) as usize;
            }
            if sampling.is_greedy() {
                assert!(
                    early > 0,
                    "{name}: no sequence stopped early; the test lost its edge"
                );
            }
        }
    }
}
