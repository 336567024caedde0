//! Helpers shared by this crate's unit tests.

use candle_core::Tensor;

/// Largest absolute elementwise difference of two same-shaped f32 tensors.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}
