// tree_attn_rows: the bf16 tensor-core tree attention for keys by step row (the ancestor bits) at
// a compile-time head width D, for the wide verifies (DDTree trees) at long context. Appended
// after tree_attn_mma.cu at compile time (it uses that file's mk_* helpers).
//
// Why: session 26's profile of Qwen3-8B's DDTree-64 verify at context 2048 found tree_attn_mma at
// 97 µs a layer (a third of the step), issuing ~2,400 instructions a warp for each 64-key tile
// (runtime head width: predicated loops, divisions in the staging; masks on every score; element
// loads of the operands), two blocks an SM, the tiles staged through registers between barriers.
//
// Contract: tree_attn_mma's with `logical` 0 — the same blocks (one kv head, one split, 64 query
// vectors: 16 a warp, tree row first, head second), the same records, and per vector the same
// arithmetic: scores by the same mma chain over 16-channel steps in order, the same masks (−inf),
// mk_tile_softmax per 64-key tile, p·v by the same mma chain over 16-key chunks in key order. So
// its output equals tree_attn_mma's bit for bit at the same chunk (GPU test
// `row_kernel_gives_the_general_kernels_bits`). What changes is how the block gets there:
// - K and V tiles move by cp.async into two buffers (dynamic shared memory), two tiles ahead,
//   with one barrier pair a tile and no staging registers (zero-filled past the split);
// - a tile of cached keys alone that every row sees (full, below `past`, no window) is scored
//   without masks, the eight 8-key score chains interleaved (channel steps outer: each chain
//   still runs its channel steps in order);
// - K and V operands come by ldmatrix (.trans for V), the same values in the same registers as
//   tree_attn_mma's element loads;
// - __launch_bounds__ asks for three blocks an SM.
// The one-row step (an AR token, keys by step row) may take (DFLASH_ATTN_ROWS=3, opt-in: measured
// no faster than the few-vector kernel in session 29) tree_attn_rows_one_bf16_d<D>: the same
// arithmetic (its one row sees every key up to its own: no ancestor reads) with
// group_attn_mma's fused merge — the last block of a kv head's splits merges its vectors' records
// (`counters`, `out`), so no combine kernel follows. With keys by
// position (`logical`, `--bit-exact`) it takes the splits of cached keys alone — where every row
// sees the same keys and tree_attn_mma reads none row by row — and leaves the splits holding step
// keys to tree_attn_mma (launched after it with `logical` bit 1).

#define RW_STAGES 2  // tile buffers (each: K then V, MK_TK rows of D + 8)
#ifndef RW_MIN_BLOCKS
#define RW_MIN_BLOCKS 3  // resident blocks an SM asked of the compiler (DFLASH_ATTN_ROWS_BLOCKS)
#endif

// Four 8×8 bf16 matrices from shared memory (each lane names one row), transposed for V.
template <bool TRANS>
__device__ __forceinline__ void rw_ldsm4(unsigned int* r, const bf16_t* p) {
  const unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
  if (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// Keys t0 .. t0 + nt − 1 of kv head g (K and V) into one tile buffer, zero past nt.
template <int D>
__device__ __forceinline__ void rw_stage(bf16_t* ks, bf16_t* vs, const bf16_t* kb,
                                         const bf16_t* vb, int g, int cap, int t0, int nt,
                                         int tid) {
  constexpr int UPR = D / 8, UNITS = MK_TK * UPR, STR = D + 8;
#pragma unroll
  for (int u0 = 0; u0 < UNITS; u0 += MK_WARPS * 32) {
    const int u = u0 + tid, j = u / UPR, c = (u % UPR) * 8;
    const bool in = j < nt;
    const long long off = ((long long)g * cap + t0 + (in ? j : 0)) * D + c;
    mk_cp16(ks + j * STR + c, kb + off, in);
    mk_cp16(vs + j * STR + c, vb + off, in);
  }
}

template <int D, bool ONE>
__device__ void tree_attn_rows(const bf16_t* q, const bf16_t* kb, const bf16_t* vb,
                               const unsigned int* meta, const unsigned int* ancestors, int stride,
                               int n, int H, int KV, int cap, int chunk, int groups, float scale,
                               float* part, int window, int logical, unsigned int* counters,
                               bf16_t* out) {
  constexpr int KSTEPS = D / 16, DT = D / 8, STR = D + 8, TILE = MK_TK * STR;
  extern __shared__ __align__(16) bf16_t rw_smem[];  // RW_STAGES × (K tile, V tile)
  const int rep = H / KV;
  const int g = blockIdx.x / groups, grp = blockIdx.x % groups, s = blockIdx.y;
  const int splits = gridDim.y;
  const int nvec = rep * n;
  const int past = (int)meta[0];
  const int total = past + n;
  const int k1 = min(total, s * chunk + chunk);
  const int k0 = window_tile_start(s * chunk, past, window, MK_TK);
  if (logical && s * chunk + chunk > past) return;  // tree_attn_mma's split (keys by position)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;
  const int wbase = grp * MK_VPB + warp * 16;
  const bool wactive = wbase < nvec;
  bool ok[2];
  int rr[2], head[2];
  mk_lane_vectors(wbase, gq, nvec, rep, g, ok, rr, head);
  const int ntiles = k0 < k1 ? (k1 - k0 + MK_TK - 1) / MK_TK : 0;
  // the first tiles' copies go out before q is loaded
#pragma unroll
  for (int i = 0; i < RW_STAGES; ++i) {
    if (i < ntiles) {
      bf16_t* ks = rw_smem + i * 2 * TILE;
      rw_stage<D>(ks, ks + TILE, kb, vb, g, cap, k0 + i * MK_TK, min(MK_TK, k1 - k0 - i * MK_TK),
                  tid);
    }
    mk_cp_commit();
  }
  unsigned int qa[KSTEPS][4];
  mk_load_q<D>(qa, q, ok, rr, head, n, tq);
  float acc[DT][4];
#pragma unroll
  for (int t = 0; t < DT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
  float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.0f, 0.0f};

  for (int i = 0; i < ntiles; ++i) {
    const int t0 = k0 + i * MK_TK, nt = min(MK_TK, k1 - t0);
    const bf16_t* ks = rw_smem + (i % RW_STAGES) * 2 * TILE;
    const bf16_t* vs = ks + TILE;
    mk_cp_wait<RW_STAGES - 1>();  // this thread's copies of tile i have landed
    __syncthreads();              // and every thread's
    if (wactive) {
      // every row sees every key of the tile: no mask, every chunk full
      const bool plain = nt == MK_TK && t0 + MK_TK <= past && window <= 0;
      float sc[MK_TK / 8][4];
#pragma unroll
      for (int j8 = 0; j8 < MK_TK / 8; ++j8) sc[j8][0] = sc[j8][1] = sc[j8][2] = sc[j8][3] = 0.0f;
      // scores: per 8-key column j8 the chain over channel steps kk in order; ldmatrix gives a
      // lane key j8·8 + gq's channels 16·kk + 2·tq (+1, +8, +9) for steps kk and kk + 1
      const bf16_t* krow = ks + (lane & 7) * STR + 8 * (lane >> 3);
#pragma unroll
      for (int kk = 0; kk < KSTEPS; kk += 2) {
#pragma unroll
        for (int j8 = 0; j8 < MK_TK / 8; ++j8) {
          if (!plain && j8 * 8 >= nt) continue;  // tree_attn_mma leaves such columns 0
          unsigned int b[4];
          rw_ldsm4<false>(b, krow + j8 * 8 * STR + 16 * kk);
          mk_mma(sc[j8], qa[kk], b[0], b[1]);
          mk_mma(sc[j8], qa[kk + 1], b[2], b[3]);
        }
      }
      float tmax[2] = {NEG_INF, NEG_INF};
      if (plain) {
#pragma unroll
        for (int j8 = 0; j8 < MK_TK / 8; ++j8) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float x = ok[e >> 1] ? sc[j8][e] * scale : NEG_INF;
            sc[j8][e] = x;
            tmax[e >> 1] = fmaxf(tmax[e >> 1], x);
          }
        }
      } else {
#pragma unroll
        for (int j8 = 0; j8 < MK_TK / 8; ++j8) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int hf = e >> 1, jr = j8 * 8 + 2 * tq + (e & 1), j = t0 + jr;
            bool vis = ok[hf] && jr < nt && in_window(j, past, rr[hf], window);
            if (!ONE && vis && j >= past) {  // (one row: its own key is the only step key)
              const int a = j - past;
              vis = ((__ldg(ancestors + (long long)rr[hf] * stride + (a >> 5)) >> (a & 31)) & 1u) != 0u;
            }
            const float x = vis ? sc[j8][e] * scale : NEG_INF;
            sc[j8][e] = x;
            tmax[hf] = fmaxf(tmax[hf], x);
          }
        }
      }
      float alpha[2];
      unsigned int pk[MK_TK / 8][2];
      mk_tile_softmax(sc, tmax, mrow, lrow, alpha, pk);
      mk_rescale<DT>(acc, alpha);
      // output += p·v, 16 keys a chunk in key order; ldmatrix.trans gives a lane keys
      // kc·16 + 2·tq (+1, +8, +9) of channel 8·t + gq for channel tiles t and t + 1
      const bf16_t* vrow = vs + ((lane & 7) + 8 * ((lane >> 3) & 1)) * STR + 8 * (lane >> 4);
#pragma unroll
      for (int kc = 0; kc < MK_TK / 16; ++kc) {
        if (!plain && kc * 16 >= nt) continue;
        const unsigned int pa[4] = {pk[2 * kc][0], pk[2 * kc][1], pk[2 * kc + 1][0],
                                    pk[2 * kc + 1][1]};
#pragma unroll
        for (int t = 0; t < DT; t += 2) {
          unsigned int b[4];
          rw_ldsm4<true>(b, vrow + kc * 16 * STR + 8 * t);
          mk_mma(acc[t], pa, b[0], b[1]);
          mk_mma(acc[t + 1], pa, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with the buffer: tile i + RW_STAGES may come in
    if (i + RW_STAGES < ntiles) {
      const int tn = t0 + RW_STAGES * MK_TK;
      bf16_t* kn = rw_smem + (i % RW_STAGES) * 2 * TILE;
      rw_stage<D>(kn, kn + TILE, kb, vb, g, cap, tn, min(MK_TK, k1 - tn), tid);
    }
    mk_cp_commit();  // (an empty group past the last tile keeps the wait's count)
  }
  mk_cp_wait<0>();
  if (wactive)
    mk_write_records<DT>(part, ok, rr, head, n, splits, s, D, DT, tq, mrow, lrow, acc);
  if (ONE && last_of_column(counters, splits)) {
    // the last block of this kv head's splits: its vectors' records merged, as group_attn_mma's
    for (int w = grp * MK_VPB + warp; w < min(nvec, (grp + 1) * MK_VPB); w += MK_WARPS)
      merge_vector<bf16_t, (D > MAX_D ? D : MAX_D)>(part, (g * rep + w % rep) * n + w / rep, n, H,
                                                    D, splits, out);
    if (tid == 0) counters[blockIdx.x] = 0u;
  }
}

#define TREE_ATTN_ROWS(D)                                                                       \
  extern "C" __global__ void __launch_bounds__(MK_WARPS * 32, RW_MIN_BLOCKS) tree_attn_rows_bf16_d##D(      \
      const bf16_t* q, const bf16_t* kb, const bf16_t* vb, const unsigned int* meta,            \
      const unsigned int* anc, int stride, int n, int H, int KV, int cap, int chunk,            \
      int groups, float scale, float* part, int window, int logical) {                          \
    PDL_ENTRY();                                                                                \
    tree_attn_rows<D, false>(q, kb, vb, meta, anc, stride, n, H, KV, cap, chunk, groups, scale, \
                             part, window, logical, nullptr, nullptr);                          \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(MK_WARPS * 32, RW_MIN_BLOCKS)                    \
      tree_attn_rows_one_bf16_d##D(const bf16_t* q, const bf16_t* kb, const bf16_t* vb,         \
                                   const unsigned int* meta, const unsigned int* anc, int stride, \
                                   int n, int H, int KV, int cap, int chunk, int groups,        \
                                   float scale, float* part, int window, int logical,           \
                                   unsigned int* counters, bf16_t* out) {                       \
    PDL_ENTRY();                                                                                \
    tree_attn_rows<D, true>(q, kb, vb, meta, anc, stride, n, H, KV, cap, chunk, groups, scale,  \
                            part, window, logical, counters, out);                              \
  }
TREE_ATTN_ROWS(128)
TREE_ATTN_ROWS(64)
