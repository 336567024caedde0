//! Qwen3.5 / Qwen3.6 hybrids beyond the transformers fixture comparison (reference_fixtures.rs):
//! the multimodal checkpoint layout loads the same model, and speculative verification is exact
//! over many rounds — every row of a causal block and every node of a branching tree has the
//! logits of a causal forward along its own path, after rejections in the middle of blocks and
//! after tree paths were kept, on the fixture model and on random hybrids.

mod common;
use candle_core::{DType, Device, Tensor};
use common::*;
use dflash_core::{AttentionMask, SequenceCache};
use dflash_models::random::random_hybrid;
use dflash_models::{load_target, DecoderConfig, ForwardRequest, LogitRows, TargetModel};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

fn fixture_dir() -> std::path::PathBuf {
    fixtures().join("tiny-qwen3.5")
}

fn logits_of(m: &dyn TargetModel, tokens: &[u32]) -> Tensor {
    let mut cache = m.new_cache(tokens.len()).unwrap();
    let pos: Vec<u32> = (0..tokens.len() as u32).collect();
    m.forward(
        &ForwardRequest::causal(tokens, &pos, LogitRows::All),
        &mut cache,
    )
    .unwrap()
    .logits
    .unwrap()
}

#[test]
fn the_multimodal_layout_loads_the_same_model() {
    let src = fixture_dir();
    let tmp = tempfile::tempdir().unwrap();
    let w = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut moved: HashMap<String, Tensor> = w
        .into_iter()
        .map(|(k, t)| match k.strip_prefix("model.") {
            Some(rest) => (format!("model.language_model.{rest}"), t),
            None => (k, t),
        })
        .collect();
    // vision and MTP weights are present in the real checkpoints and ignored
    let junk = Tensor::zeros((3, 5), DType::F32, &Device::Cpu).unwrap();
    moved.insert("model.visual.blocks.0.attn.qkv.weight".into(), junk.clone());
    moved.insert("mtp.fc.weight".into(), junk);
    candle_core::safetensors::save(&moved, tmp.path().join("model.safetensors")).unwrap();
    let text: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let cfg = serde_json::json!({
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": false,
        "text_config": text,
        "vision_config": {"depth": 2},
    });
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    let a = load_target(tmp.path(), &Device::Cpu, DType::F32).unwrap();
    let b = load_target(&src, &Device::Cpu, DType::F32).unwrap();
    assert_eq!(a.config.num_hidden_layers, 4);
    assert_eq!(a.model.info().architecture, "qwen3_5");
    let prompt = [3u32, 99, 7, 250, 12, 1];
    let err = max_abs_diff(
        &logits_of(a.model.as_ref(), &prompt),
        &logits_of(b.model.as_ref(), &prompt),
    );
    assert_eq!(err, 0.0);
    // a MoE hybrid is refused by name
    let moe = serde_json::json!({"model_type": "qwen3_5_moe", "text_config": {
        "model_type": "qwen3_5_moe_text", "vocab_size": 8, "hidden_size": 8,
        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}});
    std::fs::write(tmp.path().join("config.json"), moe.to_string()).unwrap();
    let e = load_target(tmp.path(), &Device::Cpu, DType::F32)
        .err()
        .expect("MoE must be refused")
        .to_string();
    assert!(
        e.contains("qwen3_5_moe") && e.contains("mixture-of-experts"),
        "{e}"
    );
}

/// A random tree of `n` nodes below a root (`parents[0] = -1`, parents before children).
fn random_tree(rng: &mut impl Rng, n: usize) -> Vec<i64> {
    let mut p = vec![-1i64];
    for i in 1..n {
        // prefer recent parents so that trees get deep (past the conv window)
        let lo = i.saturating_sub(3);
        p.push(rng.random_range(lo..i) as i64);
    }
    p
}

/// Rounds of verification as the decoding loops run them — causal blocks cropped after a random
/// number of accepted rows, trees compacted to a random root path — checking every verified row
/// against a fresh causal forward of the committed tokens plus the row's path.
fn verify_rounds_equal_causal_paths(m: &dyn TargetModel, vocab: u32, seed: u64, what: &str) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut committed: Vec<u32> = (0..rng.random_range(3..12))
        .map(|_| rng.random_range(0..vocab))
        .collect();
    let mut cache: SequenceCache = m.new_cache(256).unwrap();
    let pos: Vec<u32> = (0..committed.len() as u32).collect();
    m.forward(
        &ForwardRequest::causal(&committed, &pos, LogitRows::None),
        &mut cache,
    )
    .unwrap();
    let mut worst = 0f32;
    for round in 0..8 {
        let start = committed.len();
        let n = rng.random_range(1..10);
        let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
        let parents: Vec<i64> = if round % 2 == 0 {
            (0..n as i64).map(|i| i - 1).collect()
        } else {
            random_tree(&mut rng, n)
        };
        let depth = |i: usize| path_to(&parents, i).len() - 1;
        let positions: Vec<u32> = (0..n).map(|i| (start + depth(i)) as u32).collect();
        let mask = match round % 2 {
            0 => AttentionMask::Causal,
            _ => AttentionMask::Tree {
                parents: parents.clone(),
            },
        };
        let req = ForwardRequest {
            tokens: &tokens,
            positions: &positions,
            mask,
            taps: &[],
            logits: LogitRows::All,
        };
        let got = m.forward(&req, &mut cache).unwrap().logits.unwrap();
        for node in 0..n {
            let seq: Vec<u32> = committed
                .iter()
                .copied()
                .chain(path_to(&parents, node).iter().map(|&i| tokens[i]))
                .collect();
            let want = logits_of(m, &seq).narrow(0, seq.len() - 1, 1).unwrap();
            let err = max_abs_diff(&got.narrow(0, node, 1).unwrap(), &want);
            worst = worst.max(err);
            assert!(
                err <= 1e-4 * max_abs(&want).max(1.0),
                "{what}: round {round} node {node} err {err}"
            );
        }
        // accept a random node's path (a chain: a random prefix, often rejecting mid-block)
        let keep = path_to(&parents, rng.random_range(0..n));
        if round % 2 == 0 {
            cache.crop(start + keep.len());
        } else {
            let rows: Vec<u32> = keep.iter().map(|&i| i as u32).collect();
            cache.keep_rows(start, &rows).unwrap();
        }
        assert_eq!(cache.len(), start + keep.len());
        committed.extend(keep.iter().map(|&i| tokens[i]));
    }
    eprintln!("{what}: worst verify-row error {worst:.2e}");
}

#[test]
fn verified_rows_equal_causal_paths_over_rounds_of_rejection_and_compaction() {
    let t = load_target(&fixture_dir(), &Device::Cpu, DType::F32).unwrap();
    for seed in 0..3 {
        verify_rounds_equal_causal_paths(t.model.as_ref(), 263, seed, "tiny-qwen3.5");
    }
    // random hybrids: Hv = Hk, no layer_types (full attention every 3rd layer), no output gate,
    // tied embeddings, a wider conv window
    let cfg: DecoderConfig = serde_json::from_value(serde_json::json!({
        "model_type": "qwen3_5_text", "vocab_size": 97, "hidden_size": 48,
        "intermediate_size": 64, "num_hidden_layers": 6, "full_attention_interval": 3,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "linear_num_key_heads": 3, "linear_num_value_heads": 3, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 5, "attn_output_gate": false,
        "tie_word_embeddings": true, "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}
    }))
    .unwrap();
    assert_eq!(
        cfg.recurrent_layers(),
        [true, true, false, true, true, false]
    );
    let m = random_hybrid(&cfg, DType::F32, &Device::Cpu, 5).unwrap();
    verify_rounds_equal_causal_paths(&m, 97, 9, "random hybrid");
}

#[test]
fn what_a_recurrent_state_cannot_follow_is_refused() {
    let t = load_target(&fixture_dir(), &Device::Cpu, DType::F32).unwrap();
    let m = t.model.as_ref();
    let mut cache = m.new_cache(64).unwrap();
    let fwd = |cache: &mut SequenceCache, tokens: &[u32], start: u32, mask: AttentionMask| {
        let pos: Vec<u32> = (start..start + tokens.len() as u32).collect();
        let req = ForwardRequest {
            tokens,
            positions: &pos,
            mask,
            taps: &[],
            logits: LogitRows::Last,
        };
        m.forward(&req, cache).map(|_| ())
    };
    fwd(&mut cache, &[1, 2, 3, 4], 0, AttentionMask::Causal).unwrap();
    assert!(fwd(&mut cache, &[5, 6], 4, AttentionMask::Full).is_err());
    assert_eq!(cache.len(), 4, "a refused forward leaves the cache");
    let tree = AttentionMask::Tree {
        parents: vec![-1, 0, 0, 2],
    };
    fwd(&mut cache, &[5, 6, 7, 8], 4, tree.clone()).unwrap();
    // rows 0 -> 1 -> 3 are no path (3's parent is 2); the cache is left as it was
    assert!(cache.keep_rows(4, &[0, 1, 3]).is_err());
    // a forward over an unresolved tree is refused
    assert!(fwd(&mut cache, &[9], 8, AttentionMask::Causal).is_err());
    // cropping inside the tree past its root is no state either
    cache.crop(7);
    assert!(fwd(&mut cache, &[9], 7, AttentionMask::Causal).is_err());
    // cropping to its root is, and decoding goes on as from the prompt and the root
    cache.crop(5);
    fwd(&mut cache, &[9], 5, AttentionMask::Causal).unwrap();
    // below the last forward's start the state is gone
    cache.crop(2);
    assert!(fwd(&mut cache, &[9], 2, AttentionMask::Causal).is_err());
    // crop(0) starts over
    cache.crop(0);
    fwd(&mut cache, &[1, 2], 0, AttentionMask::Causal).unwrap();
}
