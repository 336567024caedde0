//! `dflash bench decode`'s report: the JSON document (shape, device, dtype, the floor, every op's
//! median / min / p90 in ms, the decode paths the steps took, the trees verified) and the human
//! table on stderr.
//!
//! Invariants: every number is one the measuring half (`bench_decode`) recorded — nothing is
//! computed here but ratios and unit changes; the JSON keys are the ones issue 15 names
//! (`floor_ms`, `ar_step_ms`, `verify_ms` by width, `draft_block_ms`, `tree_build_ms`,
//! `sampled_step_ms`) plus the loops and the state commit.

use super::{dtype_name, git_commit, DecodeArgs, Op, LOOP_TOKENS};
use candle_core::DType;
use dflash_decoding::tree::DEFAULT_TREE_BUDGET;
use dflash_models::DecoderConfig;
use serde_json::{json, Map, Value};

pub(super) struct ReportIn<'a> {
    pub(super) a: &'a DecodeArgs,
    pub(super) shape: &'a str,
    pub(super) cfg: &'a DecoderConfig,
    pub(super) devname: &'a str,
    pub(super) dtype: DType,
    pub(super) widths: &'a [usize],
    pub(super) params: (usize, usize),
    pub(super) bytes: (usize, usize),
    pub(super) bw: &'a crate::bench_shapes::Bandwidth,
    pub(super) floor: f64,
    pub(super) ops: &'a [Op],
    pub(super) trees: Map<String, Value>,
    pub(super) build_s: f64,
    pub(super) drafter_layout: String,
}

pub(super) fn ms(s: f64) -> f64 {
    s * 1e3
}

/// Which kernels the run's decode steps took (from the same functions the engine asks, so a
/// record says what it measured): the projections' streaming-GEMM policy, the attention kernel and
/// how tree keys are ordered on it.
fn decode_paths(r: &ReportIn) -> Value {
    use dflash_core::step::{keys_by_position, tensor_core_attention};
    let cuda = r.devname.starts_with("cuda");
    let mma = cuda && tensor_core_attention(r.dtype, r.cfg.head_dim());
    let attention = match (cuda, mma) {
        (false, _) => "host (row-invariant CPU kernels)",
        (true, true) => "tensor cores",
        (true, false) => "CUDA cores",
    };
    json!({
        "stream_policy": format!("{:?}", dflash_core::stream_gemm::stream_policy()),
        "stream_tiled": dflash_core::stream_gemm::tiled_wide_calls(),
        "stream_tiled_from_rows": dflash_core::stream_gemm::tiled_from_rows(),
        "attention": attention,
        "tree_keys": if keys_by_position(mma) { "position" } else { "row" },
        // the hybrids' device step (off with DFLASH_HYBRID_STEP=0, read at load like the model)
        "hybrid_step": cuda
            && matches!(r.cfg.architecture(), Ok(dflash_models::Architecture::Qwen35))
            && std::env::var("DFLASH_HYBRID_STEP").as_deref() != Ok("0"),
    })
}

/// The JSON report: headline medians in ms at the top level, every op's min / median / p90 under
/// `stats`, ratios to the AR step and to the floor.
pub(super) fn report(r: &ReportIn) -> Value {
    let get = |k: &str| r.ops.iter().find(|o| o.key == k).map(|o| o.t.median);
    let ar = get("ar_step").unwrap_or(f64::NAN);
    let mut verify = Map::new();
    let mut by_budget = Map::new();
    let (mut stats, mut to_ar, mut to_floor) = (Map::new(), Map::new(), Map::new());
    let mut loops = Map::new();
    for o in r.ops {
        if let Some(k) = o.key.strip_prefix("loop.") {
            loops.insert(k.into(), json!(ms(o.t.median)));
        }
        if let Some(k) = o.key.strip_prefix("verify.") {
            verify.insert(k.into(), json!(ms(o.t.median)));
        }
        if let Some(b) = o.key.strip_prefix("tree_build.") {
            by_budget.insert(b.into(), json!(ms(o.t.median)));
        }
        stats.insert(
            o.key.clone(),
            json!({"median_ms": ms(o.t.median), "min_ms": ms(o.t.min), "p90_ms": ms(o.t.p90)}),
        );
        to_ar.insert(o.key.clone(), json!(o.t.median / ar));
        to_floor.insert(o.key.clone(), json!(o.t.median / r.floor));
    }
    let tree_build = get(&format!("tree_build.{DEFAULT_TREE_BUDGET}")).unwrap_or(f64::NAN);
    let mut doc = json!({
        "shape": r.shape,
        "architecture": r.cfg.architecture().unwrap_or(dflash_models::config::Architecture::Llama).as_str(),
        "device": r.devname,
        "dtype": dtype_name(r.dtype),
        "context": r.a.context,
        "rounds": r.a.rounds,
        "warmup": r.a.warmup,
        "block_size": r.a.block_size,
        "draft_layers": r.a.draft_layers,
        "drafter_layout": r.drafter_layout,
        "widths": r.widths,
        "params_target": r.params.0,
        "params_drafter": r.params.1,
        "bytes_per_step": r.bytes.0 + r.bytes.1,
        "bytes_weights": r.bytes.0,
        "bytes_kv_cache": r.bytes.1,
        "copy_gbps": r.bw.gbps,
        "copy_method": r.bw.method,
        "copy_bytes": r.bw.bytes,
        "floor_ms": ms(r.floor),
        "ar_step_ms": ms(ar),
        "sampled_step_ms": get("sampled_step").map(ms),
        "verify_ms": verify,
        "draft_block_ms": get("draft_block").map(ms),
        "state_commit_ms": get("state_commit").map(ms),
        "state_commit_submit_ms": get("state_commit_submit").map(ms),
        "tree_build_ms": ms(tree_build),
        "tree_build_budget": DEFAULT_TREE_BUDGET,
        "tree_topk_ms": get(&format!("tree_topk.{DEFAULT_TREE_BUDGET}")).map(ms),
        "tree_build_ms_by_budget": by_budget,
        "loop_step_ms": loops,
        "loop_tokens": LOOP_TOKENS,
        "trees": r.trees,
        "stats": stats,
        "ratio_to_ar_step": to_ar,
        "ratio_to_floor": to_floor,
        "setup_seconds": r.build_s,
        "decode_paths": decode_paths(r),
        "step_graphs": dflash_core::step_graph::last_graph_report(),
        "dflash_version": env!("CARGO_PKG_VERSION"),
        "git": git_commit(),
    });
    // (added after: one json! of every field passes the macro's recursion limit)
    doc["tree_commit_ms"] = json!(get("tree_commit").map(ms));
    doc["tree_commit_submit_ms"] = json!(get("tree_commit_submit").map(ms));
    // per commit: the host's crop / path compaction alone; the folded commit (hybrids on CUDA):
    // the verify folding it less the verify alone
    for commit in ["state_commit", "tree_commit"] {
        doc[format!("{commit}_keep_ms")] = json!(get(&format!("{commit}_keep")).map(ms));
        let pair = get(&format!("{commit}_folding")).zip(get(&format!("{commit}_alone")));
        doc[format!("{commit}_folded_ms")] = json!(pair.map(|(f, a)| ms(f) - ms(a)));
    }
    doc
}

/// The human table on stderr: op, median / min / p90 ms, × AR step, × floor.
pub(super) fn print_table(
    ops: &[Op],
    floor: f64,
    bytes: usize,
    bw: &crate::bench_shapes::Bandwidth,
) {
    let ar = ops
        .iter()
        .find(|o| o.key == "ar_step")
        .map(|o| o.t.median)
        .unwrap_or(f64::NAN);
    eprintln!(
        "{:<30} {:>10} {:>10} {:>10} {:>8} {:>8}",
        "op", "ms", "min ms", "p90 ms", "× AR", "× floor"
    );
    for o in ops {
        eprintln!(
            "{:<30} {:>10.3} {:>10.3} {:>10.3} {:>8.2} {:>8.2}",
            o.label,
            ms(o.t.median),
            ms(o.t.min),
            ms(o.t.p90),
            o.t.median / ar,
            o.t.median / floor
        );
    }
    eprintln!(
        "{:<30} {:>10.3} {:>10} {:>10} {:>8.2} {:>8.2}",
        "floor",
        ms(floor),
        "",
        "",
        floor / ar,
        1.0
    );
    eprintln!(
        "floor: {:.1} MB per AR step at {:.1} GB/s ({})",
        bytes as f64 / 1e6,
        bw.gbps,
        bw.method
    );
    let graphs = dflash_core::step_graph::last_graph_report();
    if !graphs.is_empty() {
        eprintln!("step graphs: {graphs}");
    }
}
