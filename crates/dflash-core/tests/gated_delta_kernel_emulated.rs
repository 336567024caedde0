//! The gated delta rule's CUDA kernel (`src/gated_delta_kernels.cu`), emulated on the CPU: its
//! source compiled as C++ (g++, with CUDA's keywords defined away and the grid walked block by
//! block, thread by thread — valid because its threads share nothing, the kernel's invariant)
//! and checked against the host rule (`gated_delta::tree_recurrent`, `advance`) for chains, trees
//! with branches and several roots, and the replay mode without outputs, at two key head dims.
//! What it does not check — the launch itself, on a GPU — `decode_ops_device.rs` does on the
//! H200.

use candle_core::{Device, Tensor};
use dflash_core::gated_delta::{self, kept_states, DeltaInputs};
use std::io::Write;
use std::process::{Command, Stdio};

const KERNEL: &str = include_str!("../src/gated_delta_kernels.cu");

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
#define __launch_bounds__(x)
#define RELOAD(p) (*(p))
struct Dim3 { unsigned x, y, z; };
static Dim3 blockIdx, threadIdx, blockDim;
"#;

const MAIN: &str = r#"
#include <stdio.h>
#include <vector>
template <class T> static std::vector<T> take(size_t n) {
    std::vector<T> v(n);
    if (n && fread(v.data(), sizeof(T), n, stdin) != n) { fprintf(stderr, "short input\n"); exit(2); }
    return v;
}
int main() {
    auto head = take<int>(5);
    int T = head[0], H = head[1], dk = head[2], dv = head[3], outputs = head[4];
    if (dk != DK) { fprintf(stderr, "dk %d but DK %d\n", dk, DK); return 2; }
    auto parents = take<int>(T);
    auto keep = take<int>(T);
    auto q = take<float>((size_t)T * H * dk), k = take<float>((size_t)T * H * dk);
    auto v = take<float>((size_t)T * H * dv);
    auto g = take<float>((size_t)T * H), beta = take<float>((size_t)T * H);
    auto state = take<float>((size_t)H * dk * dv);
    std::vector<float> out((size_t)T * H * dv, NAN), scratch((size_t)T * H * dk * dv, NAN),
        last((size_t)H * dk * dv, NAN);
    const unsigned threads = 32;
    blockDim = {threads, 1, 1};
    for (unsigned by = 0; by < (unsigned)H; ++by)
        for (unsigned bx = 0; bx < (dv + threads - 1) / threads; ++bx)
            for (unsigned tx = 0; tx < threads; ++tx) {
                blockIdx = {bx, by, 0};
                threadIdx = {tx, 0, 0};
                gated_delta_tree_f32(q.data(), k.data(), v.data(), g.data(), beta.data(),
                                     state.data(), parents.data(), keep.data(),
                                     outputs ? out.data() : nullptr, scratch.data(), last.data(),
                                     T, H, dv);
            }
    if (outputs) fwrite(out.data(), sizeof(float), out.size(), stdout);
    fwrite(last.data(), sizeof(float), last.size(), stdout);
    return 0;
}
"#;

/// The kernel built for key head dim `dk` in `dir`; its path.
fn build(dir: &std::path::Path, dk: usize) -> std::path::PathBuf {
    let src = dir.join(format!("gated_delta_dk{dk}.cpp"));
    let exe = dir.join(format!("gated_delta_dk{dk}"));
    std::fs::write(&src, format!("{PRELUDE}#define DK {dk}\n{KERNEL}\n{MAIN}")).unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let o = Command::new(&cxx)
        .args(["-O1", "-std=c++17", "-Wno-unknown-pragmas", "-o"])
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
    let mut input = bytes_i32(&[t as i32, h as i32, dk as i32, dv as i32, outputs as i32]);
    input.extend(bytes_i32(
        &parents.iter().map(|&p| p as i32).collect::<Vec<_>>(),
    ));
    input.extend(bytes_i32(
        &kept_states(parents)
            .iter()
            .map(|&b| b as i32)
            .collect::<Vec<_>>(),
    ));
    for a in [x.q, x.k, x.v, x.g, x.beta, state] {
        input.extend(bytes_f32(a));
    }
    let mut child = Command::new(exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let f: Vec<f32> = o
        .stdout
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let n_out = if outputs { t * h * dv } else { 0 };
    assert_eq!(f.len(), n_out + h * dk * dv, "output size");
    let out = outputs.then(|| f[..n_out].to_vec());
    (out, f[n_out..].to_vec())
}

/// Random rule inputs of `t` tokens (q, k l2-normalised, g ≤ 0, β in (0, 1)) and a state.
fn inputs(t: usize, h: usize, dk: usize, dv: usize, seed: u64) -> (Vec<Tensor>, Tensor) {
    let dev = Device::Cpu;
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut rnd = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0
            })
            .collect()
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
            let di = DeltaInputs {
                q: &x[0],
                k: &x[1],
                v: &x[2],
                g: &x[3],
                beta: &x[4],
            };
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
