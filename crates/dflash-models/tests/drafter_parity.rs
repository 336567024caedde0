//! The drafter's training-mode forward (many blocks, block mask) equals its inference forward
//! (incremental context cache, one block) on the same anchors; gradients reach every parameter;
//! a drafter that does not fit its target is refused naming both values.

mod common;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use common::*;
use dflash_core::Grad;
use dflash_models::drafter::{
    config_for_target, load_drafter, random_weights, save_drafter, BlockConvention,
};
use dflash_models::{load_target, DFlashConfig, DFlashDrafter, TargetModel};

fn drafter_from(cfg: &DFlashConfig, seed: u64) -> (DFlashDrafter, VarMap) {
    let vm = VarMap::new();
    {
        let mut data = vm.data().lock().unwrap();
        for (k, v) in random_weights(cfg, seed).unwrap() {
            let v = if k.ends_with("norm.weight") {
                v
            } else {
                (v * 4.0).unwrap()
            };
            data.insert(k, Var::from_tensor(&v).unwrap());
        }
    }
    let d =
        DFlashDrafter::new(cfg, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu)).unwrap();
    (d, vm)
}

/// One inference block at `anchor` from a fresh cache fed the context rows before it.
fn draft_at(
    d: &DFlashDrafter,
    target: &dyn TargetModel,
    taps: &Tensor,
    tokens: &[u32],
    anchor: usize,
) -> dflash_models::Result<Tensor> {
    let mut cache = d.new_cache(64);
    let ctx = taps.narrow(0, 0, anchor)?;
    d.draft(target, &mut cache, &ctx, tokens[anchor], anchor)
}

fn parity(cfg: &DFlashConfig, target: &dyn TargetModel, what: &str) {
    let (mut drafter, _) = drafter_from(cfg, 5);
    drafter.bind_target(target).unwrap();
    let tokens: Vec<u32> = (0..24).map(|i| (i * 37 + 11) % 263).collect();
    let taps = sequence_taps(target, &tokens, drafter.target_layers());
    let anchors = [4u32, 9, 15, 17];
    let train = drafter
        .forward_train(target, &taps, &tokens, &anchors, Grad::On)
        .unwrap();
    let bs = drafter.block_size();
    // inference, context fed incrementally: [0,4) then [4,9) then [9,15) then [15,17)
    let mut cache = drafter.new_cache(64);
    let mut done = 0usize;
    for (b, &a) in anchors.iter().enumerate() {
        let a = a as usize;
        let ctx = taps.narrow(0, done, a - done).unwrap();
        let inf = drafter
            .draft(target, &mut cache, &ctx, tokens[a], a)
            .unwrap();
        done = a;
        let want = train.get(b).unwrap().narrow(0, 1, bs - 1).unwrap();
        let err = max_abs_diff(&inf, &want);
        assert!(
            err < 1e-4,
            "{what}: block {b} (anchor {a}) train vs inference err {err}"
        );
    }
}

#[test]
fn training_and_inference_forwards_agree() {
    let t = load_target(&fixtures().join("tiny-llama"), &Device::Cpu, DType::F32).unwrap();
    let mut cfg = config_for_target(&t, 2, 6, 262);
    parity(&cfg, t.model.as_ref(), "full attention");
    cfg.layer_types = Some(vec!["sliding_attention".into(), "full_attention".into()]);
    cfg.sliding_window = Some(5);
    parity(&cfg, t.model.as_ref(), "sliding window (causal) + full");
    cfg.dflash_config.causal = Some(true);
    cfg.layer_types = None;
    parity(&cfg, t.model.as_ref(), "causal within block");
    // z-lab's scalar settings (PyPI dflash 0.1.0 reads them) apply on both paths
    let mut cfg = config_for_target(&t, 2, 6, 262);
    cfg.dflash_config.input_embedding_scale = Some(1.7);
    cfg.dflash_config.output_multiplier = Some(0.6);
    cfg.final_logit_softcapping = Some(4.0); // top level: read when dflash_config lacks it
    parity(
        &cfg,
        t.model.as_ref(),
        "embedding scale, output multiplier, soft cap",
    );
    // a declared block layout (dflash_config.block_position_offset / anchor_slot_masked) is the
    // one both paths use
    for (offset, masked) in [(1, false), (0, true), (-1, true)] {
        let mut cfg = config_for_target(&t, 2, 6, 262);
        cfg.set_block_convention(BlockConvention {
            position_offset: offset,
            anchor_slot_masked: masked,
        });
        parity(
            &cfg,
            t.model.as_ref(),
            &format!("block layout offset {offset:+}, slot 0 masked {masked}"),
        );
    }
    // the target's final norm on the last tap, declared: both paths apply it
    let mut cfg = config_for_target(&t, 2, 6, 262);
    cfg.set_final_norm_on_last_tap(true);
    parity(&cfg, t.model.as_ref(), "final norm on the last tap");
}

/// `dflash_config.final_norm_on_last_tap`: the drafter feeds its last tap through the target's
/// final norm itself (the same drafts as an undeclared drafter fed that tap normed by hand), it
/// changes the drafts, it survives a save and load (absent by default), and a drafter declaring
/// it refuses to draft until bound to a target.
#[test]
fn a_declared_final_norm_on_the_last_tap_is_applied_by_the_drafter() {
    let t = load_target(&fixtures().join("tiny-llama"), &Device::Cpu, DType::F32).unwrap();
    let target = t.model.as_ref();
    let plain = config_for_target(&t, 2, 6, 262);
    let mut normed = plain.clone();
    normed.set_final_norm_on_last_tap(true);
    let tokens: Vec<u32> = (0..12).map(|i| (i * 37 + 11) % 263).collect();
    let draft = |d: &DFlashDrafter, taps: &Tensor| draft_at(d, target, taps, &tokens, 7);
    let (mut declared, _) = drafter_from(&normed, 5);
    let taps = sequence_taps(target, &tokens, declared.target_layers());
    let err = draft(&declared, &taps).unwrap_err().to_string();
    assert!(
        err.contains("final_norm_on_last_tap") && err.contains("bind_target"),
        "{err}"
    );
    declared.bind_target(target).unwrap();
    let (mut undeclared, _) = drafter_from(&plain, 5);
    undeclared.bind_target(target).unwrap();
    let h = plain.hidden_size;
    let w = taps.dim(1).unwrap();
    let last = target
        .final_norm()
        .unwrap()
        .forward(&taps.narrow(1, w - h, h).unwrap(), Grad::Off)
        .unwrap();
    let by_hand = Tensor::cat(&[taps.narrow(1, 0, w - h).unwrap(), last], 1).unwrap();
    let got = draft(&declared, &taps).unwrap();
    let err = max_abs_diff(&got, &draft(&undeclared, &by_hand).unwrap());
    assert!(err < 1e-5, "declared vs normed by hand: {err}");
    assert!(
        max_abs_diff(&got, &draft(&undeclared, &taps).unwrap()) > 1e-3,
        "the declared norm changes the drafts"
    );
    // the diagnose variant's toggle is the same drafter either way
    let off = declared.with_final_norm_on_last_tap(false);
    assert!(
        max_abs_diff(
            &draft(&off, &taps).unwrap(),
            &draft(&undeclared, &taps).unwrap()
        ) < 1e-6
    );
    let dir = tempfile::tempdir().unwrap();
    save_drafter(
        dir.path(),
        &normed,
        &random_weights(&normed, 1).unwrap(),
        1 << 30,
    )
    .unwrap();
    let d = load_drafter(dir.path(), &Device::Cpu, DType::F32).unwrap();
    assert!(d.config().final_norm_on_last_tap());
    let json = serde_json::to_value(&plain).unwrap();
    assert!(json["dflash_config"]
        .get("final_norm_on_last_tap")
        .is_none());
}

/// A declared block layout changes what the drafter computes (so the parity above could fail),
/// survives a save and load, and a default config declares none (z-lab's format unchanged).
#[test]
fn a_declared_block_layout_is_used_and_saved() {
    let t = load_target(&fixtures().join("tiny-llama"), &Device::Cpu, DType::F32).unwrap();
    let target = t.model.as_ref();
    let plain = config_for_target(&t, 2, 6, 262);
    let tokens: Vec<u32> = (0..12).map(|i| (i * 37 + 11) % 263).collect();
    let draft = |cfg: &DFlashConfig| {
        let (d, _) = drafter_from(cfg, 5);
        let taps = sequence_taps(target, &tokens, d.target_layers());
        let mut cache = d.new_cache(64);
        let ctx = taps.narrow(0, 0, 7).unwrap();
        d.draft(target, &mut cache, &ctx, tokens[7], 7).unwrap()
    };
    let base = draft(&plain);
    for conv in [
        BlockConvention {
            position_offset: 1,
            anchor_slot_masked: false,
        },
        BlockConvention {
            position_offset: 0,
            anchor_slot_masked: true,
        },
    ] {
        let mut cfg = plain.clone();
        cfg.set_block_convention(conv);
        assert_eq!(cfg.block_convention(), conv);
        assert!(max_abs_diff(&draft(&cfg), &base) > 1e-3, "{conv:?} ignored");
        let dir = tempfile::tempdir().unwrap();
        save_drafter(dir.path(), &cfg, &random_weights(&cfg, 1).unwrap(), 1 << 30).unwrap();
        let d = load_drafter(dir.path(), &Device::Cpu, DType::F32).unwrap();
        assert_eq!(d.block_convention(), conv);
    }
    let json = serde_json::to_value(&plain).unwrap();
    let section = json["dflash_config"].as_object().unwrap();
    assert!(
        !section.contains_key("block_position_offset")
            && !section.contains_key("anchor_slot_masked"),
        "{section:?}"
    );
    assert_eq!(plain.block_convention(), BlockConvention::default());
}

/// The z-lab scalar settings act exactly as their reference applies them: logits are
/// `tanh(m·l / c)·c` of the plain drafter's `l`, and the embedding scale changes the drafts.
#[test]
fn output_multiplier_and_softcap_transform_the_logits_and_the_embedding_scale_is_used() {
    let t = load_target(&fixtures().join("tiny-llama"), &Device::Cpu, DType::F32).unwrap();
    let target = t.model.as_ref();
    let plain_cfg = config_for_target(&t, 2, 6, 262);
    let tokens: Vec<u32> = (0..12).map(|i| (i * 37 + 11) % 263).collect();
    let draft = |cfg: &DFlashConfig| {
        let (d, _) = drafter_from(cfg, 5);
        let taps = sequence_taps(target, &tokens, d.target_layers());
        draft_at(&d, target, &taps, &tokens, 7).unwrap()
    };
    let plain = draft(&plain_cfg);
    let mut capped = plain_cfg.clone();
    capped.dflash_config.output_multiplier = Some(2.0);
    capped.dflash_config.final_logit_softcapping = Some(3.0);
    let want = ((((&plain * 2.0).unwrap() / 3.0).unwrap().tanh().unwrap()) * 3.0).unwrap();
    assert!(max_abs_diff(&draft(&capped), &want) < 1e-5);
    let mut scaled = plain_cfg.clone();
    scaled.input_embedding_scale = Some(3.0);
    assert!(max_abs_diff(&draft(&scaled), &plain) > 1e-3);
    // a DFlash 2 checkpoint and a non-positive multiplier are refused, naming why
    let mut v2 = plain_cfg.clone();
    v2.architectures = vec!["DFlash2DraftModel".into()];
    let err = v2.validate().unwrap_err();
    assert!(err.contains("DFlash 2"), "{err}");
    let mut bad = plain_cfg;
    bad.dflash_config.output_multiplier = Some(0.0);
    assert!(bad.validate().unwrap_err().contains("output_multiplier"));
}

#[test]
fn gradients_reach_every_drafter_parameter_and_slot_zero_is_the_anchor() {
    let t = load_target(&fixtures().join("tiny-qwen3"), &Device::Cpu, DType::F32).unwrap();
    let cfg = config_for_target(&t, 2, 4, 262);
    let (drafter, vm) = drafter_from(&cfg, 7);
    let tokens: Vec<u32> = (0..16).map(|i| (i * 53 + 3) % 263).collect();
    let taps = sequence_taps(t.model.as_ref(), &tokens, drafter.target_layers());
    let logits = drafter
        .forward_train(t.model.as_ref(), &taps, &tokens, &[2, 7], Grad::On)
        .unwrap();
    let loss = logits.sqr().unwrap().mean_all().unwrap();
    let grads = loss.backward().unwrap();
    for (name, var) in vm.data().lock().unwrap().iter() {
        let g = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("no gradient reaches {name}"));
        let norm = g
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(norm > 0.0, "zero gradient for {name}");
    }
    // changing the anchor token changes the block: slot 0 is embed(anchor), not embed(mask)
    let mut other = tokens.clone();
    other[7] = (other[7] + 1) % 263;
    let l2 = drafter
        .forward_train(t.model.as_ref(), &taps, &other, &[2, 7], Grad::Off)
        .unwrap();
    assert!(max_abs_diff(&logits.get(1).unwrap(), &l2.get(1).unwrap()) > 1e-4);
    assert!(
        max_abs_diff(&logits.get(0).unwrap(), &l2.get(0).unwrap()) < 1e-5,
        "block 0 must not see block 1"
    );
}

#[test]
fn save_load_round_trip_shards_and_mismatch_is_refused() {
    let t = load_target(&fixtures().join("tiny-llama"), &Device::Cpu, DType::F32).unwrap();
    let cfg = config_for_target(&t, 2, 4, 262);
    let w = random_weights(&cfg, 1).unwrap();
    let dir = tempfile::tempdir().unwrap();
    save_drafter(dir.path(), &cfg, &w, 40_000).unwrap();
    assert!(
        dir.path().join("model.safetensors.index.json").is_file(),
        "small shard limit must shard"
    );
    let mut d = load_drafter(dir.path(), &Device::Cpu, DType::F32).unwrap();
    d.bind_target(t.model.as_ref()).unwrap();
    assert_eq!(d.target_layers(), cfg.target_layer_ids().as_slice());
    let mut bad = cfg.clone();
    bad.hidden_size = 96;
    let dir2 = tempfile::tempdir().unwrap();
    let w2 = random_weights(&bad, 1).unwrap();
    save_drafter(dir2.path(), &bad, &w2, 1 << 30).unwrap();
    let mut d2 = load_drafter(dir2.path(), &Device::Cpu, DType::F32).unwrap();
    let err = d2.bind_target(t.model.as_ref()).unwrap_err().to_string();
    assert!(err.contains("hidden size: drafter 96, target 64"), "{err}");
    let mut bad_mask = cfg.clone();
    bad_mask.dflash_config.mask_token_id = Some(999);
    let (mut d3, _) = drafter_from(&bad_mask, 1);
    let err = d3.bind_target(t.model.as_ref()).unwrap_err().to_string();
    assert!(
        err.contains("mask token id") && err.contains("999") && err.contains("263"),
        "{err}"
    );
}

#[test]
fn batched_training_forward_equals_each_sequence_alone() {
    let t = load_target(&fixtures().join("tiny-llama"), &Device::Cpu, DType::F32).unwrap();
    let mut cfg = config_for_target(&t, 2, 4, 262);
    cfg.layer_types = Some(vec!["sliding_attention".into(), "full_attention".into()]);
    cfg.sliding_window = Some(6);
    let (drafter, _) = drafter_from(&cfg, 9);
    let (m, bs) = (t.model.as_ref(), drafter.block_size());
    let long: Vec<u32> = (0..20).map(|i| (i * 37 + 11) % 263).collect();
    let short: Vec<u32> = (0..11).map(|i| (i * 29 + 5) % 263).collect();
    let (a_long, a_short) = ([3u32, 8, 15], [2u32, 6]);
    let s = long.len();
    // right-pad the short sequence (tokens and taps) to the long one's length
    let mut tokens = long.clone();
    tokens.extend(&short);
    tokens.extend(std::iter::repeat_n(7u32, s - short.len()));
    let taps_long = sequence_taps(m, &long, drafter.target_layers());
    let taps_short = sequence_taps(m, &short, drafter.target_layers());
    let pad = Tensor::full(
        123.0f32,
        (s - short.len(), taps_short.dim(1).unwrap()),
        &Device::Cpu,
    )
    .unwrap();
    let padded = Tensor::cat(&[&taps_short, &pad], 0).unwrap();
    let ctx = Tensor::stack(&[&taps_long, &padded], 0).unwrap();
    // the short sequence has 2 real blocks; its third repeats an anchor (no loss weight)
    let anchors = [
        a_long[0], a_long[1], a_long[2], a_short[0], a_short[1], a_short[0],
    ];
    let hidden = drafter
        .forward_train_batch(m, &ctx, &tokens, &anchors, Grad::Off)
        .unwrap();
    let batched = m
        .lm_head(&hidden)
        .unwrap()
        .reshape((anchors.len(), bs, ()))
        .unwrap();
    let alone_long = drafter
        .forward_train(m, &taps_long, &long, &a_long, Grad::Off)
        .unwrap();
    let alone_short = drafter
        .forward_train(m, &taps_short, &short, &a_short, Grad::Off)
        .unwrap();
    let err_long = max_abs_diff(&batched.narrow(0, 0, 3).unwrap(), &alone_long);
    let err_short = max_abs_diff(&batched.narrow(0, 3, 2).unwrap(), &alone_short);
    assert!(
        err_long < 1e-4,
        "long sequence: batched vs alone err {err_long}"
    );
    assert!(
        err_short < 1e-4,
        "padded short sequence: batched vs alone err {err_short} (padding leaked?)"
    );
}
