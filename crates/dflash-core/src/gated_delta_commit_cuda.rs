//! The Gated DeltaNet state commit's launches on CUDA (`gated_delta_kernels.cu`): the
//! convolution windows after the kept tokens, the fixed commit tables of a hybrid device step's
//! buffers (replay, windows, record gather, the folded commit's copy and per-layer tables), the
//! folded commit's prologue, the tree path's record gather and the chain commit from the tables.
//!
//! Invariants: tables are uploaded once, when the buffers are made (outside any capture); the
//! launches read only fixed buffers, so a CUDA graph captures them; a window or a state may be
//! written over its start (per channel or column, each thread reads before it writes); the folded
//! commit's launches read their row count on the device.

use crate::gated_delta_cuda::{launch_table_as, ptx, replay_kernel, table_words, LayerArgs};
use crate::step_cuda::address;
use crate::{CoreError, Result};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Tensor};

/// See [`crate::gated_delta_layer::conv_windows`]: one table upload, one launch.
/// `outs`: the windows' destinations (contiguous f32 `[W, C]`, which may be the jobs' starts:
/// the kernel commits in place safely), else fresh tensors.
pub(crate) fn conv_windows(
    jobs: &[(&Tensor, &Tensor)],
    n: usize,
    outs_into: Option<&[&Tensor]>,
) -> Result<Vec<Tensor>> {
    let (w, c) = jobs[0].0.dims2()?;
    let dev_t = jobs[0].0.device();
    let mut kept = Vec::with_capacity(jobs.len());
    let mut outs = Vec::with_capacity(jobs.len());
    let mut words = Vec::with_capacity(6 * jobs.len());
    if outs_into.is_some_and(|o| o.len() != jobs.len()) {
        return Err(CoreError::InvalidInput(
            "conv_windows: one output per job".into(),
        ));
    }
    for (i, &(start, conv_in)) in jobs.iter().enumerate() {
        if start.dims() != [w, c] || conv_in.dim(1)? != c || conv_in.dim(0)? < n {
            return Err(CoreError::InvalidInput(format!(
                "conv_windows: start {:?}, inputs {:?}, {n} kept",
                start.dims(),
                conv_in.dims()
            )));
        }
        let f32c = |a: &Tensor| a.to_dtype(DType::F32).and_then(|a| a.contiguous());
        let (s, x) = (f32c(start)?, f32c(conv_in)?);
        let out = match outs_into.map(|o| o[i]) {
            Some(t) if t.dims() == [w, c] && t.dtype() == DType::F32 && t.is_contiguous() => {
                t.clone()
            }
            Some(t) => {
                return Err(CoreError::InvalidInput(format!(
                    "conv_windows: an output {:?} {:?} for windows [{w}, {c}] f32",
                    t.dims(),
                    t.dtype()
                )))
            }
            // SAFETY: every element is written by the kernel.
            None => unsafe { Tensor::empty((w, c), DType::F32, dev_t)? },
        };
        for t in [&s, &x, &out] {
            let p = address(t, "conv window")?.0;
            words.push(p as u32);
            words.push((p >> 32) as u32);
        }
        kept.push((s, x));
        outs.push(out);
    }
    // SAFETY: the upload writes the whole table before the kernel reads it.
    let meta = unsafe { Tensor::empty(words.len(), DType::U32, dev_t)? };
    crate::step_cuda::upload_meta(&meta, &words)?;
    // the table holds live contiguous f32 tensors of the checked sizes
    launch_conv_windows(&meta, jobs.len(), n, w, c)?;
    drop(kept);
    Ok(outs)
}

/// `gdn_conv_window_layers` over the `layers` (start, inputs, out) address triples in `table`:
/// each window `[w, c]` moved over `n` inputs. The caller guarantees the table names live
/// contiguous f32 tensors of those sizes (an output may be its start: per channel, in row order).
fn launch_conv_windows(table: &Tensor, layers: usize, n: usize, w: usize, c: usize) -> Result<()> {
    let (mp, dev) = address(table, "conv window table")?;
    let (ni, wi, ci) = (n as i32, w as i32, c as i32);
    let cfg = LaunchConfig {
        grid_dim: (c.div_ceil(128) as u32, layers as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let module = "dflash_gated_delta_dk16"; // the window does not depend on DK
    let f = dev.get_or_load_custom_func("gdn_conv_window_layers", module, ptx(16)?)?;
    let mut b = f.builder();
    b.arg(&mp).arg(&ni).arg(&wi).arg(&ci);
    // SAFETY: see the function's contract; `table` outlives the launch on this stream.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Writes the fixed tables of a hybrid device step's state commit over every recurrent layer's
/// buffers, in layer order: `replay` (22 u32 words a layer) makes the rule's kernel advance each
/// layer's state buffer in place along the first rows of its step record (no outputs, nothing
/// kept), `windows` (6 words a layer) makes the window kernel move each convolution window buffer
/// in place over the same rows. Uploaded once, when the buffers are made.
pub(crate) fn upload_commit_tables(
    replay: &Tensor,
    windows: &Tensor,
    gather: &Tensor,
    pending: &Tensor,
    layers: &[&crate::recurrent_step::RecurrentStepBuffers],
) -> Result<()> {
    let ptr = |t: &Tensor, what: &str| address(t, what).map(|p| p.0);
    let mut args = Vec::with_capacity(layers.len());
    let mut words = Vec::with_capacity(6 * layers.len());
    let mut gathered = Vec::with_capacity(crate::recurrent_step::GATHER_WORDS * layers.len());
    let mut copies = Vec::with_capacity(24 * layers.len());
    for b in layers {
        let p = &b.pending;
        for (src, dst) in [(&b.k, &p.k), (&b.v, &p.v), (&b.g, &p.g), (&b.beta, &p.beta)] {
            let width = (src.elem_count() / src.dim(0)?) as u64;
            for w in [
                ptr(src, "record buffer")?,
                ptr(dst, "pending buffer")?,
                width,
            ] {
                copies.push(w as u32);
                copies.push((w >> 32) as u32);
            }
        }
        for t in [&b.conv_in, &b.k, &b.v, &b.g, &b.beta] {
            let width = (t.elem_count() / t.dim(0)?) as u64;
            for w in [ptr(t, "record buffer")?, width] {
                gathered.push(w as u32);
                gathered.push((w >> 32) as u32);
            }
        }
        let ssm = ptr(&b.ssm, "commit state")?;
        let k = ptr(&b.k, "commit k")?;
        args.push(LayerArgs {
            q: k,
            k,
            v: ptr(&b.v, "commit v")?,
            g: ptr(&b.g, "commit g")?,
            beta: ptr(&b.beta, "commit beta")?,
            state: ssm,
            parents: 0,
            keep: 0,
            out: 0,
            scratch: 0,
            last: ssm, // in place: each thread reads its column before it writes it
        });
        let conv = ptr(&b.conv, "commit conv window")?;
        for p in [conv, ptr(&b.conv_in, "commit conv inputs")?, conv] {
            words.push(p as u32);
            words.push((p >> 32) as u32);
        }
    }
    crate::step_cuda::upload_meta(replay, &table_words(&args, &[]))?;
    crate::step_cuda::upload_meta(gather, &gathered)?;
    crate::step_cuda::upload_meta(pending, &copies)?;
    crate::step_cuda::upload_meta(windows, &words)
}

/// Writes one layer's folded commit table (u32 `[10]`: its pending k, v, g, beta and the shared
/// pending count's address) into `table`; uploaded once, with the buffers.
pub(crate) fn upload_fold_table(
    table: &Tensor,
    pending: &crate::recurrent_step::PendingInputs,
    count: &Tensor,
) -> Result<()> {
    let mut words = Vec::with_capacity(10);
    for (t, what) in [
        (&pending.k, "pending k"),
        (&pending.v, "pending v"),
        (&pending.g, "pending g"),
        (&pending.beta, "pending beta"),
        (count, "pending count"),
    ] {
        let p = address(t, what)?.0;
        words.push(p as u32);
        words.push((p >> 32) as u32);
    }
    crate::step_cuda::upload_meta(table, &words)
}

/// The folded commit's prologue over every layer (see
/// [`crate::recurrent_step::CommitTables::fold_prologue`]): the windows of `windows` moved over
/// the record's first `*count` rows, the rule inputs of the `pending` table copied aside. Two
/// launches that read the count on the device (capturable); `widest`: the widest record row.
pub(crate) fn fold_prologue(
    windows: &Tensor,
    pending: &Tensor,
    count: &Tensor,
    layers: usize,
    widest: usize,
    shape: crate::recurrent_step::StepShape,
) -> Result<()> {
    let (wp, dev) = address(windows, "conv window table")?;
    let (pp, _) = address(pending, "pending copy table")?;
    let (cp, _) = address(count, "pending count")?;
    let module = "dflash_gated_delta_dk16"; // neither depends on DK
    let (w, c) = ((shape.conv_kernel - 1) as i32, shape.channels);
    let f = dev.get_or_load_custom_func("gdn_conv_window_layers_pending", module, ptx(16)?)?;
    let cfg = LaunchConfig {
        grid_dim: (c.div_ceil(128) as u32, layers as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let ci = c as i32;
    let mut b = f.builder();
    b.arg(&wp).arg(&cp).arg(&w).arg(&ci);
    // SAFETY: the table names every layer's live window and record buffers (fixed for the
    // cache's life, contiguous f32 of the step shape); the count is at most the records' rows.
    unsafe { b.launch(cfg) }.w()?;
    let f = dev.get_or_load_custom_func("gdn_record_pending_rows", module, ptx(16)?)?;
    let cfg = LaunchConfig {
        grid_dim: ((4 * layers) as u32, widest.div_ceil(256) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = f.builder();
    b.arg(&pp).arg(&cp);
    // SAFETY: the table names each layer's record buffers and pending copies (FOLD_ROWS rows,
    // the count at most that: `SequenceCache::foldable_step_chain`) with their row widths.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// The accepted root path's record rows `rows` (strictly increasing, below the records' row
/// count: `CommitTables::check_path`) gathered to rows `0..rows.len()` of every layer's record in
/// place, through the gather table of [`upload_commit_tables`] over `layers` layers whose widest
/// record row is `widest` floats: the rows copied into `path` (a u32 buffer), one launch.
pub(crate) fn gather_records(
    gather: &Tensor,
    path: &Tensor,
    layers: usize,
    widest: usize,
    rows: &[u32],
) -> Result<()> {
    crate::step_cuda::upload_meta(path, rows)?;
    let (gp, dev) = address(gather, "record gather table")?;
    let (pp, _) = address(path, "record gather rows")?;
    let m = rows.len() as i32;
    let cfg = LaunchConfig {
        grid_dim: ((5 * layers) as u32, widest.div_ceil(256) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let module = "dflash_gated_delta_dk16"; // the gather does not depend on DK
    let f = dev.get_or_load_custom_func("gdn_record_keep_rows", module, ptx(16)?)?;
    let mut b = f.builder();
    b.arg(&gp).arg(&pp).arg(&m);
    // SAFETY: the table names live f32 record buffers of the cache (fixed for its life) with
    // their row widths; `path` holds `m` rows below the records' row count; in stream order.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// The state commit of every recurrent layer from the tables of [`upload_commit_tables`]: each
/// layer's state advanced in place along the first `n` rows of its record, then its
/// convolution window moved over them — two launches, no upload, whatever the layer count.
pub(crate) fn commit_from_tables(
    replay: &Tensor,
    windows: &Tensor,
    layers: usize,
    n: usize,
    shape: crate::recurrent_step::StepShape,
) -> Result<()> {
    let heads = shape.heads;
    let dims = (n, heads.hv, heads.dk, heads.dv);
    launch_table_as(replay, layers, dims, replay_kernel())?;
    // the table holds the layers' window and record buffers (fixed for the cache's life,
    // contiguous f32 of the step shape)
    launch_conv_windows(windows, layers, n, shape.conv_kernel - 1, shape.channels)
}
