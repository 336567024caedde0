//! GGUF metadata → [`DecoderConfig`] and [`GgufVocab`].
//!
//! Invariants: keys follow the GGUF spec (`{arch}.block_count`, `tokenizer.ggml.*`); integers of any
//! width are accepted; a missing required key is a [`ModelError::Config`] naming the key; the
//! config produced is the one transformers' GGUF loader would build for the same file. The keys are
//! read under the file's own `general.architecture` (`llama.*`, `qwen3.*`, `qwen35.*`); Qwen3.5 /
//! Qwen3.6 hybrids add their fields in [`crate::gguf_hybrid`].

use crate::config::{Architecture, DecoderConfig};
use crate::weights::GgufFile;
use crate::{ModelError, Result};
use candle_core::quantized::gguf_file::Value;
use dflash_text::GgufVocab;

pub(crate) fn int(v: &Value) -> Option<u64> {
    match v {
        Value::U8(x) => Some(*x as u64),
        Value::I8(x) => u64::try_from(*x).ok(),
        Value::U16(x) => Some(*x as u64),
        Value::I16(x) => u64::try_from(*x).ok(),
        Value::U32(x) => Some(*x as u64),
        Value::I32(x) => u64::try_from(*x).ok(),
        Value::U64(x) => Some(*x),
        Value::I64(x) => u64::try_from(*x).ok(),
        _ => None,
    }
}

pub(crate) fn float(v: &Value) -> Option<f64> {
    match v {
        Value::F32(x) => Some(*x as f64),
        Value::F64(x) => Some(*x),
        other => int(other).map(|x| x as f64),
    }
}

impl GgufFile {
    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.metadata().get(key)
    }

    pub(crate) fn need_int(&self, key: &str) -> Result<usize> {
        self.get(key)
            .and_then(int)
            .map(|x| x as usize)
            .ok_or_else(|| ModelError::Config {
                path: self.path.clone(),
                msg: format!("GGUF metadata key '{key}' missing or not an integer"),
            })
    }

    pub(crate) fn string(&self, key: &str) -> Option<String> {
        match self.get(key) {
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        }
    }

    /// `general.architecture` as written (the prefix of the model's metadata keys).
    pub fn architecture_name(&self) -> Result<String> {
        self.string("general.architecture")
            .ok_or_else(|| ModelError::Config {
                path: self.path.clone(),
                msg: "GGUF metadata key 'general.architecture' missing".into(),
            })
    }

    /// The architecture named by `general.architecture` (see
    /// [`crate::gguf_hybrid::gguf_architecture`] for the names accepted and refused).
    pub fn architecture(&self) -> Result<Architecture> {
        crate::gguf_hybrid::gguf_architecture(&self.path, &self.architecture_name()?)
    }

    /// The decoder config, as transformers' GGUF loader maps the metadata.
    pub fn decoder_config(&self) -> Result<DecoderConfig> {
        let arch = self.architecture()?;
        let a = self.architecture_name()?;
        let key = |k: &str| format!("{a}.{k}");
        let n_heads = self.need_int(&key("attention.head_count"))?;
        let hidden = self.need_int(&key("embedding_length"))?;
        let vocab =
            match self.get(&key("vocab_size")).and_then(int) {
                Some(v) => v as usize,
                None => match self.get("tokenizer.ggml.tokens") {
                    Some(Value::Array(t)) => t.len(),
                    _ => return Err(ModelError::Config {
                        path: self.path.clone(),
                        msg: "no vocab size: neither '{arch}.vocab_size' nor tokenizer.ggml.tokens"
                            .into(),
                    }),
                },
            };
        let head_dim = self
            .get(&key("attention.key_length"))
            .or_else(|| self.get(&key("rope.dimension_count")))
            .and_then(int)
            .map(|x| x as usize)
            .unwrap_or(hidden / n_heads.max(1));
        let tied = !self.content.tensor_infos.contains_key("output.weight");
        let cfg = DecoderConfig {
            architectures: vec![],
            model_type: Some(arch.as_str().to_string()),
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: self.need_int(&key("feed_forward_length"))?,
            num_hidden_layers: self.need_int(&key("block_count"))?,
            num_attention_heads: n_heads,
            num_key_value_heads: self
                .get(&key("attention.head_count_kv"))
                .and_then(int)
                .map(|x| x as usize),
            head_dim: Some(head_dim),
            rms_norm_eps: self
                .get(&key("attention.layer_norm_rms_epsilon"))
                .and_then(float)
                .unwrap_or(1e-6),
            rope_theta: self.get(&key("rope.freq_base")).and_then(float),
            rope_scaling: None,
            rope_parameters: None,
            max_position_embeddings: self
                .get(&key("context_length"))
                .and_then(int)
                .unwrap_or(4096) as usize,
            tie_word_embeddings: tied,
            attention_bias: false,
            hidden_act: None,
            bos_token_id: None,
            eos_token_id: self
                .get("tokenizer.ggml.eos_token_id")
                .and_then(int)
                .map(|x| x.into()),
            hybrid: Default::default(),
        };
        match arch {
            Architecture::Qwen35 => self.hybrid_decoder_config(cfg),
            _ => Ok(cfg),
        }
    }

    /// The tokenizer metadata as plain data for dflash-text.
    pub fn vocab(&self) -> Result<GgufVocab> {
        let strings = |k: &str| -> Vec<String> {
            match self.get(k) {
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|v| match v {
                        Value::String(s) => s.clone(),
                        _ => String::new(),
                    })
                    .collect(),
                _ => vec![],
            }
        };
        let tokens = strings("tokenizer.ggml.tokens");
        if tokens.is_empty() {
            return Err(ModelError::Config {
                path: self.path.clone(),
                msg: "GGUF has no tokenizer (tokenizer.ggml.tokens missing)".into(),
            });
        }
        let token_types = match self.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a.iter().map(|v| int(v).unwrap_or(1) as i32).collect(),
            _ => vec![],
        };
        let scores = match self.get("tokenizer.ggml.scores") {
            Some(Value::Array(a)) => a.iter().map(|v| float(v).unwrap_or(0.0) as f32).collect(),
            _ => vec![],
        };
        let id = |k: &str| self.get(k).and_then(int).map(|x| x as u32);
        let flag = |k: &str| match self.get(k) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        };
        Ok(GgufVocab {
            model: self
                .string("tokenizer.ggml.model")
                .unwrap_or_else(|| "gpt2".into()),
            pre: self.string("tokenizer.ggml.pre"),
            tokens,
            token_types,
            scores,
            merges: strings("tokenizer.ggml.merges"),
            bos_token_id: id("tokenizer.ggml.bos_token_id"),
            eos_token_id: id("tokenizer.ggml.eos_token_id"),
            unknown_token_id: id("tokenizer.ggml.unknown_token_id"),
            padding_token_id: id("tokenizer.ggml.padding_token_id"),
            add_bos_token: flag("tokenizer.ggml.add_bos_token"),
            add_eos_token: flag("tokenizer.ggml.add_eos_token"),
            chat_template: self.string("tokenizer.chat_template"),
        })
    }
}
