//! Parsing of `--device` and `--dtype` flag values. Invariant: a value that cannot be honoured in this
//! build (e.g. `cuda` without the `cuda` feature) is an `InvalidInput` error, never a panic.
//!
//! A CUDA device runs everything on one stream, so cudarc's per-buffer event tracking (two CUDA
//! events created and destroyed with every allocation, needed only across streams) is switched
//! off when the device opens; `DFLASH_CUDA_EVENT_TRACKING=1` keeps it on (to measure the cost).
//! The device's default memory pool (which serves candle's `cuMemAllocAsync`) keeps freed memory
//! instead of returning it to the driver at every synchronisation (CUDA's default release
//! threshold is 0, so each host read-back — every decoding step, every loss chunk — would hand the
//! working set back and map it anew); `DFLASH_CUDA_POOL_RELEASE=1` keeps CUDA's default.

use crate::{CoreError, Result};
use candle_core::{DType, Device};

/// `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<Device> {
    let s = s.trim().to_ascii_lowercase();
    if s == "cpu" {
        return Ok(Device::Cpu);
    }
    let ordinal = if s == "cuda" {
        0
    } else if let Some(n) = s.strip_prefix("cuda:") {
        n.parse::<usize>().map_err(|_| {
            CoreError::InvalidInput(format!("bad device '{s}': expected cpu, cuda or cuda:N"))
        })?
    } else {
        return Err(CoreError::InvalidInput(format!(
            "bad device '{s}': expected cpu, cuda or cuda:N"
        )));
    };
    if !candle_core::utils::cuda_is_available() {
        return Err(CoreError::InvalidInput(format!(
            "device '{s}' asked for, but this dflash binary was built without the `cuda` feature"
        )));
    }
    let dev = Device::new_cuda(ordinal)
        .map_err(|e| CoreError::InvalidInput(format!("cannot open CUDA device {ordinal}: {e}")))?;
    #[cfg(feature = "cuda")]
    if std::env::var("DFLASH_CUDA_EVENT_TRACKING").as_deref() != Ok("1") {
        if let Device::Cuda(c) = &dev {
            // SAFETY: every dflash kernel and copy runs on the device's one stream, so no buffer
            // is ever shared across streams (the case event tracking exists for).
            unsafe { c.disable_event_tracking() };
        }
    }
    #[cfg(feature = "cuda")]
    if std::env::var("DFLASH_CUDA_POOL_RELEASE").as_deref() != Ok("1") {
        if let Device::Cuda(c) = &dev {
            // a speed setting, not a correctness one: say so and go on if the driver refuses it
            if let Err(e) = keep_pool_memory(c) {
                eprintln!("[dflash] warning: CUDA memory pool left at its default ({e})");
            }
        }
    }
    Ok(dev)
}

/// Sets the release threshold of the device's default memory pool to "never" (see the module doc).
#[cfg(feature = "cuda")]
fn keep_pool_memory(c: &candle_core::CudaDevice) -> std::result::Result<(), String> {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    let stream = c.cuda_stream();
    let ctx = stream.context();
    if !ctx.has_async_alloc() {
        return Ok(()); // plain cuMemAlloc: no pool to configure
    }
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: the device handle comes from a live context; the release-threshold attribute takes
    // a u64, which `threshold` is.
    unsafe {
        let pool =
            result::device::get_default_mem_pool(ctx.cu_device()).map_err(|e| e.to_string())?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// `f32`, `bf16` or `f16`.
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s.trim().to_ascii_lowercase().as_str() {
        "f32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "float16" => Ok(DType::F16),
        other => Err(CoreError::InvalidInput(format!(
            "bad dtype '{other}': expected f32, bf16 or f16"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_flags_and_rejects_bad_ones() {
        assert!(matches!(parse_device("cpu").unwrap(), Device::Cpu));
        assert!(parse_device("gpu").is_err());
        assert!(parse_device("cuda:x").is_err());
        assert_eq!(parse_dtype("bf16").unwrap(), DType::BF16);
        assert_eq!(parse_dtype("F32").unwrap(), DType::F32);
        assert!(parse_dtype("int8").is_err());
    }
}
