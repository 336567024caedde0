// Kernels of the device-side decoding step (compiled at run time by NVRTC). Every length they
// need is read from device memory, so one captured CUDA graph serves every step of its shape.
//
// The step's metadata `meta` (u32) is [past, tokens[n], rope_rows[2n], parents[n]]: `past` rows
// are committed in the cache, the step's n rows are written at past..past+n, and parents[i] < i
// (as i32; −1 for a root) is row i's parent inside the step (a causal block is the chain
// parents[i] = i − 1).
//
// - kv_append: k, v [KV, n, d] into the cache buffers [KV, cap, d] at rows past..past+n.
// - tree_attn_partial: attention of q [H, n, d] over keys 0..past+n of kv head g = h / (H/KV):
//   query row r sees every committed key and the step rows that are r or its ancestors. Keys are
//   cut into fixed chunks of `chunk` keys (split s = keys s·chunk ..); each block takes one kv
//   head, one split and up to VPB query vectors (vector v of kv head g is head g·rep + v / n, row
//   v mod n), stages 32-key tiles of K and V in shared memory (16-byte loads, all in flight at
//   once), and keeps an online softmax per
//   vector (one warp per vector, a lane per key for the scores, a lane per channel for the
//   values). Scores and softmax are f32 whatever the dtype. It writes, per (vector, split), the
//   running max, the sum of exponentials and the unnormalised output (m = −inf where the split
//   saw no visible key).
// - tree_attn_combine: merges the splits of each vector (in split order) and writes the output
//   in the o_proj layout [n, H, d] in the compute dtype. Given a counters buffer, the partial
//   kernel does this itself: the last block of each (kv head, vector group) to finish merges it
//   (same arithmetic, one launch fewer).
// A row's result depends only on its own visible keys, the chunk size and its q: not on how many
// rows the step has.
typedef unsigned short bf16_t;
// PDL_ENTRY(): pdl.cuh, prepended at compile time (crate::pdl::with_prelude)
#define NEG_INF __int_as_float(0xff800000)
#define TK 32
#define WARPS 8
#define VPW 2
#define VPB (WARPS * VPW)
#define MAX_D 128
#define MAX_ROWS 288  // = step::MAX_STEP_ROWS: a DDTree of budget 256 plus its root
#define ANC_BITS (MAX_ROWS / 32)
#define ANC_WORDS (ANC_BITS + 1 + MAX_ROWS)  // = step::ANCESTOR_WORDS: bits, depth, path

__device__ __forceinline__ float ldv(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float ldv(const bf16_t* p, long long i) {
  return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void stv(float* p, long long i, float v) { p[i] = v; }
// v's bf16 bits, rounded to nearest even (finite values)
__device__ __forceinline__ unsigned int bf16_bits(float v) {
  unsigned int u = __float_as_uint(v);
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}
__device__ __forceinline__ void stv(bf16_t* p, long long i, float v) { p[i] = (bf16_t)bf16_bits(v); }

template <typename T>
__device__ void kv_append(const T* k, const T* v, T* kb, T* vb, const unsigned int* meta, int KV,
                          int n, int cap, int d) {
  const long long total = (long long)KV * n * d;
  const long long past = meta[0];
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const long long c = i % d, rn = i / d;
    const long long r = rn % n, g = rn / n;
    const long long dst = (g * cap + past + r) * d + c;
    kb[dst] = k[i];
    vb[dst] = v[i];
  }
}

extern "C" __global__ void kv_append_f32(const float* k, const float* v, float* kb, float* vb,
                                         const unsigned int* meta, int KV, int n, int cap, int d) {
  PDL_ENTRY();
  kv_append(k, v, kb, vb, meta, KV, n, cap, d);
}
extern "C" __global__ void kv_append_bf16(const bf16_t* k, const bf16_t* v, bf16_t* kb,
                                          bf16_t* vb, const unsigned int* meta, int KV, int n,
                                          int cap, int d) {
  PDL_ENTRY();
  kv_append(k, v, kb, vb, meta, KV, n, cap, d);
}

// step_mask_f32: the additive mask [rows, cap] of a step whose attention reads the whole cache
// buffer through GEMMs (the hybrids' gated attention, whose heads are wider than this file's
// kernels stage): row r sees key j when j < past, or when j = past + t for a step row t that is r
// or one of its ancestors (`anc`, tree_ancestors' bits); every other key (the step's other rows,
// the rows past the step) gets −inf. One thread per element.
extern "C" __global__ void step_mask_f32(const unsigned int* meta, const unsigned int* anc,
                                         int rows, int cap, float* out) {
  PDL_ENTRY();
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)rows * cap) return;
  const int r = (int)(idx / cap), j = (int)(idx % cap);
  const int past = (int)meta[0];
  float m = NEG_INF;
  if (j < past) {
    m = 0.0f;
  } else if (j < past + rows) {
    const int t = j - past;
    if ((anc[(long long)r * ANC_WORDS + (t >> 5)] >> (t & 31)) & 1u) m = 0.0f;
  }
  out[idx] = m;
}

// tree_ancestors: per step row r, `stride` = ANC_WORDS words: bit b of word w set when step row
// 32·w + b is r or an ancestor of r; then r's depth (0 for a root); then its path, the step rows of
// its ancestors-or-self by depth (root first). Rows walked once per step, not per layer or block.
// One thread per row; parents staged in shared memory.
extern "C" __global__ void tree_ancestors(const unsigned int* meta, int n, unsigned int* anc) {
  PDL_ENTRY();
  __shared__ int par[MAX_ROWS];
  const int* parents = (const int*)(meta + 1 + 3 * n);
  for (int i = threadIdx.x; i < n; i += blockDim.x) par[i] = parents[i];
  __syncthreads();
  for (int r = threadIdx.x; r < n; r += blockDim.x) {
    unsigned int* out = anc + (long long)r * ANC_WORDS;
    unsigned int bits[ANC_BITS];
    for (int w = 0; w < ANC_BITS; ++w) bits[w] = 0u;
    int depth = -1;
    int x = r;
    for (int steps = 0; x >= 0 && x < n && steps < n; ++steps) {
      bits[x >> 5] |= 1u << (x & 31);
      ++depth;
      x = par[x];
    }
    for (int w = 0; w < ANC_BITS; ++w) out[w] = bits[w];
    out[ANC_BITS] = (unsigned int)depth;
    x = r;
    for (int t = depth; t >= 0; --t) {
      out[ANC_BITS + 1 + t] = (unsigned int)x;
      x = par[x];
    }
  }
}

// a 16-byte unit of the cache as floats (the first argument names the cache's type): 4 f32 or
// 8 bf16 values, exactly what ldv reads one by one
__device__ __forceinline__ void unpack_unit(const float*, uint4 u, float* dst) {
  dst[0] = __uint_as_float(u.x);
  dst[1] = __uint_as_float(u.y);
  dst[2] = __uint_as_float(u.z);
  dst[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void unpack_unit(const bf16_t*, uint4 u, float* dst) {
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    dst[2 * i] = __uint_as_float(w[i] << 16);
    dst[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// part [H·n, splits, d + 2] f32: per (vector, split) the running max, the sum of exponentials and
// the unnormalised output. merge_vector: vector vec = h·n + r from its split records, merged by one
// warp (lane c + 32·i holds channel c + 32·i) in split order — the only place the splits meet, one
// arithmetic for the fused merges and the combine kernel: M = max of the maxima; per split with a
// visible key w = expf(m_s − M), sum = fma(w, l_s, sum), a = fma(w, o_s, a), in split order;
// out = a / sum. The records' loads are issued 8 splits ahead of the sums (the loop is unrolled);
// a split's max, weight and sum are read once per warp and shared by shuffles.
template <typename T, int MD = MAX_D>
__device__ void merge_vector(const float* part, int vec, int n, int H, int d, int splits, T* out) {
  const int lane = threadIdx.x & 31, dpl = d >> 5;
  const int h = vec / n, r = vec % n;
  const long long rs = d + 2;
  const float* p = part + (long long)vec * splits * rs;
  float mx = NEG_INF;
  for (int s = lane; s < splits; s += 32) mx = fmaxf(mx, __ldcg(p + s * rs));
  mx = warp_max(mx);
  float sum = 0.0f, a[MD / 32];
#pragma unroll
  for (int t = 0; t < MD / 32; ++t) a[t] = 0.0f;
  for (int s0 = 0; s0 < splits; s0 += 32) {
    const int s = s0 + lane;
    const float ms = s < splits ? __ldcg(p + s * rs) : NEG_INF;
    const float ls = s < splits ? __ldcg(p + s * rs + 1) : 0.0f;
    const float w = ms == NEG_INF ? 0.0f : expf(ms - mx);
    const int cnt = min(32, splits - s0);
#pragma unroll 8
    for (int j = 0; j < cnt; ++j) {
      const float mj = __shfl_sync(0xffffffffu, ms, j);
      const float wj = __shfl_sync(0xffffffffu, w, j);
      const float lj = __shfl_sync(0xffffffffu, ls, j);
      if (mj == NEG_INF) continue;  // the split saw no visible key (warp-uniform)
      sum = fmaf(wj, lj, sum);
      const float* ps = p + (long long)(s0 + j) * rs + 2 + lane;
#pragma unroll
      for (int t = 0; t < MD / 32; ++t)
        if (t < dpl) a[t] = fmaf(wj, __ldcg(ps + 32 * t), a[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < MD / 32; ++t)
    if (t < dpl) stv(out, ((long long)r * H + h) * d + lane + 32 * t, sum > 0.0f ? a[t] / sum : 0.0f);
}

// With the fused merge: whether this block is the last of its column (blockIdx.x: a kv head and
// vector group) to finish, counted in `counters` — its records written and fenced before it counts,
// and the others' visible to it after. Every thread of the block calls it.
__device__ __forceinline__ bool last_of_column(unsigned int* counters, int splits) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0)
    last = atomicAdd(&counters[blockIdx.x], 1u) == (unsigned int)(splits - 1);
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// The 16-byte units of keys and values of cache rows t0 .. t0 + nt of kv head g that thread tid
// stages (unit tid + i · WARPS · 32 of the tile).
template <typename T, int UPT>
__device__ __forceinline__ void tile_load(const T* kb, const T* vb, int g, int cap, int t0,
                                          int nt, int d, int tid, uint4* pk, uint4* pv) {
  constexpr int EPU = 16 / sizeof(T);
  const int units = nt * d / EPU;
  const uint4* kt = (const uint4*)(kb + ((long long)g * cap + t0) * d);
  const uint4* vt = (const uint4*)(vb + ((long long)g * cap + t0) * d);
#pragma unroll
  for (int i = 0; i < UPT; ++i) {
    const int u = tid + i * WARPS * 32;
    if (u < units) {
      pk[i] = __ldcg(kt + u);
      pv[i] = __ldcg(vt + u);
    }
  }
}

// A sliding window (`window` > 0: the drafter's windowed layers; its block's rows sit at consecutive
// positions past, past + 1, …): step row r sees cached key j < past iff past + r − j < window.
// Keys before past − window + 1 are hidden from every row, so a split starts at the first of its
// tiles that holds a visible key (the tiles skipped would add nothing: the same numbers).
__device__ __forceinline__ bool in_window(int j, int past, int row, int window) {
  return window <= 0 || j >= past || past + row - j < window;
}
__device__ __forceinline__ int window_tile_start(int k0, int past, int window, int tile) {
  const int lo = past - window + 1;
  return (window <= 0 || lo <= k0) ? k0 : k0 + (lo - k0) / tile * tile;
}

// With `counters` (one per block column, zero between launches): the last split of each
// (kv head, vector group) to finish merges the group's records into `out` (the combine, fused)
// and resets its counter.
template <typename T, bool VEC>
__device__ void tree_attn_partial(const T* q, const T* kb, const T* vb, const unsigned int* meta,
                                  const unsigned int* ancestors, int stride, int logical, int n,
                                  int H, int KV, int cap, int d, int chunk, int groups,
                                  float scale, float* part, unsigned int* counters, T* out,
                                  int window) {
  __shared__ float ks[TK][MAX_D + 1];
  __shared__ float vs[TK][MAX_D];
  __shared__ float qs[VPB][MAX_D];
  __shared__ unsigned int anc[VPB][ANC_BITS];
  const int rep = H / KV;
  const int g = blockIdx.x / groups, grp = blockIdx.x % groups, s = blockIdx.y;
  const int splits = gridDim.y;
  const int nvec = rep * n, v0 = grp * VPB;
  const int past = (int)meta[0];
  const int total = past + n;
  const int k1 = min(total, s * chunk + chunk);
  const int k0 = window_tile_start(s * chunk, past, window, TK);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int dpl = d >> 5;
  const long long qbase = (long long)g * rep * n;  // q vectors of kv head g are contiguous
  // K and V tiles move in 16-byte units, all of a thread's loads in flight at once (a tile's
  // rows are contiguous in the cache); the loads live only while staging. With DFLASH_TILE_PREFETCH
  // (DFLASH_ATTN_PREFETCH=1, opt-in: built in session 15, no faster in session 19) the next tile's loads
  // are issued before the current tile is scored, and the first tile's before q is staged
  constexpr int EPU = 16 / sizeof(T);                   // elements per unit
  constexpr int UPT = TK * MAX_D / EPU / (WARPS * 32);  // units per thread, at most
  uint4 pk[UPT], pv[UPT];
#if defined(DFLASH_TILE_PREFETCH)
  if (VEC && k0 < k1) tile_load<T, UPT>(kb, vb, g, cap, k0, min(TK, k1 - k0), d, tid, pk, pv);
#endif
  if (k0 < total) {  // a split past the keys only writes its empty record
    for (int e = tid; e < VPB * d; e += blockDim.x) {
      const int i = e / d, c = e % d;
      qs[i][c] = (v0 + i < nvec) ? ldv(q, (qbase + v0 + i) * d + c) * scale : 0.0f;
    }
    for (int e = tid; e < VPB * ANC_BITS; e += blockDim.x) {
      const int i = e / ANC_BITS, w = e % ANC_BITS;
      anc[i][w] = (v0 + i < nvec) ? ancestors[(long long)((v0 + i) % n) * stride + w] : 0u;
    }
  }
  // logical mode: a step key's index is its position, past + depth; vector u of this warp reads
  // its path (ancestor rows by depth) from `ancestors`
  int depth[VPW];
  const unsigned int* path[VPW];
  for (int u = 0; u < VPW; ++u) {
    const int i = warp * VPW + u;
    const long long r = (v0 + i < nvec) ? (v0 + i) % n : 0;
    depth[u] = (logical && v0 + i < nvec) ? (int)ancestors[r * stride + ANC_BITS] : -1;
    path[u] = ancestors + r * stride + ANC_BITS + 1;
  }
  float m[VPW], l[VPW], acc[VPW][MAX_D / 32];
  for (int u = 0; u < VPW; ++u) {
    m[u] = NEG_INF;
    l[u] = 0.0f;
    for (int t = 0; t < MAX_D / 32; ++t) acc[u][t] = 0.0f;
  }
  for (int t0 = k0; t0 < k1; t0 += TK) {
    const int nt = min(TK, k1 - t0);
    __syncthreads();
    if (!VEC) {  // element by element: fewer registers, for the widest steps
      const T* kt = kb + ((long long)g * cap + t0) * d;
      const T* vt = vb + ((long long)g * cap + t0) * d;
      for (int e = tid; e < nt * d; e += blockDim.x) {
        const int j = e / d, c = e - j * d;
        ks[j][c] = ldv(kt, e);
        vs[j][c] = ldv(vt, e);
      }
    } else {
      const int units = nt * d / EPU;
#if !defined(DFLASH_TILE_PREFETCH)
      tile_load<T, UPT>(kb, vb, g, cap, t0, nt, d, tid, pk, pv);
#endif
#pragma unroll
      for (int i = 0; i < UPT; ++i) {
        const int u = tid + i * WARPS * 32;
        if (u < units) {
          const int e = u * EPU, j = e / d, c = e - j * d;
          unpack_unit(kb, pk[i], &ks[j][c]);
          unpack_unit(vb, pv[i], &vs[j][c]);
        }
      }
#if defined(DFLASH_TILE_PREFETCH)
      if (t0 + TK < k1) tile_load<T, UPT>(kb, vb, g, cap, t0 + TK, min(TK, k1 - t0 - TK), d, tid, pk, pv);
#endif
    }
    __syncthreads();
    // this warp's vectors share each key row: lane j scores key t0 + j for all of them
    const int key = t0 + lane;
    float sc[VPW], p[VPW];
    bool any = false;
    {
      float dot[VPW];
      bool vis[VPW];
      for (int u = 0; u < VPW; ++u) {
        const int i = warp * VPW + u;
        dot[u] = 0.0f;
        vis[u] = lane < nt && v0 + i < nvec && in_window(key, past, (v0 + i) % n, window);
        if (vis[u] && key >= past)
          vis[u] = logical ? key - past <= depth[u]
                           : ((anc[i][(key - past) >> 5] >> ((key - past) & 31)) & 1u) != 0u;
        any = any || vis[u];
      }
      if (any) {
        // a step key at its position is the ancestor row past + path[depth]: the staged row
        // itself when the path runs straight there (AR steps, chains, a tree's first branch)
        bool staged = true;
        int row[VPW];
        for (int u = 0; u < VPW; ++u) {
          row[u] = key - past;
          if (logical && key >= past && vis[u]) row[u] = (int)path[u][key - past];
          staged = staged && row[u] == key - past;
        }
        if (staged) {
          for (int c = 0; c < d; ++c) {
            const float kk = ks[lane][c];
            for (int u = 0; u < VPW; ++u) dot[u] += qs[warp * VPW + u][c] * kk;
          }
        } else {
          for (int u = 0; u < VPW; ++u) {
            if (!vis[u]) continue;
            if (row[u] == key - past) {
              for (int c = 0; c < d; ++c) dot[u] += qs[warp * VPW + u][c] * ks[lane][c];
            } else {
              const T* kr = kb + ((long long)g * cap + past + row[u]) * d;
              for (int c = 0; c < d; ++c) dot[u] += qs[warp * VPW + u][c] * ldv(kr, c);
            }
          }
        }
      }
      for (int u = 0; u < VPW; ++u) sc[u] = vis[u] ? dot[u] : NEG_INF;
    }
    bool live = false;
    for (int u = 0; u < VPW; ++u) {
      p[u] = 0.0f;
      const float tmax = warp_max(sc[u]);
      if (tmax == NEG_INF) continue;  // warp-uniform
      live = true;
      const float mn = fmaxf(m[u], tmax);
      const float alpha = (m[u] == NEG_INF) ? 0.0f : expf(m[u] - mn);
      p[u] = (sc[u] == NEG_INF) ? 0.0f : expf(sc[u] - mn);
      l[u] = l[u] * alpha + warp_sum(p[u]);
      for (int t = 0; t < MAX_D / 32; ++t) acc[u][t] *= alpha;
      m[u] = mn;
    }
    if (!live) continue;  // warp-uniform; the next tile's barrier is reached by every thread
    for (int j = 0; j < nt; ++j) {
      const int kj = t0 + j;
      if (!logical || kj < past) {
        float vv[MAX_D / 32];
        for (int t = 0; t < MAX_D / 32; ++t) vv[t] = (t < dpl) ? vs[j][lane + 32 * t] : 0.0f;
        for (int u = 0; u < VPW; ++u) {
          const float pj = __shfl_sync(0xffffffffu, p[u], j);
          for (int t = 0; t < MAX_D / 32; ++t) acc[u][t] += pj * vv[t];
        }
      } else {
        for (int u = 0; u < VPW; ++u) {
          const float pj = __shfl_sync(0xffffffffu, p[u], j);
          if (kj - past > depth[u]) continue;  // hidden from this vector (warp-uniform)
          const int node = (int)path[u][kj - past];
          if (node == kj - past) {  // the staged row
            for (int t = 0; t < MAX_D / 32; ++t)
              if (t < dpl) acc[u][t] += pj * vs[j][lane + 32 * t];
          } else {
            const T* vr = vb + ((long long)g * cap + past + node) * d;
            for (int t = 0; t < MAX_D / 32; ++t)
              if (t < dpl) acc[u][t] += pj * ldv(vr, lane + 32 * t);
          }
        }
      }
    }
  }
  for (int u = 0; u < VPW; ++u) {
    const int i = warp * VPW + u;
    if (v0 + i >= nvec) break;
    float* rec = part + ((qbase + v0 + i) * splits + s) * (long long)(d + 2);
    if (lane == 0) {
      rec[0] = m[u];
      rec[1] = l[u];
    }
    for (int t = 0; t < dpl; ++t) rec[2 + lane + 32 * t] = acc[u][t];
  }
  if (counters == nullptr || !last_of_column(counters, splits)) return;
  for (int i = warp; i < VPB; i += WARPS)
    if (v0 + i < nvec) merge_vector(part, (int)(qbase + v0 + i), n, H, d, splits, out);
  if (tid == 0) counters[blockIdx.x] = 0u;
}

// tree_attn_partial_<dtype> stages K/V with 16-byte loads; tree_attn_partial_wide_<dtype>
// element by element, with fewer registers (more blocks a multiprocessor: the faster choice for
// the widest trees, whose blocks fill the GPU several times over). Same arithmetic.
#define TREE_ATTN_PARTIAL(NAME, TY, VEC)                                                        \
  extern "C" __global__ void NAME(const TY* q, const TY* kb, const TY* vb,                     \
                                  const unsigned int* meta, const unsigned int* anc,           \
                                  int stride, int logical, int n, int H, int KV, int cap,      \
                                  int d, int chunk, int groups, float scale, float* part,      \
                                  unsigned int* counters, TY* out, int window) { PDL_ENTRY();               \
    tree_attn_partial<TY, VEC>(q, kb, vb, meta, anc, stride, logical, n, H, KV, cap, d, chunk, \
                               groups, scale, part, counters, out, window);                    \
  }
TREE_ATTN_PARTIAL(tree_attn_partial_f32, float, true)
TREE_ATTN_PARTIAL(tree_attn_partial_bf16, bf16_t, true)
TREE_ATTN_PARTIAL(tree_attn_partial_wide_f32, float, false)
TREE_ATTN_PARTIAL(tree_attn_partial_wide_bf16, bf16_t, false)

// grid (⌈H·n / 4⌉), block 4 warps, a warp per vector: out [n, H, d].
template <typename T>
__device__ void tree_attn_combine(const float* part, int n, int H, int d, int splits, T* out) {
  const int vec = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (vec < H * n) merge_vector(part, vec, n, H, d, splits, out);
}

extern "C" __global__ void tree_attn_combine_f32(const float* part, int n, int H, int d,
                                                 int splits, float* out) {
  PDL_ENTRY();
  tree_attn_combine(part, n, H, d, splits, out);
}
extern "C" __global__ void tree_attn_combine_bf16(const float* part, int n, int H, int d,
                                                  int splits, bf16_t* out) {
  PDL_ENTRY();
  tree_attn_combine(part, n, H, d, splits, out);
}
// the merge of 256-wide heads (group_attn_mma's, tree_attn_mma.cu)
extern "C" __global__ void tree_attn_combine_d256_bf16(const float* part, int n, int H, int d,
                                                       int splits, bf16_t* out) {
  PDL_ENTRY();
  const int vec = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (vec < H * n) merge_vector<bf16_t, 256>(part, vec, n, H, d, splits, out);
}

// kv_keep_rows: compaction after a tree verify, every layer at once. bufs[b] is the address of
// cache buffer b ([KV, cap, d] each, keys and values of every layer); rows base + rows[i] move
// to base + i for i ascending (rows strictly increasing, rows[i] ≥ i, so a row is read before
// anything overwrites it). One block per (buffer, kv head), a thread per channel.
template <typename T>
__device__ void kv_keep_rows(const unsigned long long* bufs, const unsigned int* rows, int m,
                             int base, int KV, int cap, int d) {
  T* b = (T*)bufs[blockIdx.x / KV];
  const long long g = blockIdx.x % KV;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    for (int i = 0; i < m; ++i) {
      const long long src = rows[i];
      if (src == i) continue;
      b[(g * cap + base + i) * d + c] = b[(g * cap + base + src) * d + c];
    }
  }
}

extern "C" __global__ void kv_keep_rows_f32(const unsigned long long* bufs,
                                            const unsigned int* rows, int m, int base, int KV,
                                            int cap, int d) {
  PDL_ENTRY();
  kv_keep_rows<float>(bufs, rows, m, base, KV, cap, d);
}
extern "C" __global__ void kv_keep_rows_bf16(const unsigned long long* bufs,
                                             const unsigned int* rows, int m, int base, int KV,
                                             int cap, int d) {
  PDL_ENTRY();
  kv_keep_rows<bf16_t>(bufs, rows, m, base, KV, cap, d);
}
