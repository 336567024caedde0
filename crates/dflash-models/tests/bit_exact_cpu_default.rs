//! The CPU's default decode path is row-invariant in bf16 and f32: with no policy set (no
//! `--bit-exact`, no `DFLASH_STREAM_GEMM`), each row of a tree verify and of a causal verify of up
//! to 288 rows equals the one-token AR steps along its path, bit for bit — so greedy speculative
//! decoding on the CPU equals AR without the flag. A process of its own: the policy is fixed per
//! process.

mod common;
#[path = "support/hybrid_rows.rs"]
mod hybrid_rows;

#[test]
fn default_verify_rows_equal_sequential_ar_steps_on_the_cpu_in_bf16_and_f32() {
    use dflash_core::stream_gemm::{stream_policy, StreamPolicy};
    if stream_policy() != StreamPolicy::Fast {
        panic!(
            "DFLASH_STREAM_GEMM is set ({:?}): this test checks the default policy",
            stream_policy()
        );
    }
    common::check_verify_rows_equal_ar_steps(&candle_core::Device::Cpu, &[40, 64, 257]);
    common::check_verify_rows_equal_ar_steps_in(
        &candle_core::Device::Cpu,
        &[40, 64, 257],
        candle_core::DType::F32,
    );
    hybrid_rows::check_hybrid_verify_rows_equal_ar_steps(candle_core::DType::BF16);
    hybrid_rows::check_hybrid_verify_rows_equal_ar_steps(candle_core::DType::F32);
}
