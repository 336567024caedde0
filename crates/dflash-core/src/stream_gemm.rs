//! The weight-streaming GEMM of decode steps: `x · wᵀ` for up to [`STREAM_MAX_ROWS`] bf16 rows on
//! the tensor cores (`stream_gemm.cu`), used for every projection and the LM head of an AR step, a
//! DFlash verify and a drafter block on CUDA.
//!
//! Invariants:
//! - A row's result does not depend on how many rows share the call (each output element is one
//!   fixed-order sum over K: fixed 64-wide chunks, a fixed warp split chosen from the weight's
//!   shape alone, partials added in warp order), so a verified row is bit-identical to the same
//!   row computed alone by the AR step (tested on the GPU).
//! - f32 accumulation; output rounded once to bf16, or left in f32 (logits).
//! - Calls of more than 16 rows run one narrow block per 16-row group (each re-reads the weight),
//!   the wide kernel (17–80 rows, one block per 16 outputs for every row: [`wide_calls`]), the
//!   split kernel (64 × 16–80 output tiles, the K partials over blocks: [`split_call`]) or, with
//!   [`tiled_wide_calls`] (opt-in: bit-exact, but measured far slower on an H100 in session 21),
//!   the tiled kernel — all with the narrow kernel's per-element arithmetic. The split kernel's
//!   partial sums meet in a buffer the call allocates and are added by each tile's last block
//!   (counters from `step_cuda::block_counters`, left zero).
//! - No backward: an input autograd tracks (`Tensor::track_op`) always gets `None`.
//! - `None` means "not mine" (the CPU, another dtype, too many rows, K not a multiple of 64, a
//!   misaligned weight, a device older than compute 8.0, a weight the [`StreamPolicy`] leaves to
//!   cuBLAS): the caller runs candle's matmul (cuBLAS) instead. The policy looks at the weight
//!   and the row count only. Under [`StreamPolicy::All`] (`--bit-exact`) every call of up to 288
//!   rows streams, so all of a weight's rows — AR step, chain, tree — come from one kernel; under
//!   the fast default only calls of up to [`FAST_MAX_ROWS`] rows do.
//! - On the CPU the row-invariant host kernels (`crate::rowwise`) are the default in every dtype
//!   ([`cpu_row_invariant`]): the fast policy sends every projection of up to [`STREAM_MAX_ROWS`]
//!   rows there (AR steps, verifies, trees, drafter blocks: in bf16 faster than candle's CPU
//!   matmul on every row, docs/benchmarks.md session 18; in f32 faster on every row but the
//!   DDTree-64 loop at context 1024, +4 %, session 19). [`StreamPolicy::All`] adds the longer calls
//!   (prefills); `0` and `head` send none (the A/B).

use crate::Result;
use candle_core::{DType, Tensor};

/// The most rows one call takes (a DDTree verify of budget 256 with its root; blocks take 16 rows
/// each, two 8-column tiles of the m16n8k16 tensor-core product).
pub const STREAM_MAX_ROWS: usize = 288;

/// Which bf16 calls stream, from `DFLASH_STREAM_GEMM` (read once): `0` none (cuBLAS, the A/B);
/// `head` only the LM head's; `all` every call of up to [`STREAM_MAX_ROWS`] rows (a row's numbers
/// never depend on the row count or the step kind: bit-exact verification, at a cost measured in
/// docs/benchmarks.md); unset ([`StreamPolicy::Fast`]) the calls where it measured faster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamPolicy {
    Off,
    Head,
    Fast,
    All,
}

/// Rows up to which the fast policy streams: wider calls (trees) are faster on cuBLAS (SmolLM2,
/// bf16: a 65-node tree verify 1.56 ms on cuBLAS, 2.08 streamed).
pub const FAST_MAX_ROWS: usize = 16;

/// The largest layer weight the fast policy streams. Measured on the H200 inside the decode step
/// (docs/benchmarks.md session 12): SmolLM2-135M's weights (≤ 3.5 MB) stream as fast as cuBLAS or
/// faster; Qwen3-8B's (33–100 MB) lose (AR step 5.90 → 6.63 ms: the kernel's weight reads reach
/// DRAM at a lower rate than cuBLAS's on large weights).
pub const STREAM_MAX_BYTES: usize = 16 << 20;

/// Rows up to which the fast policy also streams layer weights larger than [`STREAM_MAX_BYTES`]
/// (up to [`stream_max_few_rows_bytes`]): the AR step and small batches. Measured on the H200
/// (scripts/probe-stream-gemm.py, weights from DRAM): Qwen3-8B's o projection (33.5 MB) 11.1 µs
/// streamed against 13.4 µs on cuBLAS at one row, q/k/v (50 MB) 15.7 against 16.2; at 16 rows
/// cuBLAS wins (q/k/v 15.2 against 20.3).
pub const FEW_ROWS: usize = 4;

/// The largest layer weight the fast policy streams for calls of up to [`FEW_ROWS`] rows: 64 MiB
/// (Qwen3-8B's q/k/v and o projections; its down projection, 100 MB, measured even and its
/// gate-up, 201 MB, slower), or `DFLASH_STREAM_FEW_ROWS_MB` (a documented override for A/B runs;
/// 0 turns it off).
pub fn stream_max_few_rows_bytes() -> usize {
    static LIMIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::env::var("DFLASH_STREAM_FEW_ROWS_MB")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(64 << 20, |mb| mb << 20)
    })
}

/// The fewest 16-output tiles (blocks) a weight must give for the fast policy to stream it in a
/// call of up to [`FEW_ROWS`] rows when it is larger than [`STREAM_MAX_BYTES`]: 1.5 waves over
/// an H100/H200's 132 SMs. Below that the blocks leave SMs idle for most of the last wave:
/// Qwen3.5-4B's silu·down (2560 outputs, 160 blocks) read its 47 MB at 1.1 TB/s in the AR step
/// (ncu, session 21), and the AR step took 5.54 ms streamed against 4.99 with every few-row call
/// on cuBLAS (H100, session 22); Qwen3-8B's o projection (4096 outputs, 256 blocks) streams
/// faster than cuBLAS. `DFLASH_STREAM_FEW_MIN_TILES=N` (read once; a documented override for A/B
/// runs; 0 drops the condition).
pub fn stream_few_rows_min_tiles() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| {
        std::env::var("DFLASH_STREAM_FEW_MIN_TILES")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(198)
    })
}

/// The largest LM head the fast policy streams: cuBLAS's bf16 × bf16 → f32 product of a few rows
/// took ~0.17 ms longer on SmolLM2's 56 MB head (AR step 1.31 → 1.13 ms streamed, drafter block
/// 0.61 → 0.54), but the stream lost 0.18 ms on Qwen3-8B's 1.2 GB head (AR 5.84 → 6.02).
pub const STREAM_MAX_HEAD_BYTES: usize = 128 << 20;

static POLICY: std::sync::OnceLock<StreamPolicy> = std::sync::OnceLock::new();

/// The policy in force (see [`StreamPolicy`]): what [`set_policy`] chose, else the environment's.
pub fn stream_policy() -> StreamPolicy {
    *POLICY.get_or_init(|| match std::env::var("DFLASH_STREAM_GEMM").as_deref() {
        Ok("0") | Ok("off") => StreamPolicy::Off,
        Ok("head") => StreamPolicy::Head,
        Ok("all") => StreamPolicy::All,
        _ => StreamPolicy::Fast,
    })
}

/// Fixes the policy for the process (the CLI's `--bit-exact` sets [`StreamPolicy::All`]); an error
/// once another policy is in force (it is read at the first projection and never changes, so
/// that a weight is computed by one kernel for the whole run).
pub fn set_policy(policy: StreamPolicy) -> Result<()> {
    let now = *POLICY.get_or_init(|| policy);
    if now != policy {
        return Err(crate::CoreError::InvalidInput(format!(
            "stream GEMM policy already {now:?}, cannot switch to {policy:?}"
        )));
    }
    Ok(())
}

/// Whether a CPU call of `rows` rows of `dtype` (a projection's rows, an attention's query rows)
/// takes the row-invariant host kernels of `crate::rowwise`: every call under
/// [`StreamPolicy::All`]; under the fast default the calls of up to [`STREAM_MAX_ROWS`] rows —
/// each decode step, so greedy speculative output equals AR's on the CPU without `--bit-exact`,
/// in f32 and bf16 alike; longer prefills and training's batched target forwards stay on candle's
/// blocked matmul — and none under `off` / `head`. A function of the row count and the
/// run's dtype only, so every step of a run takes the same kernels.
pub fn cpu_row_invariant(rows: usize, dtype: DType) -> bool {
    match stream_policy() {
        StreamPolicy::All => true,
        StreamPolicy::Fast => {
            rows <= STREAM_MAX_ROWS && matches!(dtype, DType::BF16 | DType::F16 | DType::F32)
        }
        StreamPolicy::Off | StreamPolicy::Head => false,
    }
}

/// Whether a call of `rows` rows on `w` streams (`logits`: the LM head's f32-out call). Depends on
/// the weight and the row count only.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn streams(rows: usize, w: &Tensor, logits: bool) -> bool {
    let bytes = w.elem_count() * w.dtype().size_in_bytes();
    match stream_policy() {
        StreamPolicy::Off => false,
        StreamPolicy::Head => logits && rows <= FAST_MAX_ROWS,
        StreamPolicy::Fast if bulk_fetch().is_some() && rows <= FAST_MAX_ROWS => true,
        // `DFLASH_STREAM_SPLIT=N`: every call of N+ rows on the split kernel (A/B runs)
        StreamPolicy::Fast if split_override().flatten().is_some_and(|from| rows >= from) => {
            rows <= STREAM_MAX_ROWS
        }
        StreamPolicy::Fast => {
            let limit = if logits {
                STREAM_MAX_HEAD_BYTES
            } else {
                STREAM_MAX_BYTES
            };
            let tiles = w.dims().first().map_or(0, |n| n.div_ceil(16));
            // with the wide kernel forced on (`DFLASH_STREAM_WIDE=1`), tree verifies' calls up
            // to its rows stream where 16-row verifies' do; `DFLASH_STREAM_TREE_ROWS=N` streams
            // calls of up to N rows on the narrow kernel, a block per 16-row group
            let max_rows = if wide_fast_calls() && !logits {
                WIDE_MAX_ROWS
            } else {
                stream_tree_rows().unwrap_or(FAST_MAX_ROWS)
            };
            let few = !logits && rows <= FEW_ROWS && tiles >= stream_few_rows_min_tiles();
            (rows <= max_rows && bytes <= limit)
                || (few && bytes <= stream_max_few_rows_bytes())
                || (few && bulk_large_k(rows, w).is_some())
        }
        StreamPolicy::All => rows <= STREAM_MAX_ROWS,
    }
}

/// The bulk-copy kernels' stage shapes (`stream_gemm_bulk.cu`'s `SGB` list): bf16 elements of each
/// of a tile's 16 weight rows a stage holds, and stages in flight.
pub const BULK_VARIANTS: [(usize, usize); 5] = [(256, 4), (512, 3), (512, 4), (512, 6), (1024, 3)];

/// Whether narrow calls (up to 16 rows a block) fetch their weight tiles with the copy engine
/// (`stream_gemm_bulk.cu`: the narrow kernel's bits, its loads as bulk copies into shared memory;
/// compute 9.0+), and with which stage shape: `DFLASH_STREAM_BULK` (read once) `1` (512 elements
/// a row, 4 stages) or `sSPAN_nNST` (one of [`BULK_VARIANTS`], for A/B runs); else off. On, the
/// fast policy streams every call of up to [`FAST_MAX_ROWS`] rows, large weights and LM heads too.
/// Measured on an H200 (session 30): the same bits (GPU test), but slower at every shape but the
/// long-K one [`bulk_large_k`] takes (8B AR at 2048 5.155 → 6.089 ms, 16-row verify 5.84 → 11.00;
/// SmolLM2 AR 0.857 → 1.021) — an A/B switch.
pub fn bulk_fetch() -> Option<(usize, usize)> {
    static V: std::sync::OnceLock<Option<(usize, usize)>> = std::sync::OnceLock::new();
    *V.get_or_init(|| parse_bulk(std::env::var("DFLASH_STREAM_BULK").ok().as_deref()))
}

/// The stage shape the bulk kernels take for the few-row calls (≤ [`FEW_ROWS`]) of a weight whose K
/// is at least [`BULK_LARGE_K`] (Qwen3-8B's down projection, K = 12,288, 100 MB; Qwen3.6-27B's,
/// K = 17,408), on devices that run them (compute 9.0+): 512-element stages three deep. Measured on
/// an H200 (session 30): in isolation (scripts/probe-stream-gemm.py `BULK=1`, weights from DRAM,
/// one row) 26.97 µs against 30.44 on the narrow kernel and 30.23 on cuBLAS (floor 23.55), while
/// the other 8B shapes gained nothing (o 11.55 against 10.83 narrow, gate-up 57.9 against cuBLAS's
/// 49.6); inside the step the 8B AR step 5.117 → 4.993 / 4.996 ms at context 2048 (twice in one
/// call) and 4.866 → 4.756 at 512, the 27B's 16.201 → 16.082, the rest unchanged. The default;
/// `DFLASH_STREAM_BULK_LARGE_K=0` (read once; a documented override) leaves those calls to cuBLAS.
/// `None` for other calls.
pub fn bulk_large_k(rows: usize, w: &Tensor) -> Option<(usize, usize)> {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("DFLASH_STREAM_BULK_LARGE_K").as_deref() != Ok("0"));
    let k = w.dims().get(1).copied().unwrap_or(0);
    (on && rows <= FEW_ROWS && k >= BULK_LARGE_K && bulk_capable(w)).then_some((512, 3))
}

/// Whether `w`'s device runs the bulk kernels (CUDA, compute 9.0+).
#[cfg(feature = "cuda")]
fn bulk_capable(w: &Tensor) -> bool {
    crate::stream_gemm_bulk::runs_on(w)
}
#[cfg(not(feature = "cuda"))]
fn bulk_capable(_: &Tensor) -> bool {
    false
}

/// The smallest K of a weight whose few-row calls take [`bulk_large_k`]'s kernel.
pub const BULK_LARGE_K: usize = 8192;

/// `DFLASH_STREAM_TREE_ROWS=N` (read once; an A/B override, session 30): the fast policy streams
/// calls of up to N rows (at most [`STREAM_MAX_ROWS`]) on weights it streams at 16 rows, on the
/// narrow kernel, one block per 16-row group (each group re-reads the weight, from L2 for small
/// ones) — trees of SmolLM2-sized weights, whose cuBLAS GEMMs of 65 rows cost 5–6 µs each.
fn stream_tree_rows() -> Option<usize> {
    static ROWS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("DFLASH_STREAM_TREE_ROWS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map(|n| n.min(STREAM_MAX_ROWS))
    })
}

fn parse_bulk(v: Option<&str>) -> Option<(usize, usize)> {
    let v = v?;
    if v == "1" {
        return Some((512, 4));
    }
    let (s, n) = v.strip_prefix('s')?.split_once("_n")?;
    let pick = (s.parse().ok()?, n.parse().ok()?);
    BULK_VARIANTS.contains(&pick).then_some(pick)
}

/// The number of warps a block splits K over for a weight `[n, k]`: enough warps in flight to
/// fill an H200-sized GPU (~2112), at least one 64-wide chunk each, at most 8. A function of the
/// weight's shape only, so it never changes a row's arithmetic.
pub fn k_warps(n: usize, k: usize) -> usize {
    let tiles = n.div_ceil(16);
    let mut kw = 1;
    while kw < 8 && tiles * kw < 132 * 16 && 64 * 2 * kw <= k {
        kw *= 2;
    }
    kw
}

/// Whether calls of more than 16 rows take the tiled kernel (`stream_gemm_tiled.cu`: each weight
/// chunk read once per 64 rows instead of once per 16, the narrow kernel's per-element arithmetic)
/// instead of one narrow block per 16-row group: `DFLASH_STREAM_TILED=1` (read once; opt-in: on an
/// H100 in session 21 it was bit-identical with the narrow kernel but far slower — one block per
/// 64×64 output tile walking the whole K leaves too few blocks — its bit-identity is what the GPU test
/// `stream_matmul_matches_and_does_not_depend_on_the_row_count` checks under it).
pub fn tiled_wide_calls() -> bool {
    tiled_from_rows().is_some()
}

/// The fewest rows a call has to take the tiled kernel, when [`tiled_wide_calls`]: 17 (the
/// narrow kernel's 16-row group is its widest), or `DFLASH_STREAM_TILED_FROM=N` (read once; an A/B
/// override: the tiled kernel's arithmetic per element is the narrow one's, so any threshold keeps
/// rows invariant, and 16-row verifies may gain from one weight read per 64 rows too).
pub fn tiled_from_rows() -> Option<usize> {
    static FROM: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *FROM.get_or_init(|| {
        if std::env::var("DFLASH_STREAM_TILED").as_deref() != Ok("1") {
            return None;
        }
        let from = std::env::var("DFLASH_STREAM_TILED_FROM")
            .ok()
            .and_then(|v| v.parse::<usize>().ok());
        Some(from.unwrap_or(17).max(1))
    })
}

/// Whether a call of `rows` rows on `w` (`logits`: the LM head's f32-out call) takes the split
/// kernel (`stream_gemm_tiled.cu`'s `stream_gemm_split_x*`: 64 weight rows × up to 80 x rows a
/// block, the kw partial sums over blocks, the tile's last block adding them in order — the narrow
/// kernel's per-element arithmetic, so the same bits at any row count). By default under
/// [`StreamPolicy::All`] (`--bit-exact`) the calls it measured faster in (H100, session 31,
/// scripts/probe-stream-gemm.py `SPLIT=1`, weights from DRAM, and `bench decode`): weights over
/// [`STREAM_MAX_BYTES`] in calls of more than [`WIDE_MAX_ROWS`] rows, which the wide kernel does
/// not take (Qwen3-8B's projections at 257 rows 38.0 ms a step against 90.6 on the grouped narrow
/// launch; SmolLM2's small weights stay there: 2.30 against 3.34), in calls of 17–32 rows (the
/// 8B's bit-exact 17-row tree verify 13.41 ms on the wide kernel, 10.94 with every call of 2+ rows
/// on this one), and LM heads of 17+ rows (Qwen3-8B at 65 rows 0.69 ms against 0.89 on the wide
/// kernel, SmolLM2 44 against 52 µs); slower than the wide kernel on the other 65-row calls (8B
/// projections 11.7 against 10.6 ms) and than the narrow kernel on one or 16 rows, and slower
/// than cuBLAS everywhere, so never under the fast policy.
/// `DFLASH_STREAM_SPLIT=N` (read once; a documented override for A/B runs): every call of N+ rows
/// (`1`: 17+), under the fast policy too (large weights and LM heads included); `0`: none.
pub fn split_call(rows: usize, w: &Tensor, logits: bool) -> bool {
    match split_override() {
        Some(from) => from.is_some_and(|from| rows >= from),
        None => {
            let bytes = w.elem_count() * w.dtype().size_in_bytes();
            stream_policy() == StreamPolicy::All && split_by_default(rows, bytes, logits)
        }
    }
}

/// [`split_call`]'s default rule under [`StreamPolicy::All`], for a call of `rows` rows on a
/// weight of `bytes` bytes (`logits`: an LM head's call).
fn split_by_default(rows: usize, bytes: usize, logits: bool) -> bool {
    rows > 16 && bytes > STREAM_MAX_BYTES && (rows <= 32 || rows > WIDE_MAX_ROWS || logits)
}

/// `DFLASH_STREAM_SPLIT` (read once): `Some(Some(n))` every call of n+ rows (`1`: 17), `Some(None)`
/// none (`0`), `None` unset or unreadable (the default rule).
fn split_override() -> Option<Option<usize>> {
    static FROM: std::sync::OnceLock<Option<Option<usize>>> = std::sync::OnceLock::new();
    *FROM.get_or_init(|| {
        match std::env::var("DFLASH_STREAM_SPLIT")
            .ok()?
            .trim()
            .parse::<usize>()
        {
            Ok(0) => Some(None),
            Ok(1) => Some(Some(17)),
            Ok(n) => Some(Some(n)),
            Err(_) => None,
        }
    })
}

/// The tile of a split-kernel call of `m` rows: weight rows a block (BN, 64) and x-row tiles (XT;
/// a block's x rows are 16·XT): one tile of 16, 32, 64 or 80 rows for calls up to 80 rows, 80-row
/// tiles beyond. (Taller weight tiles are compiled for the probe alone: stream_gemm_tiled.cu.)
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn split_tile(m: usize) -> (usize, usize) {
    let xt = match m {
        0..=16 => 1,
        17..=32 => 2,
        33..=64 => 4,
        _ => 5,
    };
    (64, xt)
}

/// The most rows a call on the wide kernel takes (16 per row group, five groups: DDTree-64
/// verifies); calls of 17 up to this many rows take it when [`wide_calls`].
pub const WIDE_MAX_ROWS: usize = 80;

/// Whether calls of 17 to [`WIDE_MAX_ROWS`] rows (plain or f32-out epilogue) take the wide kernel
/// (`stream_gemm.cu`'s `stream_gemm_wide`: one block per 16 outputs for every row of the call, so
/// each weight chunk is read once, not once per 16-row group; the narrow kernel's arithmetic per
/// element, so the same bits): by default under [`StreamPolicy::All`] (`--bit-exact`). Measured on
/// an H100 (session 27, Qwen3-8B at context 2048): the bit-exact DDTree-64 verify 32.1 → 16.7 ms,
/// its loop step 35.2 → 20.0, with every GPU bits test passing under it (the streamed calls'
/// row invariance, bit-exact verify rows equal to AR steps). `DFLASH_STREAM_WIDE=0|1` (read once; a
/// documented override) forces it off or on; on under the fast policy it also streams tree
/// verifies' calls of ≤ 16 MiB weights (measured there: SmolLM2's DDTree-64 verify 1.47 → 1.84 ms,
/// so not by default).
pub fn wide_calls() -> bool {
    wide_override().unwrap_or_else(|| stream_policy() == StreamPolicy::All)
}

/// Whether a call of a weight with `n` outputs takes the wide kernel (when [`wide_calls`]) on a GPU
/// of `multiprocessors` SMs: only where its blocks (one per 16 outputs) fill the GPU, `n / 16 ≥`
/// the SM count; a weight with fewer outputs takes one narrow block per 16-row group instead (the
/// same bits: the wide kernel is the narrow one's arithmetic). Measured on an H100 (session 31's
/// probe, SmolLM2's weights at 65 rows, µs a call, grouped narrow against wide): q/k/v (60 tiles)
/// 5.29 against 6.16, o (36) 3.91 against 6.12, down (36) 5.47 against 8.16, but gate-up (192)
/// 10.94 against 8.45; Qwen3-8B's weights (256+ tiles) all faster wide. `DFLASH_STREAM_WIDE_MIN_TILES=N`
/// (read once; a documented override for A/B runs) fixes the threshold; 0 takes every call wide
/// (the rule before session 33).
pub fn wide_fills(n: usize, multiprocessors: usize) -> bool {
    static MIN: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let forced = *MIN.get_or_init(|| {
        std::env::var("DFLASH_STREAM_WIDE_MIN_TILES")
            .ok()
            .and_then(|v| v.trim().parse().ok())
    });
    n.div_ceil(16) >= forced.unwrap_or(multiprocessors)
}

/// Whether the fast policy streams tree verifies' calls on the wide kernel (`DFLASH_STREAM_WIDE=1`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn wide_fast_calls() -> bool {
    wide_override() == Some(true)
}

/// `DFLASH_STREAM_WIDE`: `1` on, `0` off, else unset (read once).
fn wide_override() -> Option<bool> {
    static FORCED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    *FORCED.get_or_init(|| match std::env::var("DFLASH_STREAM_WIDE").as_deref() {
        Ok("1") => Some(true),
        Ok("0") => Some(false),
        _ => None,
    })
}

/// What the kernel feeds the tensor cores and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Epilogue {
    /// `x · wᵀ`, bf16 out.
    Bf16,
    /// `x · wᵀ`, f32 out (logits).
    F32,
    /// `bf16(silu(gate) · up) · wᵀ` for `x = [gate | up]`, bf16 out (the MLP's down projection).
    Silu,
}

/// `x · wᵀ` (`x` `[.., K]` bf16, `w` `[N, K]` bf16): `[.., N]` in bf16, or f32 when `f32_out`
/// (the LM head); `None` when the policy or the kernel leaves the call to cuBLAS.
pub fn stream_matmul(x: &Tensor, w: &Tensor, f32_out: bool) -> Result<Option<Tensor>> {
    run(x, w, out_epilogue(f32_out), true)
}

/// The MLP's activation and down projection as one kernel: `bf16(silu(gate) · up) · wᵀ` for
/// `gate_up = [gate | up]` (`[.., 2·K]` bf16, the fused gate-up projection's output) and `w`
/// `[N, K]` — the same numbers as `decode_ops::silu_mul` followed by [`stream_matmul`]. Opt-in,
/// `DFLASH_SILU_EPILOGUE=1` (read once); `None` otherwise, or when the policy or the kernel leaves
/// the call to the two-kernel path. Every block of the fused kernel computes the activations of all
/// of `K` for its 16 outputs where the two-kernel path computes them once: measured on an H100
/// (session 25), the two kernels take SmolLM2's AR step 0.94 → 0.85 ms and its 16-row verify
/// 1.26 → 1.09, and cost nothing at the Qwen3.5-4B and Qwen3.6-27B shapes.
pub fn stream_silu_matmul(gate_up: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*ON.get_or_init(|| std::env::var("DFLASH_SILU_EPILOGUE").as_deref() == Ok("1")) {
        return Ok(None);
    }
    run(gate_up, w, Epilogue::Silu, true)
}

/// [`stream_matmul`] whatever the policy (`None` only where the kernel cannot run): for tests and
/// callers that need the row-invariant numbers.
pub fn stream_matmul_always(x: &Tensor, w: &Tensor, f32_out: bool) -> Result<Option<Tensor>> {
    run(x, w, out_epilogue(f32_out), false)
}

/// [`stream_matmul_always`] on the split kernel (see [`split_call`]), whatever
/// `DFLASH_STREAM_SPLIT`: `None` where it cannot run (not CUDA, more than [`STREAM_MAX_ROWS`] rows,
/// the narrow kernel's other conditions, no counters to be had). For tests: its outputs must be
/// the narrow kernel's, bit for bit.
pub fn stream_matmul_split_always(x: &Tensor, w: &Tensor, f32_out: bool) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if let (candle_core::Device::Cuda(dev), DType::BF16, DType::BF16) =
        (x.device(), x.dtype(), w.dtype())
    {
        let (m, k) = x.dims2()?;
        let (_, wk) = w.dims2()?;
        if m == 0 || m > STREAM_MAX_ROWS || k != wk || !k.is_multiple_of(64) || !w.is_contiguous() {
            return Ok(None);
        }
        let x = x.contiguous()?;
        return crate::stream_gemm_cuda::split_matmul(&x, w, f32_out, dev);
    }
    let _ = (x, w, f32_out);
    Ok(None)
}

/// [`stream_matmul_always`] on the bulk-copy kernel with stage shape `variant` (one of
/// [`BULK_VARIANTS`]), whatever `DFLASH_STREAM_BULK`: `None` where it cannot run (not CUDA, a
/// device older than compute 9.0, more than 16 · 18 rows, the narrow kernel's other conditions).
/// For tests: its outputs must be the narrow kernel's, bit for bit.
pub fn stream_matmul_bulk_always(
    x: &Tensor,
    w: &Tensor,
    f32_out: bool,
    variant: (usize, usize),
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dtype() == DType::BF16 && w.dtype() == DType::BF16 {
        let (m, k) = x.dims2()?;
        let (_, wk) = w.dims2()?;
        if m == 0 || m > STREAM_MAX_ROWS || k != wk || !k.is_multiple_of(64) || !w.is_contiguous() {
            return Ok(None);
        }
        let x = x.contiguous()?;
        return crate::stream_gemm_bulk::matmul(&x, w, f32_out, variant);
    }
    let _ = (x, w, f32_out, variant);
    Ok(None)
}

/// [`stream_silu_matmul`] whatever the policy.
pub fn stream_silu_matmul_always(gate_up: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    run(gate_up, w, Epilogue::Silu, false)
}

/// Whether a residual add and the RMSNorm after it run as the prologue of the projection that
/// reads the norm ([`stream_add_norm_matmul`]): `DFLASH_FUSED_ADD_NORM=1` (read once; opt-in,
/// built in session 15, measured no faster on an H100 in session 19).
pub fn fused_add_norm() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DFLASH_FUSED_ADD_NORM").as_deref() == Ok("1"))
}

/// `(s, n · wᵀ)` for `s = x + d` and `n = rms_norm(s) · norm_w` (`x`, `d` `[.., K]` bf16, `w`
/// `[N, K]` bf16): the residual add, its norm and the projection after it as one streaming-GEMM
/// kernel (every block recomputes the few rows' norms; one writes `s`). `s` holds the values
/// `decode_ops::add_rms_norm` writes; the normed rows differ from its only by the order of the
/// sum of squares (one fixed order, whatever the row count). `None` when [`fused_add_norm`] is
/// off or the policy or the kernel leaves the call to the two-kernel path.
pub fn stream_add_norm_matmul(
    x: &Tensor,
    d: &Tensor,
    norm_w: &Tensor,
    eps: f64,
    w: &Tensor,
) -> Result<Option<(Tensor, Tensor)>> {
    if !fused_add_norm() {
        return Ok(None);
    }
    add_norm_matmul(x, d, norm_w, eps, w, true)
}

/// [`stream_add_norm_matmul`] whatever the switch and the policy (`None` only where the kernel
/// cannot run): for tests.
pub fn stream_add_norm_matmul_always(
    x: &Tensor,
    d: &Tensor,
    norm_w: &Tensor,
    eps: f64,
    w: &Tensor,
) -> Result<Option<(Tensor, Tensor)>> {
    add_norm_matmul(x, d, norm_w, eps, w, false)
}

fn add_norm_matmul(
    x: &Tensor,
    d: &Tensor,
    norm_w: &Tensor,
    eps: f64,
    w: &Tensor,
    by_policy: bool,
) -> Result<Option<(Tensor, Tensor)>> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda()
        && [x.dtype(), d.dtype(), norm_w.dtype(), w.dtype()] == [DType::BF16; 4]
        && x.dims() == d.dims()
        && w.rank() == 2
    {
        let width = x.dim(candle_core::D::Minus1)?;
        let lead = &x.dims()[..x.rank() - 1];
        let rows: usize = lead.iter().product();
        if rows == 0 || rows > STREAM_MAX_ROWS || (by_policy && !streams(rows, w, false)) {
            return Ok(None);
        }
        let Some((s, y)) = crate::stream_gemm_cuda::stream_add_norm_matmul(
            &x.reshape((rows, width))?,
            &d.reshape((rows, width))?,
            norm_w,
            eps as f32,
            w,
        )?
        else {
            return Ok(None);
        };
        let mut shape = lead.to_vec();
        shape.push(w.dim(0)?);
        return Ok(Some((s.reshape(x.dims())?, y.reshape(shape)?)));
    }
    let _ = (x, d, norm_w, eps, w, by_policy);
    Ok(None)
}

fn out_epilogue(f32_out: bool) -> Epilogue {
    if f32_out {
        Epilogue::F32
    } else {
        Epilogue::Bf16
    }
}

fn run(x: &Tensor, w: &Tensor, epilogue: Epilogue, by_policy: bool) -> Result<Option<Tensor>> {
    // neither kernel has a backward: a product that autograd must see through (a drafter's
    // training forward through the target's LM head) stays on candle's matmul
    if x.track_op() || w.track_op() {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dtype() == DType::BF16 && w.dtype() == DType::BF16 {
        let width = x.dim(candle_core::D::Minus1)?;
        let lead = &x.dims()[..x.rank() - 1];
        let rows: usize = lead.iter().product();
        if rows == 0 || rows > STREAM_MAX_ROWS || w.rank() != 2 {
            return Ok(None);
        }
        if by_policy && !streams(rows, w, epilogue == Epilogue::F32) {
            return Ok(None);
        }
        let Some(y) =
            crate::stream_gemm_cuda::stream_matmul(&x.reshape((rows, width))?, w, epilogue)?
        else {
            return Ok(None);
        };
        let mut shape = lead.to_vec();
        shape.push(w.dim(0)?);
        return Ok(Some(y.reshape(shape)?));
    }
    // the CPU: row-invariant host kernels (the default for decode steps, every call under `all`)
    if x.device().is_cpu() && epilogue != Epilogue::Silu {
        let width = x.dim(candle_core::D::Minus1)?;
        let lead = &x.dims()[..x.rank() - 1];
        let rows: usize = lead.iter().product();
        if rows == 0
            || w.rank() != 2
            || w.dtype() != x.dtype()
            || !cpu_row_invariant(rows, x.dtype())
        {
            return Ok(None);
        }
        let y = crate::rowwise::matmul_t(&x.reshape((rows, width))?, w, epilogue == Epilogue::F32)?;
        let mut shape = lead.to_vec();
        shape.push(w.dim(0)?);
        return Ok(Some(y.reshape(shape)?));
    }
    let _ = (x, w, epilogue, by_policy, DType::BF16);
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::{parse_bulk, split_by_default, wide_fills, BULK_VARIANTS, STREAM_MAX_BYTES};

    #[test]
    fn wide_calls_take_weights_whose_blocks_fill_the_gpu() {
        // 132 SMs (H100 / H200): SmolLM2's q/k/v, o and down stay narrow, its gate-up and every
        // Qwen3-8B projection go wide (unless DFLASH_STREAM_WIDE_MIN_TILES overrides it)
        if std::env::var("DFLASH_STREAM_WIDE_MIN_TILES").is_ok() {
            return;
        }
        for (n, wide) in [
            (960, false),
            (576, false),
            (3072, true),
            (2112, true),
            (2096, false),
        ] {
            assert_eq!(wide_fills(n, 132), wide, "{n} outputs");
        }
        for n in [6144, 4096, 24576] {
            assert!(wide_fills(n, 132));
        }
        assert!(!wide_fills(4096, 300));
    }

    #[test]
    fn bit_exact_calls_split_where_the_split_kernel_measured_faster() {
        let large = 33 << 20; // Qwen3-8B's o projection
                              // 17–32 rows and 81+ rows of large weights; LM heads from 17 rows
        for rows in [17, 32, 81, 257, 288] {
            assert!(split_by_default(rows, large, false), "{rows} rows");
        }
        for rows in [17, 65, 80] {
            assert!(split_by_default(rows, large, true), "head, {rows} rows");
        }
        // the narrow kernel's AR steps and 16-row blocks, the wide kernel's 33–80 rows
        for rows in [1, 4, 16, 33, 65, 80] {
            assert!(!split_by_default(rows, large, false), "{rows} rows");
        }
        assert!(!split_by_default(16, large, true));
        // small weights (SmolLM2's projections) keep the grouped narrow launch at any width
        for rows in [17, 65, 257] {
            assert!(
                !split_by_default(rows, STREAM_MAX_BYTES, false),
                "{rows} rows"
            );
            assert!(!split_by_default(rows, 3 << 20, true), "{rows} rows");
        }
    }

    #[test]
    fn the_bulk_switch_names_a_compiled_stage_shape_or_nothing() {
        assert_eq!(parse_bulk(None), None);
        assert_eq!(parse_bulk(Some("1")), Some((512, 4)));
        assert!(BULK_VARIANTS.contains(&(512, 4)));
        for (span, nst) in BULK_VARIANTS {
            assert_eq!(
                parse_bulk(Some(&format!("s{span}_n{nst}"))),
                Some((span, nst))
            );
        }
        // not compiled, malformed, or off
        for v in ["s512_n5", "s128_n4", "512_4", "s512", "0", "", "yes"] {
            assert_eq!(parse_bulk(Some(v)), None, "{v}");
        }
    }
}
