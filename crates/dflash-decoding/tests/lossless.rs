//! Lossless decoding: every speculative mode reproduces autoregressive decoding — greedy tokens
//! exactly (f32), and in sampled mode the target's exact distribution (chi-square).

mod support;
use dflash_decoding::{
    generate_ar, generate_auto, generate_speculative, BlockDrafter, DFlashRunner, GenerateConfig,
    SamplingConfig, SpecMode,
};
use dflash_models::TargetModel;
use rand::{Rng, SeedableRng};
use support::*;

fn greedy(max_new: usize, stop: Vec<u32>) -> GenerateConfig {
    GenerateConfig {
        cancel: None,
        max_new_tokens: max_new,
        stop_tokens: stop,
        sampling: SamplingConfig::greedy(),
    }
}

fn check_modes(
    target: &dyn TargetModel,
    drafter: &mut dyn BlockDrafter,
    prompt: &[u32],
    cfg: &GenerateConfig,
    budget: usize,
    what: &str,
) -> (f64, f64) {
    let ar = generate_ar(target, prompt, cfg, &mut |_| {}).unwrap();
    let d =
        generate_speculative(target, drafter, prompt, cfg, SpecMode::DFlash, &mut |_| {}).unwrap();
    assert_eq!(d.tokens, ar.tokens, "{what}: dflash != ar");
    assert_eq!(d.stop_reason, ar.stop_reason, "{what}: dflash stop reason");
    let t = generate_speculative(
        target,
        drafter,
        prompt,
        cfg,
        SpecMode::DdTree { budget },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(t.tokens, ar.tokens, "{what}: ddtree(budget {budget}) != ar");
    assert_eq!(t.stop_reason, ar.stop_reason, "{what}: ddtree stop reason");
    // auto: DDTree while faster than AR, then AR steps; lossless whichever it chose, and when
    // the answer outlasts the watch window it has measured both rates
    let a = generate_auto(
        target,
        drafter,
        prompt,
        cfg,
        SpecMode::DdTree { budget },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(a.tokens, ar.tokens, "{what}: auto != ar");
    assert_eq!(a.stop_reason, ar.stop_reason, "{what}: auto stop reason");
    // the AR step is timed whenever the prefill's token does not end the answer
    let choice = a.spec.as_ref().unwrap().auto.clone();
    assert_eq!(choice.is_some(), a.tokens.len() > 1, "{what}: auto choice");
    if let Some(k) = choice.and_then(|c| {
        assert!(c.ar_step_seconds > 0.0, "{what}: no AR step measured");
        c.switched_to_ar_at_step
    }) {
        // the first step pays the drafter's prefill and is never counted: no switch before step 2
        assert!(k >= 2, "{what}: switched at {k}");
        assert!(a.steps > k, "{what}: switched but took no AR step");
    }
    let tau = |g: &dflash_decoding::Generation| g.spec.as_ref().unwrap().mean_acceptance();
    (tau(&d), tau(&t))
}

#[test]
fn greedy_random_drafters_equal_ar() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    for (i, name) in ["tiny-llama", "tiny-qwen3", "tiny-llama31"]
        .iter()
        .cycle()
        .take(12)
        .enumerate()
    {
        let t = tiny(name);
        let block = rng.random_range(2..=16);
        let budget = [1, 3, 8, 17, 64, 128][i % 6];
        let drafter = random_drafter(&t, 1 + i % 3, block, i as u64);
        let mut runner = DFlashRunner::new(&drafter);
        let plen = rng.random_range(1..20);
        let prompt: Vec<u32> = (0..plen).map(|_| rng.random_range(0..263)).collect();
        let max_new = rng.random_range(1..40);
        // stop on a token AR actually produces (sometimes), to test stops mid-block
        let ar = generate_ar(
            t.model.as_ref(),
            &prompt,
            &greedy(max_new, vec![]),
            &mut |_| {},
        )
        .unwrap();
        let stop = if i % 2 == 0 {
            vec![ar.tokens[ar.tokens.len() / 2]]
        } else {
            vec![]
        };
        check_modes(
            t.model.as_ref(),
            &mut runner,
            &prompt,
            &greedy(max_new, stop),
            budget,
            &format!("{name} case {i} block {block}"),
        );
    }
}

#[test]
fn greedy_oracle_drafters_accept_long_and_equal_ar() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
    let mut full_blocks = 0;
    for i in 0..10 {
        let name = ["tiny-llama", "tiny-qwen3"][i % 2];
        let t = tiny(name);
        let block = [16, 4, 9, 2, 16][i % 5];
        let noise = [0.0, 0.1, 0.3][i % 3];
        let mut oracle = OracleDrafter::new(block, noise, i as u64);
        let prompt: Vec<u32> = (0..rng.random_range(1..12))
            .map(|_| rng.random_range(0..263))
            .collect();
        let max_new = rng.random_range(20..60);
        let ar = generate_ar(
            t.model.as_ref(),
            &prompt,
            &greedy(max_new, vec![]),
            &mut |_| {},
        )
        .unwrap();
        let stop = if i % 3 == 1 {
            vec![ar.tokens[ar.tokens.len() * 2 / 3]]
        } else {
            vec![]
        };
        let budget = [4, 32, 128][i % 3];
        let (tau_d, tau_t) = check_modes(
            t.model.as_ref(),
            &mut oracle,
            &prompt,
            &greedy(max_new, stop),
            budget,
            &format!("oracle case {i}"),
        );
        if noise == 0.0 && block == 16 {
            assert!(
                tau_d > 8.0,
                "a perfect oracle must accept long blocks, tau {tau_d}"
            );
            full_blocks += 1;
        }
        assert!(tau_t + 1e-9 >= 1.0 && tau_d >= 1.0);
    }
    assert!(full_blocks > 0);
}

#[test]
fn greedy_hybrid_target_modes_equal_ar() {
    // Qwen3.5 hybrid: rejected drafts and unaccepted branches must leave no trace in the
    // recurrent states (random drafters reject often, oracles accept long)
    let t = tiny("tiny-qwen3.5");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    for i in 0..6 {
        let block = [16, 3, 8, 5, 12, 2][i];
        let budget = [1, 8, 64, 17, 3, 32][i];
        let prompt: Vec<u32> = (0..rng.random_range(1..15))
            .map(|_| rng.random_range(0..263))
            .collect();
        let max_new = rng.random_range(10..40);
        let what = format!("tiny-qwen3.5 case {i} block {block}");
        if i % 2 == 0 {
            let drafter = random_drafter(&t, 1 + i % 2, block, i as u64);
            let mut runner = DFlashRunner::new(&drafter);
            let cfg = greedy(max_new, vec![]);
            check_modes(t.model.as_ref(), &mut runner, &prompt, &cfg, budget, &what);
        } else {
            let mut oracle = OracleDrafter::new(block, [0.0, 0.2][i % 4 / 2], i as u64);
            let cfg = greedy(max_new, vec![]);
            let (tau_d, _) =
                check_modes(t.model.as_ref(), &mut oracle, &prompt, &cfg, budget, &what);
            assert!(tau_d >= 1.0);
        }
    }
}

/// The hybrids' device step (its host emulation on the CPU: the same fixed state and record
/// buffers, metadata, masks and in-place commits as on CUDA) inside the real decoding loops: AR,
/// DFlash, DDTree and auto give the host path's AR tokens exactly, after rejected drafts,
/// compacted trees and recycled caches.
#[test]
fn greedy_hybrid_device_step_modes_equal_host_ar() {
    let vocab = 7;
    let host = tiny_vocab_hybrid_layers(vocab, 6, 3, 13);
    let mut stepped = tiny_vocab_hybrid_layers(vocab, 6, 3, 13);
    stepped.emulate_device_step_on_cpu();
    assert!(stepped.device_step());
    let cfg: dflash_models::DFlashConfig = serde_json::from_value(serde_json::json!({
        "architectures": ["DFlashDraftModel"], "block_size": 8, "num_target_layers": 6,
        "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 48,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
        "rope_theta": 10000000.0, "max_position_embeddings": 256, "vocab_size": vocab,
        "tie_word_embeddings": false,
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": [1, 4]}
    }))
    .unwrap();
    let drafter = random_drafter_for(&cfg, &stepped, 5.0, 7);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
    for (i, budget) in [8, 64, 17, 33].into_iter().enumerate() {
        let prompt: Vec<u32> = (0..rng.random_range(2..12))
            .map(|_| rng.random_range(0..vocab as u32))
            .collect();
        let gen = greedy(30, vec![]);
        let want = generate_ar(&host, &prompt, &gen, &mut |_| {}).unwrap();
        let what = format!("device step, case {i}");
        let got = generate_ar(&stepped, &prompt, &gen, &mut |_| {}).unwrap();
        assert_eq!(got.tokens, want.tokens, "{what}: stepped AR != host AR");
        if i % 2 == 0 {
            let mut runner = DFlashRunner::new(&drafter);
            check_modes(&stepped, &mut runner, &prompt, &gen, budget, &what);
        } else {
            let mut oracle = OracleDrafter::new(8, 0.3, i as u64);
            check_modes(&stepped, &mut oracle, &prompt, &gen, budget, &what);
        }
    }
}

/// A drafter laid out as z-lab's published Qwen3.6-27B-DFlash (5 layers: 4 sliding-window layers,
/// causal within the block since the config has no `is_causal`, then a full one; the reference
/// taps `[1, 16, 31, 46, 61]` of a 64-layer target; block 16), scaled down, on a 64-layer hybrid
/// laid out as Qwen3.6-27B (48 Gated DeltaNet + 16 gated attention layers): every mode equals AR.
#[test]
fn a_zlab_layout_drafter_is_lossless_on_a_64_layer_hybrid() {
    let vocab = 7;
    let t = tiny_vocab_hybrid_layers(vocab, 64, 4, 11);
    let cfg: dflash_models::DFlashConfig = serde_json::from_value(serde_json::json!({
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 16, "num_target_layers": 64, "num_hidden_layers": 5,
        "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000000.0,
        "max_position_embeddings": 256, "vocab_size": vocab, "tie_word_embeddings": false,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                        "sliding_attention", "full_attention"],
        "sliding_window": 6,
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": [1, 16, 31, 46, 61]}
    }))
    .unwrap();
    assert_eq!(
        cfg.target_layer_ids(),
        dflash_models::drafter::default_target_layers(64, 5)
    );
    let drafter = random_drafter_for(&cfg, &t, 5.0, 5);
    let attn = drafter.layer_attention();
    assert!(attn[..4].iter().all(|a| a.causal && a.window == Some(6)));
    assert!(!attn[4].causal && attn[4].window.is_none());
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    let mut accepted = 0.0f64;
    for (i, budget) in [16, 64, 64].into_iter().enumerate() {
        let prompt: Vec<u32> = (0..rng.random_range(3..12))
            .map(|_| rng.random_range(0..vocab as u32))
            .collect();
        let mut runner = DFlashRunner::new(&drafter);
        let (_, tree_tau) = check_modes(
            &t,
            &mut runner,
            &prompt,
            &greedy(24, vec![]),
            budget,
            &format!("z-lab layout on 64 layers, case {i}"),
        );
        accepted = accepted.max(tree_tau);
    }
    // a random drafter's trees are nearly chains (the target's LM head makes its drafts
    // confident), but some drafts are accepted: states committed past a rejection in every layer
    assert!(accepted > 1.0, "no draft accepted: DDTree tau {accepted}");
}

/// Exact probability of the first three generated tokens under the sampler's filtered distribution.
fn exact_triples(
    target: &dyn TargetModel,
    prompt: &[u32],
    s: &SamplingConfig,
    vocab: usize,
) -> Vec<f64> {
    use dflash_models::{ForwardRequest, LogitRows};
    let sampler = dflash_decoding::Sampler::new(s.clone()).unwrap();
    let dist = |seq: &[u32]| -> Vec<f64> {
        let mut c = target.new_cache(seq.len()).unwrap();
        let pos: Vec<u32> = (0..seq.len() as u32).collect();
        let l = target
            .forward(&ForwardRequest::causal(seq, &pos, LogitRows::Last), &mut c)
            .unwrap()
            .logits
            .unwrap();
        let row: Vec<f32> = l.squeeze(0).unwrap().to_vec1().unwrap();
        let (ids, p) = sampler.distribution(&row);
        let mut full = vec![0.0; vocab];
        for (i, q) in ids.iter().zip(p) {
            full[*i as usize] = q as f64;
        }
        full
    };
    let p1 = dist(prompt);
    let mut out = vec![0.0; vocab * vocab * vocab];
    for a in 0..vocab {
        if p1[a] == 0.0 {
            continue;
        }
        let seq: Vec<u32> = prompt.iter().copied().chain([a as u32]).collect();
        let p2 = dist(&seq);
        for b in 0..vocab {
            if p2[b] == 0.0 {
                continue;
            }
            let seq: Vec<u32> = prompt.iter().copied().chain([a as u32, b as u32]).collect();
            let p3 = dist(&seq);
            for c in 0..vocab {
                out[(a * vocab + b) * vocab + c] = p1[a] * p2[b] * p3[c];
            }
        }
    }
    out
}

/// Pearson chi-square against exact probabilities, pooling cells with expectation < 5.
fn chi_square(counts: &[usize], probs: &[f64], n: usize) -> (f64, usize) {
    let (mut chi, mut dof, mut pool_c, mut pool_e) = (0.0, 0usize, 0.0, 0.0);
    for (&c, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if e < 5.0 {
            pool_c += c as f64;
            pool_e += e;
            continue;
        }
        chi += (c as f64 - e).powi(2) / e;
        dof += 1;
    }
    if pool_e > 0.0 {
        chi += (pool_c - pool_e).powi(2) / pool_e.max(1e-9);
        dof += 1;
    }
    (chi, dof.saturating_sub(1))
}

/// Upper 0.1 % quantile of chi-square (Wilson–Hilferty).
fn chi2_crit(dof: usize) -> f64 {
    let k = dof as f64;
    let z = 3.09;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

#[test]
fn sampled_modes_have_the_targets_distribution() {
    check_sampled_modes(&tiny_vocab_target(6, 3), 6, 2000);
}

#[test]
fn sampled_modes_have_the_hybrid_targets_distribution() {
    // half the draws: its distributions are concentrated (20 dof after pooling) and a hybrid
    // step costs more
    check_sampled_modes(&tiny_vocab_hybrid(6, 4), 6, 1000);
}

fn check_sampled_modes(target: &dyn TargetModel, vocab: usize, n: usize) {
    let prompt = [1u32, 4, 2];
    let s = SamplingConfig {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 0,
        seed: 0,
    };
    let exact = exact_triples(target, &prompt, &s, vocab);
    let run = |mode: Option<SpecMode>| -> Vec<usize> {
        let mut counts = vec![0usize; vocab * vocab * vocab];
        let mut oracle = OracleDrafter::new(4, 0.3, 9);
        for seed in 0..n {
            let cfg = GenerateConfig {
                cancel: None,
                max_new_tokens: 3,
                stop_tokens: vec![],
                sampling: SamplingConfig {
                    seed: seed as u64,
                    ..s.clone()
                },
            };
            let g = match mode {
                None => generate_ar(target, &prompt, &cfg, &mut |_| {}).unwrap(),
                Some(m) => generate_speculative(target, &mut oracle, &prompt, &cfg, m, &mut |_| {})
                    .unwrap(),
            };
            counts[(g.tokens[0] as usize * vocab + g.tokens[1] as usize) * vocab
                + g.tokens[2] as usize] += 1;
        }
        counts
    };
    let mut seen = vec![];
    for (name, mode) in [
        ("ar", None),
        ("dflash", Some(SpecMode::DFlash)),
        ("ddtree", Some(SpecMode::DdTree { budget: 6 })),
    ] {
        let counts = run(mode);
        seen.push(counts.clone());
        let (chi, dof) = chi_square(&counts, &exact, n);
        assert!(
            chi < chi2_crit(dof),
            "{name}: chi2 {chi:.1} with {dof} dof exceeds {:.1}",
            chi2_crit(dof)
        );
        eprintln!(
            "{name}: chi2 {chi:.1} / crit {:.1} ({dof} dof)",
            chi2_crit(dof)
        );
    }
    assert_ne!(
        seen[0], seen[1],
        "dflash must draw differently from ar (rejections resample later)"
    );
    // the test can fail: a biased sampler (always the second-most-likely first token) is rejected
    let mut biased = vec![0usize; vocab * vocab * vocab];
    let mut order: Vec<usize> = (0..vocab * vocab * vocab).collect();
    order.sort_by(|&a, &b| exact[b].total_cmp(&exact[a]));
    biased[order[1]] = n;
    let (chi, dof) = chi_square(&biased, &exact, n);
    assert!(chi > chi2_crit(dof));
}

#[test]
fn recycled_caches_give_what_fresh_caches_give() {
    // a target and drafter that served a longer answer first (their pooled caches hold its rows
    // past the new answer's length) produce exactly what fresh ones produce
    for name in ["tiny-qwen3", "tiny-qwen3.5"] {
        recycled_caches_equal_fresh(name);
    }
}

fn recycled_caches_equal_fresh(name: &str) {
    let (used, fresh) = (tiny(name), tiny(name));
    let (d_used, d_fresh) = (
        random_drafter(&used, 2, 8, 3),
        random_drafter(&fresh, 2, 8, 3),
    );
    let long: Vec<u32> = (0..60).map(|i| (i * 37 + 5) % 263).collect();
    let short: Vec<u32> = vec![17, 4, 200];
    let cfg = greedy(30, vec![]);
    for mode in [SpecMode::DFlash, SpecMode::DdTree { budget: 12 }] {
        let mut r = DFlashRunner::new(&d_used);
        generate_speculative(used.model.as_ref(), &mut r, &long, &cfg, mode, &mut |_| {}).unwrap();
        let a = generate_speculative(used.model.as_ref(), &mut r, &short, &cfg, mode, &mut |_| {})
            .unwrap();
        let mut f = DFlashRunner::new(&d_fresh);
        let b = generate_speculative(
            fresh.model.as_ref(),
            &mut f,
            &short,
            &cfg,
            mode,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(a.tokens, b.tokens, "{mode:?}");
        assert_eq!(
            a.spec.unwrap().acceptance,
            b.spec.unwrap().acceptance,
            "{mode:?}"
        );
    }
    let ar_long = generate_ar(used.model.as_ref(), &long, &cfg, &mut |_| {}).unwrap();
    assert_eq!(ar_long.tokens.len(), 30);
    let a = generate_ar(used.model.as_ref(), &short, &cfg, &mut |_| {}).unwrap();
    let b = generate_ar(fresh.model.as_ref(), &short, &cfg, &mut |_| {}).unwrap();
    assert_eq!(a.tokens, b.tokens);
}
