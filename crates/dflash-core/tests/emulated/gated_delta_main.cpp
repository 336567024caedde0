// The host `main` of the Gated DeltaNet kernels' CPU emulation (tests/gated_delta_kernel_emulated.rs
// compiles it after the prelude and the kernel source): reads a mode and its inputs on stdin,
// launches the grid as gated_delta_cuda.rs / gated_delta_commit_cuda.rs do, block by block and
// thread by thread (a WARP_LANES build: a rule block's 32 lanes at once, as host threads), and
// writes the outputs on stdout.
#include <stdio.h>
#include <stdlib.h>
#include <vector>
#include <thread>
template <class T> static std::vector<T> take(size_t n) {
    std::vector<T> v(n);
    if (n && fread(v.data(), sizeof(T), n, stdin) != n) { fprintf(stderr, "short input\n"); exit(2); }
    return v;
}
template <class T> static void put(const std::vector<T>& v) { fwrite(v.data(), sizeof(T), v.size(), stdout); }
// a grid of `items` threads in blocks of 128 (gated_delta_cuda.rs's per_item)
template <class F> static void per_item(size_t items, F f) {
    blockDim = {128, 1, 1};
    for (unsigned bx = 0; bx < (items + 127) / 128; ++bx)
        for (unsigned tx = 0; tx < 128; ++tx) { blockIdx = {bx, 0, 0}; threadIdx = {tx, 0, 0}; f(); }
}
// One block of `threads` threads running `f`: one after another on this host thread, or (a
// WARP_LANES build: the four-lane rules, whose lanes shuffle and meet at __syncwarp) as that many
// host threads at once — one warp, so 32.
template <class F> static void run_block(Dim3 block, unsigned threads, F f) {
#ifdef WARP_LANES
    std::vector<std::thread> lanes;
    for (unsigned tx = 0; tx < threads; ++tx)
        lanes.emplace_back([=] {
            blockIdx = block;
            threadIdx = {tx, 0, 0};
            f();
        });
    for (auto& l : lanes) l.join();
#else
    for (unsigned tx = 0; tx < threads; ++tx) {
        blockIdx = block;
        threadIdx = {tx, 0, 0};
        f();
    }
#endif
}
// the rule's columns a 32-thread block (gated_delta_cuda.rs's launch_rule: four lanes a column
// in the four-lane kernels)
#ifdef RULE_LANES4
static const unsigned RULE_COLUMNS = 8;
#else
static const unsigned RULE_COLUMNS = 32;
#endif
// the grid of gated_delta_cuda.rs's launch_rule: blocks of 32 threads, ceil(dv / columns) × H × L
static void launch_layers(const unsigned long long* table, int L, int T, int H, int dv) {
    const unsigned threads = 32;
    blockDim = {threads, 1, 1};
    for (unsigned bz = 0; bz < (unsigned)L; ++bz)
        for (unsigned by = 0; by < (unsigned)H; ++by)
            for (unsigned bx = 0; bx < (dv + RULE_COLUMNS - 1) / RULE_COLUMNS; ++bx)
                run_block({bx, by, bz}, threads,
                          [=] { gated_delta_tree_layers_f32(table, T, H, dv); });
}
// L layers' chains of T tokens at once, no outputs (advance_layers): per layer k, v, g, beta,
// state in; the final states out
static int chain_layers() {
    auto head = take<int>(5);
    int L = head[0], T = head[1], H = head[2], dk = head[3], dv = head[4];
    if (dk != DK) { fprintf(stderr, "dk %d but DK %d\n", dk, DK); return 2; }
    std::vector<std::vector<float>> in;
    std::vector<std::vector<float>> last(L, std::vector<float>((size_t)H * dk * dv, NAN));
    std::vector<unsigned long long> table;
    for (int l = 0; l < L; ++l) {
        in.push_back(take<float>((size_t)T * H * dk));
        in.push_back(take<float>((size_t)T * H * dv));
        in.push_back(take<float>((size_t)T * H));
        in.push_back(take<float>((size_t)T * H));
        in.push_back(take<float>((size_t)H * dk * dv));
    }
    for (int l = 0; l < L; ++l) {
        auto p = [&](int i) { return (unsigned long long)in[5 * l + i].data(); };
        unsigned long long row[11] = {p(0), p(0), p(1), p(2), p(3), p(4), 0, 0, 0, 0,
                                      (unsigned long long)last[l].data()};
        table.insert(table.end(), row, row + 11);
    }
    launch_layers(table.data(), L, T, H, dv);
    for (auto& s : last) put(s);
    return 0;
}
// L layers' convolution windows after n kept tokens (gdn_conv_window_layers): per layer start
// [W, C] and conv_in [rows, C] in; the windows out
static int conv_windows() {
    auto head = take<int>(5);
    int L = head[0], n = head[1], W = head[2], C = head[3], rows = head[4];
    std::vector<std::vector<float>> in, out(L, std::vector<float>((size_t)W * C, NAN));
    std::vector<unsigned long long> table;
    for (int l = 0; l < L; ++l) {
        in.push_back(take<float>((size_t)W * C));
        in.push_back(take<float>((size_t)rows * C));
    }
    for (int l = 0; l < L; ++l) {
        table.push_back((unsigned long long)in[2 * l].data());
        table.push_back((unsigned long long)in[2 * l + 1].data());
        table.push_back((unsigned long long)out[l].data());
    }
    blockDim = {128, 1, 1};
    for (unsigned by = 0; by < (unsigned)L; ++by)
        for (unsigned bx = 0; bx < ((unsigned)C + 127) / 128; ++bx)
            for (unsigned tx = 0; tx < 128; ++tx) {
                blockIdx = {bx, by, 0};
                threadIdx = {tx, 0, 0};
                gdn_conv_window_layers(table.data(), n, W, C);
            }
    for (auto& o : out) put(o);
    return 0;
}
// a tree's rule inputs after its header: parents, kept flags, q, k, v, g, beta ([T, H, ·])
struct TreeInputs {
    std::vector<int> parents, keep;
    std::vector<float> q, k, v, g, beta;
    TreeInputs(int T, int H, int dv)
        : parents(take<int>(T)), keep(take<int>(T)), q(take<float>((size_t)T * H * DK)),
          k(take<float>((size_t)T * H * DK)), v(take<float>((size_t)T * H * dv)),
          g(take<float>((size_t)T * H)), beta(take<float>((size_t)T * H)) {}
};
static int tree() {
    auto head = take<int>(5);
    int T = head[0], H = head[1], dk = head[2], dv = head[3], outputs = head[4];
    if (dk != DK) { fprintf(stderr, "dk %d but DK %d\n", dk, DK); return 2; }
    TreeInputs x(T, H, dv);
    auto &parents = x.parents, &keep = x.keep;
    auto &q = x.q, &k = x.k, &v = x.v, &g = x.g, &beta = x.beta;
    auto state = take<float>((size_t)H * dk * dv);
    std::vector<float> out((size_t)T * H * dv, NAN), scratch((size_t)T * H * dk * dv, NAN),
        last((size_t)H * dk * dv, NAN);
    // one layer through the pointer table, as gated_delta_cuda.rs launches it
    unsigned long long table[11] = {
        (unsigned long long)q.data(), (unsigned long long)k.data(), (unsigned long long)v.data(),
        (unsigned long long)g.data(), (unsigned long long)beta.data(),
        (unsigned long long)state.data(), (unsigned long long)parents.data(),
        (unsigned long long)keep.data(),
        outputs ? (unsigned long long)out.data() : 0ull,
        (unsigned long long)scratch.data(), (unsigned long long)last.data()};
    launch_layers(table, 1, T, H, dv);
    if (outputs) put(out);
    put(last);
    return 0;
}
// the hybrid step's rule with a folded commit (gated_delta_tree_fold_f32, one layer; `staged`: its
// argument): np pending
// tokens' k, v, g, beta, then the step's tree from the state they leave; out: the outputs, the
// state buffer after the kernel (the commit, in place), the scratch of kept nodes not compared
static int fold() {
    auto head = take<int>(6);
    int T = head[0], H = head[1], dk = head[2], dv = head[3], np = head[4], staged = head[5];
    if (dk != DK) { fprintf(stderr, "dk %d but DK %d\n", dk, DK); return 2; }
    TreeInputs x(T, H, dv);
    auto &parents = x.parents, &keep = x.keep;
    auto &q = x.q, &k = x.k, &v = x.v, &g = x.g, &beta = x.beta;
    auto pk = take<float>((size_t)np * H * dk), pv = take<float>((size_t)np * H * dv);
    auto pg = take<float>((size_t)np * H), pb = take<float>((size_t)np * H);
    auto state = take<float>((size_t)H * dk * dv);
    std::vector<float> out((size_t)T * H * dv, NAN), scratch((size_t)T * H * dk * dv, NAN);
    unsigned long long table[11] = {
        (unsigned long long)q.data(), (unsigned long long)k.data(), (unsigned long long)v.data(),
        (unsigned long long)g.data(), (unsigned long long)beta.data(),
        (unsigned long long)state.data(), (unsigned long long)parents.data(),
        (unsigned long long)keep.data(), (unsigned long long)out.data(),
        (unsigned long long)scratch.data(), 0ull};
    int count = np;
    unsigned long long fold[5] = {(unsigned long long)pk.data(), (unsigned long long)pv.data(),
                                  (unsigned long long)pg.data(), (unsigned long long)pb.data(),
                                  (unsigned long long)&count};
    const unsigned threads = 32;
    blockDim = {threads, 1, 1};
    const unsigned long long* t = table;
    const unsigned long long* f = fold;
    for (unsigned by = 0; by < (unsigned)H; ++by)
        for (unsigned bx = 0; bx < (dv + RULE_COLUMNS - 1) / RULE_COLUMNS; ++bx)
            run_block({bx, by, 0}, threads,
                      [=] { gated_delta_tree_fold_f32(t, f, T, H, dv, staged); });
    put(out);
    put(state);
    return 0;
}
// rows 0..n of B record buffers copied aside (gdn_record_pending_rows): per buffer its width,
// then its rows [rows, width]; out: each destination [n, width]
static int pending_rows() {
    auto head = take<int>(3);
    int B = head[0], n = head[1], rows = head[2];
    auto widths = take<int>(B);
    std::vector<std::vector<float>> src, dst;
    std::vector<unsigned long long> table;
    for (int b = 0; b < B; ++b) {
        src.push_back(take<float>((size_t)rows * widths[b]));
        dst.push_back(std::vector<float>((size_t)n * widths[b], NAN));
    }
    int widest = 0;
    for (int b = 0; b < B; ++b) {
        table.push_back((unsigned long long)src[b].data());
        table.push_back((unsigned long long)dst[b].data());
        table.push_back((unsigned long long)widths[b]);
        widest = widths[b] > widest ? widths[b] : widest;
    }
    blockDim = {256, 1, 1};
    for (unsigned bx = 0; bx < (unsigned)B; ++bx)
        for (unsigned by = 0; by < (unsigned)(widest + 255) / 256; ++by)
            for (unsigned tx = 0; tx < 256; ++tx) {
                blockIdx = {bx, by, 0};
                threadIdx = {tx, 0, 0};
                gdn_record_pending_rows(table.data(), &n);
            }
    for (auto& d : dst) put(d);
    return 0;
}
static int conv() {
    auto head = take<int>(4);
    int n = head[0], C = head[1], K = head[2], bf = head[3];
    auto x32 = bf ? std::vector<float>() : take<float>((size_t)n * C);
    auto x16 = bf ? take<bf16_t>((size_t)n * C) : std::vector<bf16_t>();
    auto cs = take<float>((size_t)(K - 1) * C), w = take<float>((size_t)C * K);
    auto parents = take<int>(n);
    std::vector<float> u((size_t)n * C, NAN), q32((size_t)n * C, NAN);
    per_item((size_t)n * C, [&] {
        if (bf) gdn_conv_silu_bf16(x16.data(), cs.data(), w.data(), parents.data(), n, C, K, u.data(), q32.data());
        else gdn_conv_silu_f32(x32.data(), cs.data(), w.data(), parents.data(), n, C, K, u.data(), q32.data());
    });
    put(u);
    put(q32);
    return 0;
}
static int rule_inputs() {
    auto head = take<int>(5);
    int n = head[0], Hk = head[1], Hv = head[2], dv = head[3], bf = head[4];
    size_t C = (size_t)2 * Hk * DK + (size_t)Hv * dv;
    auto u = take<float>(n * C);
    auto b32 = bf ? std::vector<float>() : take<float>((size_t)n * Hv);
    auto a32 = bf ? std::vector<float>() : take<float>((size_t)n * Hv);
    auto b16 = bf ? take<bf16_t>((size_t)n * Hv) : std::vector<bf16_t>();
    auto a16 = bf ? take<bf16_t>((size_t)n * Hv) : std::vector<bf16_t>();
    auto dtb = take<float>(Hv), na = take<float>(Hv);
    std::vector<float> q((size_t)n * Hv * DK, NAN), k((size_t)n * Hv * DK, NAN),
        v((size_t)n * Hv * dv, NAN), g((size_t)n * Hv, NAN), beta((size_t)n * Hv, NAN);
    per_item((size_t)n * Hv * (DK > dv ? DK : dv), [&] {
        if (bf) gdn_rule_inputs_bf16(u.data(), b16.data(), a16.data(), dtb.data(), na.data(), n, Hk, Hv, dv, q.data(), k.data(), v.data(), g.data(), beta.data());
        else gdn_rule_inputs_f32(u.data(), b32.data(), a32.data(), dtb.data(), na.data(), n, Hk, Hv, dv, q.data(), k.data(), v.data(), g.data(), beta.data());
    });
    put(q); put(k); put(v); put(g); put(beta);
    return 0;
}
static int gated_norm() {
    auto head = take<int>(4);
    int n = head[0], Hv = head[1], dv = head[2], bf = head[3];
    float eps = take<float>(1)[0];
    auto o = take<float>((size_t)n * Hv * dv);
    auto z32 = bf ? std::vector<float>() : take<float>((size_t)n * Hv * dv);
    auto z16 = bf ? take<bf16_t>((size_t)n * Hv * dv) : std::vector<bf16_t>();
    auto w = take<float>(dv);
    std::vector<float> y32((size_t)n * Hv * dv, NAN);
    std::vector<bf16_t> y16((size_t)n * Hv * dv, 0xffff);
    per_item((size_t)n * Hv * dv, [&] {
        if (bf) gdn_gated_norm_bf16(o.data(), z16.data(), Hv * dv, w.data(), n, Hv, dv, eps, y16.data());
        else gdn_gated_norm_f32(o.data(), z32.data(), Hv * dv, w.data(), n, Hv, dv, eps, y32.data());
    });
    if (bf) put(y16); else put(y32);
    return 0;
}
// the fused convolution + rule inputs over rows `ld` (qkv) and `gld` (gates) elements apart:
// every thread of a block through phase one, then every thread through phase two (the barrier)
static int fused_inputs() {
    auto head = take<int>(8);
    int n = head[0], Hk = head[1], Hv = head[2], dv = head[3], K = head[4], ld = head[5], gld = head[6], bf = head[7];
    int C = 2 * Hk * DK + Hv * dv;
    auto x32 = bf ? std::vector<float>() : take<float>((size_t)n * ld);
    auto x16 = bf ? take<bf16_t>((size_t)n * ld) : std::vector<bf16_t>();
    auto cs = take<float>((size_t)(K - 1) * C), w = take<float>((size_t)C * K);
    auto parents = take<int>(n);
    auto g32 = bf ? std::vector<float>() : take<float>((size_t)2 * n * gld);
    auto g16 = bf ? take<bf16_t>((size_t)2 * n * gld) : std::vector<bf16_t>();
    auto dtb = take<float>(Hv), na = take<float>(Hv);
    std::vector<float> q32((size_t)n * C, NAN), q((size_t)n * Hv * DK, NAN), k((size_t)n * Hv * DK, NAN),
        v((size_t)n * Hv * dv, NAN), g((size_t)n * Hv, NAN), beta((size_t)n * Hv, NAN);
    const unsigned E = DK > dv ? DK : dv;
    blockDim = {E, 1, 1};
    float xs[2 * DK];
    for (unsigned bx = 0; bx < (unsigned)(n * Hv); ++bx) {
        blockIdx = {bx, 0, 0};
        for (unsigned tx = 0; tx < E; ++tx) {
            threadIdx = {tx, 0, 0};
            if (bf) gdn_fused_conv_phase(x16.data(), ld, cs.data(), w.data(), parents.data(), K, Hk, Hv, dv, q32.data(), v.data(), xs, xs + DK);
            else gdn_fused_conv_phase(x32.data(), ld, cs.data(), w.data(), parents.data(), K, Hk, Hv, dv, q32.data(), v.data(), xs, xs + DK);
        }
        for (unsigned tx = 0; tx < E; ++tx) {
            threadIdx = {tx, 0, 0};
            // b is the first gld-wide half of the gate rows, a the second
            if (bf) gdn_fused_inputs_phase(g16.data(), g16.data() + (size_t)n * gld, gld, dtb.data(), na.data(), Hv, xs, xs + DK, q.data(), k.data(), g.data(), beta.data());
            else gdn_fused_inputs_phase(g32.data(), g32.data() + (size_t)n * gld, gld, dtb.data(), na.data(), Hv, xs, xs + DK, q.data(), k.data(), g.data(), beta.data());
        }
    }
    put(q32); put(q); put(k); put(v); put(g); put(beta);
    return 0;
}
int main() {
    pthread_barrier_init(&warp_barrier, nullptr, 32);
    int mode = take<int>(1)[0];
    switch (mode) {
        case 0: return tree();
        case 1: return conv();
        case 2: return rule_inputs();
        case 3: return gated_norm();
        case 4: return chain_layers();
        case 5: return conv_windows();
        case 6: return fused_inputs();
        case 7: return fold();
        case 8: return pending_rows();
    }
    return 2;
}
