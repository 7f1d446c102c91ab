// mul_mat_q8x: the decode GEMV of a q4_0 / q8_0 weight with x rounded to 8-bit blocks (graphir/ops/fused.py
// q8_blocks), multiplying integer codes four at a time (dp4a). y[t, o] = sum_b d_w d_x (sum_i c_i q_i).
//
//   gemv_q8x_<fmt>_<cfg>  x and the weight's 2-byte-aligned blocks staged through shared memory (as matmul.cu's
//                         gemv1v3 kernels): rows of whole 16-byte pieces in a 16-byte aligned weight.
//   gemv_q8x_<fmt>_any    any row length and alignment: a lane reads its blocks byte by byte (slow; bitwise the
//                         same results as the staged kernels, which add the same terms in the same order).
// One x row per grid row (blockIdx.y): the weight is read once a token, which is what decode (1 token) wants.
//
// Why: the f32 gemv1v3 kernels spend ~3 instructions a 4-bit weight (a LOP3 building a float from the nibble,
// an FFMA for its bias, an FFMA for the dot) and stay issue-bound at 35-65 % of copy bandwidth. Here a 32-bit
// word of 8 q4_0 codes costs a funnel shift (re-alignment), 3 logic ops (low nibbles, high nibbles) and 2 dp4a:
// per 32-weight block and row (sm_90 SASS of gemv_q8x_q4_0_w4r4, 2026-12-02): 5 LDS, 4 SHF, 12 LOP3, 8 IDP4A
// and ~6 for the scale and the float sum, ~1.1 instructions a weight; q8_0 ~0.9 (8 SHF + 8 IDP4A + 9 LDS).
//  - the -8 of q4_0's codes: sum c q = sum nibble * q - 8 sum q; the block's sum of q is found once, with x.
//  - x is quantized inside each thread block as it is staged (4 threads a 32-value block: max |x|, scale,
//    codes, sum of codes), so no separate kernel (launch) is needed; every block computes the same codes
//    (IEEE division and roundf: NVRTC's defaults are -prec-div=true -ftz=false, no fast math).
//  - per lane and row, a block's term d_w d_x (integer sum) is added as fmaf(isum, d_w * d_x, acc), lane l
//    taking blocks l, l + 32, ... in order; then the lanes' sums are added by an xor butterfly.
//  - the next chunk's weight pieces are loaded into registers while this one is computed (Q8X_PREFETCH), as
//    gemv1v3 does: 4096-row weights put few blocks on each SM.
#include "quant.cuh"

#ifndef Q8X_PREFETCH
#define Q8X_PREFETCH 1
#endif

// c + the sum of the products of the 4 signed bytes of a and b
DEVICE int dot4_i8(unsigned a, unsigned b, int c) {
#if defined(__HIPCC__)
#if defined(__HIP_DEVICE_COMPILE__) && (defined(__gfx906__) || defined(__gfx908__) || defined(__gfx90a__) ||  \
                                        defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) ||  \
                                        defined(__gfx1030__) || defined(__gfx1031__) || defined(__gfx1032__) || \
                                        defined(__gfx1034__) || defined(__gfx1035__) || defined(__gfx1036__))
    return __builtin_amdgcn_sdot4((int)a, (int)b, c, false);  // v_dot4_i32_i8 (dot1 instructions)
#else
#pragma unroll
    for (int k = 0; k < 4; ++k) c += (int)(signed char)(a >> (8 * k)) * (int)(signed char)(b >> (8 * k));
    return c;
#endif
#else
    return __dp4a((int)a, (int)b, c);  // CUDA (sm_61+); the host emulation's shim defines it too
#endif
}

// ---------------------------------------------------------------- x in 8-bit blocks
// d = max |x| / 127; codes roundf(x * (1 / d)), with 1/d = 0 where d is below the smallest normal f32 (it
// would overflow): the same f32 operations as q8_blocks, so the same codes.
DEVICE float q8_inverse(float d) { return d >= 1.17549435e-38f ? 1.0f / d : 0.0f; }

DEVICE unsigned q8_pack4(float a, float b, float c, float d, float inv, int& sum) {
    const int qa = (int)roundf(a * inv), qb = (int)roundf(b * inv), qc = (int)roundf(c * inv),
              qd = (int)roundf(d * inv);
    sum += (qa + qb) + (qc + qd);
    return ((unsigned)qa & 0xFFu) | (((unsigned)qb & 0xFFu) << 8) | (((unsigned)qc & 0xFFu) << 16) |
           ((unsigned)qd << 24);
}

// Chunk layout in shared memory, 3 U4 a block: its codes (elements 0..15, 16..31), then {d bits, bias}; the
// third U4 also shifts consecutive blocks' 48-byte records across banks, so lanes reading their own block's
// codes with 16-byte loads do not conflict. bias = OFFSET * (sum of codes), the integer sum's start.
// Threads 4t..4t+3 quantize block t (8 values each); blocks from nbh on are written as zeros.
template <int T, int CB, int OFFSET>
DEVICE void q8_stage_chunk(const float* __restrict__ X, int nbh, U4* xs) {
    static_assert(CB % 8 == 0, "a warp's 8 blocks are all in or all out of the loop (its shuffles need them all)");
    const int part = threadIdx.x & 3;
#pragma unroll
    for (int blk = threadIdx.x >> 2; blk < CB; blk += T / 4) {
        F4 a = {0.0f, 0.0f, 0.0f, 0.0f}, b = a;
        if (blk < nbh) {
            a = *(const F4*)(X + 32 * blk + 8 * part);
            b = *(const F4*)(X + 32 * blk + 8 * part + 4);
        }
        float m = fmaxf(fmaxf(fmaxf(fabsf(a.a), fabsf(a.b)), fmaxf(fabsf(a.c), fabsf(a.d))),
                        fmaxf(fmaxf(fabsf(b.a), fabsf(b.b)), fmaxf(fabsf(b.c), fabsf(b.d))));
        m = fmaxf(m, SHFL_XOR(m, 1));
        m = fmaxf(m, SHFL_XOR(m, 2));
        const float d = m / 127.0f, inv = q8_inverse(d);
        int s = 0;
        const U2 w = {q8_pack4(a.a, a.b, a.c, a.d, inv, s), q8_pack4(b.a, b.b, b.c, b.d, inv, s)};
        s += SHFL_XOR(s, 1);
        s += SHFL_XOR(s, 2);
        ((U2*)(xs + 3 * blk))[part] = w;
        if (part == 0) xs[3 * blk + 2] = U4{__float_as_uint(d), (unsigned)(OFFSET * s), 0u, 0u};
    }
}

// ---------------------------------------------------------------- weight formats
// W: a block's words from the 4-byte aligned address at or below its start, off = its start % 4 (0 or 2);
// xa, xb: x's codes of elements 0..15 and 16..31; acc: the integer sum's start (the bias).
// dot returns acc + sum nibble-or-byte * q; *d = the block's scale. nibble_or_byte: element i of qs, unaligned.
struct Q4_0 {
    static constexpr int BB = 18, NW = 5, OFFSET = -8;  // code = nibble - 8
    MEMBER int nibble_or_byte(const u8* qs, int i) { return (qs[i & 15] >> (i < 16 ? 0 : 4)) & 15; }
    MEMBER int dot(const unsigned* W, unsigned off, const U4& xa, const U4& xb, int acc, float* d) {
        *d = h2f((W[0] >> (8 * off)) & 0xFFFFu);
        const unsigned sh = 16 + 8 * off;  // qs start 2 bytes after the block: bit 16 or 32 of W[0]:W[1]
        const unsigned x_lo[4] = {xa.a, xa.b, xa.c, xa.d}, x_hi[4] = {xb.a, xb.b, xb.c, xb.d};
        int hi = 0;  // two chains: low nibbles (elements 4k.., x word k), high (16 + 4k.., word 4 + k)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const unsigned q = funnel_r(W[k], W[k + 1], sh);
            acc = dot4_i8(q & 0x0F0F0F0Fu, x_lo[k], acc);
            hi = dot4_i8((q >> 4) & 0x0F0F0F0Fu, x_hi[k], hi);
        }
        return acc + hi;
    }
};

struct Q8_0 {
    static constexpr int BB = 34, NW = 9, OFFSET = 0;  // code = the byte
    MEMBER int nibble_or_byte(const u8* qs, int i) { return (signed char)qs[i]; }
    MEMBER int dot(const unsigned* W, unsigned off, const U4& xa, const U4& xb, int acc, float* d) {
        *d = h2f((W[0] >> (8 * off)) & 0xFFFFu);
        const unsigned sh = 16 + 8 * off;
        const unsigned x[8] = {xa.a, xa.b, xa.c, xa.d, xb.a, xb.b, xb.c, xb.d};
        int acc2 = 0;
#pragma unroll
        for (int k = 0; k < 8; k += 2) {
            acc = dot4_i8(funnel_r(W[k], W[k + 1], sh), x[k], acc);
            acc2 = dot4_i8(funnel_r(W[k + 1], W[k + 2], sh), x[k + 1], acc2);
        }
        return acc + acc2;
    }
};

// ---------------------------------------------------------------- staged kernels
// G 32-lane groups a block, NR rows a group; a chunk is CB = 32 * BPL blocks of every row (lane l: blocks
// l, l + 32, ..), copied into shared memory with aligned 16-byte loads. Every thread reaches every
// __syncthreads (rows past the end are read as the last row and not stored).
template <class S, int G, int NR, int BPL>
DEVICE void gemv_q8x_staged(const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X,
                            float* __restrict__ Y, int n_out, int n_in) {
    constexpr int T = 32 * G, CB = 32 * BPL;
    typedef RowChunks<S::BB, NR, CB> Rows;
    static_assert(G * NR * Rows::PIECES * 16 + CB * 48 <= 48 * 1024, "static shared memory is at most 48 KiB");
    __shared__ U4 xs[CB * 3];
    __shared__ U4 ws[G][NR][Rows::PIECES];
    X += (long long)blockIdx.y * n_in;
    Y += (long long)blockIdx.y * n_out;
    const int lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * G + grp) * NR;
    Rows rows(W, row_bytes, row0, n_out);
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
    const int nb = n_in / 32;
    rows.load(0, nb, lane);
    for (int b0 = 0; b0 < nb; b0 += CB) {
        const int nbh = nb - b0 < CB ? nb - b0 : CB;
#if !Q8X_PREFETCH
        if (b0 > 0) rows.load(b0, nb, lane);
#endif
        __syncthreads();  // the previous chunk is no longer read
        rows.store(ws[grp], Rows::pieces(b0, nb), lane);
        q8_stage_chunk<T, CB, S::OFFSET>(X + 32LL * b0, nbh, xs);
        __syncthreads();
#if Q8X_PREFETCH
        if (b0 + CB < nb) rows.load(b0 + CB, nb, lane);
#endif
#pragma unroll
        for (int j = 0; j < BPL; ++j) {
            const int blk = lane + 32 * j;
            if (blk < nbh) {
                const U4 xa = xs[3 * blk], xb = xs[3 * blk + 1], xh = xs[3 * blk + 2];
                const float dx = __uint_as_float(xh.a);
                const unsigned boff = (unsigned)(blk * S::BB);
#pragma unroll
                for (int r = 0; r < NR; ++r) {
                    const unsigned* wp = (const unsigned*)((const u8*)ws[grp][r] + (boff & ~3u));
                    unsigned w[S::NW];
#pragma unroll
                    for (int k = 0; k < S::NW; ++k) w[k] = wp[k];
                    float dw;
                    const int isum = S::dot(w, boff & 3u, xa, xb, (int)xh.b, &dw);
                    acc[r] = fmaf((float)isum, dw * dx, acc[r]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const float s = sum32(acc[r]);
        if (lane == 0 && row0 + r < n_out) Y[row0 + r] = s;
    }
}

// ---------------------------------------------------------------- any shape
// One 32-lane group a row, 4 a block; lane l quantizes and multiplies blocks l, l + 32, .. itself, reading
// x and the weight's bytes one at a time. Bitwise the staged kernels' result (same terms, same order).
template <class S>
DEVICE void gemv_q8x_any(const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X,
                         float* __restrict__ Y, int n_out, int n_in) {
    X += (long long)blockIdx.y * n_in;
    Y += (long long)blockIdx.y * n_out;
    const int lane = threadIdx.x & 31, row = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (row >= n_out) return;  // the whole group: its shuffles stay among its own lanes
    float acc = 0.0f;
    for (int b = lane; b < n_in / 32; b += 32) {
        const float* xb = X + 32LL * b;
        const u8* wb = W + row * row_bytes + (long long)b * S::BB;
        float m = 0.0f;
        for (int i = 0; i < 32; ++i) m = fmaxf(m, fabsf(xb[i]));
        const float dx = m / 127.0f, inv = q8_inverse(dx);
        int sq = 0, isum = 0;
        for (int i = 0; i < 32; ++i) {
            const int q = (int)roundf(xb[i] * inv);
            sq += q;
            isum += S::nibble_or_byte(wb + 2, i) * q;
        }
        isum += S::OFFSET * sq;
        const float dw = h2f(wb[0] | (wb[1] << 8));
        acc = fmaf((float)isum, dw * dx, acc);
    }
    acc = sum32(acc);
    if (lane == 0) Y[row] = acc;
}

// cfg: w<G>r<NR>[b<BPL>] -> threads 32 G, rows per block G NR (gemv_q8x.py Q8X_CONFIGS mirrors it)
#define FOR_EACH_Q8X_CFG(M, name, S)                                                                  \
    M(name, S, w4r2, 4, 2, 1) M(name, S, w4r4, 4, 4, 1) M(name, S, w8r2, 8, 2, 1) M(name, S, w8r4, 8, 4, 1) \
    M(name, S, w4r4b2, 4, 4, 2)
#define DEFINE_Q8X(name, S, cfg, G, NR, BPL)                                                               \
    extern "C" __global__ void __launch_bounds__(32 * G) gemv_q8x_##name##_##cfg(                          \
        const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X, float* __restrict__ Y, \
        int n_out, int n_in) {                                                                             \
        PDL_ENTRY();                                                                                       \
        gemv_q8x_staged<S, G, NR, BPL>(W, row_bytes, X, Y, n_out, n_in);                                   \
    }
#define DEFINE_Q8X_ANY(name, S)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) gemv_q8x_##name##_any(                                   \
        const u8* __restrict__ W, long long row_bytes, const float* __restrict__ X, float* __restrict__ Y,     \
        int n_out, int n_in) {                                                                                 \
        PDL_ENTRY();                                                                                           \
        gemv_q8x_any<S>(W, row_bytes, X, Y, n_out, n_in);                                                      \
    }
FOR_EACH_Q8X_CFG(DEFINE_Q8X, q4_0, Q4_0)
FOR_EACH_Q8X_CFG(DEFINE_Q8X, q8_0, Q8_0)
DEFINE_Q8X_ANY(q4_0, Q4_0)
DEFINE_Q8X_ANY(q8_0, Q8_0)
