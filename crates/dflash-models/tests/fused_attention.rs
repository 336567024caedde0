//! With the fused attention (`DFLASH_FUSED_ATTENTION=1`) the drafter computes the same training
//! logits, parameter gradients and inference draft as with the composite, and the target the
//! same logits and taps (causal prefill, cached continuation, batched forward).
//! Its own test binary: the switch is an environment variable of the process, and this is the
//! only test here that sets it.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use common::*;
use dflash_core::Grad;
use dflash_models::drafter::{config_for_target, random_weights};
use dflash_models::{load_target, DFlashDrafter, ForwardRequest, LogitRows, TargetModel};

/// Every tensor of `b` within 1e-4 (relative to the larger of 1 and `a`'s largest value) of `a`.
fn assert_all_close(a: &[Tensor], b: &[Tensor]) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let (err, size) = (max_abs_diff(x, y), max_abs(x).max(1.0));
        assert!(
            err <= 1e-4 * size,
            "tensor {i}: differs by {err} (max {size})"
        );
    }
}

/// Training logits of two sequences and the gradient of every parameter, with the switch set.
fn run(fused: bool, target: &dyn TargetModel, drafter: &DFlashDrafter, vm: &VarMap) -> Vec<Tensor> {
    let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 263).collect();
    // the taps through the composite, so the count below is the drafter's alone
    dflash_core::flash_block::set_fused_attention(Some(false));
    let taps = sequence_taps(target, &tokens, drafter.target_layers());
    dflash_core::flash_block::set_fused_attention(Some(fused));
    let ctx = Tensor::stack(
        &[
            taps.narrow(0, 0, 20).unwrap(),
            taps.narrow(0, 20, 20).unwrap(),
        ],
        0,
    )
    .unwrap();
    // anchor 0 sees no context; anchors in the middle and at the end of the sequence
    let anchors = [0u32, 7, 13, 19, 2, 11, 16, 18];
    let hidden = drafter
        .forward_train_batch(target, &ctx, &tokens, &anchors, Grad::On)
        .unwrap();
    let logits = target.lm_head(&hidden).unwrap();
    let w = Tensor::arange(0f32, logits.elem_count() as f32, &Device::Cpu)
        .unwrap()
        .affine(1e-4, 0.0)
        .unwrap()
        .sin()
        .unwrap()
        .reshape(logits.shape())
        .unwrap();
    let grads = (&logits * &w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let data = vm.data().lock().unwrap();
    let mut out = vec![logits.detach()];
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for n in names {
        out.push(grads.get(data[n].as_tensor()).expect(n).clone());
    }
    // inference: one block after 20 context rows (every row visible)
    let mut cache = drafter.new_cache(64);
    let draft = drafter
        .draft(
            target,
            &mut cache,
            &taps.narrow(0, 0, 20).unwrap(),
            tokens[20],
            20,
        )
        .unwrap();
    out.push(draft);
    out
}

#[test]
fn fused_attention_equals_the_composite_in_the_drafter_and_the_target() {
    let t = load_target(&fixtures().join("tiny-llama"), &Device::Cpu, DType::F32).unwrap();
    let cfg = config_for_target(&t, 2, 4, 262);
    let vm = VarMap::new();
    {
        let mut data = vm.data().lock().unwrap();
        for (k, v) in random_weights(&cfg, 5).unwrap() {
            let v = if k.ends_with("norm.weight") {
                v
            } else {
                (v * 4.0).unwrap()
            };
            data.insert(k, Var::from_tensor(&v).unwrap());
        }
    }
    let drafter =
        DFlashDrafter::new(&cfg, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu)).unwrap();
    let before = dflash_core::flash_block::calls();
    let composite = run(false, t.model.as_ref(), &drafter, &vm);
    assert_eq!(
        dflash_core::flash_block::calls(),
        before,
        "the switch is off"
    );
    let fused = run(true, t.model.as_ref(), &drafter, &vm);
    // two layers, one training forward and one draft
    assert_eq!(
        dflash_core::flash_block::calls(),
        before + 4,
        "the fused path ran"
    );
    assert_all_close(&composite, &fused);
    dflash_core::flash_block::set_fused_attention(Some(false));
    fused_causal_attention_equals_the_composite_in_the_target();
}

/// Logits and taps of a causal prefill, a cached continuation and a batched causal forward.
fn target_outputs(fused: bool, t: &dyn TargetModel) -> Vec<Tensor> {
    dflash_core::flash_block::set_fused_attention(Some(fused));
    let tokens: Vec<u32> = (0..29).map(|i| (i * 53 + 7) % 263).collect();
    let mut cache = t.new_cache(64).unwrap();
    let mut out = vec![];
    for (a, b) in [(0usize, 21usize), (21, 29)] {
        let pos: Vec<u32> = (a as u32..b as u32).collect();
        let req = ForwardRequest {
            tokens: &tokens[a..b],
            positions: &pos,
            mask: dflash_core::AttentionMask::Causal,
            taps: &[0, 1],
            logits: LogitRows::All,
        };
        let o = t.forward(&req, &mut cache).unwrap();
        out.push(o.logits.unwrap());
        out.extend(o.taps);
    }
    let (b, s) = (2usize, 13usize);
    let mut causal = vec![0f32; s * s];
    for i in 0..s {
        causal[i * s + i + 1..(i + 1) * s].fill(f32::NEG_INFINITY);
    }
    let mask = Tensor::from_vec(causal, (1, s, s), &Device::Cpu)
        .unwrap()
        .broadcast_as((b, s, s))
        .unwrap()
        .contiguous()
        .unwrap();
    let pos: Vec<u32> = (0..b).flat_map(|_| 0..s as u32).collect();
    let req = dflash_models::BatchForwardRequest {
        batch: b,
        tokens: &tokens[..b * s],
        positions: &pos,
        mask,
        causal_from: Some(&[0, 0]),
        taps: &[1],
        logits: LogitRows::All,
    };
    let mut cache = t.new_cache(s).unwrap();
    let o = t.forward_batch(&req, &mut cache).unwrap();
    out.push(o.logits.unwrap());
    out.extend(o.taps);
    out
}

/// The target's causal attention through the fused kernel (called from the one test: the
/// switch is process-wide, so the comparisons run one after the other).
fn fused_causal_attention_equals_the_composite_in_the_target() {
    let t = load_target(&fixtures().join("tiny-qwen3"), &Device::Cpu, DType::F32).unwrap();
    let before = dflash_core::flash_block::calls();
    let composite = target_outputs(false, t.model.as_ref());
    assert_eq!(
        dflash_core::flash_block::calls(),
        before,
        "the switch is off"
    );
    let fused = target_outputs(true, t.model.as_ref());
    dflash_core::flash_block::set_fused_attention(Some(false));
    // three causal forwards through every layer
    let layers = t.config.num_hidden_layers;
    assert_eq!(
        dflash_core::flash_block::calls(),
        before + 3 * layers,
        "the fused path ran"
    );
    assert_all_close(&composite, &fused);
}
