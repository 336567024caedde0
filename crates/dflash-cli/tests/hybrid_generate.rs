//! `dflash draft init` and `dflash generate` on a Qwen3.5 hybrid target: the tiny transformers
//! fixture with a word-level tokenizer written next to it, a random drafter made by `draft init`
//! for it, and `--mode ar|dflash|ddtree` giving the same token ids (greedy, f32).

use std::path::Path;

mod common;
use common::{dflash, root, run};

/// The fixture's weights and config plus a `tokenizer.json` whose vocabulary is the words
/// `w0 … w262` (whitespace-split), so prompts are plain text.
fn hybrid_with_tokenizer(dir: &Path) {
    let src = root().join("fixtures/tiny-qwen3.5");
    for f in ["config.json", "model.safetensors", "generation_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let vocab: serde_json::Map<String, serde_json::Value> = (0..263)
        .map(|i| (format!("w{i}"), serde_json::json!(i)))
        .collect();
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
}

#[test]
fn generate_modes_give_the_same_tokens_on_a_hybrid_target() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    let draft = tmp.path().join("draft");
    std::fs::create_dir(&target).unwrap();
    hybrid_with_tokenizer(&target);
    let (code, _, err) = run(dflash()
        .args(["draft", "init", "--layers", "1", "--block-size", "6"])
        .arg("--target")
        .arg(&target)
        .arg("--out")
        .arg(&draft));
    assert_eq!(code, 0, "draft init: {err}");
    let prompt = "w5 w17 w200 w3 w99 w42 w7";
    let mut outputs = vec![];
    for mode in ["ar", "dflash", "ddtree"] {
        let (code, out, err) = run(dflash()
            .args([
                "generate",
                "--raw",
                "--json",
                "--ids",
                "--max-new-tokens",
                "24",
            ])
            .args(["--mode", mode, "--tree-budget", "12", "--prompt", prompt])
            .arg("--target")
            .arg(&target)
            .arg("--draft")
            .arg(&draft));
        assert_eq!(code, 0, "{mode}: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["mode"], mode);
        let ids: Vec<u64> = v["output_ids"]
            .as_array()
            .unwrap_or_else(|| panic!("{mode}: no output_ids in {v}"))
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert!(!ids.is_empty(), "{mode}: no tokens");
        outputs.push((mode, ids));
    }
    for (mode, ids) in &outputs[1..] {
        assert_eq!(ids, &outputs[0].1, "{mode} != ar");
    }
}
