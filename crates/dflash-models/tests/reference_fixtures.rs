//! Target models against Hugging Face transformers: logits and tapped hidden states of tiny random
//! Llama / Llama-3.1 / Qwen3 checkpoints (fixtures/ made by scripts/make_fixtures.py), plus
//! self-consistency of block, token-by-token, cropped and tree-masked forwards.

mod common;
use candle_core::{DType, Tensor};
use common::*;
use dflash_core::AttentionMask;
use dflash_models::{load_target, ForwardRequest, LogitRows, TargetModel};
use std::collections::HashMap;

const TINY: [&str; 4] = ["tiny-llama", "tiny-llama31", "tiny-qwen3", "tiny-qwen3.5"];

fn reference(name: &str) -> HashMap<String, Tensor> {
    let p = fixtures().join(name).join("reference.safetensors");
    candle_core::safetensors::load(&p, &candle_core::Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn ids(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::I64)
        .unwrap()
        .to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|x| x as u32)
        .collect()
}

fn positions(start: usize, n: usize) -> Vec<u32> {
    (start as u32..(start + n) as u32).collect()
}

#[test]
fn tiny_models_match_transformers_logits_and_taps() {
    let (dev, dtype) = device_and_dtype();
    for name in TINY {
        // bf16 against transformers' f32 reference: the Qwen3.5 hybrid's logits move by 0.38 (CPU)
        // to 0.53 (H200) of 4.57 already from rounding its weights to bf16 (the error is there at
        // layer 0 and unchanged with every layer computed in f32, session 14), past the 5 % that
        // the dense models meet; 15 % still catches a wrong layer or norm. The real fix is a bf16
        // reference made by transformers from the same bf16 weights.
        let tol_for = |name: &str, scale: f32| {
            if *name == *"tiny-qwen3.5" && dtype != DType::F32 {
                0.15 * scale.max(1.0)
            } else {
                tol(dtype, 1e-4, scale)
            }
        };
        let r = reference(name);
        let t = load_target(&fixtures().join(name), &dev, dtype).unwrap();
        let m = t.model.as_ref();
        let layers = m.info().num_layers;
        let prompt = ids(&r["input_ids"]);
        let cont = ids(&r["cont_input_ids"]);
        let mut cache = m.new_cache(64).unwrap();
        let taps: Vec<usize> = (0..layers).collect();
        let pos = positions(0, prompt.len());
        let req = ForwardRequest {
            tokens: &prompt,
            positions: &pos,
            mask: AttentionMask::Causal,
            taps: &taps,
            logits: LogitRows::All,
        };
        let out = m.forward(&req, &mut cache).unwrap();
        let logits = out.logits.unwrap();
        let want = &r["logits"];
        let err = max_abs_diff(&logits, want);
        assert!(
            err <= tol_for(name, max_abs(want)),
            "{name}: logits max abs err {err}"
        );
        for l in 0..layers {
            let want = &r[&format!("layer_output.{l}")];
            let err = max_abs_diff(&out.taps[l], want);
            assert!(
                err <= tol_for(name, max_abs(want)),
                "{name}: tap {l} err {err}"
            );
            if l + 1 < layers {
                // HF hidden_states[l+1] is the same tensor for all but the last layer
                assert!(
                    max_abs_diff(&out.taps[l], &r[&format!("hidden_states.{}", l + 1)])
                        <= tol_for(name, max_abs(want))
                );
            }
        }
        // continue with a block over the cache
        let pos = positions(prompt.len(), cont.len());
        let req = ForwardRequest {
            tokens: &cont,
            positions: &pos,
            mask: AttentionMask::Causal,
            taps: &taps,
            logits: LogitRows::All,
        };
        let out = m.forward(&req, &mut cache).unwrap();
        let want = &r["cont_logits"];
        let err = max_abs_diff(&out.logits.unwrap(), want);
        assert!(
            err <= tol_for(name, max_abs(want)),
            "{name}: continued-block logits err {err}"
        );
        for l in 0..layers {
            let want = &r[&format!("cont_layer_output.{l}")];
            let err = max_abs_diff(&out.taps[l], want);
            assert!(
                err <= tol_for(name, max_abs(want)),
                "{name}: continued tap {l} err {err}"
            );
        }
        eprintln!("{name}: ok ({dtype:?})");
    }
}

fn causal_logits(m: &dyn TargetModel, tokens: &[u32]) -> Tensor {
    let mut cache = m.new_cache(64).unwrap();
    let pos = positions(0, tokens.len());
    m.forward(
        &ForwardRequest::causal(tokens, &pos, LogitRows::All),
        &mut cache,
    )
    .unwrap()
    .logits
    .unwrap()
}

#[test]
fn token_by_token_and_cropped_forwards_equal_one_block() {
    let (dev, dtype) = device_and_dtype();
    for name in TINY {
        let r = reference(name);
        let m = load_target(&fixtures().join(name), &dev, dtype)
            .unwrap()
            .model;
        let prompt = ids(&r["input_ids"]);
        let block = causal_logits(m.as_ref(), &prompt);
        let mut cache = m.new_cache(64).unwrap();
        let mut rows = vec![];
        for (i, &tok) in prompt.iter().enumerate() {
            // a rejected speculative tail, then cropped away, must leave no trace
            let junk = [5u32, 6, 7];
            let jp = positions(i, 3);
            m.forward(
                &ForwardRequest::causal(&junk, &jp, LogitRows::None),
                &mut cache,
            )
            .unwrap();
            cache.crop(i);
            let p = [i as u32];
            let out = m
                .forward(
                    &ForwardRequest::causal(&[tok], &p, LogitRows::All),
                    &mut cache,
                )
                .unwrap();
            rows.push(out.logits.unwrap());
        }
        let stepwise = Tensor::cat(&rows, 0).unwrap();
        let err = max_abs_diff(&stepwise, &block);
        assert!(
            err <= tol(dtype, 1e-4, max_abs(&block)),
            "{name}: stepwise vs block err {err}"
        );
    }
}

#[test]
fn tree_forward_equals_causal_forward_of_each_path_and_compaction_keeps_the_path() {
    let (dev, dtype) = device_and_dtype();
    for name in TINY {
        let r = reference(name);
        let m = load_target(&fixtures().join(name), &dev, dtype)
            .unwrap()
            .model;
        let prompt = ids(&r["input_ids"]);
        // root, two children, grandchildren under each, a depth-3 node
        let tokens = [11u32, 20, 21, 30, 31, 32, 40];
        let parents = [-1i64, 0, 0, 1, 1, 2, 3];
        let depth = |mut i: usize| {
            let mut d = 0;
            while parents[i] >= 0 {
                i = parents[i] as usize;
                d += 1;
            }
            d
        };
        let mut cache = m.new_cache(64).unwrap();
        let pos = positions(0, prompt.len());
        m.forward(
            &ForwardRequest::causal(&prompt, &pos, LogitRows::None),
            &mut cache,
        )
        .unwrap();
        let tree_pos: Vec<u32> = (0..tokens.len())
            .map(|i| (prompt.len() + depth(i)) as u32)
            .collect();
        let req = ForwardRequest {
            tokens: &tokens,
            positions: &tree_pos,
            mask: AttentionMask::Tree {
                parents: parents.to_vec(),
            },
            taps: &[],
            logits: LogitRows::All,
        };
        let tree_logits = m.forward(&req, &mut cache).unwrap().logits.unwrap();
        for node in 0..tokens.len() {
            let mut path = vec![];
            let mut i = node as i64;
            while i >= 0 {
                path.push(tokens[i as usize]);
                i = parents[i as usize];
            }
            path.reverse();
            let seq: Vec<u32> = prompt.iter().copied().chain(path.iter().copied()).collect();
            let want = causal_logits(m.as_ref(), &seq);
            let want = want.narrow(0, seq.len() - 1, 1).unwrap();
            let got = tree_logits.narrow(0, node, 1).unwrap();
            let err = max_abs_diff(&got, &want);
            assert!(
                err <= tol(dtype, 1e-4, max_abs(&want)),
                "{name}: tree node {node} err {err}"
            );
        }
        // accept path root -> 1 -> 3 -> 6 and continue decoding from it
        cache.keep_rows(prompt.len(), &[0, 1, 3, 6]).unwrap();
        assert_eq!(cache.len(), prompt.len() + 4);
        let next = [50u32];
        let p = [(prompt.len() + 4) as u32];
        let got = m
            .forward(
                &ForwardRequest::causal(&next, &p, LogitRows::All),
                &mut cache,
            )
            .unwrap()
            .logits
            .unwrap();
        let seq: Vec<u32> = prompt.iter().copied().chain([11, 20, 30, 40, 50]).collect();
        let want = causal_logits(m.as_ref(), &seq);
        let want = want.narrow(0, seq.len() - 1, 1).unwrap();
        let err = max_abs_diff(&got, &want);
        assert!(
            err <= tol(dtype, 1e-4, max_abs(&want)),
            "{name}: after compaction err {err}"
        );
    }
}

#[test]
fn smollm2_gguf_matches_transformers() {
    let Some(gguf) = smollm2_gguf() else { return };
    assert!(
        fixtures().join("smollm2/reference.safetensors").is_file(),
        "fixtures/smollm2/reference.safetensors is missing (made by scripts/gpu-check.sh; it is committed)"
    );
    let (dev, dtype) = device_and_dtype();
    let r = reference("smollm2");
    let t = load_target(&gguf, &dev, dtype).unwrap();
    let m = t.model.as_ref();
    let prompt = ids(&r["input_ids"]);
    let logits = causal_logits(m, &prompt);
    let n = prompt.len();
    let tail = logits.narrow(0, n - 3, 3).unwrap();
    let want = &r["logits_tail"];
    let err = max_abs_diff(&tail, want);
    assert!(
        err <= tol(dtype, 2e-3, max_abs(want)),
        "SmolLM2 logits err {err}"
    );
    if dtype == DType::F32 {
        assert_eq!(
            argmax_rows(&logits),
            ids(&r["argmax"]),
            "SmolLM2 argmax per position"
        );
    }
    eprintln!("SmolLM2 logits max abs err {err} ({dtype:?})");
}

#[test]
fn sharded_safetensors_directory_loads_the_same_model() {
    let src = fixtures().join("tiny-qwen3");
    let tmp = tempfile::tempdir().unwrap();
    let all =
        candle_core::safetensors::load(src.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let mut names: Vec<&String> = all.keys().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ] {
        let m: HashMap<String, Tensor> = part
            .iter()
            .map(|n| ((*n).clone(), all[*n].clone()))
            .collect();
        candle_core::safetensors::save(&m, tmp.path().join(file)).unwrap();
        for n in part {
            map.insert((*n).clone(), file.into());
        }
    }
    std::fs::write(
        tmp.path().join("model.safetensors.index.json"),
        serde_json::json!({"weight_map": map}).to_string(),
    )
    .unwrap();
    std::fs::copy(src.join("config.json"), tmp.path().join("config.json")).unwrap();
    let (dev, dtype) = device_and_dtype();
    let sharded = load_target(tmp.path(), &dev, dtype).unwrap();
    let single = load_target(&src, &dev, dtype).unwrap();
    let prompt = [3u32, 99, 7, 250];
    let err = max_abs_diff(
        &causal_logits(sharded.model.as_ref(), &prompt),
        &causal_logits(single.model.as_ref(), &prompt),
    );
    assert_eq!(err, 0.0);
    // a shard listed in the index but missing is an error naming it
    std::fs::remove_file(tmp.path().join("model-00002-of-00002.safetensors")).unwrap();
    let e = load_target(tmp.path(), &dev, dtype)
        .err()
        .expect("missing shard must fail")
        .to_string();
    assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
}
