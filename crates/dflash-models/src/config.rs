//! `config.json` of Llama-family, Qwen3 dense and Qwen3.5 / Qwen3.6 dense hybrid decoders,
//! mirrored with serde.
//!
//! Invariants: accepts both the transformers v4 layout (`rope_theta` + `rope_scaling`) and the v5
//! layout (`rope_parameters`); every accessor returns a validated value, and `validate` refuses
//! configs whose shapes cannot work (heads not dividing, zero sizes) with a message naming the field.
//! A multimodal checkpoint's `text_config` is read as the config, with the top level's keys it
//! lacks (and the top level's `tie_word_embeddings`) merged in ([`flatten_text_config`]). Hybrid
//! fields take transformers' `Qwen3_5TextConfig` defaults when absent.

use dflash_core::{RopeConfig, RopeScaling};
use serde::Deserialize;
use serde_json::Value;

/// The decoder families this crate implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama, Llama-3.x, SmolLM2, Mistral-style dense decoders.
    Llama,
    /// Qwen3 dense: Llama plus per-head RMSNorm on q and k.
    Qwen3,
    /// Qwen3.5 / Qwen3.6 dense hybrids: Gated DeltaNet and gated full-attention layers
    /// ([`crate::hybrid::HybridDecoder`]).
    Qwen35,
}

impl Architecture {
    pub fn from_model_type(t: &str) -> Option<Self> {
        match t {
            "llama" | "mistral" | "smollm" => Some(Self::Llama),
            "qwen3" => Some(Self::Qwen3),
            "qwen3_5" | "qwen3_5_text" => Some(Self::Qwen35),
            _ => None,
        }
    }
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen3 => "qwen3",
            Self::Qwen35 => "qwen3_5",
        }
    }
}

fn default_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> usize {
    4096
}

#[derive(Debug, Clone, Deserialize)]
pub struct DecoderConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub bos_token_id: Option<Value>,
    #[serde(default)]
    pub eos_token_id: Option<Value>,
    /// Qwen3.5 / Qwen3.6 hybrid fields (absent for dense models).
    #[serde(flatten)]
    pub hybrid: HybridFields,
}

/// The `config.json` fields of a Qwen3.5 / Qwen3.6 hybrid (`Qwen3_5TextConfig`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct HybridFields {
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub full_attention_interval: Option<usize>,
    #[serde(default)]
    pub linear_num_key_heads: Option<usize>,
    #[serde(default)]
    pub linear_num_value_heads: Option<usize>,
    #[serde(default)]
    pub linear_key_head_dim: Option<usize>,
    #[serde(default)]
    pub linear_value_head_dim: Option<usize>,
    #[serde(default)]
    pub linear_conv_kernel_dim: Option<usize>,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default)]
    pub attn_output_gate: Option<bool>,
}

/// A multimodal config's `text_config` with the top level's other keys merged in where it lacks
/// them (the top level's `tie_word_embeddings` wins: it is the causal LM's); other configs as
/// they are.
pub fn flatten_text_config(v: Value) -> Value {
    let Value::Object(mut top) = v else { return v };
    let Some(Value::Object(mut text)) = top.remove("text_config") else {
        return Value::Object(top);
    };
    top.remove("vision_config");
    for (k, val) in top {
        if k == "tie_word_embeddings" || !text.contains_key(&k) {
            text.insert(k, val);
        }
    }
    Value::Object(text)
}

/// Reads an int or a list of ints (`eos_token_id` is either).
pub fn token_ids(v: &Option<Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect(),
        _ => vec![],
    }
}

fn f(v: &Value, k: &str) -> Option<f64> {
    v.get(k).and_then(|x| x.as_f64())
}

impl DecoderConfig {
    pub fn architecture(&self) -> Result<Architecture, String> {
        let t = self.model_type.clone().unwrap_or_default();
        if let Some(a) = Architecture::from_model_type(&t) {
            return Ok(a);
        }
        for a in &self.architectures {
            match a.as_str() {
                "LlamaForCausalLM" | "MistralForCausalLM" => return Ok(Architecture::Llama),
                "Qwen3ForCausalLM" => return Ok(Architecture::Qwen3),
                "Qwen3_5ForCausalLM" | "Qwen3_5ForConditionalGeneration" => {
                    return Ok(Architecture::Qwen35)
                }
                _ => {}
            }
        }
        Err(if t.is_empty() {
            self.architectures.join(",")
        } else {
            t
        })
    }

    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_kv_heads()),
            ("head_dim", self.head_dim()),
        ] {
            if v == 0 {
                return Err(format!("{name} must be > 0"));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_kv_heads()) {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.num_kv_heads()
            ));
        }
        if let Some(act) = &self.hidden_act {
            if act != "silu" {
                return Err(format!("hidden_act '{act}' is not supported (only silu)"));
            }
        }
        if self.attention_bias {
            return Err("attention_bias=true is not supported".into());
        }
        if self.architecture() == Ok(Architecture::Qwen35) {
            self.validate_hybrid()?;
        }
        self.rope().map(|_| ())
    }

    /// Per layer, whether it is a Gated DeltaNet (linear attention) layer: `layer_types`, else
    /// every layer but each `full_attention_interval`-th (default 4). All false for dense models.
    pub fn recurrent_layers(&self) -> Vec<bool> {
        if self.architecture() != Ok(Architecture::Qwen35) {
            return vec![false; self.num_hidden_layers];
        }
        match &self.hybrid.layer_types {
            Some(t) => t.iter().map(|t| t == "linear_attention").collect(),
            None => {
                let every = self.hybrid.full_attention_interval.unwrap_or(4).max(1);
                (0..self.num_hidden_layers)
                    .map(|i| (i + 1) % every != 0)
                    .collect()
            }
        }
    }

    /// The Gated DeltaNet layers' shape (transformers' defaults where a field is absent).
    pub fn delta_net_shape(&self) -> crate::gated_deltanet::DeltaNetShape {
        let h = &self.hybrid;
        crate::gated_deltanet::DeltaNetShape {
            hidden: self.hidden_size,
            key_heads: h.linear_num_key_heads.unwrap_or(16),
            value_heads: h.linear_num_value_heads.unwrap_or(32),
            key_dim: h.linear_key_head_dim.unwrap_or(128),
            value_dim: h.linear_value_head_dim.unwrap_or(128),
            conv_kernel: h.linear_conv_kernel_dim.unwrap_or(4),
        }
    }

    /// Whether full-attention layers gate their output (`q_proj` doubled; Qwen3.5 default true).
    pub fn attn_output_gate(&self) -> bool {
        self.hybrid.attn_output_gate.unwrap_or(true)
    }

    fn validate_hybrid(&self) -> Result<(), String> {
        if let Some(t) = &self.hybrid.layer_types {
            if t.len() != self.num_hidden_layers {
                return Err(format!(
                    "layer_types has {} entries for {} layers",
                    t.len(),
                    self.num_hidden_layers
                ));
            }
            if let Some(bad) = t
                .iter()
                .find(|t| *t != "linear_attention" && *t != "full_attention")
            {
                return Err(format!(
                    "layer type '{bad}' is not supported (linear_attention, full_attention)"
                ));
            }
        }
        let s = self.delta_net_shape();
        for (name, v) in [
            ("linear_num_key_heads", s.key_heads),
            ("linear_num_value_heads", s.value_heads),
            ("linear_key_head_dim", s.key_dim),
            ("linear_value_head_dim", s.value_dim),
            ("linear_conv_kernel_dim", s.conv_kernel),
        ] {
            if v == 0 {
                return Err(format!("{name} must be > 0"));
            }
        }
        if !s.value_heads.is_multiple_of(s.key_heads) {
            return Err(format!(
                "linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                s.value_heads, s.key_heads
            ));
        }
        Ok(())
    }

    /// The fraction of each head that rotates: `rope_parameters.partial_rotary_factor`, else the
    /// top-level field, else 1 (0.25 for Qwen3.5 hybrids, transformers' default).
    fn partial_rotary_factor(&self) -> f64 {
        let default = match self.architecture() {
            Ok(Architecture::Qwen35) => 0.25,
            _ => 1.0,
        };
        self.rope_parameters
            .as_ref()
            .and_then(|p| f(p, "partial_rotary_factor"))
            .or(self.hybrid.partial_rotary_factor)
            .unwrap_or(default)
    }

    /// The RoPE settings from either config layout.
    pub fn rope(&self) -> Result<RopeConfig, String> {
        let params = self.rope_parameters.as_ref().or(self.rope_scaling.as_ref());
        let theta = self
            .rope_parameters
            .as_ref()
            .and_then(|p| f(p, "rope_theta"))
            .or(self.rope_theta)
            .unwrap_or(10000.0);
        let scaling = match params {
            None | Some(Value::Null) => None,
            Some(p) => rope_scaling(p, self.max_position_embeddings)?,
        };
        let rotary_dim = (self.head_dim() as f64 * self.partial_rotary_factor()) as usize;
        Ok(RopeConfig {
            theta,
            head_dim: self.head_dim(),
            rotary_dim,
            scaling,
        })
    }
}

/// Parses a `rope_scaling` / `rope_parameters` object.
pub fn rope_scaling(p: &Value, max_pos: usize) -> Result<Option<RopeScaling>, String> {
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(|x| x.as_str())
        .unwrap_or("default");
    let factor = f(p, "factor").unwrap_or(1.0);
    let need = |k: &str| f(p, k).ok_or_else(|| format!("rope scaling '{kind}' needs '{k}'"));
    Ok(match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: need("original_max_position_embeddings")?,
        }),
        "yarn" => Some(RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: f(p, "original_max_position_embeddings")
                .unwrap_or(max_pos as f64),
            beta_fast: f(p, "beta_fast").unwrap_or(32.0),
            beta_slow: f(p, "beta_slow").unwrap_or(1.0),
            attention_factor: f(p, "attention_factor"),
            truncate: p.get("truncate").and_then(|x| x.as_bool()).unwrap_or(true),
        }),
        other => return Err(format!("unsupported rope type '{other}'")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(v: Value) -> DecoderConfig {
        serde_json::from_value(flatten_text_config(v)).unwrap()
    }

    #[test]
    fn hybrid_fields_take_transformers_defaults_and_bad_ones_are_refused() {
        let base = serde_json::json!({
            "model_type": "qwen3_5_text", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 8, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16,
        });
        let c = cfg(base.clone());
        assert_eq!(c.architecture(), Ok(Architecture::Qwen35));
        c.validate().unwrap();
        // partial rotary 0.25 by default, every 4th layer full attention, output gate on
        assert_eq!(c.rope().unwrap().rotary_dim, 4);
        assert_eq!(
            c.recurrent_layers(),
            [true, true, true, false, true, true, true, false]
        );
        assert!(c.attn_output_gate());
        assert_eq!(c.delta_net_shape().value_heads, 32);
        // the top-level field, and rope_parameters' over it
        let mut v = base.clone();
        v["partial_rotary_factor"] = serde_json::json!(0.5);
        assert_eq!(cfg(v.clone()).rope().unwrap().rotary_dim, 8);
        v["rope_parameters"] = serde_json::json!({"rope_theta": 1e7, "partial_rotary_factor": 1.0});
        let r = cfg(v).rope().unwrap();
        assert_eq!((r.rotary_dim, r.theta), (16, 1e7));
        // a dense Qwen3 rotates the whole head
        let mut d = base.clone();
        d["model_type"] = serde_json::json!("qwen3");
        assert_eq!(cfg(d.clone()).rope().unwrap().rotary_dim, 16);
        assert_eq!(cfg(d).recurrent_layers(), [false; 8]);
        // nested text_config: its keys win, the top level's tie_word_embeddings wins
        let nested = serde_json::json!({
            "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
            "tie_word_embeddings": true, "text_config": base, "vision_config": {"depth": 1}
        });
        let n = cfg(nested);
        assert!(n.tie_word_embeddings);
        assert_eq!(n.model_type.as_deref(), Some("qwen3_5_text"));
        assert_eq!(n.architectures, ["Qwen3_5ForConditionalGeneration"]);
        for (k, val) in [
            (
                "layer_types",
                serde_json::json!(vec!["linear_attention"; 3]),
            ),
            ("layer_types", serde_json::json!(vec!["mamba"; 8])),
            ("linear_num_key_heads", serde_json::json!(3)),
            ("linear_conv_kernel_dim", serde_json::json!(0)),
        ] {
            let mut v = base.clone();
            v[k] = val;
            assert!(cfg(v).validate().is_err(), "{k}");
        }
    }
}
