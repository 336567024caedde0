// Asks L2 for the first bytes of each row of a weight while the kernels on the main stream leave
// the memory idle (NVRTC; l2_prefetch.rs launches it on a side stream). Hints only: nothing is
// written, no value any kernel reads changes.
// The weight is `rows` rows of `row_bytes` bytes from `p`; thread t asks for chunk t % per_row_chunks
// of row t / per_row_chunks, the first `per_row` bytes of every row in all: the bytes a
// weight-streaming GEMM reads first (its blocks walk their rows' K from the start) — or, with
// per_row == row_bytes, the whole weight in address order. On compute 9.0 a chunk of up to 4 KB is
// one instruction to the copy engine (`cp.async.bulk.prefetch.L2`); before that, one
// `prefetch.global.L2` per 32-byte sector. `p`, `row_bytes` and `per_row` are multiples of 16.
#if __CUDA_ARCH__ >= 900
#define L2P_CHUNK 4096ull
#else
#define L2P_CHUNK 32ull
#endif
extern "C" __global__ void l2_prefetch(const char* p, unsigned long long rows,
                                       unsigned long long row_bytes, unsigned long long per_row) {
  const unsigned long long per_row_chunks = (per_row + L2P_CHUNK - 1) / L2P_CHUNK;
  const unsigned long long total = rows * per_row_chunks;
  const unsigned long long threads = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; t < total;
       t += threads) {
    const unsigned long long row = t / per_row_chunks, at = (t % per_row_chunks) * L2P_CHUNK;
    const char* a = p + row * row_bytes + at;
#if __CUDA_ARCH__ >= 900
    const unsigned int n = (unsigned int)(per_row - at < L2P_CHUNK ? per_row - at : L2P_CHUNK);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(n) : "memory");
#else
    asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
#endif
  }
}
