// The bf16 tree attention on tensor cores (mma.sync m16n8k16, f32 accumulation): the same
// contract and output records as tree_attn_partial (step_kernels.cu, which this file is appended
// to at compile time), for bf16 caches.
//
// - Layout: a block takes one kv head g, one split s (keys s·chunk ..) and MK_VPB query vectors,
//   16 per warp (the mma's A rows). Vectors are ordered tree row first, head second (vector w is
//   tree row w / rep, head g·rep + w % rep), so the rep heads of one tree row share a warp and
//   its key path. Keys move through shared memory in tiles of MK_TK rows (zero past the split).
// - Arithmetic per vector: scores S = (q·k)·scale from bf16 q and k with f32 accumulation, in 16-
//   channel mma steps in channel order; masked scores −inf; an online softmax per tile (max, then
//   p = exp(s − m) rounded to bf16, the sum of the rounded p); output += p·v as mmas over 16-key
//   chunks in key order, f32 accumulators. What a vector's numbers depend on: its q, the keys it
//   sees at their positions, the chunk size — never on the other vectors sharing its mma (a
//   tensor-core dot product is a function of its own row and column) nor on the step's row count.
// - Keys by position (`logical`): a tree row sees its ancestors at positions past + depth. A row
//   whose path is not the step rows 0..depth (any row r ≠ depth) reads those keys and values
//   row by row (per tree row, one mma for the whole warp whose other rows are discarded) in the
//   tiles that hold step positions — from the staged tile where the ancestor's row is in it (a
//   step aligned to a tile: all of them), else from the cache; everything else is shared. A
//   causal block and an AR token never take that path. With keys by step row (`logical` 0) the
//   ancestor bits mask the step rows in place.
// - The one-row step merges its splits in the kernel (the last block of a kv head, counted in
//   `counters`: merge_vector, the combine kernel's arithmetic). Steps without per-row key reads run on
//   group_attn_mma (at the end of this file): the same arithmetic with one warp's vectors a block
//   and the tile's keys and channels spread over the block's warps, per head width.

#define MK_TK 64                // keys per shared tile
#define MK_WARPS 4              // warps per block
#define MK_VPB (MK_WARPS * 16)  // query vectors per block
#define MK_STR (MAX_D + 8)      // shared row stride in bf16: 68 words, conflict-free fragments
#define MK_FULL 0xffffffffu
#define MK_PMAX 64  // path entries a warp keeps in shared memory per tree row (deeper: from L2)

__device__ __forceinline__ void mk_mma(float* c, const unsigned int* a, unsigned int b0,
                                       unsigned int b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned int mk_ld32(const bf16_t* p) {
  return __ldcg((const unsigned int*)p);
}
// the per-row key and value reads go through L1 (the step's rows are read by every bent row of
// every warp of a kv head; the cache rows were written by an earlier kernel, so L1 holds nothing
// stale)
__device__ __forceinline__ unsigned int mk_ldg32(const bf16_t* p) {
  return __ldg((const unsigned int*)p);
}

// The tile pipeline of tree_attn_mma under DFLASH_ATTN_PIPELINE (opt-in, `DFLASH_ATTN_PIPELINE=1`;
// built in session 26 after ncu found the kernel latency-bound — one tile staged through registers
// between two barriers, then scored; the same bits, no faster on an H100 in session 27): K and V
// tiles move into shared memory by cp.async (16 bytes a copy, zero-filled past the split, no
// staging registers), the V tile of a tile while its keys are scored and the next tile's K while
// its values are summed — the same numbers in the same places as the register staging.
__device__ __forceinline__ void mk_cp16(bf16_t* dst, const bf16_t* src, bool valid) {
  const unsigned int a = (unsigned int)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void mk_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void mk_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}
// A warp without vectors skips the tile's work but not its barriers (pipeline); without the
// pipeline it leaves the tile after the staging barrier.
#if defined(DFLASH_ATTN_PIPELINE)
#define MK_PIPE_IDLE (!wactive)
#else
#define MK_PIPE_IDLE false
#endif
// Rows t0 .. t0 + MK_TK − 1 of kv head g's buffer `src` into `buf` (stride MK_STR), zero past nt.
__device__ __forceinline__ void mk_stage_async(bf16_t* buf, const bf16_t* src, int g, int cap,
                                               int d, int t0, int nt, int tid) {
  const int upr = d >> 3, units = MK_TK * upr, lg = __ffs(upr) - 1;
  const bool pow2 = (upr & (upr - 1)) == 0;
  for (int u = tid; u < units; u += MK_WARPS * 32) {
    const int j = pow2 ? u >> lg : u / upr, c = (u - j * upr) * 8;
    const bool in = j < nt;
    mk_cp16(buf + j * MK_STR + c, src + ((long long)g * cap + t0 + (in ? j : 0)) * d + c, in);
  }
}

// The cache row holding key `j` for a tree row of depth `dr` whose path is `tab` (shared memory,
// when the warp keeps its rows' paths there) or the ancestor record `ar` (its path from L2), or −1
// (a key past the row's depth or past the split: a zero operand).
__device__ __forceinline__ int mk_row_of(const unsigned short* tab, const unsigned int* ar, int dr,
                                         int j, int past, int lim) {
  if (j >= lim) return -1;
  if (j < past) return j;
  const int i = j - past;
  if (i > dr) return -1;
  return past + (tab != nullptr ? (int)tab[i] : (int)__ldg(ar + ANC_BITS + 1 + i));
}

// A lane's two query vectors, A rows gq and gq + 8 of the warp's 16 from vector `wbase` on
// (vectors tree row first, head second): whether each exists, its tree row and its head.
// With `dep`, also each existing vector's tree depth from its ancestor record (0 without one).
__device__ __forceinline__ void mk_lane_vectors(int wbase, int gq, int nvec, int rep, int g,
                                                bool* ok, int* rr, int* head, int* dep = nullptr,
                                                const unsigned int* ancestors = nullptr,
                                                int stride = 0, bool has_depth = false) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int w = wbase + gq + 8 * e;
    ok[e] = w < nvec;
    rr[e] = ok[e] ? w / rep : 0;
    head[e] = g * rep + (ok[e] ? w % rep : 0);
    if (dep != nullptr)
      dep[e] = (ok[e] && has_depth) ? (int)ancestors[(long long)rr[e] * stride + ANC_BITS] : 0;
  }
}

// The output accumulators of a lane's two vectors (T channel tiles) rescaled by the tile's alpha.
template <int T>
__device__ __forceinline__ void mk_rescale(float (*acc)[4], const float* alpha) {
#pragma unroll
  for (int t = 0; t < T; ++t) {
    acc[t][0] *= alpha[0];
    acc[t][1] *= alpha[0];
    acc[t][2] *= alpha[1];
    acc[t][3] *= alpha[1];
  }
}

// A lane's share of its two vectors' records for split s of `splits` (vector v = head·n + row:
// running max, sum, then the first `dtiles` of T channel tiles of unnormalised output).
template <int T>
__device__ __forceinline__ void mk_write_records(float* part, const bool* ok, const int* rr,
                                                 const int* head, int n, int splits, int s, int d,
                                                 int dtiles, int tq, const float* mrow,
                                                 const float* lrow, const float (*acc)[4]) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    if (!ok[hf]) continue;
    const long long vec = (long long)head[hf] * n + rr[hf];
    float* rec = part + (vec * splits + s) * (long long)(d + 2);
    if (tq == 0) {
      rec[0] = mrow[hf];
      rec[1] = lrow[hf];
    }
#pragma unroll
    for (int t = 0; t < T; ++t) {
      if (t >= dtiles) continue;
      rec[2 + 8 * t + 2 * tq] = acc[t][2 * hf];
      rec[3 + 8 * t + 2 * tq] = acc[t][2 * hf + 1];
    }
  }
}

// The mma A fragments of a lane's two vectors (rows of D channels of q [H, n, D]) for every
// 16-channel step; zero for a vector that does not exist.
template <int D>
__device__ __forceinline__ void mk_load_q(unsigned int (*qa)[4], const bf16_t* q, const bool* ok,
                                          const int* rr, const int* head, int n, int tq) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int c = 16 * kk + 2 * tq;
    const bf16_t* q0 = q + ((long long)head[0] * n + rr[0]) * D + c;
    const bf16_t* q1 = q + ((long long)head[1] * n + rr[1]) * D + c;
    qa[kk][0] = ok[0] ? mk_ld32(q0) : 0u;
    qa[kk][1] = ok[1] ? mk_ld32(q1) : 0u;
    qa[kk][2] = ok[0] ? mk_ld32(q0 + 8) : 0u;
    qa[kk][3] = ok[1] ? mk_ld32(q1 + 8) : 0u;
  }
}

// Tree row r's depth: a lane's own rows' depths are in registers; any other row's from L1/L2.
__device__ __forceinline__ int mk_depth_of(int r, const int* rr, const int* dep,
                                           const unsigned int* ar) {
  if (r == rr[0]) return dep[0];
  if (r == rr[1]) return dep[1];
  return (int)__ldg(ar + ANC_BITS);
}

// The online softmax of one tile for a lane's two vectors (A rows gq and gq + 8), given their
// masked, scaled scores `sc` (−inf where hidden) and the lane's maxima over them `tmax`: the quad's
// maxima, the running max `mrow` and the rescale `alpha` of what came before, p = exp(s − m)
// rounded to bf16 and packed as the A operand of the p·v mmas (`pk`), and the running sum `lrow`
// of the rounded p (each lane's in key order, then the quad's xor butterfly). One arithmetic for
// tree_attn_mma and group_attn_mma: a vector's bits do not depend on which kernel ran it.
template <int KT = MK_TK>
__device__ __forceinline__ void mk_tile_softmax(const float (*sc)[4], float* tmax, float* mrow,
                                                float* lrow, float* alpha,
                                                unsigned int (*pk)[2]) {
  float mnew[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    tmax[hf] = fmaxf(tmax[hf], __shfl_xor_sync(MK_FULL, tmax[hf], 1));
    tmax[hf] = fmaxf(tmax[hf], __shfl_xor_sync(MK_FULL, tmax[hf], 2));
    if (tmax[hf] == NEG_INF) {  // nothing visible in this tile: the row is unchanged
      alpha[hf] = 1.0f;
      mnew[hf] = mrow[hf];
    } else {
      mnew[hf] = fmaxf(mrow[hf], tmax[hf]);
      alpha[hf] = mrow[hf] == NEG_INF ? 0.0f : __expf(mrow[hf] - mnew[hf]);
    }
  }
  float psum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int j8 = 0; j8 < KT / 8; ++j8) {
    unsigned int bits[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int hf = e >> 1;
      bits[e] = sc[j8][e] == NEG_INF ? 0u : bf16_bits(__expf(sc[j8][e] - mnew[hf]));
      psum[hf] += __uint_as_float(bits[e] << 16);
    }
    pk[j8][0] = bits[0] | (bits[1] << 16);
    pk[j8][1] = bits[2] | (bits[3] << 16);
  }
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    psum[hf] += __shfl_xor_sync(MK_FULL, psum[hf], 1);
    psum[hf] += __shfl_xor_sync(MK_FULL, psum[hf], 2);
    lrow[hf] = lrow[hf] * alpha[hf] + psum[hf];
    mrow[hf] = mnew[hf];
  }
}

__device__ void tree_attn_mma(const bf16_t* q, const bf16_t* kb, const bf16_t* vb,
                              const unsigned int* meta, const unsigned int* ancestors, int stride,
                              int logical, int n, int H, int KV, int cap, int d, int chunk,
                              int groups, float scale, float* part, unsigned int* counters,
                              bf16_t* out, int window) {
  __shared__ __align__(16) bf16_t ks[MK_TK * MK_STR];
  __shared__ __align__(16) bf16_t vs[MK_TK * MK_STR];
#if defined(DFLASH_PATH_TABLE)
  __shared__ unsigned short ptab[MK_WARPS][16][MK_PMAX];  // the warp's tree rows' paths
  __shared__ unsigned short pdep[MK_WARPS][16];           // and their depths
#endif
  const int rep = H / KV;
  const int g = blockIdx.x / groups, grp = blockIdx.x % groups, s = blockIdx.y;
  const int splits = gridDim.y;
  const int nvec = rep * n;
  const int past = (int)meta[0];
  const int total = past + n;
  const int k1 = min(total, s * chunk + chunk);
  const int k0 = window_tile_start(s * chunk, past, window, MK_TK);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;
  const int wbase = grp * MK_VPB + warp * 16;
  const bool wactive = wbase < nvec;
  const int ksteps = d >> 4, dtiles = d >> 3;
  const bool has_depth = stride > ANC_BITS;
  // this lane's two vectors: A rows gq (half 0) and gq + 8 (half 1)
  bool ok[2];
  int rr[2], head[2], dep[2];
  mk_lane_vectors(wbase, gq, nvec, rep, g, ok, rr, head, dep, ancestors, stride, has_depth);
  unsigned int qa[MAX_D / 16][4];
#pragma unroll
  for (int kk = 0; kk < MAX_D / 16; ++kk) {
    const int c = 16 * kk + 2 * tq;
    const bool in = kk < ksteps;
    const bf16_t* q0 = q + ((long long)head[0] * n + rr[0]) * d + c;
    const bf16_t* q1 = q + ((long long)head[1] * n + rr[1]) * d + c;
    qa[kk][0] = (in && ok[0]) ? mk_ld32(q0) : 0u;
    qa[kk][1] = (in && ok[1]) ? mk_ld32(q1) : 0u;
    qa[kk][2] = (in && ok[0]) ? mk_ld32(q0 + 8) : 0u;
    qa[kk][3] = (in && ok[1]) ? mk_ld32(q1 + 8) : 0u;
  }
  // a row reads its step keys row by row when its path is not the step rows 0..depth (a path
  // of increasing rows ending at row r = depth is exactly 0..depth)
  const bool bent = logical && ((ok[0] && rr[0] != dep[0]) || (ok[1] && rr[1] != dep[1]));
  const bool gather = __any_sync(MK_FULL, bent);
  int maxdep = max(ok[0] ? dep[0] : 0, ok[1] ? dep[1] : 0);
  for (int o = 16; o > 0; o >>= 1) maxdep = max(maxdep, __shfl_xor_sync(MK_FULL, maxdep, o));
  const int rfirst = min(wbase, nvec - 1) / rep, rlast = min(wbase + 15, nvec - 1) / rep;
  // the warp's tree rows' paths into shared memory once (their loads all in flight together), so
  // that the row-by-row reads below wait on no L2 round trip for a path entry
#if defined(DFLASH_PATH_TABLE)
  const bool tabled = gather && wactive && maxdep < MK_PMAX;
#else
  const bool tabled = false;
  unsigned short(*ptab)[16][MK_PMAX] = nullptr;
  unsigned short(*pdep)[16] = nullptr;
#endif
  if (tabled) {
    const int per = maxdep + 1, nrows = rlast - rfirst + 1, cells = nrows * per;
    for (int e = lane; e < cells; e += 32) {
      const int lr = e / per, i = e - lr * per;
      ptab[warp][lr][i] = (unsigned short)__ldg(ancestors + (long long)(rfirst + lr) * stride +
                                                ANC_BITS + 1 + i);
    }
    if (lane < nrows)
      pdep[warp][lane] = (unsigned short)__ldg(ancestors + (long long)(rfirst + lane) * stride +
                                               ANC_BITS);
    __syncwarp();
  }

  float acc[MAX_D / 8][4];
#pragma unroll
  for (int t = 0; t < MAX_D / 8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
  float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.0f, 0.0f};

#if defined(DFLASH_ATTN_PIPELINE)
  if (k0 < k1) mk_stage_async(ks, kb, g, cap, d, k0, min(MK_TK, k1 - k0), tid);
  mk_cp_commit();
#endif
  for (int t0 = k0; t0 < k1; t0 += MK_TK) {
    const int nt = min(MK_TK, k1 - t0);
    __syncthreads();  // every warp is done with the tile before
#if defined(DFLASH_ATTN_PIPELINE)
    mk_stage_async(vs, vb, g, cap, d, t0, nt, tid);  // this tile's values, while its keys are scored
    mk_cp_commit();
    mk_cp_wait<1>();  // this tile's keys have landed
#else
    {  // stage the tile: 16-byte units, zero past the split
      const int upr = d >> 3, units = MK_TK * upr;
      for (int u0 = tid; u0 < units; u0 += 4 * MK_WARPS * 32) {
        uint4 kx[4], vx[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int u = u0 + i * MK_WARPS * 32, j = u / upr, c = (u - j * upr) * 8;
          kx[i] = vx[i] = make_uint4(0u, 0u, 0u, 0u);
          if (u < units && j < nt) {
            const long long off = ((long long)g * cap + t0 + j) * d + c;
            kx[i] = __ldcg((const uint4*)(kb + off));
            vx[i] = __ldcg((const uint4*)(vb + off));
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int u = u0 + i * MK_WARPS * 32, j = u / upr, c = (u - j * upr) * 8;
          if (u < units) {
            *(uint4*)(ks + j * MK_STR + c) = kx[i];
            *(uint4*)(vs + j * MK_STR + c) = vx[i];
          }
        }
      }
    }
#endif
    __syncthreads();
#if !defined(DFLASH_ATTN_PIPELINE)
    if (!wactive) continue;  // (in the pipeline every warp reaches every barrier of the tile)
#endif
    // tile-relative step keys a bent row reads row by row
    const int glo = past - t0, ghi = past + maxdep - t0;
    const bool gtile = gather && ghi >= 0 && glo < nt;
    float sc[MK_TK / 8][4];
#pragma unroll
    for (int j8 = 0; j8 < MK_TK / 8; ++j8) {
      if (MK_PIPE_IDLE) break;
      sc[j8][0] = sc[j8][1] = sc[j8][2] = sc[j8][3] = 0.0f;
      if (j8 * 8 >= nt) continue;
      if (gtile && j8 * 8 + 7 >= glo && j8 * 8 <= ghi) {
        // per tree row of the warp: its own key for column gq, one mma, its rows kept
        for (int r = rfirst; r <= rlast; ++r) {
          const unsigned int* ar = ancestors + (long long)r * stride;
          const int dr = tabled ? (int)pdep[warp][r - rfirst] : mk_depth_of(r, rr, dep, ar);
          const unsigned short* tab = tabled ? ptab[warp][r - rfirst] : nullptr;
          const int row = mk_row_of(tab, ar, dr, t0 + j8 * 8 + gq, past, t0 + nt);
          // the row from the staged tile when it is there (a step row of this tile), else L1/L2
          const bool staged = row >= t0 && row < t0 + nt;
          const bf16_t* kr = staged ? ks + (row - t0) * MK_STR + 2 * tq
                                    : kb + ((long long)g * cap + max(row, 0)) * d + 2 * tq;
          float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int kk = 0; kk < MAX_D / 16; ++kk) {
            if (kk >= ksteps) continue;
            unsigned int b0 = 0u, b1 = 0u;
            if (staged) {
              b0 = *(const unsigned int*)(kr + 16 * kk);
              b1 = *(const unsigned int*)(kr + 16 * kk + 8);
            } else if (row >= 0) {
              b0 = mk_ldg32(kr + 16 * kk);
              b1 = mk_ldg32(kr + 16 * kk + 8);
            }
            mk_mma(tmp, qa[kk], b0, b1);
          }
          if (ok[0] && rr[0] == r) {
            sc[j8][0] = tmp[0];
            sc[j8][1] = tmp[1];
          }
          if (ok[1] && rr[1] == r) {
            sc[j8][2] = tmp[2];
            sc[j8][3] = tmp[3];
          }
        }
      } else {
        const bf16_t* kr = ks + (j8 * 8 + gq) * MK_STR + 2 * tq;
#pragma unroll
        for (int kk = 0; kk < MAX_D / 16; ++kk) {
          if (kk >= ksteps) continue;
          const unsigned int b0 = *(const unsigned int*)(kr + 16 * kk);
          const unsigned int b1 = *(const unsigned int*)(kr + 16 * kk + 8);
          mk_mma(sc[j8], qa[kk], b0, b1);
        }
      }
    }
#if defined(DFLASH_ATTN_PIPELINE)
    __syncthreads();  // every warp has scored the keys: the next tile's keys may come in
    if (t0 + MK_TK < k1) mk_stage_async(ks, kb, g, cap, d, t0 + MK_TK, min(MK_TK, k1 - t0 - MK_TK), tid);
    mk_cp_commit();
#endif
    // masks, the tile's max per vector (inactive warps: every score hidden)
    float tmax[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int j8 = 0; j8 < MK_TK / 8; ++j8) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hf = e >> 1, jr = j8 * 8 + 2 * tq + (e & 1), j = t0 + jr;
        bool vis = ok[hf] && jr < nt && in_window(j, past, rr[hf], window);
        if (vis && j >= past) {
          const int i = j - past;
          vis = logical ? i <= dep[hf]
                        : ((ancestors[(long long)rr[hf] * stride + (i >> 5)] >> (i & 31)) & 1u) != 0u;
        }
        const float x = vis ? sc[j8][e] * scale : NEG_INF;
        sc[j8][e] = x;
        tmax[hf] = fmaxf(tmax[hf], x);
      }
    }
    float alpha[2];
    unsigned int pk[MK_TK / 8][2];
    mk_tile_softmax(sc, tmax, mrow, lrow, alpha, pk);
    mk_rescale<MAX_D / 8>(acc, alpha);
#if defined(DFLASH_ATTN_PIPELINE)
    mk_cp_wait<1>();  // this tile's values have landed (the next keys may still be coming)
    __syncthreads();
#endif
    // output += p·v, 16 keys a chunk in key order
#pragma unroll
    for (int kc = 0; kc < MK_TK / 16; ++kc) {
      if (MK_PIPE_IDLE || kc * 16 >= nt) continue;
      const unsigned int pa[4] = {pk[2 * kc][0], pk[2 * kc][1], pk[2 * kc + 1][0],
                                  pk[2 * kc + 1][1]};
      if (gtile && kc * 16 + 15 >= glo && kc * 16 <= ghi) {
        for (int r = rfirst; r <= rlast; ++r) {
          const unsigned int* ar = ancestors + (long long)r * stride;
          const int dr = tabled ? (int)pdep[warp][r - rfirst] : mk_depth_of(r, rr, dep, ar);
          const unsigned short* tab = tabled ? ptab[warp][r - rfirst] : nullptr;
          const int jb = t0 + kc * 16 + 2 * tq, lim = t0 + nt;
          const int rw[4] = {mk_row_of(tab, ar, dr, jb, past, lim),
                             mk_row_of(tab, ar, dr, jb + 1, past, lim),
                             mk_row_of(tab, ar, dr, jb + 8, past, lim),
                             mk_row_of(tab, ar, dr, jb + 9, past, lim)};
          const bool mine0 = ok[0] && rr[0] == r, mine1 = ok[1] && rr[1] == r;
#pragma unroll
          for (int t = 0; t < MAX_D / 8; ++t) {
            if (t >= dtiles) continue;
            unsigned int h[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int c = 8 * t + gq;
              h[i] = (rw[i] >= t0 && rw[i] < t0 + nt)
                         ? (unsigned int)vs[(rw[i] - t0) * MK_STR + c]
                         : rw[i] >= 0 ? (unsigned int)__ldg(vb + ((long long)g * cap + rw[i]) * d + c)
                                      : 0u;
            }
            float tmp[4] = {acc[t][0], acc[t][1], acc[t][2], acc[t][3]};
            mk_mma(tmp, pa, h[0] | (h[1] << 16), h[2] | (h[3] << 16));
            if (mine0) {
              acc[t][0] = tmp[0];
              acc[t][1] = tmp[1];
            }
            if (mine1) {
              acc[t][2] = tmp[2];
              acc[t][3] = tmp[3];
            }
          }
        }
      } else {
        const bf16_t* vr = vs + (kc * 16 + 2 * tq) * MK_STR + gq;
#pragma unroll
        for (int t = 0; t < MAX_D / 8; ++t) {
          if (t >= dtiles) continue;
          const unsigned int b0 =
              (unsigned int)vr[8 * t] | ((unsigned int)vr[MK_STR + 8 * t] << 16);
          const unsigned int b1 =
              (unsigned int)vr[8 * MK_STR + 8 * t] | ((unsigned int)vr[9 * MK_STR + 8 * t] << 16);
          mk_mma(acc[t], pa, b0, b1);
        }
      }
    }
  }
#if defined(DFLASH_ATTN_PIPELINE)
  mk_cp_wait<0>();
#endif
  if (wactive)
    mk_write_records<MAX_D / 8>(part, ok, rr, head, n, splits, s, d, dtiles, tq, mrow, lrow, acc);
  if (counters == nullptr || !last_of_column(counters, splits)) return;
  for (int w = grp * MK_VPB + warp; w < min(nvec, (grp + 1) * MK_VPB); w += MK_WARPS)
    merge_vector(part, (g * rep + w % rep) * n + w / rep, n, H, d, splits, out);
  if (tid == 0) counters[blockIdx.x] = 0u;
}

extern "C" __global__ void tree_attn_mma_bf16(const bf16_t* q, const bf16_t* kb,
                                              const bf16_t* vb, const unsigned int* meta,
                                              const unsigned int* anc, int stride, int logical,
                                              int n, int H, int KV, int cap, int d, int chunk,
                                              int groups, float scale, float* part,
                                              unsigned int* counters, bf16_t* out, int window) {
  PDL_ENTRY();
  // `logical` bit 1: the row kernel (tree_attn_rows.cu) took the splits of cached keys alone
  if ((logical & 2) && ((int)blockIdx.y + 1) * chunk <= (int)meta[0]) return;
  tree_attn_mma(q, kb, vb, meta, anc, stride, logical & 1, n, H, KV, cap, d, chunk, groups, scale,
                part, counters, out, window);
}

// group_attn_mma: bit for bit what tree_attn_mma computes for each of its vectors, with one warp's
// worth of vectors (16, the mma's A rows: tree row first, head second, as there) per block and the
// tile's work spread over the block's four warps: warp w scores keys 16w .. 16w + 15 (the same mma
// chain per key), the raw scores meet in shared memory, every warp runs the tile's masks and
// online softmax over all of them in the same order (so every warp holds the same p, max and sum),
// and warp w accumulates output channels w·D/4 .. (w + 1)·D/4 − 1 (the same mma chain per channel
// tile). tree_attn_mma leaves a warp alone with ~1,500 dependent instructions a tile, and three of
// four warps idle for a one-row step. Compiled per head width D. Masks: the one-row step sees
// every key up to its own; wider steps read the ancestor bits (keys by step row: `logical` 0 — the
// host sends keys by position here only for one row, whose path is never bent).
template <int D, int KT>
__device__ void group_attn_mma(const bf16_t* q, const bf16_t* kb, const bf16_t* vb,
                               const unsigned int* meta, const unsigned int* ancestors, int stride,
                               int n, int H, int KV, int cap, int chunk, int groups, float scale,
                               float* part, unsigned int* counters, bf16_t* out, int window) {
  constexpr int KSTEPS = D / 16, TPW = D / 8 / MK_WARPS, UPR = D / 8;
  constexpr int UPT = KT * UPR / (MK_WARPS * 32);  // 16-byte units a thread stages a tile
  constexpr int STR = D > MAX_D ? D + 8 : MK_STR;  // shared row stride: conflict-free fragments
  constexpr int J8W = KT / 8 / MK_WARPS;            // 8-key score columns a warp
  __shared__ __align__(16) bf16_t ks[KT * STR];
  __shared__ __align__(16) bf16_t vs[KT * STR];
  __shared__ float ss[16][KT + 4];  // raw scores: vector (A row), key of the tile
  const int rep = H / KV, g = blockIdx.x / groups, grp = blockIdx.x % groups, s = blockIdx.y;
  const int splits = gridDim.y, nvec = rep * n;
  const int past = (int)meta[0], total = past + n;
  const int k1 = min(total, s * chunk + chunk);
  const int k0 = window_tile_start(s * chunk, past, window, KT);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;
  bool ok[2];
  int rr[2], head[2];
  mk_lane_vectors(grp * 16, gq, nvec, rep, g, ok, rr, head);
  unsigned int qa[KSTEPS][4];
  mk_load_q<D>(qa, q, ok, rr, head, n, tq);
  float acc[TPW][4];
#pragma unroll
  for (int t = 0; t < TPW; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
  float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.0f, 0.0f};
  for (int t0 = k0; t0 < k1; t0 += KT) {
    const int nt = min(KT, k1 - t0);
    __syncthreads();
    {  // stage the tile (zero past the split), a thread's loads all in flight at once
      uint4 kx[UPT], vx[UPT];
#pragma unroll
      for (int i = 0; i < UPT; ++i) {
        const int u = tid + i * MK_WARPS * 32, j = u / UPR, c = (u - j * UPR) * 8;
        kx[i] = vx[i] = make_uint4(0u, 0u, 0u, 0u);
        if (j < nt) {
          const long long off = ((long long)g * cap + t0 + j) * D + c;
          kx[i] = __ldcg((const uint4*)(kb + off));
          vx[i] = __ldcg((const uint4*)(vb + off));
        }
      }
#pragma unroll
      for (int i = 0; i < UPT; ++i) {
        const int u = tid + i * MK_WARPS * 32, j = u / UPR, c = (u - j * UPR) * 8;
        *(uint4*)(ks + j * STR + c) = kx[i];
        *(uint4*)(vs + j * STR + c) = vx[i];
      }
    }
    __syncthreads();
    // this warp's keys: J8W 8-key mma columns, channel steps in order
#pragma unroll
    for (int h8 = 0; h8 < J8W; ++h8) {
      const int j8 = J8W * warp + h8;
      float c4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const bf16_t* kr = ks + (j8 * 8 + gq) * STR + 2 * tq;
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        const unsigned int b0 = *(const unsigned int*)(kr + 16 * kk);
        const unsigned int b1 = *(const unsigned int*)(kr + 16 * kk + 8);
        mk_mma(c4, qa[kk], b0, b1);
      }
      ss[gq][j8 * 8 + 2 * tq] = c4[0];
      ss[gq][j8 * 8 + 2 * tq + 1] = c4[1];
      ss[gq + 8][j8 * 8 + 2 * tq] = c4[2];
      ss[gq + 8][j8 * 8 + 2 * tq + 1] = c4[3];
    }
    __syncthreads();
    // masks and the tile's max per vector, as tree_attn_mma (every warp alike)
    float sc[KT / 8][4];
    float tmax[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int j8 = 0; j8 < KT / 8; ++j8) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hf = e >> 1, jr = j8 * 8 + 2 * tq + (e & 1), j = t0 + jr;
        bool vis = ok[hf] && jr < nt && in_window(j, past, rr[hf], window);
        if (vis && j >= past && n > 1) {
          const int i = j - past;
          vis = ((ancestors[(long long)rr[hf] * stride + (i >> 5)] >> (i & 31)) & 1u) != 0u;
        }
        const float x = vis ? ss[gq + 8 * hf][jr] * scale : NEG_INF;
        sc[j8][e] = x;
        tmax[hf] = fmaxf(tmax[hf], x);
      }
    }
    float alpha[2];
    unsigned int pk[KT / 8][2];
    mk_tile_softmax<KT>(sc, tmax, mrow, lrow, alpha, pk);
    mk_rescale<TPW>(acc, alpha);
    // this warp's channel tiles += p·v, 16 keys a chunk in key order
#pragma unroll
    for (int kc = 0; kc < KT / 16; ++kc) {
      if (kc * 16 >= nt) continue;
      const unsigned int pa[4] = {pk[2 * kc][0], pk[2 * kc][1], pk[2 * kc + 1][0],
                                  pk[2 * kc + 1][1]};
      const bf16_t* vr = vs + (kc * 16 + 2 * tq) * STR + gq;
#pragma unroll
      for (int i = 0; i < TPW; ++i) {
        const int t = warp * TPW + i;
        const unsigned int b0 = (unsigned int)vr[8 * t] | ((unsigned int)vr[STR + 8 * t] << 16);
        const unsigned int b1 =
            (unsigned int)vr[8 * STR + 8 * t] | ((unsigned int)vr[9 * STR + 8 * t] << 16);
        mk_mma(acc[i], pa, b0, b1);
      }
    }
  }
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    if (!ok[hf]) continue;
    const long long vec = (long long)head[hf] * n + rr[hf];
    float* rec = part + (vec * splits + s) * (long long)(D + 2);
    if (warp == 0 && tq == 0) {
      rec[0] = mrow[hf];
      rec[1] = lrow[hf];
    }
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
      const int t = warp * TPW + i;
      rec[2 + 8 * t + 2 * tq] = acc[i][2 * hf];
      rec[3 + 8 * t + 2 * tq] = acc[i][2 * hf + 1];
    }
  }
  if (counters == nullptr || !last_of_column(counters, splits)) return;
  for (int w = grp * 16 + warp; w < min(nvec, (grp + 1) * 16); w += MK_WARPS)
    merge_vector<bf16_t, (D > MAX_D ? D : MAX_D)>(part, (g * rep + w % rep) * n + w / rep, n, H, D,
                                                  splits, out);
  if (tid == 0) counters[blockIdx.x] = 0u;
}

#define GROUP_ATTN_MMA(D, KT)                                                                  \
  extern "C" __global__ void group_attn_mma_bf16_d##D(                                        \
      const bf16_t* q, const bf16_t* kb, const bf16_t* vb, const unsigned int* meta,           \
      const unsigned int* anc, int stride, int n, int H, int KV, int cap, int chunk,           \
      int groups, float scale, float* part, unsigned int* counters, bf16_t* out, int window) { \
    PDL_ENTRY();                                                                               \
    group_attn_mma<D, KT>(q, kb, vb, meta, anc, stride, n, H, KV, cap, chunk, groups, scale,   \
                          part, counters, out, window);                                        \
  }
GROUP_ATTN_MMA(64, MK_TK)
GROUP_ATTN_MMA(128, MK_TK)
// 256-wide heads (the Qwen3.5 / Qwen3.6 hybrids' gated attention): 32-key tiles (two to a 64-key
// split) keep the staged tiles in static shared memory; no general kernel to match
GROUP_ATTN_MMA(256, 32)
