//! The fused block attention against the composite `block_attention`, value and gradients.

use super::*;
use crate::block_attention::{block_attention, HIDDEN};
use crate::test_util::max_abs_diff;
use candle_core::{Device, Var};

struct Case {
    b: usize,
    h: usize,
    kv: usize,
    n: usize,
    bs: usize,
    s: usize,
    d: usize,
    visible: Vec<u32>,
}

/// Deterministic values in [-1.5, 1.5) (xorshift), shaped `shape`.
fn noise(shape: (usize, usize, usize, usize), seed: &mut u64) -> Tensor {
    let len = shape.0 * shape.1 * shape.2 * shape.3;
    let v: Vec<f32> = (0..len)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            (*seed >> 40) as f32 / (1u64 << 24) as f32 * 3.0 - 1.5
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn inputs(c: &Case, seed: u64) -> Vec<Var> {
    let mut seed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let shapes = [
        (c.b, c.h, c.n * c.bs, c.d),
        (c.b, c.kv, c.s, c.d),
        (c.b, c.kv, c.s, c.d),
        (c.b, c.kv, c.n * c.bs, c.d),
        (c.b, c.kv, c.n * c.bs, c.d),
    ];
    shapes
        .iter()
        .map(|&s| Var::from_tensor(&noise(s, &mut seed)).unwrap())
        .collect()
}

fn context_mask(c: &Case) -> Tensor {
    let mut m = vec![HIDDEN; c.b * c.n * c.s];
    for (blk, &v) in c.visible.iter().enumerate() {
        for j in 0..(v as usize).min(c.s) {
            m[blk * c.s + j] = 0.0;
        }
    }
    Tensor::from_vec(m, (c.b, c.n, 1, c.s), &Device::Cpu).unwrap()
}

/// Output and the gradients of `Σ out ⊙ w` for the five inputs, composite then fused.
fn both(c: &Case, scale: f64) -> [(Tensor, Vec<Tensor>); 2] {
    let vars = inputs(c, 3);
    let t: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
    let rows = c.n * c.bs;
    let w = noise((1, c.b, rows, c.h * c.d), &mut 77)
        .squeeze(0)
        .unwrap();
    let composite = block_attention(
        t[0],
        t[1],
        t[2],
        t[3],
        t[4],
        Some(&context_mask(c)),
        None,
        c.bs,
        scale,
    )
    .unwrap();
    let fused = flash_block_attention(t[0], t[1], t[2], t[3], t[4], &c.visible, c.bs, scale)
        .unwrap()
        .expect("shapes within the kernels' limits");
    [composite, fused].map(|out| {
        let g = (&out * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let grads = t
            .iter()
            .map(|x| g.get(x).expect("gradient").clone())
            .collect();
        (out, grads)
    })
}

fn check(c: &Case, tol: f32) {
    let [(want, wg), (got, gg)] = both(c, 0.125);
    let err = max_abs_diff(&got, &want);
    assert!(err < tol, "output differs by {err}");
    for (i, (a, b)) in gg.iter().zip(&wg).enumerate() {
        let err = max_abs_diff(a, b);
        let size = b
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(
            err < tol * size.max(1.0),
            "gradient of input {i} differs by {err} (max {size})"
        );
    }
}

#[test]
fn equals_the_composite_with_gqa_and_partial_context() {
    // anchors 0 (sees no context), mid-tile, exactly S, beyond S (clamped)
    check(
        &Case {
            b: 2,
            h: 6,
            kv: 2,
            n: 3,
            bs: 4,
            s: 21,
            d: 8,
            visible: vec![0, 7, 21, 16, 30, 1],
        },
        2e-5,
    );
}

#[test]
fn equals_the_composite_at_block_16_without_gqa() {
    check(
        &Case {
            b: 1,
            h: 2,
            kv: 2,
            n: 2,
            bs: 16,
            s: 40,
            d: 16,
            visible: vec![33, 5],
        },
        2e-5,
    );
}

#[test]
fn a_context_key_no_block_sees_gets_no_gradient() {
    let c = Case {
        b: 1,
        h: 2,
        kv: 1,
        n: 2,
        bs: 4,
        s: 10,
        d: 8,
        visible: vec![3, 6],
    };
    let [_, (_, g)] = both(&c, 0.5);
    let dk = g[1].squeeze(0).unwrap().squeeze(0).unwrap();
    let seen = dk
        .narrow(0, 0, 6)
        .unwrap()
        .abs()
        .unwrap()
        .sum_all()
        .unwrap();
    let unseen = dk
        .narrow(0, 6, 4)
        .unwrap()
        .abs()
        .unwrap()
        .sum_all()
        .unwrap();
    assert!(seen.to_scalar::<f32>().unwrap() > 0.0);
    assert_eq!(unseen.to_scalar::<f32>().unwrap(), 0.0);
}

#[test]
fn bf16_inputs_stay_close_to_f32() {
    let c = Case {
        b: 1,
        h: 4,
        kv: 2,
        n: 2,
        bs: 8,
        s: 12,
        d: 16,
        visible: vec![12, 4],
    };
    let vars = inputs(&c, 9);
    let t: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let run = |dt: DType| {
        let x: Vec<Tensor> = t.iter().map(|a| a.to_dtype(dt).unwrap()).collect();
        flash_block_attention(&x[0], &x[1], &x[2], &x[3], &x[4], &c.visible, c.bs, 0.25)
            .unwrap()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    let err = max_abs_diff(&run(DType::BF16), &run(DType::F32));
    assert!(err < 3e-2, "bf16 differs by {err}");
}

#[test]
fn shapes_outside_the_limits_fall_back() {
    let dev = Device::Cpu;
    let z = |s: (usize, usize, usize, usize)| Tensor::zeros(s, DType::F32, &dev).unwrap();
    // block 32 > MAX_BLOCK
    let got = flash_block_attention(
        &z((1, 1, 32, 8)),
        &z((1, 1, 4, 8)),
        &z((1, 1, 4, 8)),
        &z((1, 1, 32, 8)),
        &z((1, 1, 32, 8)),
        &[2],
        32,
        1.0,
    )
    .unwrap();
    assert!(got.is_none());
    // the causal path is forward only: no gradient reaches q
    let q = Var::from_tensor(&z((1, 2, 4, 8))).unwrap();
    let k = z((1, 1, 4, 8));
    let o = flash_causal_attention(q.as_tensor(), &k, &k, &[0], 1.0)
        .unwrap()
        .unwrap();
    assert!(o
        .sum_all()
        .unwrap()
        .backward()
        .unwrap()
        .get(q.as_tensor())
        .is_none());
    // a visibility table of the wrong length is an error, not a misread
    let bad = flash_block_attention(
        &z((1, 1, 8, 8)),
        &z((1, 1, 4, 8)),
        &z((1, 1, 4, 8)),
        &z((1, 1, 8, 8)),
        &z((1, 1, 8, 8)),
        &[2],
        4,
        1.0,
    );
    assert!(bad.is_err());
}

/// Causal attention with a cached prefix, GQA and a partial last block equals the composite.
#[test]
fn causal_forward_equals_the_composite_attention() {
    for &(past, t) in &[(0usize, 37usize), (5, 16), (11, 1), (0, 3)] {
        let (b, h, kv, d) = (2, 6, 2, 8);
        let mut seed = 99 + past as u64 * 31 + t as u64;
        let q = noise((b, h, t, d), &mut seed);
        let k = noise((b, kv, past + t, d), &mut seed);
        let v = noise((b, kv, past + t, d), &mut seed);
        let mask = crate::AttentionMask::Causal
            .build(t, past + t, &Device::Cpu)
            .unwrap();
        let want = crate::attention(&q, &k, &v, mask.as_ref(), 0.3, crate::Grad::Off).unwrap();
        let got = flash_causal_attention(&q, &k, &v, &[0, 0], 0.3)
            .unwrap()
            .expect("within limits");
        let err = max_abs_diff(&got, &want);
        assert!(err < 2e-5, "past {past}, {t} queries: differs by {err}");
    }
}

/// Left padding (batched prefill and decode): keys before a row's `first` are hidden except a
/// padding query's own key, as in the batched decoder's per-sequence mask.
#[test]
fn causal_forward_with_left_padding_equals_the_masked_composite() {
    let (b, h, kv, d) = (3, 4, 2, 8);
    let pads = [5u32, 0, 19];
    for &(past, t) in &[(0usize, 21usize), (21, 1), (4, 17)] {
        let s = past + t;
        let mut seed = 7 + past as u64 + 3 * t as u64;
        let q = noise((b, h, t, d), &mut seed);
        let k = noise((b, kv, s, d), &mut seed);
        let v = noise((b, kv, s, d), &mut seed);
        let mut m = vec![f32::NEG_INFINITY; b * t * s];
        for (bi, &pad) in pads.iter().enumerate() {
            for i in 0..t {
                let g = past + i;
                for j in 0..=g {
                    if j >= pad as usize || j == g {
                        m[(bi * t + i) * s + j] = 0.0;
                    }
                }
            }
        }
        let mask = Tensor::from_vec(m, (b, t, s), &Device::Cpu).unwrap();
        let want = crate::attention(&q, &k, &v, Some(&mask), 0.4, crate::Grad::Off).unwrap();
        let got = flash_causal_attention(&q, &k, &v, &pads, 0.4)
            .unwrap()
            .expect("within limits");
        let err = max_abs_diff(&got, &want);
        assert!(err < 2e-5, "past {past}, {t} queries: differs by {err}");
    }
}

/// The CPU never takes the fused kernels by default (its reference is single-threaded loops),
/// however large the call; the switch forces them.
#[test]
fn cpu_default_is_the_composite() {
    if std::env::var_os("DFLASH_FUSED_ATTENTION").is_some() {
        eprintln!("DFLASH_FUSED_ATTENTION is set: the default is not observable");
        return;
    }
    assert!(!use_fused(&Device::Cpu, usize::MAX));
    assert!(!use_fused(&Device::Cpu, FUSED_MIN_PAIRS));
}
