//! The z-lab DFlash drafter `config.json`, mirrored with serde (v1 top-level fields and the nested
//! `dflash_config` both accepted), and the reference rule for choosing target layers.
//!
//! Invariants: `target_layer_ids()` is `dflash_config.target_layer_ids` when present, else
//! `round(1 + i·(Nt−4)/(Nd−1))` with Python's round-half-to-even; `layer_attention(i)` resolves
//! per-layer causality/window as the later z-lab reference and vLLM do. Scalar settings are read
//! as the z-lab package (PyPI `dflash` 0.1.0) reads them: `dflash_config` first, then the top
//! level (`input_embedding_scale`, `output_multiplier`, `final_logit_softcapping`); RoPE from
//! `rope_parameters` (transformers ≥ 5, what the package saves) before `rope_theta` /
//! `rope_scaling`. DFlash 2
//! checkpoints (dynamic convolutions and a candidate selector) are refused, never half-loaded.

use crate::config::rope_scaling;
use dflash_core::RopeConfig;
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DFlashSection {
    #[serde(default)]
    pub mask_token_id: Option<u32>,
    #[serde(default)]
    pub target_layer_ids: Option<Vec<usize>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub causal: Option<bool>,
    /// The noise (block) embeddings are multiplied by this (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_embedding_scale: Option<f64>,
    /// The drafter's logits are multiplied by this (default 1)…
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_multiplier: Option<f64>,
    /// …then soft-capped, `tanh(l / c)·c`, when positive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_logit_softcapping: Option<f64>,
    /// Read before the top-level `block_size`, as z-lab's package does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<usize>,
    /// dflash-rs: added to every block slot's position (slot `j` at `anchor + j + offset`;
    /// absent: 0, the z-lab layout). Declared by `train --block-position-offset`, or written by
    /// hand for a drafter trained elsewhere that way (`diagnose` names it); z-lab's code
    /// ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_position_offset: Option<i64>,
    /// dflash-rs: slot 0 of each block holds the mask token instead of the anchor (bonus) token
    /// (absent: false, the z-lab layout); z-lab's code ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anchor_slot_masked: Option<bool>,
    /// dflash-rs: the last tap is fed through the target's final RMSNorm before `fc` (absent:
    /// false, the z-lab convention of raw layer outputs, HF `hidden_states[l + 1]`). For a
    /// drafter trained elsewhere on normed states (a model class whose last hidden state is the
    /// normed one); `diagnose` names it; z-lab's code ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_norm_on_last_tap: Option<bool>,
    /// DFlash 2 only (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conv_kernel_size: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conv_group_size: Option<Value>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    1e6
}
fn default_block() -> usize {
    16
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DFlashConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub auto_map: Option<Value>,
    #[serde(default)]
    pub model_type: Option<String>,
    #[serde(default = "default_block")]
    pub block_size: usize,
    pub num_target_layers: usize,
    pub num_hidden_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    /// transformers ≥ 5 writes RoPE here (`rope_theta`, `rope_type` and the scaling's fields)
    /// instead of top-level `rope_theta` / `rope_scaling`; it wins when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<Value>,
    pub max_position_embeddings: usize,
    pub vocab_size: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is_causal: Option<bool>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub dflash_config: DFlashSection,
    /// v1 checkpoints carry these at top level.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_token_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_layer_ids: Option<Vec<usize>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_embedding_scale: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_multiplier: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_logit_softcapping: Option<f64>,
}

/// Python's `round` (half to even) of a non-negative value.
pub fn round_half_even(x: f64) -> usize {
    let f = x.floor();
    let diff = x - f;
    let r = if (diff - 0.5).abs() < 1e-12 {
        if (f as i64) % 2 == 0 {
            f
        } else {
            f + 1.0
        }
    } else {
        x.round()
    };
    r as usize
}

/// The reference rule: layers spread from the 2nd to the 3rd-to-last.
pub fn default_target_layers(num_target_layers: usize, num_draft_layers: usize) -> Vec<usize> {
    if num_draft_layers == 1 {
        return vec![num_target_layers / 2];
    }
    let span = num_target_layers as f64 - 4.0;
    (0..num_draft_layers)
        .map(|i| round_half_even(1.0 + i as f64 * span / (num_draft_layers as f64 - 1.0)))
        .collect()
}

/// How a block's slots are laid out for the drafter: what training, validation and decoding
/// all use ([`DFlashConfig::block_convention`]); the default is the z-lab layout (slot `j` at
/// position `anchor + j`, slot 0 the anchor's token — decoding's bonus token). `dflash diagnose`
/// measures the alternatives a drafter trained elsewhere may have used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockConvention {
    /// Added to every block slot's position (clamped at 0).
    pub position_offset: i64,
    /// Slot 0 holds the mask token instead of the anchor's token.
    pub anchor_slot_masked: bool,
}

/// Visibility of one drafter layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerAttention {
    /// Block queries see only block keys at or before their own position.
    pub causal: bool,
    /// Key visible only if `q_pos - k_pos < window`.
    pub window: Option<usize>,
}

impl DFlashConfig {
    /// Multiplier of the block's token embeddings (z-lab `input_embedding_scale`, default 1).
    pub fn input_embedding_scale(&self) -> f64 {
        self.dflash_config
            .input_embedding_scale
            .or(self.input_embedding_scale)
            .unwrap_or(1.0)
    }

    /// Multiplier of the drafter's logits (z-lab `output_multiplier`, default 1).
    pub fn output_multiplier(&self) -> f64 {
        self.dflash_config
            .output_multiplier
            .or(self.output_multiplier)
            .unwrap_or(1.0)
    }

    /// Soft cap of the drafter's logits (z-lab `final_logit_softcapping`; `None` or ≤ 0: off).
    pub fn final_logit_softcapping(&self) -> Option<f64> {
        self.dflash_config
            .final_logit_softcapping
            .or(self.final_logit_softcapping)
            .filter(|&c| c > 0.0)
    }

    /// The block layout the config declares (`dflash_config.block_position_offset` and
    /// `anchor_slot_masked`; the z-lab layout when absent).
    pub fn block_convention(&self) -> BlockConvention {
        BlockConvention {
            position_offset: self.dflash_config.block_position_offset.unwrap_or(0),
            anchor_slot_masked: self.dflash_config.anchor_slot_masked.unwrap_or(false),
        }
    }

    /// Declares `conv` in the config (fields left out for the z-lab layout's defaults, so a
    /// default drafter's config stays z-lab's).
    pub fn set_block_convention(&mut self, conv: BlockConvention) {
        self.dflash_config.block_position_offset =
            (conv.position_offset != 0).then_some(conv.position_offset);
        self.dflash_config.anchor_slot_masked = conv.anchor_slot_masked.then_some(true);
    }

    /// Whether the config declares the target's final norm on the last tap
    /// (`dflash_config.final_norm_on_last_tap`; false when absent).
    pub fn final_norm_on_last_tap(&self) -> bool {
        self.dflash_config.final_norm_on_last_tap.unwrap_or(false)
    }

    /// Declares (or, with `false`, removes) `dflash_config.final_norm_on_last_tap`.
    pub fn set_final_norm_on_last_tap(&mut self, on: bool) {
        self.dflash_config.final_norm_on_last_tap = on.then_some(true);
    }

    pub fn mask_token_id(&self) -> Option<u32> {
        self.dflash_config.mask_token_id.or(self.mask_token_id)
    }

    pub fn target_layer_ids(&self) -> Vec<usize> {
        self.dflash_config
            .target_layer_ids
            .clone()
            .or_else(|| self.target_layer_ids.clone())
            .unwrap_or_else(|| {
                default_target_layers(self.num_target_layers, self.num_hidden_layers)
            })
    }

    pub fn layer_attention(&self, i: usize) -> LayerAttention {
        let sliding = self
            .layer_types
            .as_ref()
            .and_then(|t| t.get(i))
            .map(|t| t == "sliding_attention")
            .unwrap_or(false);
        let causal = self
            .is_causal
            .or(self.dflash_config.causal)
            .unwrap_or(sliding);
        LayerAttention {
            causal,
            window: if sliding { self.sliding_window } else { None },
        }
    }

    pub fn rope(&self) -> Result<RopeConfig, String> {
        let params = self
            .rope_parameters
            .as_ref()
            .filter(|p| !p.is_null())
            .or(self.rope_scaling.as_ref());
        let scaling = match params {
            None | Some(Value::Null) => None,
            Some(p) => rope_scaling(p, self.max_position_embeddings)?,
        };
        Ok(RopeConfig {
            theta: self.rope_theta,
            head_dim: self.head_dim,
            rotary_dim: self.head_dim,
            scaling,
        })
    }

    /// The config with `dflash_config.block_size` (when given) as the block size, the way z-lab's
    /// package resolves it; every loader calls this before [`DFlashConfig::validate`].
    pub fn resolved(mut self) -> Self {
        if let Some(b) = self.dflash_config.block_size {
            self.block_size = b;
        }
        if let Some(theta) = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.get("rope_theta"))
            .and_then(|t| t.as_f64())
        {
            self.rope_theta = theta;
        }
        self
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.architectures.iter().any(|a| a.starts_with("DFlash2"))
            || self.dflash_config.conv_kernel_size.is_some()
            || self.dflash_config.conv_group_size.is_some()
        {
            return Err(
                "a DFlash 2 drafter (dynamic convolutions and a candidate selector): \
                        only DFlash (v1) drafters are supported"
                    .into(),
            );
        }
        for (name, v) in [
            ("input_embedding_scale", self.input_embedding_scale()),
            ("output_multiplier", self.output_multiplier()),
        ] {
            if !v.is_finite() || v <= 0.0 {
                return Err(format!("{name} {v} must be positive and finite"));
            }
        }
        if self.block_size < 2 {
            return Err(format!("block_size {} must be at least 2", self.block_size));
        }
        if self.num_key_value_heads == 0
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            return Err("num_attention_heads must be a multiple of num_key_value_heads".into());
        }
        if self.mask_token_id().is_none() {
            return Err("dflash_config.mask_token_id missing".into());
        }
        let ids = self.target_layer_ids();
        if ids.is_empty() {
            return Err("no target layers".into());
        }
        if let Some(&l) = ids.iter().find(|&&l| l >= self.num_target_layers) {
            return Err(format!(
                "target layer {l} >= num_target_layers {}",
                self.num_target_layers
            ));
        }
        self.rope().map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config as z-lab's package writes and reads it (scalar settings in `dflash_config`, with
    /// the top level as fallback), and a DFlash 2 one.
    #[test]
    fn zlab_package_settings_resolve_like_its_draft_value() {
        let json = serde_json::json!({
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "num_target_layers": 36, "num_hidden_layers": 5, "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 4096, "vocab_size": 1000,
            "block_size": 16, "output_multiplier": 9.0, "final_logit_softcapping": 30.0,
            "dflash_config": {"mask_token_id": 7, "block_size": 10, "output_multiplier": 0.5,
                              "input_embedding_scale": 1.5},
            "transformers_version": "5.15.0", "use_cache": true
        });
        let cfg: DFlashConfig = serde_json::from_value(json.clone()).unwrap();
        let cfg = cfg.resolved();
        cfg.validate().unwrap();
        assert_eq!(cfg.block_size, 10);
        assert_eq!(cfg.output_multiplier(), 0.5);
        assert_eq!(cfg.final_logit_softcapping(), Some(30.0));
        assert_eq!(cfg.input_embedding_scale(), 1.5);
        assert_eq!(cfg.target_layer_ids(), vec![1, 9, 17, 25, 33]);
        // no top-level rope_theta: the default base
        assert_eq!(cfg.rope().unwrap().theta, 1e6);
        // transformers >= 5 writes RoPE as rope_parameters (what the package's save_pretrained
        // gives): it wins over the top-level fields
        let mut v5 = json.clone();
        v5["rope_theta"] = serde_json::json!(5e5);
        v5["rope_parameters"] = serde_json::json!({"rope_theta": 100000.0, "rope_type": "default"});
        let c5: DFlashConfig = serde_json::from_value(v5.clone()).unwrap();
        let c5 = c5.resolved();
        assert_eq!(c5.rope_theta, 100000.0);
        let r = c5.rope().unwrap();
        assert_eq!((r.theta, r.scaling.is_none()), (100000.0, true));
        v5["rope_parameters"] =
            serde_json::json!({"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0});
        let c5: DFlashConfig = serde_json::from_value(v5).unwrap();
        let r = c5.resolved().rope().unwrap();
        assert_eq!(r.theta, 1e6);
        assert!(r.scaling.is_some());
        let mut v2 = json;
        v2["dflash_config"]["conv_kernel_size"] = serde_json::json!(4);
        let v2: DFlashConfig = serde_json::from_value(v2).unwrap();
        assert!(v2.validate().unwrap_err().contains("DFlash 2"));
    }

    #[test]
    fn reference_layer_rule_rounds_half_to_even() {
        assert_eq!(default_target_layers(30, 5), vec![1, 8, 14, 20, 27]);
        assert_eq!(default_target_layers(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(default_target_layers(64, 5), vec![1, 16, 31, 46, 61]);
        assert_eq!(default_target_layers(32, 5), vec![1, 8, 15, 22, 29]);
        assert_eq!(default_target_layers(30, 1), vec![15]);
        assert_eq!(round_half_even(7.5), 8);
        assert_eq!(round_half_even(20.5), 20);
        assert_eq!(round_half_even(23.5), 24);
        assert_eq!(round_half_even(68.5), 68);
    }
}
