//! Test support: tiny targets, random drafters, and an oracle drafter built from the target.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use dflash_decoding::{BlockDrafter, Result};
use dflash_models::drafter::{config_for_target, random_weights};
use dflash_models::{
    load_target, Architecture, DFlashDrafter, Decoder, DecoderConfig, ForwardRequest, LoadedTarget,
    LogitRows, TargetModel,
};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::PathBuf;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

pub fn tiny(name: &str) -> LoadedTarget {
    load_target(&fixtures().join(name), &Device::Cpu, DType::F32).unwrap()
}

/// A random drafter sized for `target`.
pub fn random_drafter(
    target: &LoadedTarget,
    layers: usize,
    block: usize,
    seed: u64,
) -> DFlashDrafter {
    let vocab = target.config.vocab_size as u32;
    let cfg = config_for_target(target, layers, block, vocab - 1);
    random_drafter_for(&cfg, target.model.as_ref(), 5.0, seed)
}

/// A drafter of config `cfg` with random weights (matrices scaled by `scale`), bound to `target`.
pub fn random_drafter_for(
    cfg: &dflash_models::DFlashConfig,
    target: &dyn dflash_models::TargetModel,
    scale: f64,
    seed: u64,
) -> DFlashDrafter {
    let w = random_weights(cfg, seed).unwrap();
    // scaled up (by random_drafter), the random drafter is confidently (and variously) wrong
    let w: HashMap<String, Tensor> = w
        .into_iter()
        .map(|(k, v)| {
            let v = if k.ends_with("norm.weight") {
                v
            } else {
                (v * scale).unwrap()
            };
            (k, v)
        })
        .collect();
    let mut d =
        DFlashDrafter::new(cfg, VarBuilder::from_tensors(w, DType::F32, &Device::Cpu)).unwrap();
    d.bind_target(target).unwrap();
    d
}

/// A Llama with a tiny vocabulary (for exact distribution tests) and random weights.
pub fn tiny_vocab_target(vocab: usize, seed: u64) -> Decoder {
    let cfg: DecoderConfig = serde_json::from_value(serde_json::json!({
        "model_type": "llama", "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": true
    }))
    .unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut randn = |shape: &[usize], std: f32| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| (rng.random::<f32>() - 0.5) * 2.0 * std * 1.7)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    };
    let mut w = HashMap::new();
    w.insert(
        "model.embed_tokens.weight".to_string(),
        randn(&[vocab, 32], 0.12),
    );
    w.insert(
        "model.norm.weight".to_string(),
        Tensor::ones(32, DType::F32, &Device::Cpu).unwrap(),
    );
    for l in 0..2 {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        for (n, s) in [
            ("self_attn.q_proj.weight", [32, 32]),
            ("self_attn.k_proj.weight", [16, 32]),
            ("self_attn.v_proj.weight", [16, 32]),
            ("self_attn.o_proj.weight", [32, 32]),
            ("mlp.gate_proj.weight", [48, 32]),
            ("mlp.up_proj.weight", [48, 32]),
            ("mlp.down_proj.weight", [32, 48]),
        ] {
            w.insert(p(n), randn(&s, 0.3));
        }
        w.insert(
            p("input_layernorm.weight"),
            Tensor::ones(32, DType::F32, &Device::Cpu).unwrap(),
        );
        w.insert(
            p("post_attention_layernorm.weight"),
            Tensor::ones(32, DType::F32, &Device::Cpu).unwrap(),
        );
    }
    Decoder::new(
        &cfg,
        Architecture::Llama,
        VarBuilder::from_tensors(w, DType::F32, &Device::Cpu),
    )
    .unwrap()
}

/// A Qwen3.5 hybrid (two Gated DeltaNet layers, one gated attention layer) with a tiny
/// vocabulary (for exact distribution tests) and random weights large enough that its
/// next-token distributions are far from uniform.
pub fn tiny_vocab_hybrid(vocab: usize, seed: u64) -> dflash_models::HybridDecoder {
    tiny_vocab_hybrid_layers(vocab, 3, 3, seed)
}

/// [`tiny_vocab_hybrid`] with `layers` layers, every `interval`-th one full attention.
pub fn tiny_vocab_hybrid_layers(
    vocab: usize,
    layers: usize,
    interval: usize,
    seed: u64,
) -> dflash_models::HybridDecoder {
    let cfg: DecoderConfig = serde_json::from_value(serde_json::json!({
        "model_type": "qwen3_5_text", "vocab_size": vocab, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": layers, "full_attention_interval": interval,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "max_position_embeddings": 128, "tie_word_embeddings": true
    }))
    .unwrap();
    let w = dflash_models::random::random_target_tensors(&cfg, DType::F32, &Device::Cpu, seed)
        .unwrap()
        .into_iter()
        .map(|(k, v)| {
            let v = if k.ends_with("norm.weight") {
                v
            } else {
                (v * 12.0).unwrap()
            };
            (k, v)
        })
        .collect();
    dflash_models::HybridDecoder::new(&cfg, VarBuilder::from_tensors(w, DType::F32, &Device::Cpu))
        .unwrap()
}

/// Proposes the target's own greedy continuation (its logits as the draft logits), corrupting each
/// position with probability `noise` so that acceptance lengths vary.
pub struct OracleDrafter {
    pub block: usize,
    pub noise: f64,
    pub taps: Vec<usize>,
    rng: rand_chacha::ChaCha8Rng,
}

impl OracleDrafter {
    pub fn new(block: usize, noise: f64, seed: u64) -> Self {
        Self {
            block,
            noise,
            taps: vec![0],
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(seed),
        }
    }
}

impl BlockDrafter for OracleDrafter {
    fn block_size(&self) -> usize {
        self.block
    }
    fn target_layers(&self) -> &[usize] {
        &self.taps
    }
    fn reset(&mut self, _capacity: usize) -> Result<()> {
        Ok(())
    }
    fn draft(
        &mut self,
        target: &dyn TargetModel,
        _new_ctx: &Tensor,
        _bonus: u32,
        start: usize,
        history: &[u32],
    ) -> Result<Tensor> {
        assert_eq!(
            history.len(),
            start + 1,
            "bonus is the last committed token"
        );
        let mut cache = target.new_cache(history.len() + self.block)?;
        let pos: Vec<u32> = (0..history.len() as u32).collect();
        let mut logits = target
            .forward(
                &ForwardRequest::causal(history, &pos, LogitRows::Last),
                &mut cache,
            )?
            .logits
            .unwrap();
        let mut rows = vec![];
        for k in 0..self.block - 1 {
            let mut row: Vec<f32> = logits.squeeze(0)?.to_vec1()?;
            if self.rng.random::<f64>() < self.noise {
                let j = self.rng.random_range(0..row.len());
                row[j] += 1000.0;
            }
            let tok = dflash_decoding::sampling::argmax(&row);
            rows.push(Tensor::from_vec(row, (1, ()), &Device::Cpu)?);
            let p = [(history.len() + k) as u32];
            logits = target
                .forward(
                    &ForwardRequest::causal(&[tok], &p, LogitRows::Last),
                    &mut cache,
                )?
                .logits
                .unwrap();
        }
        Ok(Tensor::cat(&rows, 0)?)
    }
}
