//! Errors of dflash-decoding; `is_bad_input` mirrors the models crate's classification.

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("prompt of {prompt} tokens does not fit the context of {context} positions")]
    PromptTooLong { prompt: usize, context: usize },
    #[error(transparent)]
    Model(#[from] dflash_models::ModelError),
    #[error(transparent)]
    Core(#[from] dflash_core::CoreError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl DecodeError {
    pub fn is_bad_input(&self) -> bool {
        match self {
            DecodeError::InvalidInput(_) | DecodeError::PromptTooLong { .. } => true,
            DecodeError::Model(e) => e.is_bad_input(),
            DecodeError::Core(e) => matches!(e, dflash_core::CoreError::InvalidInput(_)),
            DecodeError::Candle(_) => false,
        }
    }
}

pub type Result<T> = std::result::Result<T, DecodeError>;
