// flash_attn_bf16 (graphir/ops/fused.py) for prefill, on tensor cores: FlashAttention-2 style.
//
//   attn_kv_bf16_<kv>     K and V rows j < kv_len (f32 or f16 cache [cap, hk, d]) rounded to bf16 into a
//                         scratch [2][hk][cap][DK] (K heads, then V heads), columns d..DK zero. Once per
//                         call: the tiles below are then plain 16-byte cp.async copies (no conversion in
//                         the hot loop, half the L2 traffic of an f32 cache) and every head dim <= DK
//                         looks like DK. The grid covers the capacity; blocks past kv_len exit.
//   attn_prefill_bf16_d<DK>  grid (q head, query tile): 16*WARPS query rows of one q head per block,
//                         16 rows per warp. K/V tiles of BN rows stream through shared memory (K of the
//                         next tile loads while P.V runs, V while Q.K^T runs); tiles outside the
//                         block's visible rows are never loaded, a warp skips tiles outside its own,
//                         and tiles inside every row's range skip the mask.
//                         DK 64, 128: Q fragments in registers, K/V tiles in static shared memory.
//                         DK 256: O alone takes 128 registers a lane, so Q waits in shared memory
//                         (bf16, its A fragments re-read by ldmatrix every tile) and the three
//                         buffers are dynamic shared memory: (2 * BN + 16 * WARPS) * (DK + 8) bf16,
//                         66 KiB at BN 32 and 4 warps, above the 48 KiB default (attention.py raises
//                         the limit).
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
#define ATTN_TC_WARPS 4  // 64 query rows per block; attention.py mirrors it (TC_WARPS)
#endif
#ifndef ATTN_TC_BN
#define ATTN_TC_BN 64  // keys per K/V tile: 2 x 64 x (DK + 8) bf16 = 34 KiB of shared memory at DK 128
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
    static constexpr int value = DK > 128 ? ATTN_TC_BN_D256 : ATTN_TC_BN;
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

// ---------------------------------------------------------------- tensor-core and async-copy PTX
DEVICE void mma_bf16(float (&c)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

DEVICE unsigned int smem_addr(const void* p) { return (unsigned int)__cvta_generic_to_shared(p); }

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

DEVICE void cp_async16(u16* dst, const u16* src, bool valid) {  // !valid: 16 zero bytes, nothing read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// ---------------------------------------------------------------- K/V to bf16
// One thread per column pair of a scratch row (h, j): dst[kv][h][j][c..c+1], kv = blockIdx.y.
template <typename KV>
DEVICE void kv_to_bf16(const KV* __restrict__ k, const KV* __restrict__ v, u16* __restrict__ dst,
                       const int* __restrict__ kv_len, int cap, int hk, int d, int dv, int dk) {
    const long long rows = (long long)hk * cap, pair = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int pairs = dk / 2;
    const long long row = pair / pairs;
    if (row >= rows) return;
    const int h = (int)(row / cap), j = (int)(row - (long long)h * cap), c = (int)(pair - row * pairs) * 2;
    int L = kv_len[0];
    L = L < 0 || L > cap ? 0 : L;  // a bad kv_len converts nothing; the attention kernel reports it
    if (j >= L) return;
    const bool is_v = blockIdx.y == 1;
    const int width = is_v ? dv : d;
    const KV* src = (is_v ? v : k) + ((long long)j * hk + h) * width;
    const float a = c < width ? kv_f32(src[c]) : 0.0f, b = c + 1 < width ? kv_f32(src[c + 1]) : 0.0f;
    ((unsigned int*)dst)[(blockIdx.y * rows + row) * pairs + c / 2] = pack_bf16(a, b);
}

// ---------------------------------------------------------------- attention
// Keys query row p sees: [lo, hi) = j <= p, j < L, p - j < window (window > 0); flash_attn's rule.
DEVICE void row_range(int p, int L, int window, int& lo, int& hi) {
    if (p < 0) return;  // lo = hi = 0: sees nothing
    hi = p < L ? p + 1 : L;
    lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
}

// K or V rows j0.. of one kv head into a tile (row stride DK + 8: ldmatrix's 8 row addresses then
// fall on distinct banks); rows at and past jhi are zero (their scores are masked, and 0 * V
// must not meet garbage).
template <int DK>
DEVICE void load_tile(u16* tile, const u16* head, int j0, int jhi) {
    constexpr int CH = DK / 8, LDS = DK + 8;
    constexpr int BN = TileKeys<DK>::value;
    static_assert(BN * CH % ATTN_TC_THREADS == 0, "a tile is whole 16-byte chunks per thread");
#pragma unroll
    for (int n = 0; n < BN * CH / ATTN_TC_THREADS; ++n) {
        const int i = n * ATTN_TC_THREADS + threadIdx.x, r = i / CH, c = i % CH;
        const bool ok = j0 + r < jhi;
        cp_async16(tile + r * LDS + c * 8, head + (long long)(ok ? j0 + r : 0) * DK + c * 8, ok);
    }
}

// This warp's 16 query rows as bf16 A fragments, and S[16 rows x BN keys] = Q K^T from them.
// Two places for Q, one interface: load() once, scores() per K tile.
DEVICE float q_at(const float* __restrict__ q, int row, int c, int n_q, int hq, int h, int d) {
    return row < n_q && c < d ? q[((long long)row * hq + h) * d + c] : 0.0f;
}

#define TC_MEMBER __device__ __forceinline__  // DEVICE is static: not for member functions

template <int DK>
struct QInRegisters {  // DK / 4 registers a lane
    unsigned int f[DK / 16][4];

    TC_MEMBER void load(const float* __restrict__ q, int row0, int n_q, int hq, int h, int d, int lane) {
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int kc = 0; kc < DK / 16; ++kc) {
            const int c = kc * 16 + 2 * t;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = row0 + g + (i & 1) * 8, cc = c + (i >> 1) * 8;
                f[kc][i] = pack_bf16(q_at(q, r, cc, n_q, hq, h, d), q_at(q, r, cc + 1, n_q, hq, h, d));
            }
        }
    }

    TC_MEMBER void scores(float (&s)[TileKeys<DK>::value / 8][4], const u16* sk, int lane) const {
        constexpr int LDS = DK + 8;
#pragma unroll
        for (int nt = 0; nt < TileKeys<DK>::value / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
            for (int kc = 0; kc < DK / 32; ++kc) {  // matrices: keys nt*8.., columns kc*32 + 8i..
                unsigned int b[4];
                ldmatrix_x4(b, sk + (nt * 8 + (lane & 7)) * LDS + kc * 32 + (lane >> 3) * 8);
                mma_bf16(s[nt], f[2 * kc], b[0], b[1]);
                mma_bf16(s[nt], f[2 * kc + 1], b[2], b[3]);
            }
        }
    }
};

template <int DK>
struct QInShared {  // the warp's own 16 rows x (DK + 8) bf16 of shared memory; 8 registers a lane
    u16* sq;

    TC_MEMBER void load(const float* __restrict__ q, int row0, int n_q, int hq, int h, int d, int lane) {
        constexpr int LDS = DK + 8, PAIRS = DK / 2;
#pragma unroll 4
        for (int i = lane; i < 16 * PAIRS; i += 32) {  // consecutive lanes, consecutive columns
            const int r = i / PAIRS, c = (i % PAIRS) * 2;
            ((unsigned int*)(sq + r * LDS))[c / 2] =
                pack_bf16(q_at(q, row0 + r, c, n_q, hq, h, d), q_at(q, row0 + r, c + 1, n_q, hq, h, d));
        }
        __syncwarp();  // only this warp reads its rows
    }

    // Same products in the same order as QInRegisters; k-steps outer, so each Q fragment is read once a tile.
    TC_MEMBER void scores(float (&s)[TileKeys<DK>::value / 8][4], const u16* sk, int lane) const {
        constexpr int LDS = DK + 8;
#pragma unroll
        for (int nt = 0; nt < TileKeys<DK>::value / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int kc = 0; kc < DK / 32; ++kc) {
            // A of columns kc*32.. and kc*32+16..: matrices rows 8(i%2).., columns 8(i/2)..
            const u16* qrow = sq + ((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + kc * 32 + (lane >> 4) * 8;
            unsigned int a0[4], a1[4];
            ldmatrix_x4(a0, qrow);
            ldmatrix_x4(a1, qrow + 16);
#pragma unroll
            for (int nt = 0; nt < TileKeys<DK>::value / 8; ++nt) {  // matrices: keys nt*8.., columns kc*32 + 8i..
                unsigned int b[4];
                ldmatrix_x4(b, sk + (nt * 8 + (lane & 7)) * LDS + kc * 32 + (lane >> 3) * 8);
                mma_bf16(s[nt], a0, b[0], b[1]);
                mma_bf16(s[nt], a1, b[2], b[3]);
            }
        }
    }
};

// The online softmax step of one tile for rows g (r = 0) and g + 8 (r = 1): scores to the log2
// domain and masked, the integer running max raised, acc and sums rescaled, weights packed as bf16.
template <int DK>
DEVICE void tile_softmax(float (&s)[TileKeys<DK>::value / 8][4], unsigned int (&pf)[TileKeys<DK>::value / 16][4],
                         float (&o)[DK / 8][4], float (&m)[2], float (&l)[2], const int (&lo)[2],
                         const int (&hi)[2], int j0, bool full, float scale2, int t) {
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int nt = 0; nt < TileKeys<DK>::value / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = e >> 1, j = j0 + nt * 8 + 2 * t + (e & 1);
            float x = __fmul_rn(s[nt][e], scale2);  // not fused into the exponent's subtraction
            if (!full && !(j >= lo[r] && j < hi[r])) x = NEG_INF;
            s[nt][e] = x;
            mx[r] = fmaxf(mx[r], x);
        }
    float sub[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], SHFL_XOR(mx[r], 1));  // the 4 lanes of a row group hold one row
        mx[r] = fmaxf(mx[r], SHFL_XOR(mx[r], 2));
        const float mn = fmaxf(m[r], ceilf(mx[r]));
        const float alpha = mn == m[r] ? 1.0f : exp2_fast(m[r] - mn);  // a power of two; 0 from -inf
        m[r] = mn;
        sub[r] = mn == NEG_INF ? 0.0f : mn;  // nothing seen yet: every weight is 0
        l[r] *= alpha;
#pragma unroll
        for (int nt = 0; nt < DK / 8; ++nt) o[nt][2 * r] *= alpha, o[nt][2 * r + 1] *= alpha;
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

// O[16 rows x DK] += P V for this warp's rows.
template <int DK>
DEVICE void tile_pv(float (&o)[DK / 8][4], const unsigned int (&pf)[TileKeys<DK>::value / 16][4], const u16* sv,
                    int lane) {
    constexpr int LDS = DK + 8;
#pragma unroll
    for (int kc = 0; kc < TileKeys<DK>::value / 16; ++kc)
#pragma unroll
        for (int dp = 0; dp < DK / 16; ++dp) {  // matrices: keys kc*16 + 8(i%2).., columns dp*16 + 8(i/2)..
            unsigned int b[4];
            ldmatrix_x4_trans(b, sv + (kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + dp * 16 + (lane >> 4) * 8);
            mma_bf16(o[2 * dp], pf[kc], b[0], b[1]);
            mma_bf16(o[2 * dp + 1], pf[kc], b[2], b[3]);
        }
}

// sk, sv: K and V tiles, BN x (DK + 8) bf16 each; qa: where this warp's Q lives (QInRegisters, QInShared).
template <int DK, typename QA>
DEVICE void attn_prefill_tc(QA qa, u16* sk, u16* sv, const float* __restrict__ q, const u16* __restrict__ kvb,
                            const int* __restrict__ pos, const int* __restrict__ kv_len, float* __restrict__ out,
                            int n_q, int hq, int hk, int d, int dv, int cap, float scale2, int window, int* errflag,
                            int code) {
    constexpr int BN = TileKeys<DK>::value, BIG = 0x7fffffff;
    __shared__ int blo, bhi;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int h = blockIdx.x, kvh = h / (hq / hk);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * 16 * ATTN_TC_WARPS;  // the latest (longest) query tiles first
    const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};

    const int L = kv_len[0];
    const bool bad = L < 0 || L > cap;
    if (bad && blockIdx.x == 0 && blockIdx.y == 0 && tid == 0) report_error(errflag, code, L);
    int lo[2] = {0, 0}, hi[2] = {0, 0};
    int ulo = BIG, uhi = 0, ilo = 0, ihi = BIG;  // the warp's rows: union and intersection of their ranges
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (bad || row[r] >= n_q) continue;
        row_range(pos[row[r]], L, window, lo[r], hi[r]);
        if (lo[r] < hi[r]) ulo = min(ulo, lo[r]), uhi = max(uhi, hi[r]);
        ilo = max(ilo, lo[r]), ihi = min(ihi, hi[r]);  // a row that sees nothing empties it
    }
    if (tid == 0) blo = BIG, bhi = 0;
    __syncthreads();
    if (t == 0 && ulo < uhi) atomicMin(&blo, ulo), atomicMax(&bhi, uhi);
#pragma unroll
    for (int o = 16; o >= 4; o >>= 1) {  // lanes 4 apart hold other rows (xor 1, 2: the same rows)
        ulo = min(ulo, SHFL_XOR(ulo, o)), uhi = max(uhi, SHFL_XOR(uhi, o));
        ilo = max(ilo, SHFL_XOR(ilo, o)), ihi = min(ihi, SHFL_XOR(ihi, o));
    }
    __syncthreads();
    const int jlo = blo, jhi = bhi;  // the keys any row of the block sees (empty when kv_len is bad)

    qa.load(q, q0 + warp * 16, n_q, hq, h, d, lane);  // rounded to bf16
    float o[DK / 8][4];
#pragma unroll
    for (int nt = 0; nt < DK / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    const u16* kh = kvb + (long long)kvh * cap * DK;
    const u16* vh = kvb + ((long long)hk + kvh) * cap * DK;
    const int n_tiles = jhi > jlo ? (jhi - jlo + BN - 1) / BN : 0;
    if (n_tiles > 0) load_tile<DK>(sk, kh, jlo, jhi);
    cp_async_commit();
    for (int it = 0; it < n_tiles; ++it) {
        const int j0 = jlo + it * BN;
        cp_async_wait_all();
        __syncthreads();  // K landed for everyone; every warp is done with the previous V tile
        load_tile<DK>(sv, vh, j0, jhi);
        cp_async_commit();
        const bool busy = j0 < uhi && j0 + BN > ulo;  // warp-uniform: a tile none of its rows sees is skipped
        unsigned int pf[BN / 16][4];
        if (busy) {
            float s[BN / 8][4];
            qa.scores(s, sk, lane);
            tile_softmax<DK>(s, pf, o, m, l, lo, hi, j0, j0 >= ilo && j0 + BN <= ihi, scale2, t);
        }
        cp_async_wait_all();
        __syncthreads();  // V landed; every warp is done with this K tile
        if (it + 1 < n_tiles) load_tile<DK>(sk, kh, j0 + BN, jhi);
        cp_async_commit();
        if (busy) tile_pv<DK>(o, pf, sv, lane);
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = l[r] + SHFL_XOR(l[r], 1);
        sum += SHFL_XOR(sum, 2);
        if (row[r] >= n_q) continue;
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // no visible key: 0
        float* dst = out + ((long long)row[r] * hq + h) * dv;
#pragma unroll
        for (int nt = 0; nt < DK / 8; ++nt) {
            const int c = nt * 8 + 2 * t;
            if (c < dv) dst[c] = o[nt][2 * r] * inv;
            if (c + 1 < dv) dst[c + 1] = o[nt][2 * r + 1] * inv;
        }
    }
}

// ---------------------------------------------------------------- specializations
#define ATTN_KV_DEFINE(KVNAME, KVT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(ATTN_KV_CONVERT_THREADS) attn_kv_bf16_##KVNAME(                     \
        const KVT* k, const KVT* v, u16* dst, const int* kv_len, int cap, int hk, int d, int dv, int dk) {           \
        PDL_ENTRY();                                                                                                 \
        kv_to_bf16<KVT>(k, v, dst, kv_len, cap, hk, d, dv, dk);                                                      \
    }
ATTN_KV_DEFINE(f32, float)
ATTN_KV_DEFINE(f16, u16)

// DK: the head dims served (d, dv <= DK). 64 and 128 (Qwen3, Llama): everything in static shared memory.
#define ATTN_TC_ARGS                                                                                                 \
    const float *q, const u16 *kvb, const int *pos, const int *kv_len, float *out, int n_q, int hq, int hk, int d,   \
        int dv, int cap, float scale2, int window, int *errflag, int code
#define ATTN_TC_PASS q, kvb, pos, kv_len, out, n_q, hq, hk, d, dv, cap, scale2, window, errflag, code
#define ATTN_TC_DEFINE(DK)                                                                                           \
    extern "C" __global__ void __launch_bounds__(ATTN_TC_THREADS) attn_prefill_bf16_d##DK(ATTN_TC_ARGS) {            \
        PDL_ENTRY();                                                                                                 \
        __shared__ alignas(16) u16 sk[TileKeys<DK>::value * (DK + 8)];                                               \
        __shared__ alignas(16) u16 sv[TileKeys<DK>::value * (DK + 8)];                                               \
        attn_prefill_tc<DK>(QInRegisters<DK>{}, sk, sv, ATTN_TC_PASS);                                               \
    }
ATTN_TC_DEFINE(64)
ATTN_TC_DEFINE(128)

// 256 (Qwen3.5, Gemma 3): Q in shared memory; K tile, V tile, then Q rows of each warp, all dynamic
// (launched with (2 * ATTN_TC_BN_D256 + 16 * ATTN_TC_WARPS) * 264 * 2 bytes).
extern "C" __global__ void __launch_bounds__(ATTN_TC_THREADS) attn_prefill_bf16_d256(ATTN_TC_ARGS) {
    PDL_ENTRY();
    constexpr int LDS = 256 + 8;
    extern __shared__ __align__(16) u16 attn_tc_smem[];
    constexpr int BN = TileKeys<256>::value;
    u16* sq = attn_tc_smem + (2 * BN + 16 * (threadIdx.x / 32)) * LDS;
    attn_prefill_tc<256>(QInShared<256>{sq}, attn_tc_smem, attn_tc_smem + BN * LDS, ATTN_TC_PASS);
}

#endif  // __CUDA_ARCH__ >= 800
