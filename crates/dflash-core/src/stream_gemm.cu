// The weight-streaming GEMM of decode steps (compiled at run time by NVRTC for compute_80+):
// y[M, N] = x[M, K] · w[N, K]ᵀ for few rows, bf16 inputs, f32 accumulation on the tensor cores
// (mma.sync m16n8k16), output rounded once to bf16 or kept in f32 (logits).
//
// Layout: a block owns 16 output columns n (a 16-row tile of w) and up to 16 rows of x (grid.y
// counts the 16-row groups: a wider call reads each w tile once per group, from L2 after the
// first); its KW warps
// split K into 64-wide chunks (warp j takes chunks j, j + KW, ...), each lane loading 16 bytes of
// two w rows and of its x row per half chunk, straight into mma fragments (A = the w tile, B = xᵀ;
// the k order inside an mma is permuted the same way for A and B, which leaves every dot product
// unchanged). The warps' partial sums meet in shared memory and are added in warp order.
// The _silu kernels take x = [gate | up] rows of width 2·K (the fused gate-up projection) and feed
// the product bf16(silu(gate) · up) — f32 math rounded once, as decode_kernels.cu's silu_mul — so
// the MLP's down projection needs no separate activation kernel.
//
// Invariant (what issue 18 needs): the arithmetic of an output element y[m, n] depends only on
// x[m, :], w[n, :], K and KW — never on M or on which mma column the row occupies (tensor-core dot
// products are per element), so a row's result is bit-identical whether it is computed alone or
// among any number of rows. KW is chosen from N and K alone. Needs K % 64 == 0.
typedef unsigned short bf16_t;
// PDL_ENTRY(): pdl.cuh, prepended at compile time (crate::pdl::with_prelude)
#define SG_MAX_KW 8
#ifndef SG_STAGES
#define SG_STAGES 2  // 1, 2, 4, 8 measured: 2 is best or within 3 % at every decode shape
#endif

__device__ __forceinline__ void sg_store(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void sg_store(bf16_t* p, long long i, float v) {
  unsigned int u = __float_as_uint(v);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (finite values)
  p[i] = (bf16_t)(u >> 16);
}

__device__ __forceinline__ void sg_mma(float* d, unsigned int a0, unsigned int a1, unsigned int a2,
                                       unsigned int a3, unsigned int b0, unsigned int b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 sg_load(const bf16_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// One 64-wide chunk's operands for a lane: w rows g and g + 8 (two 16-byte halves each) and x row
// 8·t + g of each of the MT row tiles.
template <int MT>
struct SgChunk {
  uint4 w0[2], w1[2];
  uint4 x[MT][2];
};

__device__ __forceinline__ float sg_lo(unsigned int u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float sg_hi(unsigned int u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ unsigned int sg_round(float v) {
  unsigned int u = __float_as_uint(v);
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}
__device__ __forceinline__ unsigned int sg_silu2(unsigned int g, unsigned int u) {
  const float g0 = sg_lo(g), g1 = sg_hi(g);
  const float a = g0 / (1.0f + expf(-g0)) * sg_lo(u);
  const float b = g1 / (1.0f + expf(-g1)) * sg_hi(u);
  return sg_round(a) | (sg_round(b) << 16);
}
// 8 activations bf16(silu(g) · u) from 8 gates at p and 8 ups at p + K
__device__ __forceinline__ uint4 sg_silu8(const bf16_t* p, int K) {
  const uint4 g = *(const uint4*)p, u = *(const uint4*)(p + K);
  return make_uint4(sg_silu2(g.x, u.x), sg_silu2(g.y, u.y), sg_silu2(g.z, u.z),
                    sg_silu2(g.w, u.w));
}

// 8 normed inputs bf16(bf16(x + d) · inv · w) from 8 of x at px, of d at pd and of the norm
// weight at pw — the values decode_kernels.cu's add_rms_norm writes, given the same inv
__device__ __forceinline__ unsigned int sg_addnorm2(unsigned int x, unsigned int d, unsigned int w,
                                                    float inv) {
  const float s0 = sg_lo(sg_round(sg_lo(x) + sg_lo(d)));  // the bf16 sum, back as a float
  const float s1 = sg_lo(sg_round(sg_hi(x) + sg_hi(d)));
  return sg_round(s0 * inv * sg_lo(w)) | (sg_round(s1 * inv * sg_hi(w)) << 16);
}
__device__ __forceinline__ uint4 sg_addnorm8(const bf16_t* px, const bf16_t* pd, const bf16_t* pw,
                                             float inv) {
  const uint4 x = *(const uint4*)px, d = *(const uint4*)pd, w = *(const uint4*)pw;
  return make_uint4(sg_addnorm2(x.x, d.x, w.x, inv), sg_addnorm2(x.y, d.y, w.y, inv),
                    sg_addnorm2(x.z, d.z, w.z, inv), sg_addnorm2(x.w, d.w, w.w, inv));
}

// What the add+norm prologue hands the fetch: each row tile's d row and 1/rms, and the norm
// weight at the lane's offset (unused by the other modes).
template <int MT>
struct SgNorm {
  const bf16_t* dr[MT];
  float inv[MT];
  const bf16_t* nw;
};

template <int MT, bool ACT, bool NORM>
__device__ __forceinline__ void sg_fetch(SgChunk<MT>& c, const bf16_t* w0, const bf16_t* w1,
                                         const bf16_t* const* xr, const bool* xok, int k, int K,
                                         const SgNorm<MT>& nm) {
  c.w0[0] = sg_load(w0 + k);
  c.w0[1] = sg_load(w0 + k + 32);
  c.w1[0] = sg_load(w1 + k);
  c.w1[1] = sg_load(w1 + k + 32);
  for (int t = 0; t < MT; ++t) {
    if (!xok[t]) {
      c.x[t][0] = make_uint4(0, 0, 0, 0);
      c.x[t][1] = make_uint4(0, 0, 0, 0);
    } else if (ACT) {
      c.x[t][0] = sg_silu8(xr[t] + k, K);
      c.x[t][1] = sg_silu8(xr[t] + k + 32, K);
    } else if (NORM) {
      c.x[t][0] = sg_addnorm8(xr[t] + k, nm.dr[t] + k, nm.nw + k, nm.inv[t]);
      c.x[t][1] = sg_addnorm8(xr[t] + k + 32, nm.dr[t] + k + 32, nm.nw + k + 32, nm.inv[t]);
    } else {
      c.x[t][0] = *(const uint4*)(xr[t] + k);
      c.x[t][1] = *(const uint4*)(xr[t] + k + 32);
    }
  }
}

template <int MT>
__device__ __forceinline__ void sg_compute(float (*acc)[4], const SgChunk<MT>& c) {
  for (int h = 0; h < 2; ++h) {
    for (int t = 0; t < MT; ++t) {
      sg_mma(acc[t], c.w0[h].x, c.w1[h].x, c.w0[h].y, c.w1[h].y, c.x[t][h].x, c.x[t][h].y);
      sg_mma(acc[t], c.w0[h].z, c.w1[h].z, c.w0[h].w, c.w1[h].w, c.x[t][h].z, c.x[t][h].w);
    }
  }
}

// Before the PDL wait (the weights are never written by a step): each warp asks L2 for the first
// lines of its share of the block's weight tile, so that a kernel launched early (PDL) streams its
// first chunks while the kernel before it finishes. Hints only: no value read changes.
__device__ __forceinline__ void sg_prefetch(const bf16_t* w, int N, int K) {
#if defined(DFLASH_PDL) && !defined(DFLASH_NO_PREFETCH)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, kw = blockDim.x >> 5;
  if (blockIdx.y != 0 || (lane & 3) != 0) return;  // one lane per 128-byte line of two w rows
  const int g = lane >> 2, n0 = blockIdx.x * 16;
  const bf16_t* w0 = w + (long long)min(n0 + g, N - 1) * K;
  const bf16_t* w1 = w + (long long)min(n0 + g + 8, N - 1) * K;
  const int chunks = K >> 6;
  for (int c = warp, i = 0; c < chunks && i < 2 * SG_STAGES; c += kw, ++i) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(w0 + (c << 6)));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(w1 + (c << 6)));
  }
#endif
}

// The add+norm prologue (NORM): for each row m of the block's group, inv = 1/rms(bf16(x + d))
// over K — lanes of one warp take 8 contiguous elements each per 256, an fma each, then a fixed
// xor butterfly: the same arithmetic for a row whatever M, the warp or the block — and block
// column 0 writes the sums bf16(x + d) to `sum` (the residual stream the next add reads).
template <int MT>
__device__ void sg_norm_prologue(const bf16_t* x, const bf16_t* d, int M, int K, float eps,
                                 bf16_t* sum, float* inv_s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, kw = blockDim.x >> 5;
  for (int m = warp; m < M; m += kw) {
    const bf16_t* px = x + (long long)m * K;
    const bf16_t* pd = d + (long long)m * K;
    float sq = 0.0f;
    for (int k = lane * 8; k < K; k += 256) {
      const uint4 a = *(const uint4*)(px + k), b = *(const uint4*)(pd + k);
      const unsigned int av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
      unsigned int packed[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const unsigned int lo = sg_round(sg_lo(av[i]) + sg_lo(bv[i]));
        const unsigned int hi = sg_round(sg_hi(av[i]) + sg_hi(bv[i]));
        const float s0 = __uint_as_float(lo << 16), s1 = __uint_as_float(hi << 16);
        sq = fmaf(s0, s0, sq);
        sq = fmaf(s1, s1, sq);
        packed[i] = lo | (hi << 16);
      }
      if (blockIdx.x == 0)
        *(uint4*)(sum + (long long)m * K + k) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    if (lane == 0) inv_s[m] = rsqrtf(sq / (float)K + eps);
  }
  __syncthreads();
}

// A warp's accumulators into its slice of the block's partials part[warp][n][m]: for row tile t,
// d0, d1 are column g, rows 8·t + 2·t4 and + 1 of the tile; d2, d3 column g + 8.
template <int MT>
__device__ __forceinline__ void sg_put_partials(float (*part)[16][16], int warp, int g, int t4,
                                                const float (*acc)[4]) {
  for (int t = 0; t < MT; ++t) {
    const int m = 8 * t + 2 * t4;
    part[warp][g][m] = acc[t][0];
    part[warp][g][m + 1] = acc[t][1];
    part[warp][g + 8][m] = acc[t][2];
    part[warp][g + 8][m + 1] = acc[t][3];
  }
}

// The block's outputs y[m, n0 + n] for its `rows` rows: the kw warps' partials added in warp
// order, rounded once (after a __syncthreads that follows every sg_put_partials).
template <typename O>
__device__ __forceinline__ void sg_sum_store(const float (*part)[16][16], int kw, int rows, int N,
                                             int n0, O* y) {
  for (int e = threadIdx.x; e < 16 * rows; e += blockDim.x) {
    const int m = e >> 4, n = e & 15;
    if (n0 + n >= N) continue;
    float s = part[0][n][m];
    for (int j = 1; j < kw; ++j) s += part[j][n][m];
    sg_store(y, (long long)m * N + n0 + n, s);
  }
}

template <int MT, bool ACT, typename O, bool NORM = false>
__device__ void stream_gemm(const bf16_t* x, const bf16_t* w, int M, int N, int K, O* y,
                            const bf16_t* d = nullptr, const bf16_t* nw = nullptr,
                            float eps = 0.0f, bf16_t* sum = nullptr) {
  // this block's row group
  x += (long long)blockIdx.y * 16 * (ACT ? 2 * K : K);
  y += (long long)blockIdx.y * 16 * N;
  M = min(16, M - 16 * (int)blockIdx.y);
  __shared__ float inv_s[16];
  SgNorm<MT> nm;
  if (NORM) {
    d += (long long)blockIdx.y * 16 * K;
    sum += (long long)blockIdx.y * 16 * K;
    sg_norm_prologue<MT>(x, d, M, K, eps, sum, inv_s);
  }
  __shared__ float part[SG_MAX_KW][16][16];  // [warp][n][m]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, kw = blockDim.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int n0 = blockIdx.x * 16;
  // rows past N read row N - 1 (their outputs are dropped)
  const bf16_t* w0 = w + (long long)min(n0 + g, N - 1) * K + 8 * t4;
  const bf16_t* w1 = w + (long long)min(n0 + g + 8, N - 1) * K + 8 * t4;
  const bf16_t* xr[MT];
  bool xok[MT];
  for (int t = 0; t < MT; ++t) {
    const int m = 8 * t + g;
    xok[t] = m < M;
    xr[t] = x + (long long)(xok[t] ? m : 0) * (ACT ? 2 * K : K) + 8 * t4;
    if (NORM) {
      nm.dr[t] = d + (long long)(xok[t] ? m : 0) * K + 8 * t4;
      nm.inv[t] = xok[t] ? inv_s[m] : 0.0f;
    }
  }
  if (NORM) nm.nw = nw + 8 * t4;
  float acc[MT][4];
  for (int t = 0; t < MT; ++t)
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.0f;
  // SG_STAGES chunks are loaded before any is multiplied (that many 2 KiB loads of a warp in
  // flight); chunks still meet the accumulators in increasing order
  const int chunks = K >> 6;
  for (int c = warp; c < chunks; c += SG_STAGES * kw) {
    SgChunk<MT> buf[SG_STAGES];
#pragma unroll
    for (int st = 0; st < SG_STAGES; ++st)
      if (c + st * kw < chunks)
        sg_fetch<MT, ACT, NORM>(buf[st], w0, w1, xr, xok, (c + st * kw) << 6, K, nm);
#pragma unroll
    for (int st = 0; st < SG_STAGES; ++st)
      if (c + st * kw < chunks) sg_compute<MT>(acc, buf[st]);
  }
  sg_put_partials<MT>(part, warp, g, t4, acc);
  __syncthreads();
  sg_sum_store(part, kw, M, N, n0, y);
}

#ifndef SG_HELPERS_ONLY  // the entries (a module that only borrows the helpers defines it)
extern "C" __global__ void stream_gemm_m8_bf16(const bf16_t* x, const bf16_t* w, int M, int N,
                                               int K, bf16_t* y) {
  sg_prefetch(w, N, K);
  PDL_ENTRY();
  stream_gemm<1, false>(x, w, M, N, K, y);
}
extern "C" __global__ void stream_gemm_m16_bf16(const bf16_t* x, const bf16_t* w, int M, int N,
                                                int K, bf16_t* y) {
  sg_prefetch(w, N, K);
  PDL_ENTRY();
  stream_gemm<2, false>(x, w, M, N, K, y);
}
extern "C" __global__ void stream_gemm_m8_f32out(const bf16_t* x, const bf16_t* w, int M, int N,
                                                 int K, float* y) {
  sg_prefetch(w, N, K);
  PDL_ENTRY();
  stream_gemm<1, false>(x, w, M, N, K, y);
}
extern "C" __global__ void stream_gemm_m16_f32out(const bf16_t* x, const bf16_t* w, int M, int N,
                                                  int K, float* y) {
  sg_prefetch(w, N, K);
  PDL_ENTRY();
  stream_gemm<2, false>(x, w, M, N, K, y);
}
extern "C" __global__ void stream_gemm_silu_m8_bf16(const bf16_t* x, const bf16_t* w, int M,
                                                    int N, int K, bf16_t* y) {
  sg_prefetch(w, N, K);
  PDL_ENTRY();
  stream_gemm<1, true>(x, w, M, N, K, y);
}
extern "C" __global__ void stream_gemm_silu_m16_bf16(const bf16_t* x, const bf16_t* w, int M,
                                                     int N, int K, bf16_t* y) {
  sg_prefetch(w, N, K);
  PDL_ENTRY();
  stream_gemm<2, true>(x, w, M, N, K, y);
}
// x · wᵀ of the normed rows bf16(bf16(x + d) · inv · nw) (an add+norm prologue, see
// sg_norm_prologue), bf16 out; `sum` receives bf16(x + d). Opt-in (DFLASH_FUSED_ADD_NORM=1).
extern "C" __global__ void stream_gemm_addnorm_m8_bf16(const bf16_t* x, const bf16_t* d,
                                                       const bf16_t* nw, float eps,
                                                       const bf16_t* w, int M, int N, int K,
                                                       bf16_t* y, bf16_t* sum) {
  sg_prefetch(w, N, K);
  PDL_ENTRY();
  stream_gemm<1, false, bf16_t, true>(x, w, M, N, K, y, d, nw, eps, sum);
}
extern "C" __global__ void stream_gemm_addnorm_m16_bf16(const bf16_t* x, const bf16_t* d,
                                                        const bf16_t* nw, float eps,
                                                        const bf16_t* w, int M, int N, int K,
                                                        bf16_t* y, bf16_t* sum) {
  sg_prefetch(w, N, K);
  PDL_ENTRY();
  stream_gemm<2, false, bf16_t, true>(x, w, M, N, K, y, d, nw, eps, sum);
}
#endif  // SG_HELPERS_ONLY

// The wide kernel (`DFLASH_STREAM_WIDE=1`; session 27, --bit-exact's default for 17–80 rows): all
// of a call's rows, up to 16·G, in one block per 16 output columns. Each warp loads a chunk's w
// fragments once and multiplies them with every 16-row group's x fragments (read from L2), so the
// weight is read once for the whole call instead of once per 16-row group (the narrow kernel's
// grid.y). Per element it is the narrow kernel's arithmetic — the same warps and chunks
// (KW from N and K alone), the same mma chain per accumulator (half 0 then 1, the .x/.y pair then
// .z/.w), the same warp-order sum and rounding — so a row's bits equal the narrow kernel's, and
// with it the AR step's, at any row count.
template <int G, typename O>
__device__ void stream_gemm_wide(const bf16_t* x, const bf16_t* w, int M, int N, int K, O* y) {
  __shared__ float part[SG_MAX_KW][16][16];  // [warp][n][m] of one row group at a time
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, kw = blockDim.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int n0 = blockIdx.x * 16;
  const bf16_t* w0 = w + (long long)min(n0 + g, N - 1) * K + 8 * t4;
  const bf16_t* w1 = w + (long long)min(n0 + g + 8, N - 1) * K + 8 * t4;
  float acc[G][2][4];
#pragma unroll
  for (int gr = 0; gr < G; ++gr)
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[gr][t][i] = 0.0f;
  const int chunks = K >> 6;
  for (int c = warp; c < chunks; c += 2 * kw) {
    // two chunks' w fragments in flight, then each multiplied in chunk order
    uint4 a0[2][2], a1[2][2];
#pragma unroll
    for (int st = 0; st < 2; ++st) {
      if (c + st * kw >= chunks) continue;
      const int k = (c + st * kw) << 6;
      a0[st][0] = sg_load(w0 + k);
      a0[st][1] = sg_load(w0 + k + 32);
      a1[st][0] = sg_load(w1 + k);
      a1[st][1] = sg_load(w1 + k + 32);
    }
#pragma unroll
    for (int st = 0; st < 2; ++st) {
      if (c + st * kw >= chunks) continue;
      const int k = (c + st * kw) << 6;
#pragma unroll
      for (int gr = 0; gr < G; ++gr) {
        uint4 xv[2][2];
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const int m = 16 * gr + 8 * t + g;
          const bf16_t* xr = x + (long long)(m < M ? m : 0) * K + 8 * t4 + k;
          xv[t][0] = m < M ? *(const uint4*)xr : make_uint4(0, 0, 0, 0);
          xv[t][1] = m < M ? *(const uint4*)(xr + 32) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            sg_mma(acc[gr][t], a0[st][h].x, a1[st][h].x, a0[st][h].y, a1[st][h].y, xv[t][h].x,
                   xv[t][h].y);
            sg_mma(acc[gr][t], a0[st][h].z, a1[st][h].z, a0[st][h].w, a1[st][h].w, xv[t][h].z,
                   xv[t][h].w);
          }
      }
    }
  }
  // each row group's warp partials meet in shared memory and are added in warp order
#pragma unroll
  for (int gr = 0; gr < G; ++gr) {
    if (16 * gr >= M) break;  // the same for every thread of the block
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int m = 8 * t + 2 * t4;
      part[warp][g][m] = acc[gr][t][0];
      part[warp][g][m + 1] = acc[gr][t][1];
      part[warp][g + 8][m] = acc[gr][t][2];
      part[warp][g + 8][m + 1] = acc[gr][t][3];
    }
    __syncthreads();
    const int rows = min(16, M - 16 * gr);
    for (int e = threadIdx.x; e < 16 * rows; e += blockDim.x) {
      const int m = e >> 4, n = e & 15;
      if (n0 + n >= N) continue;
      float s = part[0][n][m];
      for (int j = 1; j < kw; ++j) s += part[j][n][m];
      sg_store(y, (long long)(16 * gr + m) * N + n0 + n, s);
    }
    __syncthreads();
  }
}

#define SG_WIDE(G)                                                                              \
  extern "C" __global__ void stream_gemm_wide_g##G##_bf16(const bf16_t* x, const bf16_t* w,      \
                                                          int M, int N, int K, bf16_t* y) {      \
    sg_prefetch(w, N, K);                                                                       \
    PDL_ENTRY();                                                                                \
    stream_gemm_wide<G>(x, w, M, N, K, y);                                                      \
  }                                                                                             \
  extern "C" __global__ void stream_gemm_wide_g##G##_f32out(const bf16_t* x, const bf16_t* w,    \
                                                            int M, int N, int K, float* y) {     \
    sg_prefetch(w, N, K);                                                                       \
    PDL_ENTRY();                                                                                \
    stream_gemm_wide<G>(x, w, M, N, K, y);                                                      \
  }
#ifndef SG_HELPERS_ONLY
SG_WIDE(2)
SG_WIDE(3)
SG_WIDE(4)
SG_WIDE(5)
#endif
