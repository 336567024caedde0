//! The drafter shipped in `drafters/smollm2-135m-instruct/`: its files are in the z-lab layout with
//! shards of at most 16 MiB, it is found without `--draft` when the target is SmolLM2, speculative
//! output with it equals autoregressive output, and it accepts drafted tokens (τ well above the 1.0 a
//! drafter that never matches would give).

use std::path::{Path, PathBuf};

mod common;
use common::{dflash, root, run, smollm2};

fn drafter_dir() -> PathBuf {
    root().join("drafters/smollm2-135m-instruct")
}

#[test]
fn files_are_in_the_zlab_layout_with_small_shards() {
    let dir = drafter_dir();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "DFlashDraftModel");
    assert_eq!(config["hidden_size"], 576, "SmolLM2-135M's hidden size");
    assert_eq!(config["vocab_size"], 49152, "SmolLM2's vocabulary");
    assert_eq!(config["num_target_layers"], 30);
    let taps = config["dflash_config"]["target_layer_ids"]
        .as_array()
        .unwrap();
    assert_eq!(taps.len(), 5);
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let mut shards: Vec<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
    shards.sort();
    shards.dedup();
    assert!(!shards.is_empty());
    for s in shards {
        let len = std::fs::metadata(dir.join(s)).unwrap().len();
        assert!(len <= 16 * 1024 * 1024, "{s} is {len} bytes");
    }
    for name in ["fc.weight", "hidden_norm.weight", "norm.weight"] {
        assert!(map.contains_key(name), "index lacks {name}");
    }
    assert!(
        !map.keys()
            .any(|k| k.contains("embed_tokens") || k.contains("lm_head")),
        "the target's embedding and head are never copied into the drafter"
    );
}

/// `dflash generate --target TARGET ARGS…` from the repository root, without `--draft` or
/// `$DFLASH_DRAFT` (so the shipped drafter is found by default): (exit code, stdout, stderr).
fn generate_on(target: &Path, args: &[&str]) -> (i32, String, String) {
    run(dflash()
        .current_dir(root())
        .env_remove("DFLASH_DRAFT")
        .arg("generate")
        .arg("--target")
        .arg(target)
        .args(args))
}

/// `dflash generate --mode MODE` on the default target without `--draft`; (stdout, stderr).
fn generate(target: &Path, mode: &str) -> (String, String) {
    let (code, out, err) = generate_on(
        target,
        &[
            "--mode",
            mode,
            "--max-new-tokens",
            "48",
            "--prompt",
            "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?",
        ],
    );
    assert_eq!(code, 0, "{mode}: {err}");
    (out, err)
}

fn tau(stderr: &str) -> f64 {
    let after = stderr
        .split("tau ")
        .nth(1)
        .unwrap_or_else(|| panic!("no tau in {stderr}"));
    after.split_whitespace().next().unwrap().parse().unwrap()
}

#[test]
fn found_by_default_lossless_and_accepting() {
    let Some(target) = smollm2() else { return };
    let (ar, _) = generate(&target, "ar");
    assert!(!ar.trim().is_empty());
    for mode in ["dflash", "ddtree"] {
        let (text, err) = generate(&target, mode);
        assert_eq!(text, ar, "{mode} output differs from AR");
        let t = tau(&err);
        assert!(
            t > 1.3,
            "{mode}: τ {t} — the shipped drafter barely accepts ({err})"
        );
    }
}

#[test]
fn ddtree_uses_the_shared_default_budget_and_reports_it() {
    let Some(target) = smollm2() else { return };
    let (code, out, err) = generate_on(
        &target,
        &[
            "--mode",
            "ddtree",
            "--max-new-tokens",
            "8",
            "--json",
            "--prompt",
            "Name a prime number.",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        report["tree_budget"],
        dflash_decoding::tree::DEFAULT_TREE_BUDGET,
        "generate's default budget is eval's"
    );
}

#[test]
fn no_default_drafter_for_another_target() {
    let Some(target) = smollm2() else { return };
    // the same weights under another name: nothing ships for it, so `--draft` is required
    let tmp = tempfile::tempdir().unwrap();
    let other = tmp.path().join("other-model.gguf");
    std::os::unix::fs::symlink(&target, &other).unwrap();
    let (code, _, err) = generate_on(
        &other,
        &[
            "--mode",
            "dflash",
            "--max-new-tokens",
            "2",
            "--prompt",
            "hi",
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no drafter ships"), "{err}");
}

#[test]
fn auto_is_the_default_lossless_and_reports_its_choice() {
    let Some(target) = smollm2() else { return };
    let prompt = "Name three prime numbers and add them up.";
    let args = |mode: Option<&str>| -> serde_json::Value {
        let mut a = vec!["--max-new-tokens", "40", "--json", "--prompt", prompt];
        if let Some(m) = mode {
            a.extend(["--mode", m]);
        }
        let (code, out, err) = generate_on(&target, &a);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str(&out).unwrap()
    };
    let auto = args(None);
    let ar = args(Some("ar"));
    assert_eq!(auto["mode"], "auto", "auto is the default mode");
    assert_eq!(auto["text"], ar["text"], "auto output differs from AR");
    assert!(auto["auto"]["ar_step_seconds"].as_f64().unwrap() > 0.0);
    assert_eq!(
        auto["tree_budget"],
        dflash_decoding::tree::DEFAULT_TREE_BUDGET
    );
    // no drafter ships for another name: auto decodes with AR instead of failing
    let tmp = tempfile::tempdir().unwrap();
    let other = tmp.path().join("other-model.gguf");
    std::os::unix::fs::symlink(&target, &other).unwrap();
    let (code, _, err) = generate_on(&other, &["--max-new-tokens", "2", "--prompt", "hi"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("auto -> ar (no drafter)"), "{err}");
}

/// Auto mode remembers what it measured: a record of speculation at under half AR's rate makes the
/// next run decode with AR from the first token (same text, reported as such); a record of fast
/// speculation leaves the choice to live measurement.
#[test]
fn auto_mode_remembers_its_measurement() {
    let Some(target) = smollm2() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let memory = tmp.path().join("auto-mode.json");
    let gen = |mode: &str| -> serde_json::Value {
        let (code, out, err) = run(dflash()
            .current_dir(root())
            .env_remove("DFLASH_DRAFT")
            .env("DFLASH_AUTO_MEMORY", &memory)
            .args([
                "generate",
                "--json",
                "--max-new-tokens",
                "40",
                "--mode",
                mode,
            ])
            .arg("--target")
            .arg(&target)
            .args(["--prompt", "Name three prime numbers and add them up."]));
        assert_eq!(code, 0, "{err}");
        serde_json::from_str(&out).unwrap()
    };
    let ar = gen("ar");
    assert!(!memory.exists(), "only auto mode records");
    let first = gen("auto");
    assert!(first["auto"].get("remembered").is_none());
    // the one record, rewritten to a chosen verdict
    let set_rates = |spec: f64, ar_rate: f64| {
        let mut file: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&memory).expect("auto run recorded")).unwrap();
        let entries = file["entries"].as_object_mut().unwrap();
        assert_eq!(entries.len(), 1, "{entries:?}");
        let e = entries.values_mut().next().unwrap();
        e["spec_tokens_per_second"] = spec.into();
        e["ar_tokens_per_second"] = ar_rate.into();
        e["spec_steps"] = 8.into();
        std::fs::write(&memory, serde_json::to_vec(&file).unwrap()).unwrap();
    };
    set_rates(10.0, 100.0);
    let remembered = gen("auto");
    assert_eq!(remembered["text"], ar["text"], "AR from the start is AR");
    assert_eq!(remembered["auto"]["switched_to_ar_at_step"], 0);
    assert_eq!(
        remembered["auto"]["remembered"]["spec_tokens_per_second"],
        10.0
    );
    assert!(
        remembered.get("acceptance_length_mean").is_none(),
        "no speculative step"
    );
    set_rates(1000.0, 100.0);
    let live = gen("auto");
    assert!(live["auto"].get("remembered").is_none(), "{live}");
    assert_ne!(live["auto"]["switched_to_ar_at_step"], 0);
    assert_eq!(live["text"], ar["text"]);
}

/// `--bit-exact` on the CPU in bf16: DFlash and DDTree give exactly the AR tokens (the CPU's
/// row-invariant kernels; without the flag the CPU's bf16 verify rows round differently from AR
/// steps).
#[test]
fn bit_exact_bf16_on_the_cpu_equals_ar() {
    let Some(target) = smollm2() else { return };
    let run_mode = |mode: &str| {
        let (code, out, err) = generate_on(
            &target,
            &[
                "--bit-exact",
                "--dtype",
                "bf16",
                "--mode",
                mode,
                "--max-new-tokens",
                "16",
                "--prompt",
                "Natalia sold clips to 48 of her friends in April. How many clips?",
            ],
        );
        assert_eq!(code, 0, "{mode}: {err}");
        out
    };
    let ar = run_mode("ar");
    assert!(!ar.trim().is_empty());
    for mode in ["dflash", "ddtree"] {
        assert_eq!(
            run_mode(mode),
            ar,
            "{mode} differs from AR under --bit-exact"
        );
    }
}
