//! `dflash data regen --part I/N`: N processes sharing one `--out` write exactly the shards one
//! process writes alone (byte for byte), each process only its own (k mod N = I), and a rerun of a
//! part skips what it finished. Bad `--part` values are usage errors.

use std::path::Path;

mod common;
use common::{dflash, run, smollm2};

fn regen(target: &Path, prompts: &Path, out: &Path, extra: &[&str]) -> (i32, String) {
    let (code, _, err) = run(dflash()
        .args(["data", "regen", "--target"])
        .arg(target)
        .arg("--prompts")
        .arg(prompts)
        .arg("--out")
        .arg(out)
        .args(["--max-new-tokens", "3", "--batch", "2", "--shard-size", "2"])
        .args(extra));
    (code, err)
}

fn shards(dir: &Path) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            (name, std::fs::read_to_string(&p).unwrap())
        })
        .collect();
    v.sort();
    v
}

#[test]
fn parts_write_what_one_process_writes() {
    let Some(g) = smollm2() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("prompts.jsonl");
    let lines: Vec<String> = [
        "What is 2+2?",
        "Name a colour.",
        "Say hi.",
        "Count to three.",
        "Why?",
    ]
    .iter()
    .map(|p| serde_json::json!({ "prompt": p }).to_string())
    .collect();
    std::fs::write(&prompts, lines.join("\n") + "\n").unwrap();

    let whole = tmp.path().join("whole");
    let (code, err) = regen(&g, &prompts, &whole, &[]);
    assert_eq!(code, 0, "{err}");
    let expected = shards(&whole);
    assert_eq!(expected.len(), 3, "5 prompts in shards of 2: {expected:?}");

    let shared = tmp.path().join("shared");
    let (code, err) = regen(&g, &prompts, &shared, &["--part", "1/2"]);
    assert_eq!(code, 0, "{err}");
    let names: Vec<String> = shards(&shared).into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        ["shard-00001.jsonl"],
        "part 1/2 owns the odd shards only"
    );
    let (code, err) = regen(&g, &prompts, &shared, &["--part", "0/2"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(shards(&shared), expected);

    let (code, err) = regen(&g, &prompts, &shared, &["--part", "0/2"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("owns 2, 2 already done"), "{err}");

    for bad in ["2/2", "1", "a/b", "0/0"] {
        let (code, err) = regen(&g, &prompts, &shared, &["--part", bad]);
        assert_eq!(code, 2, "--part {bad}: {err}");
        assert!(err.contains("expected I/N"), "--part {bad}: {err}");
    }
}
