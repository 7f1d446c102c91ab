// Rotary position embedding. The angle pos * freq_scale * inv_freq[i] is formed and rotated in
// double precision, as the op table's reference does: at position 4000 an f32 angle is already
// off by ~2e-4 rad, more than the 1e-5 the tests allow; rope is a tiny share of a step.
#include "common.cuh"

// The rotation of element j of a head (j < n_dims). Pairs: neox (i, i + half), norm (2i, 2i + 1).
// Returns the rotated value of element j, reading its partner from `head`.
DEVICE float rope_elem(const float* head, int j, int n_dims, int neox, double ang) {
    const int half = n_dims / 2;
    int i, first, second;
    if (neox) {
        i = j < half ? j : j - half;
        first = i;
        second = i + half;
    } else {
        i = j / 2;
        first = 2 * i;
        second = 2 * i + 1;
    }
    const double c = cos(ang), s = sin(ang);
    const double a = head[first], b = head[second];
    return (float)(j == first ? a * c - b * s : a * s + b * c);
}

DEVICE int pair_index(int j, int n_dims, int neox) {
    const int half = n_dims / 2;
    return neox ? (j < half ? j : j - half) : j / 2;
}

// y[t, h, j] for x [n_tok, n_heads, head_dim], y contiguous; head (t, h) of x starts at
// x + t * x_tok + h * x_head (a row-strided view read in place, e.g. q of a stacked q|k|v product).
// y may alias x (in-place rope after a fused norm, x then contiguous): one thread owns both
// elements of a pair, reading both before writing either.
extern "C" __global__ void rope_f32(const float* x, const int* __restrict__ pos, const double* __restrict__ inv_freq,
                                    float* y, int n_tok, int n_heads, int head_dim, int n_dims, int neox,
                                    double freq_scale, long long x_tok, long long x_head) {
    PDL_ENTRY();
    const int half = n_dims / 2;
    const int per_head = half + (head_dim - n_dims);  // one thread per pair, one per pass-through element
    const long long n = (long long)n_tok * n_heads * per_head;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < n; g += (long long)gridDim.x * blockDim.x) {
        const int k = (int)(g % per_head);
        const long long th = g / per_head;  // t * n_heads + h
        const int t = (int)(th / n_heads);
        const float* xh = x + t * x_tok + (th - (long long)t * n_heads) * x_head;
        float* yh = y + th * head_dim;
        if (k >= half) {  // dims past n_dims pass through
            const int j = n_dims + (k - half);
            yh[j] = xh[j];
            continue;
        }
        const int first = neox ? k : 2 * k, second = neox ? k + half : 2 * k + 1;
        const double ang = (double)pos[t] * freq_scale * inv_freq[k];
        const float r0 = rope_elem(xh, first, n_dims, neox, ang);
        const float r1 = rope_elem(xh, second, n_dims, neox, ang);
        yh[first] = r0;
        yh[second] = r1;
    }
}

// y[t, h, :] = rope(rms_norm(x[t, h, :]) * w, pos[t]) for x [n_tok, n_heads, head_dim] and w [head_dim]:
// the q/k norm of Qwen3-style attention and its rotation in one pass, one block per head row
// (blockDim >= head_dim). Head (t, h) of x starts at x + t * x_tok + h * x_head: q read in place
// from the projection (Qwen3.5 interleaves q and its gate per head; Qwen3 stacks q|k|v); y contiguous.
// The normed row waits in shared memory for its rotation partners; the arithmetic is that of
// rms_norm_f32 followed by rope_f32, so the two paths agree bitwise.
extern "C" __global__ void rms_norm_mul_rope_f32(const float* x, const float* __restrict__ w,
                                                 const int* __restrict__ pos, const double* __restrict__ inv_freq,
                                                 float* y, int n_heads, int head_dim, int n_dims, int neox,
                                                 double freq_scale, float eps, long long x_tok, long long x_head) {
    PDL_ENTRY();
    __shared__ float red[MAX_THREADS / WARP_SIZE];
    extern __shared__ float normed[];  // head_dim floats
    const long long th = blockIdx.x;  // t * n_heads + h
    const int t = (int)(th / n_heads), j = threadIdx.x;
    const float* xh = x + t * x_tok + (th - (long long)t * n_heads) * x_head;
    const float v = j < head_dim ? xh[j] : 0.0f;
    const float ss = block_sum(v * v, red);
    const float inv = 1.0f / sqrtf(ss / (float)head_dim + eps);
    if (j < head_dim) normed[j] = v * inv * w[j];
    __syncthreads();
    if (j >= head_dim) return;
    float out = normed[j];
    if (j < n_dims) out = rope_elem(normed, j, n_dims, neox, (double)pos[t] * freq_scale * inv_freq[pair_index(j, n_dims, neox)]);
    y[th * head_dim + j] = out;
}

// cache[rows[t], :] = rope(x, pos)[t] for x [n_tok, n_heads, head_dim]: roped K written straight into
// the KV cache (f32 or f16). Head (t, h) of x starts at x + t * x_tok + h * x_head (K read in place
// from a stacked q|k|v product). A row outside 0..cap-1 is reported, never written.
#define DEFINE_ROPE_SET_ROWS(name, T, STORE)                                                                       \
    extern "C" __global__ void name(T* cache, const float* __restrict__ x, const int* __restrict__ pos,             \
                                    const int* __restrict__ rows, const double* __restrict__ inv_freq, int n_tok,  \
                                    int n_heads, int head_dim, int n_dims, int neox, double freq_scale, int cap,   \
                                    int* errflag, int code, long long x_tok, long long x_head) {                   \
        PDL_ENTRY();                                                                                               \
        const long long row_elems = (long long)n_heads * head_dim;                                                 \
        const long long n = n_tok * row_elems;                                                                     \
        for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < n;                                \
             g += (long long)gridDim.x * blockDim.x) {                                                             \
            const int t = (int)(g / row_elems);                                                                    \
            const long long e = g % row_elems;                                                                     \
            const int j = (int)(e % head_dim);                                                                     \
            const int r = rows[t];                                                                                 \
            if (r < 0 || r >= cap) {                                                                               \
                report_error(errflag, code, r);                                                                    \
                continue;                                                                                          \
            }                                                                                                      \
            const float* xh = x + t * x_tok + (e / head_dim) * x_head;                                             \
            float v = xh[j];                                                                                       \
            if (j < n_dims) {                                                                                      \
                const double ang = (double)pos[t] * freq_scale * inv_freq[pair_index(j, n_dims, neox)];            \
                v = rope_elem(xh, j, n_dims, neox, ang);                                                           \
            }                                                                                                      \
            cache[(long long)r * row_elems + e] = STORE(v);                                                        \
        }                                                                                                          \
    }

DEVICE float store_f32(float v) { return v; }
DEFINE_ROPE_SET_ROWS(rope_set_rows_f32, float, store_f32)
DEFINE_ROPE_SET_ROWS(rope_set_rows_f16, u16, f32_to_f16)

// cache[rows[t], h, :] = rope(rms_norm(x[t, h, :]) * w, pos[t]): rms_norm_mul_rope_f32 writing its
// rows straight into the KV cache (Qwen3's K), same arithmetic, so it equals the norm-rope kernel
// followed by set_rows bit for bit (f32 cache). One block per head row, head (t, h) of x at
// x + t * x_tok + h * x_head; a row outside 0..cap-1 is reported, never written.
#define DEFINE_NORM_ROPE_SET_ROWS(name, T, STORE)                                                                  \
    extern "C" __global__ void name(T* cache, const float* x, const float* __restrict__ w,                          \
                                    const int* __restrict__ pos, const int* __restrict__ rows,                     \
                                    const double* __restrict__ inv_freq, int n_heads, int head_dim, int n_dims,    \
                                    int neox, double freq_scale, float eps, int cap, int* errflag, int code,       \
                                    long long x_tok, long long x_head) {                                           \
        PDL_ENTRY();                                                                                               \
        __shared__ float red[MAX_THREADS / WARP_SIZE];                                                             \
        extern __shared__ float normed[];                                                                          \
        const long long th = blockIdx.x;                                                                           \
        const int t = (int)(th / n_heads), j = threadIdx.x;                                                        \
        const float* xh = x + t * x_tok + (th - (long long)t * n_heads) * x_head;                                  \
        const float v = j < head_dim ? xh[j] : 0.0f;                                                               \
        const float ss = block_sum(v * v, red);                                                                    \
        const float inv = 1.0f / sqrtf(ss / (float)head_dim + eps);                                                \
        if (j < head_dim) normed[j] = v * inv * w[j];                                                              \
        __syncthreads();                                                                                           \
        const int r = rows[t];                                                                                     \
        if (r < 0 || r >= cap) {                                                                                   \
            if (j == 0) report_error(errflag, code, r);                                                            \
            return;                                                                                                \
        }                                                                                                          \
        if (j >= head_dim) return;                                                                                 \
        float out = normed[j];                                                                                     \
        if (j < n_dims)                                                                                            \
            out = rope_elem(normed, j, n_dims, neox,                                                               \
                            (double)pos[t] * freq_scale * inv_freq[pair_index(j, n_dims, neox)]);                 \
        cache[(long long)r * n_heads * head_dim + (th - (long long)t * n_heads) * head_dim + j] = STORE(out);     \
    }
DEFINE_NORM_ROPE_SET_ROWS(rms_norm_mul_rope_set_rows_f32, float, store_f32)
DEFINE_NORM_ROPE_SET_ROWS(rms_norm_mul_rope_set_rows_f16, u16, f32_to_f16)
