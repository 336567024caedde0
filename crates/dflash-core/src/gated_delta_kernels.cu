// The gated delta rule over a token tree in one launch (NVRTC; compiled once per key head dim,
// `#define DK n` in front). See gated_delta.rs for the rule and gated_delta_cuda.rs for the launch.
//
// Invariants:
// - Thread (head h, value column j) owns column j of head h's state S [DK, dv] in registers and
//   walks the nodes in order: a node whose parent is the node before it continues from the
//   registers, any other node loads its parent's column (from `state` for a root, from `scratch`
//   for an earlier node the host marked `keep`). Columns of S never interact in the rule
//   (S ← α(I − βkkᵀ)S + βkvᵀ mixes rows only), so threads share nothing: no shared memory, no
//   barriers, no warp shuffles. Each output element is written by exactly one thread.
// - Per node and column, the arithmetic is the host's `step_head` / `read_head` in the same order
//   (decay, then the prediction summed over rows 0..DK, then the write, then the read-out).
// - `out` may be null (a replay that needs only the final state); `scratch` is read and written
//   only for nodes marked `keep`.

#ifndef DK
#define DK 128
#endif

// A load the compiler may not merge with an earlier one of the same address: the key row is read
// again in the second pass over the rows instead of being held in DK more registers (DK 128 with
// it held: 255 registers and spills; the host emulation defines it as a plain read).
#ifndef RELOAD
__device__ __forceinline__ float RELOAD(const float* p) {
    float x;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(x) : "l"(p));
    return x;
}
#endif

extern "C" __global__ void __launch_bounds__(32) gated_delta_tree_f32(
    const float* __restrict__ q,       // [T, H, DK], l2-normalised and scaled
    const float* __restrict__ k,       // [T, H, DK], l2-normalised
    const float* __restrict__ v,       // [T, H, dv]
    const float* __restrict__ g,       // [T, H] log decay
    const float* __restrict__ beta,    // [T, H]
    const float* __restrict__ state,   // [H, DK, dv], the state every root continues from
    const int* __restrict__ parents,   // [T], parents[i] < i, -1 for a root
    const int* __restrict__ keep,      // [T], 1: the node's state is read by a later node != i+1
    float* __restrict__ out,           // [T, H, dv] or null
    float* __restrict__ scratch,       // [T, H, DK, dv] (rows of kept nodes only)
    float* __restrict__ last,          // [H, DK, dv], the state after node T-1
    int T, int H, int dv) {
    const int h = blockIdx.y;
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= dv) return;
    const size_t head = (size_t)DK * dv;
    float s[DK];
    for (int i = 0; i < T; ++i) {
        const int p = parents[i];
        if (p != i - 1 || i == 0) {
            const float* src = p < 0 ? state + (size_t)h * head
                                     : scratch + ((size_t)p * H + h) * head;
#pragma unroll
            for (int r = 0; r < DK; ++r) s[r] = src[(size_t)r * dv + j];
        }
        const size_t th = (size_t)i * H + h;
        const float alpha = expf(g[th]);
        const float* kk = k + th * DK;
        float pred = 0.0f;
#pragma unroll
        for (int r = 0; r < DK; ++r) {
            s[r] *= alpha;
            pred += kk[r] * s[r];
        }
        const float d = beta[th] * (v[th * dv + j] - pred);
        // the write and the read-out in one pass (out null: the write alone)
        const float* qq = q + th * DK;
        float o = 0.0f;
#pragma unroll
        for (int r = 0; r < DK; ++r) {
            s[r] += RELOAD(kk + r) * d;
            if (out) o += qq[r] * s[r];
        }
        if (out) out[th * dv + j] = o;
        if (keep[i]) {
            float* dst = scratch + th * head;
#pragma unroll
            for (int r = 0; r < DK; ++r) dst[(size_t)r * dv + j] = s[r];
        }
    }
    float* dst = last + (size_t)h * head;
#pragma unroll
    for (int r = 0; r < DK; ++r) dst[(size_t)r * dv + j] = s[r];
}
