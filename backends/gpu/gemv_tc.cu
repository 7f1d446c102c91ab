// The m == 1 decode GEMV of q4_0 weights on tensor cores (gemv_tc.py lowers to it; CUDA sm_80+).
//
// Why: the f32 kernel (matmul.cu gemv1v3_q4_0) spends ~3 instructions a 4-bit weight (mask, bias, multiply-add)
// plus shared-memory staging of 18-byte blocks, and on an H200 that arithmetic, not DRAM, sets its speed: the
// Qwen3-8B q4_0 step's GEMVs took ~1,925 us where their loads alone took ~1,170 (BENCHMARKS.md, seventeenth
// session). Here a weight's codes cost ~1.1 instructions (~2 with x's conversion, the B operands' selects and the
// per-block scales): a 32-bit word of 8 codes becomes four f16 pairs with a mask-or (the code as the low mantissa
// bits of 1024) and one f16x2 subtract or multiply-add that leaves the exact value q - 8; mma.sync m16n8k16
// multiplies 16 rows x 16 of them by x and sums in f32. Measured (H200, 2026-12-03, BENCHMARKS.md nineteenth
// session): these GEMVs 15-40 % faster than the f32 kernel at Qwen3-8B's shapes, its captured q4_0 step 3.5 %
// (2,629 -> 2,539 us): with the arithmetic this low, bytes in flight and per-kernel fixed costs hold it.
//
// x keeps f32 accuracy: each x block of 32 is scaled by a power of two (its largest |x| lands in [2^14, 2^15),
// so no f16 overflow or subnormal), then split into hi = f16(x) and lo = f16(x - hi); the mma's column 2j
// carries block j's hi and column 2j+1 its lo, so one mma sums both and x is represented to ~22 bits
// (|x - hi - lo| <= 2^-22 |x| plus 2^-25 of the block's scale). Products of codes and halves are exact and
// summed in f32 by the tensor core; the block scale d * 2^-e is applied per 32 values in f32.
//
// Weight layout (repacked once per weight store by repack_q4_0_tc, from ggml q4_0 rows): row tiles of 16 rows,
// groups of 4 blocks (128 columns). Per (tile, group): 32 lanes x 8 code words (two 16-byte loads a lane, the
// warp's 1 KiB contiguous) and 32 scale words (lane g,t: d of rows g and g+8 for the group's block t, f16
// pair). Code word (j, s) of lane (g = lane / 4, t = lane % 4) holds block j's elements e = 8t + 4s + {0..3}
// of rows g and g+8, nibbles in the order the dequant below emits mma A registers:
//   n0 (g, e0)  n1 (g+8, e0)  n2 (g, e0+2)  n3 (g+8, e0+2)  n4 (g, e0+1)  n5 (g+8, e0+1)  n6 (g, e0+3)  n7 (g+8, e0+3)
// with e0 = 8t + 4s. That order of a block's elements inside the mma's k (any order is a dot product's) makes
// each lane's x the 8 consecutive values 8t..8t+7 of its block: two 16-byte loads. Padding rows and blocks
// have code 0 and scale 0 (and x 0), so they add exactly 0.
//
// mma.m16n8k16 fragments (PTX ISA; g = lane / 4, t = lane % 4; low half first):
//   A (16x16, row): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B (16x8, col):  b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
//   C (16x8 f32):   c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1)
// So lane (g, t) supplies x of block g / 2 (hi if g is even, lo if odd) and zeros for the group's other three
// blocks; after the group's 8 mma (4 blocks x 2 k-halves, one f32 chain), lane (g, t) holds block t's hi and lo
// sums of rows g and g+8, and scales them by that block's d. The warps of a block split the groups (split-K)
// and add their rows through shared memory.
//
// HIP and GPUs before sm_80: the file compiles to nothing and gemv_tc.py keeps the f32 kernel. The tests also build
// it for the host (tests/_host_emulation.py), with the PTX helpers replaced by an emulation of their warp semantics.
#include "common.cuh"

#ifndef GEMV_TC_PREFETCH
// Groups a warp loads ahead of the one it multiplies (codes, scales and x). H200, 2026-12-03, bench_gpu_gemv.py --tc
// (% of copy bandwidth at 4096x4096 / 12288x4096 / 4096x12288 / 151936x4096, each shape's best geometry): depth 1
// 40.5 / 62.5 / 63.2 / 93.6, depth 2 (80-127 registers) 37.0 / 58.6 / 59.4 / 87.6.
// Bulk copies instead (cp.async.bulk of whole 8-group chunks into a ring of shared-memory slots, a producer warp,
// mbarrier waits; 38-48 registers, the first 36 KiB of every tile requested at once) were slower at every shape:
// 32.7 / 43.9 / 48.7 / 65.7 % for 8 consumer warps against t1w8's 38.8 / 54.8 / 54.2 / 69.4, and Qwen3-0.6B
// q4_0's captured step 782-832 us against 712 (BENCHMARKS.md, twenty-fourth session): bytes in flight are not
// what holds the 4,096-row products.
#define GEMV_TC_PREFETCH 1
#endif


#if !defined(__HIPCC__) && ((defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800) || defined(GEMV_TC_HOST))
// GEMV_TC_HOST: the host build of tests/test_gpu_gemv_tc.py, which defines these six helpers itself.
#ifndef GEMV_TC_HOST
DEVICE void mma_f16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

DEVICE unsigned sub_f16x2(unsigned a, unsigned b) {
    unsigned d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

DEVICE unsigned fma_f16x2(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

DEVICE unsigned pack_f16x2(float lo, float hi) {  // round each to f16; lo in the low half
    unsigned d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

DEVICE float f16_lo(unsigned h2) {
    float f;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l; }" : "=f"(f) : "r"(h2));
    return f;
}

DEVICE float f16_hi(unsigned h2) {
    float f;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "r"(h2));
    return f;
}
#endif  // GEMV_TC_HOST

// Code word -> the four A registers, each an f16 pair of exact values q - 8 (layout above).
DEVICE void codes_f16(unsigned w, unsigned (&a)[4]) {
    const unsigned k1032 = 0x64086408u;               // (1032, 1032)
    const unsigned k16th = 0x2C002C00u;               // (1/16, 1/16)
    const unsigned km72 = 0xD480D480u;                // (-72, -72)
    const unsigned w8 = w >> 8;
    a[0] = sub_f16x2((w & 0x000F000Fu) | 0x64006400u, k1032);         // 1024 + q - 1032
    a[1] = fma_f16x2((w & 0x00F000F0u) | 0x64006400u, k16th, km72);   // (1024 + 16 q) / 16 - 72
    a[2] = sub_f16x2((w8 & 0x000F000Fu) | 0x64006400u, k1032);
    a[3] = fma_f16x2((w8 & 0x00F000F0u) | 0x64006400u, k16th, km72);
}

// Lane's x for one group: its block's 8 values, scaled, as this lane's column (hi or lo) of the B fragment
// (b[s][0..1] for k-half s), and 2^e of the block that this lane's C columns belong to (block t).
struct XGroup {
    f32x4 v0, v1;
};

DEVICE void load_x(XGroup& x, const float* __restrict__ X, int blk, int nb, int t) {
    if (blk < nb) {
        const f32x4* p = reinterpret_cast<const f32x4*>(X + (long long)blk * 32 + 8 * t);
        x.v0 = p[0];
        x.v1 = p[1];
    } else {
        x.v0 = f32x4{0.0f, 0.0f, 0.0f, 0.0f};
        x.v1 = x.v0;
    }
}

DEVICE void x_fragment(const XGroup& x, bool lo, unsigned (&b)[2][2], float& unscale, int t) {
    float v[8] = {x.v0.x, x.v0.y, x.v0.z, x.v0.w, x.v1.x, x.v1.y, x.v1.z, x.v1.w};
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(v[i]));
    m = fmaxf(m, SHFL_XOR(m, 1));  // the block's 32 values are on lanes 4g..4g+3
    m = fmaxf(m, SHFL_XOR(m, 2));
    // 2^(141 - E) puts the largest |x| (biased exponent E) in [2^14, 2^15); clamped for zero and tiny blocks.
    const int e = min(268 - (int)((__float_as_uint(m) >> 23) & 0xFFu), 254);
    const float scale = __uint_as_float((unsigned)e << 23);
    const float back = __uint_as_float((unsigned)(254 - e) << 23);  // 2^-(e-127); 0 for the clamped tiny blocks
#pragma unroll
    for (int s = 0; s < 2; ++s) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float y0 = v[4 * s + 2 * h] * scale, y1 = v[4 * s + 2 * h + 1] * scale;
            const unsigned hi = pack_f16x2(y0, y1);
            b[s][h] = lo ? pack_f16x2(y0 - f16_lo(hi), y1 - f16_hi(hi)) : hi;
        }
    }
    unscale = __shfl_sync(0xffffffffu, back, 8 * t);  // block t's factor, from lane (g = 2t, 0)
}

template <int T>
struct Loads {
    u32x4 c0[T], c1[T];  // code words 0..3 and 4..7 of each tile
    unsigned sc[T];      // scale pair of each tile
    XGroup x;
};

template <int T>
DEVICE void load_group(Loads<T>& L, const u32x4* __restrict__ C, const unsigned* __restrict__ S,
                       const float* __restrict__ X, int tile0, int stride, int n_tiles, int grp, int n_groups, int nb,
                       int lane) {
#pragma unroll
    for (int i = 0; i < T; ++i) {
        const int tile = min(tile0 + i * stride, n_tiles - 1);  // tiles past the end: read the last one, never stored
        const long long at = ((long long)tile * n_groups + grp) * 32 + lane;
        L.c0[i] = C[2 * at];
        L.c1[i] = C[2 * at + 1];
        L.sc[i] = S[at];
    }
    load_x(L.x, X, grp * 4 + ((lane >> 2) >> 1), nb, lane & 3);
}

// One group: x fragments, then per tile the 8 mma and the block scales.
template <int T>
DEVICE void multiply_group(const Loads<T>& L, float (&acc)[T][2], int lane) {
    const int g = lane >> 2, t = lane & 3, jx = g >> 1;
    unsigned bx[2][2];
    float unscale;
    x_fragment(L.x, g & 1, bx, unscale, t);
#pragma unroll
    for (int i = 0; i < T; ++i) {
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const unsigned words[8] = {L.c0[i].x, L.c0[i].y, L.c0[i].z, L.c0[i].w,
                                   L.c1[i].x, L.c1[i].y, L.c1[i].z, L.c1[i].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                unsigned a[4];
                codes_f16(words[2 * j + s], a);
                const bool mine = jx == j;
                mma_f16(c, a, mine ? bx[s][0] : 0u, mine ? bx[s][1] : 0u);
            }
        }
        const float dg = f16_lo(L.sc[i]) * unscale, dg8 = f16_hi(L.sc[i]) * unscale;
        acc[i][0] = fmaf(dg, c[0] + c[1], acc[i][0]);
        acc[i][1] = fmaf(dg8, c[2] + c[3], acc[i][1]);
    }
}

// T row tiles (16 rows each) a block, W warps splitting the groups; Y[row] for rows of the block's tiles.
// SW (mul_mat_swiglu; T == 2): the weight holds 2 n_out rows, gate rows then up rows (n_out % 16 == 0); the block's
// tiles are gate tile bx and up tile bx + n_out / 16, and Y[row] = silu(gate) * up in elementwise.cu's
// swiglu_halves_f32 expression. A row's sum depends only on W (each tile's groups run in the same warps and order
// whatever T and the tile's partner are), so the fused rows equal t<T'>w<W>'s product then swiglu_halves_f32 bit for
// bit; the swiglu launch goes.
template <int T, int W, bool SW = false>
DEVICE void gemv_tc_q4_0(const u32x4* __restrict__ C, const unsigned* __restrict__ S, const float* __restrict__ X,
                         float* __restrict__ Y, int n_out, int n_in, int n_groups, int bx) {
    static_assert(!SW || T == 2, "a swiglu block holds a gate tile and its up tile");
    __shared__ float part[W][T * 16];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_tiles = SW ? 2 * (n_out / 16) : (n_out + 15) / 16, tile0 = SW ? bx : bx * T, nb = n_in / 32;
    const int stride = SW ? n_out / 16 : 1;
    float acc[T][2];
#pragma unroll
    for (int i = 0; i < T; ++i) acc[i][0] = acc[i][1] = 0.0f;
    // A ring of D + 1 groups' loads: the one multiplied and the D loaded ahead of it (D = GEMV_TC_PREFETCH).
    constexpr int D = GEMV_TC_PREFETCH;
    Loads<T> buf[D + 1];
#pragma unroll
    for (int k = 0; k < D; ++k)
        if (warp + k * W < n_groups)
            load_group<T>(buf[k], C, S, X, tile0, stride, n_tiles, warp + k * W, n_groups, nb, lane);
    for (int grp = warp; grp < n_groups; grp += (D + 1) * W) {
#pragma unroll
        for (int k = 0; k <= D; ++k) {
            const int gk = grp + k * W;
            if (gk < n_groups) {
                if (gk + D * W < n_groups)
                    load_group<T>(buf[(k + D) % (D + 1)], C, S, X, tile0, stride, n_tiles, gk + D * W, n_groups, nb,
                                  lane);
                multiply_group<T>(buf[k], acc, lane);
            }
        }
    }
    const int g = lane >> 2;
#pragma unroll
    for (int i = 0; i < T; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float v = acc[i][h];
            v += SHFL_XOR(v, 1);  // block positions t = 0..3 of the same rows
            v += SHFL_XOR(v, 2);
            if ((lane & 3) == 0) part[warp][16 * i + g + 8 * h] = v;
        }
    }
    __syncthreads();
    if (SW && threadIdx.x < 16) {
        float gate = 0.0f, up = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) gate += part[w][threadIdx.x];
#pragma unroll
        for (int w = 0; w < W; ++w) up += part[w][16 + threadIdx.x];
        Y[bx * 16 + threadIdx.x] = gate / (1.0f + expf(-gate)) * up;
    } else if (!SW && threadIdx.x < T * 16) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) s += part[w][threadIdx.x];
        const int row = tile0 * 16 + threadIdx.x;
        if (row < n_out) Y[row] = s;
    }
}

// gemv_tc_q4_0_t<T>w<W>: gemv_tc.py GEOMETRIES mirrors the list.
#define FOR_EACH_GEMV_TC(M) M(1, 4) M(1, 8) M(1, 16) M(2, 4) M(2, 8) M(2, 16) M(4, 4)
#define DEFINE_GEMV_TC(T, W)                                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * W) gemv_tc_q4_0_t##T##w##W(                                 \
        const u32x4* __restrict__ C, const unsigned* __restrict__ S, const float* __restrict__ X,                 \
        float* __restrict__ Y, int n_out, int n_in, int n_groups, int m) {                                        \
        PDL_ENTRY();                                                                                              \
        GEMV1_TOKEN_BLOCK();                                                                                      \
        gemv_tc_q4_0<T, W>(C, S, X, Y, n_out, n_in, n_groups, bx);                                                \
    }
FOR_EACH_GEMV_TC(DEFINE_GEMV_TC)

// gemv_tc_sw_q4_0_t2w<W>: mul_mat_swiglu's fused kernel (SW above); n_out is the half (gate rows = up rows = Y's row).
#define FOR_EACH_GEMV_TC_SW(M) M(4) M(8) M(16)
#define DEFINE_GEMV_TC_SW(W)                                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * W) gemv_tc_sw_q4_0_t2w##W(                                  \
        const u32x4* __restrict__ C, const unsigned* __restrict__ S, const float* __restrict__ X,                 \
        float* __restrict__ Y, int n_out, int n_in, int n_groups, int m) {                                        \
        PDL_ENTRY();                                                                                              \
        GEMV1_TOKEN_BLOCK();                                                                                      \
        gemv_tc_q4_0<2, W, true>(C, S, X, Y, n_out, n_in, n_groups, bx);                                          \
    }
FOR_EACH_GEMV_TC_SW(DEFINE_GEMV_TC_SW)

// ggml q4_0 rows (18-byte blocks: f16 d, then 16 bytes: element i's code in the low nibble of byte i, element
// i + 16's in the high nibble) -> the layout above. One thread per (tile, group, lane): 8 code words, 1 scale word.
DEVICE unsigned q4_0_code(const u8* __restrict__ W, long long row_bytes, int row, int blk, int e, int n_out, int nb) {
    if (row >= n_out || blk >= nb) return 0u;
    const u8* q = W + row * row_bytes + blk * 18 + 2;
    return e < 16 ? (q[e] & 0xFu) : (q[e - 16] >> 4);
}

DEVICE unsigned q4_0_scale(const u8* __restrict__ W, long long row_bytes, int row, int blk, int n_out, int nb) {
    if (row >= n_out || blk >= nb) return 0u;
    const u8* p = W + row * row_bytes + blk * 18;
    return (unsigned)p[0] | ((unsigned)p[1] << 8);
}

extern "C" __global__ void repack_q4_0_tc(const u8* __restrict__ W, long long row_bytes, unsigned* __restrict__ C,
                                          unsigned* __restrict__ S, int n_out, int n_in, int n_groups) {
    PDL_ENTRY();  // launched once at lowering, outside any graph: a no-op there
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int n_tiles = (n_out + 15) / 16, nb = n_in / 32;
    if (id >= (long long)n_tiles * n_groups * 32) return;
    const int lane = (int)(id % 32), grp = (int)((id / 32) % n_groups), tile = (int)(id / 32 / n_groups);
    const int g = lane >> 2, t = lane & 3, r0 = tile * 16 + g, r1 = r0 + 8;
    // nibble slot k of a word -> (row, element offset from e0), as codes_f16 reads them
    const int slot_row8[8] = {0, 1, 0, 1, 0, 1, 0, 1};
    const int slot_off[8] = {0, 0, 2, 2, 1, 1, 3, 3};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int blk = grp * 4 + j;
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const int e0 = 8 * t + 4 * s;
            unsigned w = 0u;
#pragma unroll
            for (int k = 0; k < 8; ++k)
                w |= q4_0_code(W, row_bytes, slot_row8[k] ? r1 : r0, blk, e0 + slot_off[k], n_out, nb) << (4 * k);
            C[id * 8 + 2 * j + s] = w;
        }
    }
    const int blk = grp * 4 + t;
    S[id] = q4_0_scale(W, row_bytes, r0, blk, n_out, nb) | (q4_0_scale(W, row_bytes, r1, blk, n_out, nb) << 16);
}

#endif  // CUDA sm_80+ (or the host build)
