//! `dflash train` records what `dflash diagnose --run` needs, and the diagnosis reads it: a tiny
//! SmolLM2 run (f32, CPU, two steps, blocks one position on, declared in the drafter's config)
//! writes RUN/diagnosis_inputs.json (target facts, taps, block conventions, data path and
//! prompt-format profile, recorded validation prompts, tap statistics), the same statistics in
//! RUN/drafter/tap_stats.json and its end-of-run diagnosis in RUN/diagnosis.json; `diagnose --run
//! RUN` finds the drafter, target and data from it alone and its train-vs-eval check agrees with
//! the run's validation (the exported f32 drafter replays the run's own validation text exactly);
//! a copy of the run whose validation.json claims three times the τ is a FAIL with both numbers
//! (exit 1); a missing or corrupt run exits 2.

use std::path::Path;

mod common;
use common::{check, dflash, regen_chats, run, smollm2};

fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn diagnose(run_dir: &Path, prompts: &str) -> (i32, serde_json::Value, String) {
    let (code, out, err) = run(dflash()
        .arg("diagnose")
        .arg("--run")
        .arg(run_dir)
        .args(["--dtype", "f32", "--bench", "gsm8k", "--limit", "1"])
        .args(["--max-new-tokens", "10", "--run-prompts", prompts]));
    let v = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: JSON on stdout: {err}"));
    (code, v, err)
}

#[test]
fn a_trained_run_is_diagnosed_from_its_records_and_a_planted_tau_fails() {
    let Some(g) = smollm2() else { return };
    let tmp = tempfile::tempdir().unwrap();

    // missing and corrupt runs are bad input, before any model loads
    let (code, _, err) = run(dflash()
        .arg("diagnose")
        .arg("--run")
        .arg(tmp.path().join("no-such-run")));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("run directory not found"), "{err}");
    let bare = tmp.path().join("bare");
    std::fs::create_dir_all(&bare).unwrap();
    let (code, _, err) = run(dflash().arg("diagnose").arg("--run").arg(&bare));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("diagnosis_inputs.json"), "{err}");

    // training data answered by the target itself (greedy, f32)
    let chats: Vec<serde_json::Value> = [
        "What is 7 times 8?",
        "Name three colours.",
        "What is the capital of France?",
        "How many legs does a spider have?",
        "Give me a synonym for happy.",
        "What is 15 plus 27?",
        "Name a planet.",
        "What does CPU stand for?",
    ]
    .iter()
    .map(|q| serde_json::json!([{ "role": "user", "content": q }]))
    .collect();
    let data = regen_chats(&g, tmp.path(), &chats, 10, 8);

    let out = tmp.path().join("run");
    let (code, _, err) = run(dflash()
        .arg("train")
        .arg("--target")
        .arg(&g)
        .arg("--data")
        .arg(&data)
        .arg("--out")
        .arg(&out)
        .args(["--layers", "1", "--block-size", "4", "--anchors", "8"])
        .args([
            "--max-steps",
            "2",
            "--val-fraction",
            "0.5",
            "--dtype",
            "f32",
        ])
        .args(["--export-dtype", "f32", "--diagnose-prompts", "1"])
        // a non-z-lab block layout and the final norm on the last tap, declared in the
        // exported config: validation, the record and every later decode of the drafter use them
        .args(["--block-position-offset=1", "--final-norm-on-last-tap"]));
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("train_vs_eval"), "the end-of-run table: {err}");

    // what train recorded
    let m = read_json(&out.join("diagnosis_inputs.json"));
    assert_eq!(m["version"], 1);
    assert_eq!(m["target"]["num_layers"], 30, "{}", m["target"]);
    assert_eq!(m["target"]["dtype"], "f32");
    let taps = m["drafter"]["target_layer_ids"].as_array().unwrap();
    assert_eq!(taps.len(), 1, "{}", m["drafter"]);
    assert_eq!(m["drafter"]["block_size"], 4);
    assert_eq!(m["drafter"]["position_offset"], 1);
    let exported = read_json(&out.join("drafter/config.json"));
    assert_eq!(
        exported["dflash_config"]["block_position_offset"], 1,
        "{exported}"
    );
    assert_eq!(m["drafter"]["anchor_slot_masked"], false);
    assert_eq!(m["drafter"]["final_norm_on_last_tap"], true);
    assert_eq!(
        exported["dflash_config"]["final_norm_on_last_tap"], true,
        "{exported}"
    );
    assert!(m["drafter"]["mask_token_id"].is_u64());
    assert_eq!(m["data"]["examples"], 8);
    assert_eq!(m["data"]["format"]["template"], "chat_ml", "{}", m["data"]);
    let recorded = m["validation"]["recorded"].as_array().unwrap();
    assert!(!recorded.is_empty(), "{}", m["validation"]);
    let tap = taps[0].to_string();
    assert!(m["tap_stats"]["layers"][&tap]["std"].as_f64().unwrap() > 0.0);
    let copied = read_json(&out.join("drafter/tap_stats.json"));
    assert_eq!(
        copied, m["tap_stats"],
        "the drafter carries the same statistics"
    );
    let end = read_json(&out.join("diagnosis.json"));
    assert_eq!(check(&end, "train_vs_eval")["verdict"], "ok", "{end}");

    // the diagnosis from the run's records alone; every recorded prompt decoded
    let (code, v, err) = diagnose(&out, "8");
    let c = check(&v, "train_vs_eval");
    assert_eq!(c["verdict"], "ok", "{c}\n{err}");
    let expected = if v["verdict"] == "FAIL" { 1 } else { 0 };
    assert_eq!(code, expected, "exit code follows the verdicts: {err}");
    assert!(!err.contains("error:"), "{err}");
    assert!(
        v["draft"].as_str().unwrap().ends_with("drafter"),
        "{}",
        v["draft"]
    );
    let te = &v["run"]["train_vs_eval"];
    assert_eq!(te["prompts"].as_u64().unwrap() as usize, recorded.len());
    let recorded_tau = te["validation"]["replayed_ddtree_tau"].as_f64().unwrap();
    let replayed = te["replayed_training_answers"]["ddtree"]["tau"]
        .as_f64()
        .unwrap();
    assert!(
        (replayed - recorded_tau).abs() < 1e-3 * recorded_tau,
        "the exported f32 drafter replays the validation's own text as validate did: {replayed} vs {recorded_tau}"
    );
    // a two-step drafter barely drafts: too weak to judge its conventions, a warn, never a FAIL
    let conv = check(&v, "conventions");
    let declared = v["conventions"]["variants"][0]["ddtree_tau"]
        .as_f64()
        .unwrap();
    assert!(declared < 1.5, "{declared}");
    assert_eq!(conv["verdict"], "warn", "{conv}");
    assert!(
        conv["cause"].as_str().unwrap().contains("too weak"),
        "{conv}"
    );
    let stats = check(&v, "tap_statistics");
    assert_eq!(stats["verdict"], "ok", "{stats}");
    assert!(
        stats["evidence"]
            .as_str()
            .unwrap()
            .contains("as recorded at training"),
        "{stats}"
    );
    let format = check(&v, "prompt_format");
    assert!(
        v["prompt_format"]["data"]
            .as_str()
            .unwrap()
            .contains("data"),
        "--data defaults to the run's: {format}"
    );

    // a copy of the run whose validation claims three times the τ
    let planted = tmp.path().join("planted");
    std::fs::create_dir_all(planted.join("drafter")).unwrap();
    std::fs::copy(
        out.join("diagnosis_inputs.json"),
        planted.join("diagnosis_inputs.json"),
    )
    .unwrap();
    for e in std::fs::read_dir(out.join("drafter")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), planted.join("drafter").join(e.file_name())).unwrap();
    }
    let mut val = read_json(&out.join("validation.json"));
    for k in ["replayed_tau", "replayed_ddtree_tau"] {
        val[k] = serde_json::json!(val[k].as_f64().unwrap() * 3.0);
    }
    std::fs::write(planted.join("validation.json"), val.to_string()).unwrap();
    let (code, v, err) = diagnose(&planted, "2");
    assert_eq!(code, 1, "{err}");
    assert!(!err.contains("error:"), "{err}");
    let c = check(&v, "train_vs_eval");
    assert_eq!(c["verdict"], "FAIL", "{c}");
    let claimed = format!("{:.2}", val["replayed_ddtree_tau"].as_f64().unwrap());
    let live = format!(
        "{:.2}",
        v["run"]["train_vs_eval"]["live"]["ddtree"]["tau"]
            .as_f64()
            .unwrap()
    );
    let evidence = c["evidence"].as_str().unwrap();
    assert!(
        evidence.contains(&format!("run's validation {claimed}, live decoding {live}")),
        "both numbers: {evidence}"
    );
    let cause = c["cause"].as_str().unwrap();
    assert!(cause.contains("validation.json records"), "{cause}");
    assert!(!c["fix"].as_str().unwrap().is_empty(), "{c}");
}
