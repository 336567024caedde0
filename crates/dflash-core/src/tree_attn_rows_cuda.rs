//! The row kernel's launch (`tree_attn_rows.cu`, compiled into the step module of
//! [`crate::step_cuda`]): which steps take it, its dynamic shared memory, its arguments.
//!
//! Invariants: it runs on candle's stream like every step kernel; a launch on a device whose
//! function lacks the shared-memory attribute is never made (the attribute is set per device
//! first); its arguments are the step attention's, in the kernel's order.

use crate::step_cuda::{ptx, MODULE};
use crate::Result;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use std::sync::OnceLock;

/// Dynamic shared memory of `tree_attn_rows_bf16_d128`: two tile buffers of 64 K and 64 V rows of
/// 128 + 8 bf16 (`tree_attn_rows.cu`).
const ROWS_SHARED_BYTES: usize = 2 * 2 * 64 * (128 + 8) * 2;

/// Whether a bf16 step of 2+ rows of 128-wide heads with keys by step row takes the row kernel
/// (`tree_attn_rows.cu`, on [`crate::step::row_kernel_chunk`]'s splits). `DFLASH_ATTN_ROWS` (read
/// once; a documented override for A/B runs): `2` (the default since session 28) every such step —
/// DDTree trees, DFlash blocks, the drafter's block; `1` the steps the general kernel would take
/// (more than 64 query vectors a kv head); `0` none (the general and few-vector kernels, session
/// 27's path). Measured on an H100 (session 28, Qwen3-8B, same call): at context 2048 the DDTree-64
/// verify 10.99 → 8.74 ms, the 16-row verify 8.22 → 7.54 (128-key splits), the drafter's block
/// 1.68 → 1.58; at 512 the DDTree-64 verify 8.56 → 7.99. With keys by position (`--bit-exact`)
/// only the splits of cached keys alone of steps of more than 64 rows take it (the general
/// kernel's bits there; see `step_cuda::tree_attention`). `3` (opt-in) also the one-row step (an
/// AR token, keys by step row) on its own entry with the few-vector kernel's fused merge
/// (`tree_attn_rows_one_bf16_d128`): its tiles' loads all out at once, ahead of q, where the
/// few-vector kernel stages one tile at a time — the same bits (GPU test), but measured no faster
/// on an H100 (session 29, Qwen3-8B at context 2048, twice in one call: AR step 6.699 / 6.704 ms
/// against 6.701 / 6.723).
pub(crate) fn takes(few_vectors: bool, one_row: bool) -> bool {
    static MODE: OnceLock<u8> = OnceLock::new();
    let mode = *MODE.get_or_init(|| {
        std::env::var("DFLASH_ATTN_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2)
    });
    match mode {
        0 => false,
        1 => !few_vectors,
        2 => !one_row,
        _ => true,
    }
}

/// One launch's arguments: the device addresses of q, the K and V buffers, the step metadata, the
/// ancestor records and the partial records; then stride, rows, heads, kv heads, buffer length,
/// chunk, vector groups, window and `logical` (keys by position: the cached splits alone); the
/// scale.
pub(crate) struct RowKernelArgs {
    pub pointers: [u64; 6],
    pub ints: [i32; 9],
    pub scale: f32,
}

/// Launches `tree_attn_rows_bf16_d128` over `cfg`'s grid with [`ROWS_SHARED_BYTES`] of dynamic
/// shared memory; with `merge` (a one-row step's split counters and output, device addresses)
/// `tree_attn_rows_one_bf16_d128`, whose last block of each kv head merges the splits into the
/// output.
pub(crate) fn launch(
    dev: &CudaDevice,
    cfg: LaunchConfig,
    args: &RowKernelArgs,
    merge: Option<(u64, u64)>,
) -> Result<()> {
    let name = match merge {
        Some(_) => "tree_attn_rows_one_bf16_d128",
        None => "tree_attn_rows_bf16_d128",
    };
    let f = dev.get_or_load_custom_func(name, MODULE, ptx()?)?;
    crate::pdl::mark(&f);
    crate::step_cuda::allow_dynamic_shared_memory(&f, dev, name, ROWS_SHARED_BYTES)?;
    let cfg = LaunchConfig {
        shared_mem_bytes: ROWS_SHARED_BYTES as u32,
        ..cfg
    };
    let [q, k, v, meta, anc, part] = &args.pointers;
    let [stride, n, h, kv, cap, chunk, groups, window, logical] = &args.ints;
    let mut b = f.builder();
    for p in [q, k, v, meta, anc] {
        b.arg(p);
    }
    for i in [stride, n, h, kv, cap, chunk, groups] {
        b.arg(i);
    }
    b.arg(&args.scale);
    b.arg(part);
    b.arg(window);
    b.arg(logical);
    if let Some((counters, out)) = &merge {
        b.arg(counters);
        b.arg(out);
    }
    // SAFETY: the arguments in the kernel's order and types: device addresses of live tensors of
    // the sizes it reads and writes (one record per vector and split; with `merge`, a counter per
    // block column, zero between launches, and the step's output).
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}
