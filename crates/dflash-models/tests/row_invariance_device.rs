//! GPU tests of row invariance, what bit-exact bf16 speculative decoding rests on: the streaming
//! GEMM (`dflash_core::stream_gemm`) gives a row the same bits whatever the row count, the tree
//! attention reduces a tree row's keys as the one-row step at its position does, and (under
//! `DFLASH_STREAM_GEMM=all`) a whole bf16 verify equals sequential AR steps. CUDA only
//! (`DFLASH_TEST_DEVICE=cuda`); every test returns early on the CPU.

mod common;
use candle_core::{DType, Device, Tensor};

fn device() -> Device {
    common::device_and_dtype().0
}

fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    common::max_abs_diff(a, b)
}

/// The streaming GEMM tests' (f32 out, K, N): SmolLM2's q/k/v and down shapes, a wide K, an N
/// that is not a multiple of 16 (f32 logits).
const STREAM_TEST_SHAPES: [(bool, usize, usize); 4] = [
    (false, 576, 960),
    (false, 1536, 576),
    (false, 4096, 1000),
    (true, 1088, 777),
];

/// A bf16 tensor of normal draws (mean 0, deviation `std`) on `dev`.
fn randn_bf16(std: f32, shape: (usize, usize), dev: &Device) -> Tensor {
    Tensor::randn(0f32, std, shape, dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
}

/// A tree row's attention is bit-identical to a one-row step at its position over the same keys
/// (the committed rows, then the row's ancestors in depth order): what makes a bf16 tree verify
/// compute each node exactly as the AR step would. Several trees and context lengths (chunk and
/// tile boundaries fall inside and outside the step), f32 and bf16. CUDA only.
#[test]
fn a_tree_row_attends_exactly_as_the_one_row_step_at_its_position() {
    use dflash_core::step::{kv_append_at, tree_ancestors, tree_attention, StepMeta};
    let dev = device();
    if !dev.is_cuda() {
        return;
    }
    for (dtype, d, h, kv, past, parents) in [
        (
            DType::BF16,
            64,
            9,
            3,
            61,
            (0..65)
                .map(|i: i64| if i == 0 { -1 } else { (i - 1) / 4 })
                .collect::<Vec<i64>>(),
        ),
        (
            DType::BF16,
            128,
            32,
            8,
            500,
            (0..17).map(|i: i64| i - 1).collect(),
        ),
        (
            // Qwen3-8B's heads, a 65-node tree of deep bent paths (depths to ~50) whose step
            // positions straddle 64-key tiles and splits (past 2040): rows with bent paths read their keys
            // row by row on the tensor-core kernel
            DType::BF16,
            128,
            32,
            8,
            2040,
            (0..65)
                .map(|i: i64| match i {
                    0 => -1,
                    i if i % 4 == 0 => i / 2,
                    i => i - 1,
                })
                .collect(),
        ),
        (
            DType::F32,
            64,
            4,
            2,
            190,
            (0..33)
                .map(|i: i64| if i == 0 { -1 } else { (i * 7 + 3) % i })
                .collect(),
        ),
    ] {
        let n = parents.len();
        let cap = past + n + 8;
        let rnd = |shape: (usize, usize, usize, usize)| {
            Tensor::randn(0f32, 1.0, shape, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .to_device(&dev)
                .unwrap()
        };
        let (kb, vb) = (rnd((1, kv, cap, d)), rnd((1, kv, cap, d)));
        let (k, v, q) = (rnd((1, kv, n, d)), rnd((1, kv, n, d)), rnd((1, h, n, d)));
        let tokens = vec![0u32; n];
        let positions: Vec<u32> = (0..n as u32).collect();
        let meta = StepMeta::new(past, &tokens, &positions, Some(&parents), 4096).unwrap();
        let meta = Tensor::from_slice(&meta.words, meta.words.len(), &dev).unwrap();
        kv_append_at(&kb, &vb, &k, &v, &meta).unwrap();
        let scale = 1.0 / (d as f32).sqrt();
        let tree = tree_attention(
            &q,
            &kb,
            &vb,
            &meta,
            &tree_ancestors(&meta, n).unwrap(),
            scale,
        )
        .unwrap();
        // every row of the bf16 trees (bent and straight paths alike), four of the others; a
        // bent row (path not the step rows 0..depth) only where keys are taken by position (bf16
        // by default only under DFLASH_STREAM_GEMM=all; DFLASH_TREE_KEYS=position forces it)
        use dflash_core::step::{keys_by_position, tensor_core_attention};
        let by_position = keys_by_position(tensor_core_attention(dtype, d));
        let rows: Vec<usize> = if dtype == DType::BF16 {
            (0..n).collect()
        } else {
            vec![0, 1, n / 2, n - 1]
        };
        for r in rows {
            let mut path = vec![r];
            while parents[*path.last().unwrap()] >= 0 {
                path.push(parents[*path.last().unwrap()] as usize);
            }
            path.reverse();
            let depth = path.len() - 1;
            if !by_position && depth != r {
                continue;
            }
            // the AR step's cache: the committed rows, then the ancestors at their positions
            let idx = Tensor::from_vec(
                path.iter().map(|&p| p as u32).collect::<Vec<_>>(),
                depth + 1,
                &dev,
            )
            .unwrap();
            let at = |buf: &Tensor, step: &Tensor| -> Tensor {
                let mut b = buf.copy().unwrap();
                let rows = step.index_select(&idx, 2).unwrap();
                b = b
                    .slice_assign(&[0..1, 0..kv, past..past + depth + 1, 0..d], &rows)
                    .unwrap();
                b
            };
            let (kb1, vb1) = (at(&kb, &k), at(&vb, &v));
            let one = StepMeta::new(past + depth, &[0], &[0], Some(&[-1]), 4096).unwrap();
            let one = Tensor::from_slice(&one.words, one.words.len(), &dev).unwrap();
            let q1 = q.narrow(2, r, 1).unwrap().contiguous().unwrap();
            let ar = tree_attention(
                &q1,
                &kb1,
                &vb1,
                &one,
                &tree_ancestors(&one, 1).unwrap(),
                scale,
            )
            .unwrap();
            let row = tree.narrow(1, r, 1).unwrap();
            // bf16 trees of more than 16 rows with keys by step row may take wider splits
            // (step_cuda::tree_chunk: their rows' bits already differ from AR steps' through the
            // GEMMs), so there the split boundaries differ from the one-row step's: the same
            // values up to the merge's rounding; everywhere else, the same bits
            let bound = if dtype == DType::BF16 && !by_position && n > 16 {
                2e-2
            } else {
                0.0
            };
            assert!(
                max_abs(&row, &ar) <= bound,
                "{dtype:?} past {past} n {n}: row {r} (depth {depth}): {} > {bound}",
                max_abs(&row, &ar)
            );
        }
    }
}

/// The bf16 attention for steps of few query vectors (`group_attn_mma`, one warp's vectors a block,
/// the tile's keys and channels over four warps) gives every row the general tensor-core kernel's
/// bits: one-row steps, 16-row chains and branching 16-row trees, keys by position and by step
/// row (bits alone, the drafter's layout), 64- and 128-wide heads, contexts inside one split and
/// across many. CUDA only.
#[test]
fn few_vector_attention_gives_the_general_kernels_bits() {
    use dflash_core::step::{tree_attention, tree_attention_general};
    let dev = device();
    if !dev.is_cuda() {
        return;
    }
    let chain: Vec<i64> = (0..16).map(|i| i - 1).collect();
    let tree: Vec<i64> = (0..16)
        .map(|i| if i == 0 { -1 } else { (i - 1) / 3 })
        .collect();
    for (d, h, kv) in [(64, 9, 3), (128, 32, 8)] {
        for past in [5, 61, 700] {
            for parents in [vec![-1], chain.clone(), tree.clone()] {
                let n = parents.len();
                let st = common::random_attention_step(&dev, (d, h, kv), past, &parents, 8);
                let scale = 1.0 / (d as f32).sqrt();
                for anc in [&st.ancestors, &st.bits] {
                    let (q, kb, vb, meta) = (&st.q, &st.kb, &st.vb, &st.meta);
                    let fast = tree_attention(q, kb, vb, meta, anc, scale).unwrap();
                    let general = tree_attention_general(q, kb, vb, meta, anc, scale).unwrap();
                    assert_eq!(
                        max_abs(&fast, &general),
                        0.0,
                        "d {d} heads {h}/{kv} past {past} rows {n} ancestors {:?}",
                        anc.dims()
                    );
                }
            }
        }
    }
}

/// The row kernel (`tree_attn_rows.cu`, wide bf16 steps of 128- and 64-wide heads with keys by step row)
/// gives the general tensor-core kernel's bits at the same splits: one-row steps (their own entry,
/// splits merged in the kernel), chains and branching trees of 16 to 257 rows, contexts whose tiles fall inside, across and past the step's keys, splits of
/// 64 to 448 keys and the rule's, one to four query heads a kv head; with keys by position
/// (`DFLASH_TREE_KEYS=position`), the row kernel on the cached splits and the general kernel on the
/// rest. CUDA only.
#[test]
fn row_kernel_gives_the_general_kernels_bits() {
    use dflash_core::step::{tree_attention_on_kernel, StepKernel};
    let dev = device();
    if !dev.is_cuda() {
        return;
    }
    // a branching tree: each node's parent drawn from the nodes before it (SplitMix-style mixing)
    let tree = |n: usize| -> Vec<i64> {
        (0..n as i64)
            .map(|i| {
                if i == 0 {
                    return -1;
                }
                let mut z = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                z = (z ^ (z >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                (z >> 33) as i64 % i
            })
            .collect()
    };
    let chain = |n: usize| -> Vec<i64> { (0..n as i64).map(|i| i - 1).collect() };
    let mut cases = 0;
    for (d, h, kv) in [(128, 32, 8), (128, 8, 8), (128, 16, 4), (64, 9, 3)] {
        for (past, parents) in [
            (5, chain(1)),
            (700, chain(1)),
            (2047, chain(1)),
            (5, chain(16)),
            (700, chain(16)),
            (61, tree(65)),
            (2000, tree(65)),
            (2047, chain(65)),
            (300, tree(130)),
            (1100, tree(257)),
        ] {
            if (h == 16 || d == 64) && parents.len() > 65 {
                continue; // (fewer cases for the third and fourth head layouts)
            }
            let n = parents.len();
            let st = common::random_attention_step(&dev, (d, h, kv), past, &parents, 8);
            let scale = 1.0 / (d as f32).sqrt();
            // the ancestor bits (keys by step row), and the full records (keys by position under
            // DFLASH_TREE_KEYS=position or --bit-exact: the row kernel takes the splits of cached
            // keys alone, the general kernel the rest)
            for (anc, chunk) in [
                (&st.bits, 0),
                (&st.bits, 64),
                (&st.bits, 256),
                (&st.bits, 448),
                (&st.ancestors, 0),
                (&st.ancestors, 64),
            ] {
                if n == 1 && anc.dims() == st.ancestors.dims() {
                    continue; // (a one-row step takes the row kernel with keys by step row alone)
                }
                // the rules' splits (chunk 0): each kernel its own rule, equal for 128-wide heads
                // under the default policy; 64-wide heads' rules differ (a 65-row tree over 2,000
                // keys: 128-key splits on the row kernel, 64 on the general one), and under keys
                // by position the one-row rule is off for the general kernel alone
                if chunk == 0 && (d == 64 || dflash_core::step::keys_by_position(true)) {
                    continue;
                }
                let (q, kb, vb, meta) = (&st.q, &st.kb, &st.vb, &st.meta);
                let rows =
                    tree_attention_on_kernel(q, kb, vb, meta, anc, scale, StepKernel::Rows, chunk)
                        .unwrap();
                let general = tree_attention_on_kernel(
                    q,
                    kb,
                    vb,
                    meta,
                    anc,
                    scale,
                    StepKernel::General,
                    chunk,
                )
                .unwrap();
                let what = format!(
                    "d {d} heads {h}/{kv} past {past} rows {n} chunk {chunk} ancestors {:?}",
                    anc.dims()
                );
                assert!(common::max_abs(&general).is_finite(), "{what}");
                assert!(common::max_abs(&rows).is_finite(), "{what}");
                assert_eq!(max_abs(&rows, &general), 0.0, "{what}");
                cases += 1;
            }
        }
    }
    assert!(cases >= 110);
}

/// Bit-exact bf16 (`DFLASH_STREAM_GEMM=all`, the CLI's `--bit-exact`): every row of a bf16 tree
/// verify and of a 16-token causal verify gives, bit for bit, the logits of one-token AR steps over
/// the same tokens at the same positions (the property that makes speculative output equal AR's in
/// bf16). Runs only under that policy (`scripts/gpu-decode-bench.sh` runs it so). CUDA only; the
/// CPU's twin is `tests/bit_exact_cpu.rs`.
#[test]
fn bit_exact_bf16_verify_rows_equal_sequential_ar_steps() {
    use dflash_core::stream_gemm::{stream_policy, StreamPolicy};
    let dev = device();
    if !dev.is_cuda() || stream_policy() != StreamPolicy::All {
        return;
    }
    // 40-, 64- and 256-node trees (the last padded to a 257-row step): under this policy every
    // step of up to 288 rows runs as a device step on the AR step's 64-key splits (until session
    // 30 wider trees took the host path, cuBLAS attention over a mask — not row-invariant: a
    // 257-node tree's root differed by 3.6e-3, H200, session 14)
    common::check_verify_rows_equal_ar_steps(&dev, &[40, 64, 256]);
}

/// The weight-streaming tensor-core GEMM against an f32 GEMM of the upcast operands, and
/// bit-identical whatever the row count: each row alone, or in any smaller call, gives exactly its
/// row of the 40-row product (three 16-row groups; the property bf16 losslessness needs). CUDA
/// only.
#[test]
fn stream_matmul_matches_and_does_not_depend_on_the_row_count() {
    use dflash_core::stream_gemm::stream_matmul_always as stream_matmul;
    let dev = device();
    if !dev.is_cuda() {
        return;
    }
    for (f32_out, k, n) in STREAM_TEST_SHAPES {
        // 130 rows: the 64-row groups' kernel (and its last partial group) against every width
        let x = randn_bf16(1.0, (130, k), &dev);
        let w = randn_bf16(0.05, (n, k), &dev);
        let y = stream_matmul(&x, &w, f32_out)
            .unwrap()
            .expect("130 bf16 rows stream");
        assert_eq!(y.dims(), &[130, n]);
        let want = x
            .to_dtype(DType::F32)
            .unwrap()
            .matmul(&w.to_dtype(DType::F32).unwrap().t().unwrap())
            .unwrap();
        // f32 outputs: f32 rounding; bf16 outputs: half a bf16 step (2^-9 relative) of the
        // largest output, doubled
        let top = max_abs(&want, &want.zeros_like().unwrap());
        let tol = if f32_out { 1e-3 } else { 4e-3 * top };
        let err = max_abs(&y, &want);
        assert!(err < tol, "{k}x{n}: {err}");
        for (start, rows) in [
            (0usize, 1usize),
            (7, 1),
            (39, 1),
            (3, 5),
            (8, 8),
            (1, 9),
            (5, 33),
            (100, 17),
            (60, 65),
            // (with DFLASH_STREAM_WIDE=1, 17..=80 rows take the wide kernel: every group count)
            (20, 50),
            (40, 80),
            (2, 128),
        ] {
            let part = stream_matmul(&x.narrow(0, start, rows).unwrap(), &w, f32_out)
                .unwrap()
                .unwrap();
            let same = y.narrow(0, start, rows).unwrap();
            assert_eq!(max_abs(&part, &same), 0.0, "{k}x{n}: rows {start}..+{rows}");
        }
    }
    // not its call: f32, too many rows, K not a multiple of 64
    let w = Tensor::zeros((64, 128), DType::BF16, &dev).unwrap();
    let x32 = Tensor::zeros((1, 128), DType::F32, &dev).unwrap();
    assert!(stream_matmul(&x32, &w.to_dtype(DType::F32).unwrap(), false)
        .unwrap()
        .is_none());
    let x289 = Tensor::zeros((289, 128), DType::BF16, &dev).unwrap();
    assert!(stream_matmul(&x289, &w, false).unwrap().is_none());
    let w96 = Tensor::zeros((64, 96), DType::BF16, &dev).unwrap();
    let x96 = Tensor::zeros((1, 96), DType::BF16, &dev).unwrap();
    assert!(stream_matmul(&x96, &w96, false).unwrap().is_none());
}

/// The bulk-copy weight fetch (`DFLASH_STREAM_BULK`, compute 9.0+) gives the narrow kernel's
/// outputs bit for bit, at every compiled stage shape: partial last stages (K = 576, 1088), an N
/// that is not a multiple of 16, 1–40 rows (several 16-row groups), bf16 and f32 out. CUDA only;
/// skipped (returns) on devices older than compute 9.0, where the bulk kernels never run.
#[test]
fn bulk_weight_fetch_gives_the_narrow_kernels_bits() {
    use dflash_core::stream_gemm::{
        stream_matmul_always, stream_matmul_bulk_always, BULK_VARIANTS,
    };
    let dev = device();
    if !dev.is_cuda() {
        return;
    }
    // and a long K (the down projections the bulk kernel takes by default)
    for (f32_out, k, n) in STREAM_TEST_SHAPES.into_iter().chain([(false, 12288, 64)]) {
        let x = randn_bf16(1.0, (40, k), &dev);
        let w = randn_bf16(0.05, (n, k), &dev);
        for rows in [1usize, 3, 8, 9, 16, 17, 40] {
            let xs = x.narrow(0, 0, rows).unwrap();
            let want = stream_matmul_always(&xs, &w, f32_out).unwrap().unwrap();
            for variant in BULK_VARIANTS {
                let Some(got) = stream_matmul_bulk_always(&xs, &w, f32_out, variant).unwrap()
                else {
                    return; // an older device: no bulk kernels
                };
                assert_eq!(got.dims(), want.dims());
                assert_eq!(
                    max_abs(&got, &want),
                    0.0,
                    "{k}x{n}, {rows} rows, stage shape {variant:?}"
                );
            }
        }
    }
}

/// The split kernel (`DFLASH_STREAM_SPLIT`: the kw partial sums over blocks, the tile's last block
/// adding them in order) gives the narrow kernel's outputs bit for bit at every x-tile width (1–16,
/// 17–32, 33–64, 65–80 rows and 80-row tiles past that): the shared test shapes (partial weight
/// tiles, kw 4 and 8, a partial's last chunk missing), a long K, an LM-head-like N (kw 1: no
/// partials), bf16 and f32 out; and its counters are left zero (a second call
/// gives the same bits). CUDA only.
#[test]
fn split_kernel_gives_the_narrow_kernels_bits() {
    use dflash_core::stream_gemm::{stream_matmul_always, stream_matmul_split_always};
    let dev = device();
    if !dev.is_cuda() {
        return;
    }
    let extra = [(false, 12288, 200), (true, 128, 40000)];
    for (f32_out, k, n) in STREAM_TEST_SHAPES.into_iter().chain(extra) {
        let x = randn_bf16(1.0, (257, k), &dev);
        let w = randn_bf16(0.05, (n, k), &dev);
        for rows in [1usize, 5, 16, 17, 32, 33, 64, 65, 80, 81, 257] {
            let xs = x.narrow(0, 257 - rows, rows).unwrap();
            let want = stream_matmul_always(&xs, &w, f32_out).unwrap().unwrap();
            for round in 0..2 {
                let got = stream_matmul_split_always(&xs, &w, f32_out)
                    .unwrap()
                    .expect("the split kernel runs on CUDA");
                assert_eq!(got.dims(), want.dims());
                assert_eq!(
                    max_abs(&got, &want),
                    0.0,
                    "{k}x{n}, {rows} rows, call {round}"
                );
            }
        }
    }
}

/// The MLP's activation folded into the streaming down projection gives exactly the two-kernel
/// path's numbers (silu·mul rounded to bf16, then the GEMM), whatever the row count. CUDA only.
#[test]
fn stream_silu_matmul_equals_silu_mul_then_the_gemm() {
    use dflash_core::stream_gemm::stream_matmul_always as stream_matmul;
    use dflash_core::stream_gemm::stream_silu_matmul_always as stream_silu_matmul;
    let dev = device();
    if !dev.is_cuda() {
        return;
    }
    let (inter, n) = (1536, 576);
    let gate_up = randn_bf16(2.0, (80, 2 * inter), &dev);
    let w = randn_bf16(0.05, (n, inter), &dev);
    let act = dflash_core::decode_ops::silu_mul(&gate_up).unwrap();
    let want = stream_matmul(&act, &w, false).unwrap().unwrap();
    let got = stream_silu_matmul(&gate_up, &w).unwrap().unwrap();
    assert_eq!(max_abs(&got, &want), 0.0);
    for (start, rows) in [
        (0usize, 1usize),
        (11, 1),
        (4, 7),
        (2, 18),
        (9, 40),
        (10, 70),
    ] {
        let part = stream_silu_matmul(&gate_up.narrow(0, start, rows).unwrap(), &w)
            .unwrap()
            .unwrap();
        assert_eq!(max_abs(&part, &want.narrow(0, start, rows).unwrap()), 0.0);
    }
}

/// The residual add and RMSNorm as the streaming GEMM's prologue (`DFLASH_FUSED_ADD_NORM=1`):
/// the sums are exactly `add_rms_norm`'s, the projection agrees with `add_rms_norm` then the GEMM
/// to bf16 rounding (the sum of squares is added in another order), and a row's outputs do not
/// depend on how many rows share the call. CUDA only.
#[test]
fn stream_add_norm_matmul_matches_the_two_kernels_and_does_not_depend_on_the_row_count() {
    use dflash_core::stream_gemm::stream_add_norm_matmul_always as fused;
    use dflash_core::stream_gemm::stream_matmul_always as stream_matmul;
    let dev = device();
    if !dev.is_cuda() {
        return;
    }
    let (k, n, rows) = (576, 1536, 40);
    let bf = |t: Tensor| t.to_dtype(DType::BF16).unwrap();
    let x = bf(Tensor::randn(0f32, 1.0, (rows, k), &dev).unwrap());
    let d = bf(Tensor::randn(0f32, 0.5, (rows, k), &dev).unwrap());
    let nw = bf(Tensor::randn(1f32, 0.1, k, &dev).unwrap());
    let w = bf(Tensor::randn(0f32, 0.05, (n, k), &dev).unwrap());
    let (sum, normed) = dflash_core::decode_ops::add_rms_norm(&x, &d, &nw, 1e-6)
        .unwrap()
        .expect("the fused add+norm kernel on CUDA");
    let want = stream_matmul(&normed, &w, false).unwrap().unwrap();
    let (got_sum, got) = fused(&x, &d, &nw, 1e-6, &w).unwrap().unwrap();
    assert_eq!(max_abs(&got_sum, &sum), 0.0, "the residual sums");
    let scale = max_abs(&want, &want.zeros_like().unwrap());
    let diff = max_abs(&got, &want);
    assert!(
        diff <= 0.02 * scale,
        "fused {diff} vs two kernels, of {scale}"
    );
    for (start, len) in [(0usize, 1usize), (11, 1), (4, 7), (2, 18), (9, 31)] {
        let (s, y) = fused(
            &x.narrow(0, start, len).unwrap(),
            &d.narrow(0, start, len).unwrap(),
            &nw,
            1e-6,
            &w,
        )
        .unwrap()
        .unwrap();
        assert_eq!(max_abs(&y, &got.narrow(0, start, len).unwrap()), 0.0);
        assert_eq!(max_abs(&s, &got_sum.narrow(0, start, len).unwrap()), 0.0);
    }
}
