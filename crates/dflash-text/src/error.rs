//! Error type of `dflash-text`.
//!
//! Invariants:
//! - No function of this crate panics on bad input; every failure is a [`TextError`].
//! - Errors about a file name that file (`path`) and say what was expected there, so a user can fix the
//!   input without reading the source.

use std::path::PathBuf;

/// Everything that can go wrong while loading tokenizers, encoding/decoding or rendering chat templates.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A file could not be read (missing, unreadable).
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file was read but its content is not what was expected.
    #[error("cannot parse {}: expected {expected}: {message}", path.display())]
    Parse {
        path: PathBuf,
        expected: String,
        message: String,
    },
    /// A GGUF `tokenizer.*` vocabulary this crate cannot reproduce (e.g. a SentencePiece `llama` model).
    #[error("unsupported GGUF tokenizer: {0}")]
    Unsupported(String),
    /// A GGUF `tokenizer.*` vocabulary that is internally inconsistent.
    #[error("invalid GGUF tokenizer metadata: {0}")]
    InvalidVocab(String),
    /// The `tokenizers` library failed while encoding or decoding.
    #[error("tokenizer {operation} failed: {message}")]
    Tokenizer { operation: String, message: String },
    /// A chat template does not compile (syntax error).
    #[error("chat template does not compile: {0}")]
    TemplateSyntax(String),
    /// A chat template failed while rendering; `raise_exception(msg)` lands here with `msg` in the message.
    #[error("chat template failed to render: {0}")]
    TemplateRender(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, TextError>;

impl TextError {
    pub(crate) fn tokenizer(operation: &str, err: impl std::fmt::Display) -> Self {
        TextError::Tokenizer {
            operation: operation.to_string(),
            message: err.to_string(),
        }
    }

    pub(crate) fn parse(
        path: impl Into<PathBuf>,
        expected: impl Into<String>,
        message: impl std::fmt::Display,
    ) -> Self {
        TextError::Parse {
            path: path.into(),
            expected: expected.into(),
            message: message.to_string(),
        }
    }
}
