// Fused DFlash block attention (forward and backward), compiled at run time by NVRTC with
// `#define HD <head dim>` in front. Mirrors the CPU reference in flash_block.rs line by line:
// - q [nb, H, R, HD], block keys/values bkv [2, nb, KV, R, HD], context keys/values
//   ckv [2, nb, KV, S, HD] (plane 0 keys, plane 1 values); R = n·B rows, row k·B + j is slot j of
//   block k; head h reads kv group h / (H / KV).
// - Row i of block k sees context keys 0 .. vis[bi·n + k] (clamped to S) and the B keys of its
//   own block; one softmax over both parts; scores scale·q·k; all arithmetic in f32.
// - No atomics: every output element is written by exactly one thread, so results do not depend
//   on scheduling (the backward is deterministic).
// Thread mapping of the row kernels: one thread block per (block k, sequence·kv group), one
// thread per (head of the group, slot) row; rows = (H / KV)·B ≤ blockDim.x.
// The forward also serves causal attention (the target's): `causal` hides own-block key u from
// slot j < u, the last block may be partial (R need not be a multiple of B), and the block keys
// are rows BOFF + k·B .. of a tensor with BR rows per (sequence, kv group) — for the target the
// context tensor itself (BR = S, BOFF = the cached prefix). `first[bi]` hides the keys before it
// from every row of sequence bi except a row's own key (left padding: a padding query sees only
// itself); 0 for the DFlash drafter. The backward takes the DFlash case only (full blocks, not
// causal, BR = R, BOFF = 0, first = 0).

typedef unsigned short bf16_t;
#define NEG_INF __int_as_float(0xff800000)
#define KT 16  // keys per shared tile in the row kernels; the block size must not exceed it
#define KC 32  // context keys per thread block in the key-parallel backward
#define HDP (HD + 1)  // padded row stride where threads read different rows

__device__ __forceinline__ float ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16_t* p, long long i) {
  return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void st(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16_t* p, long long i, float v) {
  unsigned int u = __float_as_uint(v);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (finite values)
  p[i] = (bf16_t)(u >> 16);
}

struct RowMap {
  int bi, g, k, hh, i, n, rep, rows, nv;
  bool active;
  long long qoff, coff, boff, cplane, bplane;
};

__device__ __forceinline__ RowMap row_map(const unsigned int* vis, int nb, int H, int KV, int R,
                                          int S, int B, int BR, int BOFF, int t) {
  RowMap m;
  m.k = blockIdx.x;
  const int bg = blockIdx.y;
  m.bi = bg / KV;
  m.g = bg % KV;
  m.n = (R + B - 1) / B;
  m.rep = H / KV;
  m.rows = m.rep * B;
  m.active = t < m.rows && m.k * B + t % B < R;
  m.hh = m.g * m.rep + (m.active ? t / B : 0);
  m.i = m.active ? m.k * B + t % B : 0;
  m.qoff = (((long long)m.bi * H + m.hh) * R + m.i) * HD;
  m.nv = min((int)vis[m.bi * m.n + m.k], S);
  m.cplane = (long long)nb * KV * S * HD;
  m.bplane = (long long)nb * KV * BR * HD;
  m.coff = ((long long)m.bi * KV + m.g) * S * HD;
  m.boff = (((long long)m.bi * KV + m.g) * BR + BOFF + (long long)m.k * B) * HD;
  return m;
}

// Tile `tile` of a row's keys: context tiles first, then (tile == ctiles) the own block.
template <typename T>
__device__ __forceinline__ int load_tile(const RowMap& m, int tile, int ctiles, const T* ckv,
                                         const T* bkv, int B, int R, float* ks, float* vs,
                                         bool values) {
  const bool own = tile == ctiles;
  const int cnt = own ? min(B, R - m.k * B) : min(KT, m.nv - tile * KT);
  const T* src = own ? bkv : ckv;
  const long long off = own ? m.boff : m.coff + (long long)tile * KT * HD;
  const long long plane = own ? m.bplane : m.cplane;
  __syncthreads();
  for (int e = threadIdx.x; e < cnt * HD; e += blockDim.x) {
    ks[e] = ld(src, off + e);
    if (values) vs[e] = ld(src, plane + off + e);
  }
  __syncthreads();
  return cnt;
}

template <typename T>
__device__ void fwd_impl(const T* q, const T* ckv, const T* bkv, const unsigned int* vis,
                         const unsigned int* first, T* out, int nb, int H, int KV, int R, int S,
                         int B, int BR, int BOFF, int causal, float scale) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + KT * HD;
  const RowMap m = row_map(vis, nb, H, KV, R, S, B, BR, BOFF, threadIdx.x);
  const int slot = threadIdx.x % B;
  float qv[HD], o[HD];
#pragma unroll
  for (int d = 0; d < HD; ++d) {
    qv[d] = m.active ? ld(q, m.qoff + d) * scale : 0.f;
    o[d] = 0.f;
  }
  float mx = NEG_INF, l = 0.f;
  const int ctiles = (m.nv + KT - 1) / KT;
  const int f = (int)first[m.bi];
  // context tiles wholly before `first` hold no visible key: start at the tile holding it
  const int t0 = f >= m.nv ? ctiles : f / KT;
  for (int tile = t0; tile <= ctiles; ++tile) {
    const int cnt = load_tile(m, tile, ctiles, ckv, bkv, B, R, ks, vs, true);
    if (!m.active) continue;
    const bool own = tile == ctiles;
    // own-block keys past the slot are hidden in causal attention
    const int seen = (causal && own) ? min(cnt, slot + 1) : cnt;
    // the row of key u in the context tensor
    const int base = own ? BOFF + m.k * B : tile * KT;
    float sc[KT];
    float tmax = NEG_INF;
#pragma unroll
    for (int u = 0; u < KT; ++u) {
      float a = NEG_INF;
      if (u < seen && (base + u >= f || (own && u == slot))) {
        a = 0.f;
#pragma unroll
        for (int d = 0; d < HD; ++d) a = fmaf(qv[d], ks[u * HD + d], a);
      }
      sc[u] = a;
      tmax = fmaxf(tmax, a);
    }
    if (tmax == NEG_INF) continue;  // nothing visible in this tile
    const float mn = fmaxf(mx, tmax);
    const float corr = __expf(mx - mn);
    l *= corr;
#pragma unroll
    for (int d = 0; d < HD; ++d) o[d] *= corr;
#pragma unroll
    for (int u = 0; u < KT; ++u) {
      if (sc[u] != NEG_INF) {
        const float p = __expf(sc[u] - mn);
        l += p;
#pragma unroll
        for (int d = 0; d < HD; ++d) o[d] = fmaf(p, vs[u * HD + d], o[d]);
      }
    }
    mx = mn;
  }
  if (m.active) {
    const float inv = 1.f / l;
#pragma unroll
    for (int d = 0; d < HD; ++d) st(out, m.qoff + d, o[d] * inv);
  }
}

// Row-parallel backward: the log-normaliser and D = dO·O of each row (kept for the other two
// kernels), then dq = scale · Σ_t dS_t k_t with dS_t = P_t (dO·v_t − D).
template <typename T>
__device__ void bwd_q_impl(const T* q, const T* dout, const T* o, const T* ckv, const T* bkv,
                           const unsigned int* vis, T* dq, float* lse_out, float* dd_out, int nb,
                           int H, int KV, int R, int S, int B, float scale) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + KT * HD;
  const RowMap m = row_map(vis, nb, H, KV, R, S, B, R, 0, threadIdx.x);
  float qv[HD], dov[HD], acc[HD];
  float dd = 0.f;
#pragma unroll
  for (int d = 0; d < HD; ++d) {
    qv[d] = m.active ? ld(q, m.qoff + d) * scale : 0.f;
    dov[d] = m.active ? ld(dout, m.qoff + d) : 0.f;
    if (m.active) dd = fmaf(dov[d], ld(o, m.qoff + d), dd);
    acc[d] = 0.f;
  }
  const int ctiles = (m.nv + KT - 1) / KT;
  float mx = NEG_INF, l = 0.f;
  for (int tile = 0; tile <= ctiles; ++tile) {
    const int cnt = load_tile(m, tile, ctiles, ckv, bkv, B, R, ks, vs, false);
    if (!m.active) continue;
    for (int u = 0; u < cnt; ++u) {
      float a = 0.f;
#pragma unroll
      for (int d = 0; d < HD; ++d) a = fmaf(qv[d], ks[u * HD + d], a);
      const float mn = fmaxf(mx, a);
      l = l * __expf(mx - mn) + __expf(a - mn);
      mx = mn;
    }
  }
  const float lse = mx + __logf(l);
  const long long row = m.qoff / HD;
  if (m.active) {
    lse_out[row] = lse;
    dd_out[row] = dd;
  }
  for (int tile = 0; tile <= ctiles; ++tile) {
    const int cnt = load_tile(m, tile, ctiles, ckv, bkv, B, R, ks, vs, true);
    if (!m.active) continue;
    for (int u = 0; u < cnt; ++u) {
      float a = 0.f, dp = 0.f;
#pragma unroll
      for (int d = 0; d < HD; ++d) {
        a = fmaf(qv[d], ks[u * HD + d], a);
        dp = fmaf(dov[d], vs[u * HD + d], dp);
      }
      const float ds = __expf(a - lse) * (dp - dd);
#pragma unroll
      for (int d = 0; d < HD; ++d) acc[d] = fmaf(ds, ks[u * HD + d], acc[d]);
    }
  }
  if (m.active) {
#pragma unroll
    for (int d = 0; d < HD; ++d) st(dq, m.qoff + d, acc[d] * scale);
  }
}

// The rows of block `k` of sequence `bi`, every head of kv group `g`, into shared memory: scaled
// queries, output gradients, log-normalisers and D (row r = head g·rep + r / B, slot r % B).
template <typename T>
__device__ __forceinline__ void load_block_rows(const T* q, const T* dout, const float* lse,
                                                const float* ddv, float* qs, float* dos,
                                                float* ls, float* dl, int bi, int g, int k,
                                                int H, int R, int B, int rep, float scale) {
  const int rows = rep * B;
  for (int e = threadIdx.x; e < rows * HD; e += blockDim.x) {
    const int r = e / HD, d = e % HD;
    const long long row = ((long long)bi * H + g * rep + r / B) * R + (long long)k * B + r % B;
    qs[e] = ld(q, row * HD + d) * scale;
    dos[e] = ld(dout, row * HD + d);
    if (d == 0) {
      ls[r] = lse[row];
      dl[r] = ddv[row];
    }
  }
}

// Gradients of a block's own keys and values: one thread block per (block, sequence·kv group),
// reducing over the block's rows of every head of the group.
template <typename T>
__device__ void bwd_blk_impl(const T* q, const T* dout, const T* bkv, const float* lse,
                             const float* ddv, T* dbkv, int nb, int H, int KV, int R, int B,
                             float scale) {
  extern __shared__ float smem[];
  const int k = blockIdx.x, bg = blockIdx.y, bi = bg / KV, g = bg % KV;
  const int rep = H / KV, rows = rep * B;
  float* qs = smem;                // [rows][HD], scaled
  float* dos = qs + rows * HD;     // [rows][HD]
  float* kb = dos + rows * HD;     // [B][HDP]
  float* vb = kb + B * HDP;        // [B][HDP]
  float* ps = vb + B * HDP;        // [rows][B]
  float* dss = ps + rows * B;      // [rows][B]
  float* ls = dss + rows * B;      // [rows]
  float* dl = ls + rows;           // [rows]
  const long long bplane = (long long)nb * KV * R * HD;
  const long long boff = (((long long)bi * KV + g) * R + (long long)k * B) * HD;
  load_block_rows(q, dout, lse, ddv, qs, dos, ls, dl, bi, g, k, H, R, B, rep, scale);
  for (int e = threadIdx.x; e < B * HD; e += blockDim.x) {
    const int u = e / HD, d = e % HD;
    kb[u * HDP + d] = ld(bkv, boff + e);
    vb[u * HDP + d] = ld(bkv, bplane + boff + e);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < rows * B; e += blockDim.x) {
    const int r = e / B, u = e % B;
    float a = 0.f, dp = 0.f;
    for (int d = 0; d < HD; ++d) {
      a = fmaf(qs[r * HD + d], kb[u * HDP + d], a);
      dp = fmaf(dos[r * HD + d], vb[u * HDP + d], dp);
    }
    const float p = __expf(a - ls[r]);
    ps[e] = p;
    dss[e] = p * (dp - dl[r]);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < B * HD; e += blockDim.x) {
    const int u = e / HD, d = e % HD;
    float ak = 0.f, av = 0.f;
    for (int r = 0; r < rows; ++r) {
      ak = fmaf(dss[r * B + u], qs[r * HD + d], ak);
      av = fmaf(ps[r * B + u], dos[r * HD + d], av);
    }
    st(dbkv, boff + e, ak);
    st(dbkv, bplane + boff + e, av);
  }
}

// Gradients of the context keys and values: one thread block of KC threads per (KC keys,
// sequence·kv group), one thread per key, looping over every block that sees the tile.
template <typename T>
__device__ void bwd_kv_impl(const T* q, const T* dout, const T* ckv, const unsigned int* vis,
                            const float* lse, const float* ddv, T* dckv, int nb, int H, int KV,
                            int R, int S, int B, float scale) {
  extern __shared__ float smem[];
  const int bg = blockIdx.y, bi = bg / KV, g = bg % KV;
  const int rep = H / KV, rows = rep * B, n = R / B;
  const int t = threadIdx.x, j0 = blockIdx.x * KC, j = j0 + t;
  float* ks = smem;               // [KC][HDP]
  float* vs = ks + KC * HDP;      // [KC][HDP]
  float* qs = vs + KC * HDP;      // [rows][HD], scaled
  float* dos = qs + rows * HD;    // [rows][HD]
  float* ls = dos + rows * HD;    // [rows]
  float* dl = ls + rows;          // [rows]
  const long long cplane = (long long)nb * KV * S * HD;
  const long long coff = ((long long)bi * KV + g) * S * HD;
  const int cnt = min(KC, S - j0);
  for (int e = t; e < KC * HD; e += blockDim.x) {
    const int u = e / HD, d = e % HD;
    const bool in = u < cnt;
    ks[u * HDP + d] = in ? ld(ckv, coff + (long long)j0 * HD + e) : 0.f;
    vs[u * HDP + d] = in ? ld(ckv, cplane + coff + (long long)j0 * HD + e) : 0.f;
  }
  float dk[HD], dv[HD];
#pragma unroll
  for (int d = 0; d < HD; ++d) {
    dk[d] = 0.f;
    dv[d] = 0.f;
  }
  for (int kk = 0; kk < n; ++kk) {
    const int nvk = min((int)vis[bi * n + kk], S);
    if (nvk <= j0) continue;  // uniform over the thread block
    __syncthreads();
    load_block_rows(q, dout, lse, ddv, qs, dos, ls, dl, bi, g, kk, H, R, B, rep, scale);
    __syncthreads();
    if (j >= nvk) continue;
    for (int r = 0; r < rows; ++r) {
      float a = 0.f, dp = 0.f;
#pragma unroll
      for (int d = 0; d < HD; ++d) {
        a = fmaf(qs[r * HD + d], ks[t * HDP + d], a);
        dp = fmaf(dos[r * HD + d], vs[t * HDP + d], dp);
      }
      const float p = __expf(a - ls[r]);
      const float ds = p * (dp - dl[r]);
#pragma unroll
      for (int d = 0; d < HD; ++d) {
        dv[d] = fmaf(p, dos[r * HD + d], dv[d]);
        dk[d] = fmaf(ds, qs[r * HD + d], dk[d]);
      }
    }
  }
  if (j < S) {
#pragma unroll
    for (int d = 0; d < HD; ++d) {
      st(dckv, coff + (long long)j * HD + d, dk[d]);
      st(dckv, cplane + coff + (long long)j * HD + d, dv[d]);
    }
  }
}

#if HD % 4 == 0
// The split backward (the default): KP = 4 threads share a row (or a context key), thread p of
// the group holding dims p, p + 4, ... (so a warp's reads of one shared row hit distinct banks);
// dot products are summed over the group with two xor shuffles, after which all four threads
// hold the same value. Fewer registers per thread than the one-thread-per-row kernels above, so
// more warps per SM; the context-key kernel also splits the blocks it loops over into
// gridDim.z parts and writes f32 partial sums that flash_block_sum adds in part order (no
// atomics, deterministic).
#define KP 4
#define DP (HD / KP)

__device__ __forceinline__ unsigned int group_mask() {
  return 0xfu << ((threadIdx.x & 31) & ~3);
}
__device__ __forceinline__ float group_sum(float v, unsigned int mask) {
  v += __shfl_xor_sync(mask, v, 1);
  v += __shfl_xor_sync(mask, v, 2);
  return v;
}

template <typename T>
__device__ void bwd_q4_impl(const T* q, const T* dout, const T* o, const T* ckv, const T* bkv,
                            const unsigned int* vis, T* dq, float* lse_out, float* dd_out, int nb,
                            int H, int KV, int R, int S, int B, float scale) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + KT * HD;
  const int p = threadIdx.x % KP;
  const RowMap m = row_map(vis, nb, H, KV, R, S, B, R, 0, threadIdx.x / KP);
  const unsigned int gm = group_mask();
  float qv[DP], dov[DP], acc[DP];
  float dd = 0.f;
#pragma unroll
  for (int i = 0; i < DP; ++i) {
    const int d = p + KP * i;
    qv[i] = m.active ? ld(q, m.qoff + d) * scale : 0.f;
    dov[i] = m.active ? ld(dout, m.qoff + d) : 0.f;
    if (m.active) dd = fmaf(dov[i], ld(o, m.qoff + d), dd);
    acc[i] = 0.f;
  }
  if (m.active) dd = group_sum(dd, gm);
  const int ctiles = (m.nv + KT - 1) / KT;
  float mx = NEG_INF, l = 0.f;
  for (int tile = 0; tile <= ctiles; ++tile) {
    const int cnt = load_tile(m, tile, ctiles, ckv, bkv, B, R, ks, vs, false);
    if (!m.active) continue;
    for (int u = 0; u < cnt; ++u) {
      float a = 0.f;
#pragma unroll
      for (int i = 0; i < DP; ++i) a = fmaf(qv[i], ks[u * HD + p + KP * i], a);
      a = group_sum(a, gm);
      const float mn = fmaxf(mx, a);
      l = l * __expf(mx - mn) + __expf(a - mn);
      mx = mn;
    }
  }
  const float lse = mx + __logf(l);
  const long long row = m.qoff / HD;
  if (m.active && p == 0) {
    lse_out[row] = lse;
    dd_out[row] = dd;
  }
  for (int tile = 0; tile <= ctiles; ++tile) {
    const int cnt = load_tile(m, tile, ctiles, ckv, bkv, B, R, ks, vs, true);
    if (!m.active) continue;
    for (int u = 0; u < cnt; ++u) {
      float a = 0.f, dp = 0.f;
#pragma unroll
      for (int i = 0; i < DP; ++i) {
        a = fmaf(qv[i], ks[u * HD + p + KP * i], a);
        dp = fmaf(dov[i], vs[u * HD + p + KP * i], dp);
      }
      a = group_sum(a, gm);
      dp = group_sum(dp, gm);
      const float ds = __expf(a - lse) * (dp - dd);
#pragma unroll
      for (int i = 0; i < DP; ++i) acc[i] = fmaf(ds, ks[u * HD + p + KP * i], acc[i]);
    }
  }
  if (m.active) {
#pragma unroll
    for (int i = 0; i < DP; ++i) st(dq, m.qoff + p + KP * i, acc[i] * scale);
  }
}

// Context keys j0 .. j0 + KC of (sequence, kv group) blockIdx.y, KP threads per key, over the
// blocks blockIdx.z·per .. of the sequence; partial dK, dV (f32) into part[blockIdx.z].
template <typename T>
__device__ void bwd_kv4_impl(const T* q, const T* dout, const T* ckv, const unsigned int* vis,
                             const float* lse, const float* ddv, float* part, int nb, int H,
                             int KV, int R, int S, int B, int per, float scale) {
  extern __shared__ float smem[];
  const int bg = blockIdx.y, bi = bg / KV, g = bg % KV;
  const int rep = H / KV, rows = rep * B, n = R / B;
  const int p = threadIdx.x % KP, j0 = blockIdx.x * KC, j = j0 + threadIdx.x / KP;
  const int k0 = blockIdx.z * per, k1 = min(n, k0 + per);
  float* qs = smem;             // [rows][HD], scaled
  float* dos = qs + rows * HD;  // [rows][HD]
  float* ls = dos + rows * HD;  // [rows]
  float* dl = ls + rows;        // [rows]
  const long long cplane = (long long)nb * KV * S * HD;
  const long long coff = ((long long)bi * KV + g) * S * HD;
  const bool in = j < S;
  const unsigned int gm = group_mask();
  float kr[DP], vr[DP], dk[DP], dv[DP];
#pragma unroll
  for (int i = 0; i < DP; ++i) {
    const long long e = coff + (long long)j * HD + p + KP * i;
    kr[i] = in ? ld(ckv, e) : 0.f;
    vr[i] = in ? ld(ckv, cplane + e) : 0.f;
    dk[i] = 0.f;
    dv[i] = 0.f;
  }
  for (int kk = k0; kk < k1; ++kk) {
    const int nvk = min((int)vis[bi * n + kk], S);
    if (nvk <= j0) continue;  // uniform over the thread block
    __syncthreads();
    load_block_rows(q, dout, lse, ddv, qs, dos, ls, dl, bi, g, kk, H, R, B, rep, scale);
    __syncthreads();
    // every thread computes (the shuffles need the whole group); keys past nvk do not add
    const bool live = j < nvk;
    for (int r = 0; r < rows; ++r) {
      float a = 0.f, dp = 0.f;
#pragma unroll
      for (int i = 0; i < DP; ++i) {
        a = fmaf(qs[r * HD + p + KP * i], kr[i], a);
        dp = fmaf(dos[r * HD + p + KP * i], vr[i], dp);
      }
      a = group_sum(a, gm);
      dp = group_sum(dp, gm);
      if (!live) continue;
      const float pr = __expf(a - ls[r]);
      const float ds = pr * (dp - dl[r]);
#pragma unroll
      for (int i = 0; i < DP; ++i) {
        dv[i] = fmaf(pr, dos[r * HD + p + KP * i], dv[i]);
        dk[i] = fmaf(ds, qs[r * HD + p + KP * i], dk[i]);
      }
    }
  }
  if (in) {
    float* dst = part + (long long)blockIdx.z * 2 * cplane;
#pragma unroll
    for (int i = 0; i < DP; ++i) {
      const long long e = coff + (long long)j * HD + p + KP * i;
      dst[e] = dk[i];
      dst[cplane + e] = dv[i];
    }
  }
}
#endif

#define ENTRY(TY, SUF)                                                                           \
  extern "C" __global__ void flash_block_fwd_##SUF(const TY* q, const TY* ckv, const TY* bkv,    \
      const unsigned int* vis, const unsigned int* first, TY* out, int nb, int H, int KV, int R, \
      int S, int B, int BR, int BOFF, int causal, float sc) {                                    \
    fwd_impl<TY>(q, ckv, bkv, vis, first, out, nb, H, KV, R, S, B, BR, BOFF, causal, sc);        \
  }                                                                                              \
  extern "C" __global__ void flash_block_bwd_q_##SUF(const TY* q, const TY* dout, const TY* o,   \
      const TY* ckv, const TY* bkv, const unsigned int* vis, TY* dq, float* lse, float* dd,      \
      int nb, int H, int KV, int R, int S, int B, float sc) {                                    \
    bwd_q_impl<TY>(q, dout, o, ckv, bkv, vis, dq, lse, dd, nb, H, KV, R, S, B, sc);              \
  }                                                                                              \
  extern "C" __global__ void flash_block_bwd_blk_##SUF(const TY* q, const TY* dout,              \
      const TY* bkv, const float* lse, const float* dd, TY* dbkv, int nb, int H, int KV, int R,  \
      int B, float sc) {                                                                         \
    bwd_blk_impl<TY>(q, dout, bkv, lse, dd, dbkv, nb, H, KV, R, B, sc);                          \
  }                                                                                              \
  extern "C" __global__ void flash_block_bwd_kv_##SUF(const TY* q, const TY* dout,               \
      const TY* ckv, const unsigned int* vis, const float* lse, const float* dd, TY* dckv,       \
      int nb, int H, int KV, int R, int S, int B, float sc) {                                    \
    bwd_kv_impl<TY>(q, dout, ckv, vis, lse, dd, dckv, nb, H, KV, R, S, B, sc);                   \
  }

#if HD % 4 == 0
#define ENTRY4(TY, SUF)                                                                          \
  extern "C" __global__ void flash_block_bwd_q4_##SUF(const TY* q, const TY* dout, const TY* o,  \
      const TY* ckv, const TY* bkv, const unsigned int* vis, TY* dq, float* lse, float* dd,      \
      int nb, int H, int KV, int R, int S, int B, float sc) {                                    \
    bwd_q4_impl<TY>(q, dout, o, ckv, bkv, vis, dq, lse, dd, nb, H, KV, R, S, B, sc);             \
  }                                                                                              \
  extern "C" __global__ void flash_block_bwd_kv4_##SUF(const TY* q, const TY* dout,              \
      const TY* ckv, const unsigned int* vis, const float* lse, const float* dd, float* part,    \
      int nb, int H, int KV, int R, int S, int B, int per, float sc) {                           \
    bwd_kv4_impl<TY>(q, dout, ckv, vis, lse, dd, part, nb, H, KV, R, S, B, per, sc);             \
  }                                                                                              \
  extern "C" __global__ void flash_block_sum_##SUF(const float* part, TY* out, long long len,    \
      int parts) {                                                                               \
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < len;                \
         e += (long long)gridDim.x * blockDim.x) {                                               \
      float s = 0.f;                                                                             \
      for (int z = 0; z < parts; ++z) s += part[(long long)z * len + e];                         \
      st(out, e, s);                                                                             \
    }                                                                                            \
  }
#else
#define ENTRY4(TY, SUF)
#endif

ENTRY(float, f32)
ENTRY(bf16_t, bf16)
ENTRY4(float, f32)
ENTRY4(bf16_t, bf16)
