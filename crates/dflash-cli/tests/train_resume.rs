//! `dflash train --resume` end to end: a run stopped by its time limit and resumed logs exactly
//! the losses of an uninterrupted run, and a resume that asks for other settings (here the
//! learning rate) is refused with exit code 2 instead of silently training another schedule.

use std::path::Path;

mod common;
use common::{dflash, root, run};

fn train(data: &Path, out: &Path, extra: &[&str]) -> (i32, String) {
    let (code, _, err) = run(dflash()
        .arg("train")
        .arg("--target")
        .arg(root().join("fixtures/tiny-llama"))
        .arg("--data")
        .arg(data)
        .arg("--out")
        .arg(out)
        .args(["--layers", "1", "--block-size", "4", "--anchors", "4"])
        .args(["--batch-tokens", "60", "--max-steps", "6", "--dtype", "f32"])
        .args(["--val-fraction", "0"])
        .args(extra));
    (code, err)
}

fn losses(out: &Path) -> Vec<String> {
    std::fs::read_to_string(out.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            format!("{} {}", v["step"], v["loss"])
        })
        .collect()
}

#[test]
fn interrupted_and_resumed_equals_straight_and_changed_flags_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let lines: Vec<String> = (0..8u32)
        .map(|k| {
            let toks: Vec<u32> = (0..30).map(|i| (i * 7 + k * 31 + 3) % 263).collect();
            let mask: Vec<u8> = (0..30).map(|i| u8::from(i >= 6)).collect();
            serde_json::json!({"tokens": toks, "loss_mask": mask}).to_string()
        })
        .collect();
    std::fs::write(data.join("shard-00000.jsonl"), lines.join("\n") + "\n").unwrap();

    let straight = tmp.path().join("straight");
    let (code, err) = train(&data, &straight, &[]);
    assert_eq!(code, 0, "{err}");
    let expected = losses(&straight);
    assert_eq!(expected.len(), 6, "{expected:?}");
    // the end-of-run validation reports the streaks and the replayed τ side by side
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(straight.join("validation.json")).unwrap()).unwrap();
    for k in [
        "streak",
        "ddtree_streak",
        "replayed_tau",
        "replayed_ddtree_tau",
    ] {
        let x = v[k].as_f64().unwrap_or_else(|| panic!("no {k} in {v}"));
        assert!((1.0..=16.0).contains(&x), "{k} {x} in {v}");
    }

    let stopped = tmp.path().join("stopped");
    let (code, err) = train(&data, &stopped, &["--time-limit", "0"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        losses(&stopped).len(),
        1,
        "a zero time limit stops after one step"
    );
    let (code, err) = train(&data, &stopped, &["--resume", "--lr", "1e-3"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--lr: checkpoint 0.0006, now 0.001"),
        "the refusal names the flag and both values: {err}"
    );
    assert_eq!(losses(&stopped).len(), 1, "a refused resume trains nothing");
    let (code, err) = train(&data, &stopped, &["--resume"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        losses(&stopped),
        expected,
        "resumed run = uninterrupted run"
    );
    // the micro-batch split may change on resume (it only regroups one step's sums)
    let (code, err) = train(&data, &stopped, &["--resume", "--micro-batch-tokens", "30"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        losses(&stopped),
        expected,
        "a finished run trains no more steps"
    );
}
