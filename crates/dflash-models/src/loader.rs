//! Opening a target from a path: an HF model directory or a `.gguf` file.
//!
//! Invariants: the returned model and text assets come from the same checkpoint; an HF directory
//! without tokenizer files still loads (tests drive tiny models by token ids) with `text == None`;
//! all input problems are [`ModelError`]s with `is_bad_input() == true`.

use crate::config::{Architecture, DecoderConfig};
use crate::decoder::Decoder;
use crate::hybrid::HybridDecoder;
use crate::target::TargetModel;
use crate::weights::{safetensors_files, safetensors_var_builder, GgufFile};
use crate::{ModelError, Result};
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use dflash_text::TextAssets;
use std::path::{Path, PathBuf};

pub struct LoadedTarget {
    pub model: Box<dyn TargetModel>,
    pub config: DecoderConfig,
    pub text: Option<TextAssets>,
    /// Token ids that end generation (tokenizer / generation_config / config, deduplicated).
    pub eos_token_ids: Vec<u32>,
    pub source: PathBuf,
}

/// Reads `dir/config.json` as `T`; `what` names the file in errors.
pub(crate) fn read_json_config<T: serde::de::DeserializeOwned>(
    dir: &Path,
    what: &str,
) -> Result<(T, PathBuf)> {
    let path = dir.join("config.json");
    if !path.is_file() {
        return Err(ModelError::MissingFile {
            path,
            what: what.into(),
        });
    }
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::Io {
        path: path.clone(),
        source: e,
    })?;
    let cfg = serde_json::from_str(&text).map_err(|e| ModelError::Config {
        path: path.clone(),
        msg: e.to_string(),
    })?;
    Ok((cfg, path))
}

/// Reads and validates `config.json` of an HF directory (a multimodal checkpoint's
/// `text_config`, see [`crate::config::flatten_text_config`]).
pub fn read_config(dir: &Path) -> Result<DecoderConfig> {
    let (raw, path): (serde_json::Value, _) = read_json_config(dir, "model config")?;
    let cfg: DecoderConfig = serde_json::from_value(crate::config::flatten_text_config(raw))
        .map_err(|e| ModelError::Config {
            path: path.clone(),
            msg: e.to_string(),
        })?;
    cfg.validate()
        .map_err(|msg| ModelError::Config { path, msg })?;
    Ok(cfg)
}

pub fn load_target(path: &Path, device: &Device, dtype: DType) -> Result<LoadedTarget> {
    if !path.exists() {
        return Err(ModelError::MissingFile {
            path: path.to_path_buf(),
            what: "target: an HF model directory or a .gguf file".into(),
        });
    }
    if path.is_dir() {
        load_hf_dir(path, device, dtype)
    } else {
        load_gguf(path, device, dtype)
    }
}

/// Every weight of the target at `path` by its Hugging Face name, f32 on the CPU (for starting a
/// drafter from the target's own layers; the model built by [`load_target`] does not keep names).
pub fn target_tensors(
    path: &Path,
) -> Result<std::collections::HashMap<String, candle_core::Tensor>> {
    if !path.exists() {
        return Err(ModelError::MissingFile {
            path: path.to_path_buf(),
            what: "target: an HF model directory or a .gguf file".into(),
        });
    }
    if path.is_dir() {
        let mut out = std::collections::HashMap::new();
        for f in safetensors_files(path)? {
            for (k, v) in candle_core::safetensors::load(&f, &Device::Cpu)? {
                out.insert(k, v.to_dtype(DType::F32)?);
            }
        }
        return Ok(out);
    }
    let gguf = GgufFile::open(path)?;
    let cfg = gguf.decoder_config()?;
    gguf.hf_tensors(&cfg, DType::F32, &Device::Cpu)
}

fn load_hf_dir(dir: &Path, device: &Device, dtype: DType) -> Result<LoadedTarget> {
    let cfg = read_config(dir)?;
    let arch = cfg
        .architecture()
        .map_err(|arch| ModelError::UnknownArchitecture {
            path: dir.join("config.json"),
            arch,
        })?;
    let files = safetensors_files(dir)?;
    let vb = safetensors_var_builder(&files, dtype, device)?;
    let model = build(&cfg, arch, vb, &files[0])?;
    let text = if dir.join("tokenizer.json").is_file() {
        Some(TextAssets::from_hf_dir(dir)?)
    } else {
        None
    };
    let mut eos = text
        .as_ref()
        .map(|t| t.eos_token_ids.clone())
        .unwrap_or_default();
    eos.extend(crate::config::token_ids(&cfg.eos_token_id));
    finish(model, cfg, text, eos, dir)
}

fn load_gguf(path: &Path, device: &Device, dtype: DType) -> Result<LoadedTarget> {
    let gguf = GgufFile::open(path)?;
    let cfg = gguf.decoder_config()?;
    cfg.validate().map_err(|msg| ModelError::Config {
        path: path.to_path_buf(),
        msg,
    })?;
    let arch = gguf.architecture()?;
    let tensors = gguf.hf_tensors(&cfg, dtype, device)?;
    let vb = VarBuilder::from_tensors(tensors, dtype, device);
    let model = build(&cfg, arch, vb, path)?;
    let text = TextAssets::from_gguf_vocab(&gguf.vocab()?)?;
    let mut eos = text.eos_token_ids.clone();
    eos.extend(crate::config::token_ids(&cfg.eos_token_id));
    finish(model, cfg, Some(text), eos, path)
}

fn build(
    cfg: &DecoderConfig,
    arch: Architecture,
    vb: VarBuilder,
    path: &Path,
) -> Result<Box<dyn TargetModel>> {
    let model = match arch {
        Architecture::Qwen35 => {
            HybridDecoder::new(cfg, vb).map(|m| Box::new(m) as Box<dyn TargetModel>)
        }
        _ => Decoder::new(cfg, arch, vb).map(|m| Box::new(m) as Box<dyn TargetModel>),
    };
    model.map_err(|e| match e {
        ModelError::Candle(c) => ModelError::Weight {
            path: path.to_path_buf(),
            name: "(see message)".into(),
            msg: c.to_string(),
        },
        other => other,
    })
}

fn finish(
    model: Box<dyn TargetModel>,
    config: DecoderConfig,
    text: Option<TextAssets>,
    mut eos: Vec<u32>,
    source: &Path,
) -> Result<LoadedTarget> {
    let mut seen = std::collections::HashSet::new();
    eos.retain(|e| seen.insert(*e));
    Ok(LoadedTarget {
        model,
        config,
        text,
        eos_token_ids: eos,
        source: source.to_path_buf(),
    })
}
