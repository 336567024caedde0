//! Fixed device buffers of the hybrids' device step (Gated DeltaNet layers in a CUDA graph): each
//! recurrent layer's state, committed in place, and the record of its last step, plus the
//! scratch every recurrent layer of one sequence shares.
//!
//! Invariants:
//! - Every address is fixed for the life of the sequence cache (a crop to zero keeps the
//!   buffers), so a step graph that bakes them in stays valid; each layer's rule pointer table
//!   ([`crate::gated_delta_layer::upload_rule_table`]) is uploaded once, when the buffers are
//!   made — outside any capture: a cache's first device step is never captured.
//! - A step writes rows `0..rows` of a layer's record buffers and reads its state buffers only;
//!   the state moves on at the commit ([`crate::RecurrentCache::commit_step`]) as a replay of the
//!   kept tokens written over the state buffers in place — the same kernel, so the same bits, as
//!   every other forward and replay.
//! - [`SharedStepBuffers::tree`] holds the step's parents (rows `0..R`), kept-state flags
//!   (rows `R..2R`) and the folded commit's pending count (word `2R`), copied from the step's
//!   metadata at the start of each step (no upload).
//! - The folded commit (CUDA, opt-in — measured no faster in session 35: `DFLASH_GDN_FOLD=1` or
//!   [`crate::SequenceCache::set_fold_commit`] turns it on): a chain replay pending from the last
//!   step ([`crate::RecurrentCache::pending_step_chain`], at most [`FOLD_ROWS`] rows) is not
//!   launched before the next step but done inside it — the step's prologue
//!   ([`CommitTables::fold_prologue`]) moves every convolution window and copies the pending rule
//!   inputs aside ([`RecurrentStepBuffers::pending`]) before any layer overwrites the record, and
//!   each layer's rule kernel advances its state over them in place before its own rows. The
//!   state is read once instead of twice; the arithmetic is the replay's (the same bits).

use crate::gated_delta_layer::{LayerHeads, StepRuleBuffers};
use crate::{CoreError, Result};
use candle_core::{DType, Device, Tensor};

/// The shapes of a sequence's recurrent layers (all alike) and the most rows a step takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    pub heads: LayerHeads,
    /// Convolution channels `C = 2·Hk·dk + Hv·dv`.
    pub channels: usize,
    /// Convolution width `K`.
    pub conv_kernel: usize,
    /// `R`, the most rows one step takes.
    pub rows: usize,
}

/// The most pending rows a folded commit takes (a DFlash block's or a tree path's accepted
/// tokens; more settle through the separate replay before the step).
pub const FOLD_ROWS: usize = 32;

/// Scratch every recurrent layer of one sequence's device step shares (layers run one after
/// another): the convolved inputs `u` `[R, C]`, the rule's queries `[R, Hv, dk]`, outputs
/// `[R, Hv, dv]`, kept node states `[R, Hv, dk, dv]` (f32), and the
/// step's parents then kept flags then the folded commit's pending count (u32 `[2R + 1]`).
#[derive(Debug, Clone)]
pub struct SharedStepBuffers {
    pub shape: StepShape,
    pub u: Tensor,
    pub q: Tensor,
    pub out: Tensor,
    pub scratch: Tensor,
    pub tree: Tensor,
    /// Whether the steps over these buffers fold the state commit in (the cache's setting,
    /// [`crate::SequenceCache::set_fold_commit`]).
    pub fold: bool,
}

impl SharedStepBuffers {
    pub fn new(shape: StepShape, device: &Device) -> Result<Self> {
        let LayerHeads { hv, dk, dv, .. } = shape.heads;
        let r = shape.rows;
        let z = |dims: &[usize]| Tensor::zeros(dims, DType::F32, device);
        Ok(Self {
            shape,
            u: z(&[r, shape.channels])?,
            q: z(&[r, hv, dk])?,
            out: z(&[r, hv, dv])?,
            scratch: z(&[r, hv, dk, dv])?,
            tree: Tensor::zeros(2 * r + 1, DType::U32, device)?,
            fold: false,
        })
    }

    /// The folded commit's pending count (word `2R` of [`SharedStepBuffers::tree`]; 0: none).
    pub fn pending_count(&self) -> Result<Tensor> {
        Ok(self.tree.narrow(0, 2 * self.shape.rows, 1)?)
    }

    /// The step's parents (first `rows` entries).
    pub fn parents(&self, rows: usize) -> Result<Tensor> {
        Ok(self.tree.narrow(0, 0, rows)?)
    }

    /// Copies the step's parents, kept flags and pending count from its metadata (`[past,
    /// tokens[n], rope_rows[2n], parents[n], kept[n], pending]`, [`crate::step::StepMeta`] plus
    /// the flags and the count) into [`SharedStepBuffers::tree`]: three device copies, capturable.
    pub fn load_tree(&self, meta: &Tensor, rows: usize) -> Result<()> {
        let r = self.shape.rows;
        if rows == 0 || rows > r || meta.elem_count() < 2 + 5 * rows {
            return Err(CoreError::InvalidInput(format!(
                "recurrent step: {rows} rows (at most {r}), metadata of {} words",
                meta.elem_count()
            )));
        }
        let parents = meta.narrow(0, 1 + 3 * rows, rows)?;
        let kept = meta.narrow(0, 1 + 4 * rows, rows)?;
        copy(&self.tree.narrow(0, 0, rows)?, &parents)?;
        copy(&self.tree.narrow(0, r, rows)?, &kept)?;
        copy(&self.pending_count()?, &meta.narrow(0, 1 + 5 * rows, 1)?)
    }
}

/// One recurrent layer's buffers: its state (`conv` `[K − 1, C]`, `ssm` `[Hv, dk, dv]`, f32), the
/// record of its last step (`conv_in` `[R, C]`, `k` `[R, Hv, dk]`, `v` `[R, Hv, dv]`, `g`, `beta`
/// `[R, Hv]`, f32), the rule's pointer table over them and the shared scratch (u32 `[22]`), and
/// the folded commit's pending rule inputs ([`PendingInputs`]) with their table (u32 `[10]`: k, v,
/// g, beta, the shared pending count).
#[derive(Debug, Clone)]
pub struct RecurrentStepBuffers {
    pub conv: Tensor,
    pub ssm: Tensor,
    pub conv_in: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub g: Tensor,
    pub beta: Tensor,
    pub table: Tensor,
    pub pending: PendingInputs,
    pub fold_table: Tensor,
}

/// A folded commit's pending rule inputs, copied out of the record at the step's start: k
/// `[P, Hv, dk]`, v `[P, Hv, dv]`, g and beta `[P, Hv]` (f32, `P` = [`FOLD_ROWS`]).
#[derive(Debug, Clone)]
pub struct PendingInputs {
    pub k: Tensor,
    pub v: Tensor,
    pub g: Tensor,
    pub beta: Tensor,
}

impl RecurrentStepBuffers {
    /// Zeroed buffers for `shared`'s shapes, and their rule table (uploaded now: call it outside
    /// any capture).
    pub fn new(shared: &SharedStepBuffers, device: &Device) -> Result<Self> {
        let s = shared.shape;
        let LayerHeads { hv, dk, dv, .. } = s.heads;
        let r = s.rows;
        let z = |dims: &[usize]| Tensor::zeros(dims, DType::F32, device);
        let b = Self {
            conv: z(&[s.conv_kernel - 1, s.channels])?,
            ssm: z(&[hv, dk, dv])?,
            conv_in: z(&[r, s.channels])?,
            k: z(&[r, hv, dk])?,
            v: z(&[r, hv, dv])?,
            g: z(&[r, hv])?,
            beta: z(&[r, hv])?,
            table: Tensor::zeros(22, DType::U32, device)?,
            pending: PendingInputs {
                k: z(&[FOLD_ROWS, hv, dk])?,
                v: z(&[FOLD_ROWS, hv, dv])?,
                g: z(&[FOLD_ROWS, hv])?,
                beta: z(&[FOLD_ROWS, hv])?,
            },
            fold_table: Tensor::zeros(10, DType::U32, device)?,
        };
        if !device.is_cuda() {
            // the host's emulation reads the buffers themselves, not a pointer table
            return Ok(b);
        }
        let keep = shared.tree.narrow(0, r, r)?;
        crate::gated_delta_layer::upload_rule_table(
            &b.table,
            &StepRuleBuffers {
                q: &shared.q,
                k: &b.k,
                v: &b.v,
                g: &b.g,
                beta: &b.beta,
                state: &b.ssm,
                parents: &shared.tree,
                keep: &keep,
                out: &shared.out,
                scratch: &shared.scratch,
            },
        )?;
        #[cfg(feature = "cuda")]
        crate::gated_delta_commit_cuda::upload_fold_table(
            &b.fold_table,
            &b.pending,
            &shared.pending_count()?,
        )?;
        Ok(b)
    }

    /// The rule inputs' buffers for a step of `rows` rows (views of the record and the shared
    /// queries), as [`crate::gated_delta_layer::conv_and_rule_inputs_into`] fills them.
    pub fn rule_inputs(
        &self,
        shared: &SharedStepBuffers,
        rows: usize,
    ) -> Result<crate::gated_delta_layer::RuleInputs> {
        let head = |t: &Tensor| t.narrow(0, 0, rows);
        Ok(crate::gated_delta_layer::RuleInputs {
            qkv: head(&self.conv_in)?,
            q: head(&shared.q)?,
            k: head(&self.k)?,
            v: head(&self.v)?,
            g: head(&self.g)?,
            beta: head(&self.beta)?,
        })
    }

    /// Whether `t` is this layer's delta-rule state buffer itself (not a copy).
    pub fn is_state(&self, ssm: &Tensor) -> bool {
        ssm.id() == self.ssm.id()
    }
}

/// Words a layer takes in the commit tables' record gather table: its five record buffers
/// (convolution inputs, k, v, g, beta), each an address and a row width (u64 each).
pub(crate) const GATHER_WORDS: usize = 20;

/// The fixed pointer tables of a sequence's state commit on CUDA (every recurrent layer, in layer
/// order; uploaded once with the buffers): a chain commit — the first `n` rows of every layer's
/// step record kept — is then two launches with no host work per layer
/// ([`CommitTables::commit_chains`]), the same kernels, so the same bits, as
/// [`crate::recurrent_cache::settle_replays`].
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct CommitTables {
    replay: Tensor,
    windows: Tensor,
    /// Every layer's record buffers and row widths (the tree path's gather).
    gather: Tensor,
    /// The kept path's record rows of the last gather (u32 `[R]`).
    path: Tensor,
    /// Every layer's rule records and their pending copies with row widths (the folded commit's
    /// prologue copy: 4 buffers × 3 words (u64) a layer).
    pending: Tensor,
    layers: usize,
    shape: StepShape,
}

impl CommitTables {
    /// The tables over `layers` (all of a sequence's recurrent layers, in order); `None` off CUDA
    /// (the host emulation settles layer by layer).
    pub fn new(
        layers: &[&RecurrentStepBuffers],
        shape: StepShape,
        device: &Device,
    ) -> Result<Option<Self>> {
        if !device.is_cuda() || layers.is_empty() {
            return Ok(None);
        }
        let replay = Tensor::zeros(22 * layers.len(), DType::U32, device)?;
        let windows = Tensor::zeros(6 * layers.len(), DType::U32, device)?;
        let gather = Tensor::zeros(GATHER_WORDS * layers.len(), DType::U32, device)?;
        let path = Tensor::zeros(shape.rows, DType::U32, device)?;
        let pending = Tensor::zeros(24 * layers.len(), DType::U32, device)?;
        #[cfg(feature = "cuda")]
        crate::gated_delta_commit_cuda::upload_commit_tables(
            &replay, &windows, &gather, &pending, layers,
        )?;
        Ok(Some(Self {
            replay,
            windows,
            gather,
            path,
            pending,
            layers: layers.len(),
            shape,
        }))
    }

    /// The folded commit's prologue, at the start of a device step (capturable; `count`: the
    /// step's pending count, [`SharedStepBuffers::pending_count`], 0 for none): every layer's
    /// convolution window moved over its record's first `count` rows, and its rule inputs of
    /// those rows copied to [`RecurrentStepBuffers::pending`] — two launches, before any layer
    /// reads a window or overwrites its record.
    pub fn fold_prologue(&self, count: &Tensor) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            let LayerHeads { hv, dk, dv, .. } = self.shape.heads;
            crate::gated_delta_commit_cuda::fold_prologue(
                &self.windows,
                &self.pending,
                count,
                self.layers,
                hv * dk.max(dv),
                self.shape,
            )
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (count, &self.pending);
            Err(CoreError::InvalidInput(
                "commit tables exist on CUDA only".into(),
            ))
        }
    }

    /// Layers the tables cover.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Every layer's state and window advanced in place along the first `n` rows of its record.
    pub fn commit_chains(&self, n: usize) -> Result<()> {
        if n == 0 || n > self.shape.rows {
            return Err(CoreError::InvalidInput(format!(
                "state commit of {n} rows (records hold {})",
                self.shape.rows
            )));
        }
        #[cfg(feature = "cuda")]
        return crate::gated_delta_commit_cuda::commit_from_tables(
            &self.replay,
            &self.windows,
            self.layers,
            n,
            self.shape,
        );
        #[cfg(not(feature = "cuda"))]
        Err(CoreError::InvalidInput(
            "commit tables exist on CUDA only".into(),
        ))
    }

    /// A verified tree's accepted root path compacted in every layer's step record: record rows
    /// `nodes` (strictly increasing) moved to rows `0..nodes.len()` in place — one upload of the
    /// rows, one launch — so that [`CommitTables::commit_chains`] then commits the path.
    pub fn gather_path(&self, nodes: &[u32]) -> Result<()> {
        self.check_path(nodes)?;
        if nodes.iter().enumerate().all(|(i, &r)| r as usize == i) {
            return Ok(()); // the path is rows 0..m already
        }
        #[cfg(feature = "cuda")]
        {
            let LayerHeads { hv, dk, dv, .. } = self.shape.heads;
            let widest = self.shape.channels.max(hv * dk).max(hv * dv);
            crate::gated_delta_commit_cuda::gather_records(
                &self.gather,
                &self.path,
                self.layers,
                widest,
                nodes,
            )
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (&self.gather, &self.path);
            Err(CoreError::InvalidInput(
                "commit tables exist on CUDA only".into(),
            ))
        }
    }

    /// Whether [`CommitTables::gather_path`] takes `nodes` (strictly increasing rows of the
    /// records): checked before anything moves.
    pub fn check_path(&self, nodes: &[u32]) -> Result<()> {
        if nodes.is_empty()
            || nodes.len() > self.shape.rows
            || nodes.windows(2).any(|w| w[0] >= w[1])
            || nodes.last().is_some_and(|&r| r as usize >= self.shape.rows)
        {
            return Err(CoreError::InvalidInput(format!(
                "record gather of rows {nodes:?} (records hold {}; rows must increase)",
                self.shape.rows
            )));
        }
        Ok(())
    }
}

/// The folded commit's prologue in the device step's host emulation (the CPU: tests of the fold's
/// bookkeeping): for each layer, its window moved over its record's first `count` rows and their
/// rule inputs copied to its pending buffers — what [`CommitTables::fold_prologue`]'s kernels do.
pub(crate) fn fold_prologue_on_host(
    shared: &SharedStepBuffers,
    layers: &[&RecurrentStepBuffers],
) -> Result<()> {
    let n = shared.pending_count()?.to_vec1::<u32>()?[0] as usize;
    if n == 0 {
        return Ok(());
    }
    if n > FOLD_ROWS {
        return Err(CoreError::InvalidInput(format!(
            "folded commit of {n} rows (at most {FOLD_ROWS})"
        )));
    }
    for b in layers {
        let p = &b.pending;
        for (src, dst) in [(&b.k, &p.k), (&b.v, &p.v), (&b.g, &p.g), (&b.beta, &p.beta)] {
            dst.slice_set(&src.narrow(0, 0, n)?.contiguous()?, 0, 0)?;
        }
        crate::gated_delta_layer::conv_windows_into(&[(&b.conv, &b.conv_in)], n, Some(&[&b.conv]))?;
    }
    Ok(())
}

/// `src` into `dst` (same shape and dtype, `dst` a contiguous view of a buffer): a device copy
/// on CUDA; on the CPU (the host's emulation of the device step, for tests) the same copy.
fn copy(dst: &Tensor, src: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if dst.device().is_cuda() {
        return crate::step_cuda::copy_into(dst, src);
    }
    if dst.dims() != src.dims() || dst.dtype() != src.dtype() {
        return Err(CoreError::InvalidInput(format!(
            "recurrent step: copy of {:?} into {:?}",
            src.dims(),
            dst.dims()
        )));
    }
    // into the buffer at the view's offset (`slice_set` writes through a contiguous view)
    dst.slice_set(&src.contiguous()?, 0, 0)?;
    Ok(())
}

/// Writes `src` over the buffer `dst` (same shape; any device): the state a host forward left,
/// moved into the device step's state buffer.
pub(crate) fn overwrite(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.dims() != src.dims() {
        return Err(CoreError::InvalidInput(format!(
            "recurrent step: a state {:?} into a buffer {:?}",
            src.dims(),
            dst.dims()
        )));
    }
    #[cfg(feature = "cuda")]
    if dst.device().is_cuda() {
        return crate::step_cuda::copy_into(dst, &src.to_dtype(dst.dtype())?);
    }
    dst.slice_set(&src.to_dtype(dst.dtype())?.contiguous()?, 0, 0)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The device step's cache bookkeeping on the CPU (the kernels' part runs on the GPU): a state
    //! a host forward left is copied into the buffers, a step's record is replayed into them in
    //! place after a crop or a path compaction, and a replay that overwrote its start consumes
    //! the record.
    use super::*;
    use crate::recurrent_cache::{RecurrentCache, RecurrentRecord, RecurrentState};
    use crate::test_util::max_abs_diff;

    const H: usize = 2;
    const DK: usize = 4;
    const DV: usize = 3;
    const C: usize = 5;
    const W: usize = 2;
    const R: usize = 6;

    fn rnd(shape: &[usize], seed: u64) -> Tensor {
        Tensor::rand(-0.5f32, 0.5, shape, &Device::Cpu)
            .unwrap()
            .affine(1.0, seed as f64 * 1e-3)
            .unwrap()
    }

    fn buffers() -> RecurrentStepBuffers {
        let z = |d: &[usize]| Tensor::zeros(d, DType::F32, &Device::Cpu).unwrap();
        RecurrentStepBuffers {
            conv: rnd(&[W, C], 1),
            ssm: rnd(&[H, DK, DV], 2),
            conv_in: z(&[R, C]),
            k: z(&[R, H, DK]),
            v: z(&[R, H, DV]),
            g: z(&[R, H]),
            beta: z(&[R, H]),
            table: Tensor::zeros(22, DType::U32, &Device::Cpu).unwrap(),
            pending: PendingInputs {
                k: z(&[FOLD_ROWS, H, DK]),
                v: z(&[FOLD_ROWS, H, DV]),
                g: z(&[FOLD_ROWS, H]),
                beta: z(&[FOLD_ROWS, H]),
            },
            fold_table: Tensor::zeros(10, DType::U32, &Device::Cpu).unwrap(),
        }
    }

    /// A device step's rows written into the record buffers (as the kernels would).
    fn write_record(b: &RecurrentStepBuffers, seed: u64) {
        b.conv_in.slice_set(&rnd(&[R, C], seed), 0, 0).unwrap();
        b.k.slice_set(&rnd(&[R, H, DK], seed + 1), 0, 0).unwrap();
        b.v.slice_set(&rnd(&[R, H, DV], seed + 2), 0, 0).unwrap();
        let g = (rnd(&[R, H], seed + 3) - 0.6).unwrap();
        b.g.slice_set(&g, 0, 0).unwrap();
        let beta = (rnd(&[R, H], seed + 4) + 0.5).unwrap();
        b.beta.slice_set(&beta, 0, 0).unwrap();
    }

    /// The state after `nodes` of the record in `b`, from `start` (the record's host reference).
    fn expected(b: &RecurrentStepBuffers, start: &RecurrentState, nodes: &[u32]) -> RecurrentState {
        let rec = RecurrentRecord {
            start: start.clone(),
            conv_in: b.conv_in.clone(),
            k: b.k.clone(),
            v: b.v.clone(),
            g: b.g.clone(),
            beta: b.beta.clone(),
            parents: (0..R as i64).map(|i| i - 1).collect(),
        };
        rec.select(nodes).unwrap().state_after(nodes.len()).unwrap()
    }

    fn assert_zero(b: &RecurrentStepBuffers) {
        let sum = b.ssm.abs().unwrap().sum_all().unwrap();
        assert_eq!(sum.to_scalar::<f32>().unwrap(), 0.0, "a zeroed state");
    }

    fn copy_of(b: &RecurrentStepBuffers) -> RecurrentState {
        RecurrentState {
            conv: b.conv.copy().unwrap(),
            ssm: b.ssm.copy().unwrap(),
        }
    }

    fn assert_holds(b: &RecurrentStepBuffers, want: &RecurrentState, what: &str) {
        assert_eq!(max_abs_diff(&b.ssm, &want.ssm), 0.0, "{what}: state");
        assert_eq!(
            max_abs_diff(&b.conv, &want.conv),
            0.0,
            "{what}: conv window"
        );
    }

    #[test]
    fn step_buffers_take_host_states_and_settle_replays_in_place() {
        let b = buffers();
        let mut cache = RecurrentCache::new(64);
        cache.set_step_buffers(b.clone());
        // the empty cache: zeros
        cache.load_step_state().unwrap();
        assert_zero(&b);
        // a host forward's end state is copied in
        let end = RecurrentState {
            conv: rnd(&[W, C], 11),
            ssm: rnd(&[H, DK, DV], 12),
        };
        let host = RecurrentRecord {
            start: cache.state().unwrap().unwrap(),
            conv_in: rnd(&[3, C], 13),
            k: rnd(&[3, H, DK], 14),
            v: rnd(&[3, H, DV], 15),
            g: rnd(&[3, H], 16),
            beta: rnd(&[3, H], 17),
            parents: vec![-1, 0, 1],
        };
        cache.commit(host, Some(end.clone())).unwrap();
        assert_eq!(cache.pending_step_chain(), None, "a host forward's record");
        cache.load_step_state().unwrap();
        assert_holds(&b, &end, "host state");
        // a chain step of 5, cropped to 3 of its tokens: replayed into the buffers in place
        write_record(&b, 20);
        let before = copy_of(&b);
        cache.commit_step(&[-1, 0, 1, 2, 3]).unwrap();
        assert_eq!(cache.len(), 8);
        cache.crop(6);
        // what the fixed commit tables would settle on CUDA: 3 rows of the step's own record
        assert_eq!(cache.pending_step_chain(), Some(3));
        let mut tables_path = cache.clone();
        cache.load_step_state().unwrap();
        assert_holds(&b, &expected(&b, &before, &[0, 1, 2]), "chain crop");
        assert_eq!(cache.pending_step_chain(), None, "settled");
        // counting it settled in place (after the tables' launches) leaves the same bookkeeping
        tables_path.settled_in_place().unwrap();
        assert_eq!(tables_path.len(), cache.len());
        assert!(tables_path.settled_in_place().is_err(), "nothing pending");
        let mut probe = tables_path.clone();
        probe.crop(5);
        assert!(probe.state().is_err(), "the record is consumed");
        // the replay overwrote its start: a crop back into that step is refused, not approximated
        let mut probe = cache.clone();
        probe.crop(5);
        assert!(probe.state().is_err());
        // a whole chain kept (an AR step): the next load replays all of it
        write_record(&b, 30);
        let before = copy_of(&b);
        cache.commit_step(&[-1]).unwrap();
        cache.load_step_state().unwrap();
        assert_holds(&b, &expected(&b, &before, &[0]), "AR step");
        // a tree, one root path kept
        write_record(&b, 40);
        let before = copy_of(&b);
        cache.commit_step(&[-1, 0, 0, 2, 1, 3]).unwrap();
        let base = cache.len() - 6;
        assert_eq!(
            cache.pending_step_chain(),
            None,
            "a tree: no state until a path is kept"
        );
        cache.keep_rows(base, &[0, 2, 3]).unwrap();
        assert_eq!(
            cache.pending_step_chain(),
            None,
            "a compacted path is a gathered record, not the step's rows"
        );
        cache.load_step_state().unwrap();
        assert_holds(&b, &expected(&b, &before, &[0, 2, 3]), "tree path");
        // the same tree, its path gathered in the record in place (what the commit tables' gather
        // does on CUDA, done here on the host): then a chain replay of the step's own record
        write_record(&b, 50);
        let before = copy_of(&b);
        cache.commit_step(&[-1, 0, 0, 2, 1, 3]).unwrap();
        let base = cache.len() - 6;
        assert!(
            cache.step_path(base, &[0, 2, 4]).is_err(),
            "not a root path"
        );
        let nodes = cache.step_path(base, &[0, 2, 3]).unwrap().unwrap();
        assert_eq!(nodes, vec![0, 2, 3]);
        let want = expected(&b, &before, &nodes);
        for t in [&b.conv_in, &b.k, &b.v, &b.g, &b.beta] {
            for (i, &r) in nodes.iter().enumerate() {
                let row = t.narrow(0, r as usize, 1).unwrap().copy().unwrap();
                t.slice_set(&row, 0, i).unwrap();
            }
        }
        cache.path_gathered_in_place(base, 3, nodes.len()).unwrap();
        assert_eq!(cache.len(), base + 3);
        assert_eq!(
            cache.pending_step_chain(),
            Some(3),
            "a chain of the step's record"
        );
        cache.load_step_state().unwrap();
        assert_holds(&b, &want, "tree path gathered in place");
        // crop(0) keeps the buffers (graphs bake them in) and zeroes them at the next load
        cache.crop(0);
        assert!(cache.step_buffers().is_some());
        cache.load_step_state().unwrap();
        assert_zero(&b);
    }
}
