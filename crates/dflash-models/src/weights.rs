//! Weight sources: a Hugging Face directory of (sharded) safetensors, or a GGUF file whose tensors
//! are dequantised at load and renamed to the Hugging Face names.
//!
//! Invariants: every tensor reaches the model under its HF checkpoint name and in the requested
//! dtype; llama.cpp's q/k row permutation for Llama GGUFs is undone, so both sources give the same
//! math (Qwen3.5 / Qwen3.6 hybrids: [`crate::gguf_hybrid`] undoes the converter's transforms); a
//! truncated or corrupt file is a [`ModelError::Corrupt`] naming the path.

use crate::config::{Architecture, DecoderConfig};
use crate::{ModelError, Result};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The safetensors files of an HF directory: `model.safetensors`, or the shards listed by
/// `model.safetensors.index.json`.
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(ModelError::MissingFile {
            path: single,
            what: "model.safetensors or model.safetensors.index.json".into(),
        });
    }
    let text = std::fs::read_to_string(&index).map_err(|e| ModelError::Io {
        path: index.clone(),
        source: e,
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Corrupt {
        path: index.clone(),
        msg: e.to_string(),
    })?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| ModelError::Corrupt {
            path: index.clone(),
            msg: "no weight_map object".into(),
        })?;
    let mut files: Vec<String> = map
        .values()
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
    files.sort();
    files.dedup();
    let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
    for p in &paths {
        if !p.is_file() {
            return Err(ModelError::MissingFile {
                path: p.clone(),
                what: "shard listed in the index".into(),
            });
        }
    }
    Ok(paths)
}

/// A VarBuilder over memory-mapped safetensors; headers are validated up front.
pub fn safetensors_var_builder(
    files: &[PathBuf],
    dtype: DType,
    device: &Device,
) -> Result<VarBuilder<'static>> {
    for p in files {
        check_safetensors(p)?;
    }
    // SAFETY: the files are not modified while mapped (we never write model files in place).
    unsafe { VarBuilder::from_mmaped_safetensors(files, dtype, device) }.map_err(|e| {
        ModelError::Corrupt {
            path: files.first().cloned().unwrap_or_default(),
            msg: e.to_string(),
        }
    })
}

/// Validates a safetensors header and that the data section is as long as the header says.
pub fn check_safetensors(path: &Path) -> Result<()> {
    let file = std::fs::File::open(path).map_err(|e| ModelError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    // SAFETY: read-only map of a file we do not modify.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    safetensors::SafeTensors::deserialize(&mmap)
        .map(|_| ())
        .map_err(|e| ModelError::Corrupt {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })
}

/// An opened GGUF file: metadata plus tensor directory.
pub struct GgufFile {
    pub path: PathBuf,
    pub content: gguf_file::Content,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(ModelError::MissingFile {
                path: path.to_path_buf(),
                what: "GGUF file".into(),
            });
        }
        let mut f = std::fs::File::open(path).map_err(|e| ModelError::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        let content = gguf_file::Content::read(&mut f).map_err(|e| ModelError::Corrupt {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        let len = f
            .metadata()
            .map_err(|e| ModelError::Io {
                path: path.to_path_buf(),
                source: e,
            })?
            .len();
        for (name, info) in &content.tensor_infos {
            let bytes = info.shape.elem_count() / info.ggml_dtype.block_size()
                * info.ggml_dtype.type_size();
            let end = content.tensor_data_offset + info.offset + bytes as u64;
            if end > len {
                return Err(ModelError::Corrupt {
                    path: path.to_path_buf(),
                    msg: format!("tensor '{name}' ends at byte {end} but the file has {len} bytes"),
                });
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            content,
        })
    }

    pub fn metadata(&self) -> &HashMap<String, gguf_file::Value> {
        &self.content.metadata
    }

    /// Tensor `name` dequantised to f32 on the CPU; `f` is this file, open.
    pub(crate) fn dequantized(&self, f: &mut std::fs::File, name: &str) -> Result<Tensor> {
        let corrupt = |e: candle_core::Error| ModelError::Corrupt {
            path: self.path.clone(),
            msg: format!("tensor '{name}': {e}"),
        };
        let q = self
            .content
            .tensor(f, name, &Device::Cpu)
            .map_err(corrupt)?;
        q.dequantize(&Device::Cpu).map_err(corrupt)
    }

    /// Dequantises every tensor to `dtype` under its Hugging Face name (`cfg` is
    /// [`GgufFile::decoder_config`]'s).
    pub fn hf_tensors(
        &self,
        cfg: &DecoderConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<HashMap<String, Tensor>> {
        let arch = self.architecture()?;
        if arch == Architecture::Qwen35 {
            return self.hybrid_hf_tensors(cfg, dtype, device);
        }
        let (n_heads, n_kv_heads) = (cfg.num_attention_heads, cfg.num_kv_heads());
        let mut f = std::fs::File::open(&self.path).map_err(|e| ModelError::Io {
            path: self.path.clone(),
            source: e,
        })?;
        let mut out = HashMap::new();
        for name in self.content.tensor_infos.keys() {
            let Some(hf) = hf_name(name) else { continue };
            let mut t = self.dequantized(&mut f, name)?;
            if arch == Architecture::Llama {
                if name.ends_with("attn_q.weight") {
                    t = unpermute_rows(&t, n_heads)?;
                } else if name.ends_with("attn_k.weight") {
                    t = unpermute_rows(&t, n_kv_heads)?;
                }
            }
            out.insert(hf, t.to_dtype(dtype)?.to_device(device)?);
        }
        Ok(out)
    }
}

/// Undoes llama.cpp's `permute` of q/k projection rows (interleaved rope pairs back to rotate-half).
fn unpermute_rows(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let half = rows / heads / 2;
    Ok(w.reshape((heads, half, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))?)
}

/// GGUF tensor name → Hugging Face checkpoint name.
pub fn hf_name(gguf: &str) -> Option<String> {
    let top = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(t) = top {
        return Some(t.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let hf = match tail {
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "attn_q_norm.weight" => "self_attn.q_norm.weight",
        "attn_k_norm.weight" => "self_attn.k_norm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}
