// The Gated DeltaNet layer kernels around the rule, compiled in the module of
// gated_delta_kernels.cu (appended to it: gated_delta_cuda.rs's SOURCE, and the CPU emulation's
// build in tests/gated_delta_kernel_emulated.rs).

// ---------------------------------------------------------------------------------------------
// The Gated DeltaNet layer around the rule (gated_delta_ops.rs), the host composite of
// gated_deltanet.rs as three kernels, a thread per output element or per (token, head) — again
// threads that share nothing. `_f32` / `_bf16`: the compute dtype of the projections' outputs
// (everything is computed in f32; bf16 values are widened exactly and rounded to nearest even).

typedef unsigned short bf16_t;
__device__ __forceinline__ float gd_ld(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float gd_ld(const bf16_t* p, size_t i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void gd_st(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void gd_st(bf16_t* p, size_t i, float v) {
    unsigned int u = __float_as_uint(v);
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (finite values)
    p[i] = (bf16_t)(u >> 16);
}
__device__ __forceinline__ float gd_silu(float x) { return x / (1.0f + expf(-x)); }

// Causal depthwise convolution along each token's ancestors, then SiLU. Thread (token i,
// channel c): window row j (oldest first, K rows) is the input of the ancestor K-1-j steps up
// (`qkv`), or, past the tree's root, a row of the convolution state (its newest row first).
// Writes u [n, C] = silu(Σ_j w[c, j] · window_j) and the f32 inputs [n, C] (the record's).
// `gdn_conv_one` is the per-channel code, shared with the fused kernel below (rows of `qkv`
// `ld` elements apart), so both give the same bits.
template <typename T>
__device__ __forceinline__ float gdn_conv_one(const T* qkv, size_t ld, const float* conv_state,
                                              const float* w, const int* parents, int C, int K,
                                              int i, int c) {
    float win[8];
    int node = i, back = 0;
    for (int j = K - 1; j >= 0; --j) {
        if (node >= 0) {
            win[j] = gd_ld(qkv, (size_t)node * ld + c);
            node = parents[node];
        } else {
            ++back;
            win[j] = conv_state[(size_t)(K - 1 - back) * C + c];
        }
    }
    float acc = win[0] * w[(size_t)c * K];
    for (int j = 1; j < K; ++j) acc = acc + win[j] * w[(size_t)c * K + j];
    return gd_silu(acc);
}
template <typename T>
__device__ void gdn_conv_silu(const T* qkv, const float* conv_state, const float* w,
                              const int* parents, int n, int C, int K, float* u, float* qkv32) {
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)n * C) return;
    const int i = (int)(idx / C), c = (int)(idx % C);
    u[idx] = gdn_conv_one(qkv, (size_t)C, conv_state, w, parents, C, K, i, c);
    qkv32[idx] = gd_ld(qkv, idx);
}
extern "C" __global__ void gdn_conv_silu_f32(const float* qkv, const float* conv_state,
                                             const float* w, const int* parents, int n, int C,
                                             int K, float* u, float* qkv32) {
    gdn_conv_silu(qkv, conv_state, w, parents, n, C, K, u, qkv32);
}
extern "C" __global__ void gdn_conv_silu_bf16(const bf16_t* qkv, const float* conv_state,
                                              const float* w, const int* parents, int n, int C,
                                              int K, float* u, float* qkv32) {
    gdn_conv_silu(qkv, conv_state, w, parents, n, C, K, u, qkv32);
}

// The rule's inputs from the convolved u [n, C] (C = 2·Hk·DK + Hv·dv) and the gate projections
// b, a [n, Hv]. Thread (token i, value head h, element e < E = max(DK, dv)) reads key head
// h / (Hv / Hk): q and k l2-normalised (x / sqrt(Σx² + 1e-6), the sums over the head's DK rows in
// order, each thread of the head summing the same values in the same order), q times DK^-½; v
// copied; for e = 0, β = sigmoid(b) and g = softplus(a + dt_bias[h]) · neg_a[h] with
// softplus(x) = max(x, 0) + log(e^{-|x|} + 1). One thread per output element: the head's reads
// are broadcasts, the writes coalesced (a thread per (token, head) walking the head measured
// 43 µs a launch on an H100, session 21).
template <typename T>
__device__ void gdn_rule_inputs(const float* u, const T* b, const T* a, const float* dt_bias,
                                const float* neg_a, int n, int Hk, int Hv, int dv, float* q,
                                float* k, float* v, float* g, float* beta) {
    const int E = DK > dv ? DK : dv;
    const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (size_t)n * Hv * E) return;
    const size_t idx = t / E;
    const int e = (int)(t % E);
    const int i = (int)(idx / Hv), h = (int)(idx % Hv);
    const int kh = h / (Hv / Hk);
    const size_t C = (size_t)2 * Hk * DK + (size_t)Hv * dv;
    const float* row = u + (size_t)i * C;
    if (e < DK) {
        const float* uq = row + (size_t)kh * DK;
        const float* uk = row + (size_t)Hk * DK + (size_t)kh * DK;
        float sq = 0.0f, sk = 0.0f;
        for (int r = 0; r < DK; ++r) {
            sq += uq[r] * uq[r];
            sk += uk[r] * uk[r];
        }
        const float iq = 1.0f / sqrtf(sq + 1e-6f), ik = 1.0f / sqrtf(sk + 1e-6f);
        const float scale = 1.0f / sqrtf((float)DK);
        q[idx * DK + e] = uq[e] * iq * scale;
        k[idx * DK + e] = uk[e] * ik;
    }
    if (e < dv) v[idx * dv + e] = row[(size_t)2 * Hk * DK + (size_t)h * dv + e];
    if (e == 0) {
        beta[idx] = 1.0f / (1.0f + expf(-gd_ld(b, idx)));
        const float x = gd_ld(a, idx) + dt_bias[h];
        const float softplus = fmaxf(x, 0.0f) + logf(expf(-fabsf(x)) + 1.0f);
        g[idx] = softplus * neg_a[h];
    }
}
extern "C" __global__ void gdn_rule_inputs_f32(const float* u, const float* b, const float* a,
                                               const float* dt_bias, const float* neg_a, int n,
                                               int Hk, int Hv, int dv, float* q, float* k,
                                               float* v, float* g, float* beta) {
    gdn_rule_inputs(u, b, a, dt_bias, neg_a, n, Hk, Hv, dv, q, k, v, g, beta);
}
extern "C" __global__ void gdn_rule_inputs_bf16(const float* u, const bf16_t* b, const bf16_t* a,
                                                const float* dt_bias, const float* neg_a, int n,
                                                int Hk, int Hv, int dv, float* q, float* k,
                                                float* v, float* g, float* beta) {
    gdn_rule_inputs(u, b, a, dt_bias, neg_a, n, Hk, Hv, dv, q, k, v, g, beta);
}

// The convolution and the rule's inputs in one launch (`gdn_conv_silu` then `gdn_rule_inputs`
// without `u` between them; `DFLASH_GDN_FUSED_INPUTS=0` keeps the two): block (token i, value
// head h), thread e < E = max(DK, dv). Phase one: thread e convolves the channels it owns — q's
// and k's channel e of key head kh = h / (Hv / Hk) (e < DK) into shared rows, v's channel e of
// head h (e < dv) into `v` — with `gdn_conv_one`, and writes the record's f32 inputs of its
// channels (q's and k's by the key head's first value head only: one writer an element). Phase
// two, after a barrier: `gdn_rule_inputs`'s arithmetic on the shared rows (the sums of squares
// over the head's DK rows in order, each thread the same), so every output has the two kernels'
// bits. Rows of `qkv` are `ld` elements apart and rows of `b` and `a` `gld` (column views of one
// stacked projection, no copies). The phases are functions of their own so that the host
// emulation can run every thread of a block through phase one before phase two.
template <typename T>
__device__ __forceinline__ void gdn_fused_conv_phase(const T* qkv, int ld, const float* conv_state,
                                                     const float* w, const int* parents, int K,
                                                     int Hk, int Hv, int dv, float* qkv32,
                                                     float* v, float* xq, float* xk) {
    const int idx = blockIdx.x, e = threadIdx.x;
    const int i = idx / Hv, h = idx % Hv, kh = h / (Hv / Hk);
    const int C = 2 * Hk * DK + Hv * dv;
    const size_t rec = (size_t)i * C, in = (size_t)i * ld;
    if (e < DK) {
        const int cq = kh * DK + e, ck = Hk * DK + kh * DK + e;
        xq[e] = gdn_conv_one(qkv, (size_t)ld, conv_state, w, parents, C, K, i, cq);
        xk[e] = gdn_conv_one(qkv, (size_t)ld, conv_state, w, parents, C, K, i, ck);
        if (h % (Hv / Hk) == 0) {
            qkv32[rec + cq] = gd_ld(qkv, in + cq);
            qkv32[rec + ck] = gd_ld(qkv, in + ck);
        }
    }
    if (e < dv) {
        const int cv = 2 * Hk * DK + h * dv + e;
        v[(size_t)idx * dv + e] = gdn_conv_one(qkv, (size_t)ld, conv_state, w, parents, C, K, i, cv);
        qkv32[rec + cv] = gd_ld(qkv, in + cv);
    }
}
template <typename T>
__device__ __forceinline__ void gdn_fused_inputs_phase(const T* b, const T* a, int gld,
                                                       const float* dt_bias, const float* neg_a,
                                                       int Hv, const float* xq, const float* xk,
                                                       float* q, float* k, float* g, float* beta) {
    const int idx = blockIdx.x, e = threadIdx.x;
    const int i = idx / Hv, h = idx % Hv;
    if (e < DK) {
        float sq = 0.0f, sk = 0.0f;
        for (int r = 0; r < DK; ++r) {
            sq += xq[r] * xq[r];
            sk += xk[r] * xk[r];
        }
        const float iq = 1.0f / sqrtf(sq + 1e-6f), ik = 1.0f / sqrtf(sk + 1e-6f);
        const float scale = 1.0f / sqrtf((float)DK);
        q[(size_t)idx * DK + e] = xq[e] * iq * scale;
        k[(size_t)idx * DK + e] = xk[e] * ik;
    }
    if (e == 0) {
        const size_t gi = (size_t)i * gld + h;
        beta[idx] = 1.0f / (1.0f + expf(-gd_ld(b, gi)));
        const float x = gd_ld(a, gi) + dt_bias[h];
        const float softplus = fmaxf(x, 0.0f) + logf(expf(-fabsf(x)) + 1.0f);
        g[idx] = softplus * neg_a[h];
    }
}
template <typename T>
__device__ void gdn_conv_rule_inputs(const T* qkv, int ld, const float* conv_state, const float* w,
                                     const int* parents, int K, const T* b, const T* a, int gld,
                                     const float* dt_bias, const float* neg_a, int Hk, int Hv,
                                     int dv, float* qkv32, float* q, float* k, float* v, float* g,
                                     float* beta) {
    __shared__ float xs[2 * DK];
    gdn_fused_conv_phase(qkv, ld, conv_state, w, parents, K, Hk, Hv, dv, qkv32, v, xs, xs + DK);
    __syncthreads();
    gdn_fused_inputs_phase(b, a, gld, dt_bias, neg_a, Hv, xs, xs + DK, q, k, g, beta);
}
extern "C" __global__ void gdn_conv_rule_inputs_f32(
    const float* qkv, int ld, const float* conv_state, const float* w, const int* parents, int K,
    const float* b, const float* a, int gld, const float* dt_bias, const float* neg_a, int Hk,
    int Hv, int dv, float* qkv32, float* q, float* k, float* v, float* g, float* beta) {
    gdn_conv_rule_inputs(qkv, ld, conv_state, w, parents, K, b, a, gld, dt_bias, neg_a, Hk, Hv, dv,
                         qkv32, q, k, v, g, beta);
}
extern "C" __global__ void gdn_conv_rule_inputs_bf16(
    const bf16_t* qkv, int ld, const float* conv_state, const float* w, const int* parents, int K,
    const bf16_t* b, const bf16_t* a, int gld, const float* dt_bias, const float* neg_a, int Hk,
    int Hv, int dv, float* qkv32, float* q, float* k, float* v, float* g, float* beta) {
    gdn_conv_rule_inputs(qkv, ld, conv_state, w, parents, K, b, a, gld, dt_bias, neg_a, Hk, Hv, dv,
                         qkv32, q, k, v, g, beta);
}

// The gated RMSNorm per value head (rows of z `zld` elements apart): thread (token i, head h, channel c) gives
// y[i, h·dv + c] = o[i, h, c] / sqrt(mean_c o² + eps) · w[c] · silu(z[i, h·dv + c]), in T (the
// head's sum of squares in channel order, the same in every thread of the head: one thread per
// output element, broadcast reads, coalesced writes).
template <typename T>
__device__ void gdn_gated_norm(const float* o, const T* z, int zld, const float* w, int n, int Hv,
                               int dv, float eps, T* y) {
    const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (size_t)n * Hv * dv) return;
    const size_t idx = t / dv;
    const int c = (int)(t % dv);
    const float* oh = o + idx * dv;
    float ss = 0.0f;
    for (int r = 0; r < dv; ++r) ss += oh[r] * oh[r];
    const float inv = 1.0f / sqrtf(ss / (float)dv + eps);
    const size_t zi = (idx / Hv) * (size_t)zld + (idx % Hv) * (size_t)dv + c;
    gd_st(y, t, oh[c] * inv * w[c] * gd_silu(gd_ld(z, zi)));
}
extern "C" __global__ void gdn_gated_norm_f32(const float* o, const float* z, int zld,
                                              const float* w, int n, int Hv, int dv, float eps,
                                              float* y) {
    gdn_gated_norm(o, z, zld, w, n, Hv, dv, eps, y);
}
extern "C" __global__ void gdn_gated_norm_bf16(const float* o, const bf16_t* z, int zld,
                                               const float* w, int n, int Hv, int dv, float eps,
                                               bf16_t* y) {
    gdn_gated_norm(o, z, zld, w, n, Hv, dv, eps, y);
}

// The convolution windows after n kept tokens, for L layers at once (the state commit's other
// half): thread (channel c) of layer blockIdx.y writes rows r = 0..W-1 of the window, row n + r of
// [start; conv_in] — the last W = K − 1 rows of the window the kept tokens leave. `ptrs` [L][3]
// holds each layer's start [W, C], conv_in [≥ n, C] and out [W, C] (f32). `out` may be `start`
// (the hybrid device step commits in place): a thread reads row n + r ≥ r of its own channel
// before it writes row r, and no other thread touches the channel.
__device__ __forceinline__ void gdn_conv_window_layer(const unsigned long long* p, int n, int W,
                                                      int C) {
    const size_t c = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= (size_t)C) return;
    const float* start = (const float*)p[0];
    const float* conv_in = (const float*)p[1];
    float* out = (float*)p[2];
    for (int r = 0; r < W; ++r) {
        const int row = n + r;
        const float x = row < W ? start[(size_t)row * C + c] : conv_in[(size_t)(row - W) * C + c];
        out[(size_t)r * C + c] = x;
    }
}
extern "C" __global__ void gdn_conv_window_layers(const unsigned long long* __restrict__ ptrs,
                                                  int n, int W, int C) {
    gdn_conv_window_layer(ptrs + (size_t)blockIdx.y * 3, n, W, C);
}
// The same with n read from the device (`count`: the hybrid device step's folded commit, in its
// graph, before any layer's convolution reads the window or overwrites the record; 0: nothing).
extern "C" __global__ void gdn_conv_window_layers_pending(
    const unsigned long long* __restrict__ ptrs, const int* __restrict__ count, int W, int C) {
    const int n = *count;
    if (n > 0) gdn_conv_window_layer(ptrs + (size_t)blockIdx.y * 3, n, W, C);
}

// The folded commit's other half of the prologue: rows 0..n (n = *count, at most the
// destination's rows) of each record buffer copied aside before the step's layers overwrite
// them. `bufs` [B][3]: source, destination, row width in floats. Block (buffer, channel chunk),
// a thread per channel.
extern "C" __global__ void gdn_record_pending_rows(const unsigned long long* __restrict__ bufs,
                                                   const int* __restrict__ count) {
    const unsigned long long* b = bufs + 3 * (size_t)blockIdx.x;
    const float* src = (const float*)b[0];
    float* dst = (float*)b[1];
    const size_t d = (size_t)b[2];
    const size_t c = (size_t)blockIdx.y * blockDim.x + threadIdx.x;
    const int n = *count;
    if (c >= d) return;
    for (int i = 0; i < n; ++i) dst[(size_t)i * d + c] = src[(size_t)i * d + c];
}

// The path compaction of the hybrids' device-step records after a tree verify, every recurrent
// layer at once (the accepted root path's rows gathered to rows 0..m in place, so the state
// commit replays rows 0..m through its fixed tables). `bufs` [B][2]: each record buffer's
// address and its row width in floats; rows rows[i] move to row i for i ascending (rows strictly
// increasing, so rows[i] ≥ i: a thread reads a row of its channel before it overwrites it, and no
// other thread touches the channel). Block (buffer, channel chunk), a thread per channel.
extern "C" __global__ void gdn_record_keep_rows(const unsigned long long* __restrict__ bufs,
                                                const unsigned int* __restrict__ rows, int m) {
    float* b = (float*)bufs[2 * (size_t)blockIdx.x];
    const size_t d = (size_t)bufs[2 * (size_t)blockIdx.x + 1];
    const size_t c = (size_t)blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= d) return;
    for (int i = 0; i < m; ++i) {
        const unsigned int src = rows[i];
        if (src != (unsigned int)i) b[(size_t)i * d + c] = b[(size_t)src * d + c];
    }
}

// The value product of the hybrids' gated attention over a long cache, o = p·v per kv head, split
// over key chunks (cuBLAS ran the one (rows × keys)·(keys × d) product per kv head on 32 blocks: 70 µs
// a layer at Qwen3.6-27B's 4 kv heads × 2100 keys × 256 channels). Phase one, block (chunk s, kv
// head h, tile of AV_ROWS rows), a thread per channel: the chunk's probabilities staged in shared
// memory, each thread sums p[r, j]·v[j, c] over the chunk's keys in key order (f32) into
// part[h, s, r, c]. Phase two: each output element adds its chunks' partials in chunk order and
// is rounded once. A fixed order whatever the row count, so a row's output does not depend on the
// rows beside it. (Phase one's threads share the staged probabilities, so the host emulation of
// this file does not run it; the GPU test `attention_over_a_buffer_matches_attention` does.)
#define AV_ROWS 8
#define AV_KEYS 64
template <typename T>
__device__ void gdn_attn_values_part(const T* p, const T* v, int m, int cap, int d, float* part) {
    __shared__ float sp[AV_ROWS][AV_KEYS];
    const int s = blockIdx.x, h = blockIdx.y, r0 = blockIdx.z * AV_ROWS;
    const int j0 = s * AV_KEYS, nj = cap - j0 < AV_KEYS ? cap - j0 : AV_KEYS;
    const int nr = m - r0 < AV_ROWS ? m - r0 : AV_ROWS;
    for (int e = threadIdx.x; e < AV_ROWS * AV_KEYS; e += blockDim.x) {
        const int r = e / AV_KEYS, j = e % AV_KEYS;
        sp[r][j] = (r < nr && j < nj) ? gd_ld(p, ((size_t)h * m + r0 + r) * cap + j0 + j) : 0.0f;
    }
    __syncthreads();
    const int S = gridDim.x;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc[AV_ROWS];
#pragma unroll
        for (int r = 0; r < AV_ROWS; ++r) acc[r] = 0.0f;
        const T* vc = v + ((size_t)h * cap + j0) * d + c;
        for (int j = 0; j < nj; ++j) {
            const float x = gd_ld(vc, (size_t)j * d);
#pragma unroll
            for (int r = 0; r < AV_ROWS; ++r) acc[r] = fmaf(sp[r][j], x, acc[r]);
        }
        for (int r = 0; r < nr; ++r) part[(((size_t)h * S + s) * m + r0 + r) * d + c] = acc[r];
    }
}
extern "C" __global__ void gdn_attn_values_part_f32(const float* p, const float* v, int m, int cap,
                                                    int d, float* part) {
    gdn_attn_values_part(p, v, m, cap, d, part);
}
extern "C" __global__ void gdn_attn_values_part_bf16(const bf16_t* p, const bf16_t* v, int m,
                                                     int cap, int d, float* part) {
    gdn_attn_values_part(p, v, m, cap, d, part);
}
template <typename T>
__device__ void gdn_attn_values_sum(const float* part, int kv, int S, int m, int d, T* out) {
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)kv * m * d) return;
    const size_t h = idx / ((size_t)m * d), rc = idx % ((size_t)m * d);
    const float* src = part + h * S * m * d + rc;
    float acc = src[0];
    for (int s = 1; s < S; ++s) acc += src[(size_t)s * m * d];
    gd_st(out, idx, acc);
}
extern "C" __global__ void gdn_attn_values_sum_f32(const float* part, int kv, int S, int m, int d,
                                                   float* out) {
    gdn_attn_values_sum(part, kv, S, m, d, out);
}
extern "C" __global__ void gdn_attn_values_sum_bf16(const float* part, int kv, int S, int m, int d,
                                                    bf16_t* out) {
    gdn_attn_values_sum(part, kv, S, m, d, out);
}
