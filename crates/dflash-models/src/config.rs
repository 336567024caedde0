//! `config.json` of Llama-family and Qwen3 decoders, mirrored with serde.
//!
//! Invariants: accepts both the transformers v4 layout (`rope_theta` + `rope_scaling`) and the v5
//! layout (`rope_parameters`); every accessor returns a validated value, and `validate` refuses
//! configs whose shapes cannot work (heads not dividing, zero sizes) with a message naming the field.

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
}

impl Architecture {
    pub fn from_model_type(t: &str) -> Option<Self> {
        match t {
            "llama" | "mistral" | "smollm" => Some(Self::Llama),
            "qwen3" => Some(Self::Qwen3),
            _ => None,
        }
    }
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen3 => "qwen3",
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
        self.rope().map(|_| ())
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
        Ok(RopeConfig {
            theta,
            head_dim: self.head_dim(),
            rotary_dim: self.head_dim(),
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
