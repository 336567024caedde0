//! Training data on disk: a directory of JSONL shards (`shard-00000.jsonl` …), one tokenised
//! conversation per line: `{"tokens": [..], "loss_mask": [0|1, ..]}` (mask 1 on assistant tokens).
//!
//! Invariants: shards are written whole to a temporary file and renamed (a crash never leaves a
//! half shard); `done.json` lists how many prompts are finished, so regeneration resumes; a line
//! whose two arrays differ in length is an error naming the shard and line.

use crate::{Result, TrainError};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Example {
    pub tokens: Vec<u32>,
    pub loss_mask: Vec<u8>,
}

impl Example {
    pub fn mask(&self) -> Vec<bool> {
        self.loss_mask.iter().map(|&m| m != 0).collect()
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |e| TrainError::Io {
        path: path.display().to_string(),
        source: e,
    }
}

pub fn shard_path(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("shard-{i:05}.jsonl"))
}

/// Writes one shard atomically.
pub fn write_shard(dir: &Path, i: usize, examples: &[Example]) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = shard_path(dir, i);
    let tmp = path.with_extension("jsonl.tmp");
    let mut text = String::new();
    for e in examples {
        text.push_str(
            &serde_json::to_string(e).map_err(|e| TrainError::InvalidInput(e.to_string()))?,
        );
        text.push('\n');
    }
    std::fs::write(&tmp, text).map_err(io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io(&path))
}

/// Every example of every shard in `dir`, in shard order.
pub fn read_dir(dir: &Path) -> Result<Vec<Example>> {
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("shard-") && n.ends_with(".jsonl"))
        })
        .collect();
    shards.sort();
    if shards.is_empty() {
        return Err(TrainError::InvalidInput(format!(
            "{}: no shard-*.jsonl files",
            dir.display()
        )));
    }
    let mut out = vec![];
    for s in shards {
        let text = std::fs::read_to_string(&s).map_err(io(&s))?;
        for (n, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let e: Example = serde_json::from_str(line)
                .map_err(|e| TrainError::InvalidInput(format!("{}:{}: {e}", s.display(), n + 1)))?;
            if e.tokens.len() != e.loss_mask.len() {
                return Err(TrainError::InvalidInput(format!(
                    "{}:{}: {} tokens but {} mask entries",
                    s.display(),
                    n + 1,
                    e.tokens.len(),
                    e.loss_mask.len()
                )));
            }
            out.push(e);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_round_trip_and_bad_lines_name_the_place() {
        let d = tempfile::tempdir().unwrap();
        let ex = vec![Example {
            tokens: vec![1, 2, 3],
            loss_mask: vec![0, 1, 1],
        }];
        write_shard(d.path(), 0, &ex).unwrap();
        write_shard(d.path(), 1, &ex).unwrap();
        assert_eq!(read_dir(d.path()).unwrap().len(), 2);
        std::fs::write(
            shard_path(d.path(), 2),
            "{\"tokens\":[1],\"loss_mask\":[1,1]}\n",
        )
        .unwrap();
        let e = read_dir(d.path()).unwrap_err().to_string();
        assert!(
            e.contains("shard-00002.jsonl:1") && e.contains("1 tokens but 2 mask"),
            "{e}"
        );
    }
}
