// The streaming GEMM with its weight tiles brought in by the bulk-copy
// engine (Hopper's cp.async.bulk, one 16-row tile span per stage into shared memory, mbarriers
// between one producer warp and the KW consumer warps) instead of each lane's scattered 16-byte
// loads (8 rows × 64 bytes per warp instruction). Compiled after stream_gemm.cu (it uses sg_mma,
// sg_store, SgChunk, sg_compute) in a module of its own for compute 9.0 (stream_gemm.rs,
// `DFLASH_STREAM_BULK`; session 30).
//
// The arithmetic is the shipped kernel's, term for term: warp j takes the 64-wide chunks j, j + KW,
// ... in increasing order, each chunk's fragments are the same 16-byte pieces (row g / g + 8, k +
// 8·t4 and + 32), fed to the same four mma per row tile, the warps' partials added in warp order —
// so every output is bit-identical to stream_gemm_m{8,16}_*, whatever the stage size.
// Needs compute 9.0 (cp.async.bulk, mbarrier expect_tx / try_wait).
#ifndef SGB_PAD
#define SGB_PAD 64  // bytes after each row of a stage: rows g and g + 1 land on different banks
#endif

__device__ __forceinline__ unsigned sgb_smem(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void sgb_bar_init(unsigned long long* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sgb_smem(b)), "r"(count));
}
__device__ __forceinline__ void sgb_expect(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sgb_smem(b)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void sgb_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sgb_smem(b)) : "memory");
}
__device__ __forceinline__ void sgb_wait(unsigned long long* b, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(sgb_smem(b)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void sgb_copy(void* dst, const void* src, unsigned bytes,
                                         unsigned long long* b, unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], "
      "%2, [%3], %4;" ::"r"(sgb_smem(dst)),
      "l"(src), "r"(bytes), "r"(sgb_smem(b)), "l"(policy)
      : "memory");
}

// SPAN: elements of each of the 16 rows a stage holds (a multiple of 64); NST: stages in flight
template <int MT, int SPAN, int NST, typename O>
__device__ void stream_gemm_bulk(const bf16_t* x, const bf16_t* w, int M, int N, int K, int kw,
                                 O* y) {
  constexpr int ROWB = SPAN * 2 + SGB_PAD;  // bytes of a row in a stage
  extern __shared__ __align__(128) unsigned char sgb_buf[];  // [NST][16][ROWB]
  __shared__ __align__(8) unsigned long long full[NST], empty[NST];
  __shared__ float part[SG_MAX_KW][16][16];
  x += (long long)blockIdx.y * 16 * K;
  y += (long long)blockIdx.y * 16 * N;
  M = min(16, M - 16 * (int)blockIdx.y);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = blockIdx.x * 16;
  const int stages = (K + SPAN - 1) / SPAN;
  if (threadIdx.x == 0) {
    for (int s = 0; s < NST; ++s) {
      sgb_bar_init(&full[s], 1);
      sgb_bar_init(&empty[s], kw);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == kw) {  // the producer: one lane issues every stage's 16 row copies
    if (lane == 0) {
      unsigned long long policy;
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
      for (int s = 0; s < stages; ++s) {
        const int b = s % NST;
        if (s >= NST) sgb_wait(&empty[b], ((s / NST) - 1) & 1);
        const int k0 = s * SPAN;
        const unsigned bytes = (unsigned)(min(SPAN, K - k0) * 2);
        sgb_expect(&full[b], 16 * bytes);
        unsigned char* dst = sgb_buf + (size_t)b * 16 * ROWB;
        for (int r = 0; r < 16; ++r)
          sgb_copy(dst + r * ROWB, w + (long long)min(n0 + r, N - 1) * K + k0, bytes, &full[b],
                   policy);
      }
    }
  } else {
    const int g = lane >> 2, t4 = lane & 3;
    const bf16_t* xr[MT];
    bool xok[MT];
    for (int t = 0; t < MT; ++t) {
      const int m = 8 * t + g;
      xok[t] = m < M;
      xr[t] = x + (long long)(xok[t] ? m : 0) * K + 8 * t4;
    }
    float acc[MT][4];
    for (int t = 0; t < MT; ++t)
      for (int i = 0; i < 4; ++i) acc[t][i] = 0.0f;
    constexpr int CPS = SPAN / 64;  // chunks a stage
    for (int s = 0; s < stages; ++s) {
      const int b = s % NST;
      const int c0 = s * CPS, c1 = min(c0 + CPS, K >> 6);
      // this warp's first chunk of the stage: the smallest c >= c0 with c ≡ warp (mod kw)
      int c = c0 + ((warp - c0 % kw) % kw + kw) % kw;
      sgb_wait(&full[b], (s / NST) & 1);
      const unsigned char* tile = sgb_buf + (size_t)b * 16 * ROWB;
      for (; c < c1; c += kw) {
        SgChunk<MT> ch;
        const int kk = (c - c0) * 128 + 16 * t4;  // byte offset of the lane's piece in a row
        ch.w0[0] = *(const uint4*)(tile + g * ROWB + kk);
        ch.w0[1] = *(const uint4*)(tile + g * ROWB + kk + 64);
        ch.w1[0] = *(const uint4*)(tile + (g + 8) * ROWB + kk);
        ch.w1[1] = *(const uint4*)(tile + (g + 8) * ROWB + kk + 64);
        const int k = c << 6;
        for (int t = 0; t < MT; ++t) {
          ch.x[t][0] = xok[t] ? *(const uint4*)(xr[t] + k) : make_uint4(0, 0, 0, 0);
          ch.x[t][1] = xok[t] ? *(const uint4*)(xr[t] + k + 32) : make_uint4(0, 0, 0, 0);
        }
        sg_compute<MT>(acc, ch);
      }
      __syncwarp();
      if (lane == 0) sgb_arrive(&empty[b]);
    }
    sg_put_partials<MT>(part, warp, g, t4, acc);
  }
  __syncthreads();
  sg_sum_store(part, kw, M, N, n0, y);
}

#define SGB(MT, SPAN, NST)                                                                      \
  extern "C" __global__ void stream_gemm_bulk_m##MT##_s##SPAN##_n##NST##_bf16(                  \
      const bf16_t* x, const bf16_t* w, int M, int N, int K, int kw, bf16_t* y) {               \
    PDL_ENTRY();                                                                                \
    stream_gemm_bulk<MT, SPAN, NST>(x, w, M, N, K, kw, y);                                      \
  }                                                                                             \
  extern "C" __global__ void stream_gemm_bulk_m##MT##_s##SPAN##_n##NST##_f32out(                \
      const bf16_t* x, const bf16_t* w, int M, int N, int K, int kw, float* y) {                \
    PDL_ENTRY();                                                                                \
    stream_gemm_bulk<MT, SPAN, NST>(x, w, M, N, K, kw, y);                                      \
  }
SGB(1, 256, 4)
SGB(1, 512, 3)
SGB(1, 512, 4)
SGB(1, 512, 6)
SGB(1, 1024, 3)
SGB(2, 256, 4)
SGB(2, 512, 3)
SGB(2, 512, 4)
SGB(2, 512, 6)
SGB(2, 1024, 3)
