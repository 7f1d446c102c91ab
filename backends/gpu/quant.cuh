// Block decoders for every weight format, shared by matmul.cu (GEMV, dequant) and get_rows.cu.
//
// Layouts are graphir/quant.py's (ggml's): little-endian, f16 scales. A row is `row_bytes` bytes
// of consecutive blocks of QK elements. Every format is described by a traits struct so the
// kernels are written once:
//   QK, BB    elements and bytes per block (float formats: a pseudo-block of 8 elements)
//   UPB       units per block: a unit is what one thread loads at once (one 2/4/8/16-byte piece)
//   WPU       8-value words per unit; word w of unit j decodes to two runs of 4 consecutive
//             elements at block offsets o0 and o1 (offs), so x is read with two 16-byte loads
//   FINAL     the values are final per element: float formats (decode gives the values) and
//             AFFINE ones (affine gives codes q and per-run scale s / offset o: value = s*q + o).
//             Otherwise decode gives integer codes and run scales sl/sh multiply the dot products
//             (one multiply per run of 4, not per value).
//   load      only memory reads (kept separate so unrolled loops issue every load before use)
//   prep      header arithmetic, once per unit
// Blocks of 18/22/34/210 bytes are only 2-byte aligned: their fields are read with 16-bit loads.
#ifndef GRAPHIR_QUANT_CUH
#define GRAPHIR_QUANT_CUH

#include "common.cuh"

#define MEMBER __device__ __forceinline__ static  // traits member functions

struct alignas(16) F4 { float a, b, c, d; };
struct alignas(16) U4 { unsigned a, b, c, d; };
struct alignas(8) U2 { unsigned a, b; };

// f16 bits -> f32 in one hardware conversion (common.cuh's integer version takes ~10 ops; scales
// are converted once per unit, but f16 weights once per value). Exact for every f16 value.
#if !defined(__CUDACC__) || defined(__HIPCC__)  // HIP (and plain C++): the compiler's _Float16
DEVICE float h2f(unsigned h) {
    u16 b = (u16)h;
    _Float16 v;
    __builtin_memcpy(&v, &b, 2);
    return (float)v;
}
#else
DEVICE float h2f(unsigned h) {
    float f;
    unsigned short b = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
    return f;
}
#endif

DEVICE unsigned ld16(const u8* p) { return *(const u16*)p; }  // p 2-byte aligned
DEVICE unsigned ld32(const u8* p) { return *(const unsigned*)p; }  // p 4-byte aligned
DEVICE unsigned ld32a2(const u8* p) { return ld16(p) | (ld16(p + 2) << 16); }  // p 2-byte aligned

// Integer -> float without I2F (a quarter-rate instruction on NVIDIA, which would limit 4-bit GEMV
// below memory bandwidth): a field masked in place at bits P.. of the mantissa of 2^23 makes the
// float 2^23 + q*2^P exactly; one FMA scales it back and removes the bias, exactly (all < 2^24).
// (v & mask) | base in ONE instruction: ptxas splits the C expression into two LOP3s (a LOP3 takes
// one immediate), which made the mask the costliest step of 4-bit decoding (2 of ~5 instructions
// per weight); the PTX lop3 with base in a register stays one.
DEVICE unsigned and_or(unsigned v, unsigned mask, unsigned base) {
#if defined(__CUDACC__) && !defined(__HIPCC__)
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(v), "r"(mask), "r"(base));  // 0xEA: (a & b) | c
    return r;
#else
    return (v & mask) | base;  // AMD: one v_and_or_b32
#endif
}

template <int P>
DEVICE float field_f(unsigned v, unsigned mask, float bias) {
    const float f = __uint_as_float(and_or(v, mask << P, 0x4B000000u));
    return fmaf(f, 1.0f / (float)(1u << P), -((float)(1u << (23 - P)) + bias));
}

DEVICE float u2f(unsigned q, float bias) {  // q < 2^23
    return __uint_as_float(0x4B000000u | q) - (8388608.0f + bias);
}

// The 4 bytes of v (each < 256) as floats minus bias, byte 0 first.
DEVICE void bytes4(unsigned v, float bias, float* o) {
    const unsigned h = v >> 16;
    o[0] = field_f<0>(v, 0xFFu, bias);
    o[1] = field_f<8>(v, 0xFFu, bias);
    o[2] = field_f<0>(h, 0xFFu, bias);
    o[3] = field_f<8>(h, 0xFFu, bias);
}

// The 8 nibbles of v: low nibbles of bytes 0..3 into lo, high nibbles into hi, minus bias.
DEVICE void nibs8(unsigned v, float bias, float* lo, float* hi) {
    const unsigned h = v >> 16;
    lo[0] = field_f<0>(v, 0xFu, bias);
    lo[1] = field_f<8>(v, 0xFu, bias);
    lo[2] = field_f<0>(h, 0xFu, bias);
    lo[3] = field_f<8>(h, 0xFu, bias);
    hi[0] = field_f<4>(v, 0xFu, bias);
    hi[1] = field_f<12>(v, 0xFu, bias);
    hi[2] = field_f<4>(h, 0xFu, bias);
    hi[3] = field_f<12>(h, 0xFu, bias);
}

// Bits 0..3 of b moved to bit 0 of bytes 0..3 (the four shifted copies do not overlap: no carries).
DEVICE unsigned spread4(unsigned b) { return ((b & 0xFu) * 0x00204081u) & 0x01010101u; }

// Q4_K / Q5_K 6-bit scale and min of sub-block s from the 12 scale bytes (words s0 s1 s2):
// bytes 0-3 scales 0-3, 4-7 mins 0-3 (low 6 bits); bytes 8-11 the low 4 bits of scales 4-7 (low
// nibble) and mins 4-7 (high nibble), whose top 2 bits are bits 6-7 of bytes 0-7. Branch-free:
// lanes of one warp decode different sub-blocks.
DEVICE void k_scale_min(unsigned s0, unsigned s1, unsigned s2, int s, unsigned& sc, unsigned& mn) {
    const int sh = 8 * (s & 3);
    const unsigned a = (s0 >> sh) & 0xFFu, b = (s1 >> sh) & 0xFFu, c = (s2 >> sh) & 0xFFu;
    const bool low = s < 4;
    sc = low ? (a & 63u) : ((c & 0xFu) | ((a >> 6) << 4));
    mn = low ? (b & 63u) : ((c >> 4) | ((b >> 6) << 4));
}

// IQ4_NL / IQ4_XS code book (graphir/quant.py IQ4_NL_VALUES). Kernels copy it to shared memory:
// 16 words in 16 banks, so a warp's random lookups never conflict (constant memory would serialize).
__constant__ float IQ4NL_TABLE[16] = {-127.f, -104.f, -83.f, -65.f, -49.f, -35.f, -22.f, -10.f,
                                      1.f,    13.f,   25.f,  38.f,  53.f,  69.f,  89.f,  113.f};

// ---------------------------------------------------------------- float formats (pseudo-block of 8)
struct Ff32 {
    static constexpr int QK = 8, BB = 32, UPB = 1, WPU = 1;
    static constexpr bool FINAL = true, AFFINE = false, TABLE = false, FLOAT = true;
    struct U { F4 p, q; };
    MEMBER U load(const u8* blk, int) { U u; u.p = ((const F4*)blk)[0]; u.q = ((const F4*)blk)[1]; return u; }
    MEMBER void prep(U&, int) {}
    MEMBER void offs(int, int, int& o0, int& o1) { o0 = 0; o1 = 4; }
    MEMBER void decode(const U& u, int, int, float* v, float&, float&, const float*) {
        v[0] = u.p.a; v[1] = u.p.b; v[2] = u.p.c; v[3] = u.p.d;
        v[4] = u.q.a; v[5] = u.q.b; v[6] = u.q.c; v[7] = u.q.d;
    }
    MEMBER float elem(const u8* row, int i) { return ((const float*)row)[i]; }
};

struct Ff16 {
    static constexpr int QK = 8, BB = 16, UPB = 1, WPU = 1;
    static constexpr bool FINAL = true, AFFINE = false, TABLE = false, FLOAT = true;
    typedef U4 U;
    MEMBER U load(const u8* blk, int) { return *(const U4*)blk; }
    MEMBER void prep(U&, int) {}
    MEMBER void offs(int, int, int& o0, int& o1) { o0 = 0; o1 = 4; }
    MEMBER void decode(const U& u, int, int, float* v, float&, float&, const float*) {
        v[0] = h2f(u.a & 0xFFFFu); v[1] = h2f(u.a >> 16); v[2] = h2f(u.b & 0xFFFFu); v[3] = h2f(u.b >> 16);
        v[4] = h2f(u.c & 0xFFFFu); v[5] = h2f(u.c >> 16); v[6] = h2f(u.d & 0xFFFFu); v[7] = h2f(u.d >> 16);
    }
    MEMBER float elem(const u8* row, int i) { return h2f(((const u16*)row)[i]); }
};

struct Fbf16 {  // bf16 is the top half of an f32: a shift or a mask per value
    static constexpr int QK = 8, BB = 16, UPB = 1, WPU = 1;
    static constexpr bool FINAL = true, AFFINE = false, TABLE = false, FLOAT = true;
    typedef U4 U;
    MEMBER U load(const u8* blk, int) { return *(const U4*)blk; }
    MEMBER void prep(U&, int) {}
    MEMBER void offs(int, int, int& o0, int& o1) { o0 = 0; o1 = 4; }
    MEMBER void decode(const U& u, int, int, float* v, float&, float&, const float*) {
        v[0] = __uint_as_float(u.a << 16); v[1] = __uint_as_float(u.a & 0xFFFF0000u);
        v[2] = __uint_as_float(u.b << 16); v[3] = __uint_as_float(u.b & 0xFFFF0000u);
        v[4] = __uint_as_float(u.c << 16); v[5] = __uint_as_float(u.c & 0xFFFF0000u);
        v[6] = __uint_as_float(u.d << 16); v[7] = __uint_as_float(u.d & 0xFFFF0000u);
    }
    MEMBER float elem(const u8* row, int i) { return __uint_as_float(((unsigned)((const u16*)row)[i]) << 16); }
};

// ---------------------------------------------------------------- 32-element blocks
// q4_0: d f16 | qs[16]; element i < 16 is the low nibble of qs[i], i >= 16 the high nibble of qs[i-16].
// Value d * (q - 8). Unit j (0..3) = qs bytes 4j..4j+3 -> elements 4j.. (low) and 16+4j.. (high).
struct Fq4_0 {
    static constexpr int QK = 32, BB = 18, UPB = 4, WPU = 1;
    static constexpr bool FINAL = false, AFFINE = false, TABLE = false, FLOAT = false;
    struct U { unsigned q, dh; float d; };
    MEMBER U load(const u8* blk, int j) { U u; u.q = ld32a2(blk + 2 + 4 * j); u.dh = ld16(blk); return u; }
    MEMBER void prep(U& u, int) { u.d = h2f(u.dh); }
    MEMBER void offs(int j, int, int& o0, int& o1) { o0 = 4 * j; o1 = 16 + 4 * j; }
    MEMBER void decode(const U& u, int, int, float* v, float& sl, float& sh, const float*) {
        nibs8(u.q, 8.0f, v, v + 4);
        sl = sh = u.d;
    }
};

// q4_1: d f16 | m f16 | qs[16] (as q4_0). Value d * q + m. 20-byte blocks: 4-byte loads.
struct Fq4_1 {
    static constexpr int QK = 32, BB = 20, UPB = 4, WPU = 1;
    static constexpr bool FINAL = true, AFFINE = true, TABLE = false, FLOAT = false;
    struct U { unsigned q, hdr; float d, m; };
    MEMBER U load(const u8* blk, int j) { U u; u.q = ld32(blk + 4 + 4 * j); u.hdr = ld32(blk); return u; }
    MEMBER void prep(U& u, int) { u.d = h2f(u.hdr & 0xFFFFu); u.m = h2f(u.hdr >> 16); }
    MEMBER void offs(int j, int, int& o0, int& o1) { o0 = 4 * j; o1 = 16 + 4 * j; }
    MEMBER void affine(const U& u, int, int, float* v, float& s0, float& o0, float& s1, float& o1) {
        nibs8(u.q, 0.0f, v, v + 4);
        s0 = s1 = u.d; o0 = o1 = u.m;
    }
};

// q5_0: d f16 | qh u32 | qs[16]; element i: nibble i (as q4_0) | bit i of qh << 4. Value d * (q - 16).
struct Fq5_0 {
    static constexpr int QK = 32, BB = 22, UPB = 4, WPU = 1;
    static constexpr bool FINAL = false, AFFINE = false, TABLE = false, FLOAT = false;
    struct U { unsigned q, qh, dh; float d; };
    MEMBER U load(const u8* blk, int j) {
        U u; u.q = ld32a2(blk + 6 + 4 * j); u.qh = ld32a2(blk + 2); u.dh = ld16(blk); return u;
    }
    MEMBER void prep(U& u, int) { u.d = h2f(u.dh); }
    MEMBER void offs(int j, int, int& o0, int& o1) { o0 = 4 * j; o1 = 16 + 4 * j; }
    MEMBER void decode(const U& u, int j, int, float* v, float& sl, float& sh, const float*) {
        const unsigned lo = (u.q & 0x0F0F0F0Fu) | (spread4(u.qh >> (4 * j)) << 4);
        const unsigned hi = ((u.q >> 4) & 0x0F0F0F0Fu) | (spread4(u.qh >> (16 + 4 * j)) << 4);
        bytes4(lo, 16.0f, v);
        bytes4(hi, 16.0f, v + 4);
        sl = sh = u.d;
    }
};

// q5_1: d f16 | m f16 | qh u32 | qs[16]. Value d * q + m. 24-byte blocks: 4-byte loads.
struct Fq5_1 {
    static constexpr int QK = 32, BB = 24, UPB = 4, WPU = 1;
    static constexpr bool FINAL = true, AFFINE = true, TABLE = false, FLOAT = false;
    struct U { unsigned q, qh, hdr; float d, m; };
    MEMBER U load(const u8* blk, int j) {
        U u; u.q = ld32(blk + 8 + 4 * j); u.qh = ld32(blk + 4); u.hdr = ld32(blk); return u;
    }
    MEMBER void prep(U& u, int) { u.d = h2f(u.hdr & 0xFFFFu); u.m = h2f(u.hdr >> 16); }
    MEMBER void offs(int j, int, int& o0, int& o1) { o0 = 4 * j; o1 = 16 + 4 * j; }
    MEMBER void affine(const U& u, int j, int, float* v, float& s0, float& o0, float& s1, float& o1) {
        const unsigned lo = (u.q & 0x0F0F0F0Fu) | (spread4(u.qh >> (4 * j)) << 4);
        const unsigned hi = ((u.q >> 4) & 0x0F0F0F0Fu) | (spread4(u.qh >> (16 + 4 * j)) << 4);
        bytes4(lo, 0.0f, v);
        bytes4(hi, 0.0f, v + 4);
        s0 = s1 = u.d; o0 = o1 = u.m;
    }
};

// q8_0: d f16 | qs[32] int8. Value d * q. Unit j = bytes 8j..8j+7 (elements 8j.., two runs of 4).
struct Fq8_0 {
    static constexpr int QK = 32, BB = 34, UPB = 4, WPU = 1;
    static constexpr bool FINAL = false, AFFINE = false, TABLE = false, FLOAT = false;
    struct U { unsigned q0, q1, dh; float d; };
    MEMBER U load(const u8* blk, int j) {
        U u; u.q0 = ld32a2(blk + 2 + 8 * j); u.q1 = ld32a2(blk + 6 + 8 * j); u.dh = ld16(blk); return u;
    }
    MEMBER void prep(U& u, int) { u.d = h2f(u.dh); }
    MEMBER void offs(int j, int, int& o0, int& o1) { o0 = 8 * j; o1 = 8 * j + 4; }
    MEMBER void decode(const U& u, int, int, float* v, float& sl, float& sh, const float*) {
        // int8 -> unsigned byte + 128 by flipping the sign bits, then the bias takes 128 back off
        bytes4(u.q0 ^ 0x80808080u, 128.0f, v);
        bytes4(u.q1 ^ 0x80808080u, 128.0f, v + 4);
        sl = sh = u.d;
    }
};

// ---------------------------------------------------------------- 256-element super-blocks
// q4_k: d f16 | dmin f16 | scales[12] | qs[128]. 32-byte chunk c of qs holds sub-block 2c in its
// low nibbles and 2c+1 in its high nibbles. Value d*sc[s] * q - dmin*mn[s].
// Unit j (0..7) = qs bytes 32c + 16t .. +15 (c = j/2, t = j%2), one 16-byte load; word w of it
// gives elements 64c + 16t + 4w.. (sub-block 2c) and 32 further (sub-block 2c+1).
struct Fq4_k {
    static constexpr int QK = 256, BB = 144, UPB = 8, WPU = 4;
    static constexpr bool FINAL = true, AFFINE = true, TABLE = false, FLOAT = false;
    struct U { U4 q; unsigned hdr, s0, s1, s2; float a0, m0, a1, m1; };
    MEMBER U load(const u8* blk, int j) {
        U u;
        u.q = *(const U4*)(blk + 16 + 16 * j);  // 32c + 16t = 16j
        u.hdr = ld32(blk); u.s0 = ld32(blk + 4); u.s1 = ld32(blk + 8); u.s2 = ld32(blk + 12);
        return u;
    }
    MEMBER void prep(U& u, int j) {
        const float d = h2f(u.hdr & 0xFFFFu), dmin = h2f(u.hdr >> 16);
        const int c = j >> 1;
        unsigned sc, mn;
        k_scale_min(u.s0, u.s1, u.s2, 2 * c, sc, mn);
        u.a0 = d * u2f(sc, 0.0f); u.m0 = dmin * u2f(mn, 0.0f);
        k_scale_min(u.s0, u.s1, u.s2, 2 * c + 1, sc, mn);
        u.a1 = d * u2f(sc, 0.0f); u.m1 = dmin * u2f(mn, 0.0f);
    }
    MEMBER void offs(int j, int w, int& o0, int& o1) { o0 = 64 * (j >> 1) + 16 * (j & 1) + 4 * w; o1 = o0 + 32; }
    MEMBER void affine(const U& u, int, int w, float* v, float& s0, float& o0, float& s1, float& o1) {
        const unsigned q = w == 0 ? u.q.a : (w == 1 ? u.q.b : (w == 2 ? u.q.c : u.q.d));
        nibs8(q, 0.0f, v, v + 4);
        s0 = u.a0; o0 = -u.m0; s1 = u.a1; o1 = -u.m1;
    }
};

// q5_k: d | dmin | scales[12] | qh[32] | qs[128]. As q4_k, plus the fifth bit of element l of
// sub-block s is bit s of qh[l]. Unit j (c = j/2, t = j%2): qs bytes 32c + 16t.., qh bytes 16t..
struct Fq5_k {
    static constexpr int QK = 256, BB = 176, UPB = 8, WPU = 4;
    static constexpr bool FINAL = true, AFFINE = true, TABLE = false, FLOAT = false;
    struct U { U4 q, h; unsigned hdr, s0, s1, s2; float a0, m0, a1, m1; };
    MEMBER U load(const u8* blk, int j) {
        U u;
        u.q = *(const U4*)(blk + 48 + 16 * j);
        u.h = *(const U4*)(blk + 16 + 16 * (j & 1));
        u.hdr = ld32(blk); u.s0 = ld32(blk + 4); u.s1 = ld32(blk + 8); u.s2 = ld32(blk + 12);
        return u;
    }
    MEMBER void prep(U& u, int j) { Fq4_k::U t; t.hdr = u.hdr; t.s0 = u.s0; t.s1 = u.s1; t.s2 = u.s2;
        Fq4_k::prep(t, j); u.a0 = t.a0; u.m0 = t.m0; u.a1 = t.a1; u.m1 = t.m1; }
    MEMBER void offs(int j, int w, int& o0, int& o1) { Fq4_k::offs(j, w, o0, o1); }
    MEMBER void affine(const U& u, int j, int w, float* v, float& s0, float& o0, float& s1, float& o1) {
        const unsigned q = w == 0 ? u.q.a : (w == 1 ? u.q.b : (w == 2 ? u.q.c : u.q.d));
        const unsigned h = w == 0 ? u.h.a : (w == 1 ? u.h.b : (w == 2 ? u.h.c : u.h.d));
        const int s = 2 * (j >> 1);  // sub-block of the low nibbles
        const unsigned lo = (q & 0x0F0F0F0Fu) | (((h >> s) & 0x01010101u) << 4);
        const unsigned hi = ((q >> 4) & 0x0F0F0F0Fu) | (((h >> (s + 1)) & 0x01010101u) << 4);
        bytes4(lo, 0.0f, v);
        bytes4(hi, 0.0f, v + 4);
        s0 = u.a0; o0 = -u.m0; s1 = u.a1; o1 = -u.m1;
    }
};

// q6_k: ql[128] | qh[64] | scales[16] int8 | d f16. Per 128-element half h: element e < 64 is the
// low nibble of ql[64h + e], e >= 64 the high nibble of ql[64h + e - 64]; its top 2 bits are bits
// 2*(e/32) of qh[32h + e%32]. Value d * scales[(128h + e)/16] * (q - 32).
// Unit j (h = j/16, t = j%16) = ql bytes 64h + 4t.. -> elements 4t.. (low) and 64 + 4t.. (high).
struct Fq6_k {
    static constexpr int QK = 256, BB = 210, UPB = 32, WPU = 1;
    static constexpr bool FINAL = false, AFFINE = false, TABLE = false, FLOAT = false;
    struct U { unsigned ql, qh, dh; int sc0, sc1; float s0, s1; };
    MEMBER U load(const u8* blk, int j) {
        const int h = j >> 4, t = j & 15;
        U u;
        u.ql = ld32a2(blk + 64 * h + 4 * t);
        u.qh = ld32a2(blk + 128 + 32 * h + 4 * (t & 7));
        u.sc0 = (signed char)blk[192 + 8 * h + (t >> 2)];
        u.sc1 = (signed char)blk[192 + 8 * h + 4 + (t >> 2)];
        u.dh = ld16(blk + 208);
        return u;
    }
    MEMBER void prep(U& u, int) { const float d = h2f(u.dh); u.s0 = d * (float)u.sc0; u.s1 = d * (float)u.sc1; }
    MEMBER void offs(int j, int, int& o0, int& o1) { o0 = 128 * (j >> 4) + 4 * (j & 15); o1 = o0 + 64; }
    MEMBER void decode(const U& u, int j, int, float* v, float& sl, float& sh, const float*) {
        const int g = 2 * ((j & 15) >> 3);  // qh shift of the low-nibble run; the high run is 4 further
        const unsigned lo = (u.ql & 0x0F0F0F0Fu) | (((u.qh >> g) & 0x03030303u) << 4);
        const unsigned hi = ((u.ql >> 4) & 0x0F0F0F0Fu) | (((u.qh >> (g + 4)) & 0x03030303u) << 4);
        bytes4(lo, 32.0f, v);
        bytes4(hi, 32.0f, v + 4);
        sl = u.s0; sh = u.s1;
    }
};

// iq4_xs: d f16 | scales_h u16 | scales_l[4] | qs[128]. Sub-block s (32 elements) has scale
// ls = (4-bit from scales_l[s/2] | 2 bits of scales_h << 4) - 32, and 16 bytes qs[16s..]: element
// l < 16 the low nibble of byte l, l >= 16 the high nibble of byte l-16. Value d*ls*TABLE[q].
// Unit j (s = j/2, t = j%2) = 8 bytes qs[16s + 8t..] (8-byte aligned); word w its 4-byte half.
struct Fiq4_xs {
    static constexpr int QK = 256, BB = 136, UPB = 16, WPU = 2;
    static constexpr bool FINAL = false, AFFINE = false, TABLE = true, FLOAT = false;
    struct U { U2 q; unsigned hdr, sl4; float s; };
    MEMBER U load(const u8* blk, int j) {
        U u; u.q = *(const U2*)(blk + 8 + 8 * j); u.hdr = ld32(blk); u.sl4 = ld32(blk + 4); return u;
    }
    MEMBER void prep(U& u, int j) {
        const int s = j >> 1;
        const unsigned lo = (u.sl4 >> (4 * s)) & 0xFu;  // byte s/2, nibble s%2 = bits 4s..4s+3
        const unsigned hi = ((u.hdr >> 16) >> (2 * s)) & 3u;
        u.s = h2f(u.hdr & 0xFFFFu) * u2f(lo | (hi << 4), 32.0f);
    }
    MEMBER void offs(int j, int w, int& o0, int& o1) { o0 = 32 * (j >> 1) + 8 * (j & 1) + 4 * w; o1 = o0 + 16; }
    MEMBER void decode(const U& u, int, int w, float* v, float& sl, float& sh, const float* tab) {
        const unsigned q = w == 0 ? u.q.a : u.q.b;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[k] = tab[(q >> (8 * k)) & 0xFu];
            v[k + 4] = tab[(q >> (8 * k + 4)) & 0xFu];
        }
        sl = sh = u.s;
    }
};

// ---------------------------------------------------------------- wide-load traits (gemv1v2)
// The same formats read with 16-byte loads where ggml's 18/22/34-byte blocks are only 2-byte
// aligned. One LDG.128 serves 16 bytes where the 16-bit loads above need 8 instructions, and
// the L1 load pipeline (one wavefront per 128-byte line an instruction touches) is what limits a
// GEMV that issues many small loads. Valid only when rows are whole 16-byte pieces and the weight
// is 16-byte aligned (matmul.py checks): then the second window below never passes the row end.

// Bytes p..p+15 (p 2-byte aligned) from the 16-byte windows at p&~15 and, when p is not aligned,
// the next one (which ends at or before the row end: p+16 <= end and end is 16-byte aligned).
DEVICE U4 load16_a2(const u8* p) {
    const unsigned long long a = (unsigned long long)p;
    const U4* b = (const U4*)(a & ~15ull);
    const unsigned off = (unsigned)(a & 15u);
    const U4 x = b[0];
    const U4 y = off ? b[1] : x;
    // words of the 32-byte window: x.a x.b x.c x.d y.a y.b y.c y.d; wanted: words off/4 .. off/4+4,
    // shifted right by (off % 4) bytes. Two select stages (by 8 bytes, then by 4) and a funnel.
    const bool s8 = off & 8, s4 = off & 4;
    const unsigned e0 = s8 ? x.c : x.a, e1 = s8 ? x.d : x.b, e2 = s8 ? y.a : x.c, e3 = s8 ? y.b : x.d,
                   e4 = s8 ? y.c : y.a, e5 = s8 ? y.d : y.b;
    const unsigned f0 = s4 ? e1 : e0, f1 = s4 ? e2 : e1, f2 = s4 ? e3 : e2, f3 = s4 ? e4 : e3, f4 = s4 ? e5 : e4;
    const unsigned sh = (off & 3u) * 8u;  // 0 or 16
    U4 r;
    r.a = (unsigned)((((unsigned long long)f1 << 32) | f0) >> sh);
    r.b = (unsigned)((((unsigned long long)f2 << 32) | f1) >> sh);
    r.c = (unsigned)((((unsigned long long)f3 << 32) | f2) >> sh);
    r.d = (unsigned)((((unsigned long long)f4 << 32) | f3) >> sh);
    return r;
}

DEVICE unsigned word4(const U4& q, int w) { return w == 0 ? q.a : (w == 1 ? q.b : (w == 2 ? q.c : q.d)); }

// q4_0 / q4_1 / q5_0 / q5_1: one unit per block (its 16 qs bytes); word w = qs bytes 4w..4w+3 ->
// elements 4w.. (low nibbles) and 16 + 4w.. (high nibbles).
struct Fq4_0w {
    static constexpr int QK = 32, BB = 18, UPB = 1, WPU = 4;
    static constexpr bool FINAL = false, AFFINE = false, TABLE = false, FLOAT = false;
    struct U { U4 q; unsigned dh; float d; };
    MEMBER U load(const u8* blk, int) { U u; u.q = load16_a2(blk + 2); u.dh = ld16(blk); return u; }
    MEMBER void prep(U& u, int) { u.d = h2f(u.dh); }
    MEMBER void offs(int, int w, int& o0, int& o1) { o0 = 4 * w; o1 = 16 + 4 * w; }
    MEMBER void decode(const U& u, int, int w, float* v, float& sl, float& sh, const float*) {
        nibs8(word4(u.q, w), 8.0f, v, v + 4);
        sl = sh = u.d;
    }
};

struct Fq4_1w {
    static constexpr int QK = 32, BB = 20, UPB = 1, WPU = 4;
    static constexpr bool FINAL = true, AFFINE = true, TABLE = false, FLOAT = false;
    struct U { U4 q; unsigned hdr; float d, m; };
    MEMBER U load(const u8* blk, int) { U u; u.q = load16_a2(blk + 4); u.hdr = ld32(blk); return u; }
    MEMBER void prep(U& u, int) { u.d = h2f(u.hdr & 0xFFFFu); u.m = h2f(u.hdr >> 16); }
    MEMBER void offs(int, int w, int& o0, int& o1) { o0 = 4 * w; o1 = 16 + 4 * w; }
    MEMBER void affine(const U& u, int, int w, float* v, float& s0, float& o0, float& s1, float& o1) {
        nibs8(word4(u.q, w), 0.0f, v, v + 4);
        s0 = s1 = u.d; o0 = o1 = u.m;
    }
};

struct Fq5_0w {
    static constexpr int QK = 32, BB = 22, UPB = 1, WPU = 4;
    static constexpr bool FINAL = false, AFFINE = false, TABLE = false, FLOAT = false;
    struct U { U4 q; unsigned qh, dh; float d; };
    MEMBER U load(const u8* blk, int) {
        U u; u.q = load16_a2(blk + 6); u.qh = ld32a2(blk + 2); u.dh = ld16(blk); return u;
    }
    MEMBER void prep(U& u, int) { u.d = h2f(u.dh); }
    MEMBER void offs(int, int w, int& o0, int& o1) { o0 = 4 * w; o1 = 16 + 4 * w; }
    MEMBER void decode(const U& u, int, int w, float* v, float& sl, float& sh, const float*) {
        const unsigned q = word4(u.q, w);
        const unsigned lo = (q & 0x0F0F0F0Fu) | (spread4(u.qh >> (4 * w)) << 4);
        const unsigned hi = ((q >> 4) & 0x0F0F0F0Fu) | (spread4(u.qh >> (16 + 4 * w)) << 4);
        bytes4(lo, 16.0f, v);
        bytes4(hi, 16.0f, v + 4);
        sl = sh = u.d;
    }
};

struct Fq5_1w {
    static constexpr int QK = 32, BB = 24, UPB = 1, WPU = 4;
    static constexpr bool FINAL = true, AFFINE = true, TABLE = false, FLOAT = false;
    struct U { U4 q; unsigned qh, hdr; float d, m; };
    MEMBER U load(const u8* blk, int) {
        U u; u.q = load16_a2(blk + 8); u.qh = ld32(blk + 4); u.hdr = ld32(blk); return u;
    }
    MEMBER void prep(U& u, int) { u.d = h2f(u.hdr & 0xFFFFu); u.m = h2f(u.hdr >> 16); }
    MEMBER void offs(int, int w, int& o0, int& o1) { o0 = 4 * w; o1 = 16 + 4 * w; }
    MEMBER void affine(const U& u, int, int w, float* v, float& s0, float& o0, float& s1, float& o1) {
        const unsigned q = word4(u.q, w);
        const unsigned lo = (q & 0x0F0F0F0Fu) | (spread4(u.qh >> (4 * w)) << 4);
        const unsigned hi = ((q >> 4) & 0x0F0F0F0Fu) | (spread4(u.qh >> (16 + 4 * w)) << 4);
        bytes4(lo, 0.0f, v);
        bytes4(hi, 0.0f, v + 4);
        s0 = s1 = u.d; o0 = o1 = u.m;
    }
};

// q8_0: two units per block, unit j = qs bytes 16j..16j+15; word w = its bytes 8w..8w+7 ->
// elements 16j + 8w.. (two runs of 4).
struct Fq8_0w {
    static constexpr int QK = 32, BB = 34, UPB = 2, WPU = 2;
    static constexpr bool FINAL = false, AFFINE = false, TABLE = false, FLOAT = false;
    struct U { U4 q; unsigned dh; float d; };
    MEMBER U load(const u8* blk, int j) { U u; u.q = load16_a2(blk + 2 + 16 * j); u.dh = ld16(blk); return u; }
    MEMBER void prep(U& u, int) { u.d = h2f(u.dh); }
    MEMBER void offs(int j, int w, int& o0, int& o1) { o0 = 16 * j + 8 * w; o1 = o0 + 4; }
    MEMBER void decode(const U& u, int, int w, float* v, float& sl, float& sh, const float*) {
        bytes4((w == 0 ? u.q.a : u.q.c) ^ 0x80808080u, 128.0f, v);
        bytes4((w == 0 ? u.q.b : u.q.d) ^ 0x80808080u, 128.0f, v + 4);
        sl = sh = u.d;
    }
};

// q4_k / q5_k with the 16-byte header (d, dmin, 12 scale bytes) in one load (144- and 176-byte
// blocks are 16-byte aligned in an aligned weight).
struct Fq4_kw : Fq4_k {
    MEMBER U load(const u8* blk, int j) {
        U u;
        u.q = *(const U4*)(blk + 16 + 16 * j);
        const U4 h = *(const U4*)blk;
        u.hdr = h.a; u.s0 = h.b; u.s1 = h.c; u.s2 = h.d;
        return u;
    }
};

struct Fq5_kw : Fq5_k {
    MEMBER U load(const u8* blk, int j) {
        U u;
        u.q = *(const U4*)(blk + 48 + 16 * j);
        u.h = *(const U4*)(blk + 16 + 16 * (j & 1));
        const U4 h = *(const U4*)blk;
        u.hdr = h.a; u.s0 = h.b; u.s1 = h.c; u.s2 = h.d;
        return u;
    }
};

// The 8 values of word w for the GEMV: AFFINE formats as one FMA per value (f32-exact within an
// ulp); codes with run scales otherwise.
template <class F>
DEVICE void decode_gemv(const typename F::U& u, int j, int w, float* v, float& sl, float& sh, const float* tab) {
    if constexpr (F::AFFINE) {
        float s0, o0, s1, o1;
        F::affine(u, j, w, v, s0, o0, s1, o1);
#pragma unroll
        for (int k = 0; k < 4; ++k) { v[k] = fmaf(s0, v[k], o0); v[k + 4] = fmaf(s1, v[k + 4], o1); }
    } else {
        F::decode(u, j, w, v, sl, sh, tab);
    }
}

// A product that is never fused with a following add (NVRTC and clang contract a*b+c by default).
DEVICE float mul_nofma(float a, float b) {
#if defined(__CUDACC__) && !defined(__HIPCC__)
    return __fmul_rn(a, b);
#else
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    return a * b;
#endif
}

// The 8 values of word w rounded exactly as graphir/quant.py computes them (a product, then the
// offset added): get_rows and dequant match the reference bit for bit.
template <class F>
DEVICE void decode_exact(const typename F::U& u, int j, int w, float* v, const float* tab) {
    if constexpr (F::AFFINE) {
        float s0, o0, s1, o1;
        F::affine(u, j, w, v, s0, o0, s1, o1);
#pragma unroll
        for (int k = 0; k < 4; ++k) { v[k] = mul_nofma(s0, v[k]) + o0; v[k + 4] = mul_nofma(s1, v[k + 4]) + o1; }
    } else {
        float sl = 1.0f, sh = 1.0f;
        F::decode(u, j, w, v, sl, sh, tab);
        if (!F::FINAL) {
#pragma unroll
            for (int k = 0; k < 4; ++k) { v[k] *= sl; v[k + 4] *= sh; }
        }
    }
}

// Copies the code book to shared memory for formats that need it (call before any decode,
// from every thread of the block, before any thread may return).
template <class F>
DEVICE const float* init_table(float* smem) {
    if (F::TABLE) {
        if (threadIdx.x < 16) smem[threadIdx.x] = IQ4NL_TABLE[threadIdx.x];
        __syncthreads();
    }
    return smem;
}

// ---------------------------------------------------------------- the staged decode GEMVs' shared parts
// (matmul.cu gemv1v3, gemv_q8x.cu)
DEVICE float sum32(float v) {  // sum over the 32-lane group (xor offsets < 32 stay inside it on wave64 too)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += SHFL_XOR(v, o);
    return v;
}

DEVICE unsigned funnel_r(unsigned lo, unsigned hi, unsigned sh) {  // bits sh..sh+31 of hi:lo, sh in 0..32
#if defined(__CUDACC__) && !defined(__HIPCC__)
    unsigned r;
    asm("shf.r.clamp.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(sh));
    return r;
#else
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> sh);
#endif
}

// A 32-lane group's NR weight rows, CB blocks of BB bytes a row at a time: the chunk's aligned 16-byte
// pieces (lane l: pieces l, l + 32, ..) loaded into registers (so the next chunk's loads can be in flight
// while this one is decoded), then stored into the group's rows in shared memory, where lanes decode the
// 2-byte-aligned blocks. Rows past n_out are read as the last row: every thread reaches every barrier, and
// those rows' sums are not stored.
template <int BB, int NR, int CB>
struct RowChunks {
    static constexpr int PIECES = CB * BB / 16, PPL = (PIECES + 31) / 32;  // a row's chunk; pieces per lane
    static_assert(CB * BB % 16 == 0, "chunks are whole 16-byte pieces");
    const u8* row[NR];
    U4 pc[NR][PPL];

    __device__ __forceinline__ RowChunks(const u8* W, long long row_bytes, int row0, int n_out) {
#pragma unroll
        for (int r = 0; r < NR; ++r) row[r] = W + (long long)(row0 + r < n_out ? row0 + r : n_out - 1) * row_bytes;
    }
    // pieces of the chunk that starts at block c0 (rows are whole pieces, so a short last chunk is too)
    MEMBER int pieces(int c0, int nb) { return ((nb - c0 < CB ? nb - c0 : CB) * BB + 15) / 16; }
    __device__ __forceinline__ void load(int c0, int nb, int lane) {
        const int npc = pieces(c0, nb);
#pragma unroll
        for (int r = 0; r < NR; ++r)
#pragma unroll
            for (int p = 0; p < PPL; ++p)
                if (lane + 32 * p < npc) pc[r][p] = ((const U4*)(row[r] + (long long)c0 * BB))[lane + 32 * p];
    }
    __device__ __forceinline__ void store(U4 (*ws)[PIECES], int npc, int lane) const {
#pragma unroll
        for (int r = 0; r < NR; ++r)
#pragma unroll
            for (int p = 0; p < PPL; ++p)
                if (lane + 32 * p < npc) ws[r][lane + 32 * p] = pc[r][p];
    }
};

// X-macro of every format: name and traits struct.
#define FOR_EACH_QUANT(M) \
    M(q4_0, Fq4_0) M(q4_1, Fq4_1) M(q5_0, Fq5_0) M(q5_1, Fq5_1) M(q8_0, Fq8_0) \
    M(q4_k, Fq4_k) M(q5_k, Fq5_k) M(q6_k, Fq6_k) M(iq4_xs, Fiq4_xs)
#define FOR_EACH_FLOAT(M) M(f32, Ff32) M(f16, Ff16) M(bf16, Fbf16)
// gemv1v2: every format with the traits it reads fastest with (wide loads where they differ).
// In two halves, compiled in separate parts of matmul.cu (common.cuh IN_PART).
#define FOR_EACH_WIDE_A(M) M(q4_0, Fq4_0w) M(q4_1, Fq4_1w) M(q5_0, Fq5_0w) M(q5_1, Fq5_1w) M(q8_0, Fq8_0w)
#define FOR_EACH_WIDE_B(M) \
    M(q4_k, Fq4_kw) M(q5_k, Fq5_kw) M(q6_k, Fq6_k) M(iq4_xs, Fiq4_xs) M(f32, Ff32) M(f16, Ff16) M(bf16, Fbf16)
#define FOR_EACH_WIDE(M) FOR_EACH_WIDE_A(M) FOR_EACH_WIDE_B(M)

#endif  // GRAPHIR_QUANT_CUH
