//! What `dflash bench decode` measures against: the named model shapes (the real `config.json`
//! values of each model, parsed by the ordinary config path), the bytes one autoregressive step
//! must read, and the device's copy bandwidth measured in the same run.
//!
//! Invariants:
//! - A named shape is exactly its model's published config (dimensions, RoPE, norms, tying); only
//!   the weights are random. `tiny` is a made-up shape for tests.
//! - `step_bytes` counts every weight once in the compute dtype (the embedding table as one row,
//!   unless tied, when the LM head reads it whole) plus the K and V cache at the context (of the
//!   full-attention layers only, for Qwen3.5 / Qwen3.6 hybrids, plus each Gated DeltaNet layer's
//!   f32 rule state and conv window, which do not grow with the context).
//! - Copy bandwidth counts bytes read plus bytes written, so `bytes / bandwidth` is the time a
//!   perfect kernel would need to stream `bytes` once.

use anyhow::{anyhow, Result};
use candle_core::{DType, Device};
use dflash_models::config::Architecture;
use dflash_models::DecoderConfig;
use std::time::Instant;

/// A named shape: its config, the mask token its z-lab drafter uses and, where z-lab's drafter
/// for it is published with a layout of its own, that layout.
pub struct NamedShape {
    pub name: &'static str,
    pub config: DecoderConfig,
    pub mask_token_id: u32,
    pub zlab_drafter: Option<DrafterLayout>,
}

/// A published drafter's attention layout where it differs from the target's (what `draft init`
/// would give): heads, head width, and per-layer `layer_types` with their sliding window.
#[derive(Debug, Clone, PartialEq)]
pub struct DrafterLayout {
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub layer_types: Vec<&'static str>,
    pub sliding_window: Option<usize>,
}

impl DrafterLayout {
    /// `cfg` with this layout (heads, head width, layer types, window); the drafter must have as
    /// many layers as the layout names.
    pub fn apply(&self, cfg: &mut dflash_models::DFlashConfig) -> Result<()> {
        if cfg.num_hidden_layers != self.layer_types.len() {
            return Err(anyhow!(
                "the published drafter layout has {} layers, --draft-layers asks for {} \
                 (pass --drafter-layout target for another depth)",
                self.layer_types.len(),
                cfg.num_hidden_layers
            ));
        }
        cfg.num_attention_heads = self.num_attention_heads;
        cfg.num_key_value_heads = self.num_key_value_heads;
        cfg.head_dim = self.head_dim;
        cfg.layer_types = Some(self.layer_types.iter().map(|t| t.to_string()).collect());
        cfg.sliding_window = self.sliding_window;
        Ok(())
    }
}

/// The names `--shape` accepts.
pub const SHAPE_NAMES: &[&str] = &[
    "tiny",
    "smollm2-135m",
    "qwen3-0.6b",
    "qwen3-8b",
    "qwen3.5-4b",
    "qwen3.6-27b",
];

/// The config of a named shape, or `None` for an unknown name.
pub fn named_shape(name: &str) -> Result<Option<NamedShape>> {
    let (json, mask) = match name {
        "tiny" => (
            serde_json::json!({
                "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "max_position_embeddings": 4096, "tie_word_embeddings": false,
                "hidden_act": "silu", "attention_bias": false,
            }),
            511,
        ),
        // HuggingFaceTB/SmolLM2-135M(-Instruct) config.json
        "smollm2-135m" => (
            serde_json::json!({
                "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "rope_scaling": null,
                "max_position_embeddings": 8192, "tie_word_embeddings": true,
                "hidden_act": "silu", "attention_bias": false,
                "bos_token_id": 1, "eos_token_id": 2,
            }),
            16, // the shipped drafter's
        ),
        // Qwen/Qwen3-0.6B config.json
        "qwen3-0.6b" => (
            serde_json::json!({
                "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                "rope_scaling": null, "max_position_embeddings": 40960,
                "tie_word_embeddings": true, "hidden_act": "silu", "attention_bias": false,
                "bos_token_id": 151643, "eos_token_id": 151645,
            }),
            151669, // z-lab's Qwen3 drafters
        ),
        // Qwen/Qwen3-8B config.json
        "qwen3-8b" => (
            serde_json::json!({
                "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                "rope_scaling": null, "max_position_embeddings": 40960,
                "tie_word_embeddings": false, "hidden_act": "silu", "attention_bias": false,
                "bos_token_id": 151643, "eos_token_id": 151645,
            }),
            151669,
        ),
        // Qwen/Qwen3.5-4B config.json, text_config (a Gated DeltaNet / gated attention hybrid)
        "qwen3.5-4b" => (
            serde_json::json!({
                "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5_text",
                "vocab_size": 248320, "hidden_size": 2560, "intermediate_size": 9216,
                "num_hidden_layers": 32, "full_attention_interval": 4,
                "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
                "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "linear_conv_kernel_dim": 4, "attn_output_gate": true, "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                    "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                    "mrope_interleaved": true},
                "max_position_embeddings": 262144, "tie_word_embeddings": true,
                "hidden_act": "silu", "attention_bias": false, "eos_token_id": 248044,
            }),
            248070, // z-lab's Qwen3.5 / Qwen3.6 drafters
        ),
        // Qwen/Qwen3.6-27B config.json, text_config
        "qwen3.6-27b" => (
            serde_json::json!({
                "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5_text",
                "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
                "num_hidden_layers": 64, "full_attention_interval": 4,
                "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
                "linear_num_key_heads": 16, "linear_num_value_heads": 48,
                "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "linear_conv_kernel_dim": 4, "attn_output_gate": true, "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                    "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                    "mrope_interleaved": true},
                "max_position_embeddings": 262144, "tie_word_embeddings": false,
                "hidden_act": "silu", "attention_bias": false, "eos_token_id": 248044,
            }),
            248070,
        ),
        _ => return Ok(None),
    };
    // z-lab/Qwen3.6-27B-DFlash config.json (../shared/docs/spec.md): 32 / 8 heads of 128, four
    // sliding-window layers of 2,048 keys (causal within the block: no `is_causal` key) and a
    // full one; the other shapes' published drafters take the target's heads
    let zlab_drafter = (name == "qwen3.6-27b").then(|| DrafterLayout {
        num_attention_heads: 32,
        num_key_value_heads: 8,
        head_dim: 128,
        layer_types: vec![
            "sliding_attention",
            "sliding_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
        ],
        sliding_window: Some(2048),
    });
    let config: DecoderConfig = serde_json::from_value(json)?;
    config
        .validate()
        .map_err(|m| anyhow!("shape {name}: bad built-in config: {m}"))?;
    let name = SHAPE_NAMES
        .iter()
        .find(|n| **n == name)
        .expect("matched above");
    Ok(Some(NamedShape {
        name,
        config,
        mask_token_id: mask,
        zlab_drafter,
    }))
}

/// Bytes one AR step must read at `context` cached positions (see the module invariants):
/// `(weights, kv_cache)`.
pub fn step_bytes(cfg: &DecoderConfig, dtype: DType, context: usize) -> Result<(usize, usize)> {
    let arch = cfg
        .architecture()
        .map_err(|a| anyhow!("architecture {a}"))?;
    let h = cfg.hidden_size;
    let elems: usize = dflash_models::random::target_parameter_shapes(cfg, arch)
        .iter()
        .map(|(name, shape)| {
            if name == "model.embed_tokens.weight" && !cfg.tie_word_embeddings {
                h // one row looked up; the untied LM head reads its own table
            } else {
                shape.iter().product::<usize>()
            }
        })
        .sum();
    let recurrent = cfg.recurrent_layers();
    let linear = recurrent.iter().filter(|&&r| r).count();
    let full = recurrent.len() - linear;
    let kv = 2 * full * cfg.num_kv_heads() * cfg.head_dim() * context;
    // Gated DeltaNet layers read their f32 rule state and their conv window instead
    let d = cfg.delta_net_shape();
    let state = linear * d.value_heads * d.key_dim * d.value_dim * 4;
    let conv = linear * (d.conv_kernel - 1) * d.conv_channels() * dtype.size_in_bytes();
    Ok((
        elems * dtype.size_in_bytes(),
        kv * dtype.size_in_bytes() + state + conv,
    ))
}

/// Parameters of a target with this config (every tensor, the embedding included).
pub fn target_params(cfg: &DecoderConfig) -> Result<usize> {
    let arch: Architecture = cfg
        .architecture()
        .map_err(|a| anyhow!("architecture {a}"))?;
    Ok(dflash_models::random::target_parameter_shapes(cfg, arch)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum())
}

/// A measured copy bandwidth.
pub struct Bandwidth {
    /// Bytes read plus bytes written per second, in GB/s (10⁹).
    pub gbps: f64,
    /// How the copy was made.
    pub method: &'static str,
    /// Size of one copy (bytes read).
    pub bytes: usize,
}

/// The device's copy bandwidth: the median of `rounds` large copies after one warm-up.
pub fn copy_bandwidth(dev: &Device, rounds: usize) -> Result<Bandwidth> {
    let rounds = rounds.clamp(3, 10);
    match dev {
        Device::Cpu => cpu_copy(rounds),
        #[cfg(feature = "cuda")]
        Device::Cuda(c) => cuda_copy(dev, c, rounds),
        _ => tensor_copy(dev, rounds),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// One `memcpy` of 256 MiB (well past any cache) between two touched host buffers.
fn cpu_copy(rounds: usize) -> Result<Bandwidth> {
    let n = 256 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src);
    let mut t = vec![];
    for _ in 0..rounds {
        let t0 = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        t.push(t0.elapsed().as_secs_f64());
    }
    Ok(Bandwidth {
        gbps: 2.0 * n as f64 / median(t) / 1e9,
        method: "host memcpy (copy_from_slice, 256 MiB)",
        bytes: n,
    })
}

/// The driver's device-to-device copy (`cuMemcpyDtoDAsync` on the device's stream) of 2 GiB.
#[cfg(feature = "cuda")]
fn cuda_copy(dev: &Device, c: &candle_core::CudaDevice, rounds: usize) -> Result<Bandwidth> {
    let n = 2usize << 30;
    let src = c.alloc_zeros::<u8>(n)?;
    let mut dst = c.alloc_zeros::<u8>(n)?;
    c.memcpy_dtod(&src, &mut dst)?;
    dev.synchronize()?;
    let mut t = vec![];
    for _ in 0..rounds {
        let t0 = Instant::now();
        c.memcpy_dtod(&src, &mut dst)?;
        dev.synchronize()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    Ok(Bandwidth {
        gbps: 2.0 * n as f64 / median(t) / 1e9,
        method: "cudarc memcpy_dtod (2 GiB)",
        bytes: n,
    })
}

/// Any other device: candle's own elementwise kernel reading and writing 1 GiB.
fn tensor_copy(dev: &Device, rounds: usize) -> Result<Bandwidth> {
    let n = 1usize << 30;
    let x = candle_core::Tensor::zeros(n / 4, DType::F32, dev)?;
    let mut t = vec![];
    for i in 0..=rounds {
        dev.synchronize()?;
        let t0 = Instant::now();
        let y = x.affine(1.0, 0.0)?;
        dev.synchronize()?;
        drop(y);
        if i > 0 {
            t.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(Bandwidth {
        gbps: 2.0 * n as f64 / median(t) / 1e9,
        method: "candle affine kernel (1 GiB)",
        bytes: n,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hybrid_shapes_have_their_models_sizes_and_caches() {
        let b4 = named_shape("qwen3.5-4b").unwrap().unwrap().config;
        let b27 = named_shape("qwen3.6-27b").unwrap().unwrap().config;
        for (cfg, layers) in [(&b4, 32), (&b27, 64)] {
            // every 4th layer is full attention, the others Gated DeltaNet
            let want: Vec<bool> = (0..layers).map(|i| (i + 1) % 4 != 0).collect();
            assert_eq!(cfg.recurrent_layers(), want);
        }
        let p4 = target_params(&b4).unwrap() as f64;
        let p27 = target_params(&b27).unwrap() as f64;
        eprintln!("text parameters: 4B shape {p4:.3e}, 27B shape {p27:.3e}");
        assert!((3.5e9..4.6e9).contains(&p4), "{p4}");
        assert!((25.0e9..28.0e9).contains(&p27), "{p27}");
        // bf16 at context 2048: K and V of the 16 attention layers, f32 states of the 48 others
        let (_, cache) = step_bytes(&b27, DType::BF16, 2048).unwrap();
        let kv = 2 * 16 * 4 * 256 * 2048 * 2;
        let state = 48 * 48 * 128 * 128 * 4;
        let conv = 48 * 3 * (2 * 16 * 128 + 48 * 128) * 2;
        assert_eq!(cache, kv + state + conv);
    }

    #[test]
    fn the_27b_shape_drafts_with_zlabs_layout_and_the_others_with_the_targets() {
        use dflash_models::drafter::io::config_for_decoder;
        let s = named_shape("qwen3.6-27b").unwrap().unwrap();
        let layout = s
            .zlab_drafter
            .expect("z-lab's Qwen3.6-27B drafter has its own layout");
        let mut d = config_for_decoder(&s.config, 5, 16, s.mask_token_id);
        assert_eq!(
            (d.num_attention_heads, d.head_dim),
            (24, 256),
            "the target's heads"
        );
        layout.apply(&mut d).unwrap();
        d.validate().unwrap();
        assert_eq!(
            (d.num_attention_heads, d.num_key_value_heads, d.head_dim),
            (32, 8, 128)
        );
        let types = d.layer_types.clone().unwrap();
        assert_eq!(
            types.iter().filter(|t| *t == "sliding_attention").count(),
            4
        );
        assert_eq!(types[4], "full_attention");
        assert_eq!(d.sliding_window, Some(2048));
        // another depth is refused, not silently given a made-up layout
        let mut d4 = config_for_decoder(&s.config, 4, 16, s.mask_token_id);
        assert!(layout.apply(&mut d4).is_err());
        for name in ["smollm2-135m", "qwen3-8b", "qwen3.5-4b"] {
            assert!(
                named_shape(name).unwrap().unwrap().zlab_drafter.is_none(),
                "{name}"
            );
        }
    }
}
