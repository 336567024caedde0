//! CUDA graphs of device steps ([`crate::step`]), one per step shape, kept with the cache whose
//! buffers they bake in.
//!
//! Invariants:
//! - A step shape ([`StepKey`]) runs eagerly the first time (which also fills candle's cache of
//!   small host-to-device parameter uploads), is captured on its second run and replayed after;
//!   the body must depend on nothing but the device metadata buffer it is given and buffers that
//!   outlive the graph (weights, the cache's preallocated K/V).
//! - Only the metadata words cross to the device per step (one copy into a buffer owned by the
//!   shape's entry); outputs come back as fresh copies, never as the graph's own buffers, so a
//!   caller may keep them across steps.
//! - A shape whose capture fails runs eagerly from then on (same kernels, same results), and
//!   `DFLASH_CUDA_GRAPHS=0` (read once) turns capture off for an A/B comparison.
//! - Cloning a [`StepGraphs`] gives an empty one: graphs are bound to one cache's buffers.

use crate::Result;
use candle_core::{Device, Tensor};
use std::collections::HashMap;

/// What fixes a step's kernels: its row count and which outputs it produces.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StepKey {
    pub rows: usize,
    /// Caller-defined code for the outputs (which logit rows, for instance).
    pub outputs: u8,
    pub taps: Vec<usize>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Entry {
    meta: Tensor,
    /// Device copies of the step's tensor inputs, at fixed addresses (refilled each run).
    inputs: Vec<Tensor>,
    runs: u64,
    failed: bool,
    #[cfg(feature = "cuda")]
    graph: Option<crate::step_graph_cuda::Captured>,
}

/// The step graphs of one sequence cache.
#[derive(Default)]
pub struct StepGraphs {
    entries: HashMap<StepKey, Entry>,
}

impl Clone for StepGraphs {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl std::fmt::Debug for StepGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepGraphs")
            .field("shapes", &self.entries.len())
            .finish()
    }
}

/// A step's computation: outputs from the device metadata and the device copies of its inputs.
pub type StepBody<'a> = dyn FnMut(&Tensor, &[Tensor]) -> Result<Vec<Tensor>> + 'a;

/// Whether steps are captured into CUDA graphs (`DFLASH_CUDA_GRAPHS=0` turns it off).
pub fn cuda_graphs_enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("DFLASH_CUDA_GRAPHS").as_deref() != Ok("0"))
}

/// What the last capture did with its memory nodes: how many it removed, or why the graph was
/// kept as captured (empty before any capture and without CUDA).
pub fn last_graph_report() -> String {
    #[cfg(feature = "cuda")]
    return crate::step_graph_cuda::last_graph_report();
    #[cfg(not(feature = "cuda"))]
    String::new()
}

impl StepGraphs {
    /// How many step shapes currently replay from a captured graph.
    pub fn captured(&self) -> usize {
        #[cfg(feature = "cuda")]
        return self.entries.values().filter(|e| e.graph.is_some()).count();
        #[cfg(not(feature = "cuda"))]
        0
    }

    /// Runs the step `key` with metadata `words` and tensor `inputs` on `device`: `body`
    /// computes the outputs from the device copy of the metadata (`[words.len()]` u32) and
    /// copies of the inputs (same shapes, contiguous; the key must fix their shapes).
    pub fn run(
        &mut self,
        key: StepKey,
        words: &[u32],
        inputs: &[&Tensor],
        device: &Device,
        body: &mut StepBody,
    ) -> Result<Vec<Tensor>> {
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            return self.run_cuda(key, words, inputs, device, body);
        }
        let meta = Tensor::from_slice(words, words.len(), device)?;
        let inputs: Vec<Tensor> = inputs.iter().map(|&t| t.clone()).collect();
        let _ = key;
        body(&meta, &inputs)
    }

    #[cfg(feature = "cuda")]
    fn run_cuda(
        &mut self,
        key: StepKey,
        words: &[u32],
        inputs: &[&Tensor],
        device: &Device,
        body: &mut StepBody,
    ) -> Result<Vec<Tensor>> {
        use crate::{step_cuda, step_graph_cuda};
        let entry = match self.entries.entry(key) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(Entry {
                meta: Tensor::zeros(words.len(), candle_core::DType::U32, device)?,
                inputs: inputs
                    .iter()
                    .map(|t| Ok(t.contiguous()?.copy()?))
                    .collect::<Result<_>>()?,
                runs: 0,
                failed: false,
                graph: None,
            }),
        };
        step_cuda::upload_meta(&entry.meta, words)?;
        if entry.runs > 0 {
            if entry.inputs.len() != inputs.len() {
                return Err(crate::CoreError::InvalidInput(format!(
                    "device step: {} inputs for a shape captured with {}",
                    inputs.len(),
                    entry.inputs.len()
                )));
            }
            for (dst, src) in entry.inputs.iter().zip(inputs) {
                step_cuda::copy_into(dst, src)?;
            }
        }
        entry.runs += 1;
        let meta = entry.meta.clone();
        let statics = entry.inputs.clone();
        let mut run_body = || body(&meta, &statics);
        if let Some(g) = &entry.graph {
            g.launch()?;
            return g
                .outputs
                .iter()
                .map(|t| Ok(t.copy()?))
                .collect::<Result<Vec<_>>>();
        }
        if entry.failed || !cuda_graphs_enabled() {
            return run_body();
        }
        if entry.runs == 1 {
            return step_graph_cuda::warm_up(device, &mut run_body);
        }
        match step_graph_cuda::capture(device, &mut run_body) {
            Ok(g) => {
                g.launch()?;
                let out = g
                    .outputs
                    .iter()
                    .map(|t| Ok(t.copy()?))
                    .collect::<Result<Vec<_>>>();
                entry.graph = Some(g);
                out
            }
            Err(e) => {
                eprintln!("note: a decoding step could not be captured as a CUDA graph ({e}); it runs without one");
                entry.failed = true;
                run_body()
            }
        }
    }
}
