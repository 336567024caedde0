//! The cache of one recurrent (Gated DeltaNet) layer: a conv window and a delta-rule state instead
//! of per-position keys and values, with the same `crop` / `keep_rows` contract as a
//! [`crate::KvCache`], made exact by replay.
//!
//! Invariants:
//! - `len` counts positions like a KV cache; the state "at `len`" is the layer's state after the
//!   first `len` tokens of the sequence. A fresh cache (or `crop(0)`) is the all-zero state.
//! - Each forward hands its per-token inputs ([`RecurrentRecord`]: the raw conv inputs and the
//!   rule's k, v, g, beta, plus the tree's parents) and its end state (chains only). `crop(len)`
//!   to any length inside the last forward, and `keep_rows(base, rows)` along any root path of its
//!   tree, set the state to the last forward's starting state advanced along exactly the kept
//!   tokens (`gated_delta::advance`, the arithmetic the forward's tree recurrence used), lazily on
//!   the next [`RecurrentCache::state`] — so a rejected draft or an unaccepted branch leaves no
//!   trace, and a tree node's kept state follows its own ancestors.
//! - What cannot be restored is refused, never approximated: after a tree forward the state is
//!   undefined until a crop or a path compaction picks one; cropping below the last forward's
//!   start, or inside a forward longer than [`MAX_RECORDED_ROWS`] tokens (prefill: its inputs are
//!   not kept), poisons the cache and the next forward fails with the reason. `keep_rows` on rows
//!   that are not a path fails at once.
//! - Batched decoding (data regeneration, training features) keeps one state per sequence
//!   ([`RecurrentCache::batch_states`] / [`RecurrentCache::commit_batch`]); such a cache can only
//!   grow, drop sequences ([`RecurrentCache::select_batch`]) or be emptied (`crop(0)`).
//! - With device-step buffers ([`crate::recurrent_step`]; the hybrids' device step), the state at
//!   `len` lives in fixed buffers: a step's record is rows of them, replays settle into them in
//!   place, and a replay that overwrote the state its record started from consumes the record
//!   (a crop back into that forward then fails with the reason). A chain replay of a step's own
//!   record ([`RecurrentCache::pending_step_chain`]) settles for every layer at once through the
//!   sequence's fixed commit tables on CUDA ([`crate::recurrent_step::CommitTables`]; the same
//!   kernels), the rest through [`settle_replays`]. A tree path kept from a device step's own
//!   record becomes such a chain on CUDA: the commit tables gather the path's rows to the record's
//!   first rows in place (`RecurrentCache::step_path`, then `path_gathered_in_place`;
//!   `SequenceCache::keep_rows`).

use crate::gated_delta;
use crate::recurrent_step::{overwrite, RecurrentStepBuffers};
use crate::{CoreError, Result};
use candle_core::{Device, Tensor};

/// Forwards up to this many tokens keep their inputs for rollback (verify blocks and trees);
/// longer ones (prefill) keep only their end state.
pub const MAX_RECORDED_ROWS: usize = 1025;

/// A recurrent layer's state after some prefix of a sequence.
#[derive(Debug, Clone)]
pub struct RecurrentState {
    /// The last `K − 1` inputs of the causal convolution `[K − 1, C]` (f32).
    pub conv: Tensor,
    /// The delta rule's state `[H, dk, dv]` (f32).
    pub ssm: Tensor,
}

/// What one forward fed a recurrent layer, per token, to replay the state along any root path.
#[derive(Debug, Clone)]
pub struct RecurrentRecord {
    /// The state the forward started from.
    pub start: RecurrentState,
    /// The convolution's raw inputs `[n, C]` (the `in_proj_qkv` rows, f32).
    pub conv_in: Tensor,
    /// The rule's keys `[n, H, dk]`, values `[n, H, dv]`, log decays and write strengths `[n, H]`.
    pub k: Tensor,
    pub v: Tensor,
    pub g: Tensor,
    pub beta: Tensor,
    /// Each token's parent in the forward (`-1`: the starting state); a chain for causal blocks.
    pub parents: Vec<i64>,
}

impl RecurrentRecord {
    fn len(&self) -> usize {
        self.parents.len()
    }

    /// Whether tokens `0..n` form a chain (`parents[i] = i − 1`).
    fn chain_prefix(&self, n: usize) -> bool {
        self.parents[..n]
            .iter()
            .enumerate()
            .all(|(i, &p)| p == i as i64 - 1)
    }

    /// The record restricted to `nodes` (a root path, in order), as a chain.
    pub(crate) fn select(&self, nodes: &[u32]) -> Result<Self> {
        let idx = Tensor::from_slice(nodes, nodes.len(), self.k.device())?;
        let pick = |t: &Tensor| t.index_select(&idx, 0);
        Ok(Self {
            start: self.start.clone(),
            conv_in: pick(&self.conv_in)?,
            k: pick(&self.k)?,
            v: pick(&self.v)?,
            g: pick(&self.g)?,
            beta: pick(&self.beta)?,
            parents: (0..nodes.len() as i64).map(|i| i - 1).collect(),
        })
    }

    /// The state after the first `n` tokens (which form a chain) from the starting state, by the
    /// host reference ops (the tests' expected values).
    #[cfg(test)]
    pub(crate) fn state_after(&self, n: usize) -> Result<RecurrentState> {
        if n == 0 {
            return Ok(self.start.clone());
        }
        let head = |t: &Tensor| t.narrow(0, 0, n);
        let ssm = gated_delta::advance(
            &head(&self.k)?,
            &head(&self.v)?,
            &head(&self.g)?,
            &head(&self.beta)?,
            &self.start.ssm,
        )?;
        let conv = crate::gated_delta_layer::conv_windows(&[(&self.start.conv, &self.conv_in)], n)?;
        Ok(RecurrentState {
            conv: conv.into_iter().next().expect("one job"),
            ssm,
        })
    }
}

/// Settles the pending replays of many recurrent layers at once ([`RecurrentCache::state`] is
/// the one-layer case): the delta-rule states of the layers whose replays keep the same number
/// of tokens through one [`gated_delta::advance_layers`], their convolution windows through one
/// [`crate::gated_delta_layer::conv_windows`] (one launch each on CUDA). The same states as layer
/// by layer, bit for bit.
pub fn settle_replays(caches: &mut [&mut RecurrentCache]) -> Result<()> {
    let mut pending: Vec<(usize, usize)> = caches
        .iter()
        .enumerate()
        .filter_map(|(i, c)| match (&c.at, &c.last) {
            (At::Replay(n), Some(_)) if *n > 0 => Some((*n, i)),
            _ => None,
        })
        .collect();
    pending.sort_unstable();
    for group in pending.chunk_by(|a, b| a.0 == b.0) {
        let n = group[0].0;
        let heads: Vec<[Tensor; 4]> = group
            .iter()
            .map(|&(_, i)| {
                let (_, rec) = caches[i].last.as_ref().expect("a replay has a record");
                let head = |t: &Tensor| t.narrow(0, 0, n);
                Ok([
                    head(&rec.k)?,
                    head(&rec.v)?,
                    head(&rec.g)?,
                    head(&rec.beta)?,
                ])
            })
            .collect::<Result<_>>()?;
        let jobs: Vec<gated_delta::AdvanceJob> = group
            .iter()
            .zip(&heads)
            .map(|(&(_, i), [k, v, g, beta])| gated_delta::AdvanceJob {
                k,
                v,
                g,
                beta,
                state: &caches[i].last.as_ref().expect("checked").1.start.ssm,
                // a layer with device-step buffers settles in place (see `RecurrentCache::step`)
                into: caches[i].step.as_ref().map(|b| &b.ssm),
            })
            .collect();
        let states = gated_delta::advance_layers(&jobs)?;
        let windows: Vec<(&Tensor, &Tensor)> = group
            .iter()
            .map(|&(_, i)| {
                let (_, rec) = caches[i].last.as_ref().expect("checked");
                (&rec.start.conv, &rec.conv_in)
            })
            .collect();
        let step_convs: Vec<&Tensor> = group
            .iter()
            .filter_map(|&(_, i)| caches[i].step.as_ref().map(|b| &b.conv))
            .collect();
        let convs = match step_convs.len() == group.len() {
            true => crate::gated_delta_layer::conv_windows_into(&windows, n, Some(&step_convs))?,
            false if step_convs.is_empty() => crate::gated_delta_layer::conv_windows(&windows, n)?,
            false => {
                return Err(CoreError::InvalidInput(
                    "settle: some recurrent layers have device-step buffers, some not".into(),
                ))
            }
        };
        for ((&(_, i), ssm), conv) in group.iter().zip(states).zip(convs) {
            let c = &mut *caches[i];
            // a replay written over the state it started from consumed its record
            if let (Some(b), Some((_, rec))) = (&c.step, &c.last) {
                if b.is_state(&rec.start.ssm) {
                    c.last = None;
                    c.step_record = false;
                }
            }
            c.at = At::State(Some(RecurrentState { conv, ssm }));
        }
    }
    Ok(())
}

/// Where the state at `len` comes from.
#[derive(Debug, Clone)]
enum At {
    /// This state (`None`: all zeros, nothing fed yet).
    State(Option<RecurrentState>),
    /// The last forward's starting state advanced along its first `n` tokens (a chain).
    Replay(usize),
    /// No state can be given (the reason).
    Lost(String),
}

#[derive(Debug, Clone)]
pub struct RecurrentCache {
    capacity: usize,
    len: usize,
    /// The last forward's inputs (absent for long forwards) and the length before it.
    last: Option<(usize, RecurrentRecord)>,
    at: At,
    /// One state per sequence of a batched cache.
    batch: Option<Vec<RecurrentState>>,
    /// The device step's fixed buffers, once a device step ran (kept by `crop(0)`). With them,
    /// pending replays settle into the state buffers in place, and a replay that overwrote the
    /// state its record started from consumes the record (a later crop inside that forward is
    /// refused, never approximated).
    step: Option<Box<RecurrentStepBuffers>>,
    /// Whether `last` is a device step's record as the step wrote it (rows of the step buffers,
    /// starting from the state buffers): then a chain replay of it can settle through the
    /// sequence's fixed commit tables ([`RecurrentCache::pending_step_chain`]).
    step_record: bool,
}

impl RecurrentCache {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            len: 0,
            last: None,
            at: At::State(None),
            batch: None,
            step: None,
            step_record: false,
        }
    }

    /// The rows to keep when the pending state is a chain replay of the last device step's own
    /// record into the state buffers it started from — what
    /// [`crate::recurrent_step::CommitTables::commit_chains`] does for every layer at once;
    /// `None` otherwise.
    pub fn pending_step_chain(&self) -> Option<usize> {
        match (&self.at, &self.last, &self.step) {
            (At::Replay(n), Some((_, rec)), Some(b))
                if *n > 0 && self.step_record && b.is_state(&rec.start.ssm) =>
            {
                Some(*n)
            }
            _ => None,
        }
    }

    /// Counts the pending chain replay ([`RecurrentCache::pending_step_chain`]) as done: the state
    /// buffers hold it, and the record they started from is consumed.
    pub(crate) fn settled_in_place(&mut self) -> Result<()> {
        let Some(b) = self
            .step
            .as_ref()
            .filter(|_| self.pending_step_chain().is_some())
        else {
            return Err(CoreError::InvalidInput(
                "settled_in_place: no chain replay of a device step is pending".into(),
            ));
        };
        self.at = At::State(Some(RecurrentState {
            conv: b.conv.clone(),
            ssm: b.ssm.clone(),
        }));
        self.last = None;
        self.step_record = false;
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// No state can be given any more (`why`): a later `state` or device step fails with it.
    pub(crate) fn lose(&mut self, why: String) {
        self.at = At::Lost(why);
        self.last = None;
        self.step_record = false;
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The state at `len` (`None`: the zero state), replaying a pending crop or compaction.
    pub fn state(&mut self) -> Result<Option<RecurrentState>> {
        match &self.at {
            At::State(s) => return Ok(s.clone()),
            At::Lost(why) => return Err(CoreError::InvalidInput(why.clone())),
            At::Replay(0) => {
                let (_, rec) = self.last.as_ref().expect("a replay has a record");
                self.at = At::State(Some(rec.start.clone()));
            }
            // the one-layer case of settling many layers at once
            At::Replay(_) => settle_replays(&mut [self])?,
        }
        self.state()
    }

    /// Counts a forward of `record.parents.len()` tokens fed from the state at `len`; `end` is the
    /// state after its last token when the forward was a chain (`None` after a branching tree).
    pub fn commit(&mut self, record: RecurrentRecord, end: Option<RecurrentState>) -> Result<()> {
        let n = record.len();
        let needed = self.len + n;
        if needed > self.capacity {
            return Err(CoreError::CacheOverflow {
                needed,
                capacity: self.capacity,
            });
        }
        self.at = match end {
            Some(s) => At::State(Some(s)),
            None => At::Lost(format!(
                "a recurrent layer's state after a token tree is defined only once crop or \
                 keep_rows picks a path (tree of {n} tokens at position {})",
                self.len
            )),
        };
        self.last = (n <= MAX_RECORDED_ROWS).then_some((self.len, record));
        self.step_record = false;
        self.len = needed;
        Ok(())
    }

    /// Forgets every position at or past `len` (see the module invariants).
    pub fn crop(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        if len == 0 {
            let step = self.step.take();
            *self = Self::new(self.capacity);
            self.step = step;
            return;
        }
        self.at = match &mut self.last {
            Some((base, rec)) if len >= *base && rec.chain_prefix(len - *base) => {
                let n = len - *base;
                rec.parents.truncate(n);
                At::Replay(n)
            }
            Some((base, _)) if len >= *base => At::Lost(format!(
                "crop to {len}: positions {base}..{len} of the last forward are not a chain, so a \
                 recurrent state for them does not exist"
            )),
            _ => At::Lost(format!(
                "crop to {len}: a recurrent state can only return inside the last forward \
                 (from position {}, at most {MAX_RECORDED_ROWS} tokens)",
                self.last.as_ref().map_or(self.len, |(b, _)| *b)
            )),
        };
        self.len = len;
    }

    /// Keeps rows `base + rows[i]` as positions `base + i` (the accepted path of a verified tree):
    /// they must continue, in order, a root path of the last forward's tree.
    pub fn keep_rows(&mut self, base: usize, rows: &[u32]) -> Result<()> {
        if rows.is_empty() {
            self.check_rows(base, rows)?;
            self.crop(base);
            return Ok(());
        }
        let (start, nodes) = self.path_nodes(base, rows)?;
        let Some((_, rec)) = &self.last else {
            return Err(CoreError::InvalidInput(format!(
                "keep_rows at {base}: no last forward"
            )));
        };
        let kept = rec.select(&nodes)?;
        let n = kept.len();
        self.last = Some((start, kept));
        self.step_record = false;
        self.at = At::Replay(n);
        self.len = base + rows.len();
        Ok(())
    }

    fn check_rows(&self, base: usize, rows: &[u32]) -> Result<()> {
        if rows.iter().any(|&r| base + r as usize >= self.len) {
            return Err(CoreError::InvalidInput(format!(
                "keep_rows: row out of range (base {base}, len {}, rows {rows:?})",
                self.len
            )));
        }
        Ok(())
    }

    /// The last forward's start and the record rows that [`RecurrentCache::keep_rows`]`(base,
    /// rows)` keeps (the chain before `base`, then the path), or why there are none.
    fn path_nodes(&self, base: usize, rows: &[u32]) -> Result<(usize, Vec<u32>)> {
        self.check_rows(base, rows)?;
        let Some((start, rec)) = &self.last else {
            return Err(CoreError::InvalidInput(format!(
                "keep_rows at {base}: the recurrent layer kept no inputs of its last forward"
            )));
        };
        let start = *start;
        if base < start || !rec.chain_prefix(base - start) {
            return Err(CoreError::InvalidInput(format!(
                "keep_rows at {base}: the rows before it are not a chain of the last forward \
                 (which started at {start})"
            )));
        }
        let prefix = base - start;
        let mut nodes: Vec<u32> = (0..prefix as u32).collect();
        let mut prev = prefix as i64 - 1;
        for &r in rows {
            let node = prefix + r as usize;
            if rec.parents[node] != prev {
                return Err(CoreError::InvalidInput(format!(
                    "keep_rows: rows {rows:?} at {base} are not a root path of the last forward's \
                     tree (node {node}'s parent is {}, not {prev})",
                    rec.parents[node]
                )));
            }
            nodes.push(node as u32);
            prev = node as i64;
        }
        Ok((start, nodes))
    }

    /// The record rows a [`RecurrentCache::keep_rows`]`(base, rows)` keeps when the last forward
    /// is a device step's own record ([`RecurrentCache::pending_step_chain`]'s condition), for
    /// the sequence's commit tables to gather in place; `None` where the general path must run.
    /// Errors as `keep_rows` does.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn step_path(&self, base: usize, rows: &[u32]) -> Result<Option<Vec<u32>>> {
        let own = matches!((&self.last, &self.step), (Some((_, rec)), Some(b))
            if self.step_record && b.is_state(&rec.start.ssm));
        if !own || rows.is_empty() {
            return Ok(None);
        }
        Ok(Some(self.path_nodes(base, rows)?.1))
    }

    /// Counts [`RecurrentCache::keep_rows`]`(base, rows)` as done by the commit tables' gather:
    /// the record's first `n` rows (`n` = the nodes [`RecurrentCache::step_path`] gave) now hold
    /// the kept path as a chain, so its replay is a [`RecurrentCache::pending_step_chain`].
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn path_gathered_in_place(
        &mut self,
        base: usize,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        let Some((_, rec)) = self.last.as_mut().filter(|_| self.step_record) else {
            return Err(CoreError::InvalidInput(
                "path_gathered_in_place: the last forward is not a device step's record".into(),
            ));
        };
        let head = |t: &Tensor| t.narrow(0, 0, n);
        rec.conv_in = head(&rec.conv_in)?;
        rec.k = head(&rec.k)?;
        rec.v = head(&rec.v)?;
        rec.g = head(&rec.g)?;
        rec.beta = head(&rec.beta)?;
        rec.parents = (0..n as i64).map(|i| i - 1).collect();
        self.at = At::Replay(n);
        self.len = base + rows;
        Ok(())
    }

    /// The state of each of `b` sequences of a batched cache (`None`: the zero state, an empty
    /// cache).
    pub fn batch_states(&self, b: usize) -> Result<Vec<Option<RecurrentState>>> {
        match &self.batch {
            None if self.len == 0 => Ok(vec![None; b]),
            Some(s) if s.len() == b => Ok(s.iter().cloned().map(Some).collect()),
            _ => Err(CoreError::InvalidInput(format!(
                "a recurrent cache of {} positions holds no batch of {b} sequences",
                self.len
            ))),
        }
    }

    /// Counts `n` positions fed to every sequence of a batch, which end in `states`.
    pub fn commit_batch(&mut self, n: usize, states: Vec<RecurrentState>) -> Result<()> {
        let needed = self.len + n;
        if needed > self.capacity {
            return Err(CoreError::CacheOverflow {
                needed,
                capacity: self.capacity,
            });
        }
        self.batch = Some(states);
        self.last = None;
        self.at = At::Lost("a batched recurrent cache has no single state".into());
        self.len = needed;
        Ok(())
    }

    /// Keeps sequences `rows` (in that order) of a batched cache.
    pub fn select_batch(&mut self, rows: &[u32]) -> Result<()> {
        match &mut self.batch {
            None if rows == [0] => Ok(()),
            None if self.len == 0 => Ok(()),
            None => Err(CoreError::InvalidInput(
                "select_batch on a single-sequence recurrent cache".into(),
            )),
            Some(states) => {
                if let Some(&r) = rows.iter().find(|&&r| r as usize >= states.len()) {
                    return Err(CoreError::InvalidInput(format!(
                        "select_batch: row {r} of a batch of {}",
                        states.len()
                    )));
                }
                *states = rows.iter().map(|&r| states[r as usize].clone()).collect();
                Ok(())
            }
        }
    }

    /// The device step's buffers, if a device step made them.
    pub fn step_buffers(&self) -> Option<&RecurrentStepBuffers> {
        self.step.as_deref()
    }

    /// Gives the layer its device-step buffers (once; they live as long as the cache).
    pub fn set_step_buffers(&mut self, buffers: RecurrentStepBuffers) {
        self.step = Some(Box::new(buffers));
    }

    /// Puts the state at `len` into the device step's state buffers (settling a pending replay
    /// there in place; copying a state a host forward left; zeroing them for the empty state).
    pub fn load_step_state(&mut self) -> Result<()> {
        let Some(b) = self.step.clone() else {
            return Err(CoreError::InvalidInput(
                "load_step_state: the layer has no device-step buffers".into(),
            ));
        };
        match self.state()? {
            Some(s) if b.is_state(&s.ssm) && s.conv.id() == b.conv.id() => {}
            Some(s) => {
                overwrite(&b.ssm, &s.ssm)?;
                overwrite(&b.conv, &s.conv)?;
            }
            None => {
                overwrite(&b.ssm, &b.ssm.zeros_like()?)?;
                overwrite(&b.conv, &b.conv.zeros_like()?)?;
            }
        }
        // the buffers now hold the state at `len`; a record starting from them is void
        if let Some((_, rec)) = &self.last {
            if b.is_state(&rec.start.ssm) {
                self.last = None;
                self.step_record = false;
            }
        }
        self.at = At::State(Some(RecurrentState {
            conv: b.conv.clone(),
            ssm: b.ssm.clone(),
        }));
        Ok(())
    }

    /// Counts a device step of `parents.len()` tokens (rows `0..n` of the step buffers' record,
    /// fed from the state buffers, which it left unchanged): a chain's state is the replay of all
    /// its tokens, a tree's is defined once a crop or a path compaction picks a path.
    pub fn commit_step(&mut self, parents: &[i64]) -> Result<()> {
        let Some(b) = self.step.clone() else {
            return Err(CoreError::InvalidInput(
                "commit_step: the layer has no device-step buffers".into(),
            ));
        };
        let n = parents.len();
        let head = |t: &Tensor| t.narrow(0, 0, n);
        let record = RecurrentRecord {
            start: RecurrentState {
                conv: b.conv.clone(),
                ssm: b.ssm.clone(),
            },
            conv_in: head(&b.conv_in)?,
            k: head(&b.k)?,
            v: head(&b.v)?,
            g: head(&b.g)?,
            beta: head(&b.beta)?,
            parents: parents.to_vec(),
        };
        let chain = record.chain_prefix(n);
        self.commit(record, None)?;
        self.step_record = true;
        if chain {
            self.at = At::Replay(n);
        }
        Ok(())
    }

    /// The device of the kept tensors, if any.
    pub fn device(&self) -> Option<&Device> {
        self.last.as_ref().map(|(_, r)| r.k.device())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::max_abs_diff;

    const H: usize = 2;
    const DK: usize = 3;
    const DV: usize = 2;
    const C: usize = 4;
    const W: usize = 2;

    fn rnd(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn record(parents: &[i64], start: &RecurrentState, seed: u64) -> RecurrentRecord {
        let n = parents.len();
        RecurrentRecord {
            start: start.clone(),
            conv_in: rnd(&[n, C], seed),
            k: rnd(&[n, H, DK], seed + 1),
            v: rnd(&[n, H, DV], seed + 2),
            g: (rnd(&[n, H], seed + 3) - 0.6).unwrap(),
            beta: (rnd(&[n, H], seed + 4) + 0.5).unwrap(),
            parents: parents.to_vec(),
        }
    }

    fn start() -> RecurrentState {
        RecurrentState {
            conv: rnd(&[W, C], 7),
            ssm: rnd(&[H, DK, DV], 8),
        }
    }

    #[test]
    fn crop_and_keep_rows_replay_exactly_the_kept_tokens() {
        let s0 = start();
        let mut c = RecurrentCache::new(32);
        c.commit(record(&[-1], &s0, 1), Some(s0.clone())).unwrap();
        assert!(c.state().unwrap().is_some());
        // a chain of 5 from the state at 1, cropped to 3 tokens of it
        let chain = record(&[-1, 0, 1, 2, 3], &s0, 2);
        c.commit(chain.clone(), None).unwrap();
        assert!(c.state().is_err(), "unresolved after an unchained commit");
        c.crop(4);
        let got = c.state().unwrap().unwrap();
        let want = chain.state_after(3).unwrap();
        assert_eq!(max_abs_diff(&got.ssm, &want.ssm), 0.0);
        // the conv window is the last W raw inputs: tokens 1 and 2 of the chain
        assert_eq!(
            max_abs_diff(&got.conv, &chain.conv_in.narrow(0, 1, 2).unwrap()),
            0.0
        );
        // a tree at 4; keep root -> 2 -> 4 (rows 0, 2, 4)
        let parents = [-1i64, 0, 0, 1, 2, 4];
        let tree = record(&parents, &got, 3);
        c.commit(tree.clone(), None).unwrap();
        assert!(c.keep_rows(4, &[0, 1, 4]).is_err(), "1 -> 4 is not an edge");
        assert!(c.keep_rows(4, &[1]).is_err(), "a path starts at a root");
        c.keep_rows(4, &[0, 2, 4]).unwrap();
        assert_eq!(c.len(), 7);
        let path = tree.select(&[0, 2, 4]).unwrap();
        let want = path.state_after(3).unwrap();
        let got = c.state().unwrap().unwrap();
        assert_eq!(max_abs_diff(&got.ssm, &want.ssm), 0.0);
        let conv_want = Tensor::cat(
            &[
                tree.conv_in.get(2).unwrap().unsqueeze(0).unwrap(),
                tree.conv_in.get(4).unwrap().unsqueeze(0).unwrap(),
            ],
            0,
        )
        .unwrap();
        assert_eq!(max_abs_diff(&got.conv, &conv_want), 0.0);
        // the compacted path crops like a chain
        c.crop(5);
        let s5 = c.state().unwrap().unwrap();
        assert_eq!(
            max_abs_diff(
                &s5.ssm,
                &tree.select(&[0]).unwrap().state_after(1).unwrap().ssm
            ),
            0.0
        );
        // below the last forward: refused, not approximated; crop(0) is the zero state
        c.crop(2);
        assert!(c.state().is_err());
        c.crop(0);
        assert!(c.state().unwrap().is_none());
        assert_eq!(c.len(), 0);
        let mut small = RecurrentCache::new(3);
        let r = record(&[-1, 0, 1, 2], &s0, 5);
        assert!(matches!(
            small.commit(r, None),
            Err(CoreError::CacheOverflow { .. })
        ));
    }

    #[test]
    fn settling_many_layers_at_once_gives_each_layers_own_replay() {
        let s0 = start();
        // four layers: two cropped inside a chain to 3 tokens, one compacted to a tree path of 3,
        // one cropped to 2 (another group), and a fresh one (nothing pending)
        let mut caches: Vec<RecurrentCache> = (0..5).map(|_| RecurrentCache::new(32)).collect();
        let parents = [-1i64, 0, 0, 1, 2, 4];
        for (i, c) in caches.iter_mut().enumerate().take(4) {
            let rec = if i == 2 {
                record(&parents, &s0, 20 + i as u64)
            } else {
                record(&[-1, 0, 1, 2, 3], &s0, 20 + i as u64)
            };
            c.commit(rec, None).unwrap();
            match i {
                2 => c.keep_rows(0, &[0, 2, 4]).unwrap(),
                3 => c.crop(2),
                _ => c.crop(3),
            }
        }
        let mut alone = caches.clone();
        let mut refs: Vec<&mut RecurrentCache> = caches.iter_mut().collect();
        settle_replays(&mut refs).unwrap();
        for (i, (c, a)) in caches.iter_mut().zip(alone.iter_mut()).enumerate() {
            assert!(
                i == 4 || matches!(c.at, At::State(Some(_))),
                "layer {i} settled"
            );
            match (c.state().unwrap(), a.state().unwrap()) {
                (Some(x), Some(y)) => {
                    assert_eq!(max_abs_diff(&x.ssm, &y.ssm), 0.0, "layer {i}");
                    assert_eq!(max_abs_diff(&x.conv, &y.conv), 0.0, "layer {i}");
                }
                (None, None) => assert_eq!(i, 4),
                _ => panic!("layer {i}: one settled, one not"),
            }
        }
    }
}
