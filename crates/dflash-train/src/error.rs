//! Errors of dflash-train.

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error(transparent)]
    Model(#[from] dflash_models::ModelError),
    #[error(transparent)]
    Core(#[from] dflash_core::CoreError),
    #[error(transparent)]
    Plot(#[from] dflash_plot::PlotError),
    #[error(transparent)]
    Decode(#[from] dflash_decoding::DecodeError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, TrainError>;
