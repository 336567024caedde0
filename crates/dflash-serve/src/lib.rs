//! Serving: `dflash serve`'s OpenAI-compatible HTTP endpoint, independent of the models.
//!
//! The crate speaks HTTP/1.1 and the OpenAI wire format (`/v1/chat/completions`,
//! `/v1/completions`, `/v1/models`, `/health`; Server-Sent Events when `stream` is set) and hands
//! each request to an [`Engine`], which the binary implements with the decoding loops. It knows
//! nothing of tensors, so its protocol is tested against a scripted engine.
//!
//! Invariants:
//! - One completion is decoded at a time, in arrival order (the engines decode batch 1); the
//!   others wait in a queue of [`ServerOptions::max_queue`] (a 503 beyond), while `/health` and
//!   `/v1/models` are answered at once by the thread that accepts connections.
//! - The text a response carries is exactly the concatenation of the pieces the engine passed to
//!   its `on_text` callback, cut before the first occurrence of any `stop` string; once a stop
//!   string is seen (or a streaming client is gone) the request's [`GenRequest::cancel`] flag is
//!   set, and the engine ends the generation after the token it is emitting.
//! - Bad requests get an OpenAI-style error object (`{"error": {"message", "type", …}}`) with a
//!   4xx status, never a panic or a dropped connection; engine failures get a 500.

pub mod http;
pub mod openai;
pub mod server;
mod stop;

pub use server::{serve, ServerOptions};

use serde::Serialize;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// One chat message (`role`: system, user, assistant, …).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// What to complete: a chat (rendered with the model's template) or raw text.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Chat {
        messages: Vec<Message>,
        /// `chat_template_kwargs.enable_thinking` (templates that know it: Qwen3).
        enable_thinking: bool,
    },
    Text(String),
}

/// Sampling settings of one request; `temperature == 0` is greedy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    /// 0: no top-k filter.
    pub top_k: usize,
    pub seed: u64,
}

/// One generation the engine runs.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub prompt: Prompt,
    pub max_tokens: usize,
    pub sampling: Sampling,
    /// Set by the server when the answer is complete before the engine is (a stop string) or
    /// nobody is listening; the engine stops after the token it is emitting.
    pub cancel: Arc<AtomicBool>,
}

/// Why the engine stopped, in OpenAI's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token (or the server's stop string, or a cancellation).
    Stop,
    /// The token budget or the model's context ran out.
    Length,
}

/// What the engine reports after a generation.
#[derive(Debug, Clone)]
pub struct GenOutcome {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub finish: FinishReason,
    /// Engine-specific measurements (mode, acceptance length, speed), passed through as the
    /// response's `dflash` object.
    pub stats: serde_json::Value,
}

/// Why a generation could not run.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request cannot be served as asked (prompt longer than the context, …): a 400.
    #[error("{0}")]
    BadRequest(String),
    /// Anything else: a 500.
    #[error("{0}")]
    Internal(String),
}

/// A decoding engine behind the endpoint.
pub trait Engine {
    /// The model name `/v1/models` lists and responses carry.
    fn model_id(&self) -> &str;
    /// Runs `req`, passing the answer's text to `on_text` piece by piece as it is decoded.
    fn generate(
        &mut self,
        req: &GenRequest,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenOutcome, EngineError>;
}

/// Errors of this crate: the listener's I/O.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("server I/O: {0}")]
    Io(#[from] std::io::Error),
}
