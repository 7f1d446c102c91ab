// Elementwise ops over f32: binary ops with broadcasting, unary activations, scale, swiglu.
// Every kernel is a grid-stride loop over the output's elements, so any size works with any grid.
#include "common.cuh"

#define GRID_STRIDE(i, n) for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
                               i += (long long)gridDim.x * blockDim.x)

// y = a OP b, where b is broadcast onto a. a is contiguous with its shape collapsed (on the host) to
// [d0, d1, d2, d3]; b is read at i0*s0 + i1*s1 + i2*s2 + i3*s3 (stride 0 on broadcast axes).
#define DEFINE_BINARY(name, expr)                                                                     \
    extern "C" __global__ void binary_##name(const float* __restrict__ a, const float* __restrict__ b, \
                                             float* __restrict__ y, long long n, int d1, int d2, int d3, \
                                             int s0, int s1, int s2, int s3) {                        \
        PDL_ENTRY();                                                                                  \
        GRID_STRIDE(i, n) {                                                                           \
            long long r = i;                                                                          \
            const int i3 = (int)(r % d3); r /= d3;                                                    \
            const int i2 = (int)(r % d2); r /= d2;                                                    \
            const int i1 = (int)(r % d1);                                                             \
            const long long i0 = r / d1;                                                              \
            const float x = a[i];                                                                     \
            const float z = b[i0 * s0 + (long long)i1 * s1 + (long long)i2 * s2 + (long long)i3 * s3]; \
            y[i] = (expr);                                                                            \
        }                                                                                             \
    }

DEFINE_BINARY(add, x + z)
DEFINE_BINARY(sub, x - z)
DEFINE_BINARY(mul, x * z)
DEFINE_BINARY(div, x / z)

DEVICE float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// tanh-approximated gelu, as the op table defines it
DEVICE float gelu_f(float x) {
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

// log(1 + e^x) = max(x, 0) + log1p(e^-|x|): never overflows (numpy's logaddexp(0, x))
DEVICE float softplus_f(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }

#define DEFINE_UNARY(name, expr)                                                                          \
    extern "C" __global__ void unary_##name(const float* __restrict__ in, float* __restrict__ y, long long n) { \
        PDL_ENTRY();                                                                                            \
        GRID_STRIDE(i, n) {                                                                               \
            const float x = in[i];                                                                        \
            y[i] = (expr);                                                                                \
        }                                                                                                 \
    }

DEFINE_UNARY(neg, -x)
DEFINE_UNARY(exp, expf(x))
DEFINE_UNARY(silu, x / (1.0f + expf(-x)))  // e^-x = inf for very negative x gives -0, the right limit
DEFINE_UNARY(gelu, gelu_f(x))
DEFINE_UNARY(sigmoid, sigmoid_f(x))
DEFINE_UNARY(softplus, softplus_f(x))

// y = a * sigmoid(b) for a (contiguous) and b of the same shape, b read in place as a row-strided
// view: row r = (i0, i1) of b starts at b + i0 * s0 + i1 * s1, its `cols` elements contiguous
// (Qwen3.5's gate half of the q projection, interleaved per head with q). The same expression as
// unary_sigmoid then binary_mul, so it equals them bit for bit.
extern "C" __global__ void mul_sigmoid_f32(const float* __restrict__ a, const float* __restrict__ b,
                                           float* __restrict__ y, long long n, int cols, int d1, long long s0,
                                           long long s1) {
    PDL_ENTRY();
    GRID_STRIDE(i, n) {
        const long long r = i / cols;
        const int c = (int)(i - r * cols);
        const long long i0 = r / d1, i1 = r - i0 * d1;
        y[i] = a[i] * sigmoid_f(b[i0 * s0 + i1 * s1 + c]);
    }
}

extern "C" __global__ void scale_f32(const float* __restrict__ in, float* __restrict__ y, long long n, float s,
                                     float b) {
    PDL_ENTRY();
    GRID_STRIDE(i, n) y[i] = in[i] * s + b;
}

// mul_mat_swiglu's activation over the stacked product gu [rows, 2 * half]: the same expression as
// swiglu_split_f32 (and matmul.cu's gemv1sw_ kernels) with a at gu[t, c] and b at gu[t, half + c].
extern "C" __global__ void swiglu_halves_f32(const float* __restrict__ gu, float* __restrict__ y, long long n,
                                             int half) {
    PDL_ENTRY();
    GRID_STRIDE(i, n) {
        const long long t = i / half, c = i - t * half;
        const float x = gu[2 * half * t + c];
        y[i] = x / (1.0f + expf(-x)) * gu[2 * half * t + half + c];
    }
}

extern "C" __global__ void swiglu_split_f32(const float* __restrict__ a, const float* __restrict__ b,
                                            float* __restrict__ y, long long n) {
    PDL_ENTRY();
    GRID_STRIDE(i, n) {
        const float x = a[i];
        y[i] = x / (1.0f + expf(-x)) * b[i];
    }
}

// The same with 16-byte accesses (a, b, y 16-byte aligned; the last n % 4 values one a thread): a prefill's
// [4096, 12288] halves reached ~60 % of copy bandwidth with one float a thread (H200, 2026-12-01).
// swiglu_split_v4_bf16 stores y as bf16 bits (8-byte aligned): the bf16 twin a prefill GEMM reads
// (matmul.py bf16_twin), f32_to_bf16 of the values the f32 kernel stores.
DEVICE float silu_mul(float x, float u) { return x / (1.0f + expf(-x)) * u; }
DEVICE f32x4 silu_mul4(f32x4 x, f32x4 u) {
    return f32x4{silu_mul(x.x, u.x), silu_mul(x.y, u.y), silu_mul(x.z, u.z), silu_mul(x.w, u.w)};
}
DEVICE void store4(float* y, long long i, f32x4 v) { ((f32x4*)y)[i] = v; }
DEVICE void store4(u16* y, long long i, f32x4 v) {
    ((u16x4*)y)[i] = u16x4{f32_to_bf16(v.x), f32_to_bf16(v.y), f32_to_bf16(v.z), f32_to_bf16(v.w)};
}
DEVICE void store1(float* y, long long i, float v) { y[i] = v; }
DEVICE void store1(u16* y, long long i, float v) { y[i] = f32_to_bf16(v); }

template <typename OUT>
DEVICE void swiglu_split_v4(const float* __restrict__ a, const float* __restrict__ b, OUT* __restrict__ y, long long n) {
    const long long n4 = n / 4, first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long i = first; i < n4; i += (long long)gridDim.x * blockDim.x) {
        const f32x4 x = ((const f32x4*)a)[i], u = ((const f32x4*)b)[i];
        store4(y, i, silu_mul4(x, u));
    }
    if (first < n - 4 * n4) store1(y, 4 * n4 + first, silu_mul(a[4 * n4 + first], b[4 * n4 + first]));
}
// The kernels over contiguous halves: NAME_<f32|bf16> writing y as OUT from a and b read as IN by BODY<OUT>.
#define DEFINE_SWIGLU_SPLIT(name, body, IN, OUT)                                                          \
    extern "C" __global__ void name(const IN* __restrict__ a, const IN* __restrict__ b, OUT* __restrict__ y, \
                                    long long n) {                                                         \
        PDL_ENTRY();                                                                                       \
        body<OUT>(a, b, y, n);                                                                             \
    }
DEFINE_SWIGLU_SPLIT(swiglu_split_v4_f32, swiglu_split_v4, float, float)
DEFINE_SWIGLU_SPLIT(swiglu_split_v4_bf16, swiglu_split_v4, float, u16)

// The same over gate and up stored as bf16 (mul_mat_bf16_rounded's products, held in the first half of their f32
// slots: matmul.py bf16_stored): 16-byte loads of 8 values each (a, b 16-byte aligned: memplan's 64-byte slots; y
// 16-byte aligned as f32, as bf16), the last n % 8 values one a thread. The values are the ops' exact results (bf16
// values), widened, so y is what the f32 kernels compute from them.
DEVICE float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
DEVICE float bf16_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }
DEVICE void silu_mul8(const u32x4 x, const u32x4 u, f32x4& lo, f32x4& hi) {
    lo = silu_mul4(f32x4{bf16_lo(x.x), bf16_hi(x.x), bf16_lo(x.y), bf16_hi(x.y)},
                   f32x4{bf16_lo(u.x), bf16_hi(u.x), bf16_lo(u.y), bf16_hi(u.y)});
    hi = silu_mul4(f32x4{bf16_lo(x.z), bf16_hi(x.z), bf16_lo(x.w), bf16_hi(x.w)},
                   f32x4{bf16_lo(u.z), bf16_hi(u.z), bf16_lo(u.w), bf16_hi(u.w)});
}
template <typename OUT>
DEVICE void swiglu_split_bf16in_v8(const u16* __restrict__ a, const u16* __restrict__ b, OUT* __restrict__ y,
                                   long long n) {
    const long long n8 = n / 8, first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long i = first; i < n8; i += (long long)gridDim.x * blockDim.x) {
        f32x4 lo, hi;
        silu_mul8(((const u32x4*)a)[i], ((const u32x4*)b)[i], lo, hi);
        store4(y, 2 * i, lo);
        store4(y, 2 * i + 1, hi);
    }
    if (first < n - 8 * n8) {
        const long long i = 8 * n8 + first;
        store1(y, i, silu_mul(bf16_to_f32(a[i]), bf16_to_f32(b[i])));
    }
}
DEFINE_SWIGLU_SPLIT(swiglu_split_bf16in_v8_f32, swiglu_split_bf16in_v8, u16, float)
DEFINE_SWIGLU_SPLIT(swiglu_split_bf16in_v8_bf16, swiglu_split_bf16in_v8, u16, u16)

// swiglu_split of row-strided halves: a and b [rows, f] with row strides sa, sb (the gate and up columns of a
// stacked gate|up prefill product, read in place: a gathered copy of each costs more than the activation),
// y contiguous. _v4: f, sa, sb multiples of 4 and a, b 16-byte aligned (y as the contiguous kernels).
template <typename OUT>
DEVICE void swiglu_rows_v4(const float* __restrict__ a, const float* __restrict__ b, OUT* __restrict__ y,
                           long long rows, int f, long long sa, long long sb) {
    const int f4 = f / 4;
    const long long n4 = rows * f4;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / f4, c = i - t * f4;
        const f32x4 x = ((const f32x4*)(a + t * sa))[c], u = ((const f32x4*)(b + t * sb))[c];
        store4(y, i, silu_mul4(x, u));
    }
}
extern "C" __global__ void swiglu_split_rows_v4_f32(const float* __restrict__ a, const float* __restrict__ b,
                                                    float* __restrict__ y, long long rows, int f, long long sa,
                                                    long long sb) {
    PDL_ENTRY();
    swiglu_rows_v4<float>(a, b, y, rows, f, sa, sb);
}
extern "C" __global__ void swiglu_split_rows_v4_bf16(const float* __restrict__ a, const float* __restrict__ b,
                                                     u16* __restrict__ y, long long rows, int f, long long sa,
                                                     long long sb) {
    PDL_ENTRY();
    swiglu_rows_v4<u16>(a, b, y, rows, f, sa, sb);
}
extern "C" __global__ void swiglu_split_rows_f32(const float* __restrict__ a, const float* __restrict__ b,
                                                 float* __restrict__ y, long long rows, int f, long long sa,
                                                 long long sb) {
    PDL_ENTRY();
    GRID_STRIDE(i, rows * f) {
        const long long t = i / f, c = i - t * f;
        y[i] = silu_mul(a[t * sa + c], b[t * sb + c]);
    }
}
