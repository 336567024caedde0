//! Comparison with Hugging Face transformers on the SmolLM2 GGUF.
//!
//! - `tests/data/hf_gguf_reference.json` was produced by `scripts/hf_gguf_reference.py` with transformers
//!   5.17.0 / tokenizers 0.23.2 on a vocabulary-only copy of the GGUF (same metadata, no tensors); it is part of
//!   this crate and always checked.
//! - `fixtures/smollm2/text_cases.json` at the workspace root (format
//!   `{"encode": [{text, ids}], "chat": [{messages, add_generation_prompt, rendered, ids}]}`) is produced
//!   separately; the test against it is skipped with a notice only when the file is absent.

mod common;

use std::path::PathBuf;

use dflash_text::{ChatMessage, RenderOptions, TextAssets};
use serde_json::Value;

fn reference() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf_gguf_reference.json");
    let text = std::fs::read_to_string(&path).expect("read hf_gguf_reference.json");
    serde_json::from_str(&text).expect("parse hf_gguf_reference.json")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn messages(v: &Value) -> Vec<ChatMessage> {
    serde_json::from_value(v.clone()).expect("messages")
}

/// Checks encode (with and without special tokens) and chat cases; returns the number of cases checked.
fn check_cases(assets: &TextAssets, cases: &Value, source: &str) -> usize {
    let tok = &assets.tokenizer;
    let mut n = 0;
    for case in cases["encode"].as_array().expect("encode list") {
        let text = case["text"].as_str().expect("text");
        let got = tok.encode(text, true).unwrap();
        assert_eq!(
            got,
            ids(&case["ids"]),
            "{source}: encode {text:?}: {:?}",
            common::pieces(tok, &got)
        );
        if let Some(plain) = case.get("ids_no_special") {
            assert_eq!(
                tok.encode(text, false).unwrap(),
                ids(plain),
                "{source}: {text:?}"
            );
        }
        n += 1;
    }
    let template = assets.chat_template.as_ref().expect("chat template");
    for case in cases["chat"].as_array().expect("chat list") {
        let opts = RenderOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().expect("agp"),
            ..Default::default()
        };
        let rendered = template
            .render(&messages(&case["messages"]), &opts)
            .unwrap();
        assert_eq!(
            rendered,
            case["rendered"].as_str().expect("rendered"),
            "{source}"
        );
        assert_eq!(
            tok.encode(&rendered, false).unwrap(),
            ids(&case["ids"]),
            "{source}: chat ids of {rendered:?}"
        );
        n += 1;
    }
    n
}

#[test]
fn matches_transformers_reference() {
    let Some(assets) = common::smollm2_assets("matches_transformers_reference") else {
        return;
    };
    let r = reference();
    assert_eq!(r["transformers"], "5.17.0");
    let n = check_cases(&assets, &r, "hf_gguf_reference.json");
    assert!(n >= 30, "only {n} cases");

    let tok = &assets.tokenizer;
    for case in r["decode"].as_array().unwrap() {
        let skip = case["skip_special_tokens"].as_bool().unwrap();
        assert_eq!(
            tok.decode(&ids(&case["ids"]), skip).unwrap(),
            case["text"].as_str().unwrap(),
            "decode {:?} skip={skip}",
            case["ids"]
        );
    }
    assert_eq!(tok.vocab_size() as u64, r["len"].as_u64().unwrap());
    assert_eq!(assets.add_bos, r["add_bos_token"].as_bool().unwrap());

    // The whole pipeline, not only its outputs: normalizer, pre-tokenizer, post-processor, decoder, model
    // options and added tokens serialise identically.
    let ours: Value = serde_json::from_str(&tok.to_json(false).unwrap()).unwrap();
    let theirs = &r["backend_without_vocab"];
    for key in [
        "normalizer",
        "pre_tokenizer",
        "post_processor",
        "decoder",
        "added_tokens",
    ] {
        assert_eq!(&ours[key], &theirs[key], "{key}");
    }
    for (k, v) in theirs["model"].as_object().unwrap() {
        assert_eq!(&ours["model"][k], v, "model.{k}");
    }
    // transformers' GGUF converter sets eos_token = tokens[bos_token_id]; we keep the real EOS.
    assert_eq!(r["eos_token"], "<|im_start|>");
    assert_eq!(assets.eos_token_ids, vec![2]);
}

#[test]
fn matches_fixture_text_cases() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/smollm2/text_cases.json");
    assert!(
        path.is_file(),
        "{} is missing (made with transformers on the GPU machine by scripts/gpu-check.sh; it is committed)",
        path.display()
    );
    let Some(assets) = common::smollm2_assets("matches_fixture_text_cases") else {
        return;
    };
    let text = std::fs::read_to_string(&path).expect("read text_cases.json");
    let cases: Value = serde_json::from_str(&text).expect("parse text_cases.json");
    let n = check_cases(&assets, &cases, "text_cases.json");
    assert!(n > 0, "{} holds no cases", path.display());
}
