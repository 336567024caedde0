//! The device-side decoding step: a forward of up to [`MAX_STEP_ROWS`] rows (one AR token, a
//! DFlash block, a DDTree tree) whose every length, position and mask lives in device memory, so
//! that a CUDA graph captured once replays it at any cache length ([`crate::step_graph`]).
//!
//! Invariants:
//! - [`StepMeta`] is the only thing that crosses to the device per step: `[past, tokens[n],
//!   rope_rows[2n], parents[n]]` (u32; parents as i32 bits, −1 for a root, `parents[i] < i`).
//!   `rope_rows` index a cos-then-sin table `[2·P, rot/2]`: `positions`, then `P + positions`.
//! - [`kv_append_at`] writes the step's keys and values at rows `past..past+n` of the cache
//!   buffers and never touches other rows; the host's cache length is advanced by the caller.
//! - [`tree_attention`] gives query row `r` every committed key and the step rows that are `r`
//!   or its ancestors (a causal block is the chain), softmax in f32; a row's result depends on
//!   its own keys only, not on how many rows the step has; with keys by position
//!   ([`keys_by_position`]), keys are reduced in position order (the ancestor at depth t counts as
//!   key `past + t`), so a tree row's result is bit-identical to a one-row step at its position over
//!   the same keys. One kernel serves every step of a dtype in a process
//!   ([`tensor_core_attention`]: bf16 on tensor cores, f32 on CUDA cores).
//! - CUDA only (f32, bf16; head_dim a multiple of 32 up to 128); [`device_step_supported`] says
//!   when, and callers take the host path otherwise. [`kv_append_at`], [`tree_ancestors`] and
//!   [`step_mask`] also have host emulations (the hybrids' device step tested on the CPU).

use crate::{CoreError, Result};
use candle_core::{DType, Tensor};

/// The most rows one device step takes (a DDTree of budget 256 has 257 nodes with its root;
/// a multiple of 32, the ancestor bitmask's word size, and `MAX_ROWS` of `step_kernels.cu`).
pub const MAX_STEP_ROWS: usize = 288;
/// Words per row of [`tree_ancestors`]'s output: the ancestor bits (`MAX_STEP_ROWS / 32`), the
/// depth, then the path (`MAX_STEP_ROWS`: the row's ancestors-or-self by depth, root first).
pub const ANCESTOR_WORDS: usize = MAX_STEP_ROWS / 32 + 1 + MAX_STEP_ROWS;
/// The largest head dimension the step's attention kernel stages in shared memory.
pub const MAX_STEP_HEAD_DIM: usize = 128;
/// The one wider head the device step's bf16 attention takes ([`tree_attention`] with keys by
/// step row, on the few-vector tensor-core kernel alone): the Qwen3.5 / Qwen3.6 hybrids' gated
/// attention.
pub const WIDE_STEP_HEAD_DIM: usize = 256;

/// Whether [`tree_attention`] takes a tree's keys by position (bit-identical to the one-row step
/// at each row's position: a row whose path is not the step rows 0..depth reads its ancestors'
/// keys one by one) or by cache row (ancestor masks in place, the same softmax over the same keys
/// in another order). `DFLASH_TREE_KEYS=position|row` (read once) forces one. Otherwise by
/// position on the f32 CUDA-core kernel, and on the bf16 tensor-core kernel only when every
/// projection is row-invariant too (`DFLASH_STREAM_GEMM=all`, the CLI's `--bit-exact`): without
/// it a bf16 tree verify is not bit-identical to AR steps anyway (its GEMMs are not), and the
/// per-row reads cost up to a third of a small model's DDTree-64 verify (SmolLM2 bf16, H100,
/// session 20: 2.09 against 1.51 ms; Qwen3-8B at context 2048: 13.0 against 12.2 ms).
pub fn keys_by_position(tensor_cores: bool) -> bool {
    static FORCED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let forced = *FORCED.get_or_init(|| match std::env::var("DFLASH_TREE_KEYS").as_deref() {
        Ok("row") => Some(false),
        Ok("position") => Some(true),
        _ => None,
    });
    forced.unwrap_or_else(|| {
        !tensor_cores
            || crate::stream_gemm::stream_policy() == crate::stream_gemm::StreamPolicy::All
    })
}

/// Whether a bf16 step's attention runs on tensor cores (`tree_attn_mma_bf16` and its kin) or on
/// the f32 CUDA-core kernel. Every bf16 step of a process takes the same kernel, so verified rows
/// and AR steps stay bit-identical. f32 always takes the CUDA-core kernel (tensor cores would
/// round its operands). bf16 takes tensor cores at every head width, `--bit-exact` included.
/// Until session 30 `--bit-exact` put heads narrower than 128 on the CUDA-core kernel (its tree
/// rows read their ancestors' keys one by one, which cost more on the tensor cores at small
/// heads); measured on an H200 (session 30, SmolLM2's 64-wide heads at context 512, both under
/// `--bit-exact`): tensor cores take the AR step 1.182 → 0.857 ms (the default path's), the
/// 16-row verify 1.290 → 1.232 and the DFlash loop step 1.647 → 1.561, and cost the DDTree-64
/// verify 2.024 → 2.327 (its loop step 2.478 → 2.900) — the fastest bit-exact way to decode
/// (DFlash at τ 2.88) and AR itself both gain. `DFLASH_TREE_ATTN=scalar|mma` (a documented
/// override) forces one.
pub fn tensor_core_attention(dtype: DType, d: usize) -> bool {
    static FORCED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let forced = *FORCED.get_or_init(|| match std::env::var("DFLASH_TREE_ATTN").as_deref() {
        Ok("scalar") => Some(false),
        Ok("mma") => Some(true),
        _ => None,
    });
    dtype == DType::BF16 && d.is_multiple_of(16) && forced.unwrap_or(true)
}

/// Keys per split of a tree's attention on the tensor cores with keys by step row, over `columns`
/// blocks a split (kv heads × vector groups), buffers of `cap` keys and `multiprocessors` SMs: the
/// widest of 256 and 128 that still gives every multiprocessor two blocks, else 64 (the CUDA
/// launch's rule; see `step_cuda::tree_chunk` for what it was measured on).
pub fn wide_tree_chunk(columns: usize, cap: usize, multiprocessors: usize) -> usize {
    [256, 128]
        .into_iter()
        .find(|&c| columns * cap.div_ceil(c) >= 2 * multiprocessors)
        .unwrap_or(64)
}

/// Keys per split for the row kernel (`tree_attn_rows.cu`: three blocks an SM, tiles two ahead),
/// over `columns` blocks a split, buffers of `cap` keys and `multiprocessors` SMs: 256 where that
/// still gives every multiprocessor two blocks, else 128 where it gives each one, else 64.
/// Measured on an H100 (session 28, Qwen3-8B at context 2048): the 65-node tree 8.74 ms on 256-key
/// splits (360 blocks), 9.45 on 128, 8.93 on 448; the 16-row chain 7.54 on 128 (144 blocks), 7.82
/// on 64, 7.65 on 256; the 17-node tree 7.65 on 128 (288 blocks), 7.75 on 256.
pub fn row_kernel_chunk(columns: usize, cap: usize, multiprocessors: usize) -> usize {
    let blocks = |c: usize| columns * cap.div_ceil(c);
    if blocks(256) >= 2 * multiprocessors {
        256
    } else if blocks(128) >= multiprocessors {
        128
    } else {
        64
    }
}

/// Keys per split for the one-row step (an AR token) outside `--bit-exact`, over `columns` blocks a
/// split (kv heads × vector groups), buffers of `cap` keys and `multiprocessors` SMs: 128 where
/// that still gives every multiprocessor a block, else 64. Fewer, longer splits leave fewer
/// partial records to merge; below one block an SM they leave SMs idle. Measured on an H100
/// (session 29, Qwen3-8B at context 2048, 8 kv heads over 2,305 keys: 136 blocks on 128-key
/// splits): the AR step 6.548 → 6.472 ms on 128, 6.699 on 256.
pub fn one_row_chunk(columns: usize, cap: usize, multiprocessors: usize) -> usize {
    if columns * cap.div_ceil(128) >= multiprocessors {
        128
    } else {
        64
    }
}

/// Whether the device step can run a model with these heads in `dtype` on `device`.
pub fn device_step_supported(device: &candle_core::Device, dtype: DType, head_dim: usize) -> bool {
    device.is_cuda()
        && matches!(dtype, DType::F32 | DType::BF16)
        && head_dim.is_multiple_of(32)
        && head_dim <= MAX_STEP_HEAD_DIM
}

/// Whether the device step's attention ([`tree_attention`]) takes heads of `head_dim` in `dtype`
/// on `device`: those of [`device_step_supported`], and in bf16 [`WIDE_STEP_HEAD_DIM`]-wide heads
/// on the tensor cores (keys by step row). What the hybrids' gated attention and the drafters of
/// hybrid targets check before taking the step's attention.
pub fn step_attention_takes(device: &candle_core::Device, dtype: DType, head_dim: usize) -> bool {
    device_step_supported(device, dtype, head_dim)
        || (device.is_cuda()
            && dtype == DType::BF16
            && head_dim == WIDE_STEP_HEAD_DIM
            && tensor_core_attention(DType::BF16, head_dim))
}

/// The host side of one step's metadata (see the module invariants).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepMeta {
    pub words: Vec<u32>,
    pub rows: usize,
}

impl StepMeta {
    /// `parents`: `None` for a causal block (the chain). `table_rows` is `P`, the number of
    /// positions the rope table holds; every position must be below it.
    pub fn new(
        past: usize,
        tokens: &[u32],
        positions: &[u32],
        parents: Option<&[i64]>,
        table_rows: usize,
    ) -> Result<Self> {
        let n = tokens.len();
        if n == 0 || n > MAX_STEP_ROWS || positions.len() != n {
            return Err(CoreError::InvalidInput(format!(
                "device step: {n} tokens, {} positions (1..={MAX_STEP_ROWS} rows)",
                positions.len()
            )));
        }
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= table_rows) {
            return Err(CoreError::InvalidInput(format!(
                "device step: position {p} past the rope table ({table_rows} rows)"
            )));
        }
        let mut words = Vec::with_capacity(1 + 4 * n);
        words.push(u32::try_from(past).map_err(|_| {
            CoreError::InvalidInput(format!("device step: cache length {past} too large"))
        })?);
        words.extend_from_slice(tokens);
        words.extend_from_slice(positions);
        words.extend(positions.iter().map(|&p| p + table_rows as u32));
        match parents {
            None => words.extend((0..n as i64).map(|i| (i - 1) as i32 as u32)),
            Some(ps) => {
                if ps.len() != n {
                    return Err(CoreError::InvalidInput(format!(
                        "device step: {} parents for {n} rows",
                        ps.len()
                    )));
                }
                for (i, &p) in ps.iter().enumerate() {
                    if p >= i as i64 || p < -1 {
                        return Err(CoreError::InvalidInput(format!(
                            "device step: parent {p} of row {i}"
                        )));
                    }
                    words.push(p as i32 as u32);
                }
            }
        }
        Ok(Self { words, rows: n })
    }

    /// The table `rope_rows` index: cos for positions `0..positions`, then sin, `[2·positions,
    /// rot/2]` in `dtype`, made once per model (`positions` from [`StepMeta::table_positions`]).
    pub fn rope_table(
        rotary: &crate::RotaryEmbedding,
        positions: usize,
        device: &candle_core::Device,
        dtype: DType,
    ) -> Result<Tensor> {
        let all: Vec<u32> = (0..positions as u32).collect();
        let (cos, sin) = rotary.cos_sin(&all, device, dtype)?;
        Ok(Tensor::cat(&[&cos, &sin], 0)?)
    }

    /// How many positions a model's rope table covers: its `max_position_embeddings`, at most
    /// 2^18.
    pub fn table_positions(max_position_embeddings: usize) -> usize {
        max_position_embeddings.clamp(1, 1 << 18)
    }

    /// The step's token ids inside the device copy of the metadata.
    pub fn tokens(meta: &Tensor, rows: usize) -> Result<Tensor> {
        Ok(meta.narrow(0, 1, rows)?)
    }

    /// The rope-table rows (cos rows, then sin rows) inside the device copy.
    pub fn rope_rows(meta: &Tensor, rows: usize) -> Result<Tensor> {
        Ok(meta.narrow(0, 1 + rows, 2 * rows)?)
    }
}

/// Writes `k`, `v` (`[1, kv_heads, n, d]`, contiguous) into the cache buffers `kbuf`, `vbuf`
/// (`[1, kv_heads, capacity, d]`) at rows `past..past+n`, `past` read from `meta` on the device.
pub fn kv_append_at(
    kbuf: &Tensor,
    vbuf: &Tensor,
    k: &Tensor,
    v: &Tensor,
    meta: &Tensor,
) -> Result<()> {
    #[cfg(feature = "cuda")]
    if k.device().is_cuda() {
        return crate::step_cuda::kv_append_at(kbuf, vbuf, k, v, meta);
    }
    // the host's emulation (the hybrids' device step on the CPU, for tests)
    let past = meta.narrow(0, 0, 1)?.to_vec1::<u32>()?[0] as usize;
    kbuf.slice_set(&k.contiguous()?, 2, past)?;
    vbuf.slice_set(&v.contiguous()?, 2, past)?;
    Ok(())
}

/// A device step's q/k/v heads as one kernel (the math of [`crate::decode_ops::qkv_heads`]: q/k
/// RMSNorm when `norms` is given, then RoPE from `cos_sin` `[2·n, rot/2]`): returns q of rows
/// `q_from..n` (`[1, h, n − q_from, head_dim]`; `q_from` 0 but in the drafter's device step, whose
/// context rows share the block's GEMM and give keys alone) and writes k and v of every row
/// straight into the cache buffers `kbuf`, `vbuf` (`[1, kv, capacity, head_dim]`) at rows
/// `past..past+n`, `past` read from `meta`. `q_from < n`.
#[allow(clippy::too_many_arguments)]
pub fn qkv_heads_into_cache(
    y: &Tensor,
    cos_sin: &Tensor,
    norms: Option<&Tensor>,
    heads: (usize, usize, usize),
    rot: usize,
    eps: f64,
    kbuf: &Tensor,
    vbuf: &Tensor,
    meta: &Tensor,
    q_from: usize,
) -> Result<Tensor> {
    let cache = (kbuf, vbuf);
    heads_into_cache(
        y, cos_sin, norms, heads, rot, eps, cache, meta, false, q_from,
    )
}

/// [`qkv_heads_into_cache`] for the hybrids' gated attention: rows of `y` are
/// `[heads × (q | gate) | kv × k | kv × v]` (each q head followed by its `head_dim` gate
/// channels, which stay in `y`), and `norms` (q's then k's, `[2·head_dim]`) are f32 — the
/// zero-centred norms' `1 + w`. The same per-element math (norm in f32 rounded once, then the
/// rotate-half RoPE of the first `rot` channels rounded once). CUDA only.
#[allow(clippy::too_many_arguments)]
pub fn gated_qkv_heads_into_cache(
    y: &Tensor,
    cos_sin: &Tensor,
    norms: &Tensor,
    heads: (usize, usize, usize),
    rot: usize,
    eps: f64,
    kbuf: &Tensor,
    vbuf: &Tensor,
    meta: &Tensor,
) -> Result<Tensor> {
    let cache = (kbuf, vbuf);
    heads_into_cache(
        y,
        cos_sin,
        Some(norms),
        heads,
        rot,
        eps,
        cache,
        meta,
        true,
        0,
    )
}

/// [`qkv_heads_into_cache`] (`gated` false) or [`gated_qkv_heads_into_cache`].
#[allow(clippy::too_many_arguments)]
fn heads_into_cache(
    y: &Tensor,
    cos_sin: &Tensor,
    norms: Option<&Tensor>,
    heads: (usize, usize, usize),
    rot: usize,
    eps: f64,
    (kbuf, vbuf): (&Tensor, &Tensor),
    meta: &Tensor,
    gated: bool,
    q_from: usize,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if y.device().is_cuda() {
        return crate::step_cuda::qkv_heads_into_cache(
            y, cos_sin, norms, heads, rot, eps as f32, kbuf, vbuf, meta, gated, q_from,
        );
    }
    let _ = (
        y, cos_sin, norms, heads, rot, eps, kbuf, vbuf, meta, gated, q_from,
    );
    Err(CoreError::InvalidInput(
        "device step: the fused q/k/v heads need a CUDA device".into(),
    ))
}

/// `x + d` (returned) and its RMSNorm times `w` written into `dst` (contiguous, `[.., W]`) at
/// rows `row..row + rows(x)` — [`crate::decode_ops::add_rms_norm`]'s kernel and arithmetic with the
/// normed rows in the caller's buffer (the drafter's device step: its block rows' next input,
/// right after the context rows its q/k/v GEMM reads with them). CUDA only.
pub fn add_rms_norm_into(
    x: &Tensor,
    d: &Tensor,
    w: &Tensor,
    eps: f64,
    dst: &Tensor,
    row: usize,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return crate::step_cuda::add_rms_norm_into(x, d, w, eps as f32, dst, row);
    }
    let _ = (x, d, w, eps, dst, row);
    Err(CoreError::InvalidInput(
        "device step: the add+norm into a buffer needs a CUDA device".into(),
    ))
}

/// Each step row's ancestors-or-self (`[rows, ANCESTOR_WORDS]` u32: bits, depth, path), computed once
/// per step from the parents in `meta` and shared by every layer's [`tree_attention`].
pub fn tree_ancestors(meta: &Tensor, rows: usize) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if meta.device().is_cuda() {
        return crate::step_cuda::tree_ancestors(meta, rows);
    }
    // the host's emulation of the kernel (the hybrids' device step on the CPU, for tests)
    let words = meta.to_vec1::<u32>()?;
    if rows == 0 || rows > MAX_STEP_ROWS || words.len() < 1 + 4 * rows {
        return Err(CoreError::InvalidInput(format!(
            "tree_ancestors: {rows} rows, metadata of {} words",
            words.len()
        )));
    }
    let parents = &words[1 + 3 * rows..1 + 4 * rows];
    let mut out = vec![0u32; rows * ANCESTOR_WORDS];
    for r in 0..rows {
        let row = &mut out[r * ANCESTOR_WORDS..(r + 1) * ANCESTOR_WORDS];
        let mut path = vec![];
        let mut x = r as i64;
        while x >= 0 && (x as usize) < rows && path.len() < rows {
            row[x as usize / 32] |= 1 << (x % 32);
            path.push(x as u32);
            x = parents[x as usize] as i32 as i64;
        }
        row[MAX_STEP_ROWS / 32] = path.len() as u32 - 1;
        for (i, &p) in path.iter().rev().enumerate() {
            row[MAX_STEP_ROWS / 32 + 1 + i] = p;
        }
    }
    Ok(Tensor::from_vec(
        out,
        (rows, ANCESTOR_WORDS),
        meta.device(),
    )?)
}

/// The additive f32 mask `[rows, cap]` over a whole cache buffer of `cap` rows for the step in
/// `meta`: row r sees every committed key (`< past`) and the step rows that are r or its
/// ancestors ([`tree_ancestors`]'s bits), nothing else (−inf) — for attention through GEMMs over
/// the whole buffer, so that its shapes do not depend on the cache length (the hybrids' gated
/// attention, whose heads are wider than [`MAX_STEP_HEAD_DIM`]). CUDA only.
pub fn step_mask(meta: &Tensor, ancestors: &Tensor, rows: usize, cap: usize) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if meta.device().is_cuda() {
        return crate::step_cuda::step_mask(meta, ancestors, rows, cap);
    }
    // the host's emulation of the kernel (the hybrids' device step on the CPU, for tests)
    let past = meta.narrow(0, 0, 1)?.to_vec1::<u32>()?[0] as usize;
    let anc = ancestors.to_vec2::<u32>()?;
    let mask: Vec<f32> = (0..rows * cap)
        .map(|idx| {
            let (r, j) = (idx / cap, idx % cap);
            let seen = j < past
                || (j < past + rows && (anc[r][(j - past) / 32] >> ((j - past) % 32)) & 1 == 1);
            if seen {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    Ok(Tensor::from_vec(mask, (rows, cap), meta.device())?)
}

/// Attention of `q` (`[1, heads, n, d]`, contiguous) over the cache buffers (`[1, kv_heads,
/// capacity, d]`) under the step's tree (see the module invariants). `ancestors` is either
/// [`tree_ancestors`]'s output (`[n, ANCESTOR_WORDS]`: a tree, its keys taken by position — a
/// row's ancestor at depth t is key `past + t` — so every row computes exactly what a one-row
/// step at its position computes over the same keys), or bits alone (`[n, MAX_STEP_ROWS / 32]`,
/// any visibility, keys by cache row: the drafter's block). Returns `[1, n, heads·d]` in `q`'s
/// dtype, the o_proj input layout.
pub fn tree_attention(
    q: &Tensor,
    kbuf: &Tensor,
    vbuf: &Tensor,
    meta: &Tensor,
    ancestors: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    attention_on(q, kbuf, vbuf, meta, ancestors, StepAttention::plain(scale))
}

/// [`tree_attention`] for a causal block (a DFlash verify, a prefill chunk: row r at position
/// `past + r`, seeing the rows before it), whose path to each row is the step rows `0..=r`: its
/// keys by step row are its keys by position. Where keys are taken by position on the tensor cores
/// (`--bit-exact`), the block is read by step row on the AR step's splits — the few-vector
/// kernel's, which equals the general kernel's bits by position there, so each row stays the AR
/// step's bit for bit, without the general kernel (SmolLM2's 16-row verify under `--bit-exact`
/// took 1.25 ms against 1.10 by default, H100, session 33). Elsewhere the same as
/// [`tree_attention`].
pub fn causal_block_attention(
    q: &Tensor,
    kbuf: &Tensor,
    vbuf: &Tensor,
    meta: &Tensor,
    ancestors: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    let how = StepAttention {
        causal_block: true,
        ..StepAttention::plain(scale)
    };
    attention_on(q, kbuf, vbuf, meta, ancestors, how)
}

/// [`tree_attention`] for a drafter's sliding-window layer: the block's `n` rows sit at consecutive
/// positions `past ..` (`meta` word 0) and step row r sees cached key j < past only when
/// `past + r − j < window` (the block's own keys, `bits` as for [`tree_attention`], are all inside
/// a window of at least `n`). Splits skip the tiles no row sees. `window` 0 is no window.
pub fn tree_attention_in_window(
    q: &Tensor,
    kbuf: &Tensor,
    vbuf: &Tensor,
    meta: &Tensor,
    bits: &Tensor,
    scale: f32,
    window: usize,
) -> Result<Tensor> {
    let how = StepAttention {
        window,
        ..StepAttention::plain(scale)
    };
    attention_on(q, kbuf, vbuf, meta, bits, how)
}

/// [`tree_attention`] on the general kernel whatever the step's width (for tests: the kernel for
/// steps of few query vectors must give its bits).
#[doc(hidden)]
pub fn tree_attention_general(
    q: &Tensor,
    kbuf: &Tensor,
    vbuf: &Tensor,
    meta: &Tensor,
    ancestors: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    tree_attention_on_kernel(
        q,
        kbuf,
        vbuf,
        meta,
        ancestors,
        scale,
        StepKernel::General,
        0,
    )
}

/// [`tree_attention`] on a named kernel and, with `chunk` > 0 (a multiple of 64), on splits of
/// `chunk` keys instead of the rule's (for tests: every kernel must give the general one's bits
/// at the same splits). [`StepKernel::Rows`] takes bf16 steps of 2+ rows of 128-wide heads: every
/// split with keys by step row (`bits`, as for [`tree_attention`]); with keys by position the
/// splits of cached keys alone, the general kernel the rest.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn tree_attention_on_kernel(
    q: &Tensor,
    kbuf: &Tensor,
    vbuf: &Tensor,
    meta: &Tensor,
    ancestors: &Tensor,
    scale: f32,
    kernel: StepKernel,
    chunk: usize,
) -> Result<Tensor> {
    if !chunk.is_multiple_of(64) {
        return Err(CoreError::InvalidInput(format!(
            "tree_attention: a {chunk}-key split is not a multiple of 64"
        )));
    }
    let how = StepAttention {
        kernel,
        chunk,
        ..StepAttention::plain(scale)
    };
    attention_on(q, kbuf, vbuf, meta, ancestors, how)
}

/// Which CUDA kernel a step's attention takes: the rule's ([`StepKernel::Auto`]), the general one
/// whatever the width, or the row kernel for wide steps with keys by step row (tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKernel {
    Auto,
    General,
    Rows,
}

/// How a step's attention runs: its scale, the kernel (tests), a sliding window (0: none; see
/// [`tree_attention_in_window`]) and a fixed split (0: the rule's; tests).
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the CUDA kernels' launcher alone
pub(crate) struct StepAttention {
    pub scale: f32,
    pub kernel: StepKernel,
    pub window: usize,
    pub chunk: usize,
    /// A causal block ([`causal_block_attention`]).
    pub causal_block: bool,
}

impl StepAttention {
    fn plain(scale: f32) -> Self {
        Self {
            scale,
            kernel: StepKernel::Auto,
            window: 0,
            chunk: 0,
            causal_block: false,
        }
    }
}

fn attention_on(
    q: &Tensor,
    kbuf: &Tensor,
    vbuf: &Tensor,
    meta: &Tensor,
    ancestors: &Tensor,
    how: StepAttention,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return crate::step_cuda::tree_attention(q, kbuf, vbuf, meta, ancestors, how);
    }
    let _ = (q, kbuf, vbuf, meta, ancestors, how);
    Err(CoreError::InvalidInput(
        "device step: tree_attention needs a CUDA device".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_kernel_chunks_follow_the_measured_splits() {
        // Qwen3-8B at context 2048 (2,305-key buffers): the 65-node tree (8 kv heads × 5 groups)
        // on 256, the 17-node one (8 × 2) and the 16-row chain (8 × 1) on 128
        assert_eq!(row_kernel_chunk(40, 2305, 132), 256);
        assert_eq!(row_kernel_chunk(16, 2305, 132), 128);
        assert_eq!(row_kernel_chunk(8, 2305, 132), 128);
        // at context 512 (769 keys): the tree on 128, the chain on 64
        assert_eq!(row_kernel_chunk(40, 769, 132), 128);
        assert_eq!(row_kernel_chunk(8, 769, 132), 64);
    }

    #[test]
    fn one_row_chunks_keep_a_block_a_multiprocessor() {
        // Qwen3-8B at context 2048 (8 kv heads, 2,305 keys): 136 blocks on 128-key splits
        assert_eq!(one_row_chunk(8, 2305, 132), 128);
        // at 512 (769 keys) 128 would leave 56 blocks; SmolLM2 (3 kv heads) at 2048 too
        assert_eq!(one_row_chunk(8, 769, 132), 64);
        assert_eq!(one_row_chunk(3, 2305, 132), 64);
    }

    #[test]
    fn wide_tree_chunks_keep_two_blocks_a_multiprocessor() {
        // Qwen3-8B's 65-node tree over 2,305 keys (8 kv heads × 5 groups): 256-key splits
        assert_eq!(wide_tree_chunk(40, 2305, 132), 256);
        // its 17-row tree (8 × 2 columns): 128 (256 would leave 160 blocks)
        assert_eq!(wide_tree_chunk(16, 2305, 132), 128);
        // SmolLM2's 65-node tree at 512 (3 × 13 columns, 769 keys): 128; its 17-row one: 64
        assert_eq!(wide_tree_chunk(39, 769, 132), 128);
        assert_eq!(wide_tree_chunk(12, 769, 132), 64);
    }

    #[test]
    fn meta_layout_and_validation() {
        let m = StepMeta::new(7, &[10, 11, 12], &[7, 8, 8], Some(&[-1, 0, 0]), 100).unwrap();
        assert_eq!(
            m.words,
            vec![7, 10, 11, 12, 7, 8, 8, 107, 108, 108, u32::MAX, 0, 0]
        );
        let chain = StepMeta::new(0, &[1, 2], &[0, 1], None, 4).unwrap();
        assert_eq!(&chain.words[7..], &[u32::MAX, 0]);
        assert!(StepMeta::new(0, &[1], &[4], None, 4).is_err());
        assert!(StepMeta::new(0, &[1, 2], &[0, 1], Some(&[-1, 1]), 4).is_err());
        assert!(StepMeta::new(0, &[], &[], None, 4).is_err());
    }
}
