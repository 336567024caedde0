//! `dflash diagnose` end to end on SmolLM2 (f32, CPU): the shipped pair gets no FAIL and every
//! check in its JSON; a copy of the shipped drafter whose config declares every tap one layer too
//! deep is a FAIL of the conventions scan naming the −1 shift (exit 1, no "error:" line); recorded
//! tap statistics round-trip and a planted shift in them is a FAIL; planted configs (the last tap
//! on the last layer, another RoPE base, another mask token, sliding-window layers, block
//! positions one off, the mask token in slot 0) are each a FAIL naming the setting; a drafter
//! saved by z-lab's own package is diagnosed without a run directory; bad input exits 2.

use std::path::Path;

mod common;
use common::{check, dflash, root, run, smollm2};

fn diagnose(target: &Path, draft: &Path, extra: &[&str]) -> (i32, String, String) {
    run(dflash()
        .arg("diagnose")
        .arg("--target")
        .arg(target)
        .arg("--draft")
        .arg(draft)
        .args(["--dtype", "f32", "--max-new-tokens", "48"])
        .args(extra))
}

/// A copy of the shipped drafter in `dir`.
fn copy_drafter(dir: &Path) {
    let src = root().join("drafters/smollm2-135m-instruct");
    std::fs::create_dir_all(dir).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
}

#[test]
fn shipped_pair_passes_and_recorded_statistics_catch_a_shift() {
    let Some(g) = smollm2() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let draft = tmp.path().join("drafter");
    copy_drafter(&draft);
    let json_out = tmp.path().join("diagnose.json");
    let png = tmp.path().join("variants.png");
    let (code, out, err) = diagnose(
        &g,
        &draft,
        &[
            "--bench",
            "gsm8k",
            "--limit",
            "2",
            "--record-stats",
            "--json-out",
            json_out.to_str().unwrap(),
            "--plot",
            png.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("error:"), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON on stdout");
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_out).unwrap()).unwrap();
    assert_eq!(
        saved["checks"], v["checks"],
        "--json-out holds the same result"
    );
    assert_eq!(v["prompts"], 2);
    for name in ["conventions", "target_integrity", "tap_statistics"] {
        let c = check(&v, name);
        assert_eq!(c["verdict"], "ok", "{c}");
        assert!(!c["evidence"].as_str().unwrap().is_empty(), "{c}");
    }
    assert_eq!(v["verdict"], "ok");
    let variants = v["conventions"]["variants"].as_array().unwrap();
    let names: Vec<&str> = variants
        .iter()
        .map(|x| x["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "declared",
            "taps -1",
            "taps +1",
            "final norm on last tap",
            "last tap on last layer",
            "positions -1",
            "positions +1",
            "slot 0 masked",
            "mask 2 (eos)"
        ]
    );
    assert_eq!(
        variants[0]["target_layer_ids"],
        serde_json::json!([1, 8, 14, 20, 27])
    );
    let declared = variants[0]["ddtree_tau"].as_f64().unwrap();
    assert!(declared > 2.0, "the shipped drafter drafts: {declared}");
    for x in variants {
        let lo = x["ddtree_tau_ci95"][0].as_f64().unwrap();
        let hi = x["ddtree_tau_ci95"][1].as_f64().unwrap();
        let t = x["ddtree_tau"].as_f64().unwrap();
        assert!(lo <= t && t <= hi && t >= 1.0, "{x}");
    }
    let integ = &v["target_integrity"];
    assert_eq!(integ["argmax_agreement"], 1.0, "{integ}");
    assert!(integ["positions"].as_u64().unwrap() >= 2, "{integ}");
    assert!(err.contains("conventions") && err.contains("final norm on last tap"));
    assert_eq!(&std::fs::read(&png).expect("--plot")[1..4], b"PNG");

    // --record-stats wrote the statistics it measured
    let stats_path = draft.join("tap_stats.json");
    let mut stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats_path).unwrap()).unwrap();
    assert_eq!(stats, v["tap_statistics"]["measured"]);
    assert_eq!(stats["layers"].as_object().unwrap().len(), 5);
    // statistics "recorded" on another layer path: the last tap's norm 40 % off
    let norm = stats["layers"]["27"]["norm"].as_f64().unwrap();
    stats["layers"]["27"]["norm"] = serde_json::json!(norm * 1.4);
    std::fs::write(&stats_path, stats.to_string()).unwrap();
    let (code, out, err) = diagnose(&g, &draft, &["--bench", "gsm8k", "--limit", "1"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        !err.contains("error:"),
        "a FAIL is reported, not an error: {err}"
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let c = check(&v, "tap_statistics");
    assert_eq!(c["verdict"], "FAIL", "{c}");
    assert!(c["cause"].as_str().unwrap().contains("tap 27"), "{c}");
    assert_eq!(v["verdict"], "FAIL");

    // a malformed statistics file is bad input
    std::fs::write(&stats_path, "{").unwrap();
    let (code, _, err) = diagnose(&g, &draft, &["--bench", "gsm8k", "--limit", "1"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("tap_stats.json"), "{err}");
}

#[test]
fn a_planted_tap_shift_fails_and_names_the_layers() {
    let Some(g) = smollm2() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let draft = tmp.path().join("drafter");
    copy_drafter(&draft);
    let cfg_path = draft.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let ids = &mut cfg["dflash_config"]["target_layer_ids"];
    assert_eq!(*ids, serde_json::json!([1, 8, 14, 20, 27]));
    *ids = serde_json::json!([2, 9, 15, 21, 28]);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let (code, out, err) = diagnose(&g, &draft, &["--bench", "gsm8k,humaneval", "--limit", "2"]);
    assert_eq!(code, 1, "{err}");
    assert!(!err.contains("error:"), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let c = check(&v, "conventions");
    assert_eq!(c["verdict"], "FAIL", "{c}");
    let fix = c["fix"].as_str().unwrap();
    assert!(
        fix.contains("shifted by \u{2212}1")
            && fix.contains("[2, 9, 15, 21, 28] \u{2192} [1, 8, 14, 20, 27]"),
        "{fix}"
    );
    assert!(err.contains("FAIL") && err.contains("shifted by"), "{err}");
}

/// The story's "fc fed the target's last layer": a config whose last tap is the target's last
/// layer (29) for a drafter trained on layer 27 is a FAIL naming the default taps.
#[test]
fn a_planted_last_layer_tap_fails_and_names_the_layer() {
    let Some(g) = smollm2() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let draft = tmp.path().join("drafter");
    copy_drafter(&draft);
    let cfg_path = draft.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["dflash_config"]["target_layer_ids"] = serde_json::json!([1, 8, 14, 20, 29]);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let (code, out, err) = diagnose(&g, &draft, &["--bench", "gsm8k,humaneval", "--limit", "2"]);
    assert_eq!(code, 1, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let c = check(&v, "conventions");
    assert_eq!(c["verdict"], "FAIL", "{c}");
    let cause = c["cause"].as_str().unwrap();
    assert!(
        cause.contains("last layer (29)") && cause.contains("layer 27"),
        "{cause}"
    );
    let fix = c["fix"].as_str().unwrap();
    assert!(
        fix.contains("[1, 8, 14, 20, 29] \u{2192} [1, 8, 14, 20, 27]"),
        "{fix}"
    );
}

/// A drafter config declaring another RoPE base than the target's (and than it was trained with)
/// is a FAIL naming the target's θ.
#[test]
fn a_planted_rope_theta_fails_and_names_the_target_theta() {
    let Some(g) = smollm2() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let draft = tmp.path().join("drafter");
    copy_drafter(&draft);
    let cfg_path = draft.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    assert_eq!(cfg["rope_theta"], serde_json::json!(100000.0));
    cfg["rope_theta"] = serde_json::json!(10000.0);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let (code, out, err) = diagnose(&g, &draft, &["--bench", "gsm8k,humaneval", "--limit", "2"]);
    assert_eq!(code, 1, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let c = check(&v, "conventions");
    assert_eq!(c["verdict"], "FAIL", "{c}");
    let fix = c["fix"].as_str().unwrap();
    assert!(fix.contains("rope_theta to 100000"), "{fix}");
}

/// A copy of the shipped drafter with `edit` applied to its config, diagnosed on two short
/// answers: (exit code, the conventions check, stderr).
fn diagnose_planted(edit: impl Fn(&mut serde_json::Value)) -> (i32, serde_json::Value, String) {
    let g = smollm2().expect("checked by the caller");
    let tmp = tempfile::tempdir().unwrap();
    let draft = tmp.path().join("drafter");
    copy_drafter(&draft);
    let cfg_path = draft.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let (code, out, err) = diagnose(&g, &draft, &["--bench", "gsm8k,humaneval", "--limit", "1"]);
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: JSON on stdout: {err}"));
    (code, check(&v, "conventions").clone(), err)
}

/// A config declaring another mask token (the target's EOS, 2) than the drafter was trained
/// with (16, `draft init`'s rule) is a FAIL naming 16.
#[test]
fn a_planted_mask_token_fails_and_names_the_token() {
    if smollm2().is_none() {
        return;
    }
    let (code, c, err) = diagnose_planted(|cfg| {
        assert_eq!(cfg["dflash_config"]["mask_token_id"], 16);
        cfg["dflash_config"]["mask_token_id"] = serde_json::json!(2);
    });
    assert_eq!(code, 1, "{err}");
    assert_eq!(c["verdict"], "FAIL", "{c}");
    let fix = c["fix"].as_str().unwrap();
    assert!(fix.contains("mask_token_id to 16"), "{fix}\n{err}");
}

/// A config declaring sliding-window layers (window 4) for a drafter trained with full
/// attention is a FAIL naming full attention.
#[test]
fn a_planted_sliding_window_fails_and_names_full_attention() {
    if smollm2().is_none() {
        return;
    }
    let (code, c, err) = diagnose_planted(|cfg| {
        cfg["layer_types"] = serde_json::json!(vec!["sliding_attention"; 5]);
        cfg["sliding_window"] = serde_json::json!(4);
    });
    assert_eq!(code, 1, "{err}");
    assert_eq!(c["verdict"], "FAIL", "{c}");
    let fix = c["fix"].as_str().unwrap();
    assert!(fix.contains("full_attention"), "{fix}\n{err}");
}

/// A config declaring the block's positions one higher (`block_position_offset` 1: slot `j` at
/// `anchor + j + 1`) than the drafter was trained with (the z-lab layout) is a FAIL naming the
/// offset to set; so is one declaring the mask token in slot 0 for a drafter trained with the
/// anchor's token there.
#[test]
fn a_planted_block_layout_fails_and_names_the_config_field() {
    if smollm2().is_none() {
        return;
    }
    let (code, c, err) = diagnose_planted(|cfg| {
        assert!(cfg["dflash_config"].get("block_position_offset").is_none());
        cfg["dflash_config"]["block_position_offset"] = serde_json::json!(1);
    });
    assert_eq!(code, 1, "{err}");
    assert_eq!(c["verdict"], "FAIL", "{c}");
    let fix = c["fix"].as_str().unwrap();
    assert!(
        fix.contains("block_position_offset 1 \u{2192} 0"),
        "{fix}\n{err}"
    );
    let (code, c, err) = diagnose_planted(|cfg| {
        cfg["dflash_config"]["anchor_slot_masked"] = serde_json::json!(true);
    });
    assert_eq!(code, 1, "{err}");
    assert_eq!(c["verdict"], "FAIL", "{c}");
    let fix = c["fix"].as_str().unwrap();
    assert!(
        fix.contains("remove dflash_config.anchor_slot_masked"),
        "{fix}\n{err}"
    );
}

/// A config declaring the target's final norm on the last tap (`final_norm_on_last_tap`, which
/// the drafter then applies itself) for a drafter trained on raw layer outputs is a FAIL naming
/// the field to remove.
#[test]
fn a_planted_final_norm_on_the_last_tap_fails_and_names_the_config_field() {
    if smollm2().is_none() {
        return;
    }
    let (code, c, err) = diagnose_planted(|cfg| {
        assert!(cfg["dflash_config"].get("final_norm_on_last_tap").is_none());
        cfg["dflash_config"]["final_norm_on_last_tap"] = serde_json::json!(true);
    });
    assert_eq!(code, 1, "{err}");
    assert_eq!(c["verdict"], "FAIL", "{c}");
    assert!(
        c["cause"]
            .as_str()
            .unwrap()
            .contains("no final norm on last tap"),
        "{c}"
    );
    let fix = c["fix"].as_str().unwrap();
    assert!(
        fix.contains("remove dflash_config.final_norm_on_last_tap"),
        "{fix}\n{err}"
    );
}

/// A drafter saved by z-lab's own package (PyPI `dflash`, transformers 5's config layout:
/// `rope_parameters` instead of `rope_theta`, fixtures/zlab-pypi-smollm2) with the shipped weights
/// is diagnosed without a run directory as the shipped drafter is: no FAIL, the declared taps, the
/// RoPE base read (no target-RoPE variant), and the drafter drafts.
#[test]
fn a_zlab_package_drafter_is_diagnosed_without_a_run() {
    let Some(g) = smollm2() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let draft = tmp.path().join("drafter");
    copy_drafter(&draft);
    std::fs::copy(
        root().join("fixtures/zlab-pypi-smollm2/config.json"),
        draft.join("config.json"),
    )
    .unwrap();
    let (code, out, err) = diagnose(&g, &draft, &["--bench", "gsm8k", "--limit", "1"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_ne!(v["verdict"], "FAIL", "{err}");
    let variants = v["conventions"]["variants"].as_array().unwrap();
    assert_eq!(
        variants[0]["target_layer_ids"],
        serde_json::json!([1, 8, 14, 20, 27])
    );
    assert!(
        variants.iter().all(|x| x["alteration"] != "target_rope"),
        "rope_parameters' theta is read: {err}"
    );
    let declared = variants[0]["ddtree_tau"].as_f64().unwrap();
    assert!(declared > 1.5, "the package's drafter drafts: {declared}");
}

#[test]
fn bad_input_exits_2_naming_it() {
    let Some(g) = smollm2() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-drafter");
    let (code, out, err) = diagnose(&g, &missing, &["--limit", "1"]);
    assert_eq!(code, 2, "{err}");
    assert!(out.is_empty(), "{out}");
    assert!(err.contains("no-such-drafter"), "{err}");
    let draft = root().join("drafters/smollm2-135m-instruct");
    for (flags, needle) in [
        (&["--limit", "0"][..], "at least 1"),
        (&["--bench", "nope"][..], "unknown benchmark"),
        (
            &["--bench", "/no/such/prompts.jsonl"][..],
            "/no/such/prompts.jsonl",
        ),
    ] {
        let (code, _, err) = diagnose(&g, &draft, flags);
        assert_eq!(code, 2, "{flags:?}: {err}");
        assert!(err.contains(needle), "{flags:?}: {err}");
    }
}
