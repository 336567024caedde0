//! The gated delta rule of Gated DeltaNet, the linear-attention layer of the Qwen3.5 / Qwen3.6
//! hybrids and Qwen3-Next (`../shared/docs/ecosystem.md` §3): per value head a state
//! `S ∈ R^{dk×dv}` (f32) with, for each token t,
//! `S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ` and output `o_t = S_tᵀ q_t`
//! (`α_t = e^{g_t}`, `g_t ≤ 0` the log decay, `β_t ∈ (0, 1)` the write strength).
//!
//! Two forms of the same map:
//! - [`recurrent`]: token by token (decode), optionally returning the state after every token —
//!   the per-token checkpoints a speculative verify needs to keep exactly the accepted prefix.
//! - [`chunked`]: chunks of [`CHUNK`] tokens at once (prefill, verification), the WY form with a
//!   forward substitution per chunk, continuing from any state.
//!
//! Invariants:
//! - Inputs are already what the rule consumes: `q` l2-normalised and scaled by `dk^-½`, `k`
//!   l2-normalised, heads repeated to the value heads (`[T, H, dk]`, `[T, H, dv]`), `g` and `beta`
//!   `[T, H]`; everything in f32 (callers upcast), state `[H, dk, dv]`.
//! - Both forms give the same outputs and final state up to f32 rounding (tested), from any
//!   starting state; the state after token t of [`recurrent`]'s checkpoints is the state a
//!   forward over tokens `0..=t` alone ends in, so rolling back to an accepted prefix is exact.
//! - On CUDA (key head dim ≤ [`MAX_KERNEL_KEY_DIM`], a multiple of 4) [`tree_recurrent`] and
//!   [`advance`] are one launch of the same kernel (`gated_delta_kernels.cu`: a thread per state
//!   column, the host's per-head arithmetic with its row sums split four ways), so a state
//!   replayed along a path is computed as the forward computed it; other heads step through
//!   candle's ops ([`step`], shared the same way).

use crate::{CoreError, Result};
use candle_core::{DType, Tensor, D};

/// Tokens per chunk of [`chunked`] (HF's `chunk_size`).
pub const CHUNK: usize = 64;

/// The rule's inputs for `T` tokens and `H` heads (see the module invariants).
pub struct DeltaInputs<'a> {
    /// `[T, H, dk]`, l2-normalised and scaled.
    pub q: &'a Tensor,
    /// `[T, H, dk]`, l2-normalised.
    pub k: &'a Tensor,
    /// `[T, H, dv]`.
    pub v: &'a Tensor,
    /// Log decay `[T, H]` (≤ 0).
    pub g: &'a Tensor,
    /// Write strength `[T, H]`.
    pub beta: &'a Tensor,
}

impl DeltaInputs<'_> {
    /// `(T, H, dk, dv)`, after checking every shape and dtype.
    fn dims(&self) -> Result<(usize, usize, usize, usize)> {
        let (t, h, dk) = self.q.dims3()?;
        let (_, _, dv) = self.v.dims3()?;
        let ok = self.k.dims() == [t, h, dk]
            && self.v.dims() == [t, h, dv]
            && self.g.dims() == [t, h]
            && self.beta.dims() == [t, h]
            && [self.q, self.k, self.v, self.g, self.beta]
                .iter()
                .all(|x| x.dtype() == DType::F32);
        if !ok {
            return Err(CoreError::InvalidInput(format!(
                "gated delta: q {:?} k {:?} v {:?} g {:?} beta {:?} (f32, [T, H, d] and [T, H])",
                self.q.dims(),
                self.k.dims(),
                self.v.dims(),
                self.g.dims(),
                self.beta.dims()
            )));
        }
        Ok((t, h, dk, dv))
    }
}

fn check_state(state: &Tensor, h: usize, dk: usize, dv: usize) -> Result<()> {
    if state.dims() != [h, dk, dv] || state.dtype() != DType::F32 {
        return Err(CoreError::InvalidInput(format!(
            "gated delta: state {:?} {:?}, expected [{h}, {dk}, {dv}] f32",
            state.dims(),
            state.dtype()
        )));
    }
    Ok(())
}

/// What [`recurrent`] returns: outputs `[T, H, dv]`, the final state `[H, dk, dv]`, and, when
/// asked, the state after every token `[T, H, dk, dv]`.
pub struct Recurrent {
    pub out: Tensor,
    pub state: Tensor,
    pub checkpoints: Option<Tensor>,
}

/// The rule token by token from `state` (see the module docs).
pub fn recurrent(x: &DeltaInputs, state: &Tensor, checkpoints: bool) -> Result<Recurrent> {
    let (t, h, dk, dv) = x.dims()?;
    check_state(state, h, dk, dv)?;
    let mut s = state.clone();
    let (mut outs, mut states) = (Vec::with_capacity(t), Vec::new());
    let alpha = x.g.exp()?;
    for i in 0..t {
        let q = x.q.get(i)?.unsqueeze(2)?; // [H, dk, 1]
        let k = x.k.get(i)?.unsqueeze(2)?; // [H, dk, 1]
        let v = x.v.get(i)?.unsqueeze(1)?; // [H, 1, dv]
        let a = alpha.get(i)?.reshape((h, 1, 1))?;
        let b = x.beta.get(i)?.reshape((h, 1, 1))?;
        let decayed = s.broadcast_mul(&a)?;
        // δ = β (v − S̃ᵀ k), as a row [H, 1, dv]
        let predicted = k.transpose(1, 2)?.matmul(&decayed)?; // [H, 1, dv]
        let delta = (v - predicted)?.broadcast_mul(&b)?;
        s = (decayed + k.matmul(&delta)?)?;
        outs.push(q.transpose(1, 2)?.matmul(&s)?.squeeze(1)?); // [H, dv]
        if checkpoints {
            states.push(s.clone());
        }
    }
    let out = if t == 0 {
        Tensor::zeros((0, h, dv), DType::F32, state.device())?
    } else {
        Tensor::stack(&outs, 0)?
    };
    let checkpoints = if checkpoints && t > 0 {
        Some(Tensor::stack(&states, 0)?)
    } else {
        None
    };
    Ok(Recurrent {
        out,
        state: s,
        checkpoints,
    })
}

/// One step of the rule for `m` independent sequences at once: states `[m, H, dk, dv]`, `k`
/// `[m, H, dk]`, `v` `[m, H, dv]`, `alpha` (= e^g) and `beta` `[m, H]`; returns the new states.
/// Off the CPU and the CUDA kernel, [`tree_recurrent`] and [`advance`] both step through here,
/// so a state replayed along a path is computed by the same arithmetic as the forward that first
/// reached it (on the CPU both use [`step_head`]).
fn step(s: &Tensor, k: &Tensor, v: &Tensor, alpha: &Tensor, beta: &Tensor) -> Result<Tensor> {
    let (m, h, dk, dv) = s.dims4()?;
    let s = s.reshape((m * h, dk, dv))?;
    let k = k.reshape((m * h, dk, 1))?;
    let v = v.reshape((m * h, 1, dv))?;
    let a = alpha.reshape((m * h, 1, 1))?;
    let b = beta.reshape((m * h, 1, 1))?;
    let decayed = s.broadcast_mul(&a)?;
    let predicted = k.transpose(1, 2)?.matmul(&decayed)?; // [mH, 1, dv]
    let delta = (v - predicted)?.broadcast_mul(&b)?;
    Ok((decayed + k.matmul(&delta)?)?.reshape((m, h, dk, dv))?)
}

/// One step of the rule for one head on the host, in place: `s` `[dk, dv]` row-major becomes
/// `α (I − β k kᵀ) s + β k vᵀ`; `pred` is scratch of `dv`. The CPU paths of [`tree_recurrent`]
/// and [`advance`] both step through here (the same arithmetic for a forward and a replay).
fn step_head(s: &mut [f32], k: &[f32], v: &[f32], alpha: f32, beta: f32, pred: &mut [f32]) {
    let dv = v.len();
    pred.fill(0.0);
    for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
        for (x, p) in row.iter_mut().zip(pred.iter_mut()) {
            *x *= alpha;
            *p += ki * *x;
        }
    }
    for (p, &vj) in pred.iter_mut().zip(v) {
        *p = beta * (vj - *p);
    }
    for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
        for (x, &d) in row.iter_mut().zip(pred.iter()) {
            *x += ki * d;
        }
    }
}

/// `o = sᵀ q` for one head on the host (`o` of `dv`, zeroed here).
fn read_head(s: &[f32], q: &[f32], o: &mut [f32]) {
    o.fill(0.0);
    for (row, &qi) in s.chunks_exact(o.len()).zip(q) {
        for (x, &r) in o.iter_mut().zip(row) {
            *x += qi * r;
        }
    }
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

/// [`tree_recurrent`] on the host (CPU tensors): node by node in order, each from a copy of its
/// parent's state (moved, not copied, to its last child), heads one after another.
fn tree_recurrent_host(
    x: &DeltaInputs,
    state: &Tensor,
    parents: &[i64],
) -> Result<(Tensor, Tensor)> {
    let (t, h, dk, dv) = x.dims()?;
    let (q, k, v, beta) = (host(x.q)?, host(x.k)?, host(x.v)?, host(x.beta)?);
    let alpha = host(&x.g.exp()?)?;
    let base = host(state)?;
    let mut children = vec![0usize; t];
    for &p in parents.iter().filter(|&&p| p >= 0) {
        children[p as usize] += 1;
    }
    let mut states: Vec<Option<Vec<f32>>> = vec![None; t];
    let mut out = vec![0f32; t * h * dv];
    let mut pred = vec![0f32; dv];
    let size = h * dk * dv;
    for i in 0..t {
        let mut s = match parents[i] {
            p if p < 0 => base.clone(),
            p => {
                let p = p as usize;
                children[p] -= 1;
                match children[p] == 0 && p + 1 != t {
                    true => states[p].take().expect("a parent's state is kept"),
                    false => states[p].clone().expect("a parent's state is kept"),
                }
            }
        };
        for hh in 0..h {
            let (th, sh) = (i * h + hh, hh * dk * dv);
            let sv = &mut s[sh..sh + dk * dv];
            let kk = &k[th * dk..(th + 1) * dk];
            step_head(
                sv,
                kk,
                &v[th * dv..(th + 1) * dv],
                alpha[th],
                beta[th],
                &mut pred,
            );
            read_head(
                sv,
                &q[th * dk..(th + 1) * dk],
                &mut out[th * dv..(th + 1) * dv],
            );
        }
        debug_assert_eq!(s.len(), size);
        if children[i] > 0 || i + 1 == t {
            states[i] = Some(s);
        }
    }
    let dev = state.device();
    let last = states[t - 1].take().expect("the last node's state is kept");
    Ok((
        Tensor::from_vec(out, (t, h, dv), dev)?,
        Tensor::from_vec(last, (h, dk, dv), dev)?,
    ))
}

/// Depth of every node of a tree given by `parents` (`parents[i] < i`, `-1` for a child of the
/// starting state); an error names the first node that breaks the order.
pub fn tree_depths(parents: &[i64]) -> Result<Vec<usize>> {
    let mut depth = Vec::with_capacity(parents.len());
    for (i, &p) in parents.iter().enumerate() {
        if p < -1 || p >= i as i64 {
            return Err(CoreError::InvalidInput(format!(
                "tree: node {i} has parent {p} (parents must precede their children)"
            )));
        }
        depth.push(if p < 0 { 0 } else { depth[p as usize] + 1 });
    }
    Ok(depth)
}

/// Which nodes of a tree (`parents`, as [`tree_recurrent`] takes them) must keep their state for a
/// later node: those with a child other than the node right after them (a child at `i + 1`
/// continues from the state just computed). The CUDA kernel stores exactly these.
pub fn kept_states(parents: &[i64]) -> Vec<bool> {
    let mut keep = vec![false; parents.len()];
    for (c, &p) in parents.iter().enumerate() {
        if p >= 0 && p + 1 != c as i64 {
            keep[p as usize] = true;
        }
    }
    keep
}

/// The largest key head dim the CUDA kernel takes (a thread holds a state column of `dk` floats in
/// registers); wider heads step through candle's ops.
pub const MAX_KERNEL_KEY_DIM: usize = 256;

/// Whether [`tree_recurrent`] runs as one CUDA kernel launch on `device` for key head dim `dk`
/// (a build with the `cuda` feature, a CUDA device, `dk` ≤ [`MAX_KERNEL_KEY_DIM`] and a multiple
/// of 4). Then it beats
/// [`chunked`]'s dozens of small ops per chunk at every length, prefill included.
pub fn kernel_available(device: &candle_core::Device, dk: usize) -> bool {
    cfg!(feature = "cuda")
        && device.is_cuda()
        && dk <= MAX_KERNEL_KEY_DIM
        && dk.is_multiple_of(4)
        && kernels_enabled()
}

/// Whether the Gated DeltaNet kernels may run: not when `DFLASH_GDN_KERNELS=0` (read once; a
/// documented override for A/B runs against candle's composite, which stays the CPU's path).
pub fn kernels_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DFLASH_GDN_KERNELS").as_deref() != Ok("0"))
}

/// The rule's CUDA kernels (`gated_delta_kernels.cu`), all with the same arithmetic per output
/// (so the same bits): one lane a state column; four lanes a column (the default); four lanes
/// with each chunk of tokens' inputs staged in shared memory (`DFLASH_GDN_RULE_STAGE=1`, opt-in);
/// the same sized for the state commit's replays (chunks of 8 tokens, more warps an SM; the
/// replays' default, `DFLASH_GDN_REPLAY=rule` gives them the forward's); and that with the state's
/// loads first and each chunk's keys in two batches of loads (`DFLASH_GDN_REPLAY=prefetch`, opt-in
/// since session 29, measured no faster in session 30); and the replays' kernel with each key row
/// stored by lane group, read four floats at a time (`DFLASH_GDN_REPLAY=vec`, session 31: the same
/// bits (GPU test), measured on an H100 no faster — the 27B chain commit 0.205 against 0.208 ms and
/// 0.230 against 0.246, the tree commit slower, 0.52 against 0.28 twice).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RuleKernel {
    OneLane,
    FourLanes,
    FourLanesStaged,
    FourLanesStagedReplay,
    FourLanesStagedReplayPrefetch,
    FourLanesStagedReplayVec,
}

/// [`tree_recurrent`] on CUDA through the given rule kernel, whatever the environment says: the
/// GPU test that every kernel gives the same bits.
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub fn tree_recurrent_with_kernel(
    x: &DeltaInputs,
    state: &Tensor,
    parents: &[i64],
    kernel: RuleKernel,
) -> Result<(Tensor, Tensor)> {
    tree_depths(parents)?;
    crate::gated_delta_cuda::tree_recurrent_as(x, state, parents, kernel)
}

/// The rule over a token tree from `state`: node `i` continues from the state of its parent
/// `parents[i]` (`-1`: from `state`), so every node's output is what the rule gives along its own
/// path of ancestors. Nodes of one depth step together. Returns outputs `[T, H, dv]` and the state
/// after the last node (the final state when the tree is a chain).
pub fn tree_recurrent(
    x: &DeltaInputs,
    state: &Tensor,
    parents: &[i64],
) -> Result<(Tensor, Tensor)> {
    let (t, h, dk, dv) = x.dims()?;
    check_state(state, h, dk, dv)?;
    if parents.len() != t || t == 0 {
        return Err(CoreError::InvalidInput(format!(
            "tree recurrence: {} parents for {t} tokens",
            parents.len()
        )));
    }
    let depth = tree_depths(parents)?;
    if state.device().is_cpu() {
        return tree_recurrent_host(x, state, parents);
    }
    #[cfg(feature = "cuda")]
    if kernel_available(state.device(), dk) {
        return crate::gated_delta_cuda::tree_recurrent(x, state, parents);
    }
    let dev = state.device();
    let max_depth = depth.iter().copied().max().unwrap_or(0);
    let alpha = x.g.exp()?;
    // slot[i]: node i's row among the states of its depth
    let mut slot = vec![0usize; t];
    let mut prev = state.unsqueeze(0)?;
    let (mut outs, mut order) = (Vec::new(), Vec::with_capacity(t));
    let mut last_state = None;
    for d in 0..=max_depth {
        let nodes: Vec<u32> = (0..t)
            .filter(|&i| depth[i] == d)
            .map(|i| i as u32)
            .collect();
        let from: Vec<u32> = nodes
            .iter()
            .map(|&i| match parents[i as usize] {
                p if p < 0 => 0,
                p => slot[p as usize] as u32,
            })
            .collect();
        for (r, &i) in nodes.iter().enumerate() {
            slot[i as usize] = r;
        }
        let idx = Tensor::from_slice(&nodes, nodes.len(), dev)?;
        let from = Tensor::from_slice(&from, nodes.len(), dev)?;
        let pick = |a: &Tensor| a.index_select(&idx, 0);
        let s = step(
            &prev.index_select(&from, 0)?,
            &pick(x.k)?,
            &pick(x.v)?,
            &pick(&alpha)?,
            &pick(x.beta)?,
        )?;
        let m = nodes.len();
        let q = pick(x.q)?.reshape((m * h, 1, dk))?;
        let o = q
            .matmul(&s.reshape((m * h, dk, dv))?)?
            .reshape((m, h, dv))?;
        outs.push(o);
        if let Some(r) = nodes.iter().position(|&i| i as usize == t - 1) {
            last_state = Some(s.get(r)?);
        }
        order.extend(nodes);
        prev = s;
    }
    // back from depth order to node order
    let mut inverse = vec![0u32; t];
    for (r, &i) in order.iter().enumerate() {
        inverse[i as usize] = r as u32;
    }
    let out = Tensor::cat(&outs, 0)?.index_select(&Tensor::from_slice(&inverse, t, dev)?, 0)?;
    Ok((out, last_state.expect("the last node has a depth")))
}

/// The state after feeding tokens `k`, `v`, `g`, `beta` (`[T, H, ·]`, f32) one by one from
/// `state` — what [`tree_recurrent`] reaches at the end of that chain, without the outputs.
pub fn advance(
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &Tensor,
) -> Result<Tensor> {
    let t = k.dim(0)?;
    let alpha = g.exp()?;
    if state.device().is_cpu() {
        let (h, dk, dv) = state.dims3()?;
        let (k, v, alpha, beta) = (host(k)?, host(v)?, host(&alpha)?, host(beta)?);
        let mut s = host(state)?;
        let mut pred = vec![0f32; dv];
        for th in 0..t * h {
            let sh = (th % h) * dk * dv;
            let kk = &k[th * dk..(th + 1) * dk];
            let vv = &v[th * dv..(th + 1) * dv];
            step_head(
                &mut s[sh..sh + dk * dv],
                kk,
                vv,
                alpha[th],
                beta[th],
                &mut pred,
            );
        }
        return Ok(Tensor::from_vec(s, (h, dk, dv), state.device())?);
    }
    #[cfg(feature = "cuda")]
    if t > 0 && kernel_available(state.device(), k.dim(2)?) {
        // the one-layer case of the many-layer replay (the kernel the forward used)
        let job = AdvanceJob {
            k,
            v,
            g,
            beta,
            state,
            into: None,
        };
        return Ok(crate::gated_delta_cuda::advance_layers(&[job])?.remove(0));
    }
    let mut s = state.unsqueeze(0)?;
    for i in 0..t {
        let one = |a: &Tensor| a.narrow(0, i, 1);
        s = step(&s, &one(k)?, &one(v)?, &one(&alpha)?, &one(beta)?)?;
    }
    Ok(s.squeeze(0)?)
}

/// One layer's replay for [`advance_layers`]: tokens `k`, `v`, `g`, `beta` (`[T, H, ·]`, f32)
/// fed one by one from `state`.
#[derive(Clone, Copy)]
pub struct AdvanceJob<'a> {
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub g: &'a Tensor,
    pub beta: &'a Tensor,
    pub state: &'a Tensor,
    /// Where the new state goes (contiguous f32 `[H, dk, dv]`, possibly `state` itself: the
    /// hybrid device step's state buffer, committed in place); `None`: a fresh tensor.
    pub into: Option<&'a Tensor>,
}

/// [`advance`] for many layers of one shape and token count at once — the state commit of every
/// recurrent layer after a verify: one kernel launch on CUDA (the same code as the forward's, so
/// each state is the one [`advance`] gives, bit for bit), [`advance`] per job elsewhere.
pub fn advance_layers(jobs: &[AdvanceJob]) -> Result<Vec<Tensor>> {
    let Some(first) = jobs.first() else {
        return Ok(vec![]);
    };
    #[cfg(feature = "cuda")]
    if first.k.dim(0)? > 0 && kernel_available(first.state.device(), first.k.dim(2)?) {
        return crate::gated_delta_cuda::advance_layers(jobs);
    }
    let _ = first;
    jobs.iter()
        .map(|j| {
            let s = advance(j.k, j.v, j.g, j.beta, j.state)?;
            match j.into {
                Some(t) => {
                    t.slice_set(&s, 0, 0)?;
                    Ok(t.clone())
                }
                None => Ok(s),
            }
        })
        .collect()
}

/// `[n, n]` lower-triangular ones (diagonal included when `diag`).
fn tril(n: usize, diag: bool, device: &candle_core::Device) -> Result<Tensor> {
    let v: Vec<f32> = (0..n * n)
        .map(|e| {
            let (i, j) = (e / n, e % n);
            if j < i || (diag && j == i) {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    Ok(Tensor::from_vec(v, (n, n), device)?)
}

/// The rule over chunks of [`CHUNK`] tokens from `state`: outputs `[T, H, dv]` and the final
/// state (see the module docs). Per chunk, per head, with Γ the running sum of g inside the chunk
/// and `D_ij = e^{Γ_i − Γ_j}` (i ≥ j): `T = (I − A)⁻¹` for `A = −tril₀(diag(β) K Kᵀ ⊙ D)`,
/// `U = T (β ⊙ V)`, `W = T (β ⊙ e^Γ ⊙ K)`, `V' = U − W S`, then
/// `O = (e^Γ ⊙ Q) S + (tril(Q Kᵀ ⊙ D)) V'` and `S ← e^{Γ_C} S + (e^{Γ_C − Γ} ⊙ K)ᵀ V'`.
pub fn chunked(x: &DeltaInputs, state: &Tensor) -> Result<(Tensor, Tensor)> {
    let (t, h, dk, dv) = x.dims()?;
    check_state(state, h, dk, dv)?;
    let dev = state.device();
    let mut s = state.clone();
    let mut outs = vec![];
    let mut start = 0;
    while start < t {
        let c = CHUNK.min(t - start);
        // head-major chunk tensors
        let hm = |a: &Tensor| -> Result<Tensor> {
            Ok(a.narrow(0, start, c)?.transpose(0, 1)?.contiguous()?)
        };
        let (q, k, v) = (hm(x.q)?, hm(x.k)?, hm(x.v)?); // [H, c, d]
        let g = hm(x.g)?; // [H, c]
        let beta = hm(x.beta)?.unsqueeze(2)?; // [H, c, 1]
        let gamma = g.cumsum(1)?; // [H, c]
        let gi = gamma.unsqueeze(2)?; // [H, c, 1]
        let gj = gamma.unsqueeze(1)?; // [H, 1, c]
        let lower = tril(c, false, dev)?;
        let lower_diag = tril(c, true, dev)?;
        // D_ij = e^{Γi − Γj} where i ≥ j (0 elsewhere; masked before exp to avoid overflow)
        let diff = gi.broadcast_sub(&gj)?;
        let diff = diff.broadcast_mul(&lower_diag)?;
        let decay = diff.exp()?.broadcast_mul(&lower_diag)?; // [H, c, c]
        let kk = k.matmul(&k.transpose(1, 2)?)?; // [H, c, c]
        let a = (kk.broadcast_mul(&beta)? * &decay)?
            .broadcast_mul(&lower)?
            .neg()?;
        let tinv = inverse_unit_lower(&a, c)?; // (I − A)⁻¹
        let eg = gamma.exp()?.unsqueeze(2)?; // [H, c, 1]
        let u = tinv.matmul(&v.broadcast_mul(&beta)?)?; // [H, c, dv]
        let w = tinv.matmul(&k.broadcast_mul(&beta)?.broadcast_mul(&eg)?)?; // [H, c, dk]
        let v_new = (u - w.matmul(&s)?)?; // [H, c, dv]
        let qk = q.matmul(&k.transpose(1, 2)?)?; // [H, c, c]
        let inner = (qk * &decay)?.broadcast_mul(&lower_diag)?;
        let o = (q.broadcast_mul(&eg)?.matmul(&s)? + inner.matmul(&v_new)?)?; // [H, c, dv]
        outs.push(o.transpose(0, 1)?); // [c, H, dv]
        let g_last = gamma.narrow(1, c - 1, 1)?; // [H, 1]
        let tail = g_last.broadcast_sub(&gamma)?.exp()?.unsqueeze(2)?; // e^{Γ_C − Γ} [H, c, 1]
        let carried = s.broadcast_mul(&g_last.exp()?.unsqueeze(2)?)?;
        s = (carried + k.broadcast_mul(&tail)?.transpose(1, 2)?.matmul(&v_new)?)?;
        start += c;
    }
    let out = if outs.is_empty() {
        Tensor::zeros((0, h, dv), DType::F32, dev)?
    } else {
        Tensor::cat(&outs, 0)?.contiguous()?
    };
    Ok((out, s))
}

/// `(I − A)⁻¹` for strictly lower-triangular `A` `[H, n, n]`, by forward substitution: row i of
/// the inverse is `e_i + Σ_{j<i} A_ij · row j`.
fn inverse_unit_lower(a: &Tensor, n: usize) -> Result<Tensor> {
    let (h, _, _) = a.dims3()?;
    let eye = Tensor::eye(n, DType::F32, a.device())?;
    let mut rows: Vec<Tensor> = Vec::with_capacity(n);
    for i in 0..n {
        let e = eye
            .get(i)?
            .unsqueeze(0)?
            .broadcast_as((h, n))?
            .contiguous()?; // [H, n]
        let row = if i == 0 {
            e
        } else {
            let coeff = a.narrow(1, i, 1)?.narrow(2, 0, i)?; // [H, 1, i]
            let prev = Tensor::stack(&rows, 1)?; // [H, i, n]
            (e + coeff.matmul(&prev)?.squeeze(1)?)?
        };
        rows.push(row);
    }
    Ok(Tensor::stack(&rows, 1)?)
}

/// `x · rsqrt(Σx² + 1e-6)` over the last dimension (the rule's q/k normalisation, f32).
pub fn l2norm(x: &Tensor) -> Result<Tensor> {
    let ss = x.sqr()?.sum_keepdim(D::Minus1)?;
    Ok(x.broadcast_mul(&(ss + 1e-6)?.sqrt()?.recip()?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn inputs(t: usize, h: usize, dk: usize, dv: usize, seed: u64) -> Vec<Tensor> {
        let dev = Device::Cpu;
        let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        let mut rnd = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
                })
                .collect()
        };
        let q = l2norm(&Tensor::from_vec(rnd(t * h * dk), (t, h, dk), &dev).unwrap()).unwrap();
        let q = (q * (dk as f64).powf(-0.5)).unwrap();
        let k = l2norm(&Tensor::from_vec(rnd(t * h * dk), (t, h, dk), &dev).unwrap()).unwrap();
        let v = Tensor::from_vec(rnd(t * h * dv), (t, h, dv), &dev).unwrap();
        // g in (−1.5, 0), beta in (0, 1)
        let g: Vec<f32> = rnd(t * h).iter().map(|x| -0.75 * (x + 1.0)).collect();
        let b: Vec<f32> = rnd(t * h).iter().map(|x| 0.5 * (x + 1.0)).collect();
        let g = Tensor::from_vec(g, (t, h), &dev).unwrap();
        let b = Tensor::from_vec(b, (t, h), &dev).unwrap();
        vec![q, k, v, g, b]
    }

    use crate::test_util::max_abs_diff as max_diff;

    fn view(v: &[Tensor]) -> DeltaInputs<'_> {
        DeltaInputs {
            q: &v[0],
            k: &v[1],
            v: &v[2],
            g: &v[3],
            beta: &v[4],
        }
    }

    #[test]
    fn the_chunked_form_equals_the_recurrence_from_any_state() {
        let (h, dk, dv) = (3, 8, 6);
        for (t, seed) in [(1usize, 1u64), (5, 2), (64, 3), (100, 4), (130, 5)] {
            let v = inputs(t, h, dk, dv, seed);
            let s0 = (Tensor::randn(0f32, 0.3, (h, dk, dv), &Device::Cpu).unwrap()
                * (seed as f64 / 5.0))
                .unwrap();
            let r = recurrent(&view(&v), &s0, false).unwrap();
            let (o, s) = chunked(&view(&v), &s0).unwrap();
            assert_eq!(o.dims(), &[t, h, dv]);
            let (dout, dstate) = (max_diff(&o, &r.out), max_diff(&s, &r.state));
            assert!(
                dout < 1e-4 && dstate < 1e-4,
                "T {t}: out {dout}, state {dstate}"
            );
        }
    }

    #[test]
    fn checkpoints_are_the_states_of_each_prefix_and_chunks_continue_from_them() {
        let (t, h, dk, dv) = (20, 2, 4, 5);
        let v = inputs(t, h, dk, dv, 9);
        let s0 = Tensor::zeros((h, dk, dv), DType::F32, &Device::Cpu).unwrap();
        let r = recurrent(&view(&v), &s0, true).unwrap();
        let ck = r.checkpoints.unwrap();
        assert_eq!(ck.dims(), &[t, h, dk, dv]);
        assert!(max_diff(&ck.get(t - 1).unwrap(), &r.state) == 0.0);
        // the prefix 0..=6 alone ends in checkpoint 6; continuing from it gives the rest
        let cut = |a: usize, b: usize| -> Vec<Tensor> {
            v.iter().map(|x| x.narrow(0, a, b - a).unwrap()).collect()
        };
        let head = cut(0, 7);
        let (_, s7) = chunked(&view(&head), &s0).unwrap();
        assert!(max_diff(&s7, &ck.get(6).unwrap()) < 1e-5);
        let tail = cut(7, t);
        let (o_tail, s_end) = chunked(&view(&tail), &ck.get(6).unwrap()).unwrap();
        assert!(max_diff(&o_tail, &r.out.narrow(0, 7, t - 7).unwrap()) < 1e-5);
        assert!(max_diff(&s_end, &r.state) < 1e-5);
    }

    /// transformers' own torch implementations of the rule (the functions its Qwen3.5 layers
    /// call; `scripts/make_gated_delta_fixture.py` on the GPU machine), from a random state, q and
    /// k l2-normalised inside them and q scaled by dk^-½ — here before the call.
    #[test]
    fn both_forms_match_transformers() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/gated-delta/rule.safetensors");
        let f = candle_core::safetensors::load(&path, &Device::Cpu).expect("the committed fixture");
        let dk = f["q"].dim(2).unwrap();
        let q = (l2norm(&f["q"]).unwrap() * (dk as f64).powf(-0.5)).unwrap();
        let k = l2norm(&f["k"]).unwrap();
        let x = DeltaInputs {
            q: &q,
            k: &k,
            v: &f["v"],
            g: &f["g"],
            beta: &f["beta"],
        };
        let (o, s) = chunked(&x, &f["state0"]).unwrap();
        assert!(
            max_diff(&o, &f["out_chunked"]) < 2e-5,
            "{}",
            max_diff(&o, &f["out_chunked"])
        );
        assert!(max_diff(&s, &f["state_chunked"]) < 2e-5);
        let r = recurrent(&x, &f["state0"], false).unwrap();
        assert!(max_diff(&r.out, &f["out_recurrent"]) < 2e-5);
        assert!(max_diff(&r.state, &f["state_recurrent"]) < 2e-5);
    }

    #[test]
    fn each_tree_node_gets_the_rule_along_its_own_path() {
        let (h, dk, dv) = (2, 4, 3);
        let parents = [-1i64, 0, 0, 1, 1, 2, 3, -1];
        let t = parents.len();
        let v = inputs(t, h, dk, dv, 21);
        let s0 = Tensor::randn(0f32, 0.3, (h, dk, dv), &Device::Cpu).unwrap();
        let (out, last) = tree_recurrent(&view(&v), &s0, &parents).unwrap();
        assert_eq!(out.dims(), &[t, h, dv]);
        for node in 0..t {
            let mut path = vec![];
            let mut i = node as i64;
            while i >= 0 {
                path.push(i as u32);
                i = parents[i as usize];
            }
            path.reverse();
            let idx = Tensor::from_slice(&path, path.len(), &Device::Cpu).unwrap();
            let sub: Vec<Tensor> = v.iter().map(|x| x.index_select(&idx, 0).unwrap()).collect();
            let r = recurrent(&view(&sub), &s0, false).unwrap();
            let want = r.out.get(path.len() - 1).unwrap();
            let err = max_diff(&out.get(node).unwrap(), &want);
            assert!(err < 1e-5, "node {node}: {err}");
            let s = advance(&sub[1], &sub[2], &sub[3], &sub[4], &s0).unwrap();
            assert!(max_diff(&s, &r.state) < 1e-5);
            if node == t - 1 {
                assert!(max_diff(&last, &r.state) < 1e-5);
            }
        }
        // a chain is the plain recurrence
        let chain: Vec<i64> = (0..t as i64).map(|i| i - 1).collect();
        let (o, s) = tree_recurrent(&view(&v), &s0, &chain).unwrap();
        let r = recurrent(&view(&v), &s0, false).unwrap();
        assert!(max_diff(&o, &r.out) < 1e-5 && max_diff(&s, &r.state) < 1e-5);
        assert!(tree_recurrent(&view(&v), &s0, &[0, 0, 0, 0, 0, 0, 0, 0]).is_err());
    }

    #[test]
    fn bad_shapes_are_refused() {
        let v = inputs(4, 2, 4, 4, 1);
        let s_bad = Tensor::zeros((2, 4, 5), DType::F32, &Device::Cpu).unwrap();
        assert!(recurrent(&view(&v), &s_bad, false).is_err());
        assert!(chunked(&view(&v), &s_bad).is_err());
        let mut w = v.clone();
        w[3] = Tensor::zeros((4, 3), DType::F32, &Device::Cpu).unwrap();
        let s = Tensor::zeros((2, 4, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(recurrent(&view(&w), &s, false).is_err());
    }
}
