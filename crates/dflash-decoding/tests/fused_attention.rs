//! With the fused attention (`DFLASH_FUSED_ATTENTION=1`): batched decoding with left padding gives
//! the same tokens as with the composite, and DFlash / DDTree decoding stay token-identical to AR
//! (the drafter's block attention and the target's causal attention both fused). Its own test
//! binary: the switch is an environment variable of the process; one test sets it.

mod support;
use dflash_decoding::{
    generate_ar, generate_ar_batch, generate_speculative, BatchConfig, DFlashRunner,
    GenerateConfig, SamplingConfig, SpecMode,
};
use support::*;

fn greedy(max_new: usize) -> GenerateConfig {
    GenerateConfig {
        cancel: None,
        max_new_tokens: max_new,
        stop_tokens: vec![],
        sampling: SamplingConfig::greedy(),
    }
}

#[test]
fn fused_attention_keeps_batched_and_speculative_decoding_exact() {
    let prompts: Vec<Vec<u32>> = [1usize, 9, 3, 17, 5]
        .iter()
        .map(|&n| {
            (0..n as u32)
                .map(|i| (i * 37 + n as u32 * 11) % 263)
                .collect()
        })
        .collect();
    for name in ["tiny-llama", "tiny-qwen3"] {
        let t = tiny(name);
        let target = t.model.as_ref();
        let cfg = BatchConfig {
            max_new_tokens: 9,
            stop_tokens: vec![],
            sampling: SamplingConfig::greedy(),
            prefill_chunk: 4,
        };
        dflash_core::flash_block::set_fused_attention(Some(false));
        let composite = generate_ar_batch(target, &prompts, &cfg, &|i| i as u64).unwrap();
        dflash_core::flash_block::set_fused_attention(Some(true));
        let before = dflash_core::flash_block::calls();
        let fused = generate_ar_batch(target, &prompts, &cfg, &|i| i as u64).unwrap();
        assert!(
            dflash_core::flash_block::calls() > before,
            "{name}: the fused path ran"
        );
        for (i, (c, f)) in composite.iter().zip(&fused).enumerate() {
            assert_eq!(c.tokens, f.tokens, "{name}: prompt {i} of the batch");
        }
        // speculative decoding under the fused kernels equals AR under them
        let drafter = random_drafter(&t, 2, 8, 3);
        for p in &prompts {
            let ar = generate_ar(target, p, &greedy(20), &mut |_| {}).unwrap();
            for mode in [SpecMode::DFlash, SpecMode::DdTree { budget: 12 }] {
                let mut runner = DFlashRunner::new(&drafter);
                let s =
                    generate_speculative(target, &mut runner, p, &greedy(20), mode, &mut |_| {})
                        .unwrap();
                assert_eq!(
                    s.tokens,
                    ar.tokens,
                    "{name}: {mode:?} on a prompt of {}",
                    p.len()
                );
            }
        }
    }
    dflash_core::flash_block::set_fused_attention(Some(false));
}
