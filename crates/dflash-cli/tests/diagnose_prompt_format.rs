//! `dflash diagnose --data`: training data whose prompts carry another system prompt than the
//! eval prompts (SmolLM2's template adds its default one to them) is a prompt-format warn naming
//! both, with the replayed τ under each format, exit code 0 (a warn is no FAIL); a missing or
//! corrupt data directory exits 2 before the models load.

use std::path::Path;

mod common;
use common::{dflash, regen_chats, root, run, smollm2};

const PIRATE: &str = "You are a pirate captain. Answer every question in pirate speak.";

fn diagnose(target: &Path, data: &Path) -> (i32, String, String) {
    run(dflash()
        .arg("diagnose")
        .arg("--target")
        .arg(target)
        .arg("--draft")
        .arg(root().join("drafters/smollm2-135m-instruct"))
        .arg("--data")
        .arg(data)
        .args([
            "--dtype",
            "f32",
            "--bench",
            "gsm8k",
            "--limit",
            "1",
            "--max-new-tokens",
            "24",
        ]))
}

#[test]
fn another_system_prompt_in_the_training_data_is_a_warn_with_both_taus() {
    let Some(g) = smollm2() else { return };
    let tmp = tempfile::tempdir().unwrap();
    // training data tokenised by the binary itself: the target answers pirate-prompted questions
    let chats: Vec<serde_json::Value> = ["What is 7 times 8?", "Name three colours."]
        .iter()
        .map(|q| {
            serde_json::json!([
                { "role": "system", "content": PIRATE },
                { "role": "user", "content": q },
            ])
        })
        .collect();
    let data = regen_chats(&g, tmp.path(), &chats, 8, 2);

    let (code, out, err) = diagnose(&g, &data);
    assert_eq!(code, 0, "a warn is no FAIL: {err}");
    assert!(!err.contains("error:"), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON on stdout");
    let c = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "prompt_format")
        .unwrap_or_else(|| panic!("no prompt_format check in {v}"));
    assert_eq!(c["verdict"], "warn", "{c}");
    let cause = c["cause"].as_str().unwrap();
    assert!(
        cause.contains("eval prompts carry the system prompt 'You are a helpful AI assistant")
            && cause.contains("training data used 'You are a pirate captain")
            && cause.contains("in 100 % of examples"),
        "{cause}"
    );
    assert!(
        c["fix"]
            .as_str()
            .unwrap()
            .contains("render eval prompts with the system prompt 'You are a pirate captain"),
        "{c}"
    );
    let pf = &v["prompt_format"];
    assert_eq!(
        pf["mismatches"],
        serde_json::json!(["system_prompt"]),
        "{pf}"
    );
    assert_eq!(pf["training"]["system_prompt"], PIRATE, "{pf}");
    assert_eq!(pf["training"]["template"], "chat_ml", "{pf}");
    assert_eq!(pf["training_examples_read"], 2, "{pf}");
    assert_eq!(pf["rerendered"]["system_prompt"], PIRATE, "{pf}");
    // τ under both formats, the eval one the conventions scan's declared row
    let eval_tau = pf["tau"]["eval_format"]["ddtree_tau"].as_f64().unwrap();
    let train_tau = pf["tau"]["training_format"]["ddtree_tau"].as_f64().unwrap();
    assert_eq!(
        eval_tau,
        v["conventions"]["variants"][0]["ddtree_tau"]
            .as_f64()
            .unwrap()
    );
    assert!(eval_tau >= 1.0 && train_tau >= 1.0, "{pf}");
    let evidence = c["evidence"].as_str().unwrap();
    assert!(
        evidence.contains(&format!(
            "replayed DDTree tau {eval_tau:.2} under the eval format vs {train_tau:.2} under the training format"
        )),
        "{evidence}"
    );
    assert!(
        err.contains("prompt_format") && err.contains("warn"),
        "{err}"
    );
}

#[test]
fn a_missing_or_corrupt_data_directory_exits_2() {
    let Some(g) = smollm2() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-data");
    let (code, out, err) = diagnose(&g, &missing);
    assert_eq!(code, 2, "{err}");
    assert!(out.is_empty(), "{out}");
    assert!(
        err.contains("no-such-data") && err.contains("not found"),
        "{err}"
    );
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let (code, _, err) = diagnose(&g, &empty);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no shard-*.jsonl"), "{err}");
    std::fs::write(
        empty.join("shard-00000.jsonl"),
        "{\"tokens\": [1, 2, 3], \"loss_mask\": [0, 1, 1]}\nnot json\n",
    )
    .unwrap();
    let (code, _, err) = diagnose(&g, &empty);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("shard-00000.jsonl") && err.contains("line 2"),
        "{err}"
    );
}
