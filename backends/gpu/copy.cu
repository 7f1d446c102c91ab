// Data movement: strided gathers (views, permutes, casts, and assign's State copy) and concat.
// Types: f32, f16 (u16 bits), i32. (set_rows, the KV cache row write, is in rope.cu beside the roped
// K writes it is launched with.)
#include "common.cuh"

DEVICE float load_f32(const float* p, long long i) { return p[i]; }
DEVICE float load_f16(const u16* p, long long i) { return f16_to_f32(p[i]); }
DEVICE float load_i32(const int* p, long long i) { return (float)p[i]; }
DEVICE float to_f32(float v) { return v; }
DEVICE int to_i32(float v) { return (int)v; }  // C truncation toward zero, as numpy's astype

// dst[i] = convert(src[offset + sum_k idx_k(i) * s_k]) over the contiguous dst of shape [d0..d5]:
// materializes a view, permute or transpose, and casts (the same gather with the identity layout).
#define DEFINE_COPY(name, S, D, LOAD, STORE)                                                                     \
    extern "C" __global__ void name(const S* __restrict__ src, D* __restrict__ dst, long long n, long long offset, \
                                    int d1, int d2, int d3, int d4, int d5, long long s0, long long s1,          \
                                    long long s2, long long s3, long long s4, long long s5) {                    \
        PDL_ENTRY();                                                                                             \
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;                              \
             i += (long long)gridDim.x * blockDim.x) {                                                           \
            long long r = i;                                                                                     \
            long long at = offset;                                                                               \
            at += (r % d5) * s5; r /= d5;                                                                        \
            at += (r % d4) * s4; r /= d4;                                                                        \
            at += (r % d3) * s3; r /= d3;                                                                        \
            at += (r % d2) * s2; r /= d2;                                                                        \
            at += (r % d1) * s1; r /= d1;                                                                        \
            at += r * s0;                                                                                        \
            dst[i] = STORE(LOAD(src, at));                                                                       \
        }                                                                                                        \
    }

// Same-type copies move the bits untouched (f16 NaN payloads, i32 beyond 2^24).
DEVICE float load_bits_f32(const float* p, long long i) { return p[i]; }
DEVICE u16 load_bits_u16(const u16* p, long long i) { return p[i]; }
DEVICE int load_bits_i32(const int* p, long long i) { return p[i]; }
DEVICE float keep_f(float v) { return v; }
DEVICE u16 keep_u16(u16 v) { return v; }
DEVICE int keep_i(int v) { return v; }

DEFINE_COPY(copy_f32_f32, float, float, load_bits_f32, keep_f)
DEFINE_COPY(copy_f16_f16, u16, u16, load_bits_u16, keep_u16)
DEFINE_COPY(copy_i32_i32, int, int, load_bits_i32, keep_i)
DEFINE_COPY(copy_f32_f16, float, u16, load_f32, f32_to_f16)
DEFINE_COPY(copy_f32_i32, float, int, load_f32, to_i32)
DEFINE_COPY(copy_f16_f32, u16, float, load_f16, to_f32)
DEFINE_COPY(copy_f16_i32, u16, int, load_f16, to_i32)
DEFINE_COPY(copy_i32_f32, int, float, load_i32, to_f32)
DEFINE_COPY(copy_i32_f16, int, u16, load_i32, f32_to_f16)

// y [outer, na + nb, inner] = concat(a [outer, na, inner], b [outer, nb, inner]) along the middle axis
#define DEFINE_CONCAT(name, T)                                                                                   \
    extern "C" __global__ void name(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ y,         \
                                    long long n, int na, int nb, int inner) {                                    \
        PDL_ENTRY();                                                                                             \
        const int nab = na + nb;                                                                                 \
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;                              \
             i += (long long)gridDim.x * blockDim.x) {                                                           \
            const int c = (int)(i % inner);                                                                      \
            const int j = (int)((i / inner) % nab);                                                              \
            const long long o = i / ((long long)inner * nab);                                                    \
            y[i] = j < na ? a[(o * na + j) * inner + c] : b[(o * nb + (j - na)) * inner + c];                    \
        }                                                                                                        \
    }

DEFINE_CONCAT(concat_b4, unsigned int)
DEFINE_CONCAT(concat_b2, u16)

