//! The drafter's device step against the CPU draft (part of the `decode_ops_device` test binary:
//! the same device and helpers; CUDA only — every test returns early on the CPU).

use super::{common, device, max_abs};
use candle_core::{DType, Device, Tensor};

/// The drafter's device step (context and block rows written at device-held cache rows, the block
/// attending through the tree-attention kernel, one CUDA graph per number of new context rows)
/// against the CPU draft on the same random weights, through a decode whose new-context count
/// varies and repeats (each shape eager once, captured, then replayed) and whose cache is cropped
/// between drafts. CUDA only.
#[test]
fn device_drafts_replay_the_cpu_draft() {
    let dev = device();
    if !dev.is_cuda() {
        return;
    }
    let cfg = common::tiny_qwen3(4, 96, 300, 512);
    let counts = [20usize, 3, 5, 3, 5, 3, 1, 1, 1, 5];
    drafts_follow_the_cpu(&cfg, |_| {}, &dev, DType::F32, &counts, 4, |_| 2e-4);
}

/// Drafts on `dev` in `dtype` against the f32 CPU drafts on the same random weights (a target of
/// `cfg`, a 2-layer drafter of block 8, as `layout` leaves it): one draft per entry of `counts` (new
/// context rows), the caches cropped by 2 rows after draft `crop_after`; each draft's logits within
/// `bound(scale)` of the CPU's (scale: the largest CPU logit) and the cache lengths equal. Returns
/// the device cache.
fn drafts_follow_the_cpu(
    cfg: &dflash_models::DecoderConfig,
    layout: impl Fn(&mut dflash_models::DFlashConfig),
    dev: &Device,
    dtype: DType,
    counts: &[usize],
    crop_after: usize,
    bound: impl Fn(f32) -> f32,
) -> dflash_models::DraftCache {
    use dflash_models::drafter::io::config_for_decoder;
    use dflash_models::random::{random_drafter_tensors, random_target_tensors};
    use dflash_models::{DFlashDrafter, Decoder, TargetModel};
    let mut dcfg = config_for_decoder(cfg, 2, 8, 299);
    layout(&mut dcfg);
    let tw = random_target_tensors(cfg, DType::F32, &Device::Cpu, 5).unwrap();
    let dw = random_drafter_tensors(&dcfg, DType::F32, &Device::Cpu, 6).unwrap();
    let on = |w: &std::collections::HashMap<String, Tensor>, d: &Device, dtype: DType| {
        let w = w
            .iter()
            .map(|(k, t)| (k.clone(), t.to_dtype(dtype).unwrap().to_device(d).unwrap()))
            .collect();
        candle_nn::VarBuilder::from_tensors(w, dtype, d)
    };
    let arch = cfg.architecture().unwrap();
    let ct = Decoder::new(cfg, arch, on(&tw, &Device::Cpu, DType::F32)).unwrap();
    let cd = DFlashDrafter::new(&dcfg, on(&dw, &Device::Cpu, DType::F32)).unwrap();
    let gt = Decoder::new(cfg, arch, on(&tw, dev, dtype)).unwrap();
    let gd = DFlashDrafter::new(&dcfg, on(&dw, dev, dtype)).unwrap();
    let (mut cc, mut gc) = (cd.new_cache(300), gd.new_cache(300));
    let width = dcfg.target_layer_ids().len() * cfg.hidden_size;
    let mut start = 0usize;
    for (i, &m) in counts.iter().enumerate() {
        let ctx = Tensor::randn(0f32, 1.0, (m, width), &Device::Cpu).unwrap();
        start += m;
        let a = cd.draft(&ct, &mut cc, &ctx, (i * 7) as u32, start).unwrap();
        let ctx = ctx.to_dtype(dtype).unwrap().to_device(dev).unwrap();
        let b = gd.draft(&gt, &mut gc, &ctx, (i * 7) as u32, start).unwrap();
        let b = b.to_dtype(DType::F32).unwrap();
        let scale = common::max_abs(&a);
        let d = max_abs(&a, &b);
        assert!(
            d <= bound(scale),
            "{dtype:?} draft {i} (m {m}): logits differ by {d} (scale {scale})"
        );
        assert_eq!(cc.len(), gc.len(), "draft {i}: cache lengths");
        if i == crop_after {
            // a rejected tail: both caches forget the last 2 rows
            cc.crop(start - 2);
            gc.crop(start - 2);
            start -= 2;
        }
    }
    let _ = (ct.info(), gt.info());
    gc
}

/// A drafter of the z-lab Qwen3.6-27B layout — a causal sliding-window layer, then a full one —
/// drafts on the device step (causal block bits; the windowed attention once drafts reach past
/// the 40-key window: each block row sees the cached keys within its own window), in f32 and in
/// bf16, through a decode whose cache is cropped; every draft follows the CPU's host path.
/// Under `DFLASH_DRAFT_STEP_WINDOWS=0` the same drafts run on the host path. CUDA only.
#[test]
fn causal_window_drafter_drafts_on_the_device_past_its_window() {
    let dev = device();
    if !dev.is_cuda() {
        return;
    }
    let cfg = common::tiny_qwen3(4, 96, 300, 512);
    let layout = |d: &mut dflash_models::DFlashConfig| {
        d.layer_types = Some(vec!["sliding_attention".into(), "full_attention".into()]);
        d.sliding_window = Some(40);
    };
    // 47 context positions and 8-row blocks: the later blocks' windows exclude the first keys
    let counts = [20usize, 3, 5, 3, 5, 3, 1, 1, 1, 5];
    let windows_on = std::env::var("DFLASH_DRAFT_STEP_WINDOWS").as_deref() != Ok("0");
    for (dtype, bound) in [
        (DType::F32, &(|_: f32| 2e-4f32) as &dyn Fn(f32) -> f32),
        (DType::BF16, &|s: f32| 0.05 * s + 0.05),
    ] {
        let gc = drafts_follow_the_cpu(&cfg, layout, &dev, dtype, &counts, 4, bound);
        if windows_on && dflash_core::step_graph::cuda_graphs_enabled() {
            assert!(
                gc.captured_graphs() > 0,
                "{dtype:?}: the causal-window drafter took the host path: no draft graph was captured"
            );
        }
    }
}

/// A drafter with 256-wide heads (the Qwen3.5 / Qwen3.6 drafters' layout) drafts on the device
/// in bf16 — its block on the 256-wide tensor-core attention, replayed as CUDA graphs — and its
/// logits follow the f32 CPU draft on the same random weights up to bf16 rounding, through a
/// decode whose new-context count varies and whose cache is cropped. CUDA only.
#[test]
fn wide_head_drafter_drafts_on_the_device_in_bf16() {
    let dev = device();
    if !dev.is_cuda() {
        return;
    }
    let cfg: dflash_models::DecoderConfig = serde_json::from_value(serde_json::json!({
        "model_type": "qwen3", "vocab_size": 300, "hidden_size": 128, "head_dim": 256,
        "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": true
    }))
    .unwrap();
    // bf16 weights, activations and logits against f32: a few bf16 ulps of the logits' scale
    let counts = [20usize, 3, 5, 3, 5, 1, 1];
    let gc = drafts_follow_the_cpu(
        &cfg,
        |_| {},
        &dev,
        DType::BF16,
        &counts,
        3,
        |s| 0.05 * s + 0.05,
    );
    if dflash_core::step_graph::cuda_graphs_enabled() {
        assert!(
            gc.captured_graphs() > 0,
            "the 256-wide drafter took the host path: no draft graph was captured"
        );
    }
}
