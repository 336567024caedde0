// The decoding step's layer kernels, compiled in the module of decode_kernels.cu (appended to it:
// decode_ops_cuda.rs's SOURCE), whose helpers they use: an attention layer's fused q/k/v heads
// (normed, rotated, into the cache) and the residual add with the RMSNorm after it.

// qkv_heads_{f32,bf16}: the fused q/k/v projection's rows y [n, (H + 2·KV)·hd] to head-major
// q | k | v = out [H + 2·KV, n, hd]: per-head RMSNorm of q and k when has_norm (Qwen3; f32 math,
// x·rsqrt(mean x² + eps)·w rounded once, as candle's fused rms_norm), then rotate-half RoPE of the
// first `rot` channels of q and k with cos/sin [n, rot/2] (rounded once), v copied. One block per
// (row, head), one thread per channel (blockDim.x = hd ≤ 1024).
// With kb (the device step): out holds q only [H, n − q_from, hd] — rows q_from.. of y (the
// drafter's block rows after its context rows, whose q nothing reads; 0 elsewhere) — and k and v
// go straight into the cache buffers kb / vb [KV, cap, hd] at rows meta[0] + r (meta: the step's
// metadata, step_kernels.cu).
// gated (the hybrids' gated attention): each q head of y is followed by its hd gate channels
// (rows [H · 2hd | KV · hd | KV · hd]; the gates are left in y), and the norm weights are WT
// (f32: the zero-centred norms' 1 + w). Otherwise rows are [(H + 2·KV) · hd], as before.
template <typename T, typename WT>
__device__ void qkv_heads(const T* y, const T* cos_t, const T* sin_t, const WT* qw, const WT* kw,
                          int n, int H, int KV, int hd, int rot, int has_norm, float eps, T* out,
                          T* kb, T* vb, const unsigned int* meta, int cap, int gated,
                          int q_from) {
  extern __shared__ float sh[];  // hd values + 32 partial sums
  const int r = blockIdx.x, h = blockIdx.y, c = threadIdx.x;
  if (h < H && r < q_from) return;  // a q row nothing reads (uniform in the block)
  const long long qs = gated ? 2LL * hd : (long long)hd;  // a q head's width in y
  const long long row = qs * H + 2LL * KV * hd;
  const long long at = h < H ? qs * h : qs * H + (long long)(h - H) * hd;
  float v = ldv(y, (long long)r * row + at + c);
  const bool is_v = h >= H + KV;
  if (!is_v && has_norm) {
    float sq = v * v;
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    if ((c & 31) == 0) sh[hd + (c >> 5)] = sq;
    __syncthreads();
    if (c == 0) {
      float s = 0.0f;
      for (int w = 0; w < (hd + 31) / 32; ++w) s += sh[hd + w];
      sh[hd] = s;
    }
    __syncthreads();
    const float inv = rsqrtf(sh[hd] / hd + eps);
    const WT* w = h < H ? qw : kw;
    T tmp[1];
    stv(tmp, 0, v * inv * ldv(w, c));
    v = ldv(tmp, 0);
    __syncthreads();
  }
  if (!is_v) {  // uniform in the block: every thread reaches the barrier
    if (c < rot) sh[c] = v;
    __syncthreads();
    if (c < rot) {
      const int half = rot / 2;
      const int j = c < half ? c : c - half;
      const float cs = ldv(cos_t, (long long)r * half + j);
      const float sn = ldv(sin_t, (long long)r * half + j);
      v = c < half ? v * cs - sh[c + half] * sn : v * cs + sh[c - half] * sn;
    }
  }
  if (kb != nullptr && h >= H) {
    const long long g = (h - H) % KV;
    stv(h < H + KV ? kb : vb, (g * cap + meta[0] + r) * hd + c, v);
  } else {
    stv(out, ((long long)h * (n - q_from) + r - q_from) * hd + c, v);
  }
}

extern "C" __global__ void qkv_heads_f32(const float* y, const float* cs, const float* sn,
                                         const float* qw, const float* kw, int n, int H, int KV,
                                         int hd, int rot, int has_norm, float eps, float* out) {
  PDL_ENTRY();
  qkv_heads(y, cs, sn, qw, kw, n, H, KV, hd, rot, has_norm, eps, out, (float*)nullptr,
            (float*)nullptr, nullptr, 0, 0, 0);
}

extern "C" __global__ void qkv_heads_bf16(const bf16_t* y, const bf16_t* cs, const bf16_t* sn,
                                          const bf16_t* qw, const bf16_t* kw, int n, int H, int KV,
                                          int hd, int rot, int has_norm, float eps, bf16_t* out) {
  PDL_ENTRY();
  qkv_heads(y, cs, sn, qw, kw, n, H, KV, hd, rot, has_norm, eps, out, (bf16_t*)nullptr,
            (bf16_t*)nullptr, nullptr, 0, 0, 0);
}

extern "C" __global__ void qkv_heads_cache_f32(const float* y, const float* cs, const float* sn,
                                               const float* qw, const float* kw, int n, int H,
                                               int KV, int hd, int rot, int has_norm, float eps,
                                               float* q, float* kb, float* vb,
                                               const unsigned int* meta, int cap,
                                               int q_from) {
  PDL_ENTRY();
  qkv_heads(y, cs, sn, qw, kw, n, H, KV, hd, rot, has_norm, eps, q, kb, vb, meta, cap, 0, q_from);
}

extern "C" __global__ void qkv_heads_cache_bf16(const bf16_t* y, const bf16_t* cs,
                                                const bf16_t* sn, const bf16_t* qw,
                                                const bf16_t* kw, int n, int H, int KV, int hd,
                                                int rot, int has_norm, float eps, bf16_t* q,
                                                bf16_t* kb, bf16_t* vb, const unsigned int* meta,
                                                int cap, int q_from) {
  PDL_ENTRY();
  qkv_heads(y, cs, sn, qw, kw, n, H, KV, hd, rot, has_norm, eps, q, kb, vb, meta, cap, 0, q_from);
}

// The hybrids' gated attention in the device step: q (normed, rotated) out, k and v into the
// cache, the gates left in y (see qkv_heads' `gated`); f32 norm weights.
extern "C" __global__ void gated_qkv_heads_cache_f32(const float* y, const float* cs,
                                                     const float* sn, const float* qw,
                                                     const float* kw, int n, int H, int KV, int hd,
                                                     int rot, int has_norm, float eps, float* q,
                                                     float* kb, float* vb,
                                                     const unsigned int* meta, int cap,
                                                     int q_from) {
  PDL_ENTRY();
  qkv_heads(y, cs, sn, qw, kw, n, H, KV, hd, rot, has_norm, eps, q, kb, vb, meta, cap, 1, q_from);
}

extern "C" __global__ void gated_qkv_heads_cache_bf16(const bf16_t* y, const bf16_t* cs,
                                                      const bf16_t* sn, const float* qw,
                                                      const float* kw, int n, int H, int KV,
                                                      int hd, int rot, int has_norm, float eps,
                                                      bf16_t* q, bf16_t* kb, bf16_t* vb,
                                                      const unsigned int* meta, int cap,
                                                     int q_from) {
  PDL_ENTRY();
  qkv_heads(y, cs, sn, qw, kw, n, H, KV, hd, rot, has_norm, eps, q, kb, vb, meta, cap, 1, q_from);
}

// add_rms_norm_{f32,bf16}: s = x + d (rounded to the dtype, as candle's add) and rms_norm(s)·w
// (f32 math, rounded once), for rows of width W: out = [s ; normed], each [rows, W]. One block per
// row. add_rms_norm_into_*: the same with normed written to its own rows `nrm` (the drafter's
// device step: its block rows' next input, right after the context rows of the q/k/v GEMM's
// input, so that no layer concatenates them). add_rms_norm_bf16_wf32: the same with an f32 weight (the hybrids' zero-centred norms keep
// 1 + w in f32, as transformers computes them). A thread keeps its ≤ AN_PER elements (i = tid,
// tid + blockDim, …) in registers, their loads all in flight at once; wider rows loop over memory.
// Either way a thread sums its squares in that order and the block reduces them alike: one result
// whatever the path (the register path replaced a store-then-reload per element, ~8 dependent
// L2 round trips: 6.1 µs a call at Qwen3-8B's 4096 on an H100, session 24).
#define AN_PER 8
__device__ __forceinline__ float rounded(const float*, float v) { return v; }
__device__ __forceinline__ float rounded(const bf16_t*, float v) {
  unsigned int u = __float_as_uint(v);
  u += 0x7fffu + ((u >> 16) & 1u);  // stv's rounding
  return __uint_as_float(u & 0xffff0000u);
}
template <typename T, typename Wt>
__device__ void add_rms_norm(const T* x, const T* d, const Wt* w, int rows, int W, float eps,
                             T* out, T* nrm) {
  __shared__ float red[32];
  const int r = blockIdx.x, bd = blockDim.x;
  const long long off = (long long)r * W;
  float sq = 0.0f;
  if (W <= AN_PER * bd) {
    float sv[AN_PER], wv[AN_PER];
#pragma unroll
    for (int k = 0; k < AN_PER; ++k) {
      const int i = threadIdx.x + k * bd;
      sv[k] = wv[k] = 0.0f;
      if (i < W) {
        sv[k] = ldv(x, off + i) + ldv(d, off + i);
        wv[k] = ldv(w, i);
      }
    }
#pragma unroll
    for (int k = 0; k < AN_PER; ++k) {
      const int i = threadIdx.x + k * bd;
      if (i < W) {
        stv(out, off + i, sv[k]);
        sv[k] = rounded(out, sv[k]);
        sq += sv[k] * sv[k];
      }
    }
    const float inv = rsqrtf(block_sum(sq, red) / W + eps);
#pragma unroll
    for (int k = 0; k < AN_PER; ++k) {
      const int i = threadIdx.x + k * bd;
      if (i < W) stv(nrm, off + i, sv[k] * inv * wv[k]);
    }
    return;
  }
  for (int i = threadIdx.x; i < W; i += bd) {
    stv(out, off + i, ldv(x, off + i) + ldv(d, off + i));
    const float s = ldv(out, off + i);
    sq += s * s;
  }
  const float inv = rsqrtf(block_sum(sq, red) / W + eps);
  for (int i = threadIdx.x; i < W; i += bd)
    stv(nrm, off + i, ldv(out, off + i) * inv * ldv(w, i));
}

extern "C" __global__ void add_rms_norm_f32(const float* x, const float* d, const float* w,
                                            int rows, int W, float eps, float* out) {
  PDL_ENTRY();
  add_rms_norm(x, d, w, rows, W, eps, out, out + (long long)rows * W);
}

extern "C" __global__ void add_rms_norm_bf16(const bf16_t* x, const bf16_t* d, const bf16_t* w,
                                             int rows, int W, float eps, bf16_t* out) {
  PDL_ENTRY();
  add_rms_norm(x, d, w, rows, W, eps, out, out + (long long)rows * W);
}

extern "C" __global__ void add_rms_norm_bf16_wf32(const bf16_t* x, const bf16_t* d, const float* w,
                                                  int rows, int W, float eps, bf16_t* out) {
  PDL_ENTRY();
  add_rms_norm(x, d, w, rows, W, eps, out, out + (long long)rows * W);
}

extern "C" __global__ void add_rms_norm_into_f32(const float* x, const float* d, const float* w,
                                                 int rows, int W, float eps, float* out,
                                                 float* nrm) {
  PDL_ENTRY();
  add_rms_norm(x, d, w, rows, W, eps, out, nrm);
}

extern "C" __global__ void add_rms_norm_into_bf16(const bf16_t* x, const bf16_t* d,
                                                  const bf16_t* w, int rows, int W, float eps,
                                                  bf16_t* out, bf16_t* nrm) {
  PDL_ENTRY();
  add_rms_norm(x, d, w, rows, W, eps, out, nrm);
}
