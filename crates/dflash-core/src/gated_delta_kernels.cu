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
// One pending token of a folded commit on a lane's rows r = 4m + t of its column `s`: the decay,
// the prediction summed over the rows (the lanes' quarters met by `rule_sum4`), the write — the
// walk's arithmetic for a node without outputs. `kk`: the token's key row (global memory, read
// again through RELOAD for the write, or shared memory when `SHARED`); `vj`, `b`: its value at
// the lane's column and its write strength.
template <bool SHARED>
__device__ __forceinline__ void pending_token_lanes4(float* s, float alpha, const float* kk,
                                                     float vj, float b, int t) {
    float pred = 0.0f;
#pragma unroll
    for (int m = 0; m < DK / 4; ++m) {
        s[m] *= alpha;
        pred += kk[4 * m + t] * s[m];
    }
    const float d = b * (vj - rule_sum4(pred));
    if constexpr (SHARED) {
#pragma unroll
        for (int m = 0; m < DK / 4; ++m) s[m] += kk[4 * m + t] * d;
    } else {
#pragma unroll
        for (int m = 0; m < DK / 4; ++m) s[m] += RELOAD(kk + 4 * m + t) * d;
    }
}

// The folded commit's pending tokens staged (the fold kernel's default; `DFLASH_GDN_FOLD_STAGE=0`
// walks them from global memory as above): FOLD_CHUNK tokens at a time, the warp loads their keys
// (head h), its 8 value columns, decays and strengths into shared memory `stage` with every load
// in flight — issued right behind the state column's loads — then walks them from shared memory.
// Unstaged, each pending token waited on its own global loads in the serial walk (~0.8 µs a
// token a layer at Qwen3.6-27B, session 35). The same floats in the same order: the same bits.
#ifndef FOLD_CHUNK
#define FOLD_CHUNK 8
#endif
#define FOLD_STAGE_FLOATS (FOLD_CHUNK * DK + FOLD_CHUNK * 8 + 2 * FOLD_CHUNK)
static_assert(FOLD_CHUNK <= 32 && FOLD_CHUNK * 8 % 32 == 0 && FOLD_CHUNK * DK % 32 == 0,
              "a staged chunk's decays fit one load a lane; its keys and values whole loads a lane");
__device__ __forceinline__ void gated_delta_pending_staged(
    float* s, float* stage, const float* __restrict__ pk, const float* __restrict__ pv,
    const float* __restrict__ pg, const float* __restrict__ pb, int np, int H, int dv, int h,
    int j, int t) {
    const int lane = threadIdx.x, j0 = j - (lane & 7);
    float* sk = stage;
    float* sv = sk + FOLD_CHUNK * DK;
    float* sg = sv + FOLD_CHUNK * 8;
    float* sb = sg + FOLD_CHUNK;
#pragma unroll 1
    for (int c0 = 0; c0 < np; c0 += FOLD_CHUNK) {
        const int cn = np - c0 < FOLD_CHUNK ? np - c0 : FOLD_CHUNK;
        __syncwarp();  // the last chunk's reads are done
        // every load of the chunk issued before any store (a fixed count a lane, predicated)
        float kx[FOLD_CHUNK * DK / 32];
#pragma unroll
        for (int u = 0; u < FOLD_CHUNK * DK / 32; ++u) {
            const int e = lane + 32 * u;
            kx[u] = e < cn * DK ? pk[((size_t)(c0 + e / DK) * H + h) * DK + e % DK] : 0.0f;
        }
        float vx[FOLD_CHUNK * 8 / 32 > 0 ? FOLD_CHUNK * 8 / 32 : 1];
#pragma unroll
        for (int u = 0; u < FOLD_CHUNK * 8 / 32; ++u) {
            const int e = lane + 32 * u, jj = j0 + (e & 7);
            vx[u] = e < cn * 8 && jj < dv ? pv[((size_t)(c0 + e / 8) * H + h) * dv + jj] : 0.0f;
        }
        const size_t th0 = (size_t)(c0 + lane) * H + h;
        const float gx = lane < cn ? pg[th0] : 0.0f, bx = lane < cn ? pb[th0] : 0.0f;
#pragma unroll
        for (int u = 0; u < FOLD_CHUNK * DK / 32; ++u) sk[lane + 32 * u] = kx[u];
#pragma unroll
        for (int u = 0; u < FOLD_CHUNK * 8 / 32; ++u) sv[lane + 32 * u] = vx[u];
        if (lane < FOLD_CHUNK) {
            sg[lane] = gx;
            sb[lane] = bx;
        }
        __syncwarp();
#pragma unroll 1
        for (int ii = 0; ii < cn; ++ii)
            pending_token_lanes4<true>(s, expf(sg[ii]), sk + ii * DK, sv[ii * 8 + (lane & 7)],
                                       sb[ii], t);
    }
}
__device__ __forceinline__ void gated_delta_tree_lanes4(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const float* __restrict__ beta, const float* __restrict__ state,
    const int* __restrict__ parents, const int* __restrict__ keep, float* __restrict__ out,
    float* __restrict__ scratch, float* __restrict__ last, int T, int H, int dv, int h, int j,
    int t, const float* const* pending = nullptr, int np = 0, float* fold_stage = nullptr) {
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
        if (fold_stage) {
            gated_delta_pending_staged(s, fold_stage, pk, pv, pg, pb, np, H, dv, h, j, t);
        } else {
#pragma unroll 1
            for (int i = 0; i < np; ++i) {
                const size_t th = (size_t)i * H + h;
                pending_token_lanes4<false>(s, expf(pg[th]), pk + th * DK, pv[th * dv + jc],
                                            pb[th], t);
            }
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
                                                      int np, float* fold_stage = nullptr) {
#ifdef RULE_LANES4
#ifdef RULE_STAGED
    (void)pending;
    (void)np;  // (the staged kernels take no folded commit: the host never asks them to)
    (void)fold_stage;
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
                            , pending, np, fold_stage
#endif
    );
    return;
#else
    (void)fold_stage;  // (one lane a column walks the pending tokens from global memory)
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
// as the replay (so the same bits), with one read of the state instead of two. `staged` (the
// default): the four-lane kernel walks the pending tokens from shared memory
// (`gated_delta_pending_staged`); 0: from global memory.
extern "C" __global__ void __launch_bounds__(32, RULE_MIN_BLOCKS) gated_delta_tree_fold_f32(
    const unsigned long long* __restrict__ ptrs, const unsigned long long* __restrict__ fold,
    int T, int H, int dv, int staged) {
    const float* pending[4] = {(const float*)fold[0], (const float*)fold[1],
                               (const float*)fold[2], (const float*)fold[3]};
    const int np = *(const int*)fold[4];
#if defined(RULE_LANES4) && !defined(RULE_STAGED)
    __shared__ float stage[FOLD_STAGE_FLOATS];
    gated_delta_rule_call(ptrs, T, H, dv, pending, np, staged ? stage : nullptr);
#else
    (void)staged;
    gated_delta_rule_call(ptrs, T, H, dv, pending, np);
#endif
}

