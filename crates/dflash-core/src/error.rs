//! Errors of dflash-core. `InvalidInput` is the user's fault (bad flag value, bad shape request);
//! `Candle` wraps tensor-library failures.

#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("KV cache overflow: {needed} positions needed, capacity {capacity}")]
    CacheOverflow { needed: usize, capacity: usize },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, CoreError>;
