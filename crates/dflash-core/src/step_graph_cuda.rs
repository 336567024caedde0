//! The CUDA-graph plumbing of [`crate::step_graph`]: a step's body captured on candle's stream,
//! instantiated (rebuilt without its allocation nodes where [`crate::graph_rebuild`] can), and
//! replayed; a report of what the last capture did.
//!
//! Invariants: a capture runs on candle's stream only, with the host-to-device copy cache on (no
//! host uploads inside); a graph's outputs are the tensors its replays overwrite, dropped before
//! the graph; on any capture error the graph is destroyed and the step runs eagerly.

use crate::step_cuda::address;
use crate::{CoreError, Result};
use candle_core::cuda_backend::cudarc::driver::{self, sys};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Tensor};
use std::sync::OnceLock;

/// A captured step and the outputs its replays overwrite (dropped before the graph).
pub(crate) struct Captured {
    pub outputs: Vec<Tensor>,
    graph: StepGraph,
    /// The rebuilt graph's arena ([`crate::graph_rebuild`]); `None` for a graph as captured.
    _arena: Option<Tensor>,
}

/// An instantiated step graph.
struct StepGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    stream: std::sync::Arc<driver::CudaStream>,
}

impl Drop for StepGraph {
    fn drop(&mut self) {
        // SAFETY: both handles were made by `capture` and are destroyed once, here.
        unsafe {
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

// SAFETY: the graph is only launched from the thread that owns its cache, which holds it by
// `&mut`; CUDA graph execs may move between threads when access is serialised.
unsafe impl Send for Captured {}

impl Captured {
    pub fn launch(&self) -> Result<()> {
        let g = &self.graph;
        g.stream.context().bind_to_thread().w()?;
        // SAFETY: a live exec launched on the stream it was captured from.
        unsafe { sys::cuGraphLaunch(g.exec, g.stream.cu_stream()) }
            .result()
            .w()?;
        Ok(())
    }
}

/// Whether captured steps are rebuilt without their memory nodes ([`crate::graph_rebuild`]): when
/// PDL is on (its programmatic edges need graphs without memory nodes) or `DFLASH_GRAPH_REBUILD=1`
/// (read once, a documented override for A/B runs). Off by default: the rebuild alone measured
/// no faster on the H200 (memory nodes cost nothing per replay; docs/benchmarks.md session 15).
fn rebuild_graphs() -> bool {
    static REBUILD: OnceLock<bool> = OnceLock::new();
    *REBUILD.get_or_init(|| {
        crate::pdl::enabled() || std::env::var("DFLASH_GRAPH_REBUILD").as_deref() == Ok("1")
    })
}

/// What the captures did with their memory nodes: how many graphs were rebuilt and kept, and the
/// last one's numbers or reason (`dflash bench decode` reports it).
pub fn last_graph_report() -> String {
    LAST_REPORT
        .lock()
        .map(|r| {
            if r.0 + r.1 == 0 {
                String::new()
            } else {
                format!("{} rebuilt, {} kept; last {}", r.0, r.1, r.2)
            }
        })
        .unwrap_or_default()
}

static LAST_REPORT: std::sync::Mutex<(usize, usize, String)> =
    std::sync::Mutex::new((0, 0, String::new()));

fn report(rebuilt: bool, text: String) {
    if let Ok(mut r) = LAST_REPORT.lock() {
        if rebuilt {
            r.0 += 1;
        } else {
            r.1 += 1;
        }
        r.2 = text;
    }
}

/// Instantiates `graph` (owned; destroyed on failure).
///
/// # Safety
/// `graph` must be a valid graph that no one else holds.
unsafe fn instantiate(
    graph: sys::CUgraph,
    flags: u64,
    stream: &std::sync::Arc<driver::CudaStream>,
) -> Result<StepGraph> {
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    if let Err(e) = sys::cuGraphInstantiateWithFlags(&mut exec, graph, flags).result() {
        let _ = sys::cuGraphDestroy(graph);
        return Err(e).w()?;
    }
    Ok(StepGraph {
        graph,
        exec,
        stream: stream.clone(),
    })
}

/// A rebuilt step graph (not yet instantiated), the step's outputs (in their new homes where
/// `homed`), the arena, and a line saying what the rebuild did.
type Rebuild = (sys::CUgraph, Vec<Tensor>, Vec<bool>, Tensor, String);

/// The captured graph rebuilt without memory nodes ([`crate::graph_rebuild`]).
///
/// # Safety
/// `graph` must be the valid, uninstantiated graph whose capture produced `outputs`.
unsafe fn rebuilt(
    graph: sys::CUgraph,
    outputs: &[Tensor],
    device: &candle_core::Device,
    ctx: sys::CUcontext,
) -> std::result::Result<Rebuild, String> {
    let err = |e: CoreError| e.to_string();
    let mut spans = Vec::with_capacity(outputs.len());
    let mut homes = Vec::with_capacity(outputs.len());
    let mut home_ptrs = Vec::with_capacity(outputs.len());
    for t in outputs {
        let (ptr, _) = address(t, "step output").map_err(err)?;
        spans.push((ptr, t.elem_count() * t.dtype().size_in_bytes()));
        let home = Tensor::zeros(t.dims(), t.dtype(), device).map_err(|e| e.to_string())?;
        home_ptrs.push(address(&home, "step output").map_err(err)?.0);
        homes.push(home);
    }
    let mut arena: Option<Tensor> = None;
    let mut make_arena = |bytes: usize| -> std::result::Result<u64, String> {
        // f32 words: `address` takes the device-step dtypes only
        let t = Tensor::zeros(bytes.div_ceil(4), DType::F32, device).map_err(|e| e.to_string())?;
        let (ptr, _) = address(&t, "step arena").map_err(err)?;
        arena = Some(t);
        Ok(ptr)
    };
    let r = crate::graph_rebuild::rebuild(graph, ctx, &spans, &home_ptrs, &mut make_arena)?;
    let arena = arena.ok_or("no arena")?;
    let outputs = homes
        .into_iter()
        .zip(outputs)
        .zip(&r.homed)
        .map(|((home, t), &homed)| if homed { home } else { t.clone() })
        .collect();
    let homed = r.homed;
    let s = r.stats;
    let text = format!(
        "rebuilt: {} kernels of {} nodes ({} allocations, {} frees removed; arena {:.1} MiB; {} pointers moved; {} programmatic edges)",
        s.kernels,
        s.nodes,
        s.allocs,
        s.frees,
        s.arena_bytes as f64 / (1 << 20) as f64,
        s.remapped,
        s.programmatic
    );
    Ok((r.graph, outputs, homed, arena, text))
}

/// Runs `body` under stream capture on `device`'s stream and instantiates the graph, rebuilt
/// without memory nodes when [`rebuild_graphs`] and it can be ([`crate::graph_rebuild`]; the
/// outputs then live in buffers of their own); as captured otherwise (graph allocations still live at the end are
/// freed on each relaunch and reallocated at the same address, so `outputs` stay valid). On any
/// failure the capture is ended and discarded.
pub(crate) fn capture(
    device: &candle_core::Device,
    body: &mut dyn FnMut() -> Result<Vec<Tensor>>,
) -> Result<Captured> {
    let dev = device.as_cuda_device()?;
    let stream = dev.cuda_stream();
    let _cache = dev.enable_cuda_graph_htod_cache();
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .w()?;
    let outputs = body();
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above on the same stream.
    let ended = unsafe { sys::cuStreamEndCapture(stream.cu_stream(), &mut graph) }.result();
    let outputs = match (outputs, ended) {
        (Ok(o), Ok(())) if !graph.is_null() => o,
        (o, e) => {
            if !graph.is_null() {
                // SAFETY: a graph this function owns and no one else saw.
                unsafe {
                    let _ = sys::cuGraphDestroy(graph);
                }
            }
            o?;
            e.w()?;
            return Err(CoreError::InvalidInput(
                "device step: empty CUDA graph".into(),
            ));
        }
    };
    if rebuild_graphs() {
        let ctx = stream.context().cu_ctx();
        // SAFETY: `graph` is the uninstantiated graph of this capture, which made `outputs`.
        match unsafe { rebuilt(graph, &outputs, device, ctx) } {
            Ok((new_graph, homes, homed, arena, text)) => {
                // SAFETY: the captured graph is ours and never instantiated; the rebuilt one too.
                unsafe {
                    let _ = sys::cuGraphDestroy(graph);
                }
                // the captured outputs are addresses of the destroyed graph: never free them
                for (t, homed) in outputs.into_iter().zip(homed) {
                    if homed {
                        std::mem::forget(t);
                    }
                }
                // SAFETY: a valid graph, owned from here on by the StepGraph.
                let graph = unsafe { instantiate(new_graph, 0, &stream)? };
                report(true, text);
                return Ok(Captured {
                    outputs: homes,
                    graph,
                    _arena: Some(arena),
                });
            }
            Err(e) => report(false, format!("kept with its memory nodes: {e}")),
        }
    } else {
        report(
            false,
            "kept with its memory nodes (no PDL, no DFLASH_GRAPH_REBUILD=1)".into(),
        );
    }
    let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
    // SAFETY: a valid graph, owned from here on by the StepGraph.
    let graph = unsafe { instantiate(graph, flags.0 as u64, &stream)? };
    Ok(Captured {
        outputs,
        graph,
        _arena: None,
    })
}

/// Runs `body` eagerly with candle's host-to-device parameter cache on, so that a later capture
/// of the same shapes finds every small upload already on the device.
pub(crate) fn warm_up(
    device: &candle_core::Device,
    body: &mut dyn FnMut() -> Result<Vec<Tensor>>,
) -> Result<Vec<Tensor>> {
    let dev = device.as_cuda_device()?;
    let _cache = dev.enable_cuda_graph_htod_cache();
    body()
}
