// The gated delta rule over a token tree in one launch (NVRTC; compiled once per key head dim,
// `#define DK n` in front). See gated_delta.rs for the rule and gated_delta_cuda.rs for the launch.
//
// Invariants:
// - Thread (head h, value column j) owns column j of head h's state S [DK, dv] in registers and
//   walks the nodes in order: a node whose parent is the node before it continues from the
//   registers, any other node loads its parent's column (from `state` for a root, from `scratch`
//   for an earlier node the host marked `keep`). Columns of S never interact in the rule
//   (S ← α(I − βkkᵀ)S + βkvᵀ mixes rows only), so threads share nothing: no shared memory, no
//   barriers, no warp shuffles. Each output element is written by exactly one thread.
// - Per node and column, the arithmetic is the host's `step_head` / `read_head` (decay, then the
//   prediction summed over the rows, then the write, then the read-out), but each sum over the DK
//   rows is four interleaved partial sums added pairwise (DK a multiple of 4): the GPU's result
//   equals the host's up to f32 rounding, and a replay through this kernel equals the forward.
// - `out` may be null (a replay that needs only the final state), `last` too (a device step's
//   forward, whose state moves on at the commit); `scratch` is read and written
//   only for nodes marked `keep`. `gated_delta_tree_layers_f32` runs it for many layers at once
//   (the replay of every recurrent layer) through the same per-thread code.

#ifndef DK
#define DK 128
#endif

// A load the compiler may not merge with an earlier one of the same address: the key row is read
// again in the second pass over the rows instead of being held in DK more registers (DK 128 with
// it held: 255 registers and spills; the host emulation defines it as a plain read).
#ifndef RELOAD
__device__ __forceinline__ float RELOAD(const float* p) {
    float x;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(x) : "l"(p));
    return x;
}
#endif

// A coherent load (L2, never the read-only path) of a state row this kernel may have written: a
// folded commit (`gated_delta_tree_fold_f32`) writes the state before a later root of the tree
// reads it back (the host emulation defines it as a plain read).
#ifndef STATE_RELOAD
__device__ __forceinline__ float STATE_RELOAD(const float* p) {
    float x;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(x) : "l"(p));
    return x;
}
#endif

// The folded commit's pending tokens: the chain `pk`, `pv`, `pg`, `pbeta` ([np, H, ·], the rows a
// commit would replay) applied to thread (head h, column j)'s column of `state` — loaded into
// `s`, advanced with exactly the walk's arithmetic for a node without outputs (so the replay's
// bits), and written back in place (each thread reads its column before it writes it).
__device__ __forceinline__ void gated_delta_pending(
    float* s, float* state_h, const float* __restrict__ pk, const float* __restrict__ pv,
    const float* __restrict__ pg, const float* __restrict__ pbeta, int np, int H, int dv, int h,
    int j) {
#pragma unroll
    for (int r = 0; r < DK; ++r) s[r] = state_h[(size_t)r * dv + j];
#pragma unroll 1
    for (int i = 0; i < np; ++i) {
        const size_t th = (size_t)i * H + h;
        const float alpha = expf(pg[th]);
        const float* kk = pk + th * DK;
        float pred[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < DK; ++r) {
            s[r] *= alpha;
            pred[r & 3] += kk[r] * s[r];
        }
        const float d =
            pbeta[th] * (pv[th * dv + j] - ((pred[0] + pred[1]) + (pred[2] + pred[3])));
#pragma unroll
        for (int r = 0; r < DK; ++r) s[r] += RELOAD(kk + r) * d;
    }
#pragma unroll
    for (int r = 0; r < DK; ++r) state_h[(size_t)r * dv + j] = s[r];
}

// The rule over the tree for thread (head h, column j) of one layer (see the invariants).
__device__ __forceinline__ void gated_delta_tree(
    const float* __restrict__ q,       // [T, H, DK], l2-normalised and scaled
    const float* __restrict__ k,       // [T, H, DK], l2-normalised
    const float* __restrict__ v,       // [T, H, dv]
    const float* __restrict__ g,       // [T, H] log decay
    const float* __restrict__ beta,    // [T, H]
    const float* __restrict__ state,   // [H, DK, dv], the state every root continues from
    const int* __restrict__ parents,   // [T], parents[i] < i, -1 for a root; null: a chain
    const int* __restrict__ keep,      // [T], 1: the node's state is read by a later node != i+1
    float* __restrict__ out,           // [T, H, dv] or null
    float* __restrict__ scratch,       // [T, H, DK, dv] (rows of kept nodes only)
    float* __restrict__ last,          // [H, DK, dv], the state after node T-1, or null
    int T, int H, int dv, int h, int j,
    const float* const* pending = nullptr,  // a folded commit's [pk, pv, pg, pbeta], or null
    int np = 0) {                           // its token count (0: none)
    const size_t head = (size_t)DK * dv;
    float s[DK];
    // a folded commit: the state advanced over the pending tokens and written back first; the
    // first root continues from the registers, a later root reads the written state back
    const bool warm = np > 0;
    if (warm)
        gated_delta_pending(s, (float*)state + (size_t)h * head, pending[0], pending[1],
                            pending[2], pending[3], np, H, dv, h, j);
#pragma unroll 1
    for (int i = 0; i < T; ++i) {
        const int p = parents ? parents[i] : i - 1;
        if ((p != i - 1 || i == 0) && !(i == 0 && warm)) {
            const float* src = p < 0 ? state + (size_t)h * head
                                     : scratch + ((size_t)p * H + h) * head;
            if (warm && p < 0) {
#pragma unroll
                for (int r = 0; r < DK; ++r) s[r] = STATE_RELOAD(src + (size_t)r * dv + j);
            } else {
#pragma unroll
                for (int r = 0; r < DK; ++r) s[r] = src[(size_t)r * dv + j];
            }
        }
        const size_t th = (size_t)i * H + h;
        const float alpha = expf(g[th]);
        const float* kk = k + th * DK;
        // sums over the rows in four interleaved partial sums (row r into sum r mod 4): a chain
        // of DK / 4 dependent adds instead of DK
        float pred[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < DK; ++r) {
            s[r] *= alpha;
            pred[r & 3] += kk[r] * s[r];
        }
        const float d =
            beta[th] * (v[th * dv + j] - ((pred[0] + pred[1]) + (pred[2] + pred[3])));
        // the write and the read-out in one pass (out null: the write alone)
        const float* qq = q + th * DK;
        float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < DK; ++r) {
            s[r] += RELOAD(kk + r) * d;
            if (out) o[r & 3] += qq[r] * s[r];
        }
        if (out) out[th * dv + j] = (o[0] + o[1]) + (o[2] + o[3]);
        if (keep && keep[i]) {
            float* dst = scratch + th * head;
#pragma unroll
            for (int r = 0; r < DK; ++r) dst[(size_t)r * dv + j] = s[r];
        }
    }
    if (!last) return;  // a device step's forward: the state moves on at the commit
    float* dst = last + (size_t)h * head;
#pragma unroll
    for (int r = 0; r < DK; ++r) dst[(size_t)r * dv + j] = s[r];
}

#ifdef RULE_LANES4
// The same rule with four lanes a column (the default; `DFLASH_GDN_RULE_LANES=1` keeps the one-lane
// kernel above; compiled with
// `RULE_LANES4` defined, launched with blocks of 32 threads over ceil(dv / 8) × H × L): lane
// (t = lane / 8, column jl = lane % 8) owns rows r ≡ t (mod 4) of its column — exactly the rows
// of partial sum t of `gated_delta_tree` — and sums them in the same ascending order; the four
// sums meet by two xor shuffles, (p0 + p1) + (p2 + p3) on every lane (a + b = b + a in IEEE
// arithmetic), so every output and state is the one-lane kernel's, bit for bit, with a quarter of
// the registers a thread and four times the warps. Inactive columns (j ≥ dv) still shuffle.
__device__ __forceinline__ float rule_sum4(float p) {
    const float x = p + __shfl_xor_sync(0xffffffffu, p, 8);
    return x + __shfl_xor_sync(0xffffffffu, x, 16);
}
__device__ __forceinline__ void gated_delta_tree_lanes4(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const float* __restrict__ beta, const float* __restrict__ state,
    const int* __restrict__ parents, const int* __restrict__ keep, float* __restrict__ out,
    float* __restrict__ scratch, float* __restrict__ last, int T, int H, int dv, int h, int j,
    int t, const float* const* pending = nullptr, int np = 0) {
    const size_t head = (size_t)DK * dv;
    const bool col = j < dv;
    const int jc = col ? j : 0;  // a column to read for the shuffles' sake; nothing is written
    float s[DK / 4];
    // a folded commit (see `gated_delta_tree`): the pending tokens first, the state written back
    const bool warm = np > 0;
    if (warm) {
        float* sh = (float*)state + (size_t)h * head;
        const float *pk = pending[0], *pv = pending[1], *pg = pending[2], *pb = pending[3];
#pragma unroll
        for (int m = 0; m < DK / 4; ++m) s[m] = sh[(size_t)(4 * m + t) * dv + jc];
#pragma unroll 1
        for (int i = 0; i < np; ++i) {
            const size_t th = (size_t)i * H + h;
            const float alpha = expf(pg[th]);
            const float* kk = pk + th * DK;
            float pred = 0.0f;
#pragma unroll
            for (int m = 0; m < DK / 4; ++m) {
                s[m] *= alpha;
                pred += kk[4 * m + t] * s[m];
            }
            const float d = pb[th] * (pv[th * dv + jc] - rule_sum4(pred));
#pragma unroll
            for (int m = 0; m < DK / 4; ++m) s[m] += RELOAD(kk + 4 * m + t) * d;
        }
        if (col) {
#pragma unroll
            for (int m = 0; m < DK / 4; ++m) sh[(size_t)(4 * m + t) * dv + j] = s[m];
        }
    }
#pragma unroll 1
    for (int i = 0; i < T; ++i) {
        const int p = parents ? parents[i] : i - 1;
        if ((p != i - 1 || i == 0) && !(i == 0 && warm)) {
            const float* src = p < 0 ? state + (size_t)h * head
                                     : scratch + ((size_t)p * H + h) * head;
            if (warm && p < 0) {
#pragma unroll
                for (int m = 0; m < DK / 4; ++m)
                    s[m] = STATE_RELOAD(src + (size_t)(4 * m + t) * dv + jc);
            } else {
#pragma unroll
                for (int m = 0; m < DK / 4; ++m) s[m] = src[(size_t)(4 * m + t) * dv + jc];
            }
        }
        const size_t th = (size_t)i * H + h;
        const float alpha = expf(g[th]);
        const float* kk = k + th * DK;
        float pred = 0.0f;
#pragma unroll
        for (int m = 0; m < DK / 4; ++m) {
            s[m] *= alpha;
            pred += kk[4 * m + t] * s[m];
        }
        const float d = beta[th] * (v[th * dv + jc] - rule_sum4(pred));
        const float* qq = q + th * DK;
        float o = 0.0f;
#pragma unroll
        for (int m = 0; m < DK / 4; ++m) {
            s[m] += RELOAD(kk + 4 * m + t) * d;
            if (out) o += qq[4 * m + t] * s[m];
        }
        if (out) {
            const float total = rule_sum4(o);
            if (col && t == 0) out[th * dv + j] = total;
        }
        if (col && keep && keep[i]) {
            float* dst = scratch + th * head;
#pragma unroll
            for (int m = 0; m < DK / 4; ++m) dst[(size_t)(4 * m + t) * dv + j] = s[m];
        }
    }
    if (!col || !last) return;
    float* dst = last + (size_t)h * head;
#pragma unroll
    for (int m = 0; m < DK / 4; ++m) dst[(size_t)(4 * m + t) * dv + j] = s[m];
}

#ifdef RULE_STAGED
// The four-lane rule with its inputs staged in shared memory (`DFLASH_GDN_RULE_STAGE=1`, compiled
// with `RULE_STAGED` defined; opt-in until run on a GPU). A chunk of tokens at a time, the warp
// loads their k, q, g, beta, value columns, parents and kept flags with all its loads in flight,
// then walks the chunk from shared memory — a node's inputs never wait on a global load in the serial walk (the per-node global
// loads had made a 65-node tree cost 239 µs a layer at Qwen3.6-27B, 3.7 µs a node). The values
// are the same floats, so the arithmetic (and every bit) is unchanged.
// RULE_REPLAY (the state commit's replays, by default: few tokens, no outputs, every recurrent layer at once,
// so many warps): chunks of 8 tokens, queries read from global memory instead of staged (a
// replay has none to read), at most 80 registers a thread (ptxas, sm_90: 16 bytes spilled) — the
// shared memory and registers of 24 warps an SM instead of 6 (the staged forward: 156 registers,
// 34 KB) or 11 (the unstaged four-lane kernel: 180 registers).
// RULE_PREFETCH (with RULE_REPLAY; `DFLASH_GDN_REPLAY=prefetch`, opt-in, session 29; on an H200 in
// session 30 the same bits and no faster — the 27B commit 0.335 against 0.252 ms): the state commit's replay read at 1.6 TB/s of state traffic in session 29's profile
// (187 µs for Qwen3.6-27B's 48 layers, 302 MB read and written) — a warp's chunk of keys came in
// four elements at a time behind its shared stores (eight memory round trips a chunk), and the
// state only after them. Here the state's loads go out first (when the first token reads it: a
// chain, or a tree whose first node is a root), and a chunk's keys in two batches of all their
// loads. The same floats land in the same places, so every bit is the replay's. 16 blocks an SM
// (NVRTC's PTX, ptxas sm_90, DK 128: 8 bytes spilled; at 24 the batches spilled 104).
// RULE_KVEC (with RULE_REPLAY, not RULE_PREFETCH; `DFLASH_GDN_REPLAY=vec`, session 31): a replay
// token's shared key row stored by lane group — the DK / 4 rows r ≡ t (mod 4) of group t side by
// side (KV_LANE floats a group, 4 of padding so the groups start in different banks) — so a lane
// reads its rows four at a time (DK / 16 vector loads a pass instead of DK / 4 scalar ones: the
// replay issues two shared loads per multiply-add; the guess was that they, not DRAM, bound it).
// The same floats in the same order, so every bit is the replay's (GPU test). Measured on an H100
// (session 31, Qwen3.6-27B at 2048): no faster — the chain commit 0.205 against 0.208 ms, the tree
// commit 0.52 against 0.28 (twice) — so the guess was wrong; opt-in.
#define KV_LANE (DK / 4 + 4)
#define KV_ROW (4 * KV_LANE)
#ifdef RULE_REPLAY
#define RULE_CHUNK 8
#ifdef RULE_PREFETCH
#define RULE_MIN_BLOCKS 16
#else
#define RULE_MIN_BLOCKS 24
#endif
#endif
#ifndef RULE_CHUNK
#define RULE_CHUNK ((4096 / DK) < 64 ? (4096 / DK) : 64)
#endif
__device__ __forceinline__ void gated_delta_tree_lanes4_staged(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const float* __restrict__ beta, const float* __restrict__ state,
    const int* __restrict__ parents, const int* __restrict__ keep, float* __restrict__ out,
    float* __restrict__ scratch, float* __restrict__ last, int T, int H, int dv, int h, int j,
    int t) {
#if defined(RULE_REPLAY) && defined(RULE_KVEC)
    __shared__ __align__(16) float sk[RULE_CHUNK * KV_ROW];
#elif defined(RULE_REPLAY)
    __shared__ float sk[RULE_CHUNK * DK];
#else
    __shared__ float sk[RULE_CHUNK * DK], sq[RULE_CHUNK * DK];
#endif
    __shared__ float sg[RULE_CHUNK], sb[RULE_CHUNK], sv[RULE_CHUNK * 8];
    __shared__ int sp[RULE_CHUNK], skeep[RULE_CHUNK];
    const int lane = threadIdx.x, j0 = j - (lane & 7);
    const size_t head = (size_t)DK * dv;
    const bool col = j < dv;
    const int jc = col ? j : 0;  // a column to read for the shuffles' sake; nothing is written
    float s[DK / 4];
#ifdef RULE_PREFETCH
    const bool pre = T > 0 && (parents ? parents[0] : -1) < 0;
    if (pre) {
        const float* src = state + (size_t)h * head;
#pragma unroll
        for (int m = 0; m < DK / 4; ++m) s[m] = src[(size_t)(4 * m + t) * dv + jc];
    }
#endif
#pragma unroll 1
    for (int c0 = 0; c0 < T; c0 += RULE_CHUNK) {
        const int cn = T - c0 < RULE_CHUNK ? T - c0 : RULE_CHUNK;
        __syncwarp();  // the last chunk's reads are done
#ifdef RULE_PREFETCH
        constexpr int BATCH = RULE_CHUNK * DK / 64;  // loads a lane has in flight at once
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            float kx[BATCH];
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const int e = lane + 32 * (b * BATCH + u);
                kx[u] = e < cn * DK ? k[((size_t)(c0 + e / DK) * H + h) * DK + e % DK] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const int e = lane + 32 * (b * BATCH + u);
                if (e < cn * DK) sk[e] = kx[u];
            }
        }
#else
        for (int e = lane; e < cn * DK; e += 32) {
            const size_t src = ((size_t)(c0 + e / DK) * H + h) * DK + e % DK;
#ifdef RULE_KVEC
            const int r = e % DK;  // row r of the key goes to lane group r mod 4, slot r / 4
            sk[(e / DK) * KV_ROW + (r & 3) * KV_LANE + (r >> 2)] = k[src];
#else
            sk[e] = k[src];
#endif
#ifndef RULE_REPLAY
            if (out) sq[e] = q[src];
#endif
        }
#endif
        for (int e = lane; e < cn * 8; e += 32) {
            const int jj = j0 + (e & 7);
            sv[e] = jj < dv ? v[((size_t)(c0 + e / 8) * H + h) * dv + jj] : 0.0f;
        }
        for (int e = lane; e < cn; e += 32) {
            const size_t th = (size_t)(c0 + e) * H + h;
            sg[e] = g[th];
            sb[e] = beta[th];
            sp[e] = parents ? parents[c0 + e] : c0 + e - 1;
            skeep[e] = keep ? keep[c0 + e] : 0;
        }
        __syncwarp();
#pragma unroll 1
        for (int ii = 0; ii < cn; ++ii) {
            const int i = c0 + ii;
            const int p = sp[ii];
#ifdef RULE_PREFETCH
            if ((p != i - 1 || i == 0) && !(i == 0 && pre)) {  // (token 0's state came first)
#else
            if (p != i - 1 || i == 0) {
#endif
                const float* src = p < 0 ? state + (size_t)h * head
                                         : scratch + ((size_t)p * H + h) * head;
#pragma unroll
                for (int m = 0; m < DK / 4; ++m) s[m] = src[(size_t)(4 * m + t) * dv + jc];
            }
            const size_t th = (size_t)i * H + h;
            const float alpha = expf(sg[ii]);
            float pred = 0.0f;
#ifdef RULE_KVEC
            // this lane's rows 4m + t, m ascending, four at a time (the same products and order)
            const float4* kv4 = (const float4*)(sk + ii * KV_ROW + t * KV_LANE);
#pragma unroll
            for (int jv = 0; jv < DK / 16; ++jv) {
                const float4 k4 = kv4[jv];
                const float kq[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    s[4 * jv + u] *= alpha;
                    pred += kq[u] * s[4 * jv + u];
                }
            }
            const float d = sb[ii] * (sv[ii * 8 + (lane & 7)] - rule_sum4(pred));
            const float* qq = q + th * DK;  // (a replay has no outputs; the tests' forwards do)
            float o = 0.0f;
#pragma unroll
            for (int jv = 0; jv < DK / 16; ++jv) {
                const float4 k4 = kv4[jv];
                const float kq[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int m = 4 * jv + u;
                    s[m] += kq[u] * d;
                    if (out) o += qq[4 * m + t] * s[m];
                }
            }
            if (out) {
                const float total = rule_sum4(o);
                if (col && t == 0) out[th * dv + j] = total;
            }
#else
            const float* kk = sk + ii * DK;
#pragma unroll
            for (int m = 0; m < DK / 4; ++m) {
                s[m] *= alpha;
                pred += kk[4 * m + t] * s[m];
            }
            const float d = sb[ii] * (sv[ii * 8 + (lane & 7)] - rule_sum4(pred));
#ifdef RULE_REPLAY
            const float* qq = q + th * DK;  // (a replay has no outputs; the tests' forwards do)
#else
            const float* qq = sq + ii * DK;
#endif
            float o = 0.0f;
#pragma unroll
            for (int m = 0; m < DK / 4; ++m) {
                s[m] += kk[4 * m + t] * d;
                if (out) o += qq[4 * m + t] * s[m];
            }
            if (out) {
                const float total = rule_sum4(o);
                if (col && t == 0) out[th * dv + j] = total;
            }
#endif
            if (col && skeep[ii]) {
                float* dst = scratch + th * head;
#pragma unroll
                for (int m = 0; m < DK / 4; ++m) dst[(size_t)(4 * m + t) * dv + j] = s[m];
            }
        }
    }
    if (!col || !last) return;
    float* dst = last + (size_t)h * head;
#pragma unroll
    for (int m = 0; m < DK / 4; ++m) dst[(size_t)(4 * m + t) * dv + j] = s[m];
}
#endif  // RULE_STAGED
#endif  // RULE_LANES4

// The one entry point of the rule: the tree for each of L layers at once (a forward: L = 1; the
// replay of every recurrent layer after a verify: one chain per layer, same length). Layer
// blockIdx.z reads the eleven arguments of `gated_delta_tree` (q, k, v, g, beta, state, parents,
// keep, out, scratch, last; null parents: a chain, null keep: nothing kept, null out: no
// outputs) from `ptrs` [L][11] at run time, so a forward and a replay run the very same code
// and a replayed state is the forward's, bit for bit. (Specialised on compile-time nulls, the
// chain replay spilled 608 bytes at DK 128.)
#ifndef RULE_MIN_BLOCKS
#define RULE_MIN_BLOCKS 1
#endif
// Layer `p`'s eleven arguments (see above) through the compiled rule, after `np` pending tokens
// (`pending`: a folded commit's inputs; np = 0: none — every kernel but the step's fold).
__device__ __forceinline__ void gated_delta_rule_call(const unsigned long long* p, int T, int H,
                                                      int dv, const float* const* pending,
                                                      int np) {
#ifdef RULE_LANES4
#ifdef RULE_STAGED
    (void)pending;
    (void)np;  // (the staged kernels take no folded commit: the host never asks them to)
    gated_delta_tree_lanes4_staged(
#else
    gated_delta_tree_lanes4(
#endif
                            (const float*)p[0], (const float*)p[1], (const float*)p[2],
                            (const float*)p[3], (const float*)p[4], (const float*)p[5],
                            (const int*)p[6], (const int*)p[7], (float*)p[8], (float*)p[9],
                            (float*)p[10], T, H, dv, blockIdx.y,
                            blockIdx.x * 8 + (threadIdx.x & 7), threadIdx.x >> 3
#ifndef RULE_STAGED
                            , pending, np
#endif
    );
    return;
#else
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= dv) return;
    gated_delta_tree((const float*)p[0], (const float*)p[1], (const float*)p[2],
                     (const float*)p[3], (const float*)p[4], (const float*)p[5],
                     (const int*)p[6], (const int*)p[7], (float*)p[8], (float*)p[9],
                     (float*)p[10], T, H, dv, blockIdx.y, j, pending, np);
#endif
}
extern "C" __global__ void __launch_bounds__(32, RULE_MIN_BLOCKS) gated_delta_tree_layers_f32(
    const unsigned long long* __restrict__ ptrs, int T, int H, int dv) {
    gated_delta_rule_call(ptrs + (size_t)blockIdx.z * 11, T, H, dv, nullptr, 0);
}

// The hybrid device step's rule with the last verify's state commit folded in (one layer,
// `ptrs` [11] as above): `fold` [5] holds the pending inputs k, v, g, beta (copied out of the
// record by `gdn_record_pending_rows` before the step overwrote it) and the address of their
// count (a word of the step's metadata: 0 when nothing is pending). The state buffer is advanced
// over them in place — the commit — and the step's tree continues from it. The same arithmetic
// as the replay (so the same bits), with one read of the state instead of two.
extern "C" __global__ void __launch_bounds__(32, RULE_MIN_BLOCKS) gated_delta_tree_fold_f32(
    const unsigned long long* __restrict__ ptrs, const unsigned long long* __restrict__ fold,
    int T, int H, int dv) {
    const float* pending[4] = {(const float*)fold[0], (const float*)fold[1],
                               (const float*)fold[2], (const float*)fold[3]};
    const int np = *(const int*)fold[4];
    gated_delta_rule_call(ptrs, T, H, dv, pending, np);
}

// ---------------------------------------------------------------------------------------------
// The Gated DeltaNet layer around the rule (gated_delta_ops.rs), the host composite of
// gated_deltanet.rs as three kernels, a thread per output element or per (token, head) — again
// threads that share nothing. `_f32` / `_bf16`: the compute dtype of the projections' outputs
// (everything is computed in f32; bf16 values are widened exactly and rounded to nearest even).

typedef unsigned short bf16_t;
__device__ __forceinline__ float gd_ld(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float gd_ld(const bf16_t* p, size_t i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void gd_st(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void gd_st(bf16_t* p, size_t i, float v) {
    unsigned int u = __float_as_uint(v);
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (finite values)
    p[i] = (bf16_t)(u >> 16);
}
__device__ __forceinline__ float gd_silu(float x) { return x / (1.0f + expf(-x)); }

// Causal depthwise convolution along each token's ancestors, then SiLU. Thread (token i,
// channel c): window row j (oldest first, K rows) is the input of the ancestor K-1-j steps up
// (`qkv`), or, past the tree's root, a row of the convolution state (its newest row first).
// Writes u [n, C] = silu(Σ_j w[c, j] · window_j) and the f32 inputs [n, C] (the record's).
// `gdn_conv_one` is the per-channel code, shared with the fused kernel below (rows of `qkv`
// `ld` elements apart), so both give the same bits.
template <typename T>
__device__ __forceinline__ float gdn_conv_one(const T* qkv, size_t ld, const float* conv_state,
                                              const float* w, const int* parents, int C, int K,
                                              int i, int c) {
    float win[8];
    int node = i, back = 0;
    for (int j = K - 1; j >= 0; --j) {
        if (node >= 0) {
            win[j] = gd_ld(qkv, (size_t)node * ld + c);
            node = parents[node];
        } else {
            ++back;
            win[j] = conv_state[(size_t)(K - 1 - back) * C + c];
        }
    }
    float acc = win[0] * w[(size_t)c * K];
    for (int j = 1; j < K; ++j) acc = acc + win[j] * w[(size_t)c * K + j];
    return gd_silu(acc);
}
template <typename T>
__device__ void gdn_conv_silu(const T* qkv, const float* conv_state, const float* w,
                              const int* parents, int n, int C, int K, float* u, float* qkv32) {
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)n * C) return;
    const int i = (int)(idx / C), c = (int)(idx % C);
    u[idx] = gdn_conv_one(qkv, (size_t)C, conv_state, w, parents, C, K, i, c);
    qkv32[idx] = gd_ld(qkv, idx);
}
extern "C" __global__ void gdn_conv_silu_f32(const float* qkv, const float* conv_state,
                                             const float* w, const int* parents, int n, int C,
                                             int K, float* u, float* qkv32) {
    gdn_conv_silu(qkv, conv_state, w, parents, n, C, K, u, qkv32);
}
extern "C" __global__ void gdn_conv_silu_bf16(const bf16_t* qkv, const float* conv_state,
                                              const float* w, const int* parents, int n, int C,
                                              int K, float* u, float* qkv32) {
    gdn_conv_silu(qkv, conv_state, w, parents, n, C, K, u, qkv32);
}

// The rule's inputs from the convolved u [n, C] (C = 2·Hk·DK + Hv·dv) and the gate projections
// b, a [n, Hv]. Thread (token i, value head h, element e < E = max(DK, dv)) reads key head
// h / (Hv / Hk): q and k l2-normalised (x / sqrt(Σx² + 1e-6), the sums over the head's DK rows in
// order, each thread of the head summing the same values in the same order), q times DK^-½; v
// copied; for e = 0, β = sigmoid(b) and g = softplus(a + dt_bias[h]) · neg_a[h] with
// softplus(x) = max(x, 0) + log(e^{-|x|} + 1). One thread per output element: the head's reads
// are broadcasts, the writes coalesced (a thread per (token, head) walking the head measured
// 43 µs a launch on an H100, session 21).
template <typename T>
__device__ void gdn_rule_inputs(const float* u, const T* b, const T* a, const float* dt_bias,
                                const float* neg_a, int n, int Hk, int Hv, int dv, float* q,
                                float* k, float* v, float* g, float* beta) {
    const int E = DK > dv ? DK : dv;
    const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (size_t)n * Hv * E) return;
    const size_t idx = t / E;
    const int e = (int)(t % E);
    const int i = (int)(idx / Hv), h = (int)(idx % Hv);
    const int kh = h / (Hv / Hk);
    const size_t C = (size_t)2 * Hk * DK + (size_t)Hv * dv;
    const float* row = u + (size_t)i * C;
    if (e < DK) {
        const float* uq = row + (size_t)kh * DK;
        const float* uk = row + (size_t)Hk * DK + (size_t)kh * DK;
        float sq = 0.0f, sk = 0.0f;
        for (int r = 0; r < DK; ++r) {
            sq += uq[r] * uq[r];
            sk += uk[r] * uk[r];
        }
        const float iq = 1.0f / sqrtf(sq + 1e-6f), ik = 1.0f / sqrtf(sk + 1e-6f);
        const float scale = 1.0f / sqrtf((float)DK);
        q[idx * DK + e] = uq[e] * iq * scale;
        k[idx * DK + e] = uk[e] * ik;
    }
    if (e < dv) v[idx * dv + e] = row[(size_t)2 * Hk * DK + (size_t)h * dv + e];
    if (e == 0) {
        beta[idx] = 1.0f / (1.0f + expf(-gd_ld(b, idx)));
        const float x = gd_ld(a, idx) + dt_bias[h];
        const float softplus = fmaxf(x, 0.0f) + logf(expf(-fabsf(x)) + 1.0f);
        g[idx] = softplus * neg_a[h];
    }
}
extern "C" __global__ void gdn_rule_inputs_f32(const float* u, const float* b, const float* a,
                                               const float* dt_bias, const float* neg_a, int n,
                                               int Hk, int Hv, int dv, float* q, float* k,
                                               float* v, float* g, float* beta) {
    gdn_rule_inputs(u, b, a, dt_bias, neg_a, n, Hk, Hv, dv, q, k, v, g, beta);
}
extern "C" __global__ void gdn_rule_inputs_bf16(const float* u, const bf16_t* b, const bf16_t* a,
                                                const float* dt_bias, const float* neg_a, int n,
                                                int Hk, int Hv, int dv, float* q, float* k,
                                                float* v, float* g, float* beta) {
    gdn_rule_inputs(u, b, a, dt_bias, neg_a, n, Hk, Hv, dv, q, k, v, g, beta);
}

// The convolution and the rule's inputs in one launch (`gdn_conv_silu` then `gdn_rule_inputs`
// without `u` between them; `DFLASH_GDN_FUSED_INPUTS=0` keeps the two): block (token i, value
// head h), thread e < E = max(DK, dv). Phase one: thread e convolves the channels it owns — q's
// and k's channel e of key head kh = h / (Hv / Hk) (e < DK) into shared rows, v's channel e of
// head h (e < dv) into `v` — with `gdn_conv_one`, and writes the record's f32 inputs of its
// channels (q's and k's by the key head's first value head only: one writer an element). Phase
// two, after a barrier: `gdn_rule_inputs`'s arithmetic on the shared rows (the sums of squares
// over the head's DK rows in order, each thread the same), so every output has the two kernels'
// bits. Rows of `qkv` are `ld` elements apart and rows of `b` and `a` `gld` (column views of one
// stacked projection, no copies). The phases are functions of their own so that the host
// emulation can run every thread of a block through phase one before phase two.
template <typename T>
__device__ __forceinline__ void gdn_fused_conv_phase(const T* qkv, int ld, const float* conv_state,
                                                     const float* w, const int* parents, int K,
                                                     int Hk, int Hv, int dv, float* qkv32,
                                                     float* v, float* xq, float* xk) {
    const int idx = blockIdx.x, e = threadIdx.x;
    const int i = idx / Hv, h = idx % Hv, kh = h / (Hv / Hk);
    const int C = 2 * Hk * DK + Hv * dv;
    const size_t rec = (size_t)i * C, in = (size_t)i * ld;
    if (e < DK) {
        const int cq = kh * DK + e, ck = Hk * DK + kh * DK + e;
        xq[e] = gdn_conv_one(qkv, (size_t)ld, conv_state, w, parents, C, K, i, cq);
        xk[e] = gdn_conv_one(qkv, (size_t)ld, conv_state, w, parents, C, K, i, ck);
        if (h % (Hv / Hk) == 0) {
            qkv32[rec + cq] = gd_ld(qkv, in + cq);
            qkv32[rec + ck] = gd_ld(qkv, in + ck);
        }
    }
    if (e < dv) {
        const int cv = 2 * Hk * DK + h * dv + e;
        v[(size_t)idx * dv + e] = gdn_conv_one(qkv, (size_t)ld, conv_state, w, parents, C, K, i, cv);
        qkv32[rec + cv] = gd_ld(qkv, in + cv);
    }
}
template <typename T>
__device__ __forceinline__ void gdn_fused_inputs_phase(const T* b, const T* a, int gld,
                                                       const float* dt_bias, const float* neg_a,
                                                       int Hv, const float* xq, const float* xk,
                                                       float* q, float* k, float* g, float* beta) {
    const int idx = blockIdx.x, e = threadIdx.x;
    const int i = idx / Hv, h = idx % Hv;
    if (e < DK) {
        float sq = 0.0f, sk = 0.0f;
        for (int r = 0; r < DK; ++r) {
            sq += xq[r] * xq[r];
            sk += xk[r] * xk[r];
        }
        const float iq = 1.0f / sqrtf(sq + 1e-6f), ik = 1.0f / sqrtf(sk + 1e-6f);
        const float scale = 1.0f / sqrtf((float)DK);
        q[(size_t)idx * DK + e] = xq[e] * iq * scale;
        k[(size_t)idx * DK + e] = xk[e] * ik;
    }
    if (e == 0) {
        const size_t gi = (size_t)i * gld + h;
        beta[idx] = 1.0f / (1.0f + expf(-gd_ld(b, gi)));
        const float x = gd_ld(a, gi) + dt_bias[h];
        const float softplus = fmaxf(x, 0.0f) + logf(expf(-fabsf(x)) + 1.0f);
        g[idx] = softplus * neg_a[h];
    }
}
template <typename T>
__device__ void gdn_conv_rule_inputs(const T* qkv, int ld, const float* conv_state, const float* w,
                                     const int* parents, int K, const T* b, const T* a, int gld,
                                     const float* dt_bias, const float* neg_a, int Hk, int Hv,
                                     int dv, float* qkv32, float* q, float* k, float* v, float* g,
                                     float* beta) {
    __shared__ float xs[2 * DK];
    gdn_fused_conv_phase(qkv, ld, conv_state, w, parents, K, Hk, Hv, dv, qkv32, v, xs, xs + DK);
    __syncthreads();
    gdn_fused_inputs_phase(b, a, gld, dt_bias, neg_a, Hv, xs, xs + DK, q, k, g, beta);
}
extern "C" __global__ void gdn_conv_rule_inputs_f32(
    const float* qkv, int ld, const float* conv_state, const float* w, const int* parents, int K,
    const float* b, const float* a, int gld, const float* dt_bias, const float* neg_a, int Hk,
    int Hv, int dv, float* qkv32, float* q, float* k, float* v, float* g, float* beta) {
    gdn_conv_rule_inputs(qkv, ld, conv_state, w, parents, K, b, a, gld, dt_bias, neg_a, Hk, Hv, dv,
                         qkv32, q, k, v, g, beta);
}
extern "C" __global__ void gdn_conv_rule_inputs_bf16(
    const bf16_t* qkv, int ld, const float* conv_state, const float* w, const int* parents, int K,
    const bf16_t* b, const bf16_t* a, int gld, const float* dt_bias, const float* neg_a, int Hk,
    int Hv, int dv, float* qkv32, float* q, float* k, float* v, float* g, float* beta) {
    gdn_conv_rule_inputs(qkv, ld, conv_state, w, parents, K, b, a, gld, dt_bias, neg_a, Hk, Hv, dv,
                         qkv32, q, k, v, g, beta);
}

// The gated RMSNorm per value head (rows of z `zld` elements apart): thread (token i, head h, channel c) gives
// y[i, h·dv + c] = o[i, h, c] / sqrt(mean_c o² + eps) · w[c] · silu(z[i, h·dv + c]), in T (the
// head's sum of squares in channel order, the same in every thread of the head: one thread per
// output element, broadcast reads, coalesced writes).
template <typename T>
__device__ void gdn_gated_norm(const float* o, const T* z, int zld, const float* w, int n, int Hv,
                               int dv, float eps, T* y) {
    const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (size_t)n * Hv * dv) return;
    const size_t idx = t / dv;
    const int c = (int)(t % dv);
    const float* oh = o + idx * dv;
    float ss = 0.0f;
    for (int r = 0; r < dv; ++r) ss += oh[r] * oh[r];
    const float inv = 1.0f / sqrtf(ss / (float)dv + eps);
    const size_t zi = (idx / Hv) * (size_t)zld + (idx % Hv) * (size_t)dv + c;
    gd_st(y, t, oh[c] * inv * w[c] * gd_silu(gd_ld(z, zi)));
}
extern "C" __global__ void gdn_gated_norm_f32(const float* o, const float* z, int zld,
                                              const float* w, int n, int Hv, int dv, float eps,
                                              float* y) {
    gdn_gated_norm(o, z, zld, w, n, Hv, dv, eps, y);
}
extern "C" __global__ void gdn_gated_norm_bf16(const float* o, const bf16_t* z, int zld,
                                               const float* w, int n, int Hv, int dv, float eps,
                                               bf16_t* y) {
    gdn_gated_norm(o, z, zld, w, n, Hv, dv, eps, y);
}

// The convolution windows after n kept tokens, for L layers at once (the state commit's other
// half): thread (channel c) of layer blockIdx.y writes rows r = 0..W-1 of the window, row n + r of
// [start; conv_in] — the last W = K − 1 rows of the window the kept tokens leave. `ptrs` [L][3]
// holds each layer's start [W, C], conv_in [≥ n, C] and out [W, C] (f32). `out` may be `start`
// (the hybrid device step commits in place): a thread reads row n + r ≥ r of its own channel
// before it writes row r, and no other thread touches the channel.
__device__ __forceinline__ void gdn_conv_window_layer(const unsigned long long* p, int n, int W,
                                                      int C) {
    const size_t c = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= (size_t)C) return;
    const float* start = (const float*)p[0];
    const float* conv_in = (const float*)p[1];
    float* out = (float*)p[2];
    for (int r = 0; r < W; ++r) {
        const int row = n + r;
        const float x = row < W ? start[(size_t)row * C + c] : conv_in[(size_t)(row - W) * C + c];
        out[(size_t)r * C + c] = x;
    }
}
extern "C" __global__ void gdn_conv_window_layers(const unsigned long long* __restrict__ ptrs,
                                                  int n, int W, int C) {
    gdn_conv_window_layer(ptrs + (size_t)blockIdx.y * 3, n, W, C);
}
// The same with n read from the device (`count`: the hybrid device step's folded commit, in its
// graph, before any layer's convolution reads the window or overwrites the record; 0: nothing).
extern "C" __global__ void gdn_conv_window_layers_pending(
    const unsigned long long* __restrict__ ptrs, const int* __restrict__ count, int W, int C) {
    const int n = *count;
    if (n > 0) gdn_conv_window_layer(ptrs + (size_t)blockIdx.y * 3, n, W, C);
}

// The folded commit's other half of the prologue: rows 0..n (n = *count, at most the
// destination's rows) of each record buffer copied aside before the step's layers overwrite
// them. `bufs` [B][3]: source, destination, row width in floats. Block (buffer, channel chunk),
// a thread per channel.
extern "C" __global__ void gdn_record_pending_rows(const unsigned long long* __restrict__ bufs,
                                                   const int* __restrict__ count) {
    const unsigned long long* b = bufs + 3 * (size_t)blockIdx.x;
    const float* src = (const float*)b[0];
    float* dst = (float*)b[1];
    const size_t d = (size_t)b[2];
    const size_t c = (size_t)blockIdx.y * blockDim.x + threadIdx.x;
    const int n = *count;
    if (c >= d) return;
    for (int i = 0; i < n; ++i) dst[(size_t)i * d + c] = src[(size_t)i * d + c];
}

// The path compaction of the hybrids' device-step records after a tree verify, every recurrent
// layer at once (the accepted root path's rows gathered to rows 0..m in place, so the state
// commit replays rows 0..m through its fixed tables). `bufs` [B][2]: each record buffer's
// address and its row width in floats; rows rows[i] move to row i for i ascending (rows strictly
// increasing, so rows[i] ≥ i: a thread reads a row of its channel before it overwrites it, and no
// other thread touches the channel). Block (buffer, channel chunk), a thread per channel.
extern "C" __global__ void gdn_record_keep_rows(const unsigned long long* __restrict__ bufs,
                                                const unsigned int* __restrict__ rows, int m) {
    float* b = (float*)bufs[2 * (size_t)blockIdx.x];
    const size_t d = (size_t)bufs[2 * (size_t)blockIdx.x + 1];
    const size_t c = (size_t)blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= d) return;
    for (int i = 0; i < m; ++i) {
        const unsigned int src = rows[i];
        if (src != (unsigned int)i) b[(size_t)i * d + c] = b[(size_t)src * d + c];
    }
}

// The value product of the hybrids' gated attention over a long cache, o = p·v per kv head, split
// over key chunks (cuBLAS ran the one (rows × keys)·(keys × d) product per kv head on 32 blocks: 70 µs
// a layer at Qwen3.6-27B's 4 kv heads × 2100 keys × 256 channels). Phase one, block (chunk s, kv
// head h, tile of AV_ROWS rows), a thread per channel: the chunk's probabilities staged in shared
// memory, each thread sums p[r, j]·v[j, c] over the chunk's keys in key order (f32) into
// part[h, s, r, c]. Phase two: each output element adds its chunks' partials in chunk order and
// is rounded once. A fixed order whatever the row count, so a row's output does not depend on the
// rows beside it. (Phase one's threads share the staged probabilities, so the host emulation of
// this file does not run it; the GPU test `attention_over_a_buffer_matches_attention` does.)
#define AV_ROWS 8
#define AV_KEYS 64
template <typename T>
__device__ void gdn_attn_values_part(const T* p, const T* v, int m, int cap, int d, float* part) {
    __shared__ float sp[AV_ROWS][AV_KEYS];
    const int s = blockIdx.x, h = blockIdx.y, r0 = blockIdx.z * AV_ROWS;
    const int j0 = s * AV_KEYS, nj = cap - j0 < AV_KEYS ? cap - j0 : AV_KEYS;
    const int nr = m - r0 < AV_ROWS ? m - r0 : AV_ROWS;
    for (int e = threadIdx.x; e < AV_ROWS * AV_KEYS; e += blockDim.x) {
        const int r = e / AV_KEYS, j = e % AV_KEYS;
        sp[r][j] = (r < nr && j < nj) ? gd_ld(p, ((size_t)h * m + r0 + r) * cap + j0 + j) : 0.0f;
    }
    __syncthreads();
    const int S = gridDim.x;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc[AV_ROWS];
#pragma unroll
        for (int r = 0; r < AV_ROWS; ++r) acc[r] = 0.0f;
        const T* vc = v + ((size_t)h * cap + j0) * d + c;
        for (int j = 0; j < nj; ++j) {
            const float x = gd_ld(vc, (size_t)j * d);
#pragma unroll
            for (int r = 0; r < AV_ROWS; ++r) acc[r] = fmaf(sp[r][j], x, acc[r]);
        }
        for (int r = 0; r < nr; ++r) part[(((size_t)h * S + s) * m + r0 + r) * d + c] = acc[r];
    }
}
extern "C" __global__ void gdn_attn_values_part_f32(const float* p, const float* v, int m, int cap,
                                                    int d, float* part) {
    gdn_attn_values_part(p, v, m, cap, d, part);
}
extern "C" __global__ void gdn_attn_values_part_bf16(const bf16_t* p, const bf16_t* v, int m,
                                                     int cap, int d, float* part) {
    gdn_attn_values_part(p, v, m, cap, d, part);
}
template <typename T>
__device__ void gdn_attn_values_sum(const float* part, int kv, int S, int m, int d, T* out) {
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)kv * m * d) return;
    const size_t h = idx / ((size_t)m * d), rc = idx % ((size_t)m * d);
    const float* src = part + h * S * m * d + rc;
    float acc = src[0];
    for (int s = 1; s < S; ++s) acc += src[(size_t)s * m * d];
    gd_st(out, idx, acc);
}
extern "C" __global__ void gdn_attn_values_sum_f32(const float* part, int kv, int S, int m, int d,
                                                   float* out) {
    gdn_attn_values_sum(part, kv, S, m, d, out);
}
extern "C" __global__ void gdn_attn_values_sum_bf16(const float* part, int kv, int S, int m, int d,
                                                    bf16_t* out) {
    gdn_attn_values_sum(part, kv, S, m, d, out);
}
