//! Qwen3.5 hybrids from GGUF: `fixtures/tiny-qwen3.5/model-f32.gguf` is the tiny HF checkpoint
//! beside it converted by llama.cpp's own `convert_hf_to_gguf.py` (scripts/make-gguf-fixture.sh).
//! Loaded through `load_target`, it must give the HF directory's config, the checkpoint's tensors
//! under their HF names (every converter transform undone) and the same logits; MTP layers appended
//! by the converter are skipped, and mixture-of-experts and MTP-only files are refused by name.

mod common;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use common::*;
use dflash_core::SequenceCache;
use dflash_models::{load_target, target_tensors, ForwardRequest, LogitRows, ModelError};
use std::path::{Path, PathBuf};

fn hf_dir() -> PathBuf {
    fixtures().join("tiny-qwen3.5")
}

fn gguf() -> PathBuf {
    hf_dir().join("model-f32.gguf")
}

const TOKENS: [u32; 12] = [5, 17, 262, 3, 99, 140, 7, 7, 200, 31, 1, 2];

/// Logits of a prefill of `TOKENS[..split]` then of the rest (recurrent states carried over).
fn logits(path: &Path, split: usize) -> (Tensor, Tensor) {
    let t = load_target(path, &Device::Cpu, DType::F32).unwrap();
    let m = t.model.as_ref();
    let mut cache: SequenceCache = m.new_cache(TOKENS.len()).unwrap();
    let pos: Vec<u32> = (0..TOKENS.len() as u32).collect();
    let mut run = |r: std::ops::Range<usize>| {
        m.forward(
            &ForwardRequest::causal(&TOKENS[r.clone()], &pos[r], LogitRows::All),
            &mut cache,
        )
        .unwrap()
        .logits
        .unwrap()
    };
    (run(0..split), run(split..TOKENS.len()))
}

#[test]
fn the_config_is_the_hf_directorys() {
    let hf = load_target(&hf_dir(), &Device::Cpu, DType::F32).unwrap();
    let gg = load_target(&gguf(), &Device::Cpu, DType::F32).unwrap();
    let (a, b) = (&hf.config, &gg.config);
    assert_eq!(a.architecture(), b.architecture());
    assert_eq!(a.model_type, b.model_type);
    for (what, x, y) in [
        ("vocab_size", a.vocab_size, b.vocab_size),
        ("hidden_size", a.hidden_size, b.hidden_size),
        (
            "intermediate_size",
            a.intermediate_size,
            b.intermediate_size,
        ),
        (
            "num_hidden_layers",
            a.num_hidden_layers,
            b.num_hidden_layers,
        ),
        (
            "num_attention_heads",
            a.num_attention_heads,
            b.num_attention_heads,
        ),
        ("num_kv_heads", a.num_kv_heads(), b.num_kv_heads()),
        ("head_dim", a.head_dim(), b.head_dim()),
        (
            "max_position_embeddings",
            a.max_position_embeddings,
            b.max_position_embeddings,
        ),
    ] {
        assert_eq!(x, y, "{what}");
    }
    assert_eq!(a.rms_norm_eps, b.rms_norm_eps);
    assert_eq!(a.tie_word_embeddings, b.tie_word_embeddings);
    assert_eq!(a.hidden_act, b.hidden_act);
    assert_eq!(a.hybrid.layer_types, b.hybrid.layer_types);
    assert_eq!(a.recurrent_layers(), b.recurrent_layers());
    assert_eq!(a.attn_output_gate(), b.attn_output_gate());
    assert_eq!(
        a.hybrid.partial_rotary_factor,
        b.hybrid.partial_rotary_factor
    );
    let (s, t) = (a.delta_net_shape(), b.delta_net_shape());
    assert_eq!(
        (
            s.hidden,
            s.key_heads,
            s.value_heads,
            s.key_dim,
            s.value_dim,
            s.conv_kernel
        ),
        (
            t.hidden,
            t.key_heads,
            t.value_heads,
            t.key_dim,
            t.value_dim,
            t.conv_kernel
        )
    );
    let (r, q) = (a.rope().unwrap(), b.rope().unwrap());
    assert_eq!(
        (r.theta, r.head_dim, r.rotary_dim),
        (q.theta, q.head_dim, q.rotary_dim)
    );
    assert!(r.scaling.is_none() && q.scaling.is_none());
    // the GGUF carries the conversion tokenizer (bos 1, eos 2 as config.json says)
    assert!(hf.text.is_none());
    let text = gg
        .text
        .as_ref()
        .expect("the GGUF vocabulary builds a tokenizer");
    assert_eq!(gg.eos_token_ids, hf.eos_token_ids);
    let ids = text.tokenizer.encode("the hint<|im_end|>", false).unwrap();
    assert_eq!(ids, [119, 260, 35, 107, 261, 119, 2]);
}

#[test]
fn every_tensor_is_the_checkpoints() {
    let want = target_tensors(&hf_dir()).unwrap();
    let got = target_tensors(&gguf()).unwrap();
    let mut names: Vec<_> = want.keys().collect();
    names.sort();
    let mut got_names: Vec<_> = got.keys().collect();
    got_names.sort();
    assert_eq!(names, got_names);
    let mut worst = 0f32;
    for name in names {
        let (w, g) = (&want[name], &got[name]);
        assert_eq!(w.dims(), g.dims(), "{name}");
        // norms come back from 1 + w and A_log from -exp(A_log): a few f32 ulps
        let d = max_abs_diff(w, g);
        assert!(d <= 1e-6, "{name}: max abs diff {d}");
        worst = worst.max(d);
    }
    eprintln!("{} tensors, max abs diff {worst}", got.len());
}

#[test]
fn logits_agree_with_the_hf_directory() {
    let (hf_pre, hf_rest) = logits(&hf_dir(), 7);
    let (gg_pre, gg_rest) = logits(&gguf(), 7);
    assert!(max_abs(&hf_pre) > 1e-2, "logits are not trivial");
    for (what, a, b) in [
        ("prefill", &hf_pre, &gg_pre),
        ("continued", &hf_rest, &gg_rest),
    ] {
        let d = max_abs_diff(a, b);
        eprintln!("{what}: logits max abs diff {d}");
        assert!(d <= 1e-4, "{what}: max abs diff {d}");
    }
}

/// The fixture rewritten: `general.architecture` and its key prefix renamed to `arch`, `edit`
/// applied to the metadata, `extra` tensors added and `drop` ones left out.
fn rewrite(
    dir: &Path,
    arch: &str,
    edit: impl Fn(&mut Vec<(String, gguf_file::Value)>),
    extra: &[(&str, Tensor)],
    drop: &[&str],
) -> PathBuf {
    let mut f = std::fs::File::open(gguf()).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut meta: Vec<(String, gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| match k.strip_prefix("qwen35.") {
            Some(rest) => (format!("{arch}.{rest}"), v.clone()),
            None if k == "general.architecture" => {
                (k.clone(), gguf_file::Value::String(arch.into()))
            }
            None => (k.clone(), v.clone()),
        })
        .collect();
    edit(&mut meta);
    let mut tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .filter(|n| !drop.contains(&n.as_str()))
        .map(|n| (n.clone(), content.tensor(&mut f, n, &Device::Cpu).unwrap()))
        .collect();
    for (n, t) in extra {
        tensors.push((n.to_string(), QTensor::quantize(t, GgmlDType::F32).unwrap()));
    }
    let path = dir.join(format!("{arch}.gguf"));
    let mut w = std::fs::File::create(&path).unwrap();
    let m: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut w, &m, &t).unwrap();
    path
}

fn set(meta: &mut Vec<(String, gguf_file::Value)>, key: &str, v: gguf_file::Value) {
    meta.retain(|(k, _)| k != key);
    meta.push((key.into(), v));
}

#[test]
fn mtp_layers_appended_by_the_converter_are_skipped() {
    // what the converter writes for a checkpoint with one MTP layer: block_count + 1, the count in
    // nextn_predict_layers, a non-recurrent flag, and the layer's tensors under blk.{n}
    let tmp = tempfile::tempdir().unwrap();
    let z = |shape: &[usize]| Tensor::ones(shape, DType::F32, &Device::Cpu).unwrap();
    let with_mtp = |meta: &mut Vec<(String, gguf_file::Value)>| {
        use gguf_file::Value::*;
        set(meta, "qwen35.block_count", U32(5));
        set(meta, "qwen35.nextn_predict_layers", U32(1));
        let flags = [true, true, true, false, false].map(Bool).to_vec();
        set(meta, "qwen35.attention.recurrent_layers", Array(flags));
    };
    let path = rewrite(
        tmp.path(),
        "qwen35",
        with_mtp,
        &[
            ("blk.4.attn_q.weight", z(&[256, 64])),
            ("blk.4.attn_norm.weight", z(&[64])),
            ("blk.4.nextn.eh_proj.weight", z(&[64, 128])),
            ("blk.4.nextn.enorm.weight", z(&[64])),
        ],
        &[],
    );
    let t = load_target(&path, &Device::Cpu, DType::F32).unwrap();
    assert_eq!(t.config.num_hidden_layers, 4);
    let (a, a2) = logits(&gguf(), 7);
    let (b, b2) = logits(&path, 7);
    assert_eq!((max_abs_diff(&a, &b), max_abs_diff(&a2, &b2)), (0.0, 0.0));

    // llama.cpp's --mtp export: the head alone is a draft model, not a target
    let trunk: Vec<String> = (0..4)
        .map(|i| format!("blk.{i}.attn_norm.weight"))
        .collect();
    let trunk: Vec<&str> = trunk.iter().map(String::as_str).collect();
    let only = rewrite(tmp.path(), "qwen35", with_mtp, &[], &trunk);
    let err = load_target(&only, &Device::Cpu, DType::F32)
        .err()
        .expect("an MTP-only file is refused");
    assert!(
        err.is_bad_input() && err.to_string().contains("MTP-only"),
        "{err}"
    );
}

#[test]
fn moe_hybrids_and_unknown_tensors_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    for arch in ["qwen35moe", "qwen3next"] {
        let path = rewrite(tmp.path(), arch, |_| {}, &[], &[]);
        let err = load_target(&path, &Device::Cpu, DType::F32)
            .err()
            .expect("refused");
        let msg = err.to_string();
        assert!(
            matches!(err, ModelError::UnsupportedGguf { .. }) && err.is_bad_input(),
            "{msg}"
        );
        assert!(
            msg.contains(&format!("'{arch}'")) && msg.contains("mixture-of-experts"),
            "{msg}"
        );
        assert!(
            msg.contains("qwen35 = Qwen3.5 / Qwen3.6 dense hybrids"),
            "{msg}"
        );
    }
    // a tensor of Qwen3-Next's layout in a qwen35 file is not silently dropped
    let ba = Tensor::zeros((8, 64), DType::F32, &Device::Cpu).unwrap();
    let path = rewrite(
        tmp.path(),
        "qwen35",
        |_| {},
        &[("blk.0.ssm_ba.weight", ba)],
        &[],
    );
    let err = load_target(&path, &Device::Cpu, DType::F32)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("blk.0.ssm_ba.weight"), "{err}");
}
