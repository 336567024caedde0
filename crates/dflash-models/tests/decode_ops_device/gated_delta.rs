//! The gated delta rule on the device against the host rule, and its kernels' bits (part of the
//! `decode_ops_device` test binary: the same device and helpers).

use super::{device, max_abs};
use candle_core::{Device, Tensor};

/// The gated delta rule on the device (one kernel launch on CUDA: `gated_delta_kernels.cu`)
/// against the host rule on the same inputs — chains and branching trees at the real key head dim
/// (128) and the tiny fixture's (16) — and its replays (`advance`, and `advance_layers` for
/// many layers at once) ending in the bits the forward's chain ended in (exact rollback).
#[test]
fn the_gated_delta_rule_matches_the_host_on_the_device() {
    use dflash_core::gated_delta::{self, DeltaInputs};
    let dev = device();
    let trees: Vec<Vec<i64>> = vec![
        (0..16).map(|i| i - 1).collect(),
        vec![-1, 0, 1, 0, 2, 3, 1, 4, 5, 6, 2, 7, -1, 12],
    ];
    // q, k, v, g, beta, then the starting state
    let rule = |a: &[Tensor], parents: &[i64]| {
        let x = DeltaInputs {
            q: &a[0],
            k: &a[1],
            v: &a[2],
            g: &a[3],
            beta: &a[4],
        };
        gated_delta::tree_recurrent(&x, &a[5], parents).unwrap()
    };
    for (dk, dv, h) in [(128usize, 128usize, 3usize), (16, 16, 4)] {
        for parents in &trees {
            let t = parents.len();
            let r = |shape: &[usize]| Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap();
            let scale = (dk as f64).powf(-0.5);
            let host = vec![
                (gated_delta::l2norm(&r(&[t, h, dk])).unwrap() * scale).unwrap(),
                gated_delta::l2norm(&r(&[t, h, dk])).unwrap(),
                r(&[t, h, dv]),
                r(&[t, h]).abs().unwrap().neg().unwrap(),
                candle_nn::ops::sigmoid(&r(&[t, h])).unwrap(),
                r(&[h, dk, dv]),
            ];
            let on: Vec<Tensor> = host.iter().map(|x| x.to_device(&dev).unwrap()).collect();
            let (want, got) = (rule(&host, parents), rule(&on, parents));
            let (e_out, e_last) = (max_abs(&want.0, &got.0), max_abs(&want.1, &got.1));
            assert!(
                e_out < 1e-4 && e_last < 1e-3,
                "dk {dk}, tree {parents:?}: outputs differ by {e_out}, final state by {e_last}"
            );
            if parents.iter().enumerate().all(|(i, &p)| p == i as i64 - 1) {
                let replayed =
                    gated_delta::advance(&on[1], &on[2], &on[3], &on[4], &on[5]).unwrap();
                let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(
                    bits(&got.1) == bits(&replayed),
                    "dk {dk}: the replayed state is not the forward's, bit for bit"
                );
                // the many-layer replay (one launch for every recurrent layer's commit)
                let job = gated_delta::AdvanceJob {
                    k: &on[1],
                    v: &on[2],
                    g: &on[3],
                    beta: &on[4],
                    state: &on[5],
                    into: None,
                };
                let many = gated_delta::advance_layers(&[job, job]).unwrap();
                assert!(
                    many.iter().all(|m| bits(m) == bits(&replayed)),
                    "dk {dk}: advance_layers differs from advance"
                );
                // the commit's convolution windows: exact copies, on the device as on the host
                let (w, c) = (3usize, 24usize);
                let start = r(&[w, c]);
                let inputs = r(&[t, c]);
                let (ds, di) = (
                    start.to_device(&dev).unwrap(),
                    inputs.to_device(&dev).unwrap(),
                );
                for n in [1usize, 5] {
                    let host =
                        dflash_core::gated_delta_layer::conv_windows(&[(&start, &inputs)], n)
                            .unwrap();
                    let on =
                        dflash_core::gated_delta_layer::conv_windows(&[(&ds, &di)], n).unwrap();
                    assert!(bits(&host[0]) == bits(&on[0]), "conv window after {n}");
                }
            }
        }
    }
}

/// The rule's CUDA kernels — one lane a state column, four lanes a column (the default), four
/// lanes with the inputs staged in shared memory (`DFLASH_GDN_RULE_STAGE=1`) — give the same
/// outputs and end state, bit for bit, for chains and branching trees with several roots, longer
/// than one staged chunk, at the real key head dim (128) with a value dim that is not a multiple
/// of the four-lane kernel's 8 columns a warp, and at the tiny fixture's (16).
#[cfg(feature = "cuda")]
#[test]
fn the_rules_kernels_give_the_same_bits() {
    use dflash_core::gated_delta::{self, DeltaInputs, RuleKernel};
    let dev = device();
    if !dev.is_cuda() {
        return;
    }
    // a 70-node tree: branches, a second root, and more nodes than one staged chunk (32 at dk 128)
    let long: Vec<i64> = (0..70i64)
        .map(|i| match i {
            0 | 40 => -1,
            _ if i % 7 == 3 => i - 3,
            _ => i - 1,
        })
        .collect();
    let trees: Vec<Vec<i64>> = vec![
        long,
        (0..17).map(|i| i - 1).collect(),
        vec![-1, 0, 1, 0, 2, 3, 1, 4, 5, 6, 2, 7, -1, 12, 13, 12],
        vec![-1],
    ];
    let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (dk, dv, h) in [(128usize, 128usize, 3usize), (128, 20, 2), (16, 16, 4)] {
        for parents in &trees {
            let t = parents.len();
            let r = |shape: &[usize]| Tensor::randn(0f32, 1.0, shape, &dev).unwrap();
            let scale = (dk as f64).powf(-0.5);
            let q = (gated_delta::l2norm(&r(&[t, h, dk])).unwrap() * scale).unwrap();
            let k = gated_delta::l2norm(&r(&[t, h, dk])).unwrap();
            let v = r(&[t, h, dv]);
            let g = r(&[t, h]).abs().unwrap().neg().unwrap();
            let beta = candle_nn::ops::sigmoid(&r(&[t, h])).unwrap();
            let state = r(&[h, dk, dv]);
            let x = DeltaInputs {
                q: &q,
                k: &k,
                v: &v,
                g: &g,
                beta: &beta,
            };
            let run = |kernel| {
                gated_delta::tree_recurrent_with_kernel(&x, &state, parents, kernel).unwrap()
            };
            let one = run(RuleKernel::OneLane);
            for kernel in [
                RuleKernel::FourLanes,
                RuleKernel::FourLanesStaged,
                RuleKernel::FourLanesStagedReplay,
                RuleKernel::FourLanesStagedReplayPrefetch,
                RuleKernel::FourLanesStagedReplayVec,
            ] {
                let other = run(kernel);
                assert!(
                    bits(&one.0) == bits(&other.0),
                    "{kernel:?}, dk {dk}, dv {dv}, tree {parents:?}: outputs differ by {}",
                    max_abs(&one.0, &other.0)
                );
                assert!(
                    bits(&one.1) == bits(&other.1),
                    "{kernel:?}, dk {dk}, dv {dv}, tree {parents:?}: end states differ by {}",
                    max_abs(&one.1, &other.1)
                );
            }
        }
    }
}

/// The fused convolution + rule inputs (`gdn_conv_rule_inputs`, the default), reading q/k/v and
/// the gates as column views of one stacked projection, gives the bits of the two kernels it
/// replaces (run on contiguous copies): the record's f32 inputs, q, k, v, g and β — at
/// Qwen3.6-27B's heads (16 key, 48 value heads of 128) and a tiny layout whose value heads are
/// wider than its key heads, for a 16-row chain and a tree with two roots, in f32 and bf16.
#[cfg(feature = "cuda")]
#[test]
fn the_fused_inputs_kernel_gives_the_two_kernels_bits() {
    use candle_core::DType;
    use dflash_core::gated_delta_layer::{self as layer, LayerHeads, LayerWeights};
    let dev = device();
    let trees: Vec<Vec<i64>> = vec![
        (0..16).map(|i| i - 1).collect(),
        vec![-1, 0, 1, 0, 2, 3, 1, 4, 5, 6, 2, 7, -1, 12],
        vec![-1],
    ];
    for heads in [
        LayerHeads {
            hk: 16,
            hv: 48,
            dk: 128,
            dv: 128,
        },
        LayerHeads {
            hk: 2,
            hv: 4,
            dk: 16,
            dv: 24,
        },
    ] {
        let LayerHeads { hk, hv, dk, dv } = heads;
        let (c, kw) = (2 * hk * dk + hv * dv, 4usize);
        let width = c + hv * dv + 2 * hv; // qkv, z, b, a stacked
        let r = |shape: &[usize]| Tensor::randn(0f32, 1.0, shape, &dev).unwrap();
        let conv_w = (r(&[c, kw]) * 0.5).unwrap();
        let conv_state = r(&[kw - 1, c]);
        let dt_bias = r(&[hv]);
        let neg_a = r(&[hv]).abs().unwrap().neg().unwrap();
        let w = LayerWeights {
            conv_w: &conv_w,
            dt_bias: &dt_bias,
            neg_a: &neg_a,
        };
        for dtype in [DType::F32, DType::BF16] {
            for parents in &trees {
                let n = parents.len();
                let all = r(&[n, width]).to_dtype(dtype).unwrap();
                let qkv = all.narrow(1, 0, c).unwrap();
                let b = all.narrow(1, c + hv * dv, hv).unwrap();
                let a = all.narrow(1, c + hv * dv + hv, hv).unwrap();
                let fused =
                    layer::conv_and_rule_inputs(&qkv, &conv_state, &b, &a, parents, w, heads)
                        .unwrap();
                let (qc, bc, ac) = (
                    qkv.contiguous().unwrap(),
                    b.contiguous().unwrap(),
                    a.contiguous().unwrap(),
                );
                let two = layer::conv_and_rule_inputs_two_kernels(
                    &qc,
                    &conv_state,
                    &bc,
                    &ac,
                    parents,
                    w,
                    heads,
                )
                .unwrap();
                let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                for (what, x, y) in [
                    ("record", &fused.qkv, &two.qkv),
                    ("q", &fused.q, &two.q),
                    ("k", &fused.k, &two.k),
                    ("v", &fused.v, &two.v),
                    ("g", &fused.g, &two.g),
                    ("beta", &fused.beta, &two.beta),
                ] {
                    let (x, y) = (bits(x), bits(y));
                    let same = x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits());
                    assert!(
                        same && x.len() == y.len(),
                        "{what} differs ({heads:?}, {dtype:?}, {n} rows)"
                    );
                }
            }
        }
    }
}

/// The hybrids' gated attention output (`decode_ops::gate_mul`: one kernel on CUDA reading each
/// head's gates in place from the stacked q/k/v rows) against candle's `sigmoid` then `mul` of
/// the gates copied out, on the CPU in f32: within f32 rounding, and within about one bf16 step
/// (of the output's largest value) in bf16.
#[test]
fn gate_mul_is_the_sigmoid_gate_product() {
    use candle_core::DType;
    let dev = device();
    let (n, heads, hd) = (5usize, 3usize, 32usize);
    let width = 2 * heads * hd + 2 * 2 * hd; // q|gate per head, then k and v of 2 kv heads
    let o = Tensor::randn(0f32, 1.0, (1, n, heads * hd), &Device::Cpu).unwrap();
    let y = (Tensor::randn(0f32, 1.0, (n, width), &Device::Cpu).unwrap() * 3.0).unwrap();
    let gate = y
        .narrow(1, 0, 2 * heads * hd)
        .unwrap()
        .reshape((n, heads, 2 * hd))
        .unwrap()
        .narrow(2, hd, hd)
        .unwrap()
        .reshape((1, n, heads * hd))
        .unwrap();
    let want = (&o * candle_nn::ops::sigmoid(&gate).unwrap()).unwrap();
    for (dtype, tol) in [(DType::F32, 1e-6f32), (DType::BF16, 1.6e-2)] {
        let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&dev).unwrap();
        let got = dflash_core::decode_ops::gate_mul(&on(&o), &on(&y), heads, hd).unwrap();
        assert_eq!(got.dims(), o.dims());
        let scale = want
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let err = max_abs(&got, &want) / scale;
        assert!(err <= tol, "{dtype:?}: off by {err} of the output's scale");
    }
}
