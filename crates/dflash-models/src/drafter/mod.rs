//! The DFlash drafter: config (z-lab format), the one model used for inference and training, and
//! checkpoint I/O.

mod cache;
pub mod config;
mod device;
pub mod io;
pub mod model;

pub use config::{default_target_layers, BlockConvention, DFlashConfig, LayerAttention};
pub use io::{
    config_for_target, init_from_target_layers, init_weights_for_target, load_drafter,
    parameter_shapes, random_weights, save_drafter, warm_start_weights,
};
pub use model::{DFlashDrafter, DraftCache};
