//! Launches of the device-step kernels (`step_kernels.cu`, NVRTC, compiled once per process);
//! the CUDA-graph plumbing of [`crate::step_graph`] is in `step_graph_cuda`.
//!
//! Invariants: every tensor is read at its contiguous offset (anything strided is an error); the
//! cache buffers are written in place through their device addresses (they are never shared with
//! a live reader in the same step); everything runs on candle's stream, in order.

use crate::{CoreError, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    self, sys, DevicePtr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{DType, Storage, Tensor};
use std::sync::OnceLock;

pub(crate) use crate::step_copies_cuda::{
    add_rms_norm_into, copy_into, keep_rows_all, qkv_heads_into_cache, upload_meta,
};

/// The step module: the kernels of `step_kernels.cu`, then the bf16 tensor-core attention of
/// `tree_attn_mma.cu` (which uses the former's helpers) and `tree_attn_rows.cu` (which uses
/// those). Compiled for compute 8.0 or later.
const SOURCE: &str = concat!(
    include_str!("step_kernels.cu"),
    include_str!("tree_attn_mma.cu"),
    include_str!("tree_attn_rows.cu")
);
pub(crate) const MODULE: &str = "dflash_step_kernels";
/// Keys per split of the attention. A row's softmax is merged over splits in order, so its
/// result depends on the split boundaries: one chunk size for every step of up to 129 rows (an
/// AR token, a DFlash block, DDTree trees of budget ≤ 128) keeps a verified row bit-identical to
/// the AR step at that position (with 65-row trees on 128-key chunks, 9 of 10 bf16 GSM8K
/// generations diverged from AR, docs/benchmarks.md session 11). Wider trees take larger chunks
/// (bounded partial-result memory), except under `--bit-exact`, where every step keeps the AR
/// step's 64 (its trees of up to [`crate::step::MAX_STEP_ROWS`] rows run as device steps, and
/// their rows must equal AR steps bit for bit; session 30, its GPU bit test passed on an H100 in
/// session 31) — at the cost of
/// partial records that grow with the splits: heads · rows · cap/64 · (d + 2) f32, ~137 MB for a
/// 257-row tree at Qwen3-8B's shape over 2,048 keys, ~2.2 GB over 32,768 (transient, one layer at
/// a time).
fn chunk_for(rows: usize) -> usize {
    if rows <= 129 || crate::stream_gemm::stream_policy() == crate::stream_gemm::StreamPolicy::All {
        64
    } else {
        256
    }
}
/// A split size from environment variable `var`: a positive multiple of 64, else none.
fn chunk_from_env(var: &str) -> Option<usize> {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|c| *c > 0 && c.is_multiple_of(64))
}
/// The one-row step's splits outside `--bit-exact` and wherever trees take their keys by position
/// (there a verified row's bits equal the AR step's only at [`chunk_for`]'s splits:
/// `DFLASH_TREE_KEYS=position` without `--bit-exact` too — session 30 found its tree-row bit test
/// failing at context 2040 under session 29's rule), for bf16 128-wide heads on the tensor cores
/// (`row_heads`: their verifies take the row kernel's own splits, so the AR step's match no
/// verify's anyway — f32 and other widths keep [`chunk_for`]'s, which their verifies share):
/// [`crate::step::one_row_chunk`]'s rule over `columns` blocks a split and `cap` keys.
/// `DFLASH_STEP_CHUNK=N` (a multiple of 64; read once; a documented override for A/B runs) fixes
/// it for every such one-row step. `None` for other steps.
fn one_row_chunk(
    n: usize,
    row_heads: bool,
    (columns, cap): (usize, usize),
    dev: &CudaDevice,
) -> Option<usize> {
    static CHUNK: OnceLock<Option<usize>> = OnceLock::new();
    let forced = *CHUNK.get_or_init(|| chunk_from_env("DFLASH_STEP_CHUNK"));
    // keys by position on the tensor cores: `--bit-exact`'s default, or forced
    if n != 1 || crate::step::keys_by_position(true) {
        return None;
    }
    forced.or_else(|| {
        row_heads.then(|| crate::step::one_row_chunk(columns, cap, multiprocessors(dev)))
    })
}
/// Rows above which a step with keys by position (`--bit-exact`) lets the row kernel take its
/// splits of cached keys alone (see [`tree_attention`]).
const BIT_EXACT_ROWS_FROM: usize = 64;
/// Rows above which a bf16 step on the tensor cores with keys by step row (a DDTree verify; not
/// `--bit-exact`, whose keys by position keep [`chunk_for`]) takes [`tree_chunk`]'s chunks.
const TREE_CHUNK_FROM_ROWS: usize = 16;
/// Keys per split of a tree's attention on the tensor cores with keys by step row, over `columns`
/// blocks a split (kv heads × vector groups) and buffers of `cap` keys: the widest of 256 and 128
/// that still gives every multiprocessor two blocks, else 64. A block stages its query vectors
/// once for all its tiles, and the f32 partial records every split writes and the merge reads
/// shrink with the split count (at Qwen3-8B's shape, a 65-node tree over 2,048 keys wrote 36 MB of
/// them a layer on 64-key chunks). Measured on an H100 (session 25, fixed chunks): Qwen3-8B's
/// DDTree-64 verify at context 2048 11.63 ms on 64-key chunks, 10.53 on 128, 10.58 on 256 (its
/// DDTree loop step 14.88 → 12.92 / 12.55), its 17-row tree 8.46 / 8.01 / 8.33; SmolLM2's 65-row
/// tree at context 512 1.379 / 1.389 / 1.594 and its 17-row one 1.200 / 1.257 / 1.523 — the rule
/// picks the best of each. Such a row's bits already differ from the AR step's (keys by row;
/// cuBLAS GEMMs), so its split boundaries are free. On the row kernel (`rows`; since session 28
/// every bf16 step of 2+ rows of 128-wide heads with keys by step row, DFlash blocks included)
/// the chunk is [`crate::step::row_kernel_chunk`]'s; chains of up to 16 rows on the other kernels
/// keep [`chunk_for`]'s. `DFLASH_TREE_CHUNK=N` (a multiple of 64; read once) fixes the chunk, for
/// A/B runs.
fn tree_chunk(columns: usize, cap: usize, rows: bool, dev: &CudaDevice) -> usize {
    static FORCED: OnceLock<Option<usize>> = OnceLock::new();
    let forced = *FORCED.get_or_init(|| chunk_from_env("DFLASH_TREE_CHUNK"));
    if let Some(c) = forced {
        return c;
    }
    if rows {
        crate::step::row_kernel_chunk(columns, cap, multiprocessors(dev))
    } else {
        crate::step::wide_tree_chunk(columns, cap, multiprocessors(dev))
    }
}

/// The device's multiprocessor count (read once; 132 on an H100 or H200, and taken as 132 if the
/// driver will not say).
pub(crate) fn multiprocessors(dev: &CudaDevice) -> usize {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    static SMS: OnceLock<usize> = OnceLock::new();
    *SMS.get_or_init(|| {
        dev.cuda_stream()
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_or(132, |n| n.max(1) as usize)
    })
}

/// The attention kernel's K/V staging for a step of `rows` rows: 16-byte loads (`""`), or element
/// by element (`"wide_"`, fewer registers) for steps wider than 129 rows, where more resident
/// blocks win (H200, session 14: SmolLM2 bf16 AR step 1.397 → 1.317 ms and Qwen3-8B 5.94 → 5.47
/// with 16-byte loads, but a 257-row tree 3.80 → 5.61). `DFLASH_ATTN_STAGING=scalar` (a
/// documented override for A/B runs) stages element by element at every width. Same arithmetic.
fn staging_for(rows: usize) -> &'static str {
    static SCALAR: OnceLock<bool> = OnceLock::new();
    let scalar =
        *SCALAR.get_or_init(|| std::env::var("DFLASH_ATTN_STAGING").as_deref() == Ok("scalar"));
    if scalar || rows > 129 {
        "wide_"
    } else {
        ""
    }
}
const WARPS: usize = 8;
const VECTORS_PER_BLOCK: usize = 16;
/// Warps and query vectors per block of the tensor-core attention (`tree_attn_mma.cu`).
const MMA_WARPS: usize = 4;
const MMA_VECTORS_PER_BLOCK: usize = 16 * MMA_WARPS;

pub(crate) fn ptx() -> candle_core::Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        let mut opts = crate::pdl::nvrtc_options(Some("compute_80"));
        // opt-in attention variant built in session 15 and measured no faster (a documented
        // override): the next K/V tile loaded while the current one is scored
        // (`DFLASH_ATTN_PREFETCH=1`)
        if std::env::var("DFLASH_ATTN_PREFETCH").as_deref() == Ok("1") {
            opts.options.push("-DDFLASH_TILE_PREFETCH".into());
        }
        // opt-in (session 26; measured no faster on an H100 in session 27: Qwen3-8B's DDTree-64
        // verify at context 2048 10.79 → 11.04 ms, every GPU test passing under it): the general
        // tensor-core attention's tiles by a cp.async pipeline — values loading while keys are
        // scored, the next keys while values are summed — instead of register staging between
        // two barriers (the same numbers) (`DFLASH_ATTN_PIPELINE=1`)
        if std::env::var("DFLASH_ATTN_PIPELINE").as_deref() == Ok("1") {
            opts.options.push("-DDFLASH_ATTN_PIPELINE".into());
        }
        // opt-in (session 21, measured no faster on an H100): the tensor-core kernel keeps each warp's tree
        // paths and depths in shared memory for the per-row reads of keys by position
        // (`DFLASH_ATTN_PATH_TABLE=1`)
        if std::env::var("DFLASH_ATTN_PATH_TABLE").as_deref() == Ok("1") {
            opts.options.push("-DDFLASH_PATH_TABLE".into());
        }
        // the row kernel's resident blocks an SM asked of the compiler (`DFLASH_ATTN_ROWS_BLOCKS`,
        // 2 or 3; 3 by default: 168 registers, a few bytes spilled; 2: 209, none)
        if let Ok(b) = std::env::var("DFLASH_ATTN_ROWS_BLOCKS") {
            if matches!(b.as_str(), "2" | "3") {
                opts.options.push(format!("-DRW_MIN_BLOCKS={b}"));
            }
        }
        candle_core::cuda_backend::cudarc::nvrtc::compile_ptx_with_opts(
            crate::pdl::with_prelude(SOURCE),
            opts,
        )
        .map(|p| p.to_src())
        .map_err(|e| format!("step kernels: NVRTC failed: {e:?}"))
    })
    .as_deref()
    .map_err(|e| candle_core::Error::Msg(e.clone()))
}

/// Lets kernel `name` (function `f`, loaded on `dev`) take `bytes` of dynamic shared memory (past
/// the default 48 KB) and prefer shared memory over L1, once per (device, kernel): each device
/// loads its own module, and a launch on a device whose function lacks the attribute fails with an
/// invalid argument.
pub(crate) fn allow_dynamic_shared_memory(
    f: &driver::CudaFunction,
    dev: &CudaDevice,
    name: &str,
    bytes: usize,
) -> Result<()> {
    use candle_core::cuda_backend::DeviceId;
    use std::collections::HashSet;
    use std::sync::Mutex;
    use sys::CUfunction_attribute_enum as A;
    static SET: OnceLock<Mutex<HashSet<(DeviceId, String)>>> = OnceLock::new();
    let mut set = SET
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let key = (dev.id(), name.to_string());
    if set.contains(&key) {
        return Ok(());
    }
    f.set_attribute(
        A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes as i32,
    )
    .and_then(|()| f.set_attribute(A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100))
    .map_err(|e| CoreError::InvalidInput(format!("{name}: shared memory attribute: {e:?}")))?;
    set.insert(key);
    Ok(())
}

/// A contiguous tensor's device address (its first element) and device.
pub(crate) fn address(t: &Tensor, what: &str) -> Result<(u64, CudaDevice)> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(CoreError::InvalidInput(format!(
            "{what}: not a CUDA tensor"
        )));
    };
    if !layout.is_contiguous() {
        return Err(CoreError::InvalidInput(format!("{what}: strided tensor")));
    }
    let dev = cs.device().clone();
    let stream = dev.cuda_stream();
    let off = layout.start_offset() as u64;
    let ptr = match cs.dtype() {
        DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0 + 4 * off,
        DType::BF16 => cs.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0 + 2 * off,
        DType::U32 => cs.as_cuda_slice::<u32>()?.device_ptr(&stream).0 + 4 * off,
        DType::I64 => cs.as_cuda_slice::<i64>()?.device_ptr(&stream).0 + 8 * off,
        d => {
            return Err(CoreError::InvalidInput(format!(
                "{what}: {d:?} is not a device-step dtype"
            )))
        }
    };
    Ok((ptr, dev))
}

pub(crate) fn suffix(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        d => Err(CoreError::InvalidInput(format!(
            "device step: {d:?} not supported"
        ))),
    }
}

/// Launches kernel `$name` of the step module with the given arguments, in order.
macro_rules! launch {
    ($dev:expr, $name:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let f = $dev.get_or_load_custom_func($name, MODULE, ptx()?)?;
        crate::pdl::mark(&f);
        let mut b = f.builder();
        $( b.arg($arg); )+
        // SAFETY: every caller passes arguments in the kernel's order and types, with device
        // addresses of live tensors of the sizes the kernel reads and writes.
        unsafe { b.launch($cfg) }.w()?;
    }};
}

pub(crate) fn kv_append_at(
    kbuf: &Tensor,
    vbuf: &Tensor,
    k: &Tensor,
    v: &Tensor,
    meta: &Tensor,
) -> Result<()> {
    let (_, kv, n, d) = k.dims4()?;
    let (_, kvb, cap, db) = kbuf.dims4()?;
    if kv != kvb || d != db || v.dims() != k.dims() || vbuf.dims() != kbuf.dims() {
        return Err(CoreError::InvalidInput(format!(
            "kv_append_at: k {:?}, v {:?} into {:?} / {:?}",
            k.dims(),
            v.dims(),
            kbuf.dims(),
            vbuf.dims()
        )));
    }
    let dtype = k.dtype();
    if [v.dtype(), kbuf.dtype(), vbuf.dtype()]
        .iter()
        .any(|&t| t != dtype)
    {
        return Err(CoreError::InvalidInput("kv_append_at: mixed dtypes".into()));
    }
    let (kp, dev) = address(k, "kv_append_at k")?;
    let (vp, _) = address(v, "kv_append_at v")?;
    let (kbp, _) = address(kbuf, "kv_append_at cache")?;
    let (vbp, _) = address(vbuf, "kv_append_at cache")?;
    let (mp, _) = address(meta, "kv_append_at meta")?;
    let total = kv * n * d;
    let cfg = LaunchConfig {
        grid_dim: (total.div_ceil(256).min(4096) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (kvi, ni, capi, di) = (kv as i32, n as i32, cap as i32, d as i32);
    launch!(
        dev,
        &format!("kv_append_{}", suffix(dtype)?),
        cfg,
        &kp,
        &vp,
        &kbp,
        &vbp,
        &mp,
        &kvi,
        &ni,
        &capi,
        &di
    );
    Ok(())
}

pub(crate) fn tree_ancestors(meta: &Tensor, rows: usize) -> Result<Tensor> {
    if rows == 0 || rows > crate::step::MAX_STEP_ROWS || meta.elem_count() < 1 + 4 * rows {
        return Err(CoreError::InvalidInput(format!(
            "tree_ancestors: {rows} rows, metadata of {} words",
            meta.elem_count()
        )));
    }
    let (mp, dev) = address(meta, "tree_ancestors meta")?;
    let words = crate::step::ANCESTOR_WORDS;
    // SAFETY: the kernel writes the bits and the depth of every row, and its path up to its depth
    // (the only words read).
    let anc = unsafe { Tensor::empty((rows, words), DType::U32, meta.device())? };
    let (ap, _) = address(&anc, "tree_ancestors output")?;
    let ni = rows as i32;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(dev, "tree_ancestors", cfg, &mp, &ni, &ap);
    Ok(anc)
}

/// See [`crate::step::step_mask`].
pub(crate) fn step_mask(
    meta: &Tensor,
    ancestors: &Tensor,
    rows: usize,
    cap: usize,
) -> Result<Tensor> {
    if ancestors.dims() != [rows, crate::step::ANCESTOR_WORDS] || cap == 0 {
        return Err(CoreError::InvalidInput(format!(
            "step_mask: ancestors {:?} for {rows} rows, {cap} keys",
            ancestors.dims()
        )));
    }
    let (mp, dev) = address(meta, "step_mask meta")?;
    let (ap, _) = address(ancestors, "step_mask ancestors")?;
    // SAFETY: the kernel writes every element.
    let out = unsafe { Tensor::empty((rows, cap), DType::F32, meta.device())? };
    let (op, _) = address(&out, "step_mask output")?;
    let (ri, ci) = (rows as i32, cap as i32);
    let cfg = LaunchConfig {
        grid_dim: ((rows * cap).div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(dev, "step_mask_f32", cfg, &mp, &ap, &ri, &ci, &op);
    Ok(out)
}

/// Counters the attention's fused merge needs (one per block column), or `None` to take the
/// separate combine kernel: more columns than [`block_counters`] holds, `DFLASH_FUSED_MERGE=0`, or
/// no buffer yet while the stream is being captured.
fn merge_counters(dev: &CudaDevice, columns: usize) -> Result<Option<u64>> {
    static ON: OnceLock<bool> = OnceLock::new();
    if !*ON.get_or_init(|| std::env::var("DFLASH_FUSED_MERGE").as_deref() != Ok("0")) {
        return Ok(None);
    }
    block_counters(dev, columns)
}

/// The address of `count` u32 counters, zero between launches, for kernels whose last block of a
/// group to arrive finishes the group's work (the attention's fused merge, the split streaming
/// GEMM): every launch that takes them leaves them zero, and launches on one stream never overlap
/// (a PDL launch waits for its predecessor before touching memory), so the kernels share one
/// buffer. `None`: more counters than the buffer holds, or no buffer yet while the stream is being
/// captured (a buffer allocated inside a capture would belong to the graph). One buffer per device
/// of the process, made on its first eager call.
pub(crate) fn block_counters(dev: &CudaDevice, count: usize) -> Result<Option<u64>> {
    use candle_core::cuda_backend::DeviceId;
    use std::collections::HashMap;
    const COUNTERS: usize = 8192;
    static BUFFERS: std::sync::Mutex<Option<HashMap<DeviceId, Tensor>>> =
        std::sync::Mutex::new(None);
    if count > COUNTERS {
        return Ok(None);
    }
    let mut buffers = BUFFERS
        .lock()
        .map_err(|_| CoreError::InvalidInput("block counters: poisoned".into()))?;
    let map = buffers.get_or_insert_with(HashMap::new);
    if let std::collections::hash_map::Entry::Vacant(slot) = map.entry(dev.id()) {
        let capturing = dev.cuda_stream().capture_status().w()?
            != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        if capturing {
            return Ok(None);
        }
        let device = candle_core::Device::Cuda(dev.clone());
        slot.insert(Tensor::zeros(COUNTERS, DType::U32, &device)?);
    }
    let t = &map[&dev.id()];
    Ok(Some(address(t, "block counters")?.0))
}

/// The tensor-core attention for steps of few query vectors, `group_attn_mma_bf16_d{64,128}`: the
/// same bits as `tree_attn_mma_bf16` for every vector (so a verified row still equals its AR
/// step), with 16 vectors a block and the tile's keys and channels spread over the block's four
/// warps, compiled per head width (the general kernel leaves one warp with ~1,500 dependent
/// instructions a tile — for a one-row step 17.6 µs a layer at SmolLM2 and 26 µs at Qwen3-8B on an
/// H100, session 24 — and three of its four warps idle). Taken when no row reads its keys one by
/// one (keys by step row, or a one-row step) for up to `DFLASH_GROUP_ATTN_VECTORS` query vectors
/// (rows × heads per kv head; by default any number for 64-wide heads and 64 for 128-wide ones:
/// each block stages its own tiles, so wide trees of wide heads keep the general kernel, whose
/// four warps share them). With the row kernel's default (`DFLASH_ATTN_ROWS=2`, session 28) the
/// steps of 2+ rows of 128-wide heads with keys by step row leave it for the row kernel.
/// `DFLASH_DECODE_ATTN=tree` (a documented override for A/B runs) keeps the general kernel
/// everywhere.
fn group_kernel(mma: bool, logical: bool, n: usize, rep: usize, d: usize) -> Option<String> {
    static GENERAL: OnceLock<bool> = OnceLock::new();
    static MAX_VECTORS: OnceLock<usize> = OnceLock::new();
    let general =
        *GENERAL.get_or_init(|| std::env::var("DFLASH_DECODE_ATTN").as_deref() == Ok("tree"));
    let max_vectors = *MAX_VECTORS.get_or_init(|| {
        std::env::var("DFLASH_GROUP_ATTN_VECTORS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    });
    // measured (H100, session 24): 64-wide heads gain at every width (SmolLM2 tree64 1.45 → 1.35
    // ms, tree256 3.93 → 3.58), 128-wide heads lose past 64 vectors (Qwen3-8B at context 2048:
    // tree64 11.5 → 11.9 ms, its DDTree loop +7 %)
    let max_vectors = match (max_vectors, d) {
        (0, 64) => usize::MAX,
        (0, _) => 64,
        (m, _) => m,
    };
    (mma && !general
        && (n == 1 || !logical)
        && n * rep <= max_vectors.max(rep)
        && matches!(d, 64 | 128))
    .then(|| format!("group_attn_mma_bf16_d{d}"))
}

pub(crate) fn tree_attention(
    q: &Tensor,
    kbuf: &Tensor,
    vbuf: &Tensor,
    meta: &Tensor,
    ancestors: &Tensor,
    how: crate::step::StepAttention,
) -> Result<Tensor> {
    let crate::step::StepAttention {
        scale,
        kernel: choice,
        window,
        chunk: fixed_chunk,
        causal_block,
    } = how;
    let general = choice == crate::step::StepKernel::General;
    let (_, h, n, d) = q.dims4()?;
    let (_, kv, cap, db) = kbuf.dims4()?;
    // 256-wide heads (the hybrids' gated attention) run on the few-vector kernel alone
    let wide = d == crate::step::WIDE_STEP_HEAD_DIM && q.dtype() == DType::BF16;
    if d != db
        || !h.is_multiple_of(kv)
        || !d.is_multiple_of(32)
        || (d > crate::step::MAX_STEP_HEAD_DIM && !wide)
        || n > crate::step::MAX_STEP_ROWS
        || vbuf.dims() != kbuf.dims()
        || kbuf.dtype() != q.dtype()
        || ancestors.dim(0)? != n
        || ![crate::step::MAX_STEP_ROWS / 32, crate::step::ANCESTOR_WORDS]
            .contains(&ancestors.dim(1)?)
    {
        return Err(CoreError::InvalidInput(format!(
            "tree_attention: q {:?} over cache {:?}",
            q.dims(),
            kbuf.dims()
        )));
    }
    let dtype = q.dtype();
    let (qp, dev) = address(q, "tree_attention q")?;
    let (kbp, _) = address(kbuf, "tree_attention cache")?;
    let (vbp, _) = address(vbuf, "tree_attention cache")?;
    if kbp % 16 != 0 || vbp % 16 != 0 || qp % 4 != 0 {
        // the kernels move the cache in 16-byte units (and the tensor-core one q in 4-byte)
        return Err(CoreError::InvalidInput(
            "tree_attention: cache buffers not 16-byte aligned or q not 4-byte aligned".into(),
        ));
    }
    let (mp, _) = address(meta, "tree_attention meta")?;
    let (ap, _) = address(ancestors, "tree_attention ancestors")?;
    let stride = ancestors.dim(1)? as i32;
    let mma = crate::step::tensor_core_attention(dtype, d);
    let logical = (ancestors.dim(1)? == crate::step::ANCESTOR_WORDS
        && crate::step::keys_by_position(mma)) as i32;
    // a causal block with keys by position on the tensor cores (`--bit-exact`): its keys by step
    // row are its keys by position (each row's path is the step rows before it), so it is read by
    // step row — the few-vector kernel, never the row kernel — on the AR step's splits
    // ([`chunk_for`]), which the few-vector kernel shares bit for bit with the general kernel
    // (`causal_block_attention`)
    let block_by_row = causal_block
        && mma
        && logical != 0
        && window == 0
        && choice == crate::step::StepKernel::Auto;
    let logical = if block_by_row { 0 } else { logical };
    if window > 0 && (logical != 0 || window < n) {
        // a window is the drafter's block's: rows at consecutive positions, keys by cache row,
        // every step row inside every row's window
        return Err(CoreError::InvalidInput(format!(
            "tree_attention: a {window}-key window needs keys by cache row and at most {window} rows ({n})"
        )));
    }
    let wi = i32::try_from(window).map_err(|_| {
        CoreError::InvalidInput(format!("tree_attention: window {window} out of range"))
    })?;
    let (per_block, warps) = if mma {
        (MMA_VECTORS_PER_BLOCK, MMA_WARPS)
    } else {
        (VECTORS_PER_BLOCK, WARPS)
    };
    let group = if wide {
        if general || !mma || (logical != 0 && n > 1) {
            return Err(CoreError::InvalidInput(
                "tree_attention: 256-wide heads take the tensor-core kernel with keys by step row"
                    .into(),
            ));
        }
        Some(format!("group_attn_mma_bf16_d{d}"))
    } else {
        group_kernel(mma, logical != 0, n, h / kv, d).filter(|_| !general)
    };
    // the row kernel (tree_attn_rows.cu) for bf16 steps of 2+ rows of 128-wide heads (64-wide
    // heads: DDTree trees with keys by step row, `tree_attn_rows_cuda::width_ok`): every split
    // with keys by step row; with keys by position (`--bit-exact`) the splits of cached keys alone,
    // the general kernel taking those holding step keys (which bent rows read one by one) — the
    // general kernel's bits everywhere
    // (a one-row step only with keys by step row: its entry merges the splits itself, and the
    // cached-splits-only launch of keys by position would leave its merge to no one)
    let rows_ok = mma
        && !block_by_row
        && (n > 1 || logical == 0)
        && crate::tree_attn_rows_cuda::width_ok(
            d,
            n,
            logical != 0,
            choice == crate::step::StepKernel::Rows,
        )
        && !general
        && !wide
        && match choice {
            crate::step::StepKernel::Rows => true,
            _ => crate::tree_attn_rows_cuda::takes(group.is_some(), n == 1),
        };
    if choice == crate::step::StepKernel::Rows && !rows_ok {
        return Err(CoreError::InvalidInput(format!(
            "tree_attention: the row kernel takes bf16 steps of 128- or 64-wide heads, one-row steps with keys by step row (rows {n}, width {d}, {dtype:?})"
        )));
    }
    let rows = rows_ok && logical == 0;
    // (measured on an H100, session 28, Qwen3-8B at 2048 under --bit-exact: the 65-node tree's
    // verify 16.71 → 16.42 ms this way, but the 16-row chain's 7.99 → 8.35 and the 17-node tree's
    // 13.37 → 13.81 — the second launch costs more than the row kernel saves on few vectors)
    let rows_cached = rows_ok
        && logical != 0
        && (n > BIT_EXACT_ROWS_FROM || choice == crate::step::StepKernel::Rows);
    let group = group.filter(|_| !rows);
    let per_block = if group.is_some() { 16 } else { per_block };
    let groups = (n * h / kv).div_ceil(per_block);
    let chunk = if fixed_chunk > 0 {
        fixed_chunk
    } else if let Some(c) = one_row_chunk(n, mma && d == 128, (kv * groups, cap), &dev) {
        c // (on the row kernel or not: the same splits, so the same bits either way)
    } else if mma && logical == 0 && !block_by_row && (n > TREE_CHUNK_FROM_ROWS || rows) {
        tree_chunk(kv * groups, cap, rows, &dev)
    } else {
        chunk_for(n)
    };
    let splits = cap.div_ceil(chunk);
    // SAFETY: every (vector, split) record is written by exactly one block.
    let part = unsafe { Tensor::empty((h * n, splits, d + 2), DType::F32, q.device())? };
    let (pp, _) = address(&part, "tree_attention partials")?;
    let (ni, hi, kvi, capi, di, chi, gi) = (
        n as i32,
        h as i32,
        kv as i32,
        cap as i32,
        d as i32,
        chunk as i32,
        groups as i32,
    );
    let cfg = LaunchConfig {
        grid_dim: ((kv * groups) as u32, splits as u32, 1),
        block_dim: ((warps * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let sfx = suffix(dtype)?;
    let kernel = if mma {
        "tree_attn_mma_bf16".to_string()
    } else {
        format!("tree_attn_partial_{}{sfx}", staging_for(n))
    };
    // SAFETY: every output element is written, by the fused merge or by the combine kernel.
    let out = unsafe { Tensor::empty((1, n, h * d), dtype, q.device())? };
    let (op, _) = address(&out, "tree_attention output")?;
    // the fused merge runs one block per (kv head, vector group) over every split: a win for the
    // one-row AR step, a loss for wider steps on the general kernel (a 16-row verify at Qwen3-8B
    // shape took 9.6 ms against 7.8 with the combine kernel, docs/benchmarks.md session 12), and
    // on the few-vector kernel too (SmolLM2's 16-row verify 1.29 → 1.45 ms, session 24)
    let counters = if n == 1 {
        merge_counters(&dev, kv * groups)?
    } else {
        None
    };
    let cp = counters.unwrap_or(0);
    if rows || rows_cached {
        let args = crate::tree_attn_rows_cuda::RowKernelArgs {
            pointers: [qp, kbp, vbp, mp, ap, pp],
            ints: [stride, ni, hi, kvi, capi, chi, gi, wi, logical],
            scale,
        };
        // a one-row step merges its splits in the kernel (the counters are there for n = 1)
        let merge = counters.filter(|_| n == 1).map(|c| (c, op));
        crate::tree_attn_rows_cuda::launch(&dev, cfg, d, &args, merge)?;
    }
    if let Some(group) = &group {
        launch!(
            dev, group, cfg, &qp, &kbp, &vbp, &mp, &ap, &stride, &ni, &hi, &kvi, &capi, &chi, &gi,
            &scale, &pp, &cp, &op, &wi
        );
    } else if !rows {
        // with the row kernel before it (keys by position), the splits holding step keys alone
        // (`logical` bit 1)
        let logical = if rows_cached { logical | 2 } else { logical };
        launch!(
            dev, &kernel, cfg, &qp, &kbp, &vbp, &mp, &ap, &stride, &logical, &ni, &hi, &kvi, &capi,
            &di, &chi, &gi, &scale, &pp, &cp, &op, &wi
        );
    }
    if counters.is_none() {
        let si = splits as i32;
        let cfg = LaunchConfig {
            grid_dim: ((h * n).div_ceil(4) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            dev,
            &if wide {
                format!("tree_attn_combine_d256_{sfx}")
            } else {
                format!("tree_attn_combine_{sfx}")
            },
            cfg,
            &pp,
            &ni,
            &hi,
            &di,
            &si,
            &op
        );
    }
    Ok(out)
}
