//! dflash-train: the pieces of DFlash drafter training (spec.md §4).
//!
//! Invariants: the target runs without a graph (its taps are detached); noise/mask tokens never
//! enter the target; the drafter's forward is the one in dflash-models (`forward_train`), never a
//! re-implementation; labels of block row k are the tokens at `anchor + k` (same position, not
//! shifted) with weight `exp(−(k−1)/γ)` for k ≥ 1 and 0 for the anchor row; optimizer state is
//! f32 and fully serialisable, so a resumed run continues bit-for-bit.

pub mod anchors;
pub mod curves;
pub mod data;
pub mod error;
pub mod loss;
pub mod optim;
pub mod profile;
pub mod replay;
pub mod step;
pub mod trainer;

pub use anchors::sample_anchors;
pub use curves::write_curves;
pub use error::{Result, TrainError};
pub use loss::{block_labels, block_loss, BlockLabels, LossReport};
pub use optim::{AdamW, AdamWConfig, LrSchedule};
pub use profile::PhaseTimer;
pub use replay::{
    anchor_acceptance, anchor_likelihood, anchor_likelihood_with, bootstrap_ci95,
    bootstrap_interval, replay_steps, AnchorAcceptance,
};
pub use step::{
    batch_probs, compute_drafter, sequence_taps, soft_label_positions, Sequence, StepReport,
    TrainStep,
};
pub use trainer::{
    plan_steps, resume_conflicts, RunState, StepLog, TrainConfig, Trainer, Validation,
};
