//! The AVX2 variants of `super`'s kernels. Invariant: each performs, per output element, exactly
//! the IEEE operations of its portable twin in the same order (multiply rounded, then add rounded;
//! never fused), so the kernel choice changes speed, never bits (unit-tested in `super`).

use std::arch::x86_64::*;

/// [`super::bf16_bits_to_f32`] over a slice, compiled for AVX2 (the loop vectorises).
#[target_feature(enable = "avx2")]
pub(super) unsafe fn bf16_to_f32(src: &[half::bf16], dst: &mut [f32]) {
    for (o, v) in dst.iter_mut().zip(src) {
        *o = super::bf16_bits_to_f32(v.to_bits());
    }
}

/// [`super::TileKernel::accumulate`] with `o.len()` a multiple of 8 and `values` holding
/// `probs.len()` rows of `o.len()`: 64 channels at a time held in eight registers over all
/// keys (mul, then add, in key order).
#[target_feature(enable = "avx2")]
pub(super) unsafe fn accumulate(o: &mut [f32], probs: &[f32], values: &[f32]) {
    let d = o.len();
    let mut c0 = 0;
    while c0 < d {
        let lanes = ((d - c0) / 8).min(8);
        let mut acc = [_mm256_setzero_ps(); 8];
        for (a, l) in acc.iter_mut().zip(0..lanes) {
            *a = _mm256_loadu_ps(o.as_ptr().add(c0 + 8 * l));
        }
        for (j, &p) in probs.iter().enumerate() {
            if p == 0.0 {
                continue;
            }
            let pv = _mm256_set1_ps(p);
            let row = values.as_ptr().add(j * d + c0);
            for (a, l) in acc.iter_mut().zip(0..lanes) {
                *a = _mm256_add_ps(*a, _mm256_mul_ps(pv, _mm256_loadu_ps(row.add(8 * l))));
            }
        }
        for (a, l) in acc.iter().zip(0..lanes) {
            _mm256_storeu_ps(o.as_mut_ptr().add(c0 + 8 * l), *a);
        }
        c0 += 8 * lanes;
    }
}

/// `R` rows × four columns of `dot`: lane `l` of accumulator (r, c) sums
/// `x[r][i + l] · w[c][i + l]` over `i = 0, 8, …` (mul, then add), then `dot`'s combining
/// tree and tail.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn tile<const R: usize>(x: [&[f32]; R], w: [&[f32]; 4]) -> [[f32; 4]; R] {
    let k = w[0].len();
    debug_assert!(x.iter().chain(w.iter()).all(|s| s.len() == k));
    let body = k / 8 * 8;
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let mut i = 0;
    while i < body {
        // SAFETY: i + 8 <= body <= k, every slice is k long.
        unsafe {
            let wv: [__m256; 4] = std::array::from_fn(|c| _mm256_loadu_ps(w[c].as_ptr().add(i)));
            for r in 0..R {
                let xv = _mm256_loadu_ps(x[r].as_ptr().add(i));
                for c in 0..4 {
                    acc[r][c] = _mm256_add_ps(acc[r][c], _mm256_mul_ps(xv, wv[c]));
                }
            }
        }
        i += 8;
    }
    let mut y = [[0f32; 4]; R];
    for r in 0..R {
        // `dot`'s combining tree for the four accumulators at once: hadd pairs lanes (0+1, 2+3, …),
        // a second hadd pairs those, the last add joins the halves — the same adds, same order
        let h01 = _mm256_hadd_ps(acc[r][0], acc[r][1]);
        let h23 = _mm256_hadd_ps(acc[r][2], acc[r][3]);
        let h = _mm256_hadd_ps(h01, h23);
        let tree = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        // SAFETY: y[r] holds 4 floats.
        unsafe { _mm_storeu_ps(y[r].as_mut_ptr(), tree) };
        for (c, yc) in y[r].iter_mut().enumerate() {
            for i in body..k {
                *yc += x[r][i] * w[c][i];
            }
        }
    }
    y
}

/// [`super::exp_f32`] on eight lanes: the same operations in the same order.
#[target_feature(enable = "avx2")]
unsafe fn exp8(x: __m256) -> __m256 {
    use super::{EXP_HI, EXP_LN2_HI, EXP_LN2_LO, EXP_LO, EXP_LOG2E, EXP_POLY};
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(EXP_LO)),
        _mm256_set1_ps(EXP_HI),
    );
    let n = _mm256_floor_ps(_mm256_add_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
        _mm256_set1_ps(0.5),
    ));
    let r = _mm256_sub_ps(
        _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_HI))),
        _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_LO)),
    );
    let z = _mm256_mul_ps(r, r);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, z), r), _mm256_set1_ps(1.0));
    let pow = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    )));
    _mm256_mul_ps(y, pow)
}

/// [`super::softmax_row`] with eight keys a step (the mask, when given, at least as long as the row).
#[target_feature(enable = "avx2")]
pub(super) unsafe fn softmax(row: &mut [f32], mask: Option<&[f32]>, scale: f32) {
    let s = row.len();
    let body = s / 8 * 8;
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    let vscale = _mm256_set1_ps(scale);
    let mut vmax = ninf;
    let mut j = 0;
    while j < body {
        let x = _mm256_loadu_ps(row.as_ptr().add(j));
        let add = mask.map_or(_mm256_setzero_ps(), |m| _mm256_loadu_ps(m.as_ptr().add(j)));
        let hidden = _mm256_cmp_ps::<_CMP_EQ_OQ>(add, ninf);
        let t = _mm256_blendv_ps(_mm256_add_ps(_mm256_mul_ps(x, vscale), add), ninf, hidden);
        _mm256_storeu_ps(row.as_mut_ptr().add(j), t);
        vmax = _mm256_max_ps(vmax, t);
        j += 8;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), vmax);
    let mut mx = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for (sc, jj) in row[body..].iter_mut().zip(body..) {
        *sc = super::masked_score(*sc, mask.map_or(0.0, |m| m[jj]), scale);
        mx = mx.max(*sc);
    }
    let vmx = _mm256_set1_ps(mx);
    j = 0;
    while j < body {
        let t = _mm256_loadu_ps(row.as_ptr().add(j));
        let e = exp8(_mm256_sub_ps(t, vmx));
        let e = _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_EQ_OQ>(t, ninf));
        _mm256_storeu_ps(row.as_mut_ptr().add(j), e);
        j += 8;
    }
    for sc in row[body..].iter_mut() {
        *sc = super::unnormalised(*sc, mx);
    }
    // the running sum in key order (see `softmax_row`): scalar, latency-bound, exact
    let mut z = 0f32;
    for &e in row.iter() {
        z += e;
    }
    let inv = super::inverse_sum(z);
    let vinv = _mm256_set1_ps(inv);
    j = 0;
    while j < body {
        let p = row.as_mut_ptr().add(j);
        _mm256_storeu_ps(p, _mm256_mul_ps(_mm256_loadu_ps(p), vinv));
        j += 8;
    }
    for sc in row[body..].iter_mut() {
        *sc *= inv;
    }
}
