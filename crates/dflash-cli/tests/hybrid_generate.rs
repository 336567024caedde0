//! The CLI on a Qwen3.5 hybrid target (the tiny transformers fixture with a word-level tokenizer
//! and a chat template written next to it): `draft init` and `generate --mode ar|dflash|ddtree`
//! giving the same token ids (greedy, f32); `data regen` (batched) and `train` running end to end,
//! and the trained drafter decoding losslessly; `diagnose` measuring it.

use std::path::Path;

mod common;
use common::{dflash, regen_chats, root, run};

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
    let template = "{% for m in messages %}{{ m['content'] }} {% endfor %}\
                    {% if add_generation_prompt %}w9 {% endif %}";
    std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
}

/// The token ids `generate --raw --json --ids` gives in `mode` with the drafter at `draft`.
fn generate_ids(target: &Path, draft: &Path, mode: &str, prompt: &str) -> Vec<u64> {
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
        .arg(target)
        .arg("--draft")
        .arg(draft));
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
    ids
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
    let ar = generate_ids(&target, &draft, "ar", prompt);
    for mode in ["dflash", "ddtree"] {
        assert_eq!(
            generate_ids(&target, &draft, mode, prompt),
            ar,
            "{mode} != ar"
        );
    }
}

#[test]
fn regen_and_train_run_on_a_hybrid_target() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    std::fs::create_dir(&target).unwrap();
    hybrid_with_tokenizer(&target);
    let chats: Vec<serde_json::Value> = (0..10)
        .map(|i| {
            let words: Vec<String> = (0..2 + i % 5)
                .map(|j| format!("w{}", (i * 31 + j * 17) % 263))
                .collect();
            serde_json::json!([{"role": "user", "content": words.join(" ")}])
        })
        .collect();
    // batched with prompts of different lengths: left padding through the recurrent layers
    let data = regen_chats(&target, tmp.path(), &chats, 20, 4);
    let run_dir = tmp.path().join("run");
    let (code, _, err) = run(dflash()
        .args([
            "train",
            "--layers",
            "1",
            "--block-size",
            "4",
            "--anchors",
            "8",
        ])
        .args(["--max-steps", "3", "--epochs", "1", "--max-length", "64"])
        .arg("--target")
        .arg(&target)
        .arg("--data")
        .arg(&data)
        .arg("--out")
        .arg(&run_dir));
    assert_eq!(code, 0, "train: {err}");
    let drafter = run_dir.join("drafter");
    assert!(drafter.join("config.json").is_file(), "{err}");
    let prompt = "w1 w2 w3 w4";
    let ar = generate_ids(&target, &drafter, "ar", prompt);
    assert_eq!(generate_ids(&target, &drafter, "ddtree", prompt), ar);
}

/// `dflash diagnose` on a hybrid target: the verify path's logits equal AR's through the
/// recurrent layers (target integrity ok), the conventions scan replays every variant, and a
/// random drafter is judged too weak rather than failed.
#[test]
fn diagnose_runs_on_a_hybrid_target() {
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
    let (code, out, err) = run(dflash()
        .args(["diagnose", "--bench", "gsm8k", "--limit", "2"])
        .arg("--target")
        .arg(&target)
        .arg("--draft")
        .arg(&draft));
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let check = |name: &str| {
        v["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == name)
            .unwrap_or_else(|| panic!("no {name} check: {v}"))
            .clone()
    };
    let integrity = check("target_integrity");
    assert_eq!(integrity["verdict"], "ok", "{integrity}");
    let conventions = check("conventions");
    assert_eq!(conventions["verdict"], "warn", "{conventions}");
    assert!(v["conventions"]["variants"].as_array().unwrap().len() > 4);
}
