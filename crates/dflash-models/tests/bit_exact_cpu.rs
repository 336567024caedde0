//! Bit-exact decoding on the CPU (issue 18's "the same on the CPU"): under the bit-exact policy
//! (`--bit-exact`: `dflash_core::rowwise` for every projection, the LM head and attention), each row
//! of a bf16 (and f32) tree verify and of a causal verify equals the one-token AR steps along its path, bit
//! for bit. A process of its own: the policy is fixed per process.

mod common;
#[path = "support/hybrid_rows.rs"]
mod hybrid_rows;

#[test]
fn bit_exact_bf16_verify_rows_equal_sequential_ar_steps_on_the_cpu() {
    use dflash_core::stream_gemm::{set_policy, StreamPolicy};
    set_policy(StreamPolicy::All).unwrap();
    // up to a DDTree of budget 256 with its root
    common::check_verify_rows_equal_ar_steps(&candle_core::Device::Cpu, &[40, 64, 257]);
    // and in f32, where no bf16 rounding between layers hides a changed attention sum
    common::check_verify_rows_equal_ar_steps_in(
        &candle_core::Device::Cpu,
        &[40, 64, 257],
        candle_core::DType::F32,
    );
    // the hybrids (Gated DeltaNet + gated attention) likewise
    hybrid_rows::check_hybrid_verify_rows_equal_ar_steps(candle_core::DType::BF16);
    hybrid_rows::check_hybrid_verify_rows_equal_ar_steps(candle_core::DType::F32);
}
