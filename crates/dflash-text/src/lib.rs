//! `dflash-text`: tokenizers and chat templates for dflash-rs.
//!
//! - [`TextTokenizer`] wraps a `tokenizers::Tokenizer` loaded from a `tokenizer.json` or rebuilt from a GGUF's
//!   `tokenizer.*` metadata ([`GgufVocab`]) the way Hugging Face transformers' GGUF converter builds it.
//! - [`StreamDecoder`] turns a stream of generated ids into text chunks that never split a character.
//! - [`ChatTemplate`] renders HF Jinja chat templates with minijinja in HF's configuration.
//! - [`TextAssets`] gathers all of the above for an HF model directory or a GGUF file.
//!
//! Invariants: nothing here panics on bad input (every failure is a [`TextError`] naming the file and what was
//! expected), and this crate never reads GGUF files itself (the models crate fills [`GgufVocab`]).

pub mod assets;
pub mod chat_template;
pub mod error;
pub mod gguf_vocab;
mod json_py;
pub mod stream;
pub mod tokenizer;

pub use assets::TextAssets;
pub use chat_template::{ChatMessage, ChatTemplate, RenderOptions};
pub use error::{Result, TextError};
pub use gguf_vocab::GgufVocab;
pub use stream::StreamDecoder;
pub use tokenizer::TextTokenizer;
