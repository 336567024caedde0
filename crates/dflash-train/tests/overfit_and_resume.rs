//! A tiny drafter overfits target-generated text (loss falls, then decoding it accepts long
//! blocks, output still equal to AR); gradients flow end to end; a resumed run continues
//! bit-for-bit.

use candle_core::{DType, Device, Var};
use candle_nn::{VarBuilder, VarMap};
use dflash_decoding::{
    generate_ar, generate_speculative, DFlashRunner, GenerateConfig, SamplingConfig, SpecMode,
};
use dflash_models::drafter::{config_for_target, random_weights, save_drafter};
use dflash_models::{load_drafter, load_target, DFlashConfig, DFlashDrafter, LoadedTarget};
use dflash_train::{AdamW, AdamWConfig, LrSchedule, PhaseTimer, Sequence, TrainStep};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

fn target() -> LoadedTarget {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama");
    load_target(&p, &Device::Cpu, DType::F32).unwrap()
}

fn greedy(n: usize) -> GenerateConfig {
    GenerateConfig {
        cancel: None,
        max_new_tokens: n,
        stop_tokens: vec![],
        sampling: SamplingConfig::greedy(),
    }
}

/// (prompt, prompt + target's greedy continuation, loss mask over the continuation).
fn corpus(t: &LoadedTarget) -> Vec<(Vec<u32>, Vec<u32>, Vec<bool>)> {
    (0..3u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..5).map(|j| (i * 71 + j * 13 + 5) % 263).collect();
            let g = generate_ar(t.model.as_ref(), &prompt, &greedy(40), &mut |_| {}).unwrap();
            let seq: Vec<u32> = prompt.iter().copied().chain(g.tokens).collect();
            let mask = (0..seq.len()).map(|p| p >= prompt.len() - 1).collect();
            (prompt, seq, mask)
        })
        .collect()
}

fn fresh(
    cfg: &DFlashConfig,
    weights: BTreeMap<String, candle_core::Tensor>,
) -> (DFlashDrafter, VarMap) {
    let vm = VarMap::new();
    {
        let mut d = vm.data().lock().unwrap();
        for (k, v) in weights {
            d.insert(k, Var::from_tensor(&v).unwrap());
        }
    }
    (
        DFlashDrafter::new(cfg, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu)).unwrap(),
        vm,
    )
}

/// One step of `ts` over `group` with the anchors of `seed`.
fn step_once(
    ts: &TrainStep,
    t: &LoadedTarget,
    d: &DFlashDrafter,
    opt: &mut AdamW,
    group: &[Sequence],
    seed: u64,
) -> dflash_train::StepReport {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    ts.run(
        t.model.as_ref(),
        d,
        opt,
        group,
        &mut rng,
        &mut PhaseTimer::new(None).unwrap(),
    )
    .unwrap()
}

/// The corpus as one step's group of sequences.
fn sequences(data: &[(Vec<u32>, Vec<u32>, Vec<bool>)]) -> Vec<Sequence<'_>> {
    data.iter()
        .map(|(_, seq, mask)| Sequence {
            tokens: seq,
            loss_mask: mask,
        })
        .collect()
}

fn optimizer(vm: &VarMap) -> AdamW {
    let params: HashMap<String, Var> = vm.data().lock().unwrap().clone();
    AdamW::new(
        params,
        AdamWConfig {
            lr: 3e-3,
            weight_decay: 0.0,
            ..Default::default()
        },
    )
    .unwrap()
}

fn train(
    t: &LoadedTarget,
    d: &DFlashDrafter,
    opt: &mut AdamW,
    data: &[(Vec<u32>, Vec<u32>, Vec<bool>)],
    steps: std::ops::Range<usize>,
    total: usize,
) -> Vec<f32> {
    let ts = TrainStep {
        anchors_per_sequence: 16,
        gamma: 4.0,
        schedule: LrSchedule {
            peak: 3e-3,
            warmup: 10,
            total,
        },
        micro_batch_tokens: 1 << 20,
        distill: 0.0,
        convention: Default::default(),
    };
    steps
        .map(|s| {
            let (_, seq, mask) = &data[s % data.len()];
            let mut rng = ChaCha8Rng::seed_from_u64(1000 + s as u64);
            let group = [Sequence {
                tokens: seq,
                loss_mask: mask,
            }];
            ts.run(
                t.model.as_ref(),
                d,
                opt,
                &group,
                &mut rng,
                &mut PhaseTimer::new(None).unwrap(),
            )
            .unwrap()
            .loss
            .loss
        })
        .collect()
}

#[test]
fn tiny_drafter_overfits_and_then_decodes_with_long_acceptance() {
    let t = target();
    let data = corpus(&t);
    let cfg = config_for_target(&t, 2, 4, 262);
    let (d, vm) = fresh(&cfg, random_weights(&cfg, 3).unwrap());
    let (prompt, _, _) = &data[0];
    let tau = |d: &DFlashDrafter| {
        let mut r = DFlashRunner::new(d);
        let g = generate_speculative(
            t.model.as_ref(),
            &mut r,
            prompt,
            &greedy(40),
            SpecMode::DFlash,
            &mut |_| {},
        )
        .unwrap();
        let ar = generate_ar(t.model.as_ref(), prompt, &greedy(40), &mut |_| {}).unwrap();
        assert_eq!(g.tokens, ar.tokens);
        g.spec.unwrap().mean_acceptance()
    };
    let before = tau(&d);
    let mut opt = optimizer(&vm);
    let losses = train(&t, &d, &mut opt, &data, 0..240, 240);
    let (first, last) = (
        losses[..6].iter().sum::<f32>() / 6.0,
        losses[losses.len() - 6..].iter().sum::<f32>() / 6.0,
    );
    eprintln!("loss {first:.3} -> {last:.3}");
    assert!(
        last < 0.25 * first,
        "loss must fall a lot: {first} -> {last}"
    );
    let after = tau(&d);
    eprintln!("tau {before:.2} -> {after:.2} (block 4)");
    assert!(
        after > 3.0,
        "an overfit drafter must accept nearly full blocks on its corpus: tau {after}"
    );
}

#[test]
fn resume_continues_bit_for_bit() {
    let t = target();
    let data = corpus(&t);
    let cfg = config_for_target(&t, 1, 4, 262);
    let init = random_weights(&cfg, 9).unwrap();
    let (d, vm) = fresh(&cfg, init.clone());
    let mut opt = optimizer(&vm);
    let straight = train(&t, &d, &mut opt, &data, 0..8, 8);

    let (d1, vm1) = fresh(&cfg, init);
    let mut opt1 = optimizer(&vm1);
    let mut resumed = train(&t, &d1, &mut opt1, &data, 0..4, 8);
    let dir = tempfile::tempdir().unwrap();
    let weights: BTreeMap<String, candle_core::Tensor> = vm1
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    save_drafter(dir.path(), &cfg, &weights, 1 << 30).unwrap();
    opt1.save(&dir.path().join("optimizer.safetensors"))
        .unwrap();
    drop((d1, vm1, opt1));
    // a fresh process would do exactly this: load the checkpoint and the optimizer state
    let loaded = load_drafter(dir.path(), &Device::Cpu, DType::F32).unwrap();
    drop(loaded);
    let ckpt =
        candle_core::safetensors::load(dir.path().join("model.safetensors"), &Device::Cpu).unwrap();
    let (d2, vm2) = fresh(&cfg, ckpt.into_iter().collect());
    let mut opt2 = optimizer(&vm2);
    opt2.load(&dir.path().join("optimizer.safetensors"), 4)
        .unwrap();
    resumed.extend(train(&t, &d2, &mut opt2, &data, 4..8, 8));
    assert_eq!(straight, resumed, "losses with and without an interruption");
}

#[test]
fn bf16_compute_trains_the_f32_masters_over_packed_sequences() {
    let t = target();
    let data = corpus(&t);
    let cfg = config_for_target(&t, 1, 4, 262);
    let (_, vm) = fresh(&cfg, random_weights(&cfg, 5).unwrap());
    let mut opt = optimizer(&vm);
    let before: Vec<f32> = vm.data().lock().unwrap()["fc.weight"]
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let ts = TrainStep {
        anchors_per_sequence: 16,
        gamma: 4.0,
        schedule: LrSchedule {
            peak: 3e-3,
            warmup: 2,
            total: 30,
        },
        // smaller than the group: several padded micro-batches, gradients accumulated
        micro_batch_tokens: 100,
        distill: 0.0,
        convention: Default::default(),
    };
    let group = sequences(&data);
    let mut losses = vec![];
    for s in 0..30 {
        // a fresh bf16 view of the masters every step, as the trainer does
        let d = dflash_train::compute_drafter(&cfg, &vm, DType::BF16, t.model.as_ref()).unwrap();
        let r = step_once(&ts, &t, &d, &mut opt, &group, s);
        assert_eq!(
            r.tokens,
            group.iter().map(|g| g.tokens.len()).sum::<usize>()
        );
        losses.push(r.loss.loss);
    }
    let after = &vm.data().lock().unwrap()["fc.weight"];
    assert_eq!(after.dtype(), DType::F32, "masters stay f32");
    let after: Vec<f32> = after.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
    assert!(
        before.iter().zip(&after).any(|(a, b)| a != b),
        "gradients reached the masters"
    );
    eprintln!("bf16 packed loss {:.3} -> {:.3}", losses[0], losses[29]);
    assert!(
        losses[29] < 0.6 * losses[0],
        "bf16 training must learn: {losses:?}"
    );
}

#[test]
fn micro_batching_and_padding_do_not_change_the_step() {
    // one padded micro-batch of all sequences vs one sequence per micro-batch: same loss, same
    // statistics, same gradient norm (f32, up to summation order)
    let t = target();
    let mut data = corpus(&t);
    data[1].1.truncate(30);
    data[1].2.truncate(30);
    let cfg = config_for_target(&t, 2, 4, 262);
    let init = random_weights(&cfg, 11).unwrap();
    let run = |cap: usize| {
        let (d, vm) = fresh(&cfg, init.clone());
        let mut opt = optimizer(&vm);
        let ts = TrainStep {
            anchors_per_sequence: 8,
            gamma: 4.0,
            schedule: LrSchedule {
                peak: 3e-3,
                warmup: 0,
                total: 10,
            },
            micro_batch_tokens: cap,
            distill: 0.0,
            convention: Default::default(),
        };
        let group = sequences(&data);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        ts.run(
            t.model.as_ref(),
            &d,
            &mut opt,
            &group,
            &mut rng,
            &mut PhaseTimer::new(None).unwrap(),
        )
        .unwrap()
    };
    let one = run(1 << 20);
    let each = run(1);
    assert_eq!(one.blocks, each.blocks);
    assert_eq!(one.tokens, each.tokens);
    assert!(
        (one.loss.loss - each.loss.loss).abs() < 1e-4 * one.loss.loss.abs(),
        "loss {} vs {}",
        one.loss.loss,
        each.loss.loss
    );
    assert_eq!(one.loss.accuracy, each.loss.accuracy);
    assert_eq!(one.loss.streak, each.loss.streak);
    assert!(
        (one.grad_norm - each.grad_norm).abs() < 1e-4 * one.grad_norm,
        "grad norm {} vs {}",
        one.grad_norm,
        each.grad_norm
    );
}

/// Self-distillation: the soft label of block row k at anchor a is the target's distribution at
/// position a + k − 1 of the same padded micro-batch row, so on the target's own greedy text its
/// argmax is the row's label; a step with soft labels trains and reaches every parameter.
#[test]
fn soft_labels_point_at_the_target_output_for_each_block_row() {
    let t = target();
    let data = corpus(&t);
    let bs = 4;
    let s = data.iter().map(|d| d.1.len()).max().unwrap();
    let (b, n) = (data.len(), 5);
    let mut tokens = vec![0u32; b * s];
    let mut anchors = vec![];
    for (r, (prompt, seq, _)) in data.iter().enumerate() {
        tokens[r * s..r * s + seq.len()].copy_from_slice(seq);
        // anchors from the last prompt token on, blocks reaching past the end included
        anchors.extend((0..n).map(|j| (prompt.len() - 1 + j * 9) as u32));
    }
    let probs = dflash_train::batch_probs(t.model.as_ref(), b, &tokens).unwrap();
    let top: Vec<u32> = probs.argmax(1).unwrap().to_vec1().unwrap();
    let pos = dflash_train::soft_label_positions(s, n, bs, &anchors);
    let mut checked = 0;
    for (i, &p) in pos.iter().enumerate() {
        let (r, a, k) = (i / (n * bs), anchors[i / bs] as usize, i % bs);
        let seq = &data[r].1;
        if k == 0 || a + k >= seq.len() {
            continue;
        }
        assert_eq!(
            top[p as usize],
            seq[a + k],
            "row {i}: sequence {r}, anchor {a}, slot {k}"
        );
        checked += 1;
    }
    assert!(checked > 40, "{checked} rows checked");

    let cfg = config_for_target(&t, 2, bs, 262);
    let (d, vm) = fresh(&cfg, random_weights(&cfg, 9).unwrap());
    let mut opt = optimizer(&vm);
    let ts = TrainStep {
        anchors_per_sequence: 8,
        gamma: 4.0,
        schedule: LrSchedule {
            peak: 3e-3,
            warmup: 1,
            total: 10,
        },
        micro_batch_tokens: 1 << 20,
        distill: 0.5,
        convention: Default::default(),
    };
    let group = sequences(&data);
    let r = step_once(&ts, &t, &d, &mut opt, &group, 4);
    assert!(r.loss.loss.is_finite() && r.loss.loss > 0.0);
    assert!(r.grad_norm > 0.0);
}
