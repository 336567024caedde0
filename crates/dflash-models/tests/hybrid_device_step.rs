//! The Qwen3.5 / Qwen3.6 hybrids' device step (the default on CUDA: Gated DeltaNet layers
//! on fixed state buffers, gated attention over the whole cache buffer under a device-built mask,
//! every step shape eager once, captured, then replayed as a CUDA graph) against the CPU host
//! path on the same random weights, through a decode that mixes AR steps, causal blocks cropped
//! mid-block and trees compacted to a root path, with taps. On the GPU (`DFLASH_TEST_DEVICE=cuda`)
//! the kernels and graphs themselves (within 2e-4: cuBLAS attention over the whole buffer); on the
//! CPU the step's host emulation (the same buffers, metadata, masks and commits, host kernels),
//! which checks its bookkeeping bit for bit. Then the same in bf16 against the host path on the
//! same device (bit for bit on the CPU, within 5 % of the logits' scale on the GPU).

mod common;
use candle_core::{DType, Device};
use dflash_core::AttentionMask;
use dflash_models::random::random_target_tensors;
use dflash_models::HybridDecoder;

/// The decode every pair runs: a prompt longer than a device step (host path), a 20-row chunk
/// that is one, AR steps, DFlash blocks cropped mid-block, padded DDTree trees compacted to a root
/// path (deep enough to pass the conv window), and AR steps after. The steps ran as device steps
/// and, on the GPU, AR, block and tree shapes replay from graphs.
fn decode_script(pair: &mut common::Pair, dev: &Device) {
    let mut len = 0u32;
    // a prompt longer than a device step (host path), then one that is a device step
    let prompt: Vec<u32> = (0..150).map(|i| (i * 37 % 211) as u32).collect();
    pair.step(
        prompt,
        (0..150).collect(),
        AttentionMask::Causal,
        "prefill (host path)",
    );
    len += 150;
    pair.step(
        (0..20).map(|i| (i * 7 % 211) as u32).collect(),
        (len..len + 20).collect(),
        AttentionMask::Causal,
        "prefill chunk (device step)",
    );
    len += 20;
    for i in 0..5 {
        pair.step(vec![i * 11], vec![len], AttentionMask::Causal, "ar");
        len += 1;
    }
    // DFlash blocks: 16 rows verified, a few kept (a rejection mid-block)
    for i in 0..4u32 {
        pair.step(
            (0..16).map(|j| (j * 5 + i) % 211).collect(),
            (len..len + 16).collect(),
            AttentionMask::Causal,
            "block",
        );
        let keep = 1 + (i as usize * 5) % 16;
        pair.crop(len as usize + keep);
        len += keep as u32;
    }
    // DDTree trees (padded to a bucket), one root path kept, deep enough to pass the conv window
    let parents = vec![-1i64, 0, 0, 1, 1, 3, 2, 5, 7, 8, 4, 9];
    let depth = |mut r: usize| {
        let mut d = 0;
        while parents[r] >= 0 {
            r = parents[r] as usize;
            d += 1;
        }
        d
    };
    let path = [0u32, 1, 3, 5, 7, 8, 9, 11];
    for i in 0..4u32 {
        let pos: Vec<u32> = (0..parents.len()).map(|r| len + depth(r) as u32).collect();
        pair.step(
            (0..parents.len() as u32)
                .map(|j| (j * 13 + i) % 211)
                .collect(),
            pos,
            AttentionMask::Tree {
                parents: parents.clone(),
            },
            "tree",
        );
        let kept = &path[..2 + i as usize * 2];
        pair.keep_rows(len as usize, kept);
        len += kept.len() as u32;
    }
    for i in 0..3 {
        pair.step(
            vec![i * 3 + 1],
            vec![len],
            AttentionMask::Causal,
            "ar after trees",
        );
        len += 1;
    }
    assert!(
        pair.bc.recurrent_step.is_some(),
        "the steps ran as device steps"
    );
    assert!(
        !dev.is_cuda()
            || pair.bc.step_graphs.captured() >= 3
            || std::env::var("DFLASH_CUDA_GRAPHS").as_deref() == Ok("0"),
        "AR, block and tree shapes replay from graphs ({} captured)",
        pair.bc.step_graphs.captured()
    );
}

#[test]
fn hybrid_device_steps_replay_the_cpu_host_path() {
    let (dev, _) = common::device_and_dtype();
    let cfg = common::tiny_hybrid(32);
    let w = random_target_tensors(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
    let on = |d: &Device, dtype: DType| -> HybridDecoder {
        let w = w
            .iter()
            .map(|(k, t)| (k.clone(), t.to_dtype(dtype).unwrap().to_device(d).unwrap()))
            .collect();
        HybridDecoder::new(&cfg, candle_nn::VarBuilder::from_tensors(w, dtype, d)).unwrap()
    };
    let stepped = |dtype: DType| {
        let mut m = on(&dev, dtype);
        if dev.is_cuda() {
            m.set_device_step(true);
        } else {
            m.emulate_device_step_on_cpu();
        }
        assert!(
            m.device_step(),
            "the device step must be available on {dev:?}"
        );
        m
    };
    // f32, against the CPU host path: on the CPU the emulation is the host path's arithmetic
    // (equal bit for bit), on the GPU cuBLAS attention over the whole buffer (within 2e-4)
    let (cpu, gpu) = (on(&Device::Cpu, DType::F32), stepped(DType::F32));
    let tol = if dev.is_cuda() {
        2e-4
    } else {
        f32::MIN_POSITIVE
    };
    let mut pair = common::Pair::new(&cpu, &gpu, 500, &[0usize, 3], tol);
    decode_script(&mut pair, &dev);
    // bf16 against the host path on the same device: on the CPU again bit for bit; on the GPU
    // the same kernels but the attention, so within a few bf16 roundings of the logits' scale
    let mut host = on(&dev, DType::BF16);
    host.set_device_step(false);
    assert!(!host.device_step());
    let step = stepped(DType::BF16);
    let mut pair = match dev.is_cuda() {
        true => common::Pair::new(&host, &step, 500, &[0usize, 3], 5e-2).relative(),
        false => common::Pair::new(&host, &step, 500, &[0usize, 3], f32::MIN_POSITIVE),
    };
    decode_script(&mut pair, &dev);
}

/// The folded state commit (CUDA, `DFLASH_GDN_FOLD=1`: each device step replays the last verify's
/// kept rows inside its rule kernels) gives the separate commit's bits: the same decode on two caches
/// of one model, one with the fold off, every logit and tap equal and every recurrent state equal
/// at the end, in f32 and bf16 — and the fold ran (after each crop, path compaction and AR step).
/// On the CPU the step's host emulation folds with host kernels (its bookkeeping: the pending
/// count in the metadata, the prologue before the records are overwritten, the count after).
#[test]
fn the_folded_state_commit_gives_the_separate_commits_bits() {
    let (dev, _) = common::device_and_dtype();
    let cfg = common::tiny_hybrid(32);
    let w = random_target_tensors(&cfg, DType::F32, &Device::Cpu, 5).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let w = w
            .iter()
            .map(|(k, t)| {
                (
                    k.clone(),
                    t.to_dtype(dtype).unwrap().to_device(&dev).unwrap(),
                )
            })
            .collect();
        let mut m =
            HybridDecoder::new(&cfg, candle_nn::VarBuilder::from_tensors(w, dtype, &dev)).unwrap();
        if dev.is_cuda() {
            m.set_device_step(true);
        } else {
            m.emulate_device_step_on_cpu();
        }
        assert!(m.device_step());
        let mut pair = common::Pair::new(&m, &m, 500, &[0usize, 3], f32::MIN_POSITIVE);
        pair.ac.set_fold_commit(false);
        pair.bc.set_fold_commit(true);
        assert!(!pair.ac.fold_commit());
        assert_eq!(
            pair.bc.fold_commit(),
            dev.is_cpu() || dflash_core::gated_delta_layer::fold_commit_supported(),
            "the fold runs on CUDA (its kernels) and in the CPU's emulation (host kernels)"
        );
        decode_script(&mut pair, &dev);
        // a commit of more rows than a fold takes (a 40-row chunk) settles before the next step
        let len = pair.bc.len() as u32;
        pair.step(
            (0..40).map(|i| (i * 3 % 211) as u32).collect(),
            (len..len + 40).collect(),
            AttentionMask::Causal,
            "40-row chunk",
        );
        let before = pair.bc.folded_commits();
        pair.step(
            vec![7],
            vec![len + 40],
            AttentionMask::Causal,
            "ar after the chunk",
        );
        assert_eq!(
            pair.bc.folded_commits(),
            before,
            "{dtype:?}: a 40-row commit is not folded"
        );
        pair.step(
            vec![9],
            vec![len + 41],
            AttentionMask::Causal,
            "ar after that",
        );
        assert_eq!(
            pair.bc.folded_commits(),
            before + usize::from(pair.bc.fold_commit()),
            "{dtype:?}: the AR step's commit is folded again"
        );
        let folds = pair.bc.folded_commits();
        assert_eq!(pair.ac.folded_commits(), 0);
        if pair.bc.fold_commit() {
            // each AR step's and block's commit folded into the next step (on CUDA the trees'
            // compacted paths too: 5 AR + 4 blocks + 4 trees + 3 AR; on the CPU a compacted path
            // is a gathered record, settled before the next step)
            let least = if dev.is_cuda() { 12 } else { 9 };
            assert!(folds >= least, "{dtype:?}: {folds} commits folded");
        } else {
            assert_eq!(folds, 0);
        }
        pair.ac.settle_recurrent().unwrap();
        pair.bc.settle_recurrent().unwrap();
        for (la, lb) in pair.ac.layers.iter_mut().zip(pair.bc.layers.iter_mut()) {
            if let (
                dflash_core::LayerCache::Recurrent(ra),
                dflash_core::LayerCache::Recurrent(rb),
            ) = (la, lb)
            {
                let (sa, sb) = (ra.state().unwrap().unwrap(), rb.state().unwrap().unwrap());
                for (x, y, what) in [(&sa.ssm, &sb.ssm, "state"), (&sa.conv, &sb.conv, "window")] {
                    let (x, y) = (
                        x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    );
                    assert!(
                        x == y,
                        "{dtype:?}: the folded {what} is not the separate commit's"
                    );
                }
            }
        }
    }
}
