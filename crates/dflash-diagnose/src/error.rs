//! Errors of dflash-diagnose.
//!
//! Invariant: [`DiagnoseError::is_bad_input`] is true exactly when the user's input (a file, a
//! setting, a drafter that does not fit the target) is at fault; the CLI maps it to exit code 2.

#[derive(Debug, thiserror::Error)]
pub enum DiagnoseError {
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("{path}: {msg}")]
    BadFile { path: String, msg: String },
    #[error(transparent)]
    Model(#[from] dflash_models::ModelError),
    #[error(transparent)]
    Train(#[from] dflash_train::TrainError),
    #[error(transparent)]
    Decode(#[from] dflash_decoding::DecodeError),
    #[error(transparent)]
    Core(#[from] dflash_core::CoreError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

impl DiagnoseError {
    /// Whether the user's input is at fault (exit code 2), not the computation.
    pub fn is_bad_input(&self) -> bool {
        match self {
            DiagnoseError::InvalidInput(_) | DiagnoseError::BadFile { .. } => true,
            DiagnoseError::Model(m) => m.is_bad_input(),
            DiagnoseError::Train(t) => matches!(t, dflash_train::TrainError::InvalidInput(_)),
            DiagnoseError::Decode(d) => d.is_bad_input(),
            DiagnoseError::Core(c) => matches!(c, dflash_core::CoreError::InvalidInput(_)),
            DiagnoseError::Candle(_) | DiagnoseError::Io { .. } => false,
        }
    }
}

pub type Result<T> = std::result::Result<T, DiagnoseError>;
