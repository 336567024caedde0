//! Every bad input exits with code 2 and a message naming what is wrong — never a panic.

use std::path::{Path, PathBuf};

mod common;
use common::{dflash, root, run, smollm2};

/// Runs `dflash generate` with `args`; returns (exit code, stderr).
fn generate(target: &Path, extra: &[&str]) -> (i32, String) {
    let (code, _, err) = run(dflash()
        .arg("generate")
        .arg("--target")
        .arg(target)
        .args(if extra.contains(&"--prompt") {
            &[][..]
        } else {
            &["--prompt", "hi"][..]
        })
        .args(["--max-new-tokens", "2"])
        .args(extra));
    (code, err)
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

fn tiny_copy(tmp: &Path) -> PathBuf {
    let d = tmp.join("tiny");
    copy_dir(&root().join("fixtures/tiny-llama"), &d);
    d
}

#[test]
fn missing_target_path() {
    let (code, err) = generate(Path::new("/nonexistent/model"), &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("/nonexistent/model"), "{err}");
}

#[test]
fn truncated_safetensors() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tiny_copy(tmp.path());
    let f = d.join("model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    let (code, err) = generate(&d, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("model.safetensors") && err.contains("corrupt"),
        "{err}"
    );
}

#[test]
fn missing_weights_file() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tiny_copy(tmp.path());
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    let (code, err) = generate(&d, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn unknown_architecture_and_missing_config_field() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tiny_copy(tmp.path());
    let cfg_path = d.join("config.json");
    let cfg = std::fs::read_to_string(&cfg_path).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    v["model_type"] = "gpt_neox".into();
    v["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"]);
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    let (code, err) = generate(&d, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("unsupported architecture 'gpt_neox'"), "{err}");

    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    v.as_object_mut().unwrap().remove("hidden_size");
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    let (code, err) = generate(&d, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("hidden_size") && err.contains("config.json"),
        "{err}"
    );
}

#[test]
fn weight_with_wrong_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tiny_copy(tmp.path());
    let cfg_path = d.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    v["intermediate_size"] = 100.into();
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    let (code, err) = generate(&d, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("shape"), "{err}");
}

#[test]
fn model_without_tokenizer() {
    let (code, err) = generate(&root().join("fixtures/tiny-llama"), &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("tokenizer"), "{err}");
}

#[test]
fn corrupt_and_truncated_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    let junk = tmp.path().join("junk.gguf");
    std::fs::write(&junk, b"this is not a gguf file at all").unwrap();
    let (code, err) = generate(&junk, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("junk.gguf"), "{err}");
    let Some(real) = smollm2() else { return };
    let cut = tmp.path().join("cut.gguf");
    let bytes = std::fs::read(real).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() - 1_000_000]).unwrap();
    let (code, err) = generate(&cut, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("cut.gguf") && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn bad_flag_values() {
    let t = root().join("fixtures/tiny-llama");
    for (flags, needle) in [
        (&["--device", "gpu"][..], "bad device"),
        (&["--dtype", "int8"][..], "bad dtype"),
        (&["--max-new-tokens", "0"][..], "max-new-tokens"),
        (&["--mode", "nonsense"][..], "nonsense"),
        (&["--no-such-flag"][..], "no-such-flag"),
    ] {
        let (code, err) = generate(&t, flags);
        assert_eq!(code, 2, "{flags:?}: {err}");
        assert!(err.contains(needle), "{flags:?}: {err}");
    }
}

#[test]
fn bad_sampling_values_and_prompt_longer_than_context() {
    let Some(g) = smollm2() else { return };
    for (flags, needle) in [
        (&["--temperature=-1"][..], "temperature"),
        (&["--temperature", "0.7", "--top-p", "0"][..], "top-p"),
    ] {
        let (code, err) = generate(&g, flags);
        assert_eq!(code, 2, "{flags:?}: {err}");
        assert!(err.contains(needle), "{flags:?}: {err}");
    }
    let long = "hello ".repeat(9000);
    let (code, err) = generate(&g, &["--raw", "--prompt", &long]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("does not fit the context of 8192"), "{err}");
}

#[test]
fn train_init_that_is_no_drafter_or_does_not_fit() {
    let t = root().join("fixtures/tiny-llama");
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let toks: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 263).collect();
    let line = serde_json::json!({"tokens": toks, "loss_mask": vec![1u8; 40]}).to_string();
    std::fs::write(data.join("shard-00000.jsonl"), format!("{line}\n{line}\n")).unwrap();
    let train = |extra: &[&str]| {
        let (code, _, err) = run(dflash()
            .arg("train")
            .arg("--target")
            .arg(&t)
            .arg("--data")
            .arg(&data)
            .arg("--out")
            .arg(tmp.path().join("run"))
            .args(["--block-size", "4", "--anchors", "4", "--max-steps", "1"])
            .args(extra));
        (code, err)
    };
    let (code, err) = train(&["--layers", "2", "--init", "/no/such/drafter"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("not random, target-layers or a drafter directory"),
        "{err}"
    );
    // a 3-layer target has no top 4 layers to start from
    let (code, err) = train(&["--layers", "4", "--init", "target-layers"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("target-layers"), "{err}");
    // a 2-layer run from its own drafter works; a 1-layer run from it is refused
    let (code, err) = train(&["--layers", "2", "--init", "target-layers"]);
    assert_eq!(code, 0, "{err}");
    let drafter = tmp.path().join("run/drafter");
    let (code, err) = train(&["--layers", "1", "--init", drafter.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("layers"), "{err}");
    // a directory that holds no drafter, and a distillation share outside [0, 1]
    let (code, err) = train(&["--layers", "2", "--init", data.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("config.json"), "{err}");
    let (code, err) = train(&["--layers", "2", "--distill", "1.5"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--distill 1.5 must be in [0, 1]"), "{err}");
    let (code, err) = train(&["--layers", "2", "--val-fraction", "1.5"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--val-fraction 1.5 must be in [0, 1]"),
        "{err}"
    );
}
