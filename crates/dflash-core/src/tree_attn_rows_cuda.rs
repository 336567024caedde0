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

/// Dynamic shared memory of `tree_attn_rows_bf16_d{d}`: two tile buffers of 64 K and 64 V rows of
/// `d` + 8 bf16 (`tree_attn_rows.cu`).
const fn rows_shared_bytes(d: usize) -> usize {
    2 * 2 * 64 * (d + 8) * 2
}

/// Whether a step of heads `d` wide may take the row kernel (compiled at 128 and 64), beside
/// [`takes`]: 128-wide heads always; 64-wide heads (SmolLM2) when `forced` (a test's kernel
/// choice), never with keys by position, and otherwise by `DFLASH_ATTN_ROWS_D64` (read once; a
/// documented override for A/B runs): `1` (the default since session 33) steps of more than 16
/// rows (DDTree trees; 64-wide heads take the few-vector kernel at every width otherwise), `2`
/// every step of 2+ rows (DFlash blocks too), `0` none. Measured on an H100 (session 33, SmolLM2
/// bf16 at context 512, two calls, variants interleaved, every 2+-row step on it): the DDTree-64
/// verify 1.379 / 1.412 / 1.376 ms against 1.438 / 1.434 / 1.439 / 1.446 on the few-vector kernel
/// (−3.4 %), its loop step 1.771 against 1.806 (−2 %), the 17-node tree −1.5 %; 16-row chains −1 %
/// but they stay off by default (on the row kernel's split rule a long context would give them
/// other splits than the AR step's, and SmolLM2's bf16 DFlash output equals AR's because they
/// share them). Under `--bit-exact` its cached splits cost more than they save at 64-wide heads:
/// the DDTree-64 verify 2.45 ms with them against 2.17 on the general kernel alone (ncu: the
/// general kernel's launch over the step splits alone still took 32 µs a layer, the row kernel 11
/// more).
pub(crate) fn width_ok(d: usize, rows: usize, keys_by_position: bool, forced: bool) -> bool {
    static D64: OnceLock<u8> = OnceLock::new();
    match d {
        128 => true,
        64 if forced => true,
        64 if keys_by_position => false,
        64 => match *D64.get_or_init(|| {
            std::env::var("DFLASH_ATTN_ROWS_D64")
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(1)
        }) {
            0 => false,
            1 => rows > 16,
            _ => true,
        },
        _ => false,
    }
}

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

/// Launches `tree_attn_rows_bf16_d{d}` (`d` 128 or 64) over `cfg`'s grid with its dynamic shared
/// memory; with `merge` (a one-row step's split counters and output, device addresses)
/// `tree_attn_rows_one_bf16_d{d}`, whose last block of each kv head merges the splits into the
/// output.
pub(crate) fn launch(
    dev: &CudaDevice,
    cfg: LaunchConfig,
    d: usize,
    args: &RowKernelArgs,
    merge: Option<(u64, u64)>,
) -> Result<()> {
    let name = match (merge, d) {
        (Some(_), 128) => "tree_attn_rows_one_bf16_d128",
        (None, 128) => "tree_attn_rows_bf16_d128",
        (Some(_), 64) => "tree_attn_rows_one_bf16_d64",
        (None, 64) => "tree_attn_rows_bf16_d64",
        _ => {
            return Err(crate::CoreError::InvalidInput(format!(
                "the row kernel is compiled for 128- and 64-wide heads, not {d}"
            )))
        }
    };
    let bytes = rows_shared_bytes(d);
    let f = dev.get_or_load_custom_func(name, MODULE, ptx()?)?;
    crate::pdl::mark(&f);
    crate::step_cuda::allow_dynamic_shared_memory(&f, dev, name, bytes)?;
    let cfg = LaunchConfig {
        shared_mem_bytes: bytes as u32,
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
