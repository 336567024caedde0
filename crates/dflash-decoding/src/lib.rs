//! dflash-decoding: the loops that turn a target (and later a drafter) into tokens.
//!
//! Invariants: every mode produces exactly the tokens (greedy) or the distribution (sampled) of
//! [`ar::generate_ar`], the reference loop; stop tokens and the token limit end every mode the same
//! way; timing excludes nothing silently (prefill and decode are reported apart).

pub mod ar;
pub mod batch;
pub mod error;
pub mod sampling;
pub mod spec;
pub mod tree;

pub use ar::{generate_ar, generate_ar_with_margins, GenerateConfig, Generation, StopReason};
pub use batch::{generate_ar_batch, BatchConfig, BatchOutput};
pub use error::{DecodeError, Result};
pub use sampling::{Sampler, SamplingConfig};
pub use spec::{
    generate_auto, generate_auto_remembered, generate_speculative, AutoChoice, AutoRecord,
    BlockDrafter, DFlashRunner, SpecMode, SpecStats,
};
