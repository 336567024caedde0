// A wide row-invariant streaming GEMM, measured and not shipped (docs/benchmarks.md session 14):
// for calls of more than 16 rows it reads each weight tile once for all rows instead of once per
// 16-row group, computing each element exactly as crates/dflash-core/src/stream_gemm.cu's narrow
// kernel does (bit-identical, checked by scripts/probe-stream-gemm.py with WIDE=1, which compiles
// stream_gemm.cu followed by this file). On the H200 it was faster than the grouped narrow kernel
// on some Qwen3-8B shapes (q/k/v, gate-up) and slower on others (o, down), and 4–17× slower than
// cuBLAS everywhere: register-fed mma.sync without shared-memory staging is issue-bound at these
// row counts. What issue 18 needs is a real tiled GEMM (weights and x staged in shared memory,
// ldmatrix fragments) that keeps this kernel's per-element order.
// The wide kernel (steps of more than 16 rows: tree verifies): per output element exactly the
// arithmetic of stream_gemm above — kw interleaved partial sums over 64-wide chunks (partial s
// takes chunks s, s + kw, … in increasing order, each through the same two-half, two-mma
// sequence with the same fragments), the partials added in order 0, 1, …, kw − 1, rounded once —
// so a row computed here is bit-identical to the same row computed by stream_gemm (alone or in
// any group). Layout: a block owns NT·16 weight rows and every row of x; warp r takes TG row
// tiles of 8 at a time (tiles r·TG…, then r·TG + warps·TG…) and walks every partial for them
// itself, so partials never meet shared memory and the block's warps share each weight chunk
// through L1/L2: the weight comes from DRAM once per call, not once per 16-row group.
template <int NT, int TG, bool ACT, typename O>
__device__ void stream_gemm_wide(const bf16_t* x, const bf16_t* w, int M, int N, int K, int kw,
                                 O* y) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int n0 = blockIdx.x * 16 * NT;
  const int xs = ACT ? 2 * K : K;
  const bf16_t* wr[NT][2];
  for (int a = 0; a < NT; ++a) {
    wr[a][0] = w + (long long)min(n0 + 16 * a + g, N - 1) * K + 8 * t4;
    wr[a][1] = w + (long long)min(n0 + 16 * a + g + 8, N - 1) * K + 8 * t4;
  }
  const int tiles = (M + 7) >> 3, chunks = K >> 6;
  for (int t0 = warp * TG; t0 < tiles; t0 += warps * TG) {
    const bf16_t* xr[TG];
    bool xok[TG];
    for (int t = 0; t < TG; ++t) {
      const int m = 8 * (t0 + t) + g;
      xok[t] = m < M;
      xr[t] = x + (long long)(xok[t] ? m : 0) * xs + 8 * t4;
    }
    float tot[NT][TG][4];
    for (int s = 0; s < kw; ++s) {
      float acc[NT][TG][4];
      for (int a = 0; a < NT; ++a)
        for (int t = 0; t < TG; ++t)
          for (int i = 0; i < 4; ++i) acc[a][t][i] = 0.0f;
#pragma unroll 2
      for (int c = s; c < chunks; c += kw) {
        const int k = c << 6;
        uint4 wf[NT][2][2];  // [tile][row g, row g + 8][half]
        for (int a = 0; a < NT; ++a)
          for (int r = 0; r < 2; ++r) {
            wf[a][r][0] = __ldg((const uint4*)(wr[a][r] + k));
            wf[a][r][1] = __ldg((const uint4*)(wr[a][r] + k + 32));
          }
        uint4 xf[TG][2];
        for (int t = 0; t < TG; ++t) {
          if (!xok[t]) {
            xf[t][0] = make_uint4(0, 0, 0, 0);
            xf[t][1] = make_uint4(0, 0, 0, 0);
          } else if (ACT) {
            xf[t][0] = sg_silu8(xr[t] + k, K);
            xf[t][1] = sg_silu8(xr[t] + k + 32, K);
          } else {
            xf[t][0] = *(const uint4*)(xr[t] + k);
            xf[t][1] = *(const uint4*)(xr[t] + k + 32);
          }
        }
        for (int h = 0; h < 2; ++h)
          for (int t = 0; t < TG; ++t)
            for (int a = 0; a < NT; ++a) {
              const uint4 u0 = wf[a][0][h], u1 = wf[a][1][h], v = xf[t][h];
              sg_mma(acc[a][t], u0.x, u1.x, u0.y, u1.y, v.x, v.y);
              sg_mma(acc[a][t], u0.z, u1.z, u0.w, u1.w, v.z, v.w);
            }
      }
      for (int a = 0; a < NT; ++a)
        for (int t = 0; t < TG; ++t)
          for (int i = 0; i < 4; ++i) tot[a][t][i] = s == 0 ? acc[a][t][i] : tot[a][t][i] + acc[a][t][i];
    }
    // d0, d1: column n0 + 16a + g, rows 2·t4, 2·t4 + 1 of the tile; d2, d3: column + 8
    for (int a = 0; a < NT; ++a)
      for (int t = 0; t < TG; ++t) {
        const int m = 8 * (t0 + t) + 2 * t4, c0 = n0 + 16 * a + g, c1 = c0 + 8;
        for (int i = 0; i < 2; ++i) {
          if (m + i >= M) continue;
          if (c0 < N) sg_store(y, (long long)(m + i) * N + c0, tot[a][t][i]);
          if (c1 < N) sg_store(y, (long long)(m + i) * N + c1, tot[a][t][2 + i]);
        }
      }
  }
}

#define STREAM_GEMM_WIDE(NT, TG)                                                                 \
  extern "C" __global__ void stream_gemm_wide_n##NT##t##TG##_bf16(                              \
      const bf16_t* x, const bf16_t* w, int M, int N, int K, int kw, bf16_t* y) {              \
    stream_gemm_wide<NT, TG, false>(x, w, M, N, K, kw, y);                                      \
  }                                                                                             \
  extern "C" __global__ void stream_gemm_wide_n##NT##t##TG##_f32out(                            \
      const bf16_t* x, const bf16_t* w, int M, int N, int K, int kw, float* y) {               \
    stream_gemm_wide<NT, TG, false>(x, w, M, N, K, kw, y);                                      \
  }                                                                                             \
  extern "C" __global__ void stream_gemm_wide_silu_n##NT##t##TG##_bf16(                         \
      const bf16_t* x, const bf16_t* w, int M, int N, int K, int kw, bf16_t* y) {              \
    stream_gemm_wide<NT, TG, true>(x, w, M, N, K, kw, y);                                       \
  }
STREAM_GEMM_WIDE(1, 2)

STREAM_GEMM_WIDE(1, 4)
STREAM_GEMM_WIDE(2, 2)
STREAM_GEMM_WIDE(2, 4)
