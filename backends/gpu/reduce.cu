// Row reductions over the last axis: one block per row.
#include "common.cuh"

// y[row] = mul * sum(x[row, :])  (sum_rows: mul = 1, mean: mul = 1/ncols)
extern "C" __global__ void sum_rows_f32(const float* __restrict__ x, float* __restrict__ y, int ncols, float mul) {
    PDL_ENTRY();
    __shared__ float red[MAX_THREADS / WARP_SIZE];
    const long long off = (long long)blockIdx.x * ncols;
    float s = 0.0f;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) s += x[off + c];
    s = block_sum(s, red);
    if (threadIdx.x == 0) y[blockIdx.x] = s * mul;
}

// Order used by argmax and top_k: larger value first, lower index first among equals.
// idx == NONE marks "no candidate" and loses to everything.
#define NONE 0x7fffffff
DEVICE bool better(float v, int i, float bv, int bi) {
    if (i == NONE) return false;
    if (bi == NONE) return true;
    return v > bv || (v == bv && i < bi);
}

// Block-wide best (value, index) under `better`; every thread gets the result.
DEVICE void block_best(float& v, int& i, float* sv, int* si) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int n_warps = (blockDim.x + WARP_SIZE - 1) / WARP_SIZE;
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
        const float ov = SHFL_XOR(v, o);
        const int oi = SHFL_XOR(i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    v = lane < n_warps ? sv[lane] : 0.0f;
    i = lane < n_warps ? si[lane] : NONE;
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
        const float ov = SHFL_XOR(v, o);
        const int oi = SHFL_XOR(i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

extern "C" __global__ void argmax_f32(const float* __restrict__ x, int* __restrict__ y, int ncols) {
    PDL_ENTRY();
    __shared__ float sv[MAX_THREADS / WARP_SIZE];
    __shared__ int si[MAX_THREADS / WARP_SIZE];
    const float* xr = x + (long long)blockIdx.x * ncols;
    float bv = 0.0f;
    int bi = NONE;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x)
        if (better(xr[c], c, bv, bi)) { bv = xr[c]; bi = c; }
    block_best(bv, bi, sv, si);
    if (threadIdx.x == 0) y[blockIdx.x] = bi;
}

// k rounds of a block-wide best over the elements that come after the previous winner in the
// order; O(k * ncols) reads with no scratch, fine for the k of sampling (tens).
extern "C" __global__ void top_k_f32(const float* __restrict__ x, int* __restrict__ y, int ncols, int k) {
    PDL_ENTRY();
    __shared__ float sv[MAX_THREADS / WARP_SIZE];
    __shared__ int si[MAX_THREADS / WARP_SIZE];
    const float* xr = x + (long long)blockIdx.x * ncols;
    float pv = 0.0f;
    int pi = NONE;  // previous winner; NONE before the first round
    for (int r = 0; r < k; ++r) {
        float bv = 0.0f;
        int bi = NONE;
        for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
            const float v = xr[c];
            const bool after = pi == NONE || better(pv, pi, v, c);  // (v, c) comes after the previous winner
            if (after && better(v, c, bv, bi)) { bv = v; bi = c; }
        }
        block_best(bv, bi, sv, si);
        if (threadIdx.x == 0) y[(long long)blockIdx.x * k + r] = bi;
        pv = bv;
        pi = bi;
    }
}

// y = softmax(x * scale + mask) over the last axis. x is contiguous [d0, d1, d2, ncols]; the mask,
// broadcast onto x, is read at i0*m0 + i1*m1 + i2*m2 + c*m3 (stride 0 on broadcast axes).
extern "C" __global__ void softmax_f32(const float* __restrict__ x, const float* __restrict__ mask,
                                       float* __restrict__ y, int ncols, float scale, int has_mask, int d1, int d2,
                                       int m0, int m1, int m2, int m3) {
    PDL_ENTRY();
    __shared__ float red[MAX_THREADS / WARP_SIZE];
    const long long row = blockIdx.x;
    const int i2 = (int)(row % d2), i1 = (int)((row / d2) % d1);
    const long long i0 = row / ((long long)d1 * d2);
    const float* xr = x + row * ncols;
    const float* mr = mask + (has_mask ? i0 * m0 + (long long)i1 * m1 + (long long)i2 * m2 : 0);
    float* yr = y + row * ncols;
    float mx = NEG_INF;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x)
        mx = fmaxf(mx, xr[c] * scale + (has_mask ? mr[(long long)c * m3] : 0.0f));
    mx = block_max(mx, red);
    float s = 0.0f;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
        const float e = expf(xr[c] * scale + (has_mask ? mr[(long long)c * m3] : 0.0f) - mx);
        yr[c] = e;  // read back below by the same thread
        s += e;
    }
    const float inv = 1.0f / block_sum(s, red);
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) yr[c] *= inv;
}
