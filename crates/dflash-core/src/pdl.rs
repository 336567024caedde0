//! Programmatic dependent launch (PDL) inside the captured decode steps (CUDA, compute 9.0+).
//!
//! A captured step is a chain of a few hundred small kernels; between two of them the GPU idles
//! while the next grid launches. With PDL the next kernel's grid launches while the previous one
//! runs, and waits (`griddepcontrol.wait`) before it touches any memory.
//!
//! Invariants:
//! - Only kernels of this crate's decode modules (decode_kernels.cu, step_kernels.cu,
//!   stream_gemm.cu, compiled with `-DDFLASH_PDL` for compute 9.0) are PDL-aware: each begins with
//!   `griddepcontrol.wait`, which returns once every grid it depends on has completed and its
//!   writes are visible, then lets its own dependents launch. [`mark`] records their function
//!   handles as they launch.
//! - After a capture, [`make_programmatic`] turns a graph edge kernel → kernel into a programmatic
//!   edge only when the downstream kernel is PDL-aware; every other edge (memory copies, cuBLAS,
//!   candle's kernels downstream) stays a full dependency. Since every PDL-aware kernel waits for
//!   its upstream's completion before its first load, a kernel never reads memory an unfinished
//!   grid writes: the results are exactly those of the plain graph.
//! - Eager launches (outside captures) are plain launches: the wait returns at once.
//! - `DFLASH_PDL=0` (a documented override, read once) compiles the modules without it and keeps
//!   every edge as captured.

use candle_core::cuda_backend::cudarc::driver::{sys, CudaFunction};
use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

/// Whether the decode modules are compiled PDL-aware: compute capability ≥ 9.0 on device 0 and
/// `DFLASH_PDL` not `0`.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        if std::env::var("DFLASH_PDL").as_deref() == Ok("0") {
            return false;
        }
        let mut major = 0i32;
        let mut dev: sys::CUdevice = 0;
        // SAFETY: plain queries of device 0 (the driver is initialised by candle's device
        // before any kernel is compiled); failures leave PDL off.
        unsafe {
            if sys::cuDeviceGet(&mut dev, 0) != sys::CUresult::CUDA_SUCCESS {
                return false;
            }
            let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR;
            if sys::cuDeviceGetAttribute(&mut major, attr, dev) != sys::CUresult::CUDA_SUCCESS {
                return false;
            }
        }
        major >= 9
    })
}

/// NVRTC options for a decode module: compute 9.0 with `DFLASH_PDL` defined when [`enabled`],
/// else `fallback_arch` (e.g. `compute_80` for the tensor-core GEMM) or NVRTC's default.
pub fn nvrtc_options(
    fallback_arch: Option<&'static str>,
) -> candle_core::cuda_backend::cudarc::nvrtc::CompileOptions {
    let mut opts = candle_core::cuda_backend::cudarc::nvrtc::CompileOptions {
        arch: fallback_arch,
        ..Default::default()
    };
    if enabled() {
        opts.arch = Some("compute_90");
        opts.options.push("-DDFLASH_PDL".into());
    }
    opts
}

fn aware() -> &'static Mutex<HashSet<usize>> {
    static SET: OnceLock<Mutex<HashSet<usize>>> = OnceLock::new();
    SET.get_or_init(|| Mutex::new(HashSet::new()))
}

/// Records a launched kernel of a PDL-aware module (no-op when PDL is off).
pub fn mark(f: &CudaFunction) {
    if enabled() {
        if let Ok(mut set) = aware().lock() {
            set.insert(f.cu_function() as usize);
        }
    }
}

/// What [`make_programmatic`] did to the last graph it saw (reported by `dflash bench decode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub nodes: usize,
    pub kernels: usize,
    pub allocs: usize,
    pub frees: usize,
    /// Edges made programmatic (kernel → PDL-aware kernel).
    pub programmatic: usize,
    /// Of those, the ones that had a chain of allocation nodes in between, now moved beside the
    /// upstream kernel.
    pub through_allocs: usize,
}

static LAST: Mutex<GraphStats> = Mutex::new(GraphStats {
    nodes: 0,
    kernels: 0,
    allocs: 0,
    frees: 0,
    programmatic: 0,
    through_allocs: 0,
});

/// The [`GraphStats`] of the last captured graph.
pub fn last_graph_stats() -> GraphStats {
    LAST.lock().map(|g| *g).unwrap_or_default()
}

type Node = sys::CUgraphNode;

fn node_type(node: Node) -> Option<sys::CUgraphNodeType> {
    let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    // SAFETY: `node` belongs to a live graph.
    let ok = unsafe { sys::cuGraphNodeGetType(node, &mut kind) } == sys::CUresult::CUDA_SUCCESS;
    ok.then_some(kind)
}

/// The kernel a graph node launches, when it is a kernel node.
fn kernel_of(node: Node) -> Option<usize> {
    if node_type(node)? != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
        return None;
    }
    // SAFETY: a kernel node of a live graph; the params struct is plain data the driver fills.
    unsafe {
        let mut params: sys::CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
        if sys::cuGraphKernelNodeGetParams_v2(node, &mut params) != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        Some(params.func as usize)
    }
}

fn plain_edge() -> sys::CUgraphEdgeData {
    // SAFETY: plain data; all zero is the default edge
    unsafe { std::mem::zeroed() }
}

/// The graph's edges, as (from, to, data).
///
/// # Safety
/// `graph` must be a valid graph.
unsafe fn edges(graph: sys::CUgraph) -> Option<Vec<(Node, Node, sys::CUgraphEdgeData)>> {
    let mut n = 0usize;
    let none: *mut Node = std::ptr::null_mut();
    let no_data: *mut sys::CUgraphEdgeData = std::ptr::null_mut();
    if sys::cuGraphGetEdges_v2(graph, none, none, no_data, &mut n) != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    let mut from: Vec<Node> = vec![std::ptr::null_mut(); n];
    let mut to: Vec<Node> = vec![std::ptr::null_mut(); n];
    let mut data: Vec<sys::CUgraphEdgeData> = vec![plain_edge(); n];
    let got = sys::cuGraphGetEdges_v2(
        graph,
        from.as_mut_ptr(),
        to.as_mut_ptr(),
        data.as_mut_ptr(),
        &mut n,
    );
    (got == sys::CUresult::CUDA_SUCCESS).then(|| {
        (0..n.min(from.len()))
            .map(|i| (from[i], to[i], data[i]))
            .collect()
    })
}

/// Turns each edge kernel → PDL-aware kernel of `graph` into a programmatic edge (stream
/// capture often puts allocation nodes between two kernels: a chain of them, each with one
/// dependency and one dependent, is moved to depend on the upstream kernel's own dependencies, so
/// the two kernels meet directly); returns how many. A failed query leaves the remaining edges as
/// they are (still correct, only slower); an edit that could not be completed is an error (the
/// graph may have lost an ordering and must not run).
///
/// # Safety
/// `graph` must be a valid, not yet instantiated graph.
pub unsafe fn make_programmatic(graph: sys::CUgraph) -> Result<usize, String> {
    if !enabled() {
        return Ok(0);
    }
    let Ok(set) = aware().lock() else {
        return Ok(0);
    };
    let Some(list) = edges(graph) else {
        return Ok(0);
    };
    use std::collections::HashMap;
    let mut preds: HashMap<Node, Vec<(Node, sys::CUgraphEdgeData)>> = HashMap::new();
    let mut succ_count: HashMap<Node, usize> = HashMap::new();
    let mut kinds: HashMap<Node, Option<sys::CUgraphNodeType>> = HashMap::new();
    for &(f, t, d) in &list {
        preds.entry(t).or_default().push((f, d));
        *succ_count.entry(f).or_default() += 1;
        for n in [f, t] {
            kinds.entry(n).or_insert_with(|| node_type(n));
        }
    }
    let is = |n: &Node, k: sys::CUgraphNodeType| kinds.get(n).copied().flatten() == Some(k);
    let mut stats = GraphStats {
        nodes: kinds.len(),
        ..Default::default()
    };
    for n in kinds.keys() {
        if is(n, sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL) {
            stats.kernels += 1;
        } else if is(n, sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
            stats.allocs += 1;
        } else if is(n, sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE) {
            stats.frees += 1;
        }
    }
    let programmatic = sys::CUgraphEdgeData {
        from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
        to_port: 0,
        type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
        reserved: [0; 5],
    };
    let is_plain = |d: &sys::CUgraphEdgeData| {
        d.type_ == sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_DEFAULT as u8
            && d.from_port == 0
    };
    let ok = |r: sys::CUresult| r == sys::CUresult::CUDA_SUCCESS;
    let targets: Vec<Node> = preds
        .keys()
        .copied()
        .filter(|b| kernel_of(*b).is_some_and(|f| set.contains(&f)))
        .collect();
    for b in targets {
        let incoming = preds.get(&b).cloned().unwrap_or_default();
        for (p, d) in incoming {
            if !is_plain(&d) {
                continue;
            }
            if is(&p, sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL) {
                if !ok(sys::cuGraphRemoveDependencies_v2(graph, &p, &b, &d, 1)) {
                    continue;
                }
                if !ok(sys::cuGraphAddDependencies_v2(
                    graph,
                    &p,
                    &b,
                    &programmatic,
                    1,
                )) {
                    if !ok(sys::cuGraphAddDependencies_v2(graph, &p, &b, &d, 1)) {
                        return Err("PDL: a graph edge could not be restored".into());
                    }
                    continue;
                }
                stats.programmatic += 1;
                continue;
            }
            // a chain of allocation nodes (one dependency, one dependent each) up to a kernel
            let single = |n: &Node| {
                is(n, sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC)
                    && succ_count.get(n) == Some(&1)
                    && preds
                        .get(n)
                        .is_some_and(|v| v.len() == 1 && is_plain(&v[0].1))
            };
            let mut top = p;
            let mut hops = 0;
            while single(&top) && hops < 8 {
                let up = preds[&top][0].0;
                if is(&up, sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL) {
                    break;
                }
                top = up;
                hops += 1;
            }
            if !single(&top) {
                continue;
            }
            let k = preds[&top][0].0;
            if !is(&k, sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL) {
                continue;
            }
            // top: after k's dependencies instead of after k; then k → b, programmatic
            let plain = plain_edge();
            if !ok(sys::cuGraphRemoveDependencies_v2(
                graph, &k, &top, &plain, 1,
            )) {
                continue;
            }
            let k_preds = preds.get(&k).cloned().unwrap_or_default();
            for (q, _) in &k_preds {
                if !ok(sys::cuGraphAddDependencies_v2(graph, q, &top, &plain, 1)) {
                    return Err("PDL: an allocation node could not be moved".into());
                }
            }
            if !ok(sys::cuGraphAddDependencies_v2(
                graph,
                &k,
                &b,
                &programmatic,
                1,
            )) {
                return Err("PDL: a programmatic edge could not be added".into());
            }
            preds.insert(top, k_preds.iter().map(|(q, _)| (*q, plain)).collect());
            preds.entry(b).or_default().push((k, programmatic));
            stats.programmatic += 1;
            stats.through_allocs += 1;
        }
    }
    if let Ok(mut last) = LAST.lock() {
        *last = stats;
    }
    Ok(stats.programmatic)
}
