//! Launch of the gated delta rule's tree kernel (`gated_delta_kernels.cu`, NVRTC, one module per
//! key head dim, compiled on first use): [`crate::gated_delta::tree_recurrent`] and
//! [`crate::gated_delta::advance`] on CUDA, one launch instead of a dozen candle ops per tree
//! depth or per token.
//!
//! Invariants: inputs are made contiguous f32 here; the parents and the kept-state flags
//! ([`crate::gated_delta::kept_states`]) cross to the device in one upload; every output element
//! is written by exactly one thread, so outputs are allocated uninitialised; the scratch holds
//! only kept nodes' states (allocated when some node is kept); everything runs on candle's
//! stream, in order with the ops around it.

use crate::gated_delta::{kept_states, DeltaInputs};
use crate::step_cuda::address;
use crate::{CoreError, Result};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Tensor};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

const SOURCE: &str = include_str!("gated_delta_kernels.cu");
/// Threads of a block: one warp, a state column each (more blocks over the SMs for a few heads).
const THREADS: usize = 32;

/// The kernel module compiled for key head dim `dk` (cached per process).
fn ptx(dk: usize) -> candle_core::Result<String> {
    static PTX: OnceLock<Mutex<HashMap<usize, std::result::Result<String, String>>>> =
        OnceLock::new();
    let mut map = PTX
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .expect("the PTX cache lock is never poisoned");
    map.entry(dk)
        .or_insert_with(|| {
            candle_core::cuda_backend::cudarc::nvrtc::compile_ptx(format!(
                "#define DK {dk}\n{SOURCE}"
            ))
            .map(|p| p.to_src())
            .map_err(|e| format!("gated delta kernel (DK {dk}): NVRTC failed: {e:?}"))
        })
        .clone()
        .map_err(candle_core::Error::Msg)
}

/// The rule over the tree `parents` from `state` on the device: the outputs `[T, H, dv]` (when
/// `outputs`) and the state after the last node `[H, dk, dv]`. `parents` must already be checked
/// (`tree_depths`); `x.q` is not read without `outputs`.
pub(crate) fn tree_recurrent(
    x: &DeltaInputs,
    state: &Tensor,
    parents: &[i64],
    outputs: bool,
) -> Result<(Option<Tensor>, Tensor)> {
    let (t, h, dk) = x.k.dims3()?;
    let dv = x.v.dim(2)?;
    if t == 0 || parents.len() != t || state.dims() != [h, dk, dv] {
        return Err(CoreError::InvalidInput(format!(
            "gated delta kernel: {} parents, k {:?}, state {:?}",
            parents.len(),
            x.k.dims(),
            state.dims()
        )));
    }
    let dev_t = state.device();
    let c = |a: &Tensor| a.to_dtype(DType::F32).and_then(|a| a.contiguous());
    let (q, k, v, g, beta, s0) = (c(x.q)?, c(x.k)?, c(x.v)?, c(x.g)?, c(x.beta)?, c(state)?);
    // parents then the kept flags, one upload
    let keep = kept_states(parents);
    let any_kept = keep.iter().any(|&b| b);
    let words: Vec<u32> = parents
        .iter()
        .map(|&p| p as i32 as u32)
        .chain(keep.iter().map(|&b| b as u32))
        .collect();
    let meta = Tensor::from_vec(words, 2 * t, dev_t)?;
    // SAFETY (all three): every element the kernel's readers see is written by it first.
    let out = if outputs {
        Some(unsafe { Tensor::empty((t, h, dv), DType::F32, dev_t)? })
    } else {
        None
    };
    let scratch = if any_kept {
        Some(unsafe { Tensor::empty((t, h, dk, dv), DType::F32, dev_t)? })
    } else {
        None
    };
    let last = unsafe { Tensor::empty((h, dk, dv), DType::F32, dev_t)? };
    let (qp, dev) = address(if outputs { &q } else { &k }, "gated delta q")?;
    let (kp, _) = address(&k, "gated delta k")?;
    let (vp, _) = address(&v, "gated delta v")?;
    let (gp, _) = address(&g, "gated delta g")?;
    let (bp, _) = address(&beta, "gated delta beta")?;
    let (sp, _) = address(&s0, "gated delta state")?;
    let (mp, _) = address(&meta, "gated delta parents")?;
    let kp_flags = mp + 4 * t as u64;
    let op = match &out {
        Some(o) => address(o, "gated delta out")?.0,
        None => 0u64,
    };
    let scp = match &scratch {
        Some(s) => address(s, "gated delta scratch")?.0,
        None => 0u64,
    };
    let (lp, _) = address(&last, "gated delta state out")?;
    let (ti, hi, dvi) = (t as i32, h as i32, dv as i32);
    let cfg = LaunchConfig {
        grid_dim: (dv.div_ceil(THREADS) as u32, h as u32, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let module = format!("dflash_gated_delta_dk{dk}");
    let f = dev.get_or_load_custom_func("gated_delta_tree_f32", &module, &ptx(dk)?)?;
    let mut b = f.builder();
    b.arg(&qp)
        .arg(&kp)
        .arg(&vp)
        .arg(&gp)
        .arg(&bp)
        .arg(&sp)
        .arg(&mp)
        .arg(&kp_flags)
        .arg(&op)
        .arg(&scp)
        .arg(&lp)
        .arg(&ti)
        .arg(&hi)
        .arg(&dvi);
    // SAFETY: arguments in the kernel's order and types; device addresses of live contiguous
    // tensors of the sizes it reads and writes (the scratch exists whenever a node is kept; out
    // is null only without outputs, which the kernel checks).
    unsafe { b.launch(cfg) }.w()?;
    Ok((out, last))
}
