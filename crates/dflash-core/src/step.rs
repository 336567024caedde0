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
//!   its own keys only, not on how many rows the step has.
//! - CUDA only (f32, bf16; head_dim a multiple of 32 up to 128); [`device_step_supported`] says
//!   when, and callers take the host path otherwise.

use crate::{CoreError, Result};
use candle_core::{DType, Tensor};

/// The most rows one device step takes (a DDTree of budget 256 has 257 nodes with its root;
/// a multiple of 32, the ancestor bitmask's word size, and `MAX_ROWS` of `step_kernels.cu`).
pub const MAX_STEP_ROWS: usize = 288;
/// The largest head dimension the step's attention kernel stages in shared memory.
pub const MAX_STEP_HEAD_DIM: usize = 128;

/// The most rows [`skinny_matmul`] takes.
pub const SKINNY_MAX_ROWS: usize = 16;

/// Up to how many rows a projection goes through [`skinny_matmul`] rather than cuBLAS:
/// `DFLASH_SKINNY_ROWS=N` (read once; default 0, off). The kernel's numerics do not depend on the
/// row count (the property bit-exact bf16 verification needs), but on the H200 it is still slower
/// than cuBLAS (Qwen3-8B AR step 8.7 ms against 5.9; SmolLM2 f32 16-row verify 3.7 against 2.4,
/// docs/benchmarks.md session 11), so it is opt-in.
pub fn skinny_rows(dtype: DType) -> usize {
    static OVERRIDE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let _ = dtype;
    *OVERRIDE.get_or_init(|| {
        std::env::var("DFLASH_SKINNY_ROWS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0)
            .min(SKINNY_MAX_ROWS)
    })
}

/// Rows per cuBLAS call in a CUDA forward's projections: `DFLASH_ROW_CHUNK=N` (read once;
/// default 0, one call for all rows). An experiment for bit-exact bf16 verification: cuBLAS
/// picks kernels by row count, and a 64-row tree verify may round differently from the one-row
/// AR step where chunks of 16 do not (measured in docs/benchmarks.md session 11). Costs one weight
/// read per chunk.
pub fn row_chunk() -> usize {
    static CHUNK: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CHUNK.get_or_init(|| {
        std::env::var("DFLASH_ROW_CHUNK")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    })
}

/// `x · wᵀ` (`x` `[.., K]` with at most [`skinny_rows`] rows, `w` `[N, K]`, one dtype) with
/// f32 accumulation, one warp per output column: a row's result is the same whatever the row
/// count. Output in `x`'s dtype, or f32 when `f32_out`. `None` where cuBLAS must run (the CPU,
/// too many rows, K not a multiple of 8, a misaligned or strided weight).
pub fn skinny_matmul(x: &Tensor, w: &Tensor, f32_out: bool) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && crate::decode_ops::fused_decode(x.device()) {
        let k = x.dim(candle_core::D::Minus1)?;
        let lead = &x.dims()[..x.rank() - 1];
        let rows: usize = lead.iter().product();
        if rows == 0 || rows > skinny_rows(x.dtype()) {
            return Ok(None);
        }
        let Some(y) = crate::step_cuda::skinny_matmul(&x.reshape((rows, k))?, w, f32_out)? else {
            return Ok(None);
        };
        let mut shape = lead.to_vec();
        shape.push(w.dim(0)?);
        return Ok(Some(y.reshape(shape)?));
    }
    let _ = (x, w, f32_out);
    Ok(None)
}

/// Whether the device step can run a model with these heads in `dtype` on `device`.
pub fn device_step_supported(device: &candle_core::Device, dtype: DType, head_dim: usize) -> bool {
    device.is_cuda()
        && matches!(dtype, DType::F32 | DType::BF16)
        && head_dim.is_multiple_of(32)
        && head_dim <= MAX_STEP_HEAD_DIM
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
    let _ = (kbuf, vbuf, k, v, meta);
    Err(CoreError::InvalidInput(
        "device step: kv_append_at needs a CUDA device".into(),
    ))
}

/// Each step row's ancestors-or-self as bits (`[rows, MAX_STEP_ROWS / 32]` u32), computed once
/// per step from the parents in `meta` and shared by every layer's [`tree_attention`].
pub fn tree_ancestors(meta: &Tensor, rows: usize) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if meta.device().is_cuda() {
        return crate::step_cuda::tree_ancestors(meta, rows);
    }
    let _ = (meta, rows);
    Err(CoreError::InvalidInput(
        "device step: tree_ancestors needs a CUDA device".into(),
    ))
}

/// Attention of `q` (`[1, heads, n, d]`, contiguous) over the cache buffers (`[1, kv_heads,
/// capacity, d]`) under the step's tree (see the module invariants; `ancestors` from
/// [`tree_ancestors`]). Returns `[1, n, heads·d]` in `q`'s dtype, the o_proj input layout.
pub fn tree_attention(
    q: &Tensor,
    kbuf: &Tensor,
    vbuf: &Tensor,
    meta: &Tensor,
    ancestors: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return crate::step_cuda::tree_attention(q, kbuf, vbuf, meta, ancestors, scale);
    }
    let _ = (q, kbuf, vbuf, meta, ancestors, scale);
    Err(CoreError::InvalidInput(
        "device step: tree_attention needs a CUDA device".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

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
