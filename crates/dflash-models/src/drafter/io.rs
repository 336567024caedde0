//! Loading and saving drafters in the z-lab DFlash format: `config.json` plus `model.safetensors`,
//! or shards `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json` when large.
//!
//! Invariants: every write goes to a temporary file in the destination directory and is renamed
//! into place (a crash never leaves a half-written checkpoint); shards never exceed the requested
//! byte limit unless one tensor alone does; tensor names are exactly the reference names.

use super::config::{default_target_layers, DFlashConfig, DFlashSection};
use super::model::DFlashDrafter;
use crate::loader::LoadedTarget;
use crate::weights::{safetensors_files, safetensors_var_builder};
use crate::{ModelError, Result};
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::path::Path;

/// Loads a drafter directory onto `device` in `dtype`.
pub fn load_drafter(dir: &Path, device: &Device, dtype: DType) -> Result<DFlashDrafter> {
    let (cfg, path): (DFlashConfig, _) = crate::loader::read_json_config(dir, "drafter config")?;
    let cfg = cfg.resolved();
    cfg.validate()
        .map_err(|msg| ModelError::Config { path, msg })?;
    let files = safetensors_files(dir)?;
    let vb = safetensors_var_builder(&files, dtype, device)?;
    DFlashDrafter::new(&cfg, vb).map_err(|e| match e {
        ModelError::Candle(c) => ModelError::Weight {
            path: dir.to_path_buf(),
            name: "(see message)".into(),
            msg: c.to_string(),
        },
        other => other,
    })
}

/// Every parameter of a drafter with this config: (reference name, shape).
pub fn parameter_shapes(cfg: &DFlashConfig) -> Vec<(String, Vec<usize>)> {
    let (h, hd, i) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    let t = cfg.target_layer_ids().len();
    let mut p = vec![
        ("fc.weight".to_string(), vec![h, t * h]),
        ("hidden_norm.weight".to_string(), vec![h]),
        ("norm.weight".to_string(), vec![h]),
    ];
    for l in 0..cfg.num_hidden_layers {
        let n = |s: &str| format!("layers.{l}.{s}");
        p.extend([
            (n("input_layernorm.weight"), vec![h]),
            (n("post_attention_layernorm.weight"), vec![h]),
            (n("self_attn.q_proj.weight"), vec![nh * hd, h]),
            (n("self_attn.k_proj.weight"), vec![nkv * hd, h]),
            (n("self_attn.v_proj.weight"), vec![nkv * hd, h]),
            (n("self_attn.o_proj.weight"), vec![h, nh * hd]),
            (n("self_attn.q_norm.weight"), vec![hd]),
            (n("self_attn.k_norm.weight"), vec![hd]),
            (n("mlp.gate_proj.weight"), vec![i, h]),
            (n("mlp.up_proj.weight"), vec![i, h]),
            (n("mlp.down_proj.weight"), vec![h, i]),
        ]);
    }
    p
}

/// A drafter config sized for `target` (hidden size, heads, vocabulary from the target).
pub fn config_for_target(
    target: &LoadedTarget,
    layers: usize,
    block_size: usize,
    mask_token_id: u32,
) -> DFlashConfig {
    config_for_decoder(&target.config, layers, block_size, mask_token_id)
}

/// A drafter config sized for a target with config `t` (the z-lab layout: the target's hidden,
/// intermediate and head sizes, taps by [`default_target_layers`]); what [`config_for_target`]
/// returns, for callers with a config and no loaded target (benchmarks at named shapes).
pub fn config_for_decoder(
    t: &crate::DecoderConfig,
    layers: usize,
    block_size: usize,
    mask_token_id: u32,
) -> DFlashConfig {
    let heads = t.num_attention_heads;
    DFlashConfig {
        architectures: vec!["DFlashDraftModel".into()],
        auto_map: Some(serde_json::json!({"AutoModel": "dflash.DFlashDraftModel"})),
        model_type: Some("qwen3".into()),
        block_size,
        num_target_layers: t.num_hidden_layers,
        num_hidden_layers: layers,
        hidden_size: t.hidden_size,
        intermediate_size: t.intermediate_size,
        num_attention_heads: heads,
        num_key_value_heads: t.num_kv_heads(),
        head_dim: t.head_dim(),
        rms_norm_eps: t.rms_norm_eps,
        rope_theta: t.rope().map(|r| r.theta).unwrap_or(1e6),
        rope_scaling: None,
        rope_parameters: None,
        max_position_embeddings: t.max_position_embeddings,
        vocab_size: t.vocab_size,
        tie_word_embeddings: false,
        layer_types: Some(vec!["full_attention".into(); layers]),
        sliding_window: None,
        is_causal: None,
        attention_bias: false,
        dflash_config: DFlashSection {
            mask_token_id: Some(mask_token_id),
            target_layer_ids: Some(default_target_layers(t.num_hidden_layers, layers)),
            ..DFlashSection::default()
        },
        mask_token_id: None,
        target_layer_ids: None,
        dtype: Some("float32".into()),
        input_embedding_scale: None,
        output_multiplier: None,
        final_logit_softcapping: None,
    }
}

/// Random initial weights: N(0, 0.02²) matrices, unit norms; reproducible from `seed`.
pub fn random_weights(cfg: &DFlashConfig, seed: u64) -> Result<BTreeMap<String, Tensor>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut out = BTreeMap::new();
    for (name, shape) in parameter_shapes(cfg) {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = if name.ends_with("norm.weight") {
            vec![1.0; n]
        } else {
            (0..n)
                .map(|_| {
                    // Box–Muller from two uniforms
                    let u1: f32 = rng.random::<f32>().max(1e-12);
                    let u2: f32 = rng.random();
                    0.02 * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
                })
                .collect()
        };
        out.insert(name, Tensor::from_vec(data, shape, &Device::Cpu)?);
    }
    Ok(out)
}

/// Fresh weights for training or a random drafter: [`random_weights`], with the final `norm`
/// starting from the target's final norm (the drafter's output feeds the target's LM head, as the
/// target's normed last layer does; a unit norm there starts training at a very large loss).
pub fn init_weights_for_target(
    cfg: &DFlashConfig,
    target: &dyn crate::TargetModel,
    seed: u64,
) -> Result<BTreeMap<String, Tensor>> {
    let mut w = random_weights(cfg, seed)?;
    if let Some(norm) = target.final_norm() {
        if norm.weight().dims() == [cfg.hidden_size] {
            w.insert(
                "norm.weight".into(),
                norm.weight()
                    .to_dtype(DType::F32)?
                    .to_device(&Device::Cpu)?,
            );
        }
    }
    Ok(w)
}

/// Weights that start from the target's own top layers (`target` by Hugging Face name, as
/// [`crate::target_tensors`] returns them): drafter layer `i` of `L` copies target layer
/// `N − L + i` (attention projections, MLP, both layer norms, and q/k norms where the target has
/// them; else those start at 1); `fc` starts as the identity on the deepest tap and 0 elsewhere,
/// so the context rows enter the first copied layer as that tap; `hidden_norm` copies the first
/// copied layer's input norm and `norm` the target's final norm. Everything else is
/// [`random_weights`]. Errors when a copied tensor's shape differs from the drafter's.
///
/// A Qwen3.5 / Qwen3.6 hybrid (its tensors name `linear_attn` layers) starts from its top `L`
/// *full-attention* layers instead (a Gated DeltaNet layer has no attention to copy): the query
/// rows of each head without its output-gate rows, its zero-centred norms as the effective
/// weights `1 + w` (layer norms, q/k norms, the final norm), text weights under either prefix
/// (`model.` or `model.language_model.`).
pub fn init_from_target_layers(
    cfg: &DFlashConfig,
    target: &std::collections::HashMap<String, Tensor>,
    seed: u64,
) -> Result<BTreeMap<String, Tensor>> {
    if target.keys().any(|k| k.contains(".linear_attn.")) {
        return init_from_hybrid_attention_layers(cfg, target, seed);
    }
    let mut w = random_weights(cfg, seed)?;
    let (n, l) = (cfg.num_target_layers, cfg.num_hidden_layers);
    if l > n {
        return Err(ModelError::Mismatch(format!(
            "a {l}-layer drafter cannot start from a {n}-layer target's top layers"
        )));
    }
    let mut copy = |dst: String, src: String, required: bool| -> Result<()> {
        let Some(t) = target.get(&src) else {
            return if required {
                Err(ModelError::Mismatch(format!(
                    "the target has no tensor {src} to start {dst} from"
                )))
            } else {
                Ok(())
            };
        };
        let want = w.get(&dst).map(|t| t.dims().to_vec()).unwrap_or_default();
        if t.dims() != want.as_slice() {
            return Err(ModelError::Mismatch(format!(
                "target {src} has shape {:?}, drafter {dst} needs {want:?}",
                t.dims()
            )));
        }
        w.insert(dst, t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?);
        Ok(())
    };
    for i in 0..l {
        let j = n - l + i;
        for (name, required) in [
            ("input_layernorm.weight", true),
            ("post_attention_layernorm.weight", true),
            ("self_attn.q_proj.weight", true),
            ("self_attn.k_proj.weight", true),
            ("self_attn.v_proj.weight", true),
            ("self_attn.o_proj.weight", true),
            ("self_attn.q_norm.weight", false),
            ("self_attn.k_norm.weight", false),
            ("mlp.gate_proj.weight", true),
            ("mlp.up_proj.weight", true),
            ("mlp.down_proj.weight", true),
        ] {
            copy(
                format!("layers.{i}.{name}"),
                format!("model.layers.{j}.{name}"),
                required,
            )?;
        }
    }
    copy(
        "hidden_norm.weight".into(),
        format!("model.layers.{}.input_layernorm.weight", n - l),
        true,
    )?;
    copy("norm.weight".into(), "model.norm.weight".into(), true)?;
    w.insert("fc.weight".into(), fc_from_deepest_tap(cfg)?);
    Ok(w)
}

/// [`init_from_target_layers`] for a hybrid target (see there).
fn init_from_hybrid_attention_layers(
    cfg: &DFlashConfig,
    target: &std::collections::HashMap<String, Tensor>,
    seed: u64,
) -> Result<BTreeMap<String, Tensor>> {
    let mut w = random_weights(cfg, seed)?;
    let p = if target.contains_key("model.language_model.embed_tokens.weight") {
        "model.language_model"
    } else {
        "model"
    };
    let mut attention: Vec<usize> = target
        .keys()
        .filter_map(|k| {
            k.strip_prefix(&format!("{p}.layers."))?
                .strip_suffix(".self_attn.q_proj.weight")?
                .parse()
                .ok()
        })
        .collect();
    attention.sort_unstable();
    let l = cfg.num_hidden_layers;
    if l > attention.len() {
        return Err(ModelError::Mismatch(format!(
            "a {l}-layer drafter cannot start from a hybrid target's top full-attention layers:              it has {} ({attention:?})",
            attention.len()
        )));
    }
    let get = |src: &str| -> Result<Tensor> {
        let t = target.get(src).ok_or_else(|| {
            ModelError::Mismatch(format!("the hybrid target has no tensor {src}"))
        })?;
        Ok(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?)
    };
    let mut put = |dst: String, t: Tensor| -> Result<()> {
        let want = w.get(&dst).map(|t| t.dims().to_vec()).unwrap_or_default();
        if t.dims() != want.as_slice() {
            return Err(ModelError::Mismatch(format!(
                "the hybrid target's tensor for {dst} has shape {:?}, the drafter needs {want:?}",
                t.dims()
            )));
        }
        w.insert(dst, t);
        Ok(())
    };
    let (heads, hd) = (cfg.num_attention_heads, cfg.head_dim);
    let top = &attention[attention.len() - l..];
    for (i, &j) in top.iter().enumerate() {
        let src = |name: &str| format!("{p}.layers.{j}.{name}");
        let dst = |name: &str| format!("layers.{i}.{name}");
        // q_proj rows: per head hd query rows, then (gated attention) hd gate rows
        let q = get(&src("self_attn.q_proj.weight"))?;
        let q = if q.dim(0)? == 2 * heads * hd {
            q.reshape((heads, 2, hd, ()))?
                .narrow(1, 0, 1)?
                .reshape((heads * hd, ()))?
        } else {
            q
        };
        put(dst("self_attn.q_proj.weight"), q)?;
        for name in [
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ] {
            put(dst(name), get(&src(name))?)?;
        }
        for name in [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
        ] {
            put(dst(name), (get(&src(name))? + 1.0)?)?;
        }
    }
    put(
        "hidden_norm.weight".into(),
        (get(&format!("{p}.layers.{}.input_layernorm.weight", top[0]))? + 1.0)?,
    )?;
    put(
        "norm.weight".into(),
        (get(&format!("{p}.norm.weight"))? + 1.0)?,
    )?;
    w.insert("fc.weight".into(), fc_from_deepest_tap(cfg)?);
    Ok(w)
}

/// `fc` `[H, T·H]` as the identity on the deepest tap and 0 elsewhere: the context rows enter the
/// first layer copied from the target as that tap.
fn fc_from_deepest_tap(cfg: &DFlashConfig) -> Result<Tensor> {
    let (h, taps) = (cfg.hidden_size, cfg.target_layer_ids().len());
    let mut fc = vec![0f32; h * taps * h];
    for r in 0..h {
        fc[r * taps * h + (taps - 1) * h + r] = 1.0;
    }
    Ok(Tensor::from_vec(fc, (h, taps * h), &Device::Cpu)?)
}

/// The weights of the drafter saved in `dir` (z-lab format), f32 on the CPU, to continue
/// training from (a warm start: the optimizer and schedule start fresh). Errors unless its config
/// has `cfg`'s layers, block size, taps and parameter shapes.
pub fn warm_start_weights(dir: &Path, cfg: &DFlashConfig) -> Result<BTreeMap<String, Tensor>> {
    let (saved, path): (DFlashConfig, _) = crate::loader::read_json_config(dir, "drafter config")?;
    let saved = saved.resolved();
    let same = saved.num_hidden_layers == cfg.num_hidden_layers
        && saved.block_size == cfg.block_size
        && saved.hidden_size == cfg.hidden_size
        && saved.target_layer_ids() == cfg.target_layer_ids();
    if !same {
        return Err(ModelError::Mismatch(format!(
            "{}: {} layers, block {}, hidden {}, taps {:?}; this run wants {} layers, block {}, \
             hidden {}, taps {:?}",
            path.display(),
            saved.num_hidden_layers,
            saved.block_size,
            saved.hidden_size,
            saved.target_layer_ids(),
            cfg.num_hidden_layers,
            cfg.block_size,
            cfg.hidden_size,
            cfg.target_layer_ids()
        )));
    }
    let mut w = BTreeMap::new();
    for f in safetensors_files(dir)? {
        for (k, v) in candle_core::safetensors::load(&f, &Device::Cpu)? {
            w.insert(k, v.to_dtype(DType::F32)?);
        }
    }
    for (name, shape) in parameter_shapes(cfg) {
        match w.get(&name) {
            Some(t) if t.dims() == shape.as_slice() => {}
            Some(t) => {
                return Err(ModelError::Mismatch(format!(
                    "{}: {name} has shape {:?}, expected {shape:?}",
                    dir.display(),
                    t.dims()
                )))
            }
            None => {
                return Err(ModelError::Mismatch(format!(
                    "{}: no tensor {name}",
                    dir.display()
                )))
            }
        }
    }
    Ok(w)
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    dflash_core::fs::write_atomic(path, bytes).map_err(|e| ModelError::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

/// Saves config + weights in the z-lab layout, sharding above `shard_bytes`.
pub fn save_drafter(
    dir: &Path,
    cfg: &DFlashConfig,
    weights: &BTreeMap<String, Tensor>,
    shard_bytes: usize,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::Io {
        path: dir.to_path_buf(),
        source: e,
    })?;
    let mut shards: Vec<Vec<(&String, &Tensor)>> = vec![vec![]];
    let mut size = 0usize;
    for (name, t) in weights {
        let bytes = t.elem_count() * t.dtype().size_in_bytes();
        if size > 0 && size + bytes > shard_bytes {
            shards.push(vec![]);
            size = 0;
        }
        shards.last_mut().expect("non-empty").push((name, t));
        size += bytes;
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
        };
        let map: std::collections::HashMap<String, Tensor> = shard
            .iter()
            .map(|(k, v)| ((*k).clone(), (*v).clone()))
            .collect();
        let dest = dir.join(&file);
        dflash_core::fs::write_atomic_with(&dest, |tmp| {
            candle_core::safetensors::save(&map, tmp).map_err(std::io::Error::other)
        })
        .map_err(|e| ModelError::Io {
            path: dest.clone(),
            source: e,
        })?;
        for (name, _) in shard {
            weight_map.insert((*name).clone(), file.clone().into());
        }
    }
    if n > 1 {
        let total: usize = weights
            .values()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        let index =
            serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        write_atomic(
            &dir.join("model.safetensors.index.json"),
            index.to_string().as_bytes(),
        )?;
    } else {
        let _ = std::fs::remove_file(dir.join("model.safetensors.index.json"));
    }
    let cfg_json =
        serde_json::to_string_pretty(cfg).map_err(|e| ModelError::InvalidInput(e.to_string()))?;
    write_atomic(&dir.join("config.json"), cfg_json.as_bytes())
}
