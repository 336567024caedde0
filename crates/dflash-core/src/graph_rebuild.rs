//! A captured step graph rebuilt without memory nodes (CUDA).
//!
//! candle allocates every op's output, so a stream-captured step holds an allocation node and a
//! free node around nearly every kernel (SmolLM2's AR step: 311 kernels, 307 allocations, 305
//! frees). This module copies such a graph into one of kernels (and copies/memsets) alone: every
//! graph allocation gets a fixed place in one arena buffer owned by the rebuilt graph (places
//! reused between allocations whose lifetimes do not overlap), and every kernel parameter word
//! that points into a graph allocation is rewritten to point at its place. Used only when asked
//! (`DFLASH_GRAPH_REBUILD=1`) or for PDL, whose programmatic edges the driver refuses in graphs
//! with memory nodes: on the H200 the memory nodes themselves measured free per replay
//! (docs/benchmarks.md session 15).
//!
//! Invariants:
//! - Only a graph whose nodes are totally ordered (one stream's capture: a chain) is rebuilt; the
//!   rebuilt graph keeps that order, so an arena place is reused only after its last reader ran.
//! - A graph allocation is identified by address *and* time: the driver reuses addresses between
//!   allocations of one graph, so a parameter word is remapped through the allocation live at
//!   that node.
//! - Allocations still live at the end are the step's outputs: each must be exactly an output
//!   tensor (same address, same size), which then gets a buffer of its own outside the arena
//!   (replays overwrite it).
//! - Kernel attributes (cluster shape, priorities) are copied node to node.
//! - Anything else (another node type, a parameter layout the driver will not report, a free of
//!   memory the graph did not allocate, an allocation no output explains) is an error, and the
//!   caller keeps the captured graph as it is (never wrong, and as fast).
//! - The scan rewrites 8-byte-aligned words of 8-byte-or-larger parameters whose value lies inside
//!   a live graph allocation (graph addresses are reserved virtual addresses, far from any size or
//!   index a kernel takes).

use crate::graph_arena::{
    move_pointer, packed_params, place_allocations, Allocation, LAUNCH_PARAM_BUFFER_POINTER,
    LAUNCH_PARAM_BUFFER_SIZE, LAUNCH_PARAM_END,
};
use candle_core::cuda_backend::cudarc::driver::sys;
use std::collections::HashMap;

type Node = sys::CUgraphNode;

fn ok(r: sys::CUresult, what: &str) -> Result<(), String> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {r:?}"))
    }
}

/// What a rebuild found and did (reported by `dflash bench decode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RebuildStats {
    pub nodes: usize,
    pub kernels: usize,
    pub allocs: usize,
    pub frees: usize,
    pub arena_bytes: usize,
    /// Parameter words rewritten.
    pub remapped: usize,
    /// Kernel → kernel edges made programmatic ([`crate::pdl`]).
    pub programmatic: usize,
}

/// The node type, or an error.
///
/// # Safety
/// `node` must belong to a live graph.
unsafe fn node_type(node: Node) -> Result<sys::CUgraphNodeType, String> {
    let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    ok(sys::cuGraphNodeGetType(node, &mut kind), "graph node type")?;
    Ok(kind)
}

/// The graph's nodes in their one topological order (an error when the order is not unique).
///
/// # Safety
/// `graph` must be a valid graph.
unsafe fn chain_order(graph: sys::CUgraph) -> Result<Vec<Node>, String> {
    let mut n = 0usize;
    ok(
        sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n),
        "graph nodes",
    )?;
    let mut nodes: Vec<Node> = vec![std::ptr::null_mut(); n];
    ok(
        sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n),
        "graph nodes",
    )?;
    nodes.truncate(n);
    let index: HashMap<Node, usize> = nodes.iter().enumerate().map(|(i, &x)| (x, i)).collect();
    let mut indegree = vec![0usize; n];
    let mut next: Vec<Vec<usize>> = vec![vec![]; n];
    let mut e = 0usize;
    let null_nodes: *mut Node = std::ptr::null_mut();
    let null_data: *mut sys::CUgraphEdgeData = std::ptr::null_mut();
    ok(
        sys::cuGraphGetEdges_v2(graph, null_nodes, null_nodes, null_data, &mut e),
        "graph edges",
    )?;
    let mut from: Vec<Node> = vec![std::ptr::null_mut(); e];
    let mut to: Vec<Node> = vec![std::ptr::null_mut(); e];
    let mut data: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); e];
    ok(
        sys::cuGraphGetEdges_v2(
            graph,
            from.as_mut_ptr(),
            to.as_mut_ptr(),
            data.as_mut_ptr(),
            &mut e,
        ),
        "graph edges",
    )?;
    for k in 0..e.min(from.len()) {
        let (&i, &j) = index
            .get(&from[k])
            .zip(index.get(&to[k]))
            .ok_or("an edge outside the graph")?;
        next[i].push(j);
        indegree[j] += 1;
    }
    let mut ready: Vec<usize> = (0..n).filter(|&i| indegree[i] == 0).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(i) = ready.pop() {
        if !ready.is_empty() {
            return Err("the graph's nodes are not totally ordered".into());
        }
        order.push(nodes[i]);
        for &j in &next[i] {
            indegree[j] -= 1;
            if indegree[j] == 0 {
                ready.push(j);
            }
        }
    }
    if order.len() != n {
        return Err("the graph has a cycle".into());
    }
    Ok(order)
}

/// The parameter layout of a kernel: (offset, size) of each parameter.
///
/// # Safety
/// `params` must come from a live kernel node.
unsafe fn param_layout(params: &sys::CUDA_KERNEL_NODE_PARAMS) -> Result<Vec<usize>, String> {
    let mut sizes = vec![];
    for index in 0..1024usize {
        let (mut offset, mut size) = (0usize, 0usize);
        let r = if !params.func.is_null() {
            sys::cuFuncGetParamInfo(params.func, index, &mut offset, &mut size)
        } else if !params.kern.is_null() {
            sys::cuKernelGetParamInfo(params.kern, index, &mut offset, &mut size)
        } else {
            return Err("a kernel node without a function".into());
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            if index == 0 && r != sys::CUresult::CUDA_ERROR_INVALID_VALUE {
                return Err(format!("kernel parameter info: {r:?}"));
            }
            break;
        }
        sizes.push(size);
    }
    Ok(sizes)
}

/// A rebuilt graph, not yet instantiated.
pub(crate) struct Rebuilt {
    pub graph: sys::CUgraph,
    pub stats: RebuildStats,
    /// Which outputs were graph allocations (now written to their homes); the others lie in
    /// memory that outlives the graph and stay where they are.
    pub homed: Vec<bool>,
}

/// Copies `graph` (not yet instantiated) into a new graph without memory nodes. `arena` is
/// called once with the arena's size and returns its base address; `outputs` are the
/// (address, bytes) of the step's output tensors as captured, and `output_homes` their new
/// buffers' addresses (same order and sizes).
///
/// # Safety
/// `graph` must be a valid graph captured on `ctx`'s stream; the arena and output buffers must
/// outlive every launch of the result.
pub(crate) unsafe fn rebuild(
    graph: sys::CUgraph,
    ctx: sys::CUcontext,
    outputs: &[(u64, usize)],
    output_homes: &[u64],
    arena: &mut dyn FnMut(usize) -> Result<u64, String>,
) -> Result<Rebuilt, String> {
    let order = chain_order(graph)?;
    let mut stats = RebuildStats {
        nodes: order.len(),
        ..Default::default()
    };
    let mut allocs: Vec<Allocation> = vec![];
    let mut live: HashMap<u64, usize> = HashMap::new();
    let mut kinds = Vec::with_capacity(order.len());
    for (t, &node) in order.iter().enumerate() {
        let kind = node_type(node)?;
        match kind {
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC => {
                let mut p: sys::CUDA_MEM_ALLOC_NODE_PARAMS = std::mem::zeroed();
                ok(
                    sys::cuGraphMemAllocNodeGetParams(node, &mut p),
                    "allocation node",
                )?;
                live.insert(p.dptr, allocs.len());
                allocs.push(Allocation {
                    dptr: p.dptr,
                    bytes: p.bytesize,
                    born: t,
                    dies: usize::MAX,
                    place: 0,
                });
                stats.allocs += 1;
            }
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE => {
                let mut dptr: sys::CUdeviceptr = 0;
                ok(
                    sys::cuGraphMemFreeNodeGetParams(node, &mut dptr),
                    "free node",
                )?;
                let i = live
                    .remove(&dptr)
                    .ok_or("a free of memory the graph did not allocate")?;
                allocs[i].dies = t;
                stats.frees += 1;
            }
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => stats.kernels += 1,
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY
            | sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET
            | sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY => {}
            other => return Err(format!("a graph node of type {other:?}")),
        }
        kinds.push(kind);
    }
    let size = place_allocations(&mut allocs);
    let base = arena(size.max(256))?;
    stats.arena_bytes = size;
    let mut matched = vec![false; outputs.len()];
    for a in allocs.iter_mut() {
        if a.dies != usize::MAX {
            a.place += base;
            continue;
        }
        let k = outputs
            .iter()
            .position(|&(addr, bytes)| addr == a.dptr && bytes == a.bytes)
            .ok_or("a graph allocation still live at the end is not an output")?;
        if matched[k] {
            return Err("two graph allocations for one output".into());
        }
        matched[k] = true;
        a.place = output_homes[k];
    }
    for (k, &(addr, _)) in outputs.iter().enumerate() {
        if !matched[k]
            && allocs
                .iter()
                .any(|a| addr >= a.dptr && addr < a.dptr + a.bytes as u64)
        {
            return Err("an output inside a graph allocation it does not start".into());
        }
    }
    let mut new_graph: sys::CUgraph = std::ptr::null_mut();
    ok(sys::cuGraphCreate(&mut new_graph, 0), "graph create")?;
    let built = (|| -> Result<(), String> {
        let mut prev: Option<Node> = None;
        let mut prev_is_kernel = false;
        for (t, (&node, kind)) in order.iter().zip(&kinds).enumerate() {
            let mut deps: Vec<Node> = prev.into_iter().collect();
            let mut is_kernel = false;
            let mut added: Node = std::ptr::null_mut();
            match kind {
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => {
                    let mut p: sys::CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
                    ok(
                        sys::cuGraphKernelNodeGetParams_v2(node, &mut p),
                        "kernel node",
                    )?;
                    // the parameters as the driver holds them: one pointer per parameter, or one
                    // packed buffer (`extra`, as cuBLAS launches); either way every 8-byte word
                    // pointing into a graph allocation is moved
                    let mut remap_words = |bytes: &mut [u8]| {
                        for w in bytes.chunks_exact_mut(8) {
                            let mut v = u64::from_ne_bytes(w.try_into().expect("8 bytes"));
                            if move_pointer(&allocs, &mut v, t) {
                                w.copy_from_slice(&v.to_ne_bytes());
                                stats.remapped += 1;
                            }
                        }
                    };
                    let mut copies: Vec<Vec<u8>> = vec![];
                    let mut ptrs: Vec<*mut std::ffi::c_void> = vec![];
                    let mut packed: Vec<u8> = vec![];
                    let mut packed_size: usize = 0;
                    let mut extra: Vec<*mut std::ffi::c_void> = vec![];
                    if !p.kernelParams.is_null() {
                        for (i, size) in param_layout(&p)?.into_iter().enumerate() {
                            let src = *p.kernelParams.add(i) as *const u8;
                            let mut bytes = std::slice::from_raw_parts(src, size).to_vec();
                            if size >= 8 {
                                remap_words(&mut bytes);
                            }
                            copies.push(bytes);
                        }
                        ptrs = copies
                            .iter_mut()
                            .map(|c| c.as_mut_ptr() as *mut std::ffi::c_void)
                            .collect();
                    } else if !p.extra.is_null() {
                        let (buffer, size) = packed_params(p.extra)?;
                        packed = std::slice::from_raw_parts(buffer, size).to_vec();
                        remap_words(&mut packed[..size - size % 8]);
                        packed_size = size;
                    }
                    if !packed.is_empty() {
                        extra = vec![
                            LAUNCH_PARAM_BUFFER_POINTER,
                            packed.as_mut_ptr() as *mut std::ffi::c_void,
                            LAUNCH_PARAM_BUFFER_SIZE,
                            &mut packed_size as *mut usize as *mut std::ffi::c_void,
                            LAUNCH_PARAM_END,
                        ];
                    }
                    p.kernelParams = if ptrs.is_empty() {
                        std::ptr::null_mut()
                    } else {
                        ptrs.as_mut_ptr()
                    };
                    p.extra = if extra.is_empty() {
                        std::ptr::null_mut()
                    } else {
                        extra.as_mut_ptr()
                    };
                    let programmatic = prev_is_kernel && crate::pdl::is_aware(p.func);
                    if programmatic {
                        deps.clear(); // the edge from `prev` is added below, programmatic
                    }
                    ok(
                        sys::cuGraphAddKernelNode_v2(
                            &mut added,
                            new_graph,
                            deps.as_ptr(),
                            deps.len(),
                            &p,
                        ),
                        "add kernel node",
                    )?;
                    ok(
                        sys::cuGraphKernelNodeCopyAttributes(added, node),
                        "kernel node attributes",
                    )?;
                    if let (true, Some(up)) = (programmatic, prev) {
                        let edge = crate::pdl::programmatic_edge();
                        ok(
                            sys::cuGraphAddDependencies_v2(new_graph, &up, &added, &edge, 1),
                            "programmatic edge",
                        )?;
                        stats.programmatic += 1;
                    }
                    is_kernel = true;
                }
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY => {
                    let mut p: sys::CUDA_MEMCPY3D = std::mem::zeroed();
                    ok(sys::cuGraphMemcpyNodeGetParams(node, &mut p), "copy node")?;
                    let device = |m: sys::CUmemorytype| {
                        matches!(
                            m,
                            sys::CUmemorytype::CU_MEMORYTYPE_DEVICE
                                | sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED
                        )
                    };
                    if device(p.srcMemoryType) && move_pointer(&allocs, &mut p.srcDevice, t) {
                        stats.remapped += 1;
                    }
                    if device(p.dstMemoryType) && move_pointer(&allocs, &mut p.dstDevice, t) {
                        stats.remapped += 1;
                    }
                    ok(
                        sys::cuGraphAddMemcpyNode(
                            &mut added,
                            new_graph,
                            deps.as_ptr(),
                            deps.len(),
                            &p,
                            ctx,
                        ),
                        "add copy node",
                    )?;
                }
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET => {
                    let mut p: sys::CUDA_MEMSET_NODE_PARAMS = std::mem::zeroed();
                    ok(sys::cuGraphMemsetNodeGetParams(node, &mut p), "memset node")?;
                    if move_pointer(&allocs, &mut p.dst, t) {
                        stats.remapped += 1;
                    }
                    ok(
                        sys::cuGraphAddMemsetNode(
                            &mut added,
                            new_graph,
                            deps.as_ptr(),
                            deps.len(),
                            &p,
                            ctx,
                        ),
                        "add memset node",
                    )?;
                }
                _ => continue, // memory and empty nodes: the chain's order already holds
            }
            prev = Some(added);
            prev_is_kernel = is_kernel;
        }
        Ok(())
    })();
    if let Err(e) = built {
        let _ = sys::cuGraphDestroy(new_graph);
        return Err(e);
    }
    Ok(Rebuilt {
        graph: new_graph,
        stats,
        homed: matched,
    })
}
