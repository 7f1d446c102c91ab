// flash_attn_bf16 (graphir/ops/fused.py) for prefill, on tensor cores: FlashAttention-2 style.
//
//   attn_kv_bf16_<kv>     K and V rows j < kv_len (f32 or f16 cache [cap, hk, d]) rounded to bf16 into a
//                         scratch [2][hk][cap][DK] (K heads, then V heads), columns d..DK zero. Once per
//                         call: the tiles below are then plain 16-byte cp.async copies (no conversion in
//                         the hot loop, half the L2 traffic of an f32 cache) and every head dim <= DK
//                         looks like DK. The grid covers the capacity; blocks past kv_len exit.
//   attn_prefill_bf16_d<DK>[_obf16]  grid (q head, query tile): 16*MT*WARPS query rows of one q head
//                         per block, MT m-tiles of 16 rows per warp. K/V tiles of BN rows stream through
//                         shared memory (K of the next tile loads while P.V runs, V while Q.K^T runs);
//                         tiles outside the block's visible rows are never loaded, a warp skips tiles
//                         outside its own rows' ranges, and an m-tile skips the mask on tiles inside
//                         all of its rows' ranges. _obf16: the output as bf16 bits (f32_to_bf16 of the
//                         f32 value the plain kernel stores, so bitwise what the cast kernel makes of
//                         it) for the o-projection GEMM to read (matmul.bf16_twin).
//                         DK 64: MT 2, BN 64, Q fragments in registers (sm_90: 228 registers, no spill).
//                         DK 128: MT 2, BN 64, Q in dynamic shared memory, 16*MT*WARPS rows x (DK + 8)
//                         bf16 (34 KiB; sm_90: 254 registers, no spill), K/V tiles in static shared memory.
//                         DK 256: MT 1; O alone takes 128 registers a lane, so Q waits in shared memory
//                         and the three buffers are dynamic shared memory: (2 * BN + 16 * WARPS) *
//                         (DK + 8) bf16, 66 KiB at BN 32 and 4 warps.
//                         Dynamic shared memory above 48 KiB needs the kernel's limit raised (attention.py).
//
// Why MT m-tiles a warp: every K fragment (ldmatrix.x4) and V fragment (ldmatrix.x4.trans) is 512
// bytes of shared memory, 4 clocks of an SM's 128 bytes a clock, and feeds 2 mma per m-tile. At MT 1
// that is 256 bytes an mma; at MT 2, 128 with Q in registers, 160 with Q in shared memory at BN 64
// (its A fragments read once a tile: 16 ldmatrix next to 64 for K and V). The rows of a block also
// double, halving the K/V tile loads and barriers a query row. The cost is registers: a lane holds
// DK/4 (Q, in registers) + DK/2 (O) + BN/2 (S) per m-tile: at DK 128 and MT 2, 64 + 128 + 32..64 leave
// too little of the 255 (BN 32: 56 bytes of spills), hence Q in shared memory there (FlashAttention-2's
// 128 x 64 tile for this head dim). A few per-row values (key ranges) live in shared memory for the
// same reason (WarpRanges). The per-row arithmetic is the MT 1 kernel's in the same order (a shared B
// fragment changes no row's sums), so at the same BN the two agree bitwise where their key tiles start
// at the same key (window 0: every block starts at key 0).
//
// Per warp and tile: S = Q K^T (mma m16n8k16, bf16 in, f32 out; K fragments by ldmatrix), then the
// online softmax in f32 in the log2 domain, then O += P V (P from S's accumulator registers, V
// fragments by ldmatrix.trans). The running row maximum M is kept an integer (ceil), as the op
// defines it: rescaling by 2^(M_old - M_new) is exact, and each weight bf16(2^(s - M)) rounds as
// it would against the final M. The row sum adds the rounded weights, which P V multiplies.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 .bf16; g = lane / 4, t = lane % 4; low half first):
//   A (16x16, row): reg0 (g, 2t..2t+1), reg1 (g+8, 2t..), reg2 (g, 2t+8..), reg3 (g+8, 2t+8..)
//   B (16x8, col):  reg0 (k 2t..2t+1, n g), reg1 (k 2t+8.., n g)
//   C (16x8 f32):   c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1)
// So C of key columns 16c..16c+15 (two n-tiles) is exactly the A fragment of P for key chunk c.
//
// Tensor-core PTX (mma, ldmatrix, cp.async, cvt.bf16x2) needs sm_80: on HIP and older GPUs this
// file compiles to nothing and attention.py lowers flash_attn_bf16 with the f32 prefill kernel.
#include "common.cuh"

#ifndef ATTN_TC_WARPS
#define ATTN_TC_WARPS 4  // attention.py mirrors it (TC_WARPS)
#endif
#ifndef ATTN_TC_MT
// 16-row m-tiles a warp at DK 64 and 128 (DK 256: 1); attention.py mirrors it (TC_MT). 2 feeds each K/V
// fragment to twice the mma, but measured slower (H200, 2026-12-01, bench_gpu_attention_prefill.py, Qwen3-8B
// shapes, 4096 / 512 queries: MT 1 520 / 27 us, MT 2 535 / 35 us): at DK 128 its O and Q take 254 registers
// (Q moves to shared memory), one block an SM against three at MT 1's 168.
#define ATTN_TC_MT 1
#endif
// Where Q waits at DK 64 and 128: 0 registers (DK/4 a lane per m-tile), 1 shared memory (dynamic, its A
// fragments re-read by ldmatrix every tile); attention.py mirrors both (TC_Q_SHARED).
#ifndef ATTN_TC_Q_SHARED_D64
#define ATTN_TC_Q_SHARED_D64 0
#endif
#ifndef ATTN_TC_Q_SHARED_D128
#define ATTN_TC_Q_SHARED_D128 (ATTN_TC_MT > 1)  // MT 2: 64 registers of Q make O spill (at BN 32 too)
#endif
// Keys per K/V tile; 2 x BN x (DK + 8) bf16 of static shared memory (34 KiB at DK 128, BN 64).
#ifndef ATTN_TC_BN_D64
#define ATTN_TC_BN_D64 64
#endif
#ifndef ATTN_TC_BN_D128
#define ATTN_TC_BN_D128 64
#endif
#ifndef ATTN_TC_BN_D256
#define ATTN_TC_BN_D256 32  // at DK 256: a 64-key tile's scores and weights (48 registers) make O spill
#endif
#ifndef ATTN_KV_CONVERT_THREADS
#define ATTN_KV_CONVERT_THREADS 256
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

#define ATTN_TC_THREADS (32 * ATTN_TC_WARPS)

template <int DK>
struct TileKeys {  // keys per K/V tile (BN) at head dim DK
    static constexpr int value = DK > 128 ? ATTN_TC_BN_D256 : DK > 64 ? ATTN_TC_BN_D128 : ATTN_TC_BN_D64;
};
template <int DK>
struct MTiles {  // 16-row m-tiles a warp (MT) at head dim DK
    static constexpr int value = DK > 128 ? 1 : ATTN_TC_MT;
};
template <int DK>
struct QShared {  // Q in shared memory at head dim DK
    static constexpr bool value = DK > 128 ? true : DK > 64 ? ATTN_TC_Q_SHARED_D128 : ATTN_TC_Q_SHARED_D64;
};

// ---------------------------------------------------------------- conversions
DEVICE unsigned int pack_bf16(float lo, float hi) {  // round to nearest even; `lo` in the low half
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
DEVICE float bf16_lo(unsigned int p) { return __uint_as_float(p << 16); }
DEVICE float bf16_hi(unsigned int p) { return __uint_as_float(p & 0xffff0000u); }

DEVICE float kv_f32(float x) { return x; }
DEVICE float kv_f32(u16 h) {  // exact: every f16 is an f32
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

DEVICE float exp2_fast(float x) {  // 2^x, ~2 ulp; -inf -> 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---------------------------------------------------------------- tensor-core PTX (async copies: common.cuh)
DEVICE void mma_bf16(float (&c)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i. Lane l gets, of each
// matrix, row l/4, columns 2(l%4)..+1 (x4), or with .trans row 2(l%4)..+1, column l/4 (x4_trans).
DEVICE void ldmatrix_x4(unsigned int (&r)[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)) : "memory");
}
DEVICE void ldmatrix_x4_trans(unsigned int (&r)[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)) : "memory");
}

// ---------------------------------------------------------------- K/V to bf16
// One thread per 8 columns of a scratch row (h, j): dst[kv][h][j][c..c+7] (one 16-byte store), kv =
// blockIdx.y. With `vec` (lowering: both caches 16-byte aligned, d and dv multiples of 8) a piece is read with
// 16-byte loads (two for an f32 cache); else value by value, as at unaligned K/V views. A thread per column
// pair with 4-byte accesses ran at ~40 % of copy bandwidth (30 us a layer of Qwen3-8B's 4096-token prefill).
DEVICE void kv_load8(const float* p, float* f) {
    const f32x4 a = ((const f32x4*)p)[0], b = ((const f32x4*)p)[1];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
DEVICE void kv_load8(const u16* p, float* f) {
    const u32x4 a = *(const u32x4*)p;
    const unsigned w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = kv_f32((u16)(w[i] & 0xffffu));
        f[2 * i + 1] = kv_f32((u16)(w[i] >> 16));
    }
}

template <typename KV>
DEVICE void kv_to_bf16(const KV* __restrict__ k, const KV* __restrict__ v, u16* __restrict__ dst,
                       const int* __restrict__ kv_len, int cap, int hk, int d, int dv, int dk, int vec) {
    const long long rows = (long long)hk * cap, piece = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int pieces = dk / 8;
    const long long row = piece / pieces;
    if (row >= rows) return;
    const int h = (int)(row / cap), j = (int)(row - (long long)h * cap), c = (int)(piece - row * pieces) * 8;
    int L = kv_len[0];
    L = L < 0 || L > cap ? 0 : L;  // a bad kv_len converts nothing; the attention kernel reports it
    if (j >= L) return;
    const bool is_v = blockIdx.y == 1;
    const int width = is_v ? dv : d;
    const KV* src = (is_v ? v : k) + ((long long)j * hk + h) * width;
    float f[8];
    if (vec && c < width) {
        kv_load8(src + c, f);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = c + i < width ? kv_f32(src[c + i]) : 0.0f;
    }
    ((u32x4*)dst)[(blockIdx.y * rows + row) * pieces + c / 8] =
        u32x4{pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7])};
}

// ---------------------------------------------------------------- attention
// Keys query row p sees: [lo, hi) = j <= p, j < L, p - j < window (window > 0); flash_attn's rule.
DEVICE void row_range(int p, int L, int window, int& lo, int& hi) {
    if (p < 0) return;  // lo = hi = 0: sees nothing
    hi = p < L ? p + 1 : L;
    lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
}

// K or V rows j0.. of scratch head `head` (kv * hk + kv head) into a tile (row stride DK + 8: ldmatrix's
// 8 row addresses then fall on distinct banks); rows at and past jhi are zero (their scores are masked,
// and 0 * V must not meet garbage). Addresses from kvb every tile: two head pointers held through the
// loop cost 4 registers that MT 2 does not have.
template <int DK>
DEVICE void load_tile(u16* tile, const u16* kvb, int head, int cap, int j0, int jhi) {
    constexpr int CH = DK / 8, LDS = DK + 8, BN = TileKeys<DK>::value, STEP = ATTN_TC_THREADS / CH;
    static_assert(ATTN_TC_THREADS % CH == 0 && BN % STEP == 0, "a tile is whole 16-byte chunks per thread");
    const int r = threadIdx.x / CH, c = threadIdx.x % CH;  // chunk n: row r + n * STEP, column chunk c
    const u16* src = kvb + ((long long)head * cap + j0 + r) * DK + c * 8;
    u16* dst = tile + r * LDS + c * 8;
#pragma unroll
    for (int n = 0; n < BN / STEP; ++n) {
        const bool ok = j0 + r + n * STEP < jhi;
        cp_async16(dst + n * STEP * LDS, ok ? src + n * STEP * DK : kvb, ok);
    }
}

// This warp's 16*MT query rows as bf16 A fragments, and S[MT][16 rows x BN keys] = Q K^T from them:
// each K fragment loaded feeds the mma of every m-tile. Two places for Q, one interface: load() once,
// scores() per K tile.
DEVICE float q_at(const float* __restrict__ q, int row, int c, int n_q, int hq, int h, int d) {
    return row < n_q && c < d ? q[((long long)row * hq + h) * d + c] : 0.0f;
}

#define TC_MEMBER __device__ __forceinline__  // DEVICE is static: not for member functions

template <int DK>
using TileScores = float[MTiles<DK>::value][TileKeys<DK>::value / 8][4];  // S: m-tile, n-tile of 8 keys, C
template <int DK>
using TileWeights = unsigned int[MTiles<DK>::value][TileKeys<DK>::value / 16][4];  // P: m-tile, 16 keys, A
template <int DK>
using RowAcc = float[MTiles<DK>::value][DK / 8][4];  // O: m-tile, 8 columns, C

template <int DK>
struct QInRegisters {  // DK / 4 registers a lane per m-tile
    static constexpr int MT = MTiles<DK>::value;
    unsigned int f[MT][DK / 16][4];

    TC_MEMBER void load(const float* __restrict__ q, int row0, int n_q, int hq, int h, int d, int lane) {
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kc = 0; kc < DK / 16; ++kc) {
                const int c = kc * 16 + 2 * t;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = row0 + mt * 16 + g + (i & 1) * 8, cc = c + (i >> 1) * 8;
                    f[mt][kc][i] = pack_bf16(q_at(q, r, cc, n_q, hq, h, d), q_at(q, r, cc + 1, n_q, hq, h, d));
                }
            }
    }

    // Each n-tile's k-steps in order. Matrices: keys 16np + 8(i/2).., columns 16ks + 8(i%2)..: B of
    // n-tile 2np in b[0..1], of 2np + 1 in b[2..3].
    TC_MEMBER void scores(TileScores<DK>& s, const u16* sk, int lane) const {
        constexpr int LDS = DK + 8;
#pragma unroll
        for (int np = 0; np < TileKeys<DK>::value / 16; ++np) {  // n-tiles 2np, 2np + 1
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][2 * np][e] = s[mt][2 * np + 1][e] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < DK / 16; ++ks) {
                unsigned int b[4];
                ldmatrix_x4(b, sk + (np * 16 + (lane & 7) + ((lane >> 4) & 1) * 8) * LDS + ks * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(s[mt][2 * np], f[mt][ks], b[0], b[1]);
                    mma_bf16(s[mt][2 * np + 1], f[mt][ks], b[2], b[3]);
                }
            }
        }
    }
};

template <int DK>
struct QInShared {  // the warp's own 16*MT rows x (DK + 8) bf16 of shared memory; 4*MT registers a lane
    static constexpr int MT = MTiles<DK>::value;
    u16* sq;

    TC_MEMBER void load(const float* __restrict__ q, int row0, int n_q, int hq, int h, int d, int lane) {
        constexpr int LDS = DK + 8, PAIRS = DK / 2;
#pragma unroll 4
        for (int i = lane; i < 16 * MT * PAIRS; i += 32) {  // consecutive lanes, consecutive columns
            const int r = i / PAIRS, c = (i % PAIRS) * 2;
            ((unsigned int*)(sq + r * LDS))[c / 2] =
                pack_bf16(q_at(q, row0 + r, c, n_q, hq, h, d), q_at(q, row0 + r, c + 1, n_q, hq, h, d));
        }
        __syncwarp();  // only this warp reads its rows
    }

    // Same products in the same order as QInRegisters (each n-tile's k-steps in order); k-steps outer, so
    // each Q fragment is read once a tile and only one k-step of them (4 registers an m-tile) is held.
    TC_MEMBER void scores(TileScores<DK>& s, const u16* sk, int lane) const {
        constexpr int LDS = DK + 8;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < TileKeys<DK>::value / 8; ++nt)
                s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < DK / 16; ++ks) {
            unsigned int a[MT][4];  // A of columns 16ks..: matrices rows 16mt + 8(i%2).., columns 16ks + 8(i/2)..
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldmatrix_x4(a[mt], sq + (mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + ks * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int np = 0; np < TileKeys<DK>::value / 16; ++np) {  // n-tiles 2np, 2np + 1
                // matrices: keys 16np + 8(i/2).., columns 16ks + 8(i%2)..: B of n-tile 2np in b[0..1], 2np+1 in b[2..3]
                unsigned int b[4];
                ldmatrix_x4(b, sk + (np * 16 + (lane & 7) + ((lane >> 4) & 1) * 8) * LDS + ks * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(s[mt][2 * np], a[mt], b[0], b[1]);
                    mma_bf16(s[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }
};

// full: every key of the tile is in every row's range, no mask (warp-uniform); else the ranges come
// from `ranges` (the m-tile's 16 rows, [lo, hi) each), read only then: at MT 2 registers for them,
// or a mask computed on every tile, make O spill.
template <int DK>
DEVICE void tile_softmax(float (&s)[TileKeys<DK>::value / 8][4], unsigned int (&pf)[TileKeys<DK>::value / 16][4],
                         float (&o)[DK / 8][4], float (&m)[2], float (&l)[2], const int2* ranges, int j0, bool full,
                         float scale2, int g, int t) {
#pragma unroll
    for (int nt = 0; nt < TileKeys<DK>::value / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = __fmul_rn(s[nt][e], scale2);  // not fused into the exponent's subtraction
    if (!full) {  // key j = j0 + 2t + k, k = 8nt + (e & 1): the row's range shifted to k, compared with constants
        const int2 a = ranges[g], b = ranges[g + 8];
        const int base = j0 + 2 * t, lo[2] = {a.x - base, b.x - base}, hi[2] = {a.y - base, b.y - base};
#pragma unroll
        for (int nt = 0; nt < TileKeys<DK>::value / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1, k = nt * 8 + (e & 1);
                if (!(k >= lo[r] && k < hi[r])) s[nt][e] = NEG_INF;
            }
    }
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int nt = 0; nt < TileKeys<DK>::value / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
    float sub[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], SHFL_XOR(mx[r], 1));  // the 4 lanes of a row group hold one row
        mx[r] = fmaxf(mx[r], SHFL_XOR(mx[r], 2));
        const float mn = fmaxf(m[r], ceilf(mx[r]));
        alpha[r] = mn == m[r] ? 1.0f : exp2_fast(m[r] - mn);  // a power of two; 0 from -inf
        m[r] = mn;
        sub[r] = mn == NEG_INF ? 0.0f : mn;  // nothing seen yet: every weight is 0
        l[r] *= alpha[r];
    }
    // The integer running max of a row rarely moves after its first tiles, so most tiles rescale O by 1:
    // skipped when no row of the warp moved (exact either way; DK / 2 multiplies a lane, about as many
    // instructions as the tile's mma).
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int nt = 0; nt < DK / 8; ++nt) o[nt][2 * r] *= alpha[r], o[nt][2 * r + 1] *= alpha[r];
    }
#pragma unroll
    for (int kc = 0; kc < TileKeys<DK>::value / 16; ++kc) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // key columns 16kc + 8*half + 2t..+1
            const float(&c)[4] = s[2 * kc + half];
            const unsigned int p0 = pack_bf16(exp2_fast(c[0] - sub[0]), exp2_fast(c[1] - sub[0]));
            const unsigned int p1 = pack_bf16(exp2_fast(c[2] - sub[1]), exp2_fast(c[3] - sub[1]));
            pf[kc][2 * half] = p0, pf[kc][2 * half + 1] = p1;
            l[0] += bf16_lo(p0) + bf16_hi(p0);
            l[1] += bf16_lo(p1) + bf16_hi(p1);
        }
    }
}

// O[MT][16 rows x DK] += P V for this warp's rows: each V fragment loaded feeds the mma of every m-tile.
template <int DK>
DEVICE void tile_pv(RowAcc<DK>& o, const TileWeights<DK>& pf, const u16* sv, int lane) {
    constexpr int LDS = DK + 8, MT = MTiles<DK>::value;
#pragma unroll
    for (int kc = 0; kc < TileKeys<DK>::value / 16; ++kc)
#pragma unroll
        for (int dp = 0; dp < DK / 16; ++dp) {  // matrices: keys kc*16 + 8(i%2).., columns dp*16 + 8(i/2)..
            unsigned int b[4];
            ldmatrix_x4_trans(b, sv + (kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + dp * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_bf16(o[mt][2 * dp], pf[mt][kc], b[0], b[1]);
                mma_bf16(o[mt][2 * dp + 1], pf[mt][kc], b[2], b[3]);
            }
        }
}

// One warp's key ranges, in shared memory: read where needed, since at MT 2 registers for them make O spill.
template <int MT>
struct WarpRanges {
    int2 any;           // the union of its rows' [lo, hi): the tiles it skips
    int2 all[MT];       // the intersection over an m-tile's rows: the tiles that skip the mask
    int2 row[16 * MT];  // each row's [lo, hi): the mask
};

DEVICE void store_out(float* dst, float x) { *dst = x; }
DEVICE void store_out(u16* dst, float x) { *dst = f32_to_bf16(x); }  // as the GEMM's cast kernel rounds

// sk, sv: K and V tiles, BN x (DK + 8) bf16 each; qa: where this warp's Q lives (QInRegisters, QInShared).
// out: f32, or bf16 bits (u16) of the same values.
template <int DK, typename QA, typename OUT>
DEVICE void attn_prefill_tc(QA qa, u16* sk, u16* sv, const float* __restrict__ q, const u16* __restrict__ kvb,
                            const int* __restrict__ pos, const int* __restrict__ kv_len, OUT* __restrict__ out,
                            int n_q, int hq, int hk, int d, int dv, int cap, float scale2, int window, int* errflag,
                            int code) {
    constexpr int BN = TileKeys<DK>::value, MT = MTiles<DK>::value, BIG = 0x7fffffff;
    __shared__ int blo, bhi;
    __shared__ WarpRanges<MT> ranges[ATTN_TC_WARPS];

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int h = blockIdx.x, kvh = h / (hq / hk);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * 16 * MT * ATTN_TC_WARPS;  // the latest (longest) query tiles first
    const int w0 = q0 + warp * 16 * MT;  // the warp's first row; m-tile mt holds rows w0 + 16mt..

    const int L = kv_len[0];
    const bool bad = L < 0 || L > cap;
    if (bad && blockIdx.x == 0 && blockIdx.y == 0 && tid == 0) report_error(errflag, code, L);
    int ulo = BIG, uhi = 0;  // the warp's rows: union of their ranges
    int ilo[MT], ihi[MT];    // an m-tile's rows: intersection of their ranges
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        ilo[mt] = 0, ihi[mt] = BIG;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = mt * 16 + g + r * 8;
            int lo = 0, hi = 0;
            if (!bad && w0 + i < n_q) {
                row_range(pos[w0 + i], L, window, lo, hi);
                if (lo < hi) ulo = min(ulo, lo), uhi = max(uhi, hi);
                ilo[mt] = max(ilo[mt], lo), ihi[mt] = min(ihi[mt], hi);  // a row that sees nothing empties it
            }
            if (t == 0) ranges[warp].row[i] = make_int2(lo, hi);  // rows past n_q: empty
        }
    }
    if (tid == 0) blo = BIG, bhi = 0;
    __syncthreads();
    if (t == 0 && ulo < uhi) atomicMin(&blo, ulo), atomicMax(&bhi, uhi);
#pragma unroll
    for (int o = 16; o >= 4; o >>= 1) {  // lanes 4 apart hold other rows (xor 1, 2: the same rows)
        ulo = min(ulo, SHFL_XOR(ulo, o)), uhi = max(uhi, SHFL_XOR(uhi, o));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ilo[mt] = max(ilo[mt], SHFL_XOR(ilo[mt], o)), ihi[mt] = min(ihi[mt], SHFL_XOR(ihi[mt], o));
    }
    if (lane == 0) {
        ranges[warp].any = make_int2(ulo, uhi);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ranges[warp].all[mt] = make_int2(ilo[mt], ihi[mt]);
    }
    __syncthreads();  // and ranges written
    const int jlo = blo, jhi = bhi;  // the keys any row of the block sees (empty when kv_len is bad)

    qa.load(q, w0, n_q, hq, h, d, lane);  // rounded to bf16
    RowAcc<DK> o;
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < DK / 8; ++nt) o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.0f;
        m[mt][0] = m[mt][1] = NEG_INF, l[mt][0] = l[mt][1] = 0.0f;
    }

    if (jlo < jhi) load_tile<DK>(sk, kvb, kvh, cap, jlo, jhi);
    cp_async_commit();
    for (int j0 = jlo; j0 < jhi; j0 += BN) {
        cp_async_wait_all();
        __syncthreads();  // K landed for everyone; every warp is done with the previous V tile
        load_tile<DK>(sv, kvb, hk + kvh, cap, j0, jhi);
        cp_async_commit();
        const int2 any = ranges[warp].any;
        const bool busy = j0 < any.y && j0 + BN > any.x;  // warp-uniform: a tile none of its rows sees is skipped
        TileWeights<DK> pf;
        if (busy) {
            TileScores<DK> s;
            qa.scores(s, sk, lane);
            // an m-tile whose rows see none of this tile: all masked, its state unchanged (alpha 1, weights 0)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int2 all = ranges[warp].all[mt];
                tile_softmax<DK>(s[mt], pf[mt], o[mt], m[mt], l[mt], ranges[warp].row + mt * 16, j0,
                                 j0 >= all.x && j0 + BN <= all.y, scale2, g, t);
            }
        }
        cp_async_wait_all();
        __syncthreads();  // V landed; every warp is done with this K tile
        if (j0 + BN < jhi) load_tile<DK>(sk, kvb, kvh, cap, j0 + BN, jhi);
        cp_async_commit();
        if (busy) tile_pv<DK>(o, pf, sv, lane);
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = w0 + mt * 16 + g + r * 8;
            float sum = l[mt][r] + SHFL_XOR(l[mt][r], 1);
            sum += SHFL_XOR(sum, 2);
            if (row >= n_q) continue;
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // no visible key: 0
            OUT* dst = out + ((long long)row * hq + h) * dv;
#pragma unroll
            for (int nt = 0; nt < DK / 8; ++nt) {
                const int c = nt * 8 + 2 * t;
                if (c < dv) store_out(dst + c, o[mt][nt][2 * r] * inv);
                if (c + 1 < dv) store_out(dst + c + 1, o[mt][nt][2 * r + 1] * inv);
            }
        }
}

// ---------------------------------------------------------------- specializations
#define ATTN_KV_DEFINE(KVNAME, KVT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(ATTN_KV_CONVERT_THREADS) attn_kv_bf16_##KVNAME(                     \
        const KVT* k, const KVT* v, u16* dst, const int* kv_len, int cap, int hk, int d, int dv, int dk, int vec) {  \
        PDL_ENTRY();                                                                                                 \
        kv_to_bf16<KVT>(k, v, dst, kv_len, cap, hk, d, dv, dk, vec);                                                 \
    }
ATTN_KV_DEFINE(f32, float)
ATTN_KV_DEFINE(f16, u16)

// DK: the head dims served (d, dv <= DK). OUT: float, or u16 for the _obf16 kernels (bf16 bits).
#define ATTN_TC_ARGS(OUT)                                                                                            \
    const float *q, const u16 *kvb, const int *pos, const int *kv_len, OUT *out, int n_q, int hq, int hk, int d,     \
        int dv, int cap, float scale2, int window, int *errflag, int code
#define ATTN_TC_PASS q, kvb, pos, kv_len, out, n_q, hq, hk, d, dv, cap, scale2, window, errflag, code

// 64 and 128 (Qwen3, Llama): K/V tiles in static shared memory; Q in registers, or (ATTN_TC_Q_SHARED_D<DK>)
// each warp's 16*MT rows in dynamic shared memory (launched with 16 * MT * WARPS * (DK + 8) * 2 bytes).
// 256 (Qwen3.5, Gemma 3): Q in shared memory; K tile, V tile, then Q rows of each warp, all dynamic
// (launched with (2 * ATTN_TC_BN_D256 + 16 * ATTN_TC_WARPS) * 264 * 2 bytes).
template <int DK, typename OUT>
DEVICE void attn_prefill_entry(ATTN_TC_ARGS(OUT)) {
    constexpr int LDS = DK + 8, BN = TileKeys<DK>::value, MT = MTiles<DK>::value;
    extern __shared__ __align__(16) u16 attn_tc_smem[];
    if constexpr (DK > 128) {
        static_assert(MT == 1, "attention.py sizes the d256 kernel's shared memory for one m-tile a warp");
        u16* sq = attn_tc_smem + (2 * BN + 16 * (threadIdx.x / 32)) * LDS;
        attn_prefill_tc<DK>(QInShared<DK>{sq}, attn_tc_smem, attn_tc_smem + BN * LDS, ATTN_TC_PASS);
    } else {
        __shared__ alignas(16) u16 sk[BN * LDS];
        __shared__ alignas(16) u16 sv[BN * LDS];
        if constexpr (QShared<DK>::value)
            attn_prefill_tc<DK>(QInShared<DK>{attn_tc_smem + 16 * MT * (threadIdx.x / 32) * LDS}, sk, sv, ATTN_TC_PASS);
        else
            attn_prefill_tc<DK>(QInRegisters<DK>{}, sk, sv, ATTN_TC_PASS);
    }
}

#define ATTN_TC_DEFINE(DK)                                                                                           \
    extern "C" __global__ void __launch_bounds__(ATTN_TC_THREADS) attn_prefill_bf16_d##DK(ATTN_TC_ARGS(float)) {     \
        PDL_ENTRY();                                                                                                 \
        attn_prefill_entry<DK, float>(ATTN_TC_PASS);                                                                 \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(ATTN_TC_THREADS) attn_prefill_bf16_d##DK##_obf16(ATTN_TC_ARGS(u16)) { \
        PDL_ENTRY();                                                                                                 \
        attn_prefill_entry<DK, u16>(ATTN_TC_PASS);                                                                   \
    }
ATTN_TC_DEFINE(64)
ATTN_TC_DEFINE(128)
ATTN_TC_DEFINE(256)

#endif  // __CUDA_ARCH__ >= 800
