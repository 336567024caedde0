//! Weights asked into L2 ahead of the GEMM that reads them, while the kernels before it leave
//! the GPU's memory idle (CUDA; a no-op elsewhere).
//!
//! A batch-1 decode step alternates weight-streaming GEMMs, bound by memory bandwidth, with small
//! kernels that read almost nothing (norms, the q/k/v heads, attention over a short cache, the
//! MLP's activation): at Qwen3-8B's shape ~1.1 ms of a 6.7 ms AR step on an H100 (session 26's
//! profile), with the memory idle. [`start`] asks L2 for the first bytes of every row of the next
//! GEMM's weight from a kernel on a side stream, so those bytes arrive during the small kernels and
//! the GEMM finds them in L2.
//!
//! Invariants:
//! - Hints only: the prefetch kernel writes nothing, so every value any kernel computes is the
//!   same with or without it (the bits tests hold under it).
//! - The prefetch runs on one side stream per process, forked from candle's stream by an event
//!   after the work already queued there and joined back by [`Prefetch::finish`] (or on drop)
//!   before the GEMM that reads the weight: in a captured step the prefetch is a branch of the
//!   graph beside the kernels between the fork and the join, and the capture stays joined.
//! - The side stream is made on the first eager call (never inside a capture: a prefetch asked for
//!   while a capture runs and before any eager one is skipped), on the first device that asks;
//!   other devices are skipped.
//! - Opt-in, measured slower: `DFLASH_L2_PREFETCH=MB` (read once; a documented override for A/B
//!   runs) asks for at most MB MiB of each weight — the first `MB MiB / rows` bytes of every row,
//!   or all of a smaller weight; unset or `0`: off. On an H100 (session 27, 32 MiB) every row lost:
//!   Qwen3-8B's AR step 6.50 → 6.80 ms at context 2048, SmolLM2's 0.90 → 1.08 (the fork, the join
//!   and the kernel around every GEMM cost more than the early bytes save). Off under PDL
//!   (`DFLASH_PDL`), whose graph rebuild takes single-stream chains only.

use crate::Result;
use candle_core::Tensor;
use std::sync::OnceLock;

/// The most bytes asked for per weight (`DFLASH_L2_PREFETCH`, MiB), 0 when off.
pub fn budget_bytes() -> usize {
    static BYTES: OnceLock<usize> = OnceLock::new();
    *BYTES.get_or_init(|| {
        std::env::var("DFLASH_L2_PREFETCH")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(0, |mb| mb << 20)
    })
}

/// How many bytes of each of `rows` rows of `row_bytes` to ask for under `budget`: whole rows
/// when the weight fits, else the largest multiple of 16 below `budget / rows` (0: nothing).
pub fn bytes_per_row(rows: usize, row_bytes: usize, budget: usize) -> usize {
    if rows == 0 || row_bytes == 0 {
        return 0;
    }
    if rows.saturating_mul(row_bytes) <= budget {
        return row_bytes - row_bytes % 16;
    }
    (budget / rows).min(row_bytes) / 16 * 16
}

/// A prefetch in flight: [`Prefetch::finish`] joins it to candle's stream (dropping it does too,
/// ignoring errors) — call it before the GEMM that reads the weight.
#[must_use = "a prefetch must be joined before its GEMM (finish)"]
pub struct Prefetch {
    #[cfg(feature = "cuda")]
    pending: Option<candle_core::cuda_backend::CudaDevice>,
}

impl Prefetch {
    fn none() -> Self {
        Self {
            #[cfg(feature = "cuda")]
            pending: None,
        }
    }

    /// Makes candle's stream wait for the prefetch kernel (not for the bytes it asked for).
    pub fn finish(mut self) -> Result<()> {
        self.join()
    }

    fn join(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(dev) = self.pending.take() {
            return cuda::join(&dev);
        }
        Ok(())
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        let _ = self.join();
    }
}

/// Asks L2 for the first bytes of every row of `w` (`[rows, K]`, contiguous, on CUDA), within
/// [`budget_bytes`]; a no-op when off, on the CPU, for other shapes or while a capture runs before
/// any eager prefetch made the side stream.
pub fn start(w: &Tensor) -> Result<Prefetch> {
    let budget = budget_bytes();
    if budget == 0 || !w.device().is_cuda() || w.rank() != 2 || !w.is_contiguous() {
        return Ok(Prefetch::none());
    }
    #[cfg(feature = "cuda")]
    {
        let (rows, k) = w.dims2()?;
        let row_bytes = k * w.dtype().size_in_bytes();
        let per_row = bytes_per_row(rows, row_bytes, budget);
        if per_row == 0 || !row_bytes.is_multiple_of(16) || crate::pdl::enabled() {
            return Ok(Prefetch::none());
        }
        return Ok(Prefetch {
            pending: cuda::launch(w, rows, row_bytes, per_row)?,
        });
    }
    #[allow(unreachable_code)]
    Ok(Prefetch::none())
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::step_cuda::address;
    use crate::{CoreError, Result};
    use candle_core::cuda_backend::cudarc::driver::{
        sys, CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
    use candle_core::cuda_backend::{CudaDevice, WrapErr};
    use candle_core::Tensor;
    use std::sync::{Arc, Mutex};

    const SOURCE: &str = include_str!("l2_prefetch.cu");

    /// The side stream, its two events and the kernel, for the first device that asked.
    struct Side {
        context: sys::CUcontext,
        stream: Arc<CudaStream>,
        fork: CudaEvent,
        join: CudaEvent,
        kernel: CudaFunction,
    }
    // SAFETY: the context handle is only compared, never used; the rest is Send.
    unsafe impl Send for Side {}

    static SIDE: Mutex<Option<Side>> = Mutex::new(None);

    fn lock() -> Result<std::sync::MutexGuard<'static, Option<Side>>> {
        SIDE.lock()
            .map_err(|_| CoreError::InvalidInput("l2 prefetch: poisoned".into()))
    }

    fn make(dev: &CudaDevice) -> Result<Side> {
        let ctx = dev.cuda_stream().context().clone();
        let major = ctx.compute_capability().w()?.0;
        let opts = CompileOptions {
            arch: Some(if major >= 9 {
                "compute_90"
            } else {
                "compute_80"
            }),
            ..Default::default()
        };
        let ptx = compile_ptx_with_opts(SOURCE, opts)
            .map_err(|e| CoreError::InvalidInput(format!("l2_prefetch.cu: {e:?}")))?;
        let module = ctx.load_module(ptx).w()?;
        Ok(Side {
            context: ctx.cu_ctx(),
            stream: ctx.new_stream().w()?,
            fork: ctx.new_event(None).w()?,
            join: ctx.new_event(None).w()?,
            kernel: module.load_function("l2_prefetch").w()?,
        })
    }

    /// Forks the side stream from candle's, launches the prefetch there, and records the join;
    /// `None` when skipped (see the module's invariants).
    pub(super) fn launch(
        w: &Tensor,
        rows: usize,
        row_bytes: usize,
        per_row: usize,
    ) -> Result<Option<CudaDevice>> {
        let (ptr, dev) = address(w, "l2 prefetch weight")?;
        if !ptr.is_multiple_of(16) {
            return Ok(None);
        }
        let main = dev.cuda_stream();
        let mut side = lock()?;
        if side.is_none() {
            let capturing = main.capture_status().w()?
                != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            if capturing {
                return Ok(None);
            }
            *side = Some(make(&dev)?);
        }
        let s = side.as_ref().expect("made above");
        if s.context != main.context().cu_ctx() {
            return Ok(None);
        }
        s.fork.record(&main).w()?;
        s.stream.wait(&s.fork).w()?;
        let chunk = if main.context().compute_capability().w()?.0 >= 9 {
            4096
        } else {
            32
        };
        let threads = rows * per_row.div_ceil(chunk);
        let cfg = LaunchConfig {
            grid_dim: (threads.div_ceil(256).clamp(1, 132) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (r, rb, pr) = (rows as u64, row_bytes as u64, per_row as u64);
        let mut b = s.stream.launch_builder(&s.kernel);
        b.arg(&ptr).arg(&r).arg(&rb).arg(&pr);
        // SAFETY: the kernel reads nothing and writes nothing; it asks L2 for lines of `w`'s
        // buffer (rows × row_bytes from its address), which outlives the step.
        unsafe { b.launch(cfg) }.w()?;
        s.join.record(&s.stream).w()?;
        Ok(Some(dev))
    }

    /// Candle's stream waits for the side stream's last prefetch.
    pub(super) fn join(dev: &CudaDevice) -> Result<()> {
        let side = lock()?;
        if let Some(s) = side.as_ref() {
            dev.cuda_stream().wait(&s.join).w()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_weight_that_fits_is_asked_for_whole_rows_else_the_same_share_of_each_row() {
        // 1,024 rows of 8 KB: 8 MiB
        assert_eq!(bytes_per_row(1024, 8192, 16 << 20), 8192);
        assert_eq!(bytes_per_row(1024, 8192, 8 << 20), 8192);
        // half the budget: half of each row
        assert_eq!(bytes_per_row(1024, 8192, 4 << 20), 4096);
        // rounded down to 16 bytes
        assert_eq!(bytes_per_row(3, 8192, 1000), 320);
        // too small a budget, or nothing to read
        assert_eq!(bytes_per_row(1024, 8192, 1024), 0);
        assert_eq!(bytes_per_row(0, 8192, 1 << 20), 0);
        // off by default: no budget unless the override asks
        if std::env::var("DFLASH_L2_PREFETCH").is_err() {
            assert_eq!(budget_bytes(), 0);
        }
    }

    #[test]
    fn a_cpu_weight_is_never_prefetched() -> Result<()> {
        let w = Tensor::zeros((4, 64), candle_core::DType::F32, &candle_core::Device::Cpu)?;
        start(&w)?.finish()
    }
}
