//! dflash-models: target models (Llama family, Qwen3 dense, Qwen3.5 / Qwen3.6 dense hybrids) and
//! the DFlash drafter.
//!
//! Invariants: models are written here (not wrapped from candle-transformers) so every forward takes
//! explicit positions and attention layouts over a croppable cache and can return hidden-state taps;
//! loading goes through [`loader::load_target`] for both HF directories and GGUF files.

pub mod config;
pub mod decoder;
pub mod drafter;
pub mod error;
pub mod gated_deltanet;
pub mod gguf;
pub mod gguf_hybrid;
pub mod hybrid;
pub mod loader;
mod projection;
pub mod random;
pub mod target;
pub mod weights;

pub use config::{Architecture, DecoderConfig};
pub use decoder::Decoder;
pub use drafter::{load_drafter, DFlashConfig, DFlashDrafter, DraftCache};
pub use error::{ModelError, Result};
pub use hybrid::HybridDecoder;
pub use loader::{load_target, target_tensors, LoadedTarget};
pub use random::{random_drafter, random_target, random_target_tensors};
pub use target::{
    BatchForwardRequest, ForwardOutput, ForwardRequest, LogitRows, TargetInfo, TargetModel,
};
