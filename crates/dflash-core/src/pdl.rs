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
//! - A captured step rebuilt without memory nodes ([`crate::graph_rebuild`]) joins a kernel to the
//!   kernel before it with a programmatic edge only when the downstream kernel is PDL-aware
//!   ([`is_aware`]); every other edge (memory copies, cuBLAS, candle's kernels downstream) stays a
//!   full dependency. Since every PDL-aware kernel waits for its upstream's completion before its
//!   first load, a kernel never reads memory an unfinished grid writes: the results are exactly
//!   those of the plain graph. (Graphs that keep their memory nodes cannot take such edges: the
//!   driver refuses dependency edits there, measured in session 14.)
//! - Eager launches (outside captures) are plain launches: the wait returns at once.
//! - Opt-in (a documented override, read once): `DFLASH_PDL=1` lets a kernel's dependents launch
//!   when it leaves (its last block's exit), `DFLASH_PDL=early` right after its wait; the
//!   streaming GEMM asks L2 for its first weight lines before its wait, so a GEMM launched early
//!   overlaps its first loads with the kernel before it. Unset or anything else: the modules are
//!   compiled without PDL and every edge stays as captured.

use candle_core::cuda_backend::cudarc::driver::{sys, CudaFunction};
use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

/// Whether the decode modules are compiled PDL-aware: `DFLASH_PDL` is `1` (dependents launch when
/// a kernel leaves) or `early` (right after its wait), read once, and device 0 has compute
/// capability ≥ 9.0. Off by default: measured on the H200 (docs/benchmarks.md session 15), it
/// cut SmolLM2's AR step by 6 % but slowed Qwen3-8B's 16-row verify by up to 4 %.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        if !matches!(
            std::env::var("DFLASH_PDL").as_deref(),
            Ok("1") | Ok("early")
        ) {
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
        if early_trigger() {
            opts.options.push("-DDFLASH_PDL_EARLY".into());
        }
    }
    opts
}

/// Whether kernels let their dependents launch right after their own wait (`DFLASH_PDL=early`)
/// instead of when they leave (`DFLASH_PDL=1`).
fn early_trigger() -> bool {
    std::env::var("DFLASH_PDL").as_deref() == Ok("early")
}

/// The `PDL_ENTRY()` macro every decode kernel module starts with (`pdl.cuh`).
const PRELUDE: &str = include_str!("pdl.cuh");

/// A decode kernel module's source with the PDL prelude in front of it.
pub fn with_prelude(source: &str) -> String {
    format!("{PRELUDE}{source}")
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

/// Whether the kernel `func` is PDL-aware (launched from a marked module; false when PDL is off).
pub fn is_aware(func: sys::CUfunction) -> bool {
    enabled()
        && aware()
            .lock()
            .is_ok_and(|set| set.contains(&(func as usize)))
}

/// A programmatic edge (the downstream grid may launch before the upstream one completes).
pub fn programmatic_edge() -> sys::CUgraphEdgeData {
    sys::CUgraphEdgeData {
        from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
        to_port: 0,
        type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
        reserved: [0; 5],
    }
}
