//! Errors of dflash-models. Every variant caused by the user's input (a path, a file, a config, a
//! prompt) answers `is_bad_input() == true`, which the CLI maps to exit code 2.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{}: not found ({what})", path.display())]
    MissingFile { path: PathBuf, what: String },
    #[error("{}: corrupt or truncated: {msg}", path.display())]
    Corrupt { path: PathBuf, msg: String },
    #[error("{}: unsupported architecture '{arch}' (supported: llama, qwen3, qwen3_5 dense hybrids; mixture-of-experts models are not)", path.display())]
    UnknownArchitecture { path: PathBuf, arch: String },
    #[error("{}: unsupported GGUF architecture '{arch}': {why} (supported GGUF architectures: llama, qwen3, qwen35 = Qwen3.5 / Qwen3.6 dense hybrids)", path.display())]
    UnsupportedGguf {
        path: PathBuf,
        arch: String,
        why: String,
    },
    #[error("{}: bad config: {msg}", path.display())]
    Config { path: PathBuf, msg: String },
    #[error("{}: weight '{name}': {msg}", path.display())]
    Weight {
        path: PathBuf,
        name: String,
        msg: String,
    },
    #[error("context overflow: {needed} positions needed but the model's context is {context}")]
    ContextOverflow { needed: usize, context: usize },
    #[error("drafter does not fit target: {0}")]
    Mismatch(String),
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error(transparent)]
    Text(#[from] dflash_text::TextError),
    #[error(transparent)]
    Core(#[from] dflash_core::CoreError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl ModelError {
    /// True when the error is the caller's input (exit code 2), not an internal failure.
    pub fn is_bad_input(&self) -> bool {
        match self {
            ModelError::Candle(_) | ModelError::Io { .. } => false,
            ModelError::Core(e) => matches!(
                e,
                dflash_core::CoreError::InvalidInput(_)
                    | dflash_core::CoreError::CacheOverflow { .. }
            ),
            _ => true,
        }
    }
}

impl ModelError {
    /// As a core error (a device step's body runs under `dflash_core::step_graph`, whose errors
    /// are core errors): core and candle errors as they are, anything else as invalid input.
    pub fn into_core(self) -> dflash_core::CoreError {
        match self {
            ModelError::Core(c) => c,
            ModelError::Candle(c) => dflash_core::CoreError::Candle(c),
            other => dflash_core::CoreError::InvalidInput(other.to_string()),
        }
    }
}

pub type Result<T> = std::result::Result<T, ModelError>;
