// Decoding-step kernels, compiled at run time by NVRTC. Mirrors the CPU reference in
// decode_ops.rs:
// - argmax_rows: the lowest id among each row's maxima (NaN never wins; a row with no winner
//   gives 0xffffffff and the host takes that row).
// - topk_rows: each row's k largest logits as log-probabilities (x − logsumexp), by an exact
//   radix select on order-preserving 32-bit keys; entries above the k-th key in any order, then
//   the entries equal to it with the lowest ids (ties: lower id first, as the host's heap).
//   The host sorts the k pairs. One thread block per row, blockDim.x = TPB.
// - visibility_mask: additive [n, past + n] f32 mask, 0 where query i may see key j (every past
//   key; a tree key j − past when it is i or an ancestor of i through parents[]), −inf elsewhere.
//   A causal block is the chain parents[i] = i − 1, flagged `chain` by the host so that no thread
//   walks it (a walk would cost O(n) per key: O(n³) for a long prefill).
// PDL_ENTRY(): pdl.cuh, prepended at compile time (crate::pdl::with_prelude)
#define TPB 1024
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ unsigned int fkey(float x) {
  unsigned int u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float block_max(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  __syncthreads();
  if (l == 0) red[w] = v;
  __syncthreads();
  v = (threadIdx.x < (blockDim.x >> 5)) ? red[threadIdx.x] : NEG_INF;
  if (w == 0)
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x == 0) red[0] = v;
  __syncthreads();
  return red[0];
}

__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  __syncthreads();
  if (l == 0) red[w] = v;
  __syncthreads();
  v = (threadIdx.x < (blockDim.x >> 5)) ? red[threadIdx.x] : 0.0f;
  if (w == 0)
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x == 0) red[0] = v;
  __syncthreads();
  return red[0];
}

// One pass of a block over its row: f(i, row[i], valid) for this thread's share of [0, V), called
// the same number of times by every lane of a warp (invalid lanes get valid = false), so f may use
// warp-wide intrinsics. One block reads a whole row, so a pass is bound by load latency: 16-byte
// loads, four in flight per thread (where the row is 16-byte aligned and V a multiple of 4).
template <typename F>
__device__ __forceinline__ void row_pass(const float* row, int V, F f) {
  const int lane = threadIdx.x & 31, step = blockDim.x;
  const int wbase = threadIdx.x - lane;
  if ((V & 3) == 0 && (((unsigned long long)row) & 15ull) == 0) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
    const int n4 = V >> 2;
    for (int base = wbase; base < n4; base += 4 * step) {
      float4 q[4];
      bool ok[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int j = base + u * step + lane;
        ok[u] = j < n4;
        q[u] = ok[u] ? r4[j] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = 4 * (base + u * step + lane);
        f(i, q[u].x, ok[u]);
        f(i + 1, q[u].y, ok[u]);
        f(i + 2, q[u].z, ok[u]);
        f(i + 3, q[u].w, ok[u]);
      }
    }
  } else {
    for (int base = wbase; base < V; base += 4 * step) {
      float q[4];
      bool ok[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = base + u * step + lane;
        ok[u] = i < V;
        q[u] = ok[u] ? row[i] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) f(base + u * step + lane, q[u], ok[u]);
    }
  }
}

// Warp 0 only: the largest digit d whose bins 255 down to d of hist[256] hold at least `need`
// (the serial walk from 255; d = 0 when none does, d = 255 when need = 0), and what is still needed
// inside bin d (need − the bins above d). Each lane holds eight bins; one suffix scan finds the lane.
template <typename T>
__device__ __forceinline__ void pick_digit(const T* hist, T need, unsigned int* d_out, T* left_out) {
  const int l = threadIdx.x & 31;
  T b[8];
  T s = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    b[j] = hist[l * 8 + j];
    s += b[j];
  }
  T suf = s;  // the bins of lanes >= l
  for (int o = 1; o < 32; o <<= 1) {
    const T v = __shfl_down_sync(0xffffffffu, suf, o);
    if (l + o < 32) suf += v;
  }
  const T above = suf - s;
  if (need == 0) {
    if (l == 31) {
      *d_out = 255u;
      *left_out = 0;
    }
    return;
  }
  if ((above < need && need <= suf) || (l == 0 && suf < need)) {
    T cum = above;
    int j = 7;
    for (; j > 0; --j) {
      if (cum + b[j] >= need) break;
      cum += b[j];
    }
    *d_out = (unsigned int)(l * 8 + j);
    *left_out = need > cum ? need - cum : 0;
  }
}

// The k-th largest order key of row[0..V) (1 ≤ k ≤ V) by a 4-pass radix select over 8-bit digits;
// on return sel[1] holds how many entries equal to it complete the k. Each warp counts into its
// own 256 counters of whist (blockDim.x / 32 × 256; logits crowd into a few digits, and shared
// counters every warp hits serialise), one atomic per distinct digit of the warp; the block sums
// them into hist before warp 0 picks the digit.
__device__ unsigned int kth_largest_key(const float* row, int V, unsigned int k, unsigned int* hist,
                                        unsigned int* sel, unsigned int* whist) {
  const int t = threadIdx.x;
  const unsigned int lane = t & 31;
  const int nw = blockDim.x >> 5;
  unsigned int* mine = whist + (t >> 5) * 256;
  unsigned int prefix = 0, mask = 0;
  if (t == 0) sel[1] = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = t; b < nw * 256; b += blockDim.x) whist[b] = 0;
    __syncthreads();
    row_pass(row, V, [&](int, float x, bool ok) {
      unsigned int b = 256u;
      if (ok) {
        const unsigned int key = fkey(x);
        if ((key & mask) == prefix) b = (key >> shift) & 255u;
      }
      const unsigned int peers = __match_any_sync(0xffffffffu, b);
      if (b < 256u && (unsigned int)(__ffs(peers) - 1) == lane)
        atomicAdd(&mine[b], (unsigned int)__popc(peers));
    });
    __syncthreads();
    for (int b = t; b < 256; b += blockDim.x) {
      unsigned int c = 0;
      for (int w = 0; w < nw; ++w) c += whist[w * 256 + b];
      hist[b] = c;
    }
    __syncthreads();
    if (t < 32) {
      const unsigned int need = sel[1];
      __syncwarp();
      pick_digit<unsigned int>(hist, need, &sel[0], &sel[1]);  // sel[0] = the digit
    }
    __syncthreads();
    prefix |= sel[0] << shift;
    mask |= 255u << shift;
    __syncthreads();  // sel[0] is rewritten by the next pass
  }
  return prefix;
}

extern "C" __global__ void argmax_rows(const float* x, int V, unsigned int* out) {
  PDL_ENTRY();
  __shared__ float sv[32];
  __shared__ unsigned int si[32];
  const float* row = x + (long long)blockIdx.x * V;
  float best = NEG_INF;
  unsigned int bi = 0xffffffffu;
  row_pass(row, V, [&](int i, float v, bool ok) {
    if (ok && (v > best || (v == best && (unsigned int)i < bi))) {
      best = v;
      bi = i;
    }
  });
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const unsigned int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > best || (ov == best && oi < bi)) {
      best = ov;
      bi = oi;
    }
  }
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  if (l == 0) {
    sv[w] = best;
    si[w] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int k = 1; k < (int)(blockDim.x >> 5); ++k)
      if (sv[k] > best || (sv[k] == best && si[k] < bi)) {
        best = sv[k];
        bi = si[k];
      }
    out[blockIdx.x] = bi;
  }
}

extern "C" __global__ void topk_rows(const float* x, int V, int k, float* out_val,
                                     unsigned int* out_idx) {
  PDL_ENTRY();
  __shared__ float red[32];
  __shared__ unsigned int hist[256];
  __shared__ unsigned int sel[2];  // prefix, still needed from the threshold key
  __shared__ unsigned int pos;
  __shared__ unsigned int wcnt[TPB / 32];
  __shared__ unsigned int whist[TPB / 32 * 256];
  const float* row = x + (long long)blockIdx.x * V;
  float* ov = out_val + (long long)blockIdx.x * k;
  unsigned int* oi = out_idx + (long long)blockIdx.x * k;
  const int t = threadIdx.x;

  float m = NEG_INF;
  row_pass(row, V, [&](int, float v, bool ok) {
    if (ok) m = fmaxf(m, v);
  });
  m = block_max(m, red);
  float s = 0.0f;
  row_pass(row, V, [&](int, float v, bool ok) {
    if (ok) s += expf(v - m);
  });
  const float lse = m + logf(block_sum(s, red));

  const unsigned int thr = kth_largest_key(row, V, (unsigned int)k, hist, sel, whist);
  const unsigned int ties = sel[1];
  const unsigned int above = (unsigned int)k - ties;

  if (t == 0) pos = 0;
  __syncthreads();
  row_pass(row, V, [&](int i, float v, bool ok) {
    if (ok && fkey(v) > thr) {
      const unsigned int p = atomicAdd(&pos, 1u);
      ov[p] = v - lse;
      oi[p] = i;
    }
  });
  // ties at the threshold: the lowest ids. Each warp takes a contiguous chunk of the row (read
  // coalesced), counts its ties, and writes them after those of the warps before it.
  const int nw = blockDim.x >> 5, w = t >> 5, lane = t & 31;
  const int chunk = ((V + nw - 1) / nw + 31) & ~31;
  const int lo = min(V, w * chunk), hi = min(V, lo + chunk);
  unsigned int c = 0;
  for (int base = lo; base < hi; base += 32) {
    const int i = base + lane;
    c += __popc(__ballot_sync(0xffffffffu, i < hi && fkey(row[i]) == thr));
  }
  if (lane == 0) wcnt[w] = c;
  __syncthreads();
  unsigned int r = 0;  // ties in the chunks before this warp's
  for (int j = 0; j < w; ++j) r += wcnt[j];
  for (int base = lo; base < hi && r < ties; base += 32) {
    const int i = base + lane;
    const float v = i < hi ? row[i] : 0.0f;
    const bool tie = i < hi && fkey(v) == thr;
    const unsigned int bits = __ballot_sync(0xffffffffu, tie);
    const unsigned int p = r + __popc(bits & ((1u << lane) - 1u));
    if (tie && p < ties) {
      ov[above + p] = v - lse;
      oi[above + p] = i;
    }
    r += __popc(bits);
  }
}

// topk_split_partial / topk_split_merge: the top-k of long rows spread over `splits` blocks a row
// (opt-in, DFLASH_TOPK_SPLIT=1: topk_rows gives a row one block, 15 blocks for a DDTree draft).
// partial: grid (rows, splits); block s takes the slice [s·L, min(V, (s + 1)·L)) (L a multiple of
// 4, every slice at least k long) and writes its max and Σ exp(x − max) to stats[row, s] and its k
// largest (value, id) — topk_rows's order: by key, the lower id at ties — to cand[row, s]. Every
// element of the row's top k is in its slice's top k. merge: one block a row ranks the splits·k
// candidates (rank = how many precede it) and writes the first k as log-probs, in rank order;
// lse = M + log Σ_s sum_s · exp(m_s − M), the splits in order.
extern "C" __global__ void topk_split_partial(const float* x, int V, int L, int k, float* cand_val,
                                              unsigned int* cand_idx, float* stats) {
  PDL_ENTRY();
  __shared__ float red[32];
  __shared__ unsigned int hist[256];
  __shared__ unsigned int sel[2];
  __shared__ unsigned int pos;
  __shared__ unsigned int wcnt[TPB / 32];
  __shared__ unsigned int whist[TPB / 32 * 256];
  const int split = blockIdx.y, splits = gridDim.y;
  const int lo = split * L, n = max(0, min(V, lo + L) - lo);
  const float* row = x + (long long)blockIdx.x * V + lo;
  const long long rec = (long long)blockIdx.x * splits + split;
  float* ov = cand_val + rec * k;
  unsigned int* oi = cand_idx + rec * k;
  const int t = threadIdx.x;

  float m = NEG_INF;
  row_pass(row, n, [&](int, float v, bool ok) {
    if (ok) m = fmaxf(m, v);
  });
  m = block_max(m, red);
  float sum = 0.0f;
  row_pass(row, n, [&](int, float v, bool ok) {
    if (ok) sum += expf(v - m);
  });
  sum = block_sum(sum, red);
  if (t == 0) {
    stats[2 * rec] = m;
    stats[2 * rec + 1] = sum;
  }

  const unsigned int thr = kth_largest_key(row, n, (unsigned int)k, hist, sel, whist);
  const unsigned int ties = sel[1];
  const unsigned int above = (unsigned int)k - ties;
  if (t == 0) pos = 0;
  __syncthreads();
  row_pass(row, n, [&](int i, float v, bool ok) {
    if (ok && fkey(v) > thr) {
      const unsigned int p = atomicAdd(&pos, 1u);
      ov[p] = v;
      oi[p] = (unsigned int)(lo + i);
    }
  });
  const int nw = blockDim.x >> 5, w = t >> 5, lane = t & 31;
  const int chunk = ((n + nw - 1) / nw + 31) & ~31;
  const int clo = min(n, w * chunk), chi = min(n, clo + chunk);
  unsigned int c = 0;
  for (int b = clo; b < chi; b += 32) {
    const int i = b + lane;
    c += __popc(__ballot_sync(0xffffffffu, i < chi && fkey(row[i]) == thr));
  }
  if (lane == 0) wcnt[w] = c;
  __syncthreads();
  unsigned int r = 0;
  for (int j = 0; j < w; ++j) r += wcnt[j];
  for (int b = clo; b < chi && r < ties; b += 32) {
    const int i = b + lane;
    const float v = i < chi ? row[i] : 0.0f;
    const bool tie = i < chi && fkey(v) == thr;
    const unsigned int bits = __ballot_sync(0xffffffffu, tie);
    const unsigned int p = r + __popc(bits & ((1u << lane) - 1u));
    if (tie && p < ties) {
      ov[above + p] = v;
      oi[above + p] = (unsigned int)(lo + i);
    }
    r += __popc(bits);
  }
}

#define TOPK_SPLIT_MAX_CAND 4096
extern "C" __global__ void topk_split_merge(const float* cand_val, const unsigned int* cand_idx,
                                            const float* stats, int splits, int k,
                                            float* out_val, unsigned int* out_idx) {
  PDL_ENTRY();
  __shared__ unsigned int ck[TOPK_SPLIT_MAX_CAND];
  __shared__ unsigned int ci[TOPK_SPLIT_MAX_CAND];
  __shared__ float lse_s;
  const int r = blockIdx.x, c = splits * k, t = threadIdx.x;
  const float* cv = cand_val + (long long)r * c;
  for (int i = t; i < c; i += blockDim.x) {
    ck[i] = fkey(cv[i]);
    ci[i] = cand_idx[(long long)r * c + i];
  }
  if (t == 0) {
    const float* st = stats + (long long)r * splits * 2;
    float mx = NEG_INF;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, st[2 * s]);
    float tot = 0.0f;
    for (int s = 0; s < splits; ++s)
      if (st[2 * s] != NEG_INF) tot += st[2 * s + 1] * expf(st[2 * s] - mx);
    lse_s = mx + logf(tot);
  }
  __syncthreads();
  for (int i = t; i < c; i += blockDim.x) {
    const unsigned int key = ck[i], id = ci[i];
    unsigned int rank = 0;
    for (int j = 0; j < c; ++j) rank += (ck[j] > key) || (ck[j] == key && ci[j] < id);
    if (rank < (unsigned int)k) {
      out_val[(long long)r * k + rank] = cv[i] - lse_s;
      out_idx[(long long)r * k + rank] = id;
    }
  }
}

extern "C" __global__ void visibility_mask(const long long* parents, int n, int past, int chain,
                                           float* out) {
  PDL_ENTRY();
  const int kv = past + n;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  const int i = blockIdx.y;
  if (j >= kv) return;
  float v = NEG_INF;
  if (j < past) {
    v = 0.0f;
  } else if (chain) {  // parents[a] = a − 1: the ancestors of i are every node up to i
    if (j - past <= i) v = 0.0f;
  } else {
    const int node = j - past;
    long long a = i;
    while (a >= node) {
      if (a == node) {
        v = 0.0f;
        break;
      }
      a = parents[a];
    }
  }
  out[(long long)i * kv + j] = v;
}

// softmax_scaled_{f32,bf16}: attention probabilities from raw scores in one pass per row:
// p = softmax(scale·s + mask[q]) in f32, written in the scores' dtype. Row r of
// [b, rows_per_b] has query q = (r mod rows_per_b) mod q_len and reads the additive mask row
// mask[b·mask_bstride + q·kv .. + kv] when has_mask (the composite: to f32, ×scale, +mask,
// softmax, to dtype). One warp per row, 4 rows per block; an all −inf row gives 0s, as no real
// row is (every query sees at least one key).
typedef unsigned short bf16_t;
__device__ __forceinline__ float ldv(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float ldv(const bf16_t* p, long long i) {
  return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void stv(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void stv(bf16_t* p, long long i, float v) {
  unsigned int u = __float_as_uint(v);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (finite values)
  p[i] = (bf16_t)(u >> 16);
}

template <typename T>
__device__ void softmax_scaled(const T* s, const float* mask, int total_rows, int rows_per_b,
                               int q_len, int kv, long long mask_bstride, int has_mask,
                               float scale, T* out) {
  const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int l = threadIdx.x & 31;
  if (r >= total_rows) return;
  const long long off = (long long)r * kv;
  const float* mrow = 0;
  if (has_mask) {
    const int b = r / rows_per_b, q = (r % rows_per_b) % q_len;
    mrow = mask + b * mask_bstride + (long long)q * kv;
  }
  float m = NEG_INF;
  for (int j = l; j < kv; j += 32) {
    float v = ldv(s, off + j) * scale;
    if (has_mask) v += mrow[j];
    m = fmaxf(m, v);
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float z = 0.0f;
  for (int j = l; j < kv; j += 32) {
    float v = ldv(s, off + j) * scale;
    if (has_mask) v += mrow[j];
    z += (m == NEG_INF) ? 0.0f : expf(v - m);
  }
  for (int o = 16; o > 0; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
  const float inv = z > 0.0f ? 1.0f / z : 0.0f;
  for (int j = l; j < kv; j += 32) {
    float v = ldv(s, off + j) * scale;
    if (has_mask) v += mrow[j];
    stv(out, off + j, (m == NEG_INF) ? 0.0f : expf(v - m) * inv);
  }
}

extern "C" __global__ void softmax_scaled_f32(const float* s, const float* mask, int total_rows,
                                              int rows_per_b, int q_len, int kv,
                                              long long mask_bstride, int has_mask, float scale,
                                              float* out) {
  PDL_ENTRY();
  softmax_scaled(s, mask, total_rows, rows_per_b, q_len, kv, mask_bstride, has_mask, scale, out);
}

extern "C" __global__ void softmax_scaled_bf16(const bf16_t* s, const float* mask, int total_rows,
                                               int rows_per_b, int q_len, int kv,
                                               long long mask_bstride, int has_mask, float scale,
                                               bf16_t* out) {
  PDL_ENTRY();
  softmax_scaled(s, mask, total_rows, rows_per_b, q_len, kv, mask_bstride, has_mask, scale, out);
}

// silu_mul_{f32,bf16}: out[r, c] = silu(x[r, c]) · x[r, inter + c] for x = [gate | up] of
// [rows, 2·inter] (the fused gate-up projection), computed in f32.
template <typename T>
__device__ void silu_mul(const T* x, int rows, int inter, T* out) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)rows * inter) return;
  const long long r = i / inter, c = i % inter;
  const float g = ldv(x, r * 2 * inter + c), u = ldv(x, r * 2 * inter + inter + c);
  stv(out, i, g / (1.0f + expf(-g)) * u);
}

extern "C" __global__ void silu_mul_f32(const float* x, int rows, int inter, float* out) {
  PDL_ENTRY();
  silu_mul(x, rows, inter, out);
}

extern "C" __global__ void silu_mul_bf16(const bf16_t* x, int rows, int inter, bf16_t* out) {
  PDL_ENTRY();
  silu_mul(x, rows, inter, out);
}

// gate_mul_{f32,bf16}: the hybrids' gated attention output, out[r, h·hd + c] = o[r, h·hd + c] ·
// sigmoid(y[r, h·2hd + hd + c]) — y the rows (`ld` elements apart) of the stacked q/k/v
// projection, whose q heads each carry their hd gate channels — in f32 with the sigmoid rounded
// to T before the product (what candle's sigmoid then mul compute), one thread an element.
template <typename T>
__device__ void gate_mul(const T* o, const T* y, int rows, int H, int hd, long long ld, T* out) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long width = (long long)H * hd;
  if (i >= rows * width) return;
  const long long r = i / width, j = i % width, h = j / hd, c = j % hd;
  const float g = ldv(y, r * ld + h * 2 * hd + hd + c);
  T s[1];
  stv(s, 0, 1.0f / (1.0f + expf(-g)));
  stv(out, i, ldv(o, i) * ldv(s, 0));
}

extern "C" __global__ void gate_mul_f32(const float* o, const float* y, int rows, int H, int hd,
                                        long long ld, float* out) {
  PDL_ENTRY();
  gate_mul(o, y, rows, H, hd, ld, out);
}

extern "C" __global__ void gate_mul_bf16(const bf16_t* o, const bf16_t* y, int rows, int H, int hd,
                                         long long ld, bf16_t* out) {
  PDL_ENTRY();
  gate_mul(o, y, rows, H, hd, ld, out);
}

// sample_rows: one token per row of logits x [rows, V] from softmax(x / T) cut by top-k (top_k ≤ 0
// or ≥ V: off) and then top-p (top_p ≥ 1: off), for a uniform u[row] ∈ [0, 1) drawn by the host's
// seeded RNG. Masses exp((x − max) / T) are fixed point (units of 2^-40, 64-bit integer sums), so
// the choice is a deterministic function of u. top-k keeps the keys ≥ the k-th largest, top-p the
// largest keys whose mass reaches top_p of what top-k kept (ties at either cut are all kept: the
// host keeps the lower ids). The token is where the kept mass, accumulated in id order, passes
// u · (kept mass): the same distribution as walking it in sorted order.
#define FX 1099511627776.0f  // 2^40

__device__ __forceinline__ unsigned long long fx_mass(float x, float m, float inv_t) {
  return (unsigned long long)(expf((x - m) * inv_t) * FX);
}

extern "C" __global__ void sample_rows(const float* x, int V, float inv_t, int top_k, float top_p,
                                       const float* u, unsigned int* out) {
  PDL_ENTRY();
  __shared__ float red[32];
  __shared__ unsigned int hist[256];
  __shared__ unsigned int sel[2];
  __shared__ unsigned long long mhist[256];
  __shared__ unsigned long long msel[2];
  __shared__ unsigned long long wtot[TPB / 32];
  __shared__ unsigned long long wsum[TPB];  // each lane's mass, for its warp's digit sums
  // kth_largest_key's per-warp counters, then the top-p passes' per-group masses
  __shared__ unsigned long long pool[TPB / 32 * 128];
  const float* row = x + (long long)blockIdx.x * V;
  const int t = threadIdx.x;
  const int lane = t & 31, w = t >> 5, nw = blockDim.x >> 5;
  float mx = NEG_INF;
  row_pass(row, V, [&](int, float v, bool ok) {
    if (ok) mx = fmaxf(mx, v);
  });
  const float m = block_max(mx, red);

  unsigned int thr = 0;  // keep keys >= thr
  if (top_k > 0 && top_k < V)
    thr = kth_largest_key(row, V, (unsigned int)top_k, hist, sel, (unsigned int*)pool);
  if (top_p < 1.0f) {
    if (t == 0) msel[0] = 0;
    __syncthreads();
    unsigned long long z = 0;
    row_pass(row, V, [&](int, float v, bool ok) {
      if (ok && fkey(v) >= thr) z += fx_mass(v, m, inv_t);
    });
    for (int o = 16; o > 0; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
    if (lane == 0) atomicAdd(&msel[0], z);
    __syncthreads();
    const double want = (double)top_p * (double)msel[0];
    unsigned long long need = (unsigned long long)want;
    if ((double)need < want) need += 1;
    __syncthreads();
    // masses by digit, one 256-bin histogram per group of four warps
    const int groups = (nw + 3) / 4;
    unsigned long long* gh = pool + (w / 4) * 256;
    unsigned int prefix = 0, mask = 0;
    if (t == 0) msel[1] = need;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = t; b < groups * 256; b += blockDim.x) pool[b] = 0;
      __syncthreads();
      // one atomic per distinct digit of the warp, its lanes' masses summed by the lowest lane
      // (integer sums: the same totals in any order)
      row_pass(row, V, [&](int, float x, bool ok) {
        unsigned int b = 256u;
        unsigned long long wt = 0;
        if (ok) {
          const unsigned int key = fkey(x);
          if (key >= thr && (key & mask) == prefix) {
            b = (key >> shift) & 255u;
            wt = fx_mass(x, m, inv_t);
          }
        }
        const unsigned int peers = __match_any_sync(0xffffffffu, b);
        wsum[t] = wt;
        __syncwarp();
        if (b < 256u && __ffs(peers) - 1 == lane) {
          unsigned long long acc = 0;
          for (unsigned int p = peers; p; p &= p - 1) acc += wsum[t - lane + __ffs(p) - 1];
          atomicAdd(&gh[b], acc);
        }
        __syncwarp();
      });
      __syncthreads();
      for (int b = t; b < 256; b += blockDim.x) {
        unsigned long long c = 0;
        for (int g = 0; g < groups; ++g) c += pool[g * 256 + b];
        mhist[b] = c;
      }
      __syncthreads();
      if (t < 32) {
        const unsigned long long left = msel[1];
        __syncwarp();
        pick_digit<unsigned long long>(mhist, left, &sel[0], &msel[1]);
      }
      __syncthreads();
      prefix |= sel[0] << shift;
      mask |= 255u << shift;
      __syncthreads();
    }
    thr = max(thr, prefix);
  }
  // the kept mass of each warp's contiguous chunk (read coalesced), the warp holding u · total,
  // then the lane inside it where the mass accumulated in id order passes it
  const int chunk = ((V + nw - 1) / nw + 31) & ~31;
  const int lo = min(V, w * chunk), hi = min(V, lo + chunk);
  unsigned long long c = 0;
  for (int base = lo; base < hi; base += 32) {
    const int i = base + lane;
    if (i < hi) {
      const float v = row[i];
      if (fkey(v) >= thr) c += fx_mass(v, m, inv_t);
    }
  }
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  if (lane == 0) wtot[w] = c;
  if (t == 0) sel[0] = 0xffffffffu;
  __syncthreads();
  if (w == 0) {
    const unsigned long long v = lane < nw ? wtot[lane] : 0ull;
    unsigned long long inc = v;
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long y = __shfl_up_sync(0xffffffffu, inc, o);
      if (lane >= o) inc += y;
    }
    const unsigned long long total = __shfl_sync(0xffffffffu, inc, 31);
    unsigned long long r = (unsigned long long)((double)u[blockIdx.x] * (double)total);
    if (r >= total) r = total - 1;
    if (v > 0 && r >= inc - v && r < inc) {
      sel[0] = lane;
      msel[0] = r - (inc - v);
    }
  }
  __syncthreads();
  if (w == (int)sel[0]) {
    unsigned long long left = msel[0];
    for (int base = lo; base < hi; base += 32) {
      const int i = base + lane;
      unsigned long long mass = 0;
      if (i < hi) {
        const float v = row[i];
        if (fkey(v) >= thr) mass = fx_mass(v, m, inv_t);
      }
      unsigned long long inc = mass;
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
      }
      const unsigned long long tot = __shfl_sync(0xffffffffu, inc, 31);
      if (left < tot) {
        const unsigned int hit = __ballot_sync(0xffffffffu, left < inc);
        if (lane == __ffs(hit) - 1) out[blockIdx.x] = i;
        break;
      }
      left -= tot;
    }
  }
}

