// mul_mat: y[t, o] = sum_k x[t, k] * w[o, k] with f32 activations and f32 accumulation.
//
//   gemv_<fmt>   decode (m <= GEMV_MAX_TOKENS tokens): weights read straight from their blocks,
//                dequantized in registers, each weight row read once for all m tokens.
//   gemv16_<fmt> the same for up to 2 * GEMV_MAX_TOKENS tokens (a 16-token speculative verify call).
//   gemv1_<fmt>  the same for m == 1 (the decode step), with no per-token guards.
//   dequant_<fmt> prefill: the whole matrix as f32 into a scratch buffer, then cuBLAS (host side).
//   matmul_batched_f32  every other case (activation weights, batch axes): a plain dot per output.
//
// GEMV layout: a group of 32 lanes (a warp on NVIDIA, half a wavefront on gfx9: the reductions
// below only shuffle within 32 lanes, so the launch geometry is the same on every device) owns
// GEMV_NR consecutive rows. Lanes stride over the row's units (a unit is one 4..16-byte piece of
// a block, see quant.cuh), so a group's loads are contiguous; each x value loaded (through L1:
// x is small and read by every group) serves all GEMV_NR rows, which halves the L1 traffic that
// otherwise limits 4-bit formats (x is ~8x their weight bytes).
#include "quant.cuh"

#ifndef GEMV_THREADS
#define GEMV_THREADS 128  // 4 row groups per block: many small blocks balance the SMs at 4096 rows
#endif
#ifndef GEMV_NR
#define GEMV_NR 2  // rows per 32-lane group
#endif
#ifndef GEMV_MAX_TOKENS
#define GEMV_MAX_TOKENS 8  // gemv_<fmt>: up to 8 tokens; gemv16_<fmt>: 9..16 (matmul.py GEMV_MAX_TOKENS)
#endif

DEVICE F4 ldx(const float* p) { return *(const F4*)p; }

DEVICE float dot4(const F4& a, const float* v) {
    return fmaf(a.d, v[3], fmaf(a.c, v[2], fmaf(a.b, v[1], a.a * v[0])));
}

// acc += x . v over two runs of 4 (a: run 0, c: run 1). FINAL: v are the weights; otherwise
// integer codes whose run scales sl, sh multiply each run's dot once. FINAL adds the two runs' dots,
// each its own chain, as gemv1v2_impl does for float rows: every float GEMV below (gemv_, gemvm,
// gemvm_sets) then sums a row's units in the decode kernel's arithmetic, so a verify call's row of a
// float weight is the decode step's value bit for bit where the geometry splits the row alike
// (matmul.py gemvm_exact; tests/test_speculative.py).
template <bool FINAL>
DEVICE void dot8(const F4& a, const F4& c, const float* v, float sl, float sh, float& acc) {
    if (FINAL) {
        acc = acc + (dot4(a, v) + dot4(c, v + 4));
    } else {
        acc = fmaf(sh, dot4(c, v + 4), fmaf(sl, dot4(a, v), acc));
    }
}

template <class F, int M>
DEVICE void gemv_scalar(const u8* const* wr, const float* __restrict__ X, float (*acc)[M], int n_in, int m, int lane) {
    for (int k = lane; k < n_in; k += 32) {
        float wv[GEMV_NR];
#pragma unroll
        for (int r = 0; r < GEMV_NR; ++r) wv[r] = F::elem(wr[r], k);
#pragma unroll
        for (int t = 0; t < M; ++t) {
            if (t < m) {
                const float xv = X[(long long)t * n_in + k];
#pragma unroll
                for (int r = 0; r < GEMV_NR; ++r) acc[r][t] = fmaf(xv, wv[r], acc[r][t]);
            }
        }
    }
}

template <class F, int M>
DEVICE void gemv_impl(const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X,
                      float* __restrict__ Y, int n_out, int n_in, int m) {
    __shared__ float tab_smem[16];
    const float* tab = init_table<F>(tab_smem);
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * (GEMV_THREADS / 32) + (threadIdx.x >> 5)) * GEMV_NR;
    if (row0 >= n_out) return;  // no block-wide sync after this point
    const u8* wr[GEMV_NR];
#pragma unroll
    for (int r = 0; r < GEMV_NR; ++r) {  // rows past the end repeat the last row (read, never stored)
        const int row = row0 + r < n_out ? row0 + r : n_out - 1;
        wr[r] = W + (long long)row * row_bytes;
    }
    float acc[GEMV_NR][M];
#pragma unroll
    for (int r = 0; r < GEMV_NR; ++r)
#pragma unroll
        for (int t = 0; t < M; ++t) acc[r][t] = 0.0f;

    if (F::FLOAT && n_in % 8 != 0) {  // float rows that are not whole 16-byte pieces: per value
        if constexpr (F::FLOAT) gemv_scalar<F, M>(wr, X, acc, n_in, m, lane);
    } else {
        // Explicit batches of UN units per lane: every load of a batch is issued before the first
        // use, so each lane keeps UN * GEMV_NR pieces in flight (the memory-level parallelism a
        // memory-bound kernel needs; the compiler does not hoist loads across a runtime loop).
        constexpr int UN = M == 1 ? 4 : 2;
        const int units = (n_in / F::QK) * F::UPB;
        for (int u0 = lane; u0 < units; u0 += 32 * UN) {
            typename F::U q[UN][GEMV_NR];
            int bs[UN], js[UN];
#pragma unroll
            for (int i = 0; i < UN; ++i) {
                const int u = u0 + 32 * i < units ? u0 + 32 * i : u0;  // past the end: reload u0, unused
                bs[i] = u / F::UPB;
                js[i] = u - bs[i] * F::UPB;
#pragma unroll
                for (int r = 0; r < GEMV_NR; ++r) q[i][r] = F::load(wr[r] + (long long)bs[i] * F::BB, js[i]);
            }
#pragma unroll
            for (int i = 0; i < UN; ++i) {
                if (i > 0 && u0 + 32 * i >= units) break;
                const int b = bs[i], j = js[i];
#pragma unroll
                for (int r = 0; r < GEMV_NR; ++r) F::prep(q[i][r], j);
                const float* xb = X + (long long)b * F::QK;
#pragma unroll
                for (int w = 0; w < F::WPU; ++w) {
                    int o0, o1;
                    F::offs(j, w, o0, o1);
                    float v[GEMV_NR][8], sl[GEMV_NR] = {}, sh[GEMV_NR] = {};
#pragma unroll
                    for (int r = 0; r < GEMV_NR; ++r) decode_gemv<F>(q[i][r], j, w, v[r], sl[r], sh[r], tab);
#pragma unroll
                    for (int t = 0; t < M; ++t) {
                        if (t < m) {
                            const F4 a = ldx(xb + (long long)t * n_in + o0), c = ldx(xb + (long long)t * n_in + o1);
#pragma unroll
                            for (int r = 0; r < GEMV_NR; ++r) dot8<F::FINAL>(a, c, v[r], sl[r], sh[r], acc[r][t]);
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_NR; ++r)
#pragma unroll
        for (int t = 0; t < M; ++t) {
            if (t < m) {
                const float s = sum32(acc[r][t]);
                if (lane == 0 && row0 + r < n_out) Y[(long long)t * n_out + row0 + r] = s;
            }
        }
}

// W: the weight's raw rows (row_bytes apart); X: [m, n_in] f32, 16-byte aligned; Y: [m, n_out].
// Grid: ceil(n_out / (GEMV_THREADS / 32 * GEMV_NR)) blocks of GEMV_THREADS.
#define DEFINE_GEMV(name, F)                                                                              \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) gemv_##name(                               \
        const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X, float* __restrict__ Y, \
        int n_out, int n_in, int m) {                                                                     \
        PDL_ENTRY();                                                                                      \
        gemv_impl<F, GEMV_MAX_TOKENS>(W, row_bytes, X, Y, n_out, n_in, m);                                \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) gemv16_##name(                             \
        const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X, float* __restrict__ Y, \
        int n_out, int n_in, int m) {                                                                     \
        PDL_ENTRY();                                                                                      \
        gemv_impl<F, 2 * GEMV_MAX_TOKENS>(W, row_bytes, X, Y, n_out, n_in, m);                            \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) gemv1_##name(                              \
        const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X, float* __restrict__ Y, \
        int n_out, int n_in, int m) {                                                                     \
        PDL_ENTRY();                                                                                      \
        gemv_impl<F, 1>(W, row_bytes, X, Y, n_out, n_in, 1);                                              \
    }
#if IN_PART(0)
FOR_EACH_QUANT(DEFINE_GEMV)
FOR_EACH_FLOAT(DEFINE_GEMV)
#endif

// ---------------------------------------------------------------- 2..16 tokens, float weights
// gemvm<M>_<fmt> (f32, f16, bf16): a speculative verify call's GEMV, M = 2, 4, 8 or 16 tokens (m <= M run).
// gemv_<fmt> gives a 32-lane group 2 rows, so each x value it loads (m tokens' worth, 4 bytes each)
// serves 2 weights: at 4 tokens x's traffic through L1 is 8x the bf16 weight's, and the call cost 11.0 us
// against 2.9-3.8 us for the same Qwen3-0.6B weights at one token (H200, 2026-12-01). Here a group of
// G lanes owns NR rows: x's traffic per weight drops by NR / 2, and a row's units are spread over G
// lanes so short rows still keep NR loads a lane in flight. Float rows of whole 8-value pieces only
// (matmul.py routes the rest to gemv_<fmt>). gemvm<M>_<fmt>_<cfg>, cfg = g<G>r<NR> (matmul.py GEMVM_CONFIGS).
#define GEMVM_THREADS 128

// GEMVM_TOKEN_GROUP(M): gemvm<M> (either impl) serves a call of m > M tokens on cdiv(m, M) times its blocks:
// block b runs row block bx = b / groups for tokens g M .. g M + M - 1 (g = b % groups), so the token groups of
// a row block run side by side and read its weight rows from L2 after the first. A row's sum for a token does
// not depend on the tokens beside it, so every row is the same bits as in the M-token kernel (and, for the
// exact geometries, the decode step's). Needs X, Y, n_in, n_out and m in scope; declares bx, narrows m.
#define GEMVM_TOKEN_GROUP(M)                                                     \
    const int groups_ = (m + (M) - 1) / (M);                                     \
    const int bx = (int)blockIdx.x / groups_;                                    \
    const int t0_ = ((int)blockIdx.x - bx * groups_) * (M);                      \
    X += (long long)t0_ * n_in;                                                  \
    Y += (long long)t0_ * n_out;                                                 \
    m = m - t0_ < (M) ? m - t0_ : (M)

// SW (mul_mat_swiglu, gemvmsw<M>_<fmt>_<cfg>): W holds 2 * n_out rows, gate rows then up rows; a group's
// first NR / 2 rows are gate rows, its last NR / 2 the same outputs' up rows, and only
// Y[t, o] = silu(gate) * up is stored, in elementwise.cu's swiglu_halves_f32 expression.
template <class F, int M, int G, int NR, bool SW = false>
DEVICE void gemvm_impl(const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X,
                       float* __restrict__ Y, int n_out, int n_in, int m, int bx) {
    static_assert(F::FLOAT && F::QK == 8 && F::UPB == 1, "float rows of 8-value units");
    static_assert(!SW || NR % 2 == 0, "a swiglu group reads gate/up row pairs");
    constexpr int GROUPS = GEMVM_THREADS / G, OUT = SW ? NR / 2 : NR;  // outputs a group
    __shared__ float part[GROUPS][G / 32][NR][M];
    const int lane = threadIdx.x % G, grp = threadIdx.x / G;
    const int row0 = (bx * GROUPS + grp) * OUT;  // every thread reaches the barrier below
    const u8* wr[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {  // rows past the end repeat the last row (read, never stored)
        const int i = row0 + r % OUT, o = i < n_out ? i : n_out - 1;
        wr[r] = W + (long long)(SW && r >= OUT ? n_out + o : o) * row_bytes;
    }
    float acc[NR][M];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int t = 0; t < M; ++t) acc[r][t] = 0.0f;
    const int units = n_in / 8;
    for (int u = lane; u < units; u += G) {
        typename F::U q[NR];
#pragma unroll
        for (int r = 0; r < NR; ++r) q[r] = F::load(wr[r] + (long long)u * F::BB, 0);
        float v[NR][8], one = 1.0f;
#pragma unroll
        for (int r = 0; r < NR; ++r) F::decode(q[r], 0, 0, v[r], one, one, nullptr);
        const float* xb = X + (long long)u * 8;
#pragma unroll
        for (int t = 0; t < M; ++t) {
            if (t < m) {
                const F4 a = ldx(xb + (long long)t * n_in), c = ldx(xb + (long long)t * n_in + 4);
#pragma unroll
                for (int r = 0; r < NR; ++r) dot8<true>(a, c, v[r], 1.0f, 1.0f, acc[r][t]);
            }
        }
    }
    const int warp = lane / 32;
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int t = 0; t < M; ++t) {
            const float s = sum32(acc[r][t]);
            if (threadIdx.x % 32 == 0) part[grp][warp][r][t] = s;
        }
    __syncthreads();
    for (int i = lane; i < OUT * M; i += G) {  // the group's warps' sums, in warp order
        const int r = i / M, t = i % M;
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < G / 32; ++k) s += part[grp][k][r][t];
        if constexpr (SW) {
            float up = 0.0f;
#pragma unroll
            for (int k = 0; k < G / 32; ++k) up += part[grp][k][r + OUT][t];
            s = s / (1.0f + expf(-s)) * up;
        }
        if (t < m && row0 + r < n_out) Y[(long long)t * n_out + row0 + r] = s;
    }
}
#define DEFINE_GEMVM_M(name, F, M, cfg, G, NR)                                                            \
    extern "C" __global__ void __launch_bounds__(GEMVM_THREADS) gemvm##M##_##name##_##cfg(                 \
        const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X, float* __restrict__ Y,  \
        int n_out, int n_in, int m) {                                                                      \
        PDL_ENTRY();                                                                                       \
        GEMVM_TOKEN_GROUP(M);                                                                              \
        gemvm_impl<F, M, G, NR>(W, row_bytes, X, Y, n_out, n_in, m, bx);                                   \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(GEMVM_THREADS) gemvmsw##M##_##name##_##cfg(               \
        const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X, float* __restrict__ Y,  \
        int n_out, int n_in, int m) {                                                                      \
        PDL_ENTRY();                                                                                       \
        GEMVM_TOKEN_GROUP(M);                                                                              \
        gemvm_impl<F, M, G, NR, true>(W, row_bytes, X, Y, n_out, n_in, m, bx);                             \
    }
#define DEFINE_GEMVM_CFG(name, F, cfg, G, NR)                                   \
    DEFINE_GEMVM_M(name, F, 2, cfg, G, NR) DEFINE_GEMVM_M(name, F, 4, cfg, G, NR) \
    DEFINE_GEMVM_M(name, F, 8, cfg, G, NR) DEFINE_GEMVM_M(name, F, 16, cfg, G, NR)
#define DEFINE_GEMVM(name, F)                   \
    DEFINE_GEMVM_CFG(name, F, g64r4, 64, 4)     \
    DEFINE_GEMVM_CFG(name, F, g128r2, 128, 2)
#if IN_PART(1)
FOR_EACH_FLOAT(DEFINE_GEMVM)
#endif

// ---------------------------------------------------------------- 2..16 tokens, float weights: row sets
// gemvm<M>_<fmt>_j<J>w<WB>r<NR> (matmul.py GEMVM_CONFIGS): gemvm_impl's product, laid out for what bounds it.
// gemvm16_bf16_g128r2 (4096x1024: 18.7 us on an H200, 2026-12-01, ~9 of ~67 TFLOP/s) gives a lane, per
// unit, 256 FMAs, 32 x loads that each touch 8 128-byte lines (a warp's lanes read 16 bytes 32 apart) and,
// at the end, 160 shuffles (sum32 of 32 sums): ~420 cycles of the SM's load/shuffle pipe a warp (a line a
// cycle, a shuffle a cycle) against 64 of FMA issue.
//  - A warp holds S = 32 / J sets of J lanes; a set owns NR rows and a lane accumulates [NR rows][M tokens]
//    in registers. Unit u of a row goes to lane u % J of warp u / J % WB (a row over G = J * WB lanes),
//    so the S sets of a warp read the same x pieces at once: a warp's x load touches J / 4 lines (one at
//    J = 4, served to 8 sets of rows) instead of 8.
//  - A set's J sums of a row and token meet in a reduce-scatter (set_sum_scatter): V (J - 1) / J shuffles
//    for V = NR * M sums instead of V log2 J; then shared memory, the WB warps' sums added in warp order.
//  - Each x piece loaded serves NR rows, each decoded weight M tokens; a batch of UN units (UNB weight bytes
//    a lane) is loaded before any is used, and a token's pieces of the batch's units are loaded together.
// With J = 32 and WB = 4 a row's split, its butterfly and the warp order are gemvm_impl's at G = 128, so
// j32w4r<NR> equals g128r2 bit for bit (a sum does not depend on the rows beside it); other J, WB add in
// other orders (tests compare them with the f64 product).
template <int V, int O>
DEVICE void set_sum_scatter(float* v, int lane) {
    // Sums v[0..V) over the lanes that differ in bits O, O/2, .., 1 (sum32's xor order). While V > 1 a step
    // keeps half the values (the upper half where lane & O) and sends the partner the other half, so a lane
    // ends with C = max(V / lanes, 1) sums, those from index lane / (lanes / (V / C)) * C on. Each step adds
    // the same two partial sums as sum32's step (a + b == b + a), so every sum is bitwise sum32's.
    if constexpr (O > 0) {
        if constexpr (V > 1) {
            const bool hi = lane & O;
#pragma unroll
            for (int i = 0; i < V / 2; ++i) {
                const float send = hi ? v[i] : v[i + V / 2], keep = hi ? v[i + V / 2] : v[i];
                v[i] = keep + SHFL_XOR(send, O);
            }
            set_sum_scatter<V / 2, O / 2>(v, lane);
        } else {
            v[0] += SHFL_XOR(v[0], O);
            set_sum_scatter<1, O / 2>(v, lane);
        }
    }
}

template <class F, int M, int J, int WB, int NR, int UNB, bool SW = false>
DEVICE void gemvm_sets_impl(const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X,
                            float* __restrict__ Y, int n_out, int n_in, int m, int bx) {
    static_assert(F::FLOAT && F::QK == 8 && F::UPB == 1, "float rows of 8-value units");
    static_assert(J >= 1 && J <= 32 && (J & (J - 1)) == 0, "sets of 1..32 lanes, a power of two");
    static_assert(!SW || NR % 2 == 0, "a swiglu set reads gate/up row pairs");
    constexpr int S = 32 / J, G = J * WB, OUT = SW ? NR / 2 : NR, V = NR * M;
    static_assert((V & (V - 1)) == 0, "the reduce-scatter halves the sums");
    constexpr int C = V >= J ? V / J : 1, L = V / C;  // sums a lane keeps; distinct lanes holding them, a set
    constexpr int UN = UNB / (NR * F::BB) > 0 ? UNB / (NR * F::BB) : 1;  // units a batch
    __shared__ float part[WB][C][S * L];  // [warp][sum c of a lane][set, lane slot]: each store one wavefront
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, set = lane / J;
    const int row0 = (bx * S + set) * OUT;  // every thread reaches the barrier below
    const u8* wr[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {  // rows past the end repeat the last row (read, never stored)
        const int i = row0 + r % OUT, row = i < n_out ? i : n_out - 1;
        wr[r] = W + (long long)(r >= OUT ? n_out + row : row) * row_bytes;  // r >= OUT: an up row (SW)
    }
    float acc[V];  // acc[r * M + t]: row r, token t
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = 0.0f;
    const int units = n_in / 8;
    for (int u0 = warp * J + lane % J; u0 < units; u0 += G * UN) {
        typename F::U q[UN][NR];
        bool has[UN];  // unit u0 + G i is in the row (past the end: u0 reloaded, unused)
#pragma unroll
        for (int i = 0; i < UN; ++i) {
            has[i] = i == 0 || u0 + G * i < units;
            const int u = has[i] ? u0 + G * i : u0;
#pragma unroll
            for (int r = 0; r < NR; ++r) q[i][r] = F::load(wr[r] + (long long)u * F::BB, 0);
        }
        float v[UN][NR][8], one = 1.0f;
#pragma unroll
        for (int i = 0; i < UN; ++i)
#pragma unroll
            for (int r = 0; r < NR; ++r) F::decode(q[i][r], 0, 0, v[i][r], one, one, nullptr);
        const float* xt = X + (long long)u0 * 8;  // token t's x piece of unit u0 + G i: xt + t n_in + 8 G i
#pragma unroll
        for (int t = 0; t < M; ++t, xt += n_in) {
            if (t < m) {
#pragma unroll
                for (int i = 0; i < UN; ++i) {
                    if (has[i]) {
                        const F4 a = ldx(xt + 8 * G * i), c = ldx(xt + 8 * G * i + 4);
#pragma unroll
                        for (int r = 0; r < NR; ++r) dot8<true>(a, c, v[i][r], 1.0f, 1.0f, acc[r * M + t]);
                    }
                }
            }
        }
    }
    set_sum_scatter<V, J / 2>(acc, lane);
    const int j = lane % J;
    if (j % (J / L) == 0) {
#pragma unroll
        for (int c = 0; c < C; ++c) part[warp][c][set * L + j / (J / L)] = acc[c];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < C * S * L; i += 32 * WB) {  // one sum each: the warps' partial sums, in warp order
        const int c = i / (S * L), st = i / L % S, slot = i % L, idx = slot * C + c, r = idx / M, t = idx % M;
        if (SW && r >= OUT) continue;  // an up row: read with its gate row
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < WB; ++k) s += part[k][c][i % (S * L)];
        if constexpr (SW) {
            const int up = idx + OUT * M, cu = up % C, iu = (up / C) + st * L;  // the up row's sum: slot up / C
            float u = 0.0f;
#pragma unroll
            for (int k = 0; k < WB; ++k) u += part[k][cu][iu];
            s = s / (1.0f + expf(-s)) * u;
        }
        const int row = (bx * S + st) * OUT + r;
        if (t < m && row < n_out) Y[(long long)t * n_out + row] = s;
    }
}
// 512 threads an SM at least (16 / WB blocks): at most 128 registers a thread. Without the bound ptxas
// spilled 4-16 bytes in some 2-token kernels, and kept 153 registers (3 blocks an SM) in j32w4r4's 16-token ones.
#define DEFINE_GEMVM_SETS_M(name, F, M, cfg, J, WB, NR, UNB)                                               \
    extern "C" __global__ void __launch_bounds__(32 * WB, 16 / WB) gemvm##M##_##name##_##cfg(              \
        const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X, float* __restrict__ Y, \
        int n_out, int n_in, int m) {                                                                      \
        PDL_ENTRY();                                                                                       \
        GEMVM_TOKEN_GROUP(M);                                                                              \
        gemvm_sets_impl<F, M, J, WB, NR, UNB>(W, row_bytes, X, Y, n_out, n_in, m, bx);                     \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * WB, 16 / WB) gemvmsw##M##_##name##_##cfg(            \
        const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X, float* __restrict__ Y, \
        int n_out, int n_in, int m) {                                                                      \
        PDL_ENTRY();                                                                                       \
        GEMVM_TOKEN_GROUP(M);                                                                              \
        gemvm_sets_impl<F, M, J, WB, NR, UNB, true>(W, row_bytes, X, Y, n_out, n_in, m, bx);               \
    }
#define DEFINE_GEMVM_SETS_CFG(name, F, cfg, J, WB, NR, UNB)                                                \
    DEFINE_GEMVM_SETS_M(name, F, 2, cfg, J, WB, NR, UNB) DEFINE_GEMVM_SETS_M(name, F, 4, cfg, J, WB, NR, UNB) \
    DEFINE_GEMVM_SETS_M(name, F, 8, cfg, J, WB, NR, UNB) DEFINE_GEMVM_SETS_M(name, F, 16, cfg, J, WB, NR, UNB)
// Configurations (name, J, WB, NR, UNB); matmul.py GEMVM_CONFIGS mirrors them as (threads 32 * WB, rows a
// block 32 / J * NR). ptxas (nvcc 13.0, sm_90), 16-token kernels, bf16 / f32: j32w4r4 128 / 128 registers,
// j8w8r2 and j4w8r2 112 / 122, j4w8r4 128 / 128, no spills in any. j4w8r2: weights of many rows; j8w8r2:
// twice the blocks for fewer rows; j4w8r4: 64 FMAs a lane per 16-byte x load (vocabulary-sized weights).
// GEMVM_UNB: the exact geometries' (j32) weight bytes a lane loads before using any (UNB above); 64 gives one unit
// at NR 4 for every float format, so a lane with two units of a row (SmolLM2's down rows: 192 units over 128 lanes)
// waits for its loads twice. A measurement switch (profile_gpu_decode.py --verify B --defines GEMVM_UNB=256).
#ifndef GEMVM_UNB
#define GEMVM_UNB 64
#endif
#define FOR_EACH_GEMVM_SETS_CFG(X, name, F) \
    X(name, F, j32w4r4, 32, 4, 4, GEMVM_UNB) \
    X(name, F, j32w2r4, 32, 2, 4, GEMVM_UNB) \
    X(name, F, j32w1r4, 32, 1, 4, GEMVM_UNB) \
    X(name, F, j8w8r2, 8, 8, 2, 64)        \
    X(name, F, j4w8r2, 4, 8, 2, 64)        \
    X(name, F, j4w8r4, 4, 8, 4, 64)
#define DEFINE_GEMVM_SETS(name, F) FOR_EACH_GEMVM_SETS_CFG(DEFINE_GEMVM_SETS_CFG, name, F)
#if IN_PART(2)
DEFINE_GEMVM_SETS(f32, Ff32)
#endif
#if IN_PART(5)
DEFINE_GEMVM_SETS(f16, Ff16)
#endif
#if IN_PART(6)
DEFINE_GEMVM_SETS(bf16, Fbf16)  // FOR_EACH_FLOAT, one format a part
#endif

// ---------------------------------------------------------------- m == 1 GEMV, version 2
// gemv1v2_<fmt>_<cfg>: the decode step's GEMV with a tunable geometry, for the benchmark to pick
// per format (matmul.py GEMV1_KERNEL). A block of T threads holds T/G groups of G lanes; a group
// owns NR consecutive rows and its lanes stride over the row's units, UN units per lane loaded
// before any is used. Differences from gemv1_<fmt>:
//  - G > 32 (several warps on one row) keeps more bytes in flight on short matrices (4096 rows);
//    the warps' partial sums meet in shared memory.
//  - wide-load traits (quant.cuh Fq*w): 16-byte loads for the 2-byte-aligned 32-element blocks,
//    one 16-byte header load for q4_k/q5_k.
//  - AFFINE formats (value s*q + o) use x.(s*q + o) = s*(x.q) + o*sum(x) over each run of 4:
//    the run's sum(x) is shared by the group's NR rows, which saves the per-value FMA.
//  - float formats accumulate each word in two chains (shorter FMA dependency): dot8, as the 2..16-token
//    float GEMVs do.
// Float rows that are not whole 8-value pieces take gemv1_<fmt> (matmul.py routes them).
// The decode step's add + rms_norm inside these GEMVs was built and measured slower (H200, 2026-12-02,
// profile_gpu_decode.py, captured step): the add as the producing GEMV's epilogue (y = r + W x) cost nothing,
// but each reading GEMV then computed the norm's sum of squares from the x it loads and multiplied x by the
// norm weight as it went: one more f32 stream the size of x per group. Qwen3-8B's q|k|v and gate|up GEMVs
// went from ~67.5 to ~88 us a layer (g128r1 reads 16 KB of x per 8 KB row already), the step 4,480 -> 5,207 us
// with 74 kernels fewer; Qwen3-0.6B 882.5 -> 888.3 us (258 -> 200 kernels; its gate|up GEMV 3.82 -> 6.10 us).
// SW (mul_mat_swiglu): W holds 2 * n_out rows, gate rows then up rows. Groups come in pairs: the
// first reads NR gate rows, the second the same outputs' up rows, each exactly as a plain group reads
// its rows (the same loads in flight a lane, contiguous row streams); the up sums meet the gate sums
// in shared memory and only Y[o] = silu(gate) * up is stored, the expression of elementwise.cu's
// swiglu_split_f32 (so the fused op equals the two unfused kernels bit for bit).
template <class F, int T, int G, int NR, int UN, bool SW = false>
DEVICE void gemv1v2_impl(const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X,
                         float* __restrict__ Y, int n_out, int n_in, int bx) {
    static_assert(T % G == 0 && G % 32 == 0, "groups are whole 32-lane parts");
    static_assert(!SW || (T / G) % 2 == 0, "a swiglu block holds gate/up pairs of groups");
    constexpr int GP = SW ? T / G / 2 : T / G;  // groups of outputs per block
    __shared__ float tab_smem[16];
    __shared__ float part[G > 32 ? T / 32 * NR : 1];
    __shared__ float up_sums[SW ? GP : 1][NR];
    const float* tab = init_table<F>(tab_smem);
    const int lane = threadIdx.x % G, grp = threadIdx.x / G;
    const bool up = SW && grp % 2 == 1;
    const int row0 = (bx * GP + (SW ? grp / 2 : grp)) * NR;
    if (!SW && G <= 32 && row0 >= n_out) return;  // otherwise every thread reaches the __syncthreads below
    const u8* wr[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {  // rows past the end repeat the last row (read, never stored)
        const int o = row0 + r < n_out ? row0 + r : n_out - 1;
        wr[r] = W + (long long)(up ? n_out + o : o) * row_bytes;
    }
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
    const int units = (n_in / F::QK) * F::UPB;
    for (int u0 = lane; u0 < units; u0 += G * UN) {
        typename F::U q[UN][NR];
        int bs[UN], js[UN];
#pragma unroll
        for (int i = 0; i < UN; ++i) {
            const int u = u0 + G * i < units ? u0 + G * i : u0;  // past the end: reload u0, unused
            bs[i] = u / F::UPB;
            js[i] = u - bs[i] * F::UPB;
#pragma unroll
            for (int r = 0; r < NR; ++r) q[i][r] = F::load(wr[r] + (long long)bs[i] * F::BB, js[i]);
        }
#pragma unroll
        for (int i = 0; i < UN; ++i) {
            if (i > 0 && u0 + G * i >= units) break;
            const int b = bs[i], j = js[i];
#pragma unroll
            for (int r = 0; r < NR; ++r) F::prep(q[i][r], j);
            const float* xb = X + (long long)b * F::QK;
#pragma unroll
            for (int w = 0; w < F::WPU; ++w) {
                int o0, o1;
                F::offs(j, w, o0, o1);
                const F4 a = ldx(xb + o0), c = ldx(xb + o1);
                if constexpr (F::AFFINE) {
                    const float sa = (a.a + a.b) + (a.c + a.d), sc = (c.a + c.b) + (c.c + c.d);
#pragma unroll
                    for (int r = 0; r < NR; ++r) {
                        float v[8], s0, f0, s1, f1;
                        F::affine(q[i][r], j, w, v, s0, f0, s1, f1);
                        const float d0 = dot4(a, v), d1 = dot4(c, v + 4);
                        acc[r] = fmaf(s1, d1, fmaf(f1, sc, fmaf(s0, d0, fmaf(f0, sa, acc[r]))));
                    }
                } else {
#pragma unroll
                    for (int r = 0; r < NR; ++r) {
                        float v[8], sl = 1.0f, sh = 1.0f;
                        F::decode(q[i][r], j, w, v, sl, sh, tab);
                        dot8<F::FINAL>(a, c, v, sl, sh, acc[r]);  // the 2..16-token float GEMVs' arithmetic
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = sum32(acc[r]);
    bool store = (threadIdx.x & 31) == 0;
    if constexpr (G > 32) {
        const int warp = threadIdx.x / 32, sub = lane / 32;  // 32-lane part of the block, of its group
        if (store) {
#pragma unroll
            for (int r = 0; r < NR; ++r) part[warp * NR + r] = acc[r];
        }
        __syncthreads();
        store = store && sub == 0;
        if (store) {
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                float s = 0.0f;
#pragma unroll
                for (int k = 0; k < G / 32; ++k) s += part[(warp + k) * NR + r];
                acc[r] = s;
            }
        }
    }
    if constexpr (SW) {
        if (store && up) {
#pragma unroll
            for (int r = 0; r < NR; ++r) up_sums[grp / 2][r] = acc[r];
        }
        __syncthreads();
        if (store && !up) {
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                const float g = acc[r];
                if (row0 + r < n_out) Y[row0 + r] = g / (1.0f + expf(-g)) * up_sums[grp / 2][r];
            }
        }
    } else if (store) {
#pragma unroll
        for (int r = 0; r < NR; ++r)
            if (row0 + r < n_out) Y[row0 + r] = acc[r];
    }
}

// Configurations (matmul.py GEMV1_CONFIGS mirrors them: threads, rows per block = T / G * NR).
#define FOR_EACH_GEMV1_CFG(M, name, F) \
    M(name, F, g32r2, 128, 32, 2, 4)   \
    M(name, F, g32r4, 128, 32, 4, 2)   \
    M(name, F, g64r2, 128, 64, 2, 2)   \
    M(name, F, g128r1, 128, 128, 1, 4)
#define DEFINE_GEMV1V2_CFG(name, F, cfg, T, G, NR, UN)                                                     \
    extern "C" __global__ void __launch_bounds__(T) gemv1v2_##name##_##cfg(                                \
        const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X, float* __restrict__ Y,  \
        int n_out, int n_in, int m) {                                                                      \
        PDL_ENTRY();                                                                                       \
        GEMV1_TOKEN_BLOCK();                                                                               \
        gemv1v2_impl<F, T, G, NR, UN>(W, row_bytes, X, Y, n_out, n_in, bx);                                \
    }
// gemv1sw_<fmt>_<cfg>: the same groups for mul_mat_swiglu, in gate/up pairs; a configuration of one
// group a block runs two (2T threads). matmul.py GEMV1_SW mirrors (threads, outputs per block).
#define DEFINE_GEMV1SW_CFG(name, F, cfg, T, G, NR, UN)                                                     \
    extern "C" __global__ void __launch_bounds__(T == G ? 2 * T : T) gemv1sw_##name##_##cfg(               \
        const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X, float* __restrict__ Y,  \
        int n_out, int n_in, int m) {                                                                      \
        PDL_ENTRY();                                                                                       \
        GEMV1_TOKEN_BLOCK();                                                                               \
        gemv1v2_impl<F, (T == G ? 2 * T : T), G, NR, UN, true>(W, row_bytes, X, Y, n_out, n_in, bx);      \
    }
#define DEFINE_GEMV1V2(name, F) \
    FOR_EACH_GEMV1_CFG(DEFINE_GEMV1V2_CFG, name, F) FOR_EACH_GEMV1_CFG(DEFINE_GEMV1SW_CFG, name, F)
#if IN_PART(3)
FOR_EACH_WIDE_A(DEFINE_GEMV1V2)
#endif
#if IN_PART(7)
FOR_EACH_WIDE_B(DEFINE_GEMV1V2)
#endif

// ---------------------------------------------------------------- m == 1 GEMV, version 3
// gemv1v3_<fmt>_<cfg> (q8_0, q4_0, q4_k; cfg r2 / r4 = rows per 32-lane group): the decode GEMV
// with fewer instructions per weight (the v2 kernels issue ~5-8 per element for these formats and
// reach 25-70% of copy bandwidth: issue-bound, not memory-bound). Per element what remains is
// one LOP3 (the code masked into a float mantissa), one FFMA (exact code, bias included: see
// field_f) and one FFMA (the dot); per-block work (scales, alignment) is spread over 32-64 values.
//  - x is staged per chunk in shared memory by the whole block (shared by its 4 groups' rows) with
//    one 16-byte pad per lane-stride, so a lane reading its own block's x is conflict-free; global
//    x reads are coalesced once per block instead of strided per lane.
//  - q8_0 / q4_0 (34 / 18-byte blocks, only 2-byte aligned): each group copies a chunk of 32
//    blocks of its rows into shared memory with aligned 16-byte loads (coalesced), then lane i
//    decodes block i from 4-byte words re-aligned with one funnel shift per word.
//  - q4_k (16-byte aligned 144-byte blocks): lane = one 32-byte quarter of a super-block (its two
//    sub-blocks), read straight from global; value d*sc*q - dmin*mn is summed as
//    d*sc*(x.q) - dmin*mn*sum(x), sum(x) per 32-value sub-block computed once per chunk in smem.
// Every thread reaches every __syncthreads (rows past the end are read as the last row and not
// stored). Needs rows of whole 16-byte pieces and a 16-byte aligned weight (matmul.py checks).
#ifndef GEMV3_THREADS
#define GEMV3_THREADS 128
#endif
#ifndef GEMV3_PREFETCH
#define GEMV3_PREFETCH 1
#endif
#ifndef GEMV3_PROBE
#define GEMV3_PROBE 0  // 1, 2: test-only timing probes (below); wrong results
#endif
// Where gemv1v3_q4_0_r4's time goes (H200, 2026-12-02, Qwen3-8B q4_0 captured step, profile_gpu_decode.py
// --defines): 2,769 us shipped (its GEMVs 1,925), 2,260 without the decode math (GEMV3_PROBE=1), 2,017 with
// the loads alone (GEMV3_PROBE=2): the math costs ~510 us a step, the staging ~240. Tried and dropped the same
// day (bench_gpu_gemv.py --defines, % of copy bandwidth at 4096x4096 / 12288x4096 / 4096x12288 / 151936x4096,
// shipped q4_0 36.0 / 49.4 / 47.4 / 66.6): more blocks an SM by capping registers (__launch_bounds__ minimum 6:
// 25.3 / 40.1 / 30.0 / 55.3), and the chunks copied by cp.async, 2 or 3 stages deep, instead of through
// prefetch registers (32.2 / 38.9 / 43.6 / 63.4; with 8 blocks an SM 26.9 / 38.7 / 34.3 / 54.9); q8_0 lost too.
// That step is faster without PDL (2,701 / 2,713 us against 2,769 / 2,771, two calls); letting the next kernel
// launch only as these GEMVs' blocks end did not explain it (2,883 us with PDL, 2,709 without).

DEVICE float dot4acc(const F4& x, const float* v, float acc) {
    return fmaf(x.d, v[3], fmaf(x.c, v[2], fmaf(x.b, v[1], fmaf(x.a, v[0], acc))));
}

// Staged 32-element formats. W: the block's words from the 4-byte aligned address at or below its
// start, off = its start % 4 (0 or 2); xb: the block's 32 x values (8 F4). Returns d * (x . q).
struct S8_0 {
    static constexpr int BB = 34, NW = 9;
    DEVICE float dot(const unsigned* W, unsigned off, const F4* xb) {
        const float d = h2f((W[0] >> (8 * off)) & 0xFFFFu);
        const unsigned sh = 16 + 8 * off;  // qs start 2 bytes after the block: bit 16 or 32 of W[0]:W[1]
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float v[4];
            bytes4(funnel_r(W[k], W[k + 1], sh) ^ 0x80808080u, 128.0f, v);
            s = dot4acc(xb[k], v, s);
        }
        return d * s;
    }
};

struct S4_0 {
    static constexpr int BB = 18, NW = 5;
    DEVICE float dot(const unsigned* W, unsigned off, const F4* xb) {
        const float d = h2f((W[0] >> (8 * off)) & 0xFFFFu);
        const unsigned sh = 16 + 8 * off;
        float s0 = 0.0f, s1 = 0.0f;  // two chains: low nibbles (elements 0..15), high (16..31)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float lo[4], hi[4];
            nibs8(funnel_r(W[k], W[k + 1], sh), 8.0f, lo, hi);
            s0 = dot4acc(xb[k], lo, s0);
            s1 = dot4acc(xb[4 + k], hi, s1);
        }
        return d * (s0 + s1);
    }
};

// A mul_mat_swiglu twin of these kernels (gemv1v3sw: half a block's groups reading the up rows of the other half's
// outputs, silu(gate) * up stored; rows bitwise the plain kernel's then swiglu_halves_f32) was built and measured
// slower: Qwen3-0.6B q8_0's captured step 883.4 / 886.3 us fused against 840.7 / 843.8 us with the two launches
// (H200, 2026-12-04, profile_gpu_decode.py --sw-max-mib "32+0+32+0"; BENCHMARKS.md, twenty-fourth session).
template <class S, int NR>
DEVICE void gemv1v3_staged(const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X,
                           float* __restrict__ Y, int n_out, int n_in, int bx) {
    constexpr int G = GEMV3_THREADS / 32;              // 32-lane groups per block
    constexpr int CB = 32;                             // blocks per chunk: one per lane
    typedef RowChunks<S::BB, NR, CB> Rows;             // 68 / 36 aligned 16-byte pieces per row
    __shared__ F4 xs[CB * 9];                          // 8 F4 of x per block + 1 pad (bank shift)
    __shared__ U4 ws[G][NR][Rows::PIECES];
    const int lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
    const int row0 = (bx * G + grp) * NR;
    // The next chunk's weight pieces are loaded into registers while this chunk is decoded from shared
    // memory (GEMV3_PREFETCH=1), so a group keeps two chunks of its rows in flight instead of one: at
    // 4096 rows only ~4 blocks of 8 rows reach each SM, too few bytes in flight to cover DRAM latency.
    Rows rows(W, row_bytes, row0, n_out);
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
    const int nb = n_in / 32;
    const unsigned boff = (unsigned)(lane * S::BB);  // this lane's block in the staged chunk
    rows.load(0, nb, lane);
    for (int b0 = 0; b0 < nb; b0 += CB) {
        const int nbh = nb - b0 < CB ? nb - b0 : CB;
#if GEMV3_PROBE == 2  // test-only (profile_gpu_decode.py --defines): the weight loads alone, no staging or math
#pragma unroll
        for (int r = 0; r < NR; ++r)
#pragma unroll
            for (int p = 0; p < Rows::PPL; ++p) acc[r] += __uint_as_float(rows.pc[r][p].a ^ rows.pc[r][p].d);
        if (b0 + CB < nb) rows.load(b0 + CB, nb, lane);
        continue;
#endif
#if !GEMV3_PREFETCH
        if (b0 > 0) rows.load(b0, nb, lane);
#endif
        __syncthreads();  // the previous chunk is no longer read
        rows.store(ws[grp], Rows::pieces(b0, nb), lane);
#pragma unroll
        for (int k = 0; k < CB * 8 / GEMV3_THREADS; ++k) {
            const int i = threadIdx.x + GEMV3_THREADS * k;
            xs[i + (i >> 3)] = i < nbh * 8 ? ldx(X + (long long)b0 * 32 + 4 * i) : F4{0.0f, 0.0f, 0.0f, 0.0f};
        }
        __syncthreads();
#if GEMV3_PREFETCH
        if (b0 + CB < nb) rows.load(b0 + CB, nb, lane);
#endif
        if (lane < nbh) {
            const F4* xb = xs + 9 * lane;
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                const unsigned* wp = (const unsigned*)((const u8*)ws[grp][r] + (boff & ~3u));
                unsigned w[S::NW];
#pragma unroll
                for (int k = 0; k < S::NW; ++k) w[k] = wp[k];
#if GEMV3_PROBE == 1  // test-only: staged as shipped, without the decode math
                acc[r] += __uint_as_float(w[0] ^ w[S::NW - 1]) * xb[0].a;
#else
                acc[r] += S::dot(w, boff & 3u, xb);
#endif
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const float s = sum32(acc[r]);
        if (lane == 0 && row0 + r < n_out) Y[row0 + r] = s;
    }
}

template <int NR>
DEVICE void gemv1v3_q4_k(const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X,
                         float* __restrict__ Y, int n_out, int n_in, int bx) {
    constexpr int G = GEMV3_THREADS / 32;
    constexpr int SB = 8;          // super-blocks per chunk (4 lanes each)
    constexpr int CH = SB * 256;   // x values per chunk
    __shared__ F4 xs[CH / 4 + CH / 64];  // 1 F4 pad per 64 values: lanes 64 values apart hit distinct banks
    __shared__ float xsum[CH / 32];      // sum of x per 32-value sub-block
    const int lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
    const int row0 = (bx * G + grp) * NR;
    const u8* wr[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) wr[r] = W + (long long)(row0 + r < n_out ? row0 + r : n_out - 1) * row_bytes;
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
    const int c = lane & 3, bl = lane >> 2;  // quarter c of qs (sub-blocks 2c, 2c+1) of super-block bl
    // 6-bit scale / min of sub-blocks 2c, 2c+1 (see k_scale_min): bytes 2c, 2c+1 of the scale words
    // for c < 2; for c >= 2 the low 4 bits from bytes 2(c-2).. of word 2, the top 2 from words 0 / 1.
    const unsigned ssh = 16u * (c & 1);
    const bool shi = c >= 2;
    const int nb = n_in / 256;
    U4 nhd[NR], nq0[NR], nq1[NR];  // this lane's pieces of the next chunk (GEMV3_PREFETCH: see gemv1v3_staged)
    auto load_chunk = [&](int s0) {
        const int b = s0 + bl;
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            if (b < nb) {
                const u8* p = wr[r] + (long long)b * 144;
                nhd[r] = *(const U4*)p;
                nq0[r] = *(const U4*)(p + 16 + 32 * c);
                nq1[r] = *(const U4*)(p + 32 + 32 * c);
            }
        }
    };
    load_chunk(0);
    for (int sb0 = 0; sb0 < nb; sb0 += SB) {
        const int b = sb0 + bl;
        const bool act = b < nb;
#if !GEMV3_PREFETCH
        if (sb0 > 0) load_chunk(sb0);
#endif
        U4 hd[NR], q0[NR], q1[NR];
#pragma unroll
        for (int r = 0; r < NR; ++r) hd[r] = nhd[r], q0[r] = nq0[r], q1[r] = nq1[r];
        __syncthreads();  // the previous chunk's x is no longer read
        const int nx4 = (nb - sb0 < SB ? nb - sb0 : SB) * 64;  // F4s of x in this chunk
#pragma unroll
        for (int k = 0; k < CH / 4 / GEMV3_THREADS; ++k) {
            const int i = threadIdx.x + GEMV3_THREADS * k;
            const F4 v = i < nx4 ? ldx(X + (long long)sb0 * 256 + 4 * i) : F4{0.0f, 0.0f, 0.0f, 0.0f};
            xs[i + (i >> 4)] = v;
            float s = (v.a + v.b) + (v.c + v.d);  // 8 consecutive threads hold one sub-block
            s += SHFL_XOR(s, 1);
            s += SHFL_XOR(s, 2);
            s += SHFL_XOR(s, 4);
            if ((i & 7) == 0) xsum[i >> 3] = s;
        }
        __syncthreads();
#if GEMV3_PREFETCH
        if (sb0 + SB < nb) load_chunk(sb0 + SB);
#endif
        if (act) {
            const F4* xl = xs + 68 * bl + 17 * c;  // padded index of value 256 bl + 64 c
            float al[NR], ah[NR];
#pragma unroll
            for (int r = 0; r < NR; ++r) al[r] = ah[r] = 0.0f;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const F4 xlo = xl[k], xhi = xl[k + 8];  // values 4k.. (low nibbles), 32 + 4k.. (high)
#pragma unroll
                for (int r = 0; r < NR; ++r) {
                    float lo[4], hi[4];
                    nibs8(word4(k < 4 ? q0[r] : q1[r], k & 3), 0.0f, lo, hi);
                    al[r] = dot4acc(xlo, lo, al[r]);
                    ah[r] = dot4acc(xhi, hi, ah[r]);
                }
            }
            const float sx0 = xsum[8 * bl + 2 * c], sx1 = xsum[8 * bl + 2 * c + 1];
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                const unsigned A = hd[r].b >> ssh, B = hd[r].c >> ssh, C = hd[r].d >> ssh;
                const unsigned scw = shi ? ((C & 0x0F0Fu) | ((A >> 2) & 0x3030u)) : (A & 0x3F3Fu);
                const unsigned mnw = shi ? (((C >> 4) & 0x0F0Fu) | ((B >> 2) & 0x3030u)) : (B & 0x3F3Fu);
                const float d = h2f(hd[r].a & 0xFFFFu), dm = h2f(hd[r].a >> 16);
                const float a0 = d * field_f<0>(scw, 0xFFu, 0.0f), a1 = d * field_f<8>(scw, 0xFFu, 0.0f);
                const float m0 = dm * field_f<0>(mnw, 0xFFu, 0.0f), m1 = dm * field_f<8>(mnw, 0xFFu, 0.0f);
                acc[r] = fmaf(a1, ah[r], fmaf(-m1, sx1, fmaf(a0, al[r], fmaf(-m0, sx0, acc[r]))));
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const float s = sum32(acc[r]);
        if (lane == 0 && row0 + r < n_out) Y[row0 + r] = s;
    }
}

// Rows per block = GEMV3_THREADS / 32 * NR (matmul.py GEMV1_V3 mirrors it).
#define FOR_EACH_GEMV1_V3(M) \
    M(q8_0, r2, 2) M(q8_0, r4, 4) M(q4_0, r2, 2) M(q4_0, r4, 4) M(q4_k, r2, 2) M(q4_k, r4, 4)
#define GEMV1V3_BODY_q8_0(NR) gemv1v3_staged<S8_0, NR>(W, row_bytes, X, Y, n_out, n_in, bx)
#define GEMV1V3_BODY_q4_0(NR) gemv1v3_staged<S4_0, NR>(W, row_bytes, X, Y, n_out, n_in, bx)
#define GEMV1V3_BODY_q4_k(NR) gemv1v3_q4_k<NR>(W, row_bytes, X, Y, n_out, n_in, bx)
#define DEFINE_GEMV1V3(name, cfg, NR)                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV3_THREADS) gemv1v3_##name##_##cfg(                   \
        const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X, float* __restrict__ Y, \
        int n_out, int n_in, int m) {                                                                     \
        PDL_ENTRY();                                                                                      \
        GEMV1_TOKEN_BLOCK();                                                                              \
        GEMV1V3_BODY_##name(NR);                                                                          \
    }
#if IN_PART(4)
FOR_EACH_GEMV1_V3(DEFINE_GEMV1V3)
#endif

// ---------------------------------------------------------------- dequantize to f32 (prefill)
// out[row, :] = the row's values, row-major [rows, n_in]. One thread per unit, grid-stride.
template <class F>
DEVICE void dequant_impl(const u8* __restrict__ W, long long row_bytes, float* __restrict__ out, int rows,
                         int n_in) {
    __shared__ float tab_smem[16];
    const float* tab = init_table<F>(tab_smem);
    const long long upr = (long long)(n_in / F::QK) * F::UPB;
    const long long total = upr * rows;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / upr;
        const int u = (int)(i - row * upr), b = u / F::UPB, j = u - b * F::UPB;
        typename F::U q = F::load(W + row * row_bytes + (long long)b * F::BB, j);
        F::prep(q, j);
        float* ob = out + row * n_in + (long long)b * F::QK;
#pragma unroll
        for (int w = 0; w < F::WPU; ++w) {
            int o0, o1;
            F::offs(j, w, o0, o1);
            float v[8];
            decode_exact<F>(q, j, w, v, tab);
            *(F4*)(ob + o0) = F4{v[0], v[1], v[2], v[3]};
            *(F4*)(ob + o1) = F4{v[4], v[5], v[6], v[7]};
        }
    }
}

// Float formats: one value per thread (rows of any length).
template <class F>
DEVICE void dequant_float_impl(const u8* __restrict__ W, long long row_bytes, float* __restrict__ out, int rows,
                               int n_in) {
    const long long total = (long long)rows * n_in;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / n_in;
        out[i] = F::elem(W + row * row_bytes, (int)(i - row * n_in));
    }
}

#define DEFINE_DEQUANT(name, F)                                                                                 \
    extern "C" __global__ void dequant_##name(const u8* __restrict__ W, long long row_bytes, float* __restrict__ out, \
                                              int rows, int n_in) {                                             \
        PDL_ENTRY();                                                                                            \
        dequant_impl<F>(W, row_bytes, out, rows, n_in);                                                         \
    }
#define DEFINE_DEQUANT_FLOAT(name, F)                                                                           \
    extern "C" __global__ void dequant_##name(const u8* __restrict__ W, long long row_bytes, float* __restrict__ out, \
                                              int rows, int n_in) {                                             \
        PDL_ENTRY();                                                                                            \
        dequant_float_impl<F>(W, row_bytes, out, rows, n_in);                                                   \
    }
#if IN_PART(4)  // to the end of the file
FOR_EACH_QUANT(DEFINE_DEQUANT)
FOR_EACH_FLOAT(DEFINE_DEQUANT_FLOAT)

// ---------------------------------------------------------------- batched / activation weights
// Y[b0, b1, i, o] = sum_k X[b0, b1, i, k] * W[b0, b1, o, k]. Rows of W and X are contiguous
// (n_in apart); the batch strides (in elements) are 0 on axes where W broadcasts. w_f16 / x_f16:
// the operand holds f16 bits instead of f32. One thread per output: simple, for small operands.
DEVICE float ld_any(const void* p, long long i, int is_f16) {
    return is_f16 ? h2f(((const u16*)p)[i]) : ((const float*)p)[i];
}

extern "C" __global__ void matmul_batched_f32(const void* __restrict__ W, const void* __restrict__ X,
                                              float* __restrict__ Y, int B0, int B1, int n, int n_out, int n_in,
                                              long long sw0, long long sw1, long long sx0, long long sx1,
                                              int w_f16, int x_f16) {
    PDL_ENTRY();
    const long long total = (long long)B0 * B1 * n * n_out;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int o = (int)(idx % n_out);
        long long r = idx / n_out;
        const int i = (int)(r % n);
        r /= n;
        const int b1 = (int)(r % B1), b0 = (int)(r / B1);
        const long long wo = b0 * sw0 + b1 * sw1 + (long long)o * n_in;
        const long long xo = b0 * sx0 + b1 * sx1 + (long long)i * n_in;
        float s = 0.0f;
        for (int k = 0; k < n_in; ++k) s = fmaf(ld_any(X, xo + k, x_f16), ld_any(W, wo + k, w_f16), s);
        Y[idx] = s;
    }
}

// y = x rounded to bf16 (ties to even): the activations of a tensor-core GEMM with bf16 weights
extern "C" __global__ void cast_f32_bf16(const float* __restrict__ x, u16* __restrict__ y, long long n) {
    PDL_ENTRY();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = f32_to_bf16(x[i]);
}

// y rounded to bf16 in place, kept as f32: mul_mat_bf16_rounded's result where something other than a bf16-reading
// kernel reads it (matmul.py lower_mul_mat_bf16)
extern "C" __global__ void round_bf16_f32(float* __restrict__ y, long long n) {
    PDL_ENTRY();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = bf16_to_f32(f32_to_bf16(y[i]));
}

// The same with 16-byte loads (x 16-byte, y 8-byte aligned; the last n % 4 values one a thread). One float a
// thread keeps too few bytes in flight to cover DRAM latency: Qwen3-8B's 4096-token prefill spent 15.4 ms in
// casts, ~30 % of copy bandwidth (H200, 2026-12-01).
extern "C" __global__ void cast_f32_bf16_v4(const float* __restrict__ x, u16* __restrict__ y, long long n) {
    PDL_ENTRY();
    const long long n4 = n / 4, first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = first; i < n4; i += step) {
        const f32x4 v = ((const f32x4*)x)[i];
        ((u16x4*)y)[i] = u16x4{f32_to_bf16(v.x), f32_to_bf16(v.y), f32_to_bf16(v.z), f32_to_bf16(v.w)};
    }
    if (first < n - 4 * n4) y[4 * n4 + first] = f32_to_bf16(x[4 * n4 + first]);
}
#endif  // IN_PART(4)
