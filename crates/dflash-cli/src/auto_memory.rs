//! Auto mode's memory: what `generate --mode auto` measured in earlier runs, so a run on a device
//! where speculation clearly loses (the CPU: a DDTree step costs ~12 AR steps) starts with AR steps
//! instead of paying for the speculative steps that prove it again.
//!
//! Invariants:
//! - A record is keyed by everything that sets the rates it compares: the dflash version, the
//!   device (and the CPU's thread count), dtype, `--bit-exact`, the target file (canonical path,
//!   size, modification time), the drafter directory, the speculative mode with its tree budget
//!   and block size, and greedy vs sampled decoding. Another key never reuses it.
//! - Records older than [`MAX_AGE_SECONDS`] are ignored (the next run measures again), and only
//!   a record whose speculation ran at under half AR's rate changes what a run does
//!   ([`dflash_decoding::AutoRecord::prefers_ar`]); the output is the target's own either way.
//! - The file (`$DFLASH_AUTO_MEMORY`, else `$XDG_CACHE_HOME/dflash/auto-mode.json`, else
//!   `~/.cache/dflash/auto-mode.json`; `DFLASH_AUTO_MEMORY=off` turns the memory off) is written
//!   atomically; one that does not parse is reported once and replaced, never fatal.

use dflash_decoding::AutoRecord;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// A week: long enough to spare every run of a working session, short enough that a changed
/// machine or build is measured again.
pub const MAX_AGE_SECONDS: u64 = 7 * 24 * 3600;

#[derive(Debug, Default, Serialize, Deserialize)]
struct MemoryFile {
    entries: BTreeMap<String, Entry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Entry {
    #[serde(flatten)]
    record: AutoRecord,
    /// Seconds since the Unix epoch when it was measured.
    measured_unix: u64,
}

/// What makes one run's rates comparable with another's (see the module invariants).
#[derive(Debug, Clone)]
pub struct RunKey {
    pub device: String,
    pub dtype: String,
    pub bit_exact: bool,
    pub target: PathBuf,
    pub drafter: PathBuf,
    /// e.g. `ddtree:64` or `dflash`.
    pub mode: String,
    pub block_size: usize,
    pub sampled: bool,
}

impl RunKey {
    fn render(&self) -> String {
        let target_id = file_identity(&self.target);
        let drafter = canonical(&self.drafter);
        let threads = if self.device == "cpu" {
            format!(" threads {}", candle_core::utils::get_num_threads())
        } else {
            String::new()
        };
        format!(
            "dflash {} | {}{threads} {} bit_exact={} | target {target_id} | drafter {} | {} block {} | {}",
            env!("CARGO_PKG_VERSION"),
            self.device,
            self.dtype,
            self.bit_exact,
            drafter.display(),
            self.mode,
            self.block_size,
            if self.sampled { "sampled" } else { "greedy" },
        )
    }
}

fn canonical(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

/// Canonical path, size and modification time: a re-fetched or edited target is a new one.
fn file_identity(p: &Path) -> String {
    let path = canonical(p);
    let meta = std::fs::metadata(&path).ok();
    let size = meta.as_ref().map(|m| m.len()).unwrap_or(0);
    let mtime = meta
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("{} {size} bytes mtime {mtime}", path.display())
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The memory file, or `None` when it is turned off or no cache directory is known.
pub fn memory_path() -> Option<PathBuf> {
    match std::env::var("DFLASH_AUTO_MEMORY") {
        Ok(v) if matches!(v.as_str(), "0" | "off" | "") => return None,
        Ok(v) => return Some(PathBuf::from(v)),
        Err(_) => {}
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("dflash").join("auto-mode.json"))
}

fn read_file(path: &Path) -> MemoryFile {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            eprintln!(
                "[dflash] warning: auto-mode memory {} does not parse ({e}); it will be replaced",
                path.display()
            );
            MemoryFile::default()
        }),
        Err(_) => MemoryFile::default(),
    }
}

/// The latest record for `key` that is young enough to trust.
pub fn recall(path: &Path, key: &RunKey) -> Option<AutoRecord> {
    let file = read_file(path);
    let entry = file.entries.get(&key.render())?;
    (now_unix().saturating_sub(entry.measured_unix) <= MAX_AGE_SECONDS)
        .then(|| entry.record.clone())
}

/// Stores `record` for `key` (replacing the one before) and drops expired entries.
pub fn remember(path: &Path, key: &RunKey, record: AutoRecord) -> anyhow::Result<()> {
    let mut file = read_file(path);
    let now = now_unix();
    file.entries
        .retain(|_, e| now.saturating_sub(e.measured_unix) <= MAX_AGE_SECONDS);
    file.entries.insert(
        key.render(),
        Entry {
            record,
            measured_unix: now,
        },
    );
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    crate::defaults::write_atomic(path, &serde_json::to_vec_pretty(&file)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(mode: &str) -> RunKey {
        RunKey {
            device: "cpu".into(),
            dtype: "f32".into(),
            bit_exact: false,
            target: PathBuf::from("/nonexistent/target.gguf"),
            drafter: PathBuf::from("/nonexistent/drafter"),
            mode: mode.into(),
            block_size: 16,
            sampled: false,
        }
    }

    fn record(spec: f64) -> AutoRecord {
        AutoRecord {
            spec_tokens_per_second: spec,
            ar_tokens_per_second: 40.0,
            spec_steps: 6,
        }
    }

    #[test]
    fn a_record_is_recalled_for_its_own_key_only_and_replaced_by_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/auto-mode.json");
        assert_eq!(recall(&path, &key("ddtree:64")), None);
        remember(&path, &key("ddtree:64"), record(13.0)).unwrap();
        assert_eq!(recall(&path, &key("ddtree:64")), Some(record(13.0)));
        assert_eq!(recall(&path, &key("ddtree:16")), None);
        let mut sampled = key("ddtree:64");
        sampled.sampled = true;
        assert_eq!(recall(&path, &sampled), None);
        remember(&path, &key("ddtree:64"), record(30.0)).unwrap();
        assert_eq!(recall(&path, &key("ddtree:64")), Some(record(30.0)));
    }

    #[test]
    fn expired_records_are_ignored_and_a_corrupt_file_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("auto-mode.json");
        let mut file = MemoryFile::default();
        file.entries.insert(
            key("dflash").render(),
            Entry {
                record: record(10.0),
                measured_unix: now_unix() - MAX_AGE_SECONDS - 10,
            },
        );
        std::fs::write(&path, serde_json::to_vec(&file).unwrap()).unwrap();
        assert_eq!(recall(&path, &key("dflash")), None);
        std::fs::write(&path, b"{ not json").unwrap();
        assert_eq!(recall(&path, &key("dflash")), None);
        remember(&path, &key("dflash"), record(10.0)).unwrap();
        assert_eq!(recall(&path, &key("dflash")), Some(record(10.0)));
    }
}
