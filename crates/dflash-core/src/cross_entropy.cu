// Fused weighted cross-entropy over rows of f32 logits, compiled at run time by NVRTC. Mirrors
// the CPU reference in cross_entropy.rs: one thread block per row, an online log-sum-exp and
// argmax (lowest id among equal maxima) per thread, then a tree reduction in shared memory.
// out[row] = (w·(lse − logit[label]), lse, argmax); the backward writes
// dlogits = g·w·(softmax − onehot(label)) in one pass.

#define NEG_INF __int_as_float(0xff800000)
#define THREADS 256

__device__ __forceinline__ void lse_combine(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  if (mm == NEG_INF) return;
  s = (m == NEG_INF ? 0.f : s * __expf(m - mm)) + (m2 == NEG_INF ? 0.f : s2 * __expf(m2 - mm));
  m = mm;
}

extern "C" __global__ void ce_fwd_f32(const float* logits, const unsigned int* labels,
                                      const float* weights, float* out, int V) {
  __shared__ float sm[THREADS], ss[THREADS], sb[THREADS];
  __shared__ int sa[THREADS];
  const int row = blockIdx.x, t = threadIdx.x;
  const float* x = logits + (long long)row * V;
  float m = NEG_INF, s = 0.f, best = NEG_INF;
  int arg = 0x7fffffff;
  for (int j = t; j < V; j += THREADS) {
    const float v = x[j];
    if (v > best) {
      best = v;
      arg = j;
    }
    if (v > m) {
      s = s * __expf(m - v) + 1.f;
      m = v;
    } else {
      s += __expf(v - m);
    }
  }
  sm[t] = m;
  ss[t] = s;
  sb[t] = best;
  sa[t] = arg;
  __syncthreads();
  for (int off = THREADS / 2; off > 0; off >>= 1) {
    if (t < off) {
      float m1 = sm[t], s1 = ss[t];
      lse_combine(m1, s1, sm[t + off], ss[t + off]);
      sm[t] = m1;
      ss[t] = s1;
      const float b2 = sb[t + off];
      const int a2 = sa[t + off];
      if (b2 > sb[t] || (b2 == sb[t] && a2 < sa[t])) {
        sb[t] = b2;
        sa[t] = a2;
      }
    }
    __syncthreads();
  }
  if (t == 0) {
    const float lse = sm[0] + __logf(ss[0]);
    out[3 * row] = weights[row] * (lse - x[labels[row]]);
    out[3 * row + 1] = lse;
    out[3 * row + 2] = (float)sa[0];
  }
}

extern "C" __global__ void ce_bwd_f32(const float* logits, const unsigned int* labels,
                                      const float* weights, const float* res, const float* gout,
                                      float* dlogits, int V) {
  const int row = blockIdx.x;
  const float lse = res[3 * row + 1];
  const float g = gout[3 * row] * weights[row];
  const int lab = (int)labels[row];
  const float* x = logits + (long long)row * V;
  float* dx = dlogits + (long long)row * V;
  for (int j = threadIdx.x; j < V; j += THREADS) {
    dx[j] = g * (__expf(x[j] - lse) - (j == lab ? 1.f : 0.f));
  }
}
