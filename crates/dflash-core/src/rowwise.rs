//! Row-invariant CPU kernels for bit-exact decoding on the CPU (`--bit-exact`, the stream policy
//! [`crate::stream_gemm::StreamPolicy::All`]): a projection and an attention whose every output
//! row is computed by the same fixed-order f32 arithmetic whatever the number of rows in the call,
//! so a verified row equals the one-token AR step's row bit for bit (issue 18, "the same on the
//! CPU"; candle's CPU matmuls block their sums by shape and do not).
//!
//! Invariants:
//! - [`matmul_t`]: `y[m, n] = Σ_k x[m, k] · w[n, k]` in f32 with eight interleaved partial sums
//!   combined in a fixed tree, then the tail — a function of `x[m, :]` and `w[n, :]` only; rounded
//!   once to the output dtype.
//! - [`attention`]: per (sequence, head, query row): scores `q · k_j` (same fixed-order dot) ×
//!   scale + mask, softmax in f32 over keys in key order (a hidden key adds exactly 0), output
//!   `Σ_j p_j v_j` in key order, rounded once — a row's result depends on its own visible keys only.
//! - CPU tensors of f32, bf16 or f16; the projection reads its weight in place and spreads output
//!   columns over rayon's pool; the attention is plain loops (its keys copied per call).

use crate::{CoreError, Result};
use candle_core::{DType, Device, Tensor};

fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// The fixed-order dot product of the module invariants.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut p = [0f32; 8];
    let body = n / 8 * 8;
    // lane l takes elements l, l + 8, … in order (exact slices: no bounds checks, vectorised)
    for (ca, cb) in a[..body].chunks_exact(8).zip(b[..body].chunks_exact(8)) {
        for l in 0..8 {
            p[l] += ca[l] * cb[l];
        }
    }
    let mut s = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    for i in body..n {
        s += a[i] * b[i];
    }
    s
}

/// [`dot`] of `a` with each of four rows `b[0..4]` at once (each result the same bits as `dot`:
/// the same lanes, order and combining tree; `a` is read once for the four).
#[inline]
fn dot4(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    let n = a.len();
    let mut p = [[0f32; 8]; 4];
    let body = n / 8 * 8;
    for (i, ca) in a[..body].chunks_exact(8).enumerate() {
        for (c, pc) in p.iter_mut().enumerate() {
            let cb = &b[c][i * 8..i * 8 + 8];
            for l in 0..8 {
                pc[l] += ca[l] * cb[l];
            }
        }
    }
    let mut out = [0f32; 4];
    for (c, o) in out.iter_mut().enumerate() {
        let q = &p[c];
        let mut s = ((q[0] + q[1]) + (q[2] + q[3])) + ((q[4] + q[5]) + (q[6] + q[7]));
        for i in body..n {
            s += a[i] * b[c][i];
        }
        *o = s;
    }
    out
}

/// Work split over the machine's cores: `f(i)` for `i in 0..n`, each result in its slot.
fn parallel_fill(out: &mut [f32], chunk: usize, f: &(dyn Fn(usize, &mut [f32]) + Sync)) {
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let rows = out.len() / chunk.max(1);
    let per = rows.div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        for (ti, part) in out.chunks_mut(per * chunk).enumerate() {
            s.spawn(move || {
                for (j, row) in part.chunks_mut(chunk).enumerate() {
                    f(ti * per + j, row);
                }
            });
        }
    });
}

/// A weight matrix's elements in place (a contiguous CPU tensor's storage, no copy), or an f32
/// copy of any other.
enum WeightRows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
    F16(&'a [half::f16]),
}

impl WeightRows<'_> {
    /// Row `c` (`k` elements) as f32 into `buf`: the values the dot product reads, whatever the
    /// storage (a bf16/f16 → f32 conversion is exact).
    fn row_into(&self, c: usize, k: usize, buf: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        match self {
            WeightRows::F32(w) => buf.copy_from_slice(&w[c * k..(c + 1) * k]),
            WeightRows::Bf16(w) => w[c * k..(c + 1) * k].convert_to_f32_slice(buf),
            WeightRows::F16(w) => w[c * k..(c + 1) * k].convert_to_f32_slice(buf),
        }
    }
}

/// Output columns a rayon task computes (for every row of `x`).
const COLUMNS_PER_TASK: usize = 64;

/// `x · wᵀ` (`x` `[m, k]`, `w` `[n, k]`) by the module invariants' per-element arithmetic;
/// `f32_out` keeps f32, else the result takes `x`'s dtype. The weight is read in place (a
/// contiguous bf16 / f16 / f32 tensor is not copied), each of its rows converted once per call and
/// used for every row of `x`; tasks of [`COLUMNS_PER_TASK`] output columns run on rayon's pool.
/// Neither changes any element's arithmetic: a row's result is the same in a call of any size.
pub fn matmul_t(x: &Tensor, w: &Tensor, f32_out: bool) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let (n, k2) = w.dims2()?;
    if k != k2 || !x.device().is_cpu() || !w.device().is_cpu() {
        return Err(CoreError::InvalidInput(format!(
            "rowwise matmul: x {:?} and w {:?} (CPU, matching inner sizes)",
            x.dims(),
            w.dims()
        )));
    }
    let xs = host_f32(x)?;
    let (storage, layout) = w.storage_and_layout();
    let copied;
    let rows = match (&*storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(cpu), Some((start, end))) => match cpu {
            candle_core::CpuStorage::F32(v) => WeightRows::F32(&v[start..end]),
            candle_core::CpuStorage::BF16(v) => WeightRows::Bf16(&v[start..end]),
            candle_core::CpuStorage::F16(v) => WeightRows::F16(&v[start..end]),
            _ => {
                copied = host_f32(w)?;
                WeightRows::F32(&copied)
            }
        },
        _ => {
            copied = host_f32(w)?;
            WeightRows::F32(&copied)
        }
    };
    // column-major partial results: task t holds columns t·C … for every row
    let mut cols = vec![0f32; n * m];
    {
        use rayon::prelude::*;
        cols.par_chunks_mut(COLUMNS_PER_TASK * m)
            .enumerate()
            .for_each(|(t, out)| {
                let mut wr = vec![0f32; 4 * k];
                let first = t * COLUMNS_PER_TASK;
                // four columns at a time (each row of x read once for the four), then the rest
                let quads = out.len() / m / 4;
                for q in 0..quads {
                    for (c, buf) in wr.chunks_mut(k).enumerate() {
                        rows.row_into(first + 4 * q + c, k, buf);
                    }
                    let w4: Vec<&[f32]> = wr.chunks(k).collect();
                    for r in 0..m {
                        let y4 = dot4(&xs[r * k..(r + 1) * k], [w4[0], w4[1], w4[2], w4[3]]);
                        for (c, v) in y4.into_iter().enumerate() {
                            out[(4 * q + c) * m + r] = v;
                        }
                    }
                }
                for (j, col) in out.chunks_mut(m).enumerate().skip(4 * quads) {
                    rows.row_into(first + j, k, &mut wr[..k]);
                    for (r, o) in col.iter_mut().enumerate() {
                        *o = dot(&xs[r * k..(r + 1) * k], &wr[..k]);
                    }
                }
            });
    }
    drop(storage);
    let mut y = vec![0f32; m * n];
    for (c, col) in cols.chunks(m).enumerate() {
        for (r, &v) in col.iter().enumerate() {
            y[r * n + c] = v;
        }
    }
    let y = Tensor::from_vec(y, (m, n), &Device::Cpu)?;
    Ok(if f32_out { y } else { y.to_dtype(x.dtype())? })
}

/// Attention as `crate::attention::attention` computes it (`q` `[b, h, n, d]`, `k`, `v` `[b,
/// kv, s, d]`, additive f32 mask `[n, s]` or `[b, n, s]`), row by row (see the module
/// invariants). Returns `[b, h, n, d]` in `q`'s dtype.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    let (b, h, n, d) = q.dims4()?;
    let (_, kv, s, _) = k.dims4()?;
    let rep = h / kv.max(1);
    let (qs, ks, vs) = (host_f32(q)?, host_f32(k)?, host_f32(v)?);
    let ms = mask.map(host_f32).transpose()?;
    let per_batch_mask = mask.is_some_and(|m| m.rank() == 3);
    let mut out = vec![0f32; b * h * n * d];
    parallel_fill(&mut out, d, &|row, o| {
        let (bi, rest) = (row / (h * n), row % (h * n));
        let (hi, i) = (rest / n, rest % n);
        let g = hi / rep;
        let qr = &qs[row * d..(row + 1) * d];
        let kbase = (bi * kv + g) * s * d;
        let mrow = ms.as_ref().map(|m| {
            let base = if per_batch_mask { bi * n * s } else { 0 } + i * s;
            &m[base..base + s]
        });
        let mut scores = vec![f32::NEG_INFINITY; s];
        let mut mx = f32::NEG_INFINITY;
        for (j, sc) in scores.iter_mut().enumerate() {
            let add = mrow.map_or(0.0, |m| m[j]);
            if add == f32::NEG_INFINITY {
                continue;
            }
            *sc = dot(qr, &ks[kbase + j * d..kbase + (j + 1) * d]) * scale as f32 + add;
            mx = mx.max(*sc);
        }
        let mut z = 0f32;
        for sc in scores.iter_mut() {
            *sc = if *sc == f32::NEG_INFINITY {
                0.0
            } else {
                (*sc - mx).exp()
            };
            z += *sc;
        }
        let inv = if z > 0.0 { 1.0 / z } else { 0.0 };
        for (j, &e) in scores.iter().enumerate() {
            if e == 0.0 {
                continue;
            }
            let p = e * inv;
            let vr = &vs[kbase + j * d..kbase + (j + 1) * d];
            for c in 0..d {
                o[c] += p * vr[c];
            }
        }
    });
    let out = Tensor::from_vec(out, (b, h, n, d), &Device::Cpu)?;
    Ok(out.to_dtype(q.dtype())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_do_not_depend_on_the_row_count_and_match_the_composites() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (9, 37), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (11, 37), &dev).unwrap();
        let y = matmul_t(&x, &w, true).unwrap();
        let want = x.matmul(&w.t().unwrap()).unwrap();
        let err = crate::test_util::max_abs_diff(&y, &want);
        assert!(err < 1e-4, "{err}");
        for r in [0, 4, 8] {
            let one = matmul_t(&x.narrow(0, r, 1).unwrap(), &w, true).unwrap();
            let same: Vec<f32> = y.get(r).unwrap().to_vec1().unwrap();
            assert_eq!(one.get(0).unwrap().to_vec1::<f32>().unwrap(), same);
        }
        // a weight read in place as bf16, as an f32 copy of it, and non-contiguous (copied):
        // the same bits; more columns than one task holds, rows alone equal rows together
        let wide = Tensor::randn(0f32, 1.0, (150, 37), &dev).unwrap();
        let w16 = wide.to_dtype(DType::BF16).unwrap();
        let y16 = matmul_t(&x, &w16, true).unwrap();
        let y32 = matmul_t(&x, &w16.to_dtype(DType::F32).unwrap(), true).unwrap();
        let wt = w16.t().unwrap().contiguous().unwrap().t().unwrap();
        assert!(!wt.is_contiguous());
        let ytt = matmul_t(&x, &wt, true).unwrap();
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(bits(&y16), bits(&y32));
        assert_eq!(bits(&y16), bits(&ytt));
        for r in [0, 5] {
            let one = matmul_t(&x.narrow(0, r, 1).unwrap(), &w16, true).unwrap();
            assert_eq!(bits(&one), bits(&y16.get(r).unwrap()));
        }
        // attention: a 5-row causal block's rows against the same rows alone over their keys
        let q = Tensor::randn(0f32, 1.0, (1, 4, 5, 8), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (1, 2, 12, 8), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (1, 2, 12, 8), &dev).unwrap();
        let mask = crate::AttentionMask::Causal.build(5, 12, &dev).unwrap();
        let o = attention(&q, &k, &v, mask.as_ref(), 0.35).unwrap();
        let want =
            crate::attention::attention(&q, &k, &v, mask.as_ref(), 0.35, crate::Grad::On).unwrap();
        let err = crate::test_util::max_abs_diff(&o, &want);
        assert!(err < 1e-5, "{err}");
        for i in 0..5 {
            let keys = 7 + i + 1;
            let alone = attention(
                &q.narrow(2, i, 1).unwrap(),
                &k.narrow(2, 0, keys).unwrap(),
                &v.narrow(2, 0, keys).unwrap(),
                None,
                0.35,
            )
            .unwrap();
            let a: Vec<f32> = alone.flatten_all().unwrap().to_vec1().unwrap();
            let b: Vec<f32> = o
                .narrow(2, i, 1)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(a, b, "row {i}");
        }
    }
}
