//! Parsing of `--device` and `--dtype` flag values. Invariant: a value that cannot be honoured in this
//! build (e.g. `cuda` without the `cuda` feature) is an `InvalidInput` error, never a panic.

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
    Device::new_cuda(ordinal)
        .map_err(|e| CoreError::InvalidInput(format!("cannot open CUDA device {ordinal}: {e}")))
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
