// A tiled row-invariant GEMM for wide steps (issue 18: bit-exact tree verifies at the speed of the
// default path), appended to stream_gemm.cu at compile time (stream_gemm_cuda.rs: SOURCE). Opt-in
// (`DFLASH_STREAM_TILED=1`: calls of more than 16 rows on the streaming GEMM take it): written at the
// end of session 14 and moved here in session 20; first run on an H100 in session 21: bit for bit
// the narrow kernel's outputs, but far slower (one block per 64×64 output tile walking the whole K
// leaves 9–64 blocks at SmolLM2 / Qwen3-8B down shapes) — `scripts/probe-stream-gemm.py` (WIDE=1) checks every output bit for bit
// against the narrow kernel and times it; the GPU test
// `stream_matmul_matches_and_does_not_depend_on_the_row_count` under `DFLASH_STREAM_TILED=1` checks
// the same through the Rust launch.
//
// Per output element the arithmetic of the narrow kernel (stream_gemm.cu): kw interleaved partial
// sums over 64-wide K chunks (partial s takes chunks s, s + kw, … in increasing order), each chunk
// through two 32-wide halves of two m16n8k16 mmas whose fragments hold the same elements in the same
// registers as the narrow kernel's (lane (g, t4) holds weight rows g and g + 8 and x row g of a
// tile, elements 8·t4 … 8·t4 + 7 of the half), partials added in order 0 … kw − 1, rounded once.
// What changes is where the operands come from: a block owns a 64 × 64 output tile (64 weight rows,
// 64 x rows), stages each chunk's weight and x tiles in shared memory with cp.async
// (double-buffered), and its 8 warps read their fragments from there, so each weight chunk leaves
// DRAM once per 64 rows of x instead of once per 16, and each x chunk once per 64 weight rows.
//
// Shared-memory rows are 128 bytes (64 bf16), eight 16-byte units; unit u of row r is stored at
// u ^ ((r & 1) << 2), so the 8 lanes of a quarter-warp (rows g, g + 1 at units t4) hit 8 distinct
// bank groups.
#define ST_BN 64  // weight rows a block
#define ST_BM 64  // x rows a block
#define ST_WARPS 8

__device__ __forceinline__ int st_unit(int r, int u) { return (u ^ ((r & 1) << 2)); }

__device__ __forceinline__ void st_cp16(void* smem, const void* gmem, bool ok) {
  const unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
  const int n = ok ? 16 : 0;  // zero-fill rows past the end
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void st_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void st_wait1() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void st_wait0() { asm volatile("cp.async.wait_group 0;\n" ::); }

// one stage: the weight tile, the x tile (gates), and for ACT the up tile
struct StStage {
  uint4 w[ST_BN][8];
  uint4 x[ST_BM][8];
  uint4 u[ST_BM][8];
};

template <bool ACT>
__device__ __forceinline__ void st_load(StStage& st, const bf16_t* w, const bf16_t* x, int n0,
                                        int m0, int N, int M, int K, int k) {
  const int xs = ACT ? 2 * K : K;
  for (int e = threadIdx.x; e < ST_BN * 8; e += blockDim.x) {
    const int r = e >> 3, u = e & 7, n = n0 + r;
    st_cp16(&st.w[r][st_unit(r, u)], w + (long long)min(n, N - 1) * K + k + 8 * u, n < N);
  }
  for (int e = threadIdx.x; e < ST_BM * 8; e += blockDim.x) {
    const int r = e >> 3, u = e & 7, m = m0 + r;
    const bf16_t* p = x + (long long)min(m, M - 1) * xs + k + 8 * u;
    st_cp16(&st.x[r][st_unit(r, u)], p, m < M);
    if (ACT) st_cp16(&st.u[r][st_unit(r, u)], p + K, m < M);
  }
}

template <bool ACT, typename O>
__device__ void stream_gemm_tiled(const bf16_t* x, const bf16_t* w, int M, int N, int K, int kw,
                                  O* y) {
  extern __shared__ uint4 st_smem[];
  StStage* stage = (StStage*)st_smem;  // [2]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int n0 = blockIdx.x * ST_BN, m0 = blockIdx.y * ST_BM;
  const int at = warp & 3;         // this warp's 16-row weight tile
  const int mt0 = (warp >> 2) * 4;  // its first of four 8-row x tiles
  const int chunks = K >> 6;
  float tot[4][4], acc[4][4];
  for (int s = 0; s < kw; ++s) {
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 4; ++i) acc[t][i] = 0.0f;
    int buf = 0;
    st_load<ACT>(stage[0], w, x, n0, m0, N, M, K, s << 6);
    st_commit();
    for (int c = s; c < chunks; c += kw) {
      const bool more = c + kw < chunks;
      if (more) st_load<ACT>(stage[buf ^ 1], w, x, n0, m0, N, M, K, (c + kw) << 6);
      st_commit();
      st_wait1();
      __syncthreads();
      const StStage& st = stage[buf];
      const int ra = 16 * at + g, rb = ra + 8;
      for (int h = 0; h < 2; ++h) {
        const uint4 a0 = st.w[ra][st_unit(ra, t4 + 4 * h)];
        const uint4 a1 = st.w[rb][st_unit(rb, t4 + 4 * h)];
        for (int t = 0; t < 4; ++t) {
          const int rx = 8 * (mt0 + t) + g;
          uint4 b = st.x[rx][st_unit(rx, t4 + 4 * h)];
          if (ACT) {
            const uint4 up = st.u[rx][st_unit(rx, t4 + 4 * h)];
            b = make_uint4(sg_silu2(b.x, up.x), sg_silu2(b.y, up.y), sg_silu2(b.z, up.z),
                           sg_silu2(b.w, up.w));
          }
          sg_mma(acc[t], a0.x, a1.x, a0.y, a1.y, b.x, b.y);
          sg_mma(acc[t], a0.z, a1.z, a0.w, a1.w, b.z, b.w);
        }
      }
      __syncthreads();  // the stage is free for the load after next
      buf ^= 1;
    }
    st_wait0();
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 4; ++i) tot[t][i] = s == 0 ? acc[t][i] : tot[t][i] + acc[t][i];
  }
  // d0, d1: column n0 + 16·at + g, x rows 2·t4, 2·t4 + 1 of the tile; d2, d3: column + 8
  for (int t = 0; t < 4; ++t) {
    const int m = m0 + 8 * (mt0 + t) + 2 * t4, c0 = n0 + 16 * at + g, c1 = c0 + 8;
    for (int i = 0; i < 2; ++i) {
      if (m + i >= M) continue;
      if (c0 < N) sg_store(y, (long long)(m + i) * N + c0, tot[t][i]);
      if (c1 < N) sg_store(y, (long long)(m + i) * N + c1, tot[t][2 + i]);
    }
  }
}

// grid (ceil(N / 64), ceil(M / 64)), block 256 threads, dynamic shared memory 2 · sizeof(StStage)
// (the bf16 and f32 kernels use only the weight and x parts; the up tile is for _silu)
extern "C" __global__ void stream_gemm_tiled_bf16(const bf16_t* x, const bf16_t* w, int M, int N,
                                                  int K, int kw, bf16_t* y) {
  PDL_ENTRY();
  stream_gemm_tiled<false>(x, w, M, N, K, kw, y);
}
extern "C" __global__ void stream_gemm_tiled_f32out(const bf16_t* x, const bf16_t* w, int M, int N,
                                                    int K, int kw, float* y) {
  PDL_ENTRY();
  stream_gemm_tiled<false>(x, w, M, N, K, kw, y);
}
extern "C" __global__ void stream_gemm_tiled_silu_bf16(const bf16_t* x, const bf16_t* w, int M,
                                                       int N, int K, int kw, bf16_t* y) {
  PDL_ENTRY();
  stream_gemm_tiled<true>(x, w, M, N, K, kw, y);
}

// ---------------------------------------------------------------------------------------------
// The split kernel (session 31): the tiled kernel's tiles with the kw partial sums spread over
// blocks instead of walked one after another inside one (the tiled kernel left 9–64 blocks at the
// decode shapes). Block (x-row tile, weight-row tile, partial s) stages chunks s, s + kw, … of its
// 64 weight rows and 16·XT x rows in shared memory (SP_STAGES deep, cp.async) and runs the narrow
// kernel's mma chain on them; with kw > 1 it writes its partial to `part` [kw, M, N] (f32), and the
// tile's last block to arrive (a counter per tile, left zero again) adds the kw partials in order
// 0 … kw − 1 and rounds once. Per output element that is the narrow kernel's arithmetic — the same
// chunks per partial in the same order, the same mma per accumulator (half 0 then 1, the .x/.y pair
// then .z/.w), the same partial order and rounding — so a row's bits are the AR step's at any row
// count. x-row tiles are blockIdx.x (the fastest), so the blocks that share a weight tile run side
// by side and the weight leaves DRAM once. 8 warps: 4 weight-row tiles of 16 × 2 halves of the x
// rows (XT 8-row tiles each; tiles past the call's rows are neither loaded nor multiplied).
// Measured on an H100 (session 31, scripts/probe-stream-gemm.py SPLIT=1, weights from DRAM; the
// Qwen3-8B projections of a step summed): 7.8 ms at 17 rows against 10.6 on the wide kernel, 9.1
// against 9.4 at 33, 11.7 against 10.6 at 65, 38.0 at 257 against 90.6 on the grouped narrow
// launch — but slower than cuBLAS at every row count (5.8–7.5 ms) and than the narrow kernel at 1
// and 16 rows (6.3 / 7.2 against 5.6 / 6.2), and on SmolLM2's small weights slower than both
// (latency: ~5 µs a call at 1 row against 2.8). stream_gemm.rs's `split_call` takes it where it
// won (`--bit-exact`'s large weights at 17–32 and 81+ rows, LM heads of 17+ rows).
#ifndef SP_STAGES
// probed (session 31, the 8B step sums): 3 faster than 4 at 1, 16, 65 rows, within 0.5 % at 257
#define SP_STAGES 3
#endif

template <int BN, int XT>
struct SpStage {
  uint4 w[BN][8];
  uint4 x[16 * XT][8];
};

template <int BN, int XT>
__device__ __forceinline__ void sp_load(SpStage<BN, XT>& st, const bf16_t* w, const bf16_t* x,
                                        int n0, int m0, int N, int M, int K, int xrows, int k) {
  for (int e = threadIdx.x; e < BN * 8; e += blockDim.x) {
    const int r = e >> 3, u = e & 7, n = n0 + r;
    st_cp16(&st.w[r][st_unit(r, u)], w + (long long)min(n, N - 1) * K + k + 8 * u, n < N);
  }
  for (int e = threadIdx.x; e < xrows * 8; e += blockDim.x) {
    const int r = e >> 3, u = e & 7, m = m0 + r;
    st_cp16(&st.x[r][st_unit(r, u)], x + (long long)min(m, M - 1) * K + k + 8 * u, m < M);
  }
}

// BN weight rows a block (64: 4 tiles of 16, each warp one tile and half the x rows; 128: each warp
// one tile and all the x rows; 256: each warp two tiles and all the x rows), 16·XT x rows.
template <int BN, int XT, typename O>
__device__ void stream_gemm_split(const bf16_t* x, const bf16_t* w, int M, int N, int K, int kw,
                                  float* part, unsigned int* counters, O* y) {
  typedef SpStage<BN, XT> Stage;
  constexpr int AT = BN == 256 ? 2 : 1;      // 16-row weight tiles a warp
  constexpr int XW = BN == 64 ? XT : 2 * XT;  // 8-row x tiles a warp
  extern __shared__ uint4 st_smem[];
  Stage* stage = (Stage*)st_smem;  // [SP_STAGES]
  __shared__ int sp_last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int m0 = blockIdx.x * 16 * XT, n0 = blockIdx.y * BN, s = blockIdx.z;
  const int at0 = BN == 64 ? (warp & 3) : AT * warp;  // this warp's first 16-row weight tile
  const int mt0 = BN == 64 ? (warp >> 2) * XT : 0;    // its first 8-row x tile
  const int rows = min(16 * XT, M - m0);
  const int xrows = (rows + 7) & ~7;
  const int chunks = K >> 6;
  const int mine = (chunks - s + kw - 1) / kw;  // chunks s, s + kw, … (s < kw ≤ chunks / 2)
  float acc[AT][XW][4];
#pragma unroll
  for (int a = 0; a < AT; ++a)
#pragma unroll
    for (int t = 0; t < XW; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[a][t][i] = 0.0f;
#pragma unroll
  for (int i = 0; i < SP_STAGES - 1; ++i) {
    if (i < mine) sp_load<BN, XT>(stage[i], w, x, n0, m0, N, M, K, xrows, (s + i * kw) << 6);
    st_commit();
  }
  for (int i = 0; i < mine; ++i) {
    const int next = i + SP_STAGES - 1;  // into the stage chunk i - 1 left (free since its sync)
    if (next < mine)
      sp_load<BN, XT>(stage[next % SP_STAGES], w, x, n0, m0, N, M, K, xrows, (s + next * kw) << 6);
    st_commit();
    asm volatile("cp.async.wait_group %0;\n" ::"n"(SP_STAGES - 1));
    __syncthreads();
    const Stage& st = stage[i % SP_STAGES];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int a = 0; a < AT; ++a) {
        const int ra = 16 * (at0 + a) + g, rb = ra + 8;
        const uint4 a0 = st.w[ra][st_unit(ra, t4 + 4 * h)];
        const uint4 a1 = st.w[rb][st_unit(rb, t4 + 4 * h)];
#pragma unroll
        for (int t = 0; t < XW; ++t) {
          if (8 * (mt0 + t) >= rows) continue;  // the same for the whole warp
          const int rx = 8 * (mt0 + t) + g;
          const uint4 b = st.x[rx][st_unit(rx, t4 + 4 * h)];
          sg_mma(acc[a][t], a0.x, a1.x, a0.y, a1.y, b.x, b.y);
          sg_mma(acc[a][t], a0.z, a1.z, a0.w, a1.w, b.z, b.w);
        }
      }
    }
    __syncthreads();  // the stage is free for the load SP_STAGES - 1 chunks on
  }
  st_wait0();
  // d0, d1: column n0 + 16·(at0 + a) + g, x rows 2·t4, 2·t4 + 1 of tile t; d2, d3: column + 8
  const bool direct = kw == 1;
  float* dst = direct ? nullptr : part + (long long)s * M * N;
#pragma unroll
  for (int a = 0; a < AT; ++a)
#pragma unroll
    for (int t = 0; t < XW; ++t) {
      if (8 * (mt0 + t) >= rows) continue;
      const int m = m0 + 8 * (mt0 + t) + 2 * t4, c0 = n0 + 16 * (at0 + a) + g, c1 = c0 + 8;
      for (int i = 0; i < 2; ++i) {
        if (m + i >= M) continue;
        const long long r = (long long)(m + i) * N;
        if (direct) {
          if (c0 < N) sg_store(y, r + c0, acc[a][t][i]);
          if (c1 < N) sg_store(y, r + c1, acc[a][t][2 + i]);
        } else {
          if (c0 < N) dst[r + c0] = acc[a][t][i];
          if (c1 < N) dst[r + c1] = acc[a][t][2 + i];
        }
      }
    }
  if (direct) return;
  // the tile's last block adds the partials in order
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int* c = counters + (size_t)blockIdx.y * gridDim.x + blockIdx.x;
    const unsigned int before = atomicAdd(c, 1u);
    sp_last = before == (unsigned int)kw - 1;
    if (sp_last) *c = 0u;  // zero again for the next launch
  }
  __syncthreads();
  if (!sp_last) return;
  __threadfence();
  for (int e = threadIdx.x; e < rows * BN; e += blockDim.x) {
    const int m = m0 + e / BN, n = n0 + e % BN;
    if (n >= N) continue;
    const long long r = (long long)m * N + n;
    float v = __ldcg(part + r);
    for (int j = 1; j < kw; ++j) v += __ldcg(part + (long long)j * M * N + r);
    sg_store(y, r, v);
  }
}

// grid (ceil(M / (16·XT)), ceil(N / BN), kw), block 256 threads, dynamic shared memory
// SP_STAGES · sizeof(SpStage<BN, XT>); `part` [kw, M, N] f32 and `counters` (one per (x tile,
// weight tile), zero) when kw > 1. (No activation prologue: the MLP's activation runs apart by
// default.) `stream_gemm_split_x{XT}_*` are the BN = 64 kernels the crate launches;
// `stream_gemm_split_b{BN}_x{XT}_*`, taller weight tiles (half or a quarter of the x rows' reloads
// per weight byte — the x tiles, from L2, outweighed the weight tiles at 65+ rows), are compiled
// for scripts/probe-stream-gemm.py alone (`SP_TALL_TILES`; built in session 31 after the last GPU
// call, not yet run).
#define SP_KERNELS(NAME, BN, XT)                                                                 \
  extern "C" __global__ void NAME##_bf16(const bf16_t* x, const bf16_t* w, int M, int N, int K,  \
                                         int kw, float* part, unsigned int* counters,           \
                                         bf16_t* y) {                                           \
    PDL_ENTRY();                                                                                \
    stream_gemm_split<BN, XT>(x, w, M, N, K, kw, part, counters, y);                           \
  }                                                                                             \
  extern "C" __global__ void NAME##_f32out(const bf16_t* x, const bf16_t* w, int M, int N,       \
                                           int K, int kw, float* part, unsigned int* counters,  \
                                           float* y) {                                          \
    PDL_ENTRY();                                                                                \
    stream_gemm_split<BN, XT>(x, w, M, N, K, kw, part, counters, y);                           \
  }
SP_KERNELS(stream_gemm_split_x1, 64, 1)
SP_KERNELS(stream_gemm_split_x2, 64, 2)
SP_KERNELS(stream_gemm_split_x4, 64, 4)
SP_KERNELS(stream_gemm_split_x5, 64, 5)
#ifdef SP_TALL_TILES
SP_KERNELS(stream_gemm_split_b128_x2, 128, 2)
SP_KERNELS(stream_gemm_split_b128_x5, 128, 5)
SP_KERNELS(stream_gemm_split_b256_x2, 256, 2)
SP_KERNELS(stream_gemm_split_b256_x5, 256, 5)
#endif
