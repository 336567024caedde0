//! The Gated DeltaNet CUDA kernels (`src/gated_delta_kernels.cu`), emulated on the CPU: their
//! source compiled as C++ (g++, with CUDA's keywords defined away and the grid walked block by
//! block, thread by thread — valid because their threads share nothing, the one-lane kernels'
//! invariant; the four-lane rule kernels, whose lanes shuffle and meet at `__syncwarp`, run each
//! block's 32 lanes as host threads with a barrier for each). The rule's tree kernel is checked
//! against the host rule (`gated_delta::tree_recurrent`, `advance`) for chains, trees with
//! branches and several roots, and the replay mode without outputs, at two key head dims, and the
//! many-layer replay through its pointer table (each layer's `advance`, and the forward's bits);
//! the four-lane, staged and replay kernels and the folded commit against the one-lane kernel's
//! bits; the layer kernels around it (convolution + SiLU along a tree's ancestors, the rule's
//! inputs, the gated RMSNorm, the state commit's convolution windows) against host loops of the
//! model's composite, in f32 and bf16. What this cannot check — the launches themselves —
//! `decode_ops_device.rs` and the reference fixtures check on the H200.

use candle_core::{Device, Tensor};
use dflash_core::gated_delta::{self, kept_states, DeltaInputs};
use std::io::Write;
use std::process::{Command, Stdio};

const KERNEL: &str = concat!(
    include_str!("../src/gated_delta_kernels.cu"),
    include_str!("../src/gated_delta_layer_kernels.cu")
);

/// CUDA's keywords for a host build, and a `main` that reads the inputs on stdin, launches the
/// grid as `gated_delta_cuda.rs` does (blocks of 32 threads, `ceil(dv / 32) × H` blocks) and
/// writes the outputs (when asked) and the final state on stdout.
const PRELUDE: &str = r#"
#include <math.h>
#include <stddef.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __shared__ static
#define __syncthreads()
#define RELOAD(p) (*(p))
#define STATE_RELOAD(p) (*(p))
#include <string.h>
#include <pthread.h>
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
struct Dim3 { unsigned x, y, z; };
// a warp's lanes run as 32 host threads (the warp kernels: WARP_LANES builds), each with its own
// indices; the others walk the grid thread by thread on one host thread
static thread_local Dim3 blockIdx, threadIdx;
static Dim3 blockDim, gridDim;
// __syncwarp: every lane of the warp waits for the others; a shuffle writes the lane's value to
// its slot between two such waits and reads the source lane's after them
static pthread_barrier_t warp_barrier;
static float warp_slots[32];
static inline void __syncwarp(unsigned = 0xffffffffu) { pthread_barrier_wait(&warp_barrier); }
static inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    __syncwarp();
    warp_slots[threadIdx.x] = v;
    __syncwarp();
    return warp_slots[threadIdx.x ^ lane_mask];
}
"#;

const MAIN: &str = include_str!("emulated/gated_delta_main.cpp");

/// The kernel built for key head dim `dk` in `dir`; its path.
fn build(dir: &std::path::Path, dk: usize) -> std::path::PathBuf {
    build_variant(dir, dk, RuleBuild::OneLane)
}

/// The rule kernel a build compiles (`gated_delta_cuda.rs`'s `RuleKernel`, by its defines).
#[derive(Clone, Copy, Debug, PartialEq)]
enum RuleBuild {
    OneLane,
    FourLanes,
    FourLanesStaged,
    FourLanesStagedReplay,
    /// The four-lane kernels with the fold staging 4 pending tokens at a time
    /// (`DFLASH_GDN_FOLD_CHUNK=4`; 8 by default).
    FourLanesFoldChunk4,
}

impl RuleBuild {
    fn defines(self) -> &'static str {
        match self {
            RuleBuild::OneLane => "",
            RuleBuild::FourLanes => "#define RULE_LANES4\n",
            RuleBuild::FourLanesStaged => "#define RULE_LANES4\n#define RULE_STAGED\n",
            RuleBuild::FourLanesStagedReplay => {
                "#define RULE_LANES4\n#define RULE_STAGED\n#define RULE_REPLAY\n"
            }
            RuleBuild::FourLanesFoldChunk4 => "#define RULE_LANES4\n#define FOLD_CHUNK 4\n",
        }
    }
}

/// The kernels built for key head dim `dk` with the rule kernel `rule` in `dir`; its path. The
/// four-lane rules run each 32-thread block's lanes as host threads (warp shuffles and
/// `__syncwarp` between them: the harness's `WARP_LANES`).
fn build_variant(dir: &std::path::Path, dk: usize, rule: RuleBuild) -> std::path::PathBuf {
    let name = format!("gated_delta_dk{dk}_{rule:?}");
    let src = dir.join(format!("{name}.cpp"));
    let exe = dir.join(&name);
    let warp = if rule == RuleBuild::OneLane {
        ""
    } else {
        "#define WARP_LANES\n"
    };
    let defines = rule.defines();
    std::fs::write(
        &src,
        format!("{PRELUDE}#define DK {dk}\n{defines}{warp}{KERNEL}\n{MAIN}"),
    )
    .unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let o = Command::new(&cxx)
        .args([
            "-O1",
            "-std=c++17",
            "-pthread",
            "-Wno-unknown-pragmas",
            "-o",
        ])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("{cxx} (a C++ compiler emulates the kernel): {e}"));
    assert!(
        o.status.success(),
        "the kernel does not build as C++: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    exe
}

fn bytes_f32(t: &Tensor) -> Vec<u8> {
    let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_i32(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A tree mode's input up to its rule inputs: the mode and header words, the parents, the kept
/// flags ([`kept_states`]), as the harness's `TreeInputs` reads them.
fn tree_header(words: &[i32], parents: &[i64]) -> Vec<u8> {
    let mut input = bytes_i32(words);
    input.extend(bytes_i32(
        &parents.iter().map(|&p| p as i32).collect::<Vec<_>>(),
    ));
    input.extend(bytes_i32(
        &kept_states(parents)
            .iter()
            .map(|&b| b as i32)
            .collect::<Vec<_>>(),
    ));
    input
}

/// Runs the emulated kernel: (outputs `[T·H·dv]` when asked, final state `[H·dk·dv]`).
fn emulate(
    exe: &std::path::Path,
    x: &DeltaInputs,
    state: &Tensor,
    parents: &[i64],
    outputs: bool,
) -> (Option<Vec<f32>>, Vec<f32>) {
    let (t, h, dk) = x.k.dims3().unwrap();
    let dv = x.v.dim(2).unwrap();
    let mut input = tree_header(
        &[0, t as i32, h as i32, dk as i32, dv as i32, outputs as i32],
        parents,
    );
    for a in [x.q, x.k, x.v, x.g, x.beta, state] {
        input.extend(bytes_f32(a));
    }
    let f = floats(&run(exe, &input));
    let n_out = if outputs { t * h * dv } else { 0 };
    assert_eq!(f.len(), n_out + h * dk * dv, "output size");
    let out = outputs.then(|| f[..n_out].to_vec());
    (out, f[n_out..].to_vec())
}

/// The rule's inputs of [`inputs`]' q, k, v, g, beta.
fn view(x: &[Tensor]) -> DeltaInputs<'_> {
    DeltaInputs {
        q: &x[0],
        k: &x[1],
        v: &x[2],
        g: &x[3],
        beta: &x[4],
    }
}

/// Random rule inputs of `t` tokens (q, k l2-normalised, g ≤ 0, β in (0, 1)) and a state.
fn inputs(t: usize, h: usize, dk: usize, dv: usize, seed: u64) -> (Vec<Tensor>, Tensor) {
    let dev = Device::Cpu;
    let mut next_seed = seed;
    let mut rnd = |n: usize| {
        next_seed = next_seed.wrapping_add(0x51_7cc1);
        uniform(n, next_seed)
    };
    let mut t3 = |d: usize| Tensor::from_vec(rnd(t * h * d), (t, h, d), &dev).unwrap();
    let q = gated_delta::l2norm(&t3(dk)).unwrap();
    let q = (q * (dk as f64).powf(-0.5)).unwrap();
    let k = gated_delta::l2norm(&t3(dk)).unwrap();
    let v = t3(dv);
    let g = Tensor::from_vec(rnd(t * h), (t, h), &dev)
        .unwrap()
        .abs()
        .unwrap()
        .neg()
        .unwrap();
    let beta = candle_nn_sigmoid(&Tensor::from_vec(rnd(t * h), (t, h), &dev).unwrap());
    let s0 = Tensor::from_vec(rnd(h * dk * dv), (h, dk, dv), &dev).unwrap();
    (vec![q, k, v, g, beta], s0)
}

fn candle_nn_sigmoid(x: &Tensor) -> Tensor {
    (x.neg().unwrap().exp().unwrap() + 1.0)
        .unwrap()
        .recip()
        .unwrap()
}

fn max_rel(a: &[f32], b: &Tensor) -> f32 {
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
        / scale
}

#[test]
fn the_tree_kernel_computes_the_host_rule_for_chains_and_trees() {
    let dir = tempfile::tempdir().unwrap();
    let trees: Vec<Vec<i64>> = vec![
        vec![-1],
        (0..9).map(|i| i - 1).collect(),
        // branches, a node whose parent is not the node before it, a second root
        vec![-1, 0, 0, 1, 1, 2, -1, 6, 3, 8, 4],
        // a DDTree-like order: best-first, parents far back
        vec![-1, 0, 1, 0, 2, 3, 1, 4, 5, 6, 2, 7],
    ];
    for (dk, dv, h) in [(16usize, 40usize, 3usize), (64, 32, 2)] {
        let exe = build(dir.path(), dk);
        for (ti, parents) in trees.iter().enumerate() {
            let t = parents.len();
            let (x, s0) = inputs(t, h, dk, dv, 7 + ti as u64);
            let di = view(&x);
            let (want_out, want_last) = gated_delta::tree_recurrent(&di, &s0, parents).unwrap();
            let (out, last) = emulate(&exe, &di, &s0, parents, true);
            let e_out = max_rel(&out.unwrap(), &want_out);
            let e_last = max_rel(&last, &want_last);
            assert!(
                e_out < 1e-5 && e_last < 1e-5,
                "dk {dk} tree {parents:?}: outputs off by {e_out}, final state by {e_last}"
            );
            // the replay mode: no outputs, the final state of the chain is advance's
            if parents.iter().enumerate().all(|(i, &p)| p == i as i64 - 1) {
                let (none, last) = emulate(&exe, &di, &s0, parents, false);
                assert!(none.is_none());
                let want = gated_delta::advance(&x[1], &x[2], &x[3], &x[4], &s0).unwrap();
                let e = max_rel(&last, &want);
                assert!(e < 1e-5, "dk {dk}: replayed state off by {e}");
            }
        }
    }
}

#[test]
fn kept_states_are_the_nodes_a_later_non_adjacent_child_reads() {
    assert_eq!(kept_states(&[-1, 0, 1, 2]), [false; 4]);
    assert_eq!(
        kept_states(&[-1, 0, 0, 1, 1, 2, -1, 6]),
        // 0 → 2, 1 → 3 and 4, 2 → 5 are not adjacent; 6 → 7 is
        [true, true, true, false, false, false, false, false]
    );
    // node 1's children are 2 (adjacent) and 4; node 0's are 1 (adjacent) and 3
    assert_eq!(
        kept_states(&[-1, 0, 1, 0, 1]),
        [true, true, false, false, false]
    );
}

/// Runs the emulated kernels of `exe` on `input` (mode word first); the f32 words it prints.
fn run(exe: &std::path::Path, input: &[u8]) -> Vec<u8> {
    let mut child = Command::new(exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    o.stdout
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Values as the kernel's compute dtype sees them: f32 as is, or rounded to bf16 (its bits).
fn compute_dtype(v: &[f32], bf16: bool) -> (Vec<f32>, Vec<u8>) {
    if !bf16 {
        return (v.to_vec(), f32s(v));
    }
    let b: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
    (
        b.iter().map(|x| x.to_f32()).collect(),
        b.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
    )
}

fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: sizes");
    let scale = want.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    let err = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(err <= tol * scale, "{what}: off by {err} (scale {scale})");
}

/// `n` draws uniform in (−1, 1).
fn uniform(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0
        })
        .collect()
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The layer kernels around the rule (convolution + SiLU along a tree's ancestors, the rule's
/// inputs from the convolved rows and the gate projections, the gated RMSNorm) against plain host
/// loops of the map `dflash_models::gated_deltanet` computes, in f32 and bf16.
#[test]
fn the_layer_kernels_compute_the_host_composite() {
    let dir = tempfile::tempdir().unwrap();
    let dk = 16;
    let exe = build(dir.path(), dk);
    let (hk, hv, dv, kw) = (2usize, 4usize, 24usize, 4usize);
    let c = 2 * hk * dk + hv * dv;
    let parents: Vec<i64> = vec![-1, 0, 1, 0, 3, 1, -1, 6];
    let n = parents.len();
    let raw = uniform(n * c, 3); // [n, c]
    let cs = uniform((kw - 1) * c, 4);
    let w = uniform(c * kw, 5);
    for bf16 in [false, true] {
        let (xv, xb) = compute_dtype(&raw, bf16);
        // the convolution
        let mut input = bytes_i32(&[1, n as i32, c as i32, kw as i32, bf16 as i32]);
        input.extend(xb);
        input.extend(f32s(&cs));
        input.extend(f32s(&w));
        input.extend(bytes_i32(
            &parents.iter().map(|&p| p as i32).collect::<Vec<_>>(),
        ));
        let out = floats(&run(&exe, &input));
        let (u, q32) = out.split_at(n * c);
        let mut want = vec![0f32; n * c];
        for i in 0..n {
            for ch in 0..c {
                let (mut node, mut back) = (i as i64, 0usize);
                let mut win = vec![0f32; kw];
                for j in (0..kw).rev() {
                    win[j] = if node >= 0 {
                        let x = xv[node as usize * c + ch];
                        node = parents[node as usize];
                        x
                    } else {
                        back += 1;
                        cs[(kw - 1 - back) * c + ch]
                    };
                }
                let acc = (0..kw).map(|j| win[j] * w[ch * kw + j]).sum::<f32>();
                want[i * c + ch] = silu(acc);
            }
        }
        close(u, &want, 1e-5, &format!("convolution (bf16 {bf16})"));
        assert_eq!(q32, &xv[..], "the record's f32 inputs");
        // the rule's inputs from u and the gates
        let bg = uniform(2 * n * hv, 6);
        let (b, a): (Vec<f32>, Vec<f32>) = bg.chunks(2).map(|p| (p[0] * 3.0, p[1] * 3.0)).unzip();
        let (bv, bb) = compute_dtype(&b, bf16);
        let (av, ab) = compute_dtype(&a, bf16);
        let dt_bias: Vec<f32> = (0..hv).map(|h| 0.1 * h as f32 - 0.2).collect();
        let neg_a: Vec<f32> = (0..hv).map(|h| -0.5 - h as f32).collect();
        let mut input = bytes_i32(&[2, n as i32, hk as i32, hv as i32, dv as i32, bf16 as i32]);
        input.extend(f32s(&want));
        input.extend(bb);
        input.extend(ab);
        input.extend(f32s(&dt_bias));
        input.extend(f32s(&neg_a));
        let out = floats(&run(&exe, &input));
        let (q, rest) = out.split_at(n * hv * dk);
        let (k, rest) = rest.split_at(n * hv * dk);
        let (v, rest) = rest.split_at(n * hv * dv);
        let (g, beta) = rest.split_at(n * hv);
        let (mut wq, mut wk, mut wv, mut wg, mut wb) = (vec![], vec![], vec![], vec![], vec![]);
        for i in 0..n {
            let row = &want[i * c..(i + 1) * c];
            for h in 0..hv {
                let kh = h / (hv / hk);
                let norm = |x: &[f32]| {
                    let ss: f32 = x.iter().map(|v| v * v).sum();
                    let inv = 1.0 / (ss + 1e-6).sqrt();
                    x.iter().map(|v| v * inv).collect::<Vec<f32>>()
                };
                let scale = (dk as f32).powf(-0.5);
                wq.extend(norm(&row[kh * dk..(kh + 1) * dk]).iter().map(|x| x * scale));
                wk.extend(norm(&row[(hk + kh) * dk..(hk + kh + 1) * dk]));
                let v0 = 2 * hk * dk + h * dv;
                wv.extend_from_slice(&row[v0..v0 + dv]);
                let e = i * hv + h;
                wb.push(1.0 / (1.0 + (-bv[e]).exp()));
                let x = av[e] + dt_bias[h];
                wg.push((x.max(0.0) + ((-x.abs()).exp() + 1.0).ln()) * neg_a[h]);
            }
        }
        close(q, &wq, 1e-5, "q");
        close(k, &wk, 1e-5, "k");
        close(v, &wv, 0.0, "v");
        close(g, &wg, 1e-5, "g");
        close(beta, &wb, 1e-5, "beta");
        // the gated norm
        let o = &want[..n * hv * dv];
        let (zv, zb) = compute_dtype(&want[n * c - n * hv * dv..], bf16);
        let nw: Vec<f32> = (0..dv).map(|j| 0.5 + 0.05 * j as f32).collect();
        let eps = 1e-6f32;
        let mut input = bytes_i32(&[3, n as i32, hv as i32, dv as i32, bf16 as i32]);
        input.extend(f32s(&[eps]));
        input.extend(f32s(o));
        input.extend(zb);
        input.extend(f32s(&nw));
        let bytes = run(&exe, &input);
        let got: Vec<f32> = if bf16 {
            bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect()
        } else {
            floats(&bytes)
        };
        let mut wy = vec![];
        for head in o.chunks(dv) {
            let ms = head.iter().map(|x| x * x).sum::<f32>() / dv as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            let base = wy.len();
            for (j, &x) in head.iter().enumerate() {
                wy.push(x * inv * nw[j] * silu(zv[base + j]));
            }
        }
        let tol = if bf16 { 8e-3 } else { 1e-5 };
        close(&got, &wy, tol, &format!("gated norm (bf16 {bf16})"));
    }
}

/// The replay of many layers in one launch (`advance_layers` on CUDA: the table of L layers, no
/// outputs) gives each layer the host's `advance`, and exactly the bits the one-layer forward of
/// the same chain (with outputs) ends in.
#[test]
fn the_many_layer_replay_is_each_layers_advance_and_the_forwards_bits() {
    let dir = tempfile::tempdir().unwrap();
    let (dk, dv, h, t, layers) = (16usize, 40usize, 3usize, 6usize, 3usize);
    let exe = build(dir.path(), dk);
    let chain: Vec<i64> = (0..t as i64).map(|i| i - 1).collect();
    let per_layer: Vec<(Vec<Tensor>, Tensor)> = (0..layers)
        .map(|l| inputs(t, h, dk, dv, 40 + l as u64))
        .collect();
    let mut input = bytes_i32(&[4, layers as i32, t as i32, h as i32, dk as i32, dv as i32]);
    for (x, s0) in &per_layer {
        for a in [&x[1], &x[2], &x[3], &x[4], s0] {
            input.extend(bytes_f32(a));
        }
    }
    let out = floats(&run(&exe, &input));
    let size = h * dk * dv;
    assert_eq!(out.len(), layers * size);
    for (l, (x, s0)) in per_layer.iter().enumerate() {
        let got = &out[l * size..(l + 1) * size];
        let want = gated_delta::advance(&x[1], &x[2], &x[3], &x[4], s0).unwrap();
        let e = max_rel(got, &want);
        assert!(e < 1e-5, "layer {l}: replayed state off by {e}");
        let di = view(x);
        let (_, forward_last) = emulate(&exe, &di, s0, &chain, true);
        assert!(
            forward_last == got,
            "layer {l}: the replay is not the forward's state, bit for bit"
        );
    }
}

/// The state commit's convolution windows for many layers in one launch
/// (`gated_delta_layer::conv_windows` on CUDA) are the host's: the last K − 1 rows of
/// [start; the kept inputs], for kept counts shorter and longer than the window.
#[test]
fn the_many_layer_conv_windows_are_the_hosts() {
    let dir = tempfile::tempdir().unwrap();
    let exe = build(dir.path(), 16);
    let (layers, w, c, rows) = (3usize, 3usize, 10usize, 7usize);
    let data: Vec<(Tensor, Tensor)> = (0..layers)
        .map(|l| {
            let start = Tensor::from_vec(uniform(w * c, 60 + l as u64), (w, c), &Device::Cpu);
            let x = Tensor::from_vec(uniform(rows * c, 70 + l as u64), (rows, c), &Device::Cpu);
            (start.unwrap(), x.unwrap())
        })
        .collect();
    for n in [1usize, 2, 3, 5, 7] {
        let mut input = bytes_i32(&[5, layers as i32, n as i32, w as i32, c as i32, rows as i32]);
        for (s0, x) in &data {
            input.extend(bytes_f32(s0));
            input.extend(bytes_f32(x));
        }
        let out = floats(&run(&exe, &input));
        let jobs: Vec<(&Tensor, &Tensor)> = data.iter().map(|(s0, x)| (s0, x)).collect();
        let want = dflash_core::gated_delta_layer::conv_windows(&jobs, n).unwrap();
        for (l, wl) in want.iter().enumerate() {
            let got = &out[l * w * c..(l + 1) * w * c];
            assert_eq!(max_rel(got, wl), 0.0, "layer {l}, {n} kept");
        }
    }
}

/// The fused convolution + rule inputs (`gdn_conv_rule_inputs`, one block a token and value head,
/// reading column views of a stacked projection) gives the two kernels' bits (`gdn_conv_silu`
/// then `gdn_rule_inputs` on contiguous copies): the record's f32 inputs, q, k, v, g and β, for a
/// tree with two roots, value heads wider and narrower than the key heads, f32 and bf16.
#[test]
fn the_fused_inputs_kernel_gives_the_two_kernels_bits() {
    let dir = tempfile::tempdir().unwrap();
    let dk = 16;
    let exe = build(dir.path(), dk);
    let parents: Vec<i64> = vec![-1, 0, 1, 0, 3, 1, -1, 6, 7];
    let n = parents.len();
    let pw: Vec<i32> = parents.iter().map(|&p| p as i32).collect();
    for (hk, hv, dv) in [(2usize, 4usize, 24usize), (1, 3, 8)] {
        let kw = 4usize;
        let c = 2 * hk * dk + hv * dv;
        let (ld, gld) = (c + 7, hv + 3);
        let raw = uniform(n * c, 11);
        let cs = uniform((kw - 1) * c, 12);
        let w = uniform(c * kw, 13);
        let gates: Vec<f32> = uniform(2 * n * hv, 14).iter().map(|x| x * 3.0).collect();
        let dt_bias: Vec<f32> = (0..hv).map(|h| 0.1 * h as f32 - 0.2).collect();
        let neg_a: Vec<f32> = (0..hv).map(|h| -0.5 - h as f32).collect();
        for bf16 in [false, true] {
            // the two kernels on contiguous rows
            let (_, xb) = compute_dtype(&raw, bf16);
            let mut input = bytes_i32(&[1, n as i32, c as i32, kw as i32, bf16 as i32]);
            input.extend(&xb);
            input.extend(f32s(&cs));
            input.extend(f32s(&w));
            input.extend(bytes_i32(&pw));
            let conv = run(&exe, &input);
            let (u, rec) = conv.split_at(4 * n * c);
            let (_, bb) = compute_dtype(&gates[..n * hv], bf16);
            let (_, ab) = compute_dtype(&gates[n * hv..], bf16);
            let mut input = bytes_i32(&[2, n as i32, hk as i32, hv as i32, dv as i32, bf16 as i32]);
            input.extend(u);
            input.extend(bb);
            input.extend(ab);
            input.extend(f32s(&dt_bias));
            input.extend(f32s(&neg_a));
            let two = run(&exe, &input);
            // the fused kernel on strided rows (padding NaN: a stray read would show)
            let mut wide = vec![f32::NAN; n * ld];
            for i in 0..n {
                wide[i * ld..i * ld + c].copy_from_slice(&raw[i * c..(i + 1) * c]);
            }
            let mut gw = vec![f32::NAN; 2 * n * gld];
            for (half, src) in gates.chunks(n * hv).enumerate() {
                for i in 0..n {
                    let at = half * n * gld + i * gld;
                    gw[at..at + hv].copy_from_slice(&src[i * hv..(i + 1) * hv]);
                }
            }
            let head = [6, n, hk, hv, dv, kw, ld, gld, bf16 as usize];
            let mut input = bytes_i32(&head.map(|x| x as i32));
            input.extend(compute_dtype(&wide, bf16).1);
            input.extend(f32s(&cs));
            input.extend(f32s(&w));
            input.extend(bytes_i32(&pw));
            input.extend(compute_dtype(&gw, bf16).1);
            input.extend(f32s(&dt_bias));
            input.extend(f32s(&neg_a));
            let fused = run(&exe, &input);
            let (frec, fin) = fused.split_at(4 * n * c);
            assert_eq!(frec, rec, "the record's inputs (hv {hv}, bf16 {bf16})");
            assert_eq!(fin, &two[..], "q, k, v, g, beta (hv {hv}, bf16 {bf16})");
        }
    }
}

/// The hybrid step's rule with the last verify's commit folded in (`gated_delta_tree_fold_f32`):
/// the state buffer it leaves is, bit for bit, the chain replay of the pending tokens (the
/// commit it replaces), and the step's outputs are the tree forward's from that state — for a
/// chain, and a tree with a second root (which reads the written state back); with nothing
/// pending, the state is untouched and the outputs are the plain forward's.
#[test]
fn the_folded_commit_is_the_replay_then_the_forward() {
    let dir = tempfile::tempdir().unwrap();
    let trees: Vec<Vec<i64>> = vec![
        (0..7).map(|i| i - 1).collect(),
        vec![-1, 0, 0, 1, 1, 2, -1, 6, 3, 8, 4],
    ];
    for (dk, dv, h) in [(16usize, 40usize, 3usize), (64, 32, 2)] {
        let exe = build(dir.path(), dk);
        for (ti, parents) in trees.iter().enumerate() {
            for np in [0usize, 1, 3] {
                let t = parents.len();
                let (x, s0) = inputs(t, h, dk, dv, 90 + ti as u64);
                let (px, _) = inputs(np.max(1), h, dk, dv, 120 + ti as u64);
                let px: Vec<Tensor> = px.iter().map(|a| a.narrow(0, 0, np).unwrap()).collect();
                let f = emulate_fold(&exe, (&x, &px, &s0), parents, true);
                let n_out = t * h * dv;
                assert_eq!(f.len(), n_out + h * dk * dv, "output size");
                let (out, committed) = f.split_at(n_out);
                // the commit it replaces: the chain replay through the same kernel (mode 4)
                let want_state: Vec<f32> = if np == 0 {
                    s0.flatten_all().unwrap().to_vec1().unwrap()
                } else {
                    let mut rin = bytes_i32(&[4, 1, np as i32, h as i32, dk as i32, dv as i32]);
                    for a in [&px[1], &px[2], &px[3], &px[4], &s0] {
                        rin.extend(bytes_f32(a));
                    }
                    floats(&run(&exe, &rin))
                };
                assert!(
                    committed == want_state.as_slice(),
                    "dk {dk} tree {ti} np {np}: the folded commit is not the replay, bit for bit"
                );
                // the step from the committed state: the plain forward's outputs, bit for bit
                let start = Tensor::from_vec(want_state, (h, dk, dv), &Device::Cpu).unwrap();
                let (want_out, _) = emulate(&exe, &view(&x), &start, parents, true);
                assert!(
                    out == want_out.unwrap().as_slice(),
                    "dk {dk} tree {ti} np {np}: the step's outputs are not the forward's"
                );
            }
        }
    }
}

/// Runs the fold kernel (mode 7) of `exe`: the step's rule inputs `x` (q, k, v, g, beta) over
/// `parents` after the pending tokens of `px` (its k, v, g, beta; their count is its length)
/// from the state `s0`; `staged`: the kernel's argument. The outputs, then the state it leaves.
fn emulate_fold(
    exe: &std::path::Path,
    (x, px, s0): (&[Tensor], &[Tensor], &Tensor),
    parents: &[i64],
    staged: bool,
) -> Vec<f32> {
    let (t, h, dk) = x[1].dims3().unwrap();
    let (np, dv) = (px[1].dim(0).unwrap(), x[2].dim(2).unwrap());
    let words = [7, t, h, dk, dv, np, staged as usize].map(|w| w as i32);
    let mut input = tree_header(&words, parents);
    for a in &x[..5] {
        input.extend(bytes_f32(a));
    }
    for a in &px[1..5] {
        input.extend(bytes_f32(a));
    }
    input.extend(bytes_f32(s0));
    floats(&run(exe, &input))
}

/// The four-lane rule kernels — CUDA's default (four lanes a column, each sum's quarters met by
/// two shuffles), the staged forward and the replay kernel — and the folded commit's pending
/// tokens walked from global or staged in shared memory, each 32-thread block's lanes run as
/// host threads: every output and final state, and every state the fold leaves, equal bit for
/// bit to the one-lane kernel's (what `gated_delta_kernels.cu` claims; `decode_ops_device.rs`
/// checks it on a GPU) — at two key head dims, with inactive lanes (dv not a multiple of 8),
/// trees longer than a staged chunk, and folds of more pending tokens than a staged chunk holds.
#[test]
fn the_four_lane_kernels_give_the_one_lane_bits() {
    let dir = tempfile::tempdir().unwrap();
    let long: Vec<i64> = (0..70i64)
        .map(|i| if i % 9 == 5 { i - 3 } else { i - 1 })
        .collect();
    let trees: Vec<Vec<i64>> = vec![
        vec![-1],
        (0..9).map(|i| i - 1).collect(),
        vec![-1, 0, 0, 1, 1, 2, -1, 6, 3, 8, 4],
        long,
    ];
    let chain = |p: &[i64]| p.iter().enumerate().all(|(i, &q)| q == i as i64 - 1);
    for (dk, dv, h) in [(16usize, 36usize, 3usize), (64, 20, 2)] {
        let one = build_variant(dir.path(), dk, RuleBuild::OneLane);
        let four = build_variant(dir.path(), dk, RuleBuild::FourLanes);
        let staged = build_variant(dir.path(), dk, RuleBuild::FourLanesStaged);
        let replay = build_variant(dir.path(), dk, RuleBuild::FourLanesStagedReplay);
        let chunk4 = build_variant(dir.path(), dk, RuleBuild::FourLanesFoldChunk4);
        for (ti, parents) in trees.iter().enumerate() {
            let (x, s0) = inputs(parents.len(), h, dk, dv, 300 + ti as u64);
            let want = emulate(&one, &view(&x), &s0, parents, true);
            for (exe, rule) in [(&four, "four lanes"), (&staged, "staged")] {
                let got = emulate(exe, &view(&x), &s0, parents, true);
                assert!(
                    got == want,
                    "dk {dk} tree {ti}: the {rule} kernel's outputs or state are not one lane's"
                );
            }
            if chain(parents) {
                let want = emulate(&one, &view(&x), &s0, parents, false);
                let got = emulate(&replay, &view(&x), &s0, parents, false);
                assert!(got == want, "dk {dk} tree {ti}: the replay kernel's state");
            }
            if ti >= 3 {
                continue; // (the folds below on the shorter trees)
            }
            for np in [0usize, 1, 3, 8, 11, 20] {
                let (px, _) = inputs(np.max(1), h, dk, dv, 400 + np as u64);
                let px: Vec<Tensor> = px.iter().map(|a| a.narrow(0, 0, np).unwrap()).collect();
                let want = emulate_fold(&one, (&x, &px, &s0), parents, true);
                for (exe, stage, build) in [
                    (&four, false, "global"),
                    (&four, true, "staged 8"),
                    (&chunk4, true, "staged 4"),
                ] {
                    let got = emulate_fold(exe, (&x, &px, &s0), parents, stage);
                    assert!(
                        got == want,
                        "dk {dk} tree {ti} np {np} ({build}): the four-lane fold's outputs or \
                         state are not one lane's"
                    );
                }
            }
        }
    }
}

/// The folded commit's record copy (`gdn_record_pending_rows`): rows 0..n of each buffer, at its
/// own width, and nothing past them.
#[test]
fn the_pending_rows_copy_takes_the_first_rows_of_each_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let exe = build(dir.path(), 16);
    let widths = [300usize, 7, 513];
    let rows = 6;
    let data: Vec<Vec<f32>> = widths
        .iter()
        .enumerate()
        .map(|(b, &w)| uniform(rows * w, 200 + b as u64))
        .collect();
    for n in [0usize, 1, 4] {
        let mut input = bytes_i32(&[8, widths.len() as i32, n as i32, rows as i32]);
        input.extend(bytes_i32(
            &widths.iter().map(|&w| w as i32).collect::<Vec<_>>(),
        ));
        for d in &data {
            input.extend(f32s(d));
        }
        let out = floats(&run(&exe, &input));
        let mut at = 0;
        for (d, &w) in data.iter().zip(&widths) {
            assert_eq!(&out[at..at + n * w], &d[..n * w], "width {w}, {n} rows");
            at += n * w;
        }
        assert_eq!(at, out.len());
    }
}
