//! GGUF architecture names, and Qwen3.5 / Qwen3.6 dense hybrids from GGUF: llama.cpp's
//! architecture `qwen35`, as its converter writes them (`convert_hf_to_gguf.py`:
//! `Qwen3_5TextModel` over `_LinearAttentionVReorderBase` over `Qwen3NextModel`).
//!
//! Invariants:
//! - `general.architecture` `llama`, `qwen3` and `qwen35` load; `qwen35moe`, `qwen3next` and other
//!   mixture-of-experts names are refused by name ([`ModelError::UnsupportedGguf`]), never guessed.
//! - The config is the one transformers' `Qwen3_5TextConfig` has for the converted checkpoint:
//!   `num_hidden_layers` is `block_count` less the MTP layers (`nextn_predict_layers`),
//!   `layer_types` comes from `attention.recurrent_layers` (else `full_attention_interval`, default
//!   4), the Gated DeltaNet shape from `ssm.*` (`conv_kernel`, `state_size` = key head dim,
//!   `group_count` = key heads, `time_step_rank` = value heads, `inner_size` = value heads × value
//!   head dim), the partial rotary factor from `rope.dimension_count / attention.key_length`, the
//!   vocabulary from `token_embd`; f32 metadata floats read as their shortest decimal (1e-6, not
//!   9.99999997e-7). MTP-only files (llama.cpp's `--mtp` export) are refused.
//! - Every tensor reaches the model under its HF name with the checkpoint's values: the converter's
//!   transforms are undone — decoder, q/k and final norms −1 (the gated DeltaNet norm is stored
//!   as is); `ssm_a = −exp(A_log)` back to `A_log`; `ssm_conv1d` `[C, K]` back to `[C, 1, K]`;
//!   value heads from llama.cpp's tiled order back to grouped-by-key-head order in the V rows of
//!   `in_proj_qkv`, `in_proj_z`, `in_proj_a`, `in_proj_b`, `A_log`, `dt_bias`, the V channels of
//!   the conv and the columns of `out_proj`; a full-attention `attn_qkv` (`--fuse-qkv`) split back
//!   into `q_proj` (with its interleaved gate, which the converter leaves as is), `k_proj`,
//!   `v_proj`. MTP layers are skipped; any other tensor not known here is an error, never dropped.

use crate::config::{Architecture, DecoderConfig};
use crate::gated_deltanet::DeltaNetShape;
use crate::gguf::{float, int};
use crate::weights::GgufFile;
use crate::{ModelError, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// The architecture of a GGUF's `general.architecture`.
pub fn gguf_architecture(path: &Path, name: &str) -> Result<Architecture> {
    let refuse = |why: &str| {
        Err(ModelError::UnsupportedGguf {
            path: path.to_path_buf(),
            arch: name.to_string(),
            why: why.to_string(),
        })
    };
    match name {
        "llama" => Ok(Architecture::Llama),
        "qwen3" => Ok(Architecture::Qwen3),
        "qwen35" => Ok(Architecture::Qwen35),
        "qwen35moe" => refuse("Qwen3.5 / Qwen3.6 mixture-of-experts hybrids are not supported"),
        "qwen3next" => refuse("Qwen3-Next (a mixture-of-experts hybrid) is not supported"),
        "qwen3moe" | "qwen2moe" | "llama4" | "mixtral" => {
            refuse("mixture-of-experts models are not supported")
        }
        other => match Architecture::from_model_type(other) {
            Some(a @ (Architecture::Llama | Architecture::Qwen3)) => Ok(a),
            _ => refuse("unknown architecture"),
        },
    }
}

/// A float as written: f32 values as their shortest decimal, the value the converter was given.
fn decimal(v: &Value) -> Option<f64> {
    match v {
        Value::F32(x) => format!("{x}").parse().ok(),
        other => float(other),
    }
}

impl GgufFile {
    fn bad(&self, msg: impl Into<String>) -> ModelError {
        ModelError::Config {
            path: self.path.clone(),
            msg: msg.into(),
        }
    }

    /// The hybrid fields of a `qwen35` file on top of the dense part `cfg` read from the same keys.
    pub(crate) fn hybrid_decoder_config(&self, mut cfg: DecoderConfig) -> Result<DecoderConfig> {
        let a = self.architecture_name()?;
        let key = |k: &str| format!("{a}.{k}");
        let tensors = &self.content.tensor_infos;
        let blocks = cfg.num_hidden_layers;
        let nextn = self
            .get(&key("nextn_predict_layers"))
            .and_then(int)
            .unwrap_or(0) as usize;
        if nextn > 0 && (nextn >= blocks || !tensors.contains_key("blk.0.attn_norm.weight")) {
            return Err(self.bad(
                "an MTP-only GGUF (llama.cpp's --mtp export, no trunk layers) is a draft head, \
                 not a target model",
            ));
        }
        let layers = blocks - nextn;
        if let Some(info) = tensors.get("token_embd.weight") {
            cfg.vocab_size = info.shape.dims()[0];
        }

        let value_heads = self.need_int(&key("ssm.time_step_rank"))?;
        let inner = self.need_int(&key("ssm.inner_size"))?;
        if value_heads == 0 || !inner.is_multiple_of(value_heads) {
            return Err(self.bad(format!(
                "'{a}.ssm.inner_size' {inner} is not a multiple of '{a}.ssm.time_step_rank' \
                 {value_heads}"
            )));
        }
        let recurrent: Vec<bool> = match self.get(&key("attention.recurrent_layers")) {
            Some(Value::Array(v)) => {
                let flags: Option<Vec<bool>> = v
                    .iter()
                    .map(|x| match x {
                        Value::Bool(b) => Some(*b),
                        other => int(other).map(|i| i != 0),
                    })
                    .collect();
                match flags {
                    Some(f) if f.len() >= layers => f[..layers].to_vec(),
                    _ => {
                        return Err(self.bad(format!(
                            "'{a}.attention.recurrent_layers' is not {layers} booleans"
                        )))
                    }
                }
            }
            Some(_) => {
                return Err(self.bad(format!("'{a}.attention.recurrent_layers' is not an array")))
            }
            None => {
                let every = self
                    .get(&key("full_attention_interval"))
                    .and_then(int)
                    .unwrap_or(4)
                    .max(1) as usize;
                (0..layers).map(|i| (i + 1) % every != 0).collect()
            }
        };

        let head_dim = cfg.head_dim();
        let rotary = self
            .get(&key("rope.dimension_count"))
            .and_then(int)
            .map(|x| x as usize)
            .unwrap_or(head_dim / 4);
        let partial = rotary as f64 / head_dim as f64;
        if let Some(kind) = self.string(&key("rope.scaling.type")) {
            if kind != "none" {
                return Err(self.bad(format!(
                    "rope scaling '{kind}' in a {a} GGUF is not supported"
                )));
            }
        }
        let theta = self
            .get(&key("rope.freq_base"))
            .and_then(decimal)
            .unwrap_or(10_000.0);
        let mut rope = serde_json::json!({
            "rope_type": "default",
            "rope_theta": theta,
            "partial_rotary_factor": partial,
        });
        // text-only positions are equal on all three axes: the sections do not change the math
        if let Some(Value::Array(s)) = self.get(&key("rope.dimension_sections")) {
            let s: Vec<u64> = s.iter().filter_map(int).take(3).collect();
            rope["mrope_section"] = serde_json::json!(s);
            rope["mrope_interleaved"] = serde_json::json!(true);
        }

        cfg.model_type = Some("qwen3_5_text".into());
        cfg.num_hidden_layers = layers;
        cfg.hidden_act = Some("silu".into());
        cfg.rope_theta = Some(theta);
        cfg.rope_parameters = Some(rope);
        if let Some(eps) = self
            .get(&key("attention.layer_norm_rms_epsilon"))
            .and_then(decimal)
        {
            cfg.rms_norm_eps = eps;
        }
        let h = &mut cfg.hybrid;
        h.layer_types = Some(
            recurrent
                .iter()
                .map(|&r| {
                    if r {
                        "linear_attention"
                    } else {
                        "full_attention"
                    }
                    .to_string()
                })
                .collect(),
        );
        h.linear_conv_kernel_dim = Some(self.need_int(&key("ssm.conv_kernel"))?);
        h.linear_key_head_dim = Some(self.need_int(&key("ssm.state_size"))?);
        h.linear_num_key_heads = Some(self.need_int(&key("ssm.group_count"))?);
        h.linear_num_value_heads = Some(value_heads);
        h.linear_value_head_dim = Some(inner / value_heads);
        h.partial_rotary_factor = Some(partial);
        // llama.cpp's qwen35 graph always splits a gate off q (`attn_q` is 2 × heads × head_dim)
        h.attn_output_gate = Some(true);
        Ok(cfg)
    }

    /// Every trunk tensor of a `qwen35` file, dequantised, under its HF name with the
    /// checkpoint's values (the converter's transforms undone, see the module doc).
    pub(crate) fn hybrid_hf_tensors(
        &self,
        cfg: &DecoderConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<HashMap<String, Tensor>> {
        let mut f = std::fs::File::open(&self.path).map_err(|e| ModelError::Io {
            path: self.path.clone(),
            source: e,
        })?;
        let recurrent = cfg.recurrent_layers();
        let shape = cfg.delta_net_shape();
        let mut out = HashMap::new();
        for name in self.content.tensor_infos.keys() {
            let weight_err = |msg: String| ModelError::Weight {
                path: self.path.clone(),
                name: name.clone(),
                msg,
            };
            let Some(place) = place(name, &recurrent).map_err(weight_err)? else {
                continue;
            };
            let t = self.dequantized(&mut f, name)?;
            let undone = undo(place, t, cfg, &shape).map_err(|e| weight_err(e.to_string()))?;
            for (hf, t) in undone {
                out.insert(hf, t.to_dtype(dtype)?.to_device(device)?);
            }
        }
        Ok(out)
    }
}

/// Where a GGUF tensor goes, and which of the converter's transforms to undo.
#[derive(Debug, PartialEq)]
enum Place {
    /// Stored as is.
    Plain(String),
    /// A zero-centred norm the converter stored as `1 + w`.
    Norm(String),
    /// A full-attention `attn_qkv` of `--fuse-qkv`, at layer `i`.
    FusedQkv(usize),
    /// A Gated DeltaNet tensor at layer `i`: `model.layers.{i}.linear_attn.{HF name}`.
    Linear(usize, Linear),
}

#[derive(Debug, PartialEq, Clone, Copy)]
enum Linear {
    Qkv,
    Z,
    A,
    B,
    Conv,
    DtBias,
    ALog,
    Norm,
    Out,
}

impl Linear {
    fn hf(self) -> &'static str {
        match self {
            Self::Qkv => "in_proj_qkv.weight",
            Self::Z => "in_proj_z.weight",
            Self::A => "in_proj_a.weight",
            Self::B => "in_proj_b.weight",
            Self::Conv => "conv1d.weight",
            Self::DtBias => "dt_bias",
            Self::ALog => "A_log",
            Self::Norm => "norm.weight",
            Self::Out => "out_proj.weight",
        }
    }
}

/// The place of GGUF tensor `name` in a model whose layer `i` is recurrent when `recurrent[i]`;
/// `None` for the MTP layers past the trunk; an error for a tensor this module does not know.
fn place(name: &str, recurrent: &[bool]) -> std::result::Result<Option<Place>, String> {
    match name {
        "token_embd.weight" => return Ok(Some(Place::Plain("model.embed_tokens.weight".into()))),
        "output.weight" => return Ok(Some(Place::Plain("lm_head.weight".into()))),
        "output_norm.weight" => return Ok(Some(Place::Norm("model.norm.weight".into()))),
        _ => {}
    }
    let unknown = || format!("not a tensor of a llama.cpp qwen35 model (read: {name})");
    let rest = name.strip_prefix("blk.").ok_or_else(unknown)?;
    let (layer, tail) = rest.split_once('.').ok_or_else(unknown)?;
    let i: usize = layer.parse().map_err(|_| unknown())?;
    let Some(&rec) = recurrent.get(i) else {
        return Ok(None); // an MTP layer
    };
    let hf = |t: &str| format!("model.layers.{i}.{t}");
    let plain = |t: &str| Ok(Some(Place::Plain(hf(t))));
    let norm = |t: &str| Ok(Some(Place::Norm(hf(t))));
    let linear = |l: Linear| Ok(Some(Place::Linear(i, l)));
    match (tail, rec) {
        ("attn_norm.weight", _) => norm("input_layernorm.weight"),
        ("post_attention_norm.weight", _) => norm("post_attention_layernorm.weight"),
        ("ffn_gate.weight", _) => plain("mlp.gate_proj.weight"),
        ("ffn_up.weight", _) => plain("mlp.up_proj.weight"),
        ("ffn_down.weight", _) => plain("mlp.down_proj.weight"),
        ("attn_q.weight", false) => plain("self_attn.q_proj.weight"),
        ("attn_k.weight", false) => plain("self_attn.k_proj.weight"),
        ("attn_v.weight", false) => plain("self_attn.v_proj.weight"),
        ("attn_output.weight", false) => plain("self_attn.o_proj.weight"),
        ("attn_q_norm.weight", false) => norm("self_attn.q_norm.weight"),
        ("attn_k_norm.weight", false) => norm("self_attn.k_norm.weight"),
        ("attn_qkv.weight", false) => Ok(Some(Place::FusedQkv(i))),
        ("attn_qkv.weight", true) => linear(Linear::Qkv),
        ("attn_gate.weight", true) => linear(Linear::Z),
        ("ssm_alpha.weight", true) => linear(Linear::A),
        ("ssm_beta.weight", true) => linear(Linear::B),
        ("ssm_conv1d.weight", true) => linear(Linear::Conv),
        ("ssm_dt.bias", true) => linear(Linear::DtBias),
        ("ssm_a", true) => linear(Linear::ALog),
        ("ssm_norm.weight", true) => linear(Linear::Norm),
        ("ssm_out.weight", true) => linear(Linear::Out),
        (_, rec) => Err(format!(
            "not a tensor of a llama.cpp qwen35 {} layer",
            if rec {
                "linear-attention"
            } else {
                "full-attention"
            }
        )),
    }
}

/// Undoes llama.cpp's value-head reorder along `dim` (value heads × `head_dim` entries): the
/// converter views them as `[key heads, value heads per key head, head_dim]` and swaps the first
/// two axes (tiled order for ggml's broadcast); this swaps them back.
fn untile_value_heads(
    t: &Tensor,
    dim: usize,
    s: &DeltaNetShape,
    head_dim: usize,
) -> candle_core::Result<Tensor> {
    let per_key = s.value_heads / s.key_heads;
    if per_key == 1 {
        return Ok(t.clone());
    }
    let dims = t.dims().to_vec();
    let mut split = dims[..dim].to_vec();
    split.extend([per_key, s.key_heads, head_dim]);
    split.extend(&dims[dim + 1..]);
    t.reshape(split)?
        .transpose(dim, dim + 1)?
        .contiguous()?
        .reshape(dims)
}

/// `t` with rows `[q; k; v]` (q and k `key heads × key dim` rows each) and its v rows untiled.
fn untile_v_rows(t: &Tensor, s: &DeltaNetShape) -> candle_core::Result<Tensor> {
    let qk = 2 * s.key_heads * s.key_dim;
    let rows = t.dim(0)?;
    if rows < qk {
        candle_core::bail!("{rows} rows, fewer than q and k's {qk}");
    }
    let v = untile_value_heads(&t.narrow(0, qk, rows - qk)?, 0, s, s.value_dim)?;
    Tensor::cat(&[&t.narrow(0, 0, qk)?, &v], 0)
}

/// The HF tensors a GGUF tensor at `place` stands for, with their checkpoint values.
fn undo(
    place: Place,
    t: Tensor,
    cfg: &DecoderConfig,
    s: &DeltaNetShape,
) -> candle_core::Result<Vec<(String, Tensor)>> {
    Ok(match place {
        Place::Plain(hf) => vec![(hf, t)],
        Place::Norm(hf) => vec![(hf, (t - 1.0)?)],
        Place::FusedQkv(i) => {
            let hd = cfg.head_dim();
            let gate = if cfg.attn_output_gate() { 2 } else { 1 };
            let (q, kv) = (cfg.num_attention_heads * hd * gate, cfg.num_kv_heads() * hd);
            let rows = t.dim(0)?;
            if rows != q + 2 * kv {
                candle_core::bail!("fused attn_qkv has {rows} rows, not q {q} + k {kv} + v {kv}");
            }
            let at = |p: &str| format!("model.layers.{i}.self_attn.{p}.weight");
            vec![
                (at("q_proj"), t.narrow(0, 0, q)?),
                (at("k_proj"), t.narrow(0, q, kv)?),
                (at("v_proj"), t.narrow(0, q + kv, kv)?),
            ]
        }
        Place::Linear(i, l) => {
            let t = match l {
                Linear::Qkv => untile_v_rows(&t, s)?,
                Linear::Z => untile_value_heads(&t, 0, s, s.value_dim)?,
                Linear::A | Linear::B | Linear::DtBias => untile_value_heads(&t, 0, s, 1)?,
                Linear::ALog => {
                    let v = t.flatten_all()?.to_vec1::<f32>()?;
                    if !v.iter().all(|x| *x < 0.0) {
                        candle_core::bail!("ssm_a holds -exp(A_log) and must be negative");
                    }
                    untile_value_heads(&t.neg()?.log()?, 0, s, 1)?
                }
                Linear::Conv => {
                    // llama.cpp squeezes `[C, 1, K]` to `[C, K]`; accept either
                    let (c, k) = (t.dim(0)?, *t.dims().last().unwrap_or(&0));
                    untile_v_rows(&t.reshape((c, k))?, s)?.reshape((c, 1, k))?
                }
                Linear::Norm => t,
                Linear::Out => untile_value_heads(&t, 1, s, s.value_dim)?,
            };
            vec![(format!("model.layers.{i}.linear_attn.{}", l.hf()), t)]
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_layer_kind_and_mtp_layers_are_skipped() {
        let rec = [true, false];
        let p = |n: &str| place(n, &rec);
        assert_eq!(
            p("blk.0.attn_qkv.weight"),
            Ok(Some(Place::Linear(0, Linear::Qkv)))
        );
        assert_eq!(p("blk.1.attn_qkv.weight"), Ok(Some(Place::FusedQkv(1))));
        assert_eq!(p("blk.0.ssm_a"), Ok(Some(Place::Linear(0, Linear::ALog))));
        assert_eq!(
            p("blk.1.attn_q_norm.weight"),
            Ok(Some(Place::Norm(
                "model.layers.1.self_attn.q_norm.weight".into()
            )))
        );
        assert_eq!(p("blk.2.nextn.eh_proj.weight"), Ok(None));
        assert!(p("blk.1.ssm_a").is_err());
        assert!(p("blk.0.attn_q.weight").is_err());
        assert!(p("blk.0.ssm_ba.weight").is_err());
        assert!(p("rope_freqs.weight").is_err());
    }

    #[test]
    fn untiling_inverts_the_converters_reorder() {
        // the converter: [key heads, per key, d] -> [per key, key heads, d]
        let s = DeltaNetShape {
            hidden: 4,
            key_heads: 2,
            value_heads: 6,
            key_dim: 1,
            value_dim: 2,
            conv_kernel: 1,
        };
        let orig: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let grouped = Tensor::from_vec(orig.clone(), (12, 1), &Device::Cpu).unwrap();
        let tiled = grouped
            .reshape((2, 3, 2, 1))
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((12, 1))
            .unwrap();
        let back = untile_value_heads(&tiled, 0, &s, 2).unwrap();
        assert_eq!(back.flatten_all().unwrap().to_vec1::<f32>().unwrap(), orig);
    }
}
