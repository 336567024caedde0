//! Row-invariant CPU kernels, the CPU's decode path (every call of up to 288 rows by
//! default, every call under `--bit-exact`: [`crate::stream_gemm::cpu_row_invariant`]): a projection and
//! an attention whose every output
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
//!   columns over rayon's pool; the attention's query rows run on that pool too (plain loops, its
//!   keys copied per call).

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

/// How the CPU runs the tiles: every variant performs, per output element, exactly the IEEE
/// operations of [`dot`] in its order (a multiply rounded, then an add rounded — never fused), so
/// the choice changes speed, never bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TileKernel {
    /// Any target: one (row, column) at a time.
    Portable,
    /// AVX2: two rows × four columns in registers, one 8-lane register per accumulator.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl TileKernel {
    fn detect() -> TileKernel {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") {
                return TileKernel::Avx2;
            }
        }
        TileKernel::Portable
    }

    /// `out[r * stride + col + c] = dot(x row r, w[c])` for the four weight rows `w` and every
    /// row of `xs` (`m` rows of `k`).
    #[allow(clippy::too_many_arguments)]
    fn columns4(
        self,
        xs: &[f32],
        m: usize,
        k: usize,
        w: [&[f32]; 4],
        out: &mut [f32],
        stride: usize,
        col: usize,
    ) {
        let mut store = |r: usize, y: [f32; 4]| {
            out[r * stride + col..r * stride + col + 4].copy_from_slice(&y);
        };
        let row = |r: usize| &xs[r * k..(r + 1) * k];
        let mut r = 0;
        #[cfg(target_arch = "x86_64")]
        if self == TileKernel::Avx2 {
            while r + 2 <= m {
                // SAFETY: `detect` saw AVX2; the slices are `k` long.
                let y = unsafe { avx2::tile::<2>([row(r), row(r + 1)], w) };
                store(r, y[0]);
                store(r + 1, y[1]);
                r += 2;
            }
            if r < m {
                // SAFETY: as above.
                let [y] = unsafe { avx2::tile::<1>([row(r)], w) };
                store(r, y);
                r += 1;
            }
        }
        while r < m {
            store(r, w.map(|wc| dot(row(r), wc)));
            r += 1;
        }
    }
}

impl TileKernel {
    /// `o[c] += p_j · v_j[c]` for every key `j` in order with `p_j ≠ 0` (a multiply rounded, then
    /// an add rounded), `values` holding `probs.len()` rows of `o.len()`: the attention's
    /// probability-weighted sum of the module invariants, the same bits on every variant.
    fn accumulate(self, o: &mut [f32], probs: &[f32], values: &[f32]) {
        let d = o.len();
        #[cfg(target_arch = "x86_64")]
        if self == TileKernel::Avx2 && d.is_multiple_of(8) {
            // SAFETY: `detect` saw AVX2; `values` holds probs.len() rows of d (checked below).
            assert!(values.len() >= probs.len() * d);
            unsafe { avx2::accumulate(o, probs, values) };
            return;
        }
        for (j, &p) in probs.iter().enumerate() {
            if p == 0.0 {
                continue;
            }
            for (oc, &vc) in o.iter_mut().zip(&values[j * d..(j + 1) * d]) {
                *oc += p * vc;
            }
        }
    }
}

/// A bf16 value as f32 (exact: the bf16 bits are the f32's upper half).
#[inline(always)]
fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

#[cfg(target_arch = "x86_64")]
mod avx2;

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
    fn row_into(&self, c: usize, k: usize, buf: &mut [f32], kernel: TileKernel) {
        use half::slice::HalfFloatSliceExt;
        match self {
            WeightRows::F32(w) => buf.copy_from_slice(&w[c * k..(c + 1) * k]),
            WeightRows::Bf16(w) => {
                let src = &w[c * k..(c + 1) * k];
                #[cfg(target_arch = "x86_64")]
                if kernel == TileKernel::Avx2 {
                    // SAFETY: `detect` saw AVX2.
                    return unsafe { avx2::bf16_to_f32(src, buf) };
                }
                let _ = kernel;
                for (o, v) in buf.iter_mut().zip(src) {
                    *o = bf16_bits_to_f32(v.to_bits());
                }
            }
            WeightRows::F16(w) => w[c * k..(c + 1) * k].convert_to_f32_slice(buf),
        }
    }
}

static TILE_KERNEL: std::sync::OnceLock<TileKernel> = std::sync::OnceLock::new();

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
    // task t computes columns t·C … t·C + cw for every row, into its block `[m, cw]`
    let mut blocks = vec![0f32; n * m];
    let kernel = *TILE_KERNEL.get_or_init(TileKernel::detect);
    {
        use rayon::prelude::*;
        blocks
            .par_chunks_mut(COLUMNS_PER_TASK * m)
            .enumerate()
            .for_each(|(t, out)| {
                let first = t * COLUMNS_PER_TASK;
                let cw = out.len() / m;
                let mut wr = vec![0f32; 4 * k];
                // four columns at a time (each row of x read once for the four), then the rest
                let quads = cw / 4;
                for q in 0..quads {
                    for (c, buf) in wr.chunks_mut(k).enumerate() {
                        rows.row_into(first + 4 * q + c, k, buf, kernel);
                    }
                    let w4: [&[f32]; 4] = std::array::from_fn(|c| &wr[c * k..(c + 1) * k]);
                    kernel.columns4(&xs, m, k, w4, out, cw, 4 * q);
                }
                for j in 4 * quads..cw {
                    rows.row_into(first + j, k, &mut wr[..k], kernel);
                    for r in 0..m {
                        out[r * cw + j] = dot(&xs[r * k..(r + 1) * k], &wr[..k]);
                    }
                }
            });
    }
    drop(storage);
    let mut y = vec![0f32; m * n];
    for (t, block) in blocks.chunks(COLUMNS_PER_TASK * m).enumerate() {
        let (first, cw) = (t * COLUMNS_PER_TASK, block.len() / m);
        for (r, part) in block.chunks(cw).enumerate() {
            y[r * n + first..r * n + first + cw].copy_from_slice(part);
        }
    }
    let y = Tensor::from_vec(y, (m, n), &Device::Cpu)?;
    Ok(if f32_out { y } else { y.to_dtype(x.dtype())? })
}

/// Query rows whose scores one attention task holds at a time.
const ATTENTION_ROWS: usize = 16;

/// `exp(x)` as the attention's softmax defines it (Cephes-style: `n = ⌊x·log2 e + ½⌋`, `r = x − n·ln 2`
/// in two parts, a degree-5 polynomial, `· 2ⁿ`), `x` clamped to [−87, 88]; about 1 ulp. Spelled
/// out operation by operation (no fused multiply-add, no libm) so that its AVX2 twin gives the same
/// bits on every machine.
#[inline]
fn exp_f32(x: f32) -> f32 {
    let x = x.clamp(EXP_LO, EXP_HI);
    let n = (x * EXP_LOG2E + 0.5).floor();
    let r = (x - n * EXP_LN2_HI) - n * EXP_LN2_LO;
    let z = r * r;
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    let y = (p * z + r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

const EXP_LO: f32 = -87.0;
const EXP_HI: f32 = 88.0;
const EXP_LOG2E: f32 = std::f32::consts::LOG2_E;
const EXP_LN2_HI: f32 = 0.693_359_4;
const EXP_LN2_LO: f32 = -2.121_944_4e-4;
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// Raw scores `q · k_j` in place → probabilities: `score · scale + mask` (a hidden key, mask
/// −∞, gets exactly 0), `e_j = exp_f32(t_j − max)`, `Σ e_j` as one running sum in key order (so
/// hidden keys, wherever they stand, change nothing), each `e_j` times `1 / Σ` (the portable
/// kernel).
fn softmax_row(row: &mut [f32], mask: Option<&[f32]>, scale: f32) {
    let mut mx = f32::NEG_INFINITY;
    for (j, sc) in row.iter_mut().enumerate() {
        *sc = masked_score(*sc, mask.map_or(0.0, |m| m[j]), scale);
        mx = mx.max(*sc);
    }
    // one running sum in key order: a hidden key adds an exact zero wherever it stands (after a
    // verify row's visible keys, or between a tree node's ancestors), so z is the one-token step's
    let mut z = 0f32;
    for sc in row.iter_mut() {
        *sc = unnormalised(*sc, mx);
        z += *sc;
    }
    let inv = inverse_sum(z);
    for sc in row.iter_mut() {
        *sc *= inv;
    }
}

/// One key's `score · scale + mask`, exactly −∞ for a hidden key (mask −∞).
#[inline(always)]
fn masked_score(score: f32, add: f32, scale: f32) -> f32 {
    if add == f32::NEG_INFINITY {
        f32::NEG_INFINITY
    } else {
        score * scale + add
    }
}

/// One key's `exp(t − max)`, exactly 0 for a hidden key.
#[inline(always)]
fn unnormalised(t: f32, mx: f32) -> f32 {
    if t == f32::NEG_INFINITY {
        0.0
    } else {
        exp_f32(t - mx)
    }
}

/// `1 / Σ`, 0 for a row with every key hidden.
#[inline(always)]
fn inverse_sum(z: f32) -> f32 {
    if z > 0.0 {
        1.0 / z
    } else {
        0.0
    }
}

impl TileKernel {
    /// [`softmax_row`] on this kernel (the same bits on every variant).
    fn softmax(self, row: &mut [f32], mask: Option<&[f32]>, scale: f32) {
        #[cfg(target_arch = "x86_64")]
        if self == TileKernel::Avx2 {
            // SAFETY: `detect` saw AVX2; the mask, when given, is as long as the row.
            assert!(mask.is_none_or(|m| m.len() >= row.len()));
            unsafe { avx2::softmax(row, mask, scale) };
            return;
        }
        softmax_row(row, mask, scale)
    }
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
    let kernel = *TILE_KERNEL.get_or_init(TileKernel::detect);
    let mut out = vec![0f32; b * h * n * d];
    use rayon::prelude::*;
    // one task per (sequence, head); its query rows in chunks of ATTENTION_ROWS, their scores
    // against every key computed by the projection's tiles (each score `dot`'s bits)
    out.par_chunks_mut(n * d).enumerate().for_each(|(head, o)| {
        let (bi, hi) = (head / h, head % h);
        let kbase = (bi * kv + hi / rep) * s * d;
        let keys = &ks[kbase..kbase + s * d];
        let values = &vs[kbase..kbase + s * d];
        let mut scores = vec![0f32; ATTENTION_ROWS.min(n) * s];
        for i0 in (0..n).step_by(ATTENTION_ROWS) {
            let rows = ATTENTION_ROWS.min(n - i0);
            let qrows = &qs[(head * n + i0) * d..(head * n + i0 + rows) * d];
            let sc = &mut scores[..rows * s];
            for q4 in 0..s / 4 {
                let k4: [&[f32]; 4] =
                    std::array::from_fn(|c| &keys[(4 * q4 + c) * d..(4 * q4 + c + 1) * d]);
                kernel.columns4(qrows, rows, d, k4, sc, s, 4 * q4);
            }
            for j in s / 4 * 4..s {
                for r in 0..rows {
                    sc[r * s + j] = dot(&qrows[r * d..(r + 1) * d], &keys[j * d..(j + 1) * d]);
                }
            }
            for r in 0..rows {
                let i = i0 + r;
                let mrow = ms.as_ref().map(|m| {
                    let base = if per_batch_mask { bi * n * s } else { 0 } + i * s;
                    &m[base..base + s]
                });
                let row = &mut sc[r * s..(r + 1) * s];
                kernel.softmax(row, mrow, scale as f32);
                kernel.accumulate(&mut o[i * d..(i + 1) * d], row, values);
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
    fn every_tile_kernel_gives_dot_bits() {
        // k = 45: five 8-lane chunks and a tail; 7 rows: full tiles of 2 and 4 plus leftovers
        let (m, k) = (7, 45);
        let gen = |seed: u32, len: usize| -> Vec<f32> {
            (0..len)
                .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 97.0 - 5.0)
                .collect()
        };
        let xs = gen(1, m * k);
        let ws = gen(2, 4 * k);
        let w: [&[f32]; 4] = std::array::from_fn(|c| &ws[c * k..(c + 1) * k]);
        // the four columns land at 1..5 of rows 6 wide
        let mut want = vec![0f32; 6 * m];
        for c in 0..4 {
            for r in 0..m {
                want[r * 6 + 1 + c] = dot(&xs[r * k..(r + 1) * k], w[c]);
            }
        }
        let mut kernels = vec![TileKernel::Portable];
        let detected = TileKernel::detect();
        if detected != TileKernel::Portable {
            kernels.push(detected);
        }
        for kernel in kernels {
            let mut out = vec![0f32; 6 * m];
            kernel.columns4(&xs, m, k, w, &mut out, 6, 1);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out), bits(&want), "{kernel:?}");
        }
    }

    #[test]
    fn every_kernel_weights_values_with_the_same_bits() {
        // d = 72: a 64-channel pass and an 8-channel one; zero probabilities are skipped
        let (keys, d) = (37, 72);
        let values: Vec<f32> = (0..keys * d)
            .map(|i| ((i * 7919) % 613) as f32 / 37.0 - 8.0)
            .collect();
        let probs: Vec<f32> = (0..keys)
            .map(|j| {
                if j % 5 == 3 {
                    0.0
                } else {
                    ((j * 31) % 17) as f32 / 97.0
                }
            })
            .collect();
        let start: Vec<f32> = (0..d).map(|c| c as f32 / 3.0 - 5.0).collect();
        let mut want = start.clone();
        TileKernel::Portable.accumulate(&mut want, &probs, &values);
        let mut by_hand = start.clone();
        for (j, &p) in probs.iter().enumerate() {
            for c in 0..d {
                if p != 0.0 {
                    by_hand[c] += p * values[j * d + c];
                }
            }
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&want), bits(&by_hand));
        let mut got = start;
        TileKernel::detect().accumulate(&mut got, &probs, &values);
        assert_eq!(bits(&got), bits(&want), "{:?}", TileKernel::detect());
    }

    #[test]
    fn the_softmax_exp_is_accurate_and_every_kernel_gives_the_same_softmax_bits() {
        // exp_f32 within 2 ulp of the true exp over the softmax's range (and clamped below)
        for i in 0..20_000 {
            let x = -87.0 + i as f32 * (88.0 + 87.0) / 20_000.0;
            let want = (x as f64).exp();
            let got = exp_f32(x) as f64;
            assert!(
                ((got - want) / want).abs() < 2.5e-7,
                "exp({x}) = {got}, want {want}"
            );
        }
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(-1000.0) > 0.0 && exp_f32(-1000.0) < 1e-37);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // rows of 37 (four 8-lane steps and a tail) and 64, with hidden keys, and a row all hidden
        for s in [37usize, 64] {
            let scores: Vec<f32> = (0..s)
                .map(|j| ((j * 7919) % 613) as f32 / 7.0 - 40.0)
                .collect();
            let mask: Vec<f32> = (0..s)
                .map(|j| {
                    if j % 3 == 1 {
                        f32::NEG_INFINITY
                    } else {
                        -((j % 5) as f32)
                    }
                })
                .collect();
            let hidden = vec![f32::NEG_INFINITY; s];
            for m in [None, Some(&mask[..]), Some(&hidden[..])] {
                let mut want = scores.clone();
                softmax_row(&mut want, m, 0.125);
                let mut got = scores.clone();
                TileKernel::detect().softmax(&mut got, m, 0.125);
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{:?}, {s} keys",
                    TileKernel::detect()
                );
                let total: f32 = want.iter().sum();
                let all_hidden = m.is_some_and(|m| m[0] == f32::NEG_INFINITY && m[2] == m[0]);
                assert!(
                    (total - if all_hidden { 0.0 } else { 1.0 }).abs() < 1e-5,
                    "{total}"
                );
                if let Some(m) = m {
                    assert!(want
                        .iter()
                        .zip(m)
                        .all(|(p, a)| *a != f32::NEG_INFINITY || *p == 0.0));
                }
            }
        }
    }

    #[test]
    fn hidden_keys_after_a_row_do_not_change_its_probabilities() {
        // a verify's row sees its visible keys then hidden ones (the later rows' keys); the
        // one-token step sees the visible keys alone: the same bits, on every kernel
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut kernels = vec![TileKernel::Portable];
        if TileKernel::detect() != TileKernel::Portable {
            kernels.push(TileKernel::detect());
        }
        for visible in [5usize, 37, 64, 71] {
            let scores: Vec<f32> = (0..visible + 40)
                .map(|j| ((j * 7919) % 613) as f32 / 7.0 - 40.0)
                .collect();
            let mut alone = scores[..visible].to_vec();
            softmax_row(&mut alone, None, 0.125);
            for kernel in &kernels {
                for total in [visible + 1, visible + 3, visible + 8, visible + 40] {
                    let mask: Vec<f32> = (0..total)
                        .map(|j| if j < visible { 0.0 } else { f32::NEG_INFINITY })
                        .collect();
                    let mut row = scores[..total].to_vec();
                    kernel.softmax(&mut row, Some(&mask), 0.125);
                    assert_eq!(
                        bits(&row[..visible]),
                        bits(&alone),
                        "{kernel:?} {visible} of {total}"
                    );
                    assert!(row[visible..].iter().all(|&p| p == 0.0));
                }
                // a tree node: hidden keys between its ancestors
                let mut spread = Vec::new();
                let mut mask = Vec::new();
                for (j, &sc) in scores[..visible].iter().enumerate() {
                    for _ in 0..j % 3 {
                        spread.push(1.0e3);
                        mask.push(f32::NEG_INFINITY);
                    }
                    spread.push(sc);
                    mask.push(0.0);
                }
                kernel.softmax(&mut spread, Some(&mask), 0.125);
                let kept: Vec<f32> = spread
                    .iter()
                    .zip(&mask)
                    .filter(|(_, m)| **m == 0.0)
                    .map(|(p, _)| *p)
                    .collect();
                assert_eq!(bits(&kept), bits(&alone), "{kernel:?} {visible} spread");
            }
        }
    }

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
