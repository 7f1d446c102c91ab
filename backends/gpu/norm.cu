// Norms over the last axis: one block per row, the row's statistics reduced in f32 across the block.
#include "common.cuh"

// y = x / sqrt(mean(x^2) + eps) [* w]
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ y, int ncols, float eps, int has_w) {
    PDL_ENTRY();
    __shared__ float red[MAX_THREADS / WARP_SIZE];
    const long long row = blockIdx.x;
    const float* xr = x + row * ncols;
    float* yr = y + row * ncols;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) ss += xr[c] * xr[c];
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)ncols + eps);
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) yr[c] = has_w ? xr[c] * inv * w[c] : xr[c] * inv;
}

// s = a + b; y_sum = s; y_norm = rms_norm(s) * w: the residual add fused with the next block's norm
extern "C" __global__ void add_rms_norm_mul_f32(const float* __restrict__ a, const float* __restrict__ b,
                                                const float* __restrict__ w, float* __restrict__ y_norm,
                                                float* __restrict__ y_sum, int ncols, float eps) {
    PDL_ENTRY();
    __shared__ float red[MAX_THREADS / WARP_SIZE];
    const long long off = (long long)blockIdx.x * ncols;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
        const float s = a[off + c] + b[off + c];
        y_sum[off + c] = s;  // read back below by the same thread: no barrier needed
        ss += s * s;
    }
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)ncols + eps);
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) y_norm[off + c] = y_sum[off + c] * inv * w[c];
}

// add_rms_norm_mul_f32 for rows of 4 * NV * blockDim.x columns at most (16-byte aligned rows, ncols % 4 == 0):
// each thread keeps its sums in registers (NV row4 at columns 4 * (t + k * blockDim.x)), so y_norm needs no
// read-back of y_sum, and w is loaded before the reduction. A decode step's residual rows are 1-4k floats:
// the generic kernel's strided scalar loads, 1,024 threads and y_sum read back after the barrier took
// 3.1 us a call at 4,096 columns on an H200 (Qwen3-8B, 72 calls a token).
struct alignas(16) row4 {  // four columns, one 16-byte load (hiprtc has no float4 without its headers)
    float x, y, z, w;
};

// y_norm's four columns stored as f32, or as bf16 bits (the bf16 twin a prefill GEMM reads: matmul.py
// bf16_twin; f32_to_bf16 of the same f32 values, as the cast kernel would round them)
DEVICE void store_row4(float* y, int c, row4 v) { ((row4*)y)[c] = v; }
DEVICE void store_row4(u16* y, int c, row4 v) {
    ((u16x4*)y)[c] = u16x4{f32_to_bf16(v.x), f32_to_bf16(v.y), f32_to_bf16(v.z), f32_to_bf16(v.w)};
}

template <int NV, typename OUT>
DEVICE void add_rms_norm_mul_regs(const float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ w,
                                  OUT* __restrict__ y_norm, float* __restrict__ y_sum, int ncols, float eps) {
    __shared__ float red[MAX_THREADS / WARP_SIZE];
    const long long off = (long long)blockIdx.x * ncols;
    const int n4 = ncols / 4;
    row4 s[NV], wv[NV];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c < n4) {
            const row4 x = ((const row4*)(a + off))[c], y = ((const row4*)(b + off))[c];
            wv[k] = ((const row4*)w)[c];
            s[k] = row4{x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w};
            ((row4*)(y_sum + off))[c] = s[k];
            ss += s[k].x * s[k].x + s[k].y * s[k].y + s[k].z * s[k].z + s[k].w * s[k].w;
        }
    }
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)ncols + eps);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c < n4)
            store_row4(y_norm + off, c, row4{s[k].x * inv * wv[k].x, s[k].y * inv * wv[k].y, s[k].z * inv * wv[k].z,
                                             s[k].w * inv * wv[k].w});
    }
}
// add_rms_norm_mul_v<NV>_f32 (y_norm f32) and add_rms_norm_mul_v<NV>_bf16 (y_norm bf16 bits)
#define DEFINE_ADD_RMS_NORM_MUL_REGS(NV, SUF, OUT)                                                                  \
    extern "C" __global__ void add_rms_norm_mul_v##NV##_##SUF(const float* __restrict__ a, const float* __restrict__ b, \
                                                            const float* __restrict__ w, OUT* __restrict__ y_norm,  \
                                                            float* __restrict__ y_sum, int ncols, float eps) {      \
        PDL_ENTRY();                                                                                                \
        add_rms_norm_mul_regs<NV, OUT>(a, b, w, y_norm, y_sum, ncols, eps);                                         \
    }
#define DEFINE_ADD_RMS_NORM_MUL_OUTS(NV) DEFINE_ADD_RMS_NORM_MUL_REGS(NV, f32, float) DEFINE_ADD_RMS_NORM_MUL_REGS(NV, bf16, u16)
DEFINE_ADD_RMS_NORM_MUL_OUTS(1)
DEFINE_ADD_RMS_NORM_MUL_OUTS(2)
DEFINE_ADD_RMS_NORM_MUL_OUTS(4)
DEFINE_ADD_RMS_NORM_MUL_OUTS(8)

// y = rms_norm(x) * w * silu(z): Qwen3.5's gated output norm, one head's row per block
extern "C" __global__ void rms_norm_mul_gate_f32(const float* __restrict__ x, const float* __restrict__ w,
                                                 const float* __restrict__ z, float* __restrict__ y, int ncols,
                                                 float eps) {
    PDL_ENTRY();
    __shared__ float red[MAX_THREADS / WARP_SIZE];
    const long long off = (long long)blockIdx.x * ncols;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) ss += x[off + c] * x[off + c];
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)ncols + eps);
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
        const float g = z[off + c];
        y[off + c] = x[off + c] * inv * w[c] * (g / (1.0f + expf(-g)));
    }
}

// y = x / sqrt(sum(x^2) + eps)
extern "C" __global__ void l2_norm_f32(const float* __restrict__ x, float* __restrict__ y, int ncols, float eps) {
    PDL_ENTRY();
    __shared__ float red[MAX_THREADS / WARP_SIZE];
    const long long off = (long long)blockIdx.x * ncols;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) ss += x[off + c] * x[off + c];
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss + eps);
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) y[off + c] = x[off + c] * inv;
}

// y = (x - mean) / sqrt(var + eps), the variance of the centred values (two passes: exact for large means)
extern "C" __global__ void layer_norm_f32(const float* __restrict__ x, float* __restrict__ y, int ncols, float eps) {
    PDL_ENTRY();
    __shared__ float red[MAX_THREADS / WARP_SIZE];
    const long long off = (long long)blockIdx.x * ncols;
    float s = 0.0f;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) s += x[off + c];
    const float mean = block_sum(s, red) / (float)ncols;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
        const float d = x[off + c] - mean;
        ss += d * d;
    }
    const float inv = 1.0f / sqrtf(block_sum(ss, red) / (float)ncols + eps);
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) y[off + c] = (x[off + c] - mean) * inv;
}
