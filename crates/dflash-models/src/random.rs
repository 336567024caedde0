//! Random weights at a model's real shapes, for benchmarks and tests that need the shapes and not
//! the values: a target (Llama / Qwen3 / Qwen3.5 hybrid, Hugging Face names) or a DFlash drafter
//! (z-lab names).
//!
//! Invariants:
//! - Tensors are made on the device they are used on, in the compute dtype: an accelerator draws
//!   them with its own generator (seeded by `seed`), so a model of many GB never passes through
//!   host memory; on the CPU they come from a seeded ChaCha8 stream. Matrices are N(0, 0.02²),
//!   every norm weight is 1.
//! - The names and shapes are exactly those [`crate::Decoder::new`],
//!   [`crate::HybridDecoder::new`] and [`crate::DFlashDrafter::new`] read, so the models are built through their ordinary
//!   constructors (a config that cannot work is refused there, as when loading).

use crate::config::{Architecture, DecoderConfig};
use crate::decoder::Decoder;
use crate::drafter::{parameter_shapes, DFlashConfig, DFlashDrafter};
use crate::hybrid::HybridDecoder;
use crate::target::TargetModel;
use crate::{ModelError, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// Standard deviation of the random matrices.
const STD: f32 = 0.02;

/// Every weight of a target with config `cfg`: (Hugging Face name, shape), in model order.
/// `lm_head.weight` is present only when the embeddings are not tied.
pub fn target_parameter_shapes(
    cfg: &DecoderConfig,
    arch: Architecture,
) -> Vec<(String, Vec<usize>)> {
    let (h, hd, i, v) = (
        cfg.hidden_size,
        cfg.head_dim(),
        cfg.intermediate_size,
        cfg.vocab_size,
    );
    let (nh, nkv) = (cfg.num_attention_heads, cfg.num_kv_heads());
    let mut p = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    if arch == Architecture::Qwen35 {
        hybrid_layer_shapes(cfg, &mut p);
    }
    for l in (0..cfg.num_hidden_layers).filter(|_| arch != Architecture::Qwen35) {
        let n = |s: &str| format!("model.layers.{l}.{s}.weight");
        p.extend([
            (n("input_layernorm"), vec![h]),
            (n("self_attn.q_proj"), vec![nh * hd, h]),
            (n("self_attn.k_proj"), vec![nkv * hd, h]),
            (n("self_attn.v_proj"), vec![nkv * hd, h]),
            (n("self_attn.o_proj"), vec![h, nh * hd]),
        ]);
        if arch == Architecture::Qwen3 {
            p.extend([
                (n("self_attn.q_norm"), vec![hd]),
                (n("self_attn.k_norm"), vec![hd]),
            ]);
        }
        p.extend([
            (n("post_attention_layernorm"), vec![h]),
            (n("mlp.gate_proj"), vec![i, h]),
            (n("mlp.up_proj"), vec![i, h]),
            (n("mlp.down_proj"), vec![h, i]),
        ]);
    }
    p.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        p.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    p
}

/// The decoder layers of a Qwen3.5 / Qwen3.6 hybrid (`model.layers.N.`, the causal-LM layout).
fn hybrid_layer_shapes(cfg: &DecoderConfig, p: &mut Vec<(String, Vec<usize>)>) {
    let (h, hd, i) = (cfg.hidden_size, cfg.head_dim(), cfg.intermediate_size);
    let (nh, nkv) = (cfg.num_attention_heads, cfg.num_kv_heads());
    let d = cfg.delta_net_shape();
    let (c, vdim) = (d.conv_channels(), d.value_heads * d.value_dim);
    let q_rows = nh * hd * if cfg.attn_output_gate() { 2 } else { 1 };
    for (l, rec) in cfg.recurrent_layers().into_iter().enumerate() {
        let n = |s: &str| format!("model.layers.{l}.{s}");
        p.push((n("input_layernorm.weight"), vec![h]));
        if rec {
            p.extend([
                (n("linear_attn.in_proj_qkv.weight"), vec![c, h]),
                (n("linear_attn.in_proj_z.weight"), vec![vdim, h]),
                (n("linear_attn.in_proj_b.weight"), vec![d.value_heads, h]),
                (n("linear_attn.in_proj_a.weight"), vec![d.value_heads, h]),
                (n("linear_attn.conv1d.weight"), vec![c, 1, d.conv_kernel]),
                (n("linear_attn.dt_bias"), vec![d.value_heads]),
                (n("linear_attn.A_log"), vec![d.value_heads]),
                (n("linear_attn.norm.weight"), vec![d.value_dim]),
                (n("linear_attn.out_proj.weight"), vec![h, vdim]),
            ]);
        } else {
            p.extend([
                (n("self_attn.q_proj.weight"), vec![q_rows, h]),
                (n("self_attn.k_proj.weight"), vec![nkv * hd, h]),
                (n("self_attn.v_proj.weight"), vec![nkv * hd, h]),
                (n("self_attn.o_proj.weight"), vec![h, nh * hd]),
                (n("self_attn.q_norm.weight"), vec![hd]),
                (n("self_attn.k_norm.weight"), vec![hd]),
            ]);
        }
        p.extend([
            (n("post_attention_layernorm.weight"), vec![h]),
            (n("mlp.gate_proj.weight"), vec![i, h]),
            (n("mlp.up_proj.weight"), vec![i, h]),
            (n("mlp.down_proj.weight"), vec![h, i]),
        ]);
    }
}

/// The architecture of `cfg`, or an input error naming it.
fn architecture(cfg: &DecoderConfig) -> Result<Architecture> {
    cfg.validate()
        .map_err(|m| ModelError::InvalidInput(format!("target config: {m}")))?;
    cfg.architecture().map_err(|a| {
        ModelError::InvalidInput(format!(
            "unsupported architecture '{a}' (supported: llama, qwen3, qwen3_5)"
        ))
    })
}

/// Fills named tensors of `shapes` on `device` in `dtype` (see the module invariants).
fn fill(
    shapes: Vec<(String, Vec<usize>)>,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<HashMap<String, Tensor>> {
    let mut host = if device.is_cpu() {
        Some(rand_chacha::ChaCha8Rng::seed_from_u64(seed))
    } else {
        device.set_seed(seed)?;
        None
    };
    let mut out = HashMap::with_capacity(shapes.len());
    for (name, shape) in shapes {
        let t = if name.ends_with("norm.weight") {
            Tensor::ones(shape, dtype, device)?
        } else if let Some(rng) = host.as_mut() {
            let n: usize = shape.iter().product();
            Tensor::from_vec(normals(rng, n), shape, device)?.to_dtype(dtype)?
        } else {
            // accelerators draw f32 (candle's CUDA generator has no bf16/f16) and convert there
            Tensor::randn(0f32, STD, shape, device)?.to_dtype(dtype)?
        };
        out.insert(name, t);
    }
    Ok(out)
}

/// `n` draws of N(0, STD²): Box–Muller, both outputs of each pair used.
fn normals(rng: &mut impl Rng, n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n + 1);
    while v.len() < n {
        let u1: f32 = rng.random::<f32>().max(1e-12);
        let u2: f32 = rng.random();
        let r = STD * (-2.0 * u1.ln()).sqrt();
        let (s, c) = (2.0 * std::f32::consts::PI * u2).sin_cos();
        v.push(r * c);
        v.push(r * s);
    }
    v.truncate(n);
    v
}

/// Random weights of a target with config `cfg`, by Hugging Face name, on `device` in `dtype`.
pub fn random_target_tensors(
    cfg: &DecoderConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<HashMap<String, Tensor>> {
    let arch = architecture(cfg)?;
    fill(target_parameter_shapes(cfg, arch), dtype, device, seed)
}

/// A target with config `cfg` and random weights, built by [`Decoder::new`].
pub fn random_target(
    cfg: &DecoderConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<Decoder> {
    let arch = architecture(cfg)?;
    if arch == Architecture::Qwen35 {
        return Err(ModelError::InvalidInput(
            "a Qwen3.5 hybrid is not a dense decoder (random_hybrid / random_target_model)".into(),
        ));
    }
    let vb = random_var_builder(target_parameter_shapes(cfg, arch), dtype, device, seed)?;
    Decoder::new(cfg, arch, vb)
}

/// A var builder over random weights of these (name, shape)s: on the CPU the tensors of [`fill`]
/// (those of [`random_target_tensors`]); on an accelerator each weight drawn when the
/// constructor asks for it ([`LazyRandom`]), so that a constructor that stacks weights (the fused
/// q/k/v, gate/up and Gated DeltaNet input projections) never holds the unstacked copies beside
/// the stacked ones — a Qwen3.6-27B shape would not fit an 80 GB card otherwise.
fn random_var_builder(
    shapes: Vec<(String, Vec<usize>)>,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<VarBuilder<'static>> {
    if device.is_cpu() {
        let w = fill(shapes, dtype, device, seed)?;
        return Ok(VarBuilder::from_tensors(w, dtype, device));
    }
    device.set_seed(seed)?;
    let backend = LazyRandom {
        shapes: shapes.into_iter().collect(),
    };
    Ok(VarBuilder::from_backend(
        Box::new(backend),
        dtype,
        device.clone(),
    ))
}

/// Random weights drawn on request by the device's generator (norm weights ones), each at most
/// once per request: see [`random_var_builder`].
struct LazyRandom {
    shapes: HashMap<String, Vec<usize>>,
}

impl LazyRandom {
    fn draw(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let Some(shape) = self.shapes.get(name) else {
            candle_core::bail!("random weights: no tensor named {name}")
        };
        if name.ends_with("norm.weight") {
            return Tensor::ones(shape.as_slice(), dtype, dev);
        }
        Tensor::randn(0f32, STD, shape.as_slice(), dev)?.to_dtype(dtype)
    }
}

impl candle_nn::var_builder::SimpleBackend for LazyRandom {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.draw(name, dtype, dev)?;
        if t.shape() != &s {
            candle_core::bail!(
                "random weights: {name} is {:?}, asked for {:?}",
                t.dims(),
                s.dims()
            )
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.draw(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.shapes.contains_key(name)
    }
}

/// A Qwen3.5 / Qwen3.6 hybrid with config `cfg` and random weights, built by
/// [`HybridDecoder::new`].
pub fn random_hybrid(
    cfg: &DecoderConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<HybridDecoder> {
    let arch = architecture(cfg)?;
    let vb = random_var_builder(target_parameter_shapes(cfg, arch), dtype, device, seed)?;
    HybridDecoder::new(cfg, vb)
}

/// A target of any supported architecture with config `cfg` and random weights.
pub fn random_target_model(
    cfg: &DecoderConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<Box<dyn TargetModel>> {
    Ok(match architecture(cfg)? {
        Architecture::Qwen35 => Box::new(random_hybrid(cfg, dtype, device, seed)?),
        _ => Box::new(random_target(cfg, dtype, device, seed)?),
    })
}

/// Random weights of a drafter with config `cfg` (z-lab names), on `device` in `dtype`.
pub fn random_drafter_tensors(
    cfg: &DFlashConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<HashMap<String, Tensor>> {
    fill(parameter_shapes(cfg), dtype, device, seed)
}

/// A drafter with config `cfg` and random weights, built by [`DFlashDrafter::new`].
pub fn random_drafter(
    cfg: &DFlashConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<DFlashDrafter> {
    let w = random_drafter_tensors(cfg, dtype, device, seed)?;
    DFlashDrafter::new(cfg, VarBuilder::from_tensors(w, dtype, device))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(model_type: &str, tied: bool) -> DecoderConfig {
        serde_json::from_value(serde_json::json!({
            "model_type": model_type, "vocab_size": 64, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "tie_word_embeddings": tied,
        }))
        .unwrap()
    }

    #[test]
    fn random_models_build_and_are_reproducible() {
        for (mt, tied) in [("llama", true), ("qwen3", false)] {
            let cfg = tiny(mt, tied);
            let a = random_target_tensors(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
            let b = random_target_tensors(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
            let arch = cfg.architecture().unwrap();
            assert_eq!(a.len(), target_parameter_shapes(&cfg, arch).len());
            assert_eq!(a.contains_key("lm_head.weight"), !tied);
            let q = "model.layers.1.self_attn.q_proj.weight";
            let d = (&a[q] - &b[q]).unwrap().abs().unwrap().sum_all().unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
            let x: Vec<f32> = a[q].flatten_all().unwrap().to_vec1().unwrap();
            let var = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
            assert!((var.sqrt() - STD).abs() < 0.005, "std {}", var.sqrt());
            let m = random_target(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
            assert_eq!(m.info().vocab_size, 64);
            let dcfg = crate::drafter::io::config_for_decoder(&cfg, 2, 4, 63);
            random_drafter(&dcfg, DType::F32, &Device::Cpu, 4).unwrap();
        }
    }
}
