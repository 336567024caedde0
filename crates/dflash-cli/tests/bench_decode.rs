//! `dflash bench decode` on the CPU at small shapes: the JSON has every field, each time is
//! positive and finite, and bad flags exit with code 2. No timing thresholds.

mod common;

use common::{dflash, run};
use serde_json::Value;

fn bench(args: &[&str]) -> Value {
    let (code, out, err) = run(dflash()
        .args(["bench", "decode", "--device", "cpu"])
        .args(args));
    assert_eq!(code, 0, "bench decode {args:?} failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("bad JSON ({e}): {out}"))
}

fn positive(v: &Value, what: &str) -> f64 {
    let x = v
        .as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {v}"));
    assert!(x.is_finite() && x > 0.0, "{what} = {x}");
    x
}

fn check(r: &Value, shape: &str, context: u64, widths: &[usize]) {
    assert_eq!(r["shape"], shape);
    assert_eq!(r["device"], "cpu");
    assert_eq!(r["dtype"], "f32");
    assert_eq!(r["context"], context);
    assert!(r["dflash_version"].is_string());
    for k in [
        "floor_ms",
        "ar_step_ms",
        "sampled_step_ms",
        "draft_block_ms",
        "tree_build_ms",
        "bytes_per_step",
        "copy_gbps",
        "params_target",
        "params_drafter",
    ] {
        positive(&r[k], k);
    }
    assert!(r["copy_method"].is_string());
    // which kernels ran: the CPU's row-invariant host kernels, f32 trees keyed by position
    let paths = &r["decode_paths"];
    assert_eq!(
        paths["attention"], "host (row-invariant CPU kernels)",
        "{paths}"
    );
    assert_eq!(paths["tree_keys"], "position", "{paths}");
    assert_eq!(paths["stream_tiled"], false, "{paths}");
    assert!(paths["stream_policy"].is_string(), "{paths}");
    let verify = r["verify_ms"].as_object().expect("verify_ms object");
    let mut keys = vec!["chain16".to_string()];
    keys.extend(widths.iter().map(|w| format!("tree{w}")));
    assert_eq!(verify.len(), keys.len(), "{verify:?}");
    for k in &keys {
        positive(&verify[k.as_str()], k);
    }
    let by_budget = r["tree_build_ms_by_budget"].as_object().expect("by budget");
    for w in widths.iter().chain([&64]) {
        positive(&by_budget[&w.to_string()], "tree_build_ms_by_budget");
    }
    for (op, s) in r["stats"].as_object().expect("stats") {
        let (min, med, p90) = (
            positive(&s["min_ms"], op),
            positive(&s["median_ms"], op),
            positive(&s["p90_ms"], op),
        );
        assert!(min <= med && med <= p90, "{op}: {s}");
        positive(&r["ratio_to_ar_step"][op], op);
        positive(&r["ratio_to_floor"][op], op);
    }
    for w in widths {
        assert_eq!(r["trees"][format!("tree{w}")]["nodes"], *w as u64 + 1);
    }
}

#[test]
fn tiny_shape_reports_every_field() {
    let r = bench(&["--shape", "tiny", "--context", "32", "--rounds", "2"]);
    check(&r, "tiny", 32, &[16, 64, 256]);
    assert_eq!(r["rounds"], 2);
    // the report file is the same JSON
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("decode.json");
    let r = bench(&[
        "--shape",
        "tiny",
        "--context",
        "16",
        "--rounds",
        "1",
        "--warmup",
        "1",
        "--widths",
        "8",
        "--out",
        out.to_str().unwrap(),
    ]);
    check(&r, "tiny", 16, &[8]);
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(saved["verify_ms"], r["verify_ms"]);
}

/// `bench decode --target fixtures/NAME` at context 16, one tree width, checked field by field.
fn bench_fixture(name: &str, width: usize) -> Value {
    let dir = common::root().join("fixtures").join(name);
    let dir = dir.to_str().unwrap();
    let r = bench(&[
        "--target",
        dir,
        "--context",
        "16",
        "--rounds",
        "1",
        "--warmup",
        "1",
        "--widths",
        &width.to_string(),
    ]);
    check(&r, dir, 16, &[width]);
    r
}

#[test]
fn target_config_gives_the_shape() {
    assert_eq!(bench_fixture("tiny-qwen3", 16)["architecture"], "qwen3");
}

/// A Qwen3.5 hybrid's config (Gated DeltaNet and gated full-attention layers): every op runs on
/// its recurrent caches, the report names the architecture and times the state commit, after a
/// chain and (with width 64) after a tree's path (a dense target has neither).
#[test]
fn hybrid_target_config_runs() {
    let r = bench_fixture("tiny-qwen3.5", 64);
    assert_eq!(r["architecture"], "qwen3_5");
    assert!(r["state_commit_ms"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["tree_commit_ms"].as_f64().unwrap() > 0.0, "{r}");
    // the CPU settles each commit before the next step (the fold is CUDA's)
    assert!(r["state_commit_folded_ms"].is_null(), "{r}");
    let dense = bench_fixture("tiny-qwen3", 64);
    assert!(dense["state_commit_ms"].is_null());
    assert!(dense["tree_commit_ms"].is_null());
}

#[test]
fn smollm2_shape_runs_on_the_cpu() {
    let r = bench(&[
        "--shape",
        "smollm2-135m",
        "--context",
        "64",
        "--rounds",
        "1",
        "--warmup",
        "1",
        "--widths",
        "16",
    ]);
    check(&r, "smollm2-135m", 64, &[16]);
    // SmolLM2-135M: 134.5 M parameters, tied embeddings
    assert_eq!(r["params_target"], 134_515_008u64);
}

#[test]
fn bad_flags_exit_with_code_2() {
    for args in [
        &["--shape", "gpt-7"][..],
        &["--shape", "tiny", "--rounds", "0"],
        &["--shape", "tiny", "--widths", "16,zero"],
        &["--shape", "tiny", "--widths", "0"],
        &["--shape", "tiny", "--context", "4090"],
        &["--shape", "tiny", "--dtype", "int8"],
        &["--shape", "tiny", "--device", "tpu"],
        &["--shape", "tiny", "--target", "/nonexistent"],
        &["--target", "/nonexistent/model"],
    ] {
        let (code, out, err) = run(dflash().args(["bench", "decode"]).args(args));
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?} printed {out}");
        assert!(!err.is_empty());
    }
}
