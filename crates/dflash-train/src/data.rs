//! Training data on disk: a directory of JSONL shards (`shard-00000.jsonl` …), one tokenised
//! conversation per line: `{"tokens": [..], "loss_mask": [0|1, ..]}` (mask 1 on assistant tokens).
//!
//! Invariants: shards are written whole to a temporary file and renamed (a crash never leaves a
//! half shard); `done.json` lists how many prompts are finished, so regeneration resumes; a line
//! whose two arrays differ in length is an error naming the shard and line. The held-out split
//! ([`split_held_out`]) is a function of each example's prompt alone (the tokens before its first
//! supervised one), so a prompt held out in one run is held out in every run over any data set
//! that contains it: runs that warm-start from each other never validate on each other's
//! training prompts.

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
    let mut text = String::new();
    for e in examples {
        text.push_str(
            &serde_json::to_string(e).map_err(|e| TrainError::InvalidInput(e.to_string()))?,
        );
        text.push('\n');
    }
    dflash_core::fs::write_atomic(&path, text.as_bytes()).map_err(io(&path))
}

/// The `shard-*.jsonl` files of `dir`, in shard order (possibly none).
pub fn shard_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("shard-") && n.ends_with(".jsonl"))
        })
        .collect();
    shards.sort();
    Ok(shards)
}

/// Every example of every shard in `dir`, in shard order.
pub fn read_dir(dir: &Path) -> Result<Vec<Example>> {
    let shards = shard_files(dir).map_err(io(dir))?;
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

/// The prompt of an example: its tokens before the first supervised one.
fn prompt_tokens(e: &Example) -> &[u32] {
    let n = e
        .loss_mask
        .iter()
        .position(|&m| m != 0)
        .unwrap_or(e.tokens.len());
    &e.tokens[..n]
}

/// Whether `e` belongs to the held-out share `fraction` (in [0, 1]): FNV-1a (64-bit) of the
/// prompt's tokens (little-endian u32s) below `fraction` of the hash range.
pub fn is_held_out(e: &Example, fraction: f64) -> bool {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in prompt_tokens(e) {
        for b in t.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    (h as f64) < fraction.clamp(0.0, 1.0) * u64::MAX as f64
}

/// (held out, training) by [`is_held_out`], each in data order. At least one example stays in
/// training.
pub fn split_held_out(data: Vec<Example>, fraction: f64) -> (Vec<Example>, Vec<Example>) {
    let (mut val, mut train): (Vec<Example>, Vec<Example>) =
        data.into_iter().partition(|e| is_held_out(e, fraction));
    if train.is_empty() {
        train.extend(val.pop());
    }
    (val, train)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(prompt: &[u32], answer: &[u32]) -> Example {
        Example {
            tokens: prompt.iter().chain(answer).copied().collect(),
            loss_mask: prompt
                .iter()
                .map(|_| 0)
                .chain(answer.iter().map(|_| 1))
                .collect(),
        }
    }

    #[test]
    fn held_out_depends_on_the_prompt_only_and_matches_the_fraction() {
        let prompts: Vec<Vec<u32>> = (0..20_000u32).map(|i| vec![1, i, i / 7 + 3]).collect();
        let held: Vec<bool> = prompts
            .iter()
            .map(|p| is_held_out(&example(p, &[9, 9]), 0.05))
            .collect();
        let n = held.iter().filter(|&&h| h).count();
        assert!((800..1200).contains(&n), "5 % of 20,000 held out, got {n}");
        // another answer, another data set around it, another position: the same decision
        for (p, &h) in prompts.iter().zip(&held).take(2000) {
            assert_eq!(is_held_out(&example(p, &[4, 5, 6]), 0.05), h);
        }
        let data: Vec<Example> = prompts[..3000]
            .iter()
            .rev()
            .map(|p| example(p, &[7]))
            .collect();
        let (val, train) = split_held_out(data, 0.05);
        assert_eq!(val.len() + train.len(), 3000);
        assert!(val.iter().all(|e| is_held_out(e, 0.05)));
        assert!(train.iter().all(|e| !is_held_out(e, 0.05)));
        assert_eq!(
            val.len(),
            held[..3000].iter().filter(|&&h| h).count(),
            "the split of a subset holds out exactly its held-out prompts"
        );
        // nothing and everything
        assert!(!is_held_out(&example(&prompts[0], &[1]), 0.0));
        let (val, train) = split_held_out(vec![example(&[1], &[2]), example(&[3], &[4])], 1.0);
        assert_eq!(
            (val.len(), train.len()),
            (1, 1),
            "one example always trains"
        );
    }

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
