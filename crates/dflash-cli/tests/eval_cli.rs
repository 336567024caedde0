//! `dflash eval` end to end on SmolLM2 with its shipped drafter (f32, CPU): every speculative run
//! is token-identical to AR, τ lies in [1, block] inside its bootstrap interval with one τ per
//! prompt, several `--tree-budget`s give one `ddtree-N` summary each, `--replay` (the training-mode
//! forward walked as decoding walks) reproduces every prompt's measured steps, `--plot` draws the
//! histograms, and bad values are refused.

use std::path::Path;

mod common;
use common::{dflash, run, smollm2};

fn eval(target: &Path, bench: &Path, extra: &[&str]) -> (i32, String, String) {
    run(dflash()
        .arg("eval")
        .arg("--target")
        .arg(target)
        .arg("--bench")
        .arg(bench)
        .args(["--limit", "2", "--max-new-tokens", "24", "--dtype", "f32"])
        .args(extra))
}

#[test]
fn eval_is_lossless_with_intervals_and_one_summary_per_budget() {
    let Some(g) = smollm2() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let bench = tmp.path().join("mini.jsonl");
    std::fs::write(
        &bench,
        "{\"prompt\": \"List three prime numbers.\"}\n{\"prompt\": \"What is the capital of France?\"}\n\
         {\"prompt\": \"never reached: --limit 2\"}\n",
    )
    .unwrap();
    let (code, out, err) = eval(
        &g,
        &bench,
        &[
            "--modes",
            "ar,dflash,ddtree",
            "--tree-budget",
            "8,32",
            "--replay",
            "--plot",
            tmp.path().join("eval.png").to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON on stdout");
    assert_eq!(v["tree_budget"], serde_json::json!([8, 32]));
    let modes = v["results"][0]["modes"].as_array().unwrap();
    let names: Vec<&str> = modes.iter().map(|m| m["mode"].as_str().unwrap()).collect();
    assert_eq!(names, ["ar", "dflash", "ddtree-8", "ddtree-32"]);
    assert_eq!(modes[2]["tree_budget"], 8);
    let block = v["block_size"].as_f64().unwrap();
    for m in &modes[1..] {
        assert_eq!(m["prompts"], 2, "{m}");
        assert_eq!(m["identical_to_ar"], 2, "lossless: {m}");
        let tau = m["acceptance_length_mean"].as_f64().unwrap();
        assert!((1.0..=block).contains(&tau), "{m}");
        let ci = m["acceptance_length_ci95"].as_array().unwrap();
        let (lo, hi) = (ci[0].as_f64().unwrap(), ci[1].as_f64().unwrap());
        assert!(
            lo <= tau && tau <= hi,
            "τ {tau} outside its interval {lo}-{hi}"
        );
        let per = m["acceptance_length_per_prompt"].as_array().unwrap();
        assert_eq!(per.len(), 2, "{m}");
        assert!(m["speedup_vs_ar"].as_f64().unwrap() > 0.0);
        // the training-mode forward, walked as decoding walks, reproduces the measured steps
        assert_eq!(m["replay_matches"], 2, "train/inference parity: {m}");
        let replayed = m["replayed_tau"].as_f64().unwrap();
        assert!((1.0..=block).contains(&replayed), "{m}");
        let all = m["teacher_forced_tau"].as_f64().unwrap();
        assert!((1.0..=block).contains(&all), "{m}");
    }
    assert!(
        modes[0].get("replayed_tau").is_none(),
        "AR has nothing to replay"
    );
    let png = std::fs::read(tmp.path().join("eval.png")).expect("--plot writes the PNG");
    assert_eq!(&png[1..4], b"PNG");
    assert!(
        err.contains("ddtree-32"),
        "the table names each budget: {err}"
    );

    for (flags, needle) in [
        (&["--tree-budget", "0"][..], "at least 1"),
        (&["--modes", "dflash,ar"][..], "must start with ar"),
    ] {
        let (code, _, err) = eval(&g, &bench, flags);
        assert_eq!(code, 2, "{flags:?}: {err}");
        assert!(err.contains(needle), "{flags:?}: {err}");
    }
}
