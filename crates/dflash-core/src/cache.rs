//! Preallocated KV caches that can be cropped (reject a speculative tail) and compacted (keep the
//! rows of an accepted tree path).
//!
//! Invariants:
//! - A [`KvCache`] owns `[b, kv_heads, capacity, head_dim]` buffers (b = 1 except in batched
//!   decoding, where all sequences share one length and padding is masked) for keys and values, allocated
//!   on first append; rows `0..len` are valid, rows past `len` are garbage and never read.
//! - `crop(n)` and `keep_rows(base, idx)` never reallocate and never touch rows below `base`.
//! - A [`SequenceCache`] holds one [`LayerCache`] per decoder layer; all layers always have the same
//!   length. Recurrent layers (Gated DeltaNet) are [`LayerCache::Recurrent`], whose `crop` /
//!   `keep_rows` restore exactly the kept tokens' state ([`crate::recurrent_cache`]), so decoding
//!   code never needs to change. A dense device step counts its rows with `advance` (which refuses
//!   recurrent layers); a hybrid's with `commit_device_step`, its recurrent layers' fixed buffers
//!   made by `ensure_recurrent_step_buffers` ([`crate::recurrent_step`]) with the fixed tables
//!   through which `settle_recurrent` commits a step's kept chain in two launches on CUDA.

use crate::recurrent_cache::RecurrentCache;
use crate::{CoreError, Result};
use candle_core::{Device, Tensor};

#[derive(Debug, Clone)]
pub struct KvCache {
    capacity: usize,
    len: usize,
    buffers: Option<(Tensor, Tensor)>,
}

impl KvCache {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            len: 0,
            buffers: None,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Appends `k`, `v` (`[1, kv_heads, n, head_dim]`) after the valid rows and returns views of all
    /// valid rows `0..len+n`.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let n = k.dim(2)?;
        let needed = self.len + n;
        if needed > self.capacity {
            return Err(CoreError::CacheOverflow {
                needed,
                capacity: self.capacity,
            });
        }
        if self.buffers.is_none() {
            let (b, h, _, d) = k.dims4()?;
            let kb = Tensor::zeros((b, h, self.capacity, d), k.dtype(), k.device())?;
            let vb = Tensor::zeros((b, h, self.capacity, v.dim(3)?), v.dtype(), v.device())?;
            self.buffers = Some((kb, vb));
        }
        let (kb, vb) = self.buffers.as_ref().expect("allocated above");
        kb.slice_set(&k.contiguous()?, 2, self.len)?;
        vb.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len = needed;
        Ok((kb.narrow(2, 0, self.len)?, vb.narrow(2, 0, self.len)?))
    }

    /// The whole `[b, kv_heads, capacity, head_dim]` key and value buffers, allocated (zeros)
    /// if no row was written yet. The device step writes into them and then calls
    /// [`KvCache::advance`].
    pub fn buffers_for(
        &mut self,
        kv_heads: usize,
        head_dim: usize,
        dtype: candle_core::DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        if self.buffers.is_none() {
            let shape = (1, kv_heads, self.capacity, head_dim);
            self.buffers = Some((
                Tensor::zeros(shape, dtype, device)?,
                Tensor::zeros(shape, dtype, device)?,
            ));
        }
        let (k, v) = self.buffers.as_ref().expect("allocated above");
        if k.dims() != [1, kv_heads, self.capacity, head_dim] || k.dtype() != dtype {
            return Err(CoreError::InvalidInput(format!(
                "KV cache holds {:?} {:?}, the step needs [1, {kv_heads}, {}, {head_dim}] {dtype:?}",
                k.dims(),
                k.dtype(),
                self.capacity
            )));
        }
        Ok((k.clone(), v.clone()))
    }

    /// Counts `n` rows written past the valid ones by a device step.
    pub fn advance(&mut self, n: usize) -> Result<()> {
        let needed = self.len + n;
        if needed > self.capacity {
            return Err(CoreError::CacheOverflow {
                needed,
                capacity: self.capacity,
            });
        }
        self.len = needed;
        Ok(())
    }

    /// Views of the valid rows, if any were written.
    pub fn view(&self) -> Result<Option<(Tensor, Tensor)>> {
        match &self.buffers {
            Some((k, v)) if self.len > 0 => {
                Ok(Some((k.narrow(2, 0, self.len)?, v.narrow(2, 0, self.len)?)))
            }
            _ => Ok(None),
        }
    }

    /// Forgets every row at or past `len`.
    pub fn crop(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Keeps, in order, rows `base + rows[i]` and moves them to `base + i`; the length becomes
    /// `base + rows.len()`. Rows must lie in `base..len`.
    pub fn keep_rows(&mut self, base: usize, rows: &[u32]) -> Result<()> {
        if rows.iter().any(|&r| base + r as usize >= self.len) {
            return Err(CoreError::InvalidInput(format!(
                "keep_rows: row out of range (base {base}, len {}, rows {rows:?})",
                self.len
            )));
        }
        let identity = rows.iter().enumerate().all(|(i, &r)| i as u32 == r);
        if !identity {
            if let Some((kb, vb)) = &self.buffers {
                let idx = Tensor::from_slice(rows, rows.len(), kb.device())?;
                let tail = self.len - base;
                let k = kb
                    .narrow(2, base, tail)?
                    .contiguous()?
                    .index_select(&idx, 2)?;
                let v = vb
                    .narrow(2, base, tail)?
                    .contiguous()?
                    .index_select(&idx, 2)?;
                kb.slice_set(&k, 2, base)?;
                vb.slice_set(&v, 2, base)?;
            }
        }
        self.len = base + rows.len();
        Ok(())
    }
}

impl KvCache {
    /// Keeps batch rows `rows` (in that order) of a batched cache; used when finished sequences
    /// leave a batch. Reallocates the buffers (the batch dimension shrinks).
    pub fn select_batch(&mut self, rows: &[u32]) -> Result<()> {
        if let Some((kb, vb)) = &self.buffers {
            let b = kb.dim(0)?;
            if let Some(&r) = rows.iter().find(|&&r| r as usize >= b) {
                return Err(CoreError::InvalidInput(format!(
                    "select_batch: row {r} of a batch of {b}"
                )));
            }
            let idx = Tensor::from_slice(rows, rows.len(), kb.device())?;
            self.buffers = Some((kb.index_select(&idx, 0)?, vb.index_select(&idx, 0)?));
        }
        Ok(())
    }
}

/// The state one decoder layer keeps between forwards.
#[derive(Debug, Clone)]
pub enum LayerCache {
    Attention(KvCache),
    /// A Gated DeltaNet layer's conv window and delta-rule state.
    Recurrent(RecurrentCache),
}

impl LayerCache {
    fn len(&self) -> usize {
        match self {
            LayerCache::Attention(c) => c.len(),
            LayerCache::Recurrent(c) => c.len(),
        }
    }
    fn crop(&mut self, len: usize) {
        match self {
            LayerCache::Attention(c) => c.crop(len),
            LayerCache::Recurrent(c) => c.crop(len),
        }
    }
    fn keep_rows(&mut self, base: usize, rows: &[u32]) -> Result<()> {
        match self {
            LayerCache::Attention(c) => c.keep_rows(base, rows),
            LayerCache::Recurrent(c) => c.keep_rows(base, rows),
        }
    }
    fn select_batch(&mut self, rows: &[u32]) -> Result<()> {
        match self {
            LayerCache::Attention(c) => c.select_batch(rows),
            LayerCache::Recurrent(c) => c.select_batch(rows),
        }
    }
}

/// The whole model's state for one sequence.
#[derive(Debug, Clone)]
pub struct SequenceCache {
    pub layers: Vec<LayerCache>,
    /// CUDA graphs of this cache's device steps (they bake in its buffers).
    pub step_graphs: crate::step_graph::StepGraphs,
    /// The scratch the recurrent layers of a hybrid's device step share (made with their own
    /// buffers by [`SequenceCache::ensure_recurrent_step_buffers`]).
    pub recurrent_step: Option<crate::recurrent_step::SharedStepBuffers>,
    /// The fixed tables of the recurrent layers' state commit (CUDA; made with their buffers).
    recurrent_commit: Option<crate::recurrent_step::CommitTables>,
    /// Whether device steps fold a pending chain commit into their rule kernels
    /// ([`crate::recurrent_step`]'s invariants; fixed for the graphs captured under it).
    fold_commit: bool,
    /// Commits folded into device steps so far (tests and benchmarks check that they ran).
    folded_commits: usize,
    capacity: usize,
    device: Device,
}

impl SequenceCache {
    pub fn attention_only(num_layers: usize, capacity: usize, device: &Device) -> Self {
        let recurrent = vec![false; num_layers];
        Self::hybrid(&recurrent, capacity, device)
    }

    /// One layer cache per entry of `recurrent`: a [`RecurrentCache`] where it is true, else a
    /// [`KvCache`].
    pub fn hybrid(recurrent: &[bool], capacity: usize, device: &Device) -> Self {
        Self {
            layers: recurrent
                .iter()
                .map(|&r| match r {
                    true => LayerCache::Recurrent(RecurrentCache::new(capacity)),
                    false => LayerCache::Attention(KvCache::new(capacity)),
                })
                .collect(),
            step_graphs: Default::default(),
            recurrent_step: None,
            recurrent_commit: None,
            fold_commit: device.is_cuda()
                && recurrent.contains(&true)
                && crate::gated_delta_layer::fold_commit_default(),
            folded_commits: 0,
            capacity,
            device: device.clone(),
        }
    }

    /// Number of committed positions (all layers agree).
    pub fn len(&self) -> usize {
        self.layers.first().map(|l| l.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn crop(&mut self, len: usize) {
        for l in &mut self.layers {
            l.crop(len);
        }
    }

    /// Makes every recurrent layer's state at the cache's length concrete — the replays a crop
    /// or a path compaction left pending — all layers at once
    /// ([`crate::recurrent_cache::settle_replays`]: one kernel launch on CUDA). A forward calls it
    /// first; otherwise each layer would replay alone on first use (the same states).
    pub fn settle_recurrent(&mut self) -> Result<()> {
        if self.settle_step_chains()? {
            return Ok(());
        }
        let mut rec: Vec<&mut RecurrentCache> = self
            .layers
            .iter_mut()
            .filter_map(|l| match l {
                LayerCache::Recurrent(c) => Some(c),
                LayerCache::Attention(_) => None,
            })
            .collect();
        crate::recurrent_cache::settle_replays(&mut rec)
    }

    /// [`SequenceCache::settle_recurrent`] through the fixed commit tables when every recurrent
    /// layer's pending state is a chain replay of its last device step's record of the same
    /// length (a DFlash or AR step's crop): two launches, no per-layer host work. `false` where
    /// the general path must run (nothing pending, a compacted tree path, a host forward's
    /// record, no tables).
    fn settle_step_chains(&mut self) -> Result<bool> {
        let Some(tables) = &self.recurrent_commit else {
            return Ok(false);
        };
        let Some(n) = self
            .uniform_step_chain()
            .filter(|_| self.tables_cover_every_layer())
        else {
            return Ok(false);
        };
        tables.commit_chains(n)?;
        self.count_step_chains_settled()?;
        Ok(true)
    }

    /// Whether the commit tables cover every recurrent layer.
    fn tables_cover_every_layer(&self) -> bool {
        let layers = self
            .layers
            .iter()
            .filter(|l| matches!(l, LayerCache::Recurrent(_)))
            .count();
        self.recurrent_commit
            .as_ref()
            .is_some_and(|t| t.layers() == layers)
    }

    /// The rows every recurrent layer keeps when each one's pending state is a chain replay of
    /// its last device step's record of the same length.
    fn uniform_step_chain(&self) -> Option<usize> {
        let mut n = None;
        let mut layers = 0;
        for l in &self.layers {
            if let LayerCache::Recurrent(c) = l {
                layers += 1;
                match (c.pending_step_chain(), n) {
                    (Some(k), None) => n = Some(k),
                    (Some(k), Some(m)) if k == m => {}
                    _ => return None,
                }
            }
        }
        n.filter(|_| layers > 0)
    }

    fn count_step_chains_settled(&mut self) -> Result<()> {
        for l in &mut self.layers {
            if let LayerCache::Recurrent(c) = l {
                c.settled_in_place()?;
            }
        }
        Ok(())
    }

    /// Turns the folded state commit of hybrid device steps on or off (on only where the rule's
    /// kernel takes it: [`crate::gated_delta_layer::fold_commit_default`]'s conditions but the
    /// switch). The graphs captured under the other setting are dropped.
    pub fn set_fold_commit(&mut self, on: bool) {
        let hybrid = self
            .layers
            .iter()
            .any(|l| matches!(l, LayerCache::Recurrent(_)));
        // (on the CPU, the device step's host emulation folds with host kernels: tests)
        let on = on
            && hybrid
            && (self.device.is_cpu() || crate::gated_delta_layer::fold_commit_supported());
        if on != self.fold_commit {
            self.step_graphs = Default::default();
        }
        self.fold_commit = on;
        if let Some(s) = &mut self.recurrent_step {
            s.fold = on;
        }
    }

    /// Whether hybrid device steps fold the state commit in (never for attention-only caches).
    pub fn fold_commit(&self) -> bool {
        self.fold_commit
    }

    /// The pending rows the next device step folds into its rule kernels (the pending count of
    /// its metadata): a uniform chain replay of the last step's records of at most
    /// [`crate::recurrent_step::FOLD_ROWS`] rows while the fold is on; `None` where the state
    /// must settle before the step ([`SequenceCache::load_recurrent_step_states`]).
    pub fn foldable_step_chain(&self) -> Option<usize> {
        let shared = self.recurrent_step.as_ref()?;
        if !(self.fold_commit && shared.fold) {
            return None;
        }
        // CUDA folds through the commit tables' prologue; the CPU's emulation needs none
        let covered = self.device.is_cpu() || self.tables_cover_every_layer();
        self.uniform_step_chain()
            .filter(|&n| covered && n <= crate::recurrent_step::FOLD_ROWS)
    }

    /// The folded commit's prologue in the device step (see
    /// [`crate::recurrent_step::CommitTables::fold_prologue`]); nothing where the fold is off.
    pub fn fold_prologue(&self) -> Result<()> {
        match (&self.recurrent_step, &self.recurrent_commit) {
            (Some(s), Some(t)) if s.fold => t.fold_prologue(&s.pending_count()?),
            (Some(s), None) if s.fold && self.device.is_cpu() => {
                let layers: Vec<&crate::recurrent_step::RecurrentStepBuffers> = self
                    .layers
                    .iter()
                    .filter_map(|l| match l {
                        LayerCache::Recurrent(c) => c.step_buffers(),
                        LayerCache::Attention(_) => None,
                    })
                    .collect();
                crate::recurrent_step::fold_prologue_on_host(s, &layers)
            }
            _ => Ok(()),
        }
    }

    /// Counts the chain [`SequenceCache::foldable_step_chain`] named as committed: the device
    /// step that folded it in has been queued, so the state buffers hold it.
    pub fn count_folded_commit(&mut self) -> Result<()> {
        self.count_step_chains_settled()?;
        self.folded_commits += 1;
        Ok(())
    }

    /// How many commits device steps have folded in on this cache.
    pub fn folded_commits(&self) -> usize {
        self.folded_commits
    }

    /// After a device step that was to fold a commit failed: whether its kernels ran is unknown,
    /// so every recurrent layer's state is lost (a later step or crop fails with the reason)
    /// instead of being replayed a second time.
    pub fn abandon_folded_commit(&mut self, why: &str) {
        for l in &mut self.layers {
            if let LayerCache::Recurrent(c) = l {
                c.lose(format!(
                    "a device step that folded the state commit failed: {why}"
                ));
            }
        }
    }

    pub fn keep_rows(&mut self, base: usize, rows: &[u32]) -> Result<()> {
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() && self.keep_rows_on_device(base, rows)? {
            return Ok(());
        }
        // recurrent layers first: they refuse rows that are not a path before anything moves
        let (rec, att): (Vec<_>, Vec<_>) = self
            .layers
            .iter_mut()
            .partition(|l| matches!(l, LayerCache::Recurrent(_)));
        for l in rec.into_iter().chain(att) {
            l.keep_rows(base, rows)?;
        }
        Ok(())
    }

    /// [`SequenceCache::keep_rows`] as one kernel over every attention layer's buffers
    /// (single-sequence caches, a strictly increasing path) and, on a hybrid whose recurrent
    /// layers all hold their device step's own record, one gather of the path's rows in those
    /// records through the commit tables (so the commit is then the tables' chain commit);
    /// `false` where the per-layer path must run (before anything moved).
    #[cfg(feature = "cuda")]
    fn keep_rows_on_device(&mut self, base: usize, rows: &[u32]) -> Result<bool> {
        let len = self.len();
        if rows.iter().any(|&r| base + r as usize >= len) {
            return Err(CoreError::InvalidInput(format!(
                "keep_rows: row out of range (base {base}, len {len}, rows {rows:?})"
            )));
        }
        if rows.windows(2).any(|w| w[0] >= w[1]) {
            return Ok(false);
        }
        let mut buffers = Vec::with_capacity(2 * self.layers.len());
        // recurrent layers: the path's rows of every layer's own step record (all alike)
        let mut path: Option<Vec<u32>> = None;
        for l in &self.layers {
            match l {
                LayerCache::Attention(c) => match &c.buffers {
                    Some((k, v)) if k.dim(0)? == 1 => {
                        buffers.push(k.clone());
                        buffers.push(v.clone());
                    }
                    _ => return Ok(false),
                },
                LayerCache::Recurrent(c) => {
                    if self.recurrent_commit.is_none() || rows.is_empty() {
                        return Ok(false);
                    }
                    match (c.step_path(base, rows)?, &path) {
                        (Some(nodes), None) => path = Some(nodes),
                        (Some(nodes), Some(p)) if &nodes == p => {}
                        _ => return Ok(false),
                    }
                }
            }
        }
        if let (Some(nodes), Some(tables)) = (&path, &self.recurrent_commit) {
            tables.check_path(nodes)?; // before anything moves
        }
        let identity = rows.iter().enumerate().all(|(i, &r)| i as u32 == r);
        if !identity && !buffers.is_empty() {
            crate::step_cuda::keep_rows_all(&buffers, base, rows)?;
        }
        if let (Some(nodes), Some(tables)) = (&path, &self.recurrent_commit) {
            tables.gather_path(nodes)?;
        }
        for l in &mut self.layers {
            match l {
                LayerCache::Attention(c) => c.len = base + rows.len(),
                LayerCache::Recurrent(c) => {
                    let n = path.as_ref().map_or(0, Vec::len);
                    c.path_gathered_in_place(base, rows.len(), n)?;
                }
            }
        }
        Ok(true)
    }

    /// Makes the hybrids' device-step buffers (the shared scratch, then each recurrent layer's
    /// state, record and rule table) where they are missing; they live as long as the cache.
    /// Call it outside any capture (it uploads the rule tables).
    pub fn ensure_recurrent_step_buffers(
        &mut self,
        shape: crate::recurrent_step::StepShape,
    ) -> Result<()> {
        use crate::recurrent_step::{CommitTables, RecurrentStepBuffers, SharedStepBuffers};
        let shared = match &self.recurrent_step {
            Some(s) if s.shape == shape => s.clone(),
            Some(s) => {
                return Err(CoreError::InvalidInput(format!(
                    "recurrent step buffers made for {:?}, asked for {shape:?}",
                    s.shape
                )))
            }
            None => {
                let mut s = SharedStepBuffers::new(shape, &self.device)?;
                s.fold = self.fold_commit;
                self.recurrent_step = Some(s.clone());
                s
            }
        };
        let mut made = false;
        for l in &mut self.layers {
            if let LayerCache::Recurrent(c) = l {
                if c.step_buffers().is_none() {
                    c.set_step_buffers(RecurrentStepBuffers::new(&shared, &self.device)?);
                    made = true;
                }
            }
        }
        if made {
            let buffers: Vec<&RecurrentStepBuffers> = self
                .layers
                .iter()
                .filter_map(|l| match l {
                    LayerCache::Recurrent(c) => c.step_buffers(),
                    LayerCache::Attention(_) => None,
                })
                .collect();
            self.recurrent_commit = CommitTables::new(&buffers, shape, &self.device)?;
        }
        Ok(())
    }

    /// Puts every recurrent layer's state at the cache's length into its device-step buffers
    /// (pending replays settled there in place, all layers at once).
    pub fn load_recurrent_step_states(&mut self) -> Result<()> {
        self.settle_recurrent()?;
        for l in &mut self.layers {
            if let LayerCache::Recurrent(c) = l {
                c.load_step_state()?;
            }
        }
        Ok(())
    }

    /// Counts a hybrid device step of `parents.len()` real rows: attention layers advance over
    /// the keys it wrote, recurrent layers keep its record (see
    /// [`crate::RecurrentCache::commit_step`]).
    pub fn commit_device_step(&mut self, parents: &[i64]) -> Result<()> {
        let n = parents.len();
        if self.len() + n > self.capacity {
            return Err(CoreError::CacheOverflow {
                needed: self.len() + n,
                capacity: self.capacity,
            });
        }
        for l in &mut self.layers {
            match l {
                LayerCache::Attention(c) => c.advance(n)?,
                LayerCache::Recurrent(c) => c.commit_step(parents)?,
            }
        }
        Ok(())
    }

    /// Counts `n` rows a device step wrote in every layer (see [`KvCache::advance`]).
    pub fn advance(&mut self, n: usize) -> Result<()> {
        for l in &mut self.layers {
            match l {
                LayerCache::Attention(c) => c.advance(n)?,
                LayerCache::Recurrent(_) => {
                    return Err(CoreError::InvalidInput(
                        "recurrent layers have no device step".into(),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Keeps the given sequences of a batched cache (see [`KvCache::select_batch`]).
    pub fn select_batch(&mut self, rows: &[u32]) -> Result<()> {
        // the buffers are reallocated: graphs that bake them in are void
        self.step_graphs = Default::default();
        for l in &mut self.layers {
            l.select_batch(rows)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, start: f32) -> Tensor {
        let data: Vec<f32> = (0..n * 2).map(|i| start + i as f32).collect();
        Tensor::from_vec(data, (1, 1, n, 2), &Device::Cpu).unwrap()
    }

    #[test]
    fn append_crop_and_keep_rows() {
        let mut c = KvCache::new(8);
        c.append(&rows(3, 0.0), &rows(3, 100.0)).unwrap();
        c.append(&rows(4, 10.0), &rows(4, 110.0)).unwrap();
        assert_eq!(c.len(), 7);
        c.keep_rows(3, &[0, 2, 3]).unwrap();
        assert_eq!(c.len(), 6);
        let (k, v) = c.view().unwrap().unwrap();
        let k: Vec<f32> = k.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(&k[6..], &[10.0, 11.0, 14.0, 15.0, 16.0, 17.0]);
        let v: Vec<f32> = v.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(&v[..6], &[100.0, 101.0, 102.0, 103.0, 104.0, 105.0]);
        c.crop(2);
        assert_eq!(c.len(), 2);
        assert!(c.keep_rows(0, &[5]).is_err());
        assert!(matches!(
            c.append(&rows(7, 0.0), &rows(7, 0.0)),
            Err(CoreError::CacheOverflow {
                needed: 9,
                capacity: 8
            })
        ));
    }
}
