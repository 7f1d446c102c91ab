// Rotary position embedding, and the KV cache row writes (roped K, and set_rows for V). The angle
// pos * freq_scale * inv_freq[i] is formed and rotated in double precision, as the op table's
// reference does: at position 4000 an f32 angle is already off by ~2e-4 rad, more than the 1e-5 the
// tests allow; rope is a tiny share of a step.
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
    double s, c;
    sincos(ang, &s, &c);  // one range reduction for both
    const double a = head[first], b = head[second];
    return (float)(j == first ? a * c - b * s : a * s + b * c);
}

DEVICE int pair_index(int j, int n_dims, int neox) {
    const int half = n_dims / 2;
    return neox ? (j < half ? j : j - half) : j / 2;
}

// Each kernel below is a DEVICE body run over its whole grid: the `_rows` bodies take one head row per
// block (row = the block's index), the `_span` bodies a grid-stride loop (first = the thread's index,
// step = the threads of the grid). The qkv_* kernels at the end run three bodies side by side in one
// launch, each over its own range of blocks.

// y[t, h, j] for x [n_tok, n_heads, head_dim], y contiguous; head (t, h) of x starts at
// x + t * x_tok + h * x_head (a row-strided view read in place, e.g. q of a stacked q|k|v product).
// y may alias x (in-place rope after a fused norm, x then contiguous): one thread owns both
// elements of a pair, reading both before writing either.
DEVICE void rope_span(const float* x, const int* __restrict__ pos, const double* __restrict__ inv_freq, float* y,
                      int n_tok, int n_heads, int head_dim, int n_dims, int neox, double freq_scale, long long x_tok,
                      long long x_head, long long first, long long step) {
    const int half = n_dims / 2;
    const int per_head = half + (head_dim - n_dims);  // one thread per pair, one per pass-through element
    const long long n = (long long)n_tok * n_heads * per_head;
    for (long long g = first; g < n; g += step) {
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
        const int first_j = neox ? k : 2 * k, second = neox ? k + half : 2 * k + 1;
        const double ang = (double)pos[t] * freq_scale * inv_freq[k];
        const float r0 = rope_elem(xh, first_j, n_dims, neox, ang);
        const float r1 = rope_elem(xh, second, n_dims, neox, ang);
        yh[first_j] = r0;
        yh[second] = r1;
    }
}

#define SPAN_ARGS (long long)blockIdx.x * blockDim.x + threadIdx.x, (long long)gridDim.x * blockDim.x

extern "C" __global__ void rope_f32(const float* x, const int* __restrict__ pos, const double* __restrict__ inv_freq,
                                    float* y, int n_tok, int n_heads, int head_dim, int n_dims, int neox,
                                    double freq_scale, long long x_tok, long long x_head) {
    PDL_ENTRY();
    rope_span(x, pos, inv_freq, y, n_tok, n_heads, head_dim, n_dims, neox, freq_scale, x_tok, x_head, SPAN_ARGS);
}

// Head row th of x normed (rms_norm * w) into `normed` (shared, head_dim floats); returns after the
// barrier that publishes it. blockDim >= head_dim.
DEVICE void norm_head(const float* x, const float* __restrict__ w, int n_heads, int head_dim, float eps,
                      long long x_tok, long long x_head, long long th, float* red, float* normed) {
    const int t = (int)(th / n_heads), j = threadIdx.x;
    const float* xh = x + t * x_tok + (th - (long long)t * n_heads) * x_head;
    const float v = j < head_dim ? xh[j] : 0.0f;
    const float ss = block_sum(v * v, red);
    const float inv = 1.0f / sqrtf(ss / (float)head_dim + eps);
    if (j < head_dim) normed[j] = v * inv * w[j];
    __syncthreads();
}

// Element j of the normed head row th, roped (j < n_dims) or passed through.
DEVICE float roped_normed(const float* normed, const int* __restrict__ pos, const double* __restrict__ inv_freq,
                          int n_heads, int n_dims, int neox, double freq_scale, long long th, int j) {
    if (j >= n_dims) return normed[j];
    const int t = (int)(th / n_heads);
    return rope_elem(normed, j, n_dims, neox, (double)pos[t] * freq_scale * inv_freq[pair_index(j, n_dims, neox)]);
}

// y[t, h, :] = rope(rms_norm(x[t, h, :]) * w, pos[t]) for x [n_tok, n_heads, head_dim] and w [head_dim]:
// the q/k norm of Qwen3-style attention and its rotation in one pass, one block per head row
// (blockDim >= head_dim). Head (t, h) of x starts at x + t * x_tok + h * x_head: q read in place
// from the projection (Qwen3.5 interleaves q and its gate per head; Qwen3 stacks q|k|v); y contiguous.
// The normed row waits in shared memory for its rotation partners; the arithmetic is that of
// rms_norm_f32 followed by rope_f32, so the two paths agree bitwise.
DEVICE void norm_rope_rows(const float* x, const float* __restrict__ w, const int* __restrict__ pos,
                           const double* __restrict__ inv_freq, float* y, int n_heads, int head_dim, int n_dims,
                           int neox, double freq_scale, float eps, long long x_tok, long long x_head, long long th,
                           float* red, float* normed) {
    norm_head(x, w, n_heads, head_dim, eps, x_tok, x_head, th, red, normed);
    const int j = threadIdx.x;
    if (j < head_dim) y[th * head_dim + j] = roped_normed(normed, pos, inv_freq, n_heads, n_dims, neox, freq_scale, th, j);
}

extern "C" __global__ void rms_norm_mul_rope_f32(const float* x, const float* __restrict__ w,
                                                 const int* __restrict__ pos, const double* __restrict__ inv_freq,
                                                 float* y, int n_heads, int head_dim, int n_dims, int neox,
                                                 double freq_scale, float eps, long long x_tok, long long x_head) {
    PDL_ENTRY();
    __shared__ float red[MAX_THREADS / WARP_SIZE];
    extern __shared__ float normed[];  // head_dim floats
    norm_rope_rows(x, w, pos, inv_freq, y, n_heads, head_dim, n_dims, neox, freq_scale, eps, x_tok, x_head,
                   blockIdx.x, red, normed);
}

DEVICE float store_f32(float v) { return v; }

// The KV cache writes, per cache type (f32 or f16 bits): rope_set_rows_span: cache[rows[t], :] =
// rope(x, pos)[t] for x [n_tok, n_heads, head_dim], roped K written straight into the cache; head (t, h)
// of x starts at x + t * x_tok + h * x_head (K read in place from a stacked q|k|v product). A row outside
// 0..cap-1 is reported, never written.
#define DEFINE_KV_BODIES(SUF, T, STORE)                                                                            \
    DEVICE void rope_set_rows_span_##SUF(T* cache, const float* __restrict__ x, const int* __restrict__ pos,       \
                                         const int* __restrict__ rows, const double* __restrict__ inv_freq,        \
                                         int n_tok, int n_heads, int head_dim, int n_dims, int neox,               \
                                         double freq_scale, int cap, int* errflag, int code, long long x_tok,      \
                                         long long x_head, long long first, long long step) {                      \
        const long long row_elems = (long long)n_heads * head_dim;                                                 \
        const long long n = n_tok * row_elems;                                                                     \
        for (long long g = first; g < n; g += step) {                                                              \
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
    }                                                                                                              \
    /* cache[rows[t], h, :] = rope(rms_norm(x[t, h, :]) * w, pos[t]): the norm-rope row written straight into   \
       the KV cache (Qwen3's K), same arithmetic, so it equals rms_norm_mul_rope_f32 followed by set_rows bit \
       for bit (f32 cache). A row outside 0..cap-1 is reported, never written. */                               \
    DEVICE void norm_rope_set_rows_rows_##SUF(T* cache, const float* x, const float* __restrict__ w,               \
                                              const int* __restrict__ pos, const int* __restrict__ rows,           \
                                              const double* __restrict__ inv_freq, int n_heads, int head_dim,      \
                                              int n_dims, int neox, double freq_scale, float eps, int cap,         \
                                              int* errflag, int code, long long x_tok, long long x_head,           \
                                              long long th, float* red, float* normed) {                           \
        norm_head(x, w, n_heads, head_dim, eps, x_tok, x_head, th, red, normed);                                   \
        const int t = (int)(th / n_heads), j = threadIdx.x;                                                        \
        const int r = rows[t];                                                                                     \
        if (r < 0 || r >= cap) {                                                                                   \
            if (j == 0) report_error(errflag, code, r);                                                            \
            return;                                                                                                \
        }                                                                                                          \
        if (j >= head_dim) return;                                                                                 \
        const float out = roped_normed(normed, pos, inv_freq, n_heads, n_dims, neox, freq_scale, th, j);           \
        cache[(long long)r * n_heads * head_dim + (th - (long long)t * n_heads) * head_dim + j] = STORE(out);     \
    }                                                                                                              \
    /* dst[rows[t], :] = src[t, :] for src [n_tok, ...] f32 into an f32 or f16 State [cap, ...] (set_rows).     \
       src is row-strided: element c of outer index o (its axes but the last, flattened) is at                \
       src[(o / d1) * s0 + (o % d1) * s1 + c], c < inner (lowering.py collapses the outer axes to two).        \
       A row outside 0..cap-1 is reported and not written. */                                                  \
    DEVICE void set_rows_span_##SUF(T* dst, const float* __restrict__ src, const int* __restrict__ rows,           \
                                    int n_tok, long long row, int cap, int* errflag, int code, int inner, int d1,  \
                                    long long s0, long long s1, long long first, long long step) {                 \
        const long long n = n_tok * row;                                                                           \
        for (long long i = first; i < n; i += step) {                                                              \
            const int t = (int)(i / row);                                                                          \
            const int r = rows[t];                                                                                 \
            if (r < 0 || r >= cap) {                                                                               \
                report_error(errflag, code, r);                                                                    \
                continue;                                                                                          \
            }                                                                                                      \
            const long long o = i / inner, o0 = o / d1;                                                            \
            dst[(long long)r * row + (i - (long long)t * row)] = STORE(src[o0 * s0 + (o - o0 * d1) * s1 + (i - o * inner)]); \
        }                                                                                                          \
    }

DEFINE_KV_BODIES(f32, float, store_f32)
DEFINE_KV_BODIES(f16, u16, f32_to_f16)

#define DEFINE_KV_KERNELS(SUF, T)                                                                                  \
    extern "C" __global__ void rope_set_rows_##SUF(T* cache, const float* __restrict__ x, const int* __restrict__ pos, \
                                                   const int* __restrict__ rows, const double* __restrict__ inv_freq, \
                                                   int n_tok, int n_heads, int head_dim, int n_dims, int neox,     \
                                                   double freq_scale, int cap, int* errflag, int code,             \
                                                   long long x_tok, long long x_head) {                            \
        PDL_ENTRY();                                                                                               \
        rope_set_rows_span_##SUF(cache, x, pos, rows, inv_freq, n_tok, n_heads, head_dim, n_dims, neox, freq_scale, \
                                 cap, errflag, code, x_tok, x_head, SPAN_ARGS);                                    \
    }                                                                                                              \
    extern "C" __global__ void rms_norm_mul_rope_set_rows_##SUF(                                                   \
        T* cache, const float* x, const float* __restrict__ w, const int* __restrict__ pos,                         \
        const int* __restrict__ rows, const double* __restrict__ inv_freq, int n_heads, int head_dim, int n_dims,  \
        int neox, double freq_scale, float eps, int cap, int* errflag, int code, long long x_tok, long long x_head) { \
        PDL_ENTRY();                                                                                               \
        __shared__ float red[MAX_THREADS / WARP_SIZE];                                                             \
        extern __shared__ float normed[];                                                                          \
        norm_rope_set_rows_rows_##SUF(cache, x, w, pos, rows, inv_freq, n_heads, head_dim, n_dims, neox,           \
                                      freq_scale, eps, cap, errflag, code, x_tok, x_head, blockIdx.x, red, normed); \
    }                                                                                                              \
    extern "C" __global__ void set_rows_##SUF(T* dst, const float* __restrict__ src, const int* __restrict__ rows, \
                                              int n_tok, long long row, int cap, int* errflag, int code, int inner, \
                                              int d1, long long s0, long long s1) {                                \
        PDL_ENTRY();                                                                                               \
        set_rows_span_##SUF(dst, src, rows, n_tok, row, cap, errflag, code, inner, d1, s0, s1, SPAN_ARGS);         \
    }
DEFINE_KV_KERNELS(f32, float)
DEFINE_KV_KERNELS(f16, u16)

// ---------------------------------------------------------------- q, k and v of one attention layer, one launch
// An attention layer's decode step writes three independent things after its q|k|v projection: q roped
// (normed first in Qwen3), K roped into the cache, V into the cache. As three kernels each pays a
// launch-to-launch gap of a captured graph (1.5-2.7 us apiece on an H200, Qwen3-0.6B: 188 us of a
// 1,250 us step); here the three run side by side in one grid: blocks [0, nq) take q's body, [nq, nq + nk)
// K's, the rest V's. The parameters are the three kernels' own, in order (lowering.py merge_kv_writes
// concatenates their launch arguments), then nq and nk. Every body is the one its own kernel runs, so
// the results are bitwise those of the three launches.
#define V_PARAMS(T)                                                                                                \
    T *v_dst, const float *__restrict__ v_src, const int *__restrict__ v_rows, int v_n_tok, long long v_row,      \
        int v_cap, int *v_errflag, int v_code, int v_inner, int v_d1, long long v_s0, long long v_s1
#define V_SEGMENT(SUF, b0)                                                                                         \
    set_rows_span_##SUF(v_dst, v_src, v_rows, v_n_tok, v_row, v_cap, v_errflag, v_code, v_inner, v_d1, v_s0, v_s1, \
                        (long long)(blockIdx.x - (b0)) * blockDim.x + threadIdx.x,                                 \
                        (long long)(gridDim.x - (b0)) * blockDim.x)

#define DEFINE_QKV(SUF, T)                                                                                         \
    extern "C" __global__ void qkv_norm_rope_##SUF(                                                                \
        const float* q_x, const float* __restrict__ q_w, const int* __restrict__ q_pos,                            \
        const double* __restrict__ q_inv_freq, float* q_y, int q_n_heads, int q_head_dim, int q_n_dims, int q_neox, \
        double q_freq_scale, float q_eps, long long q_x_tok, long long q_x_head,                                   \
        T* k_cache, const float* k_x, const float* __restrict__ k_w, const int* __restrict__ k_pos,                 \
        const int* __restrict__ k_rows, const double* __restrict__ k_inv_freq, int k_n_heads, int k_head_dim,      \
        int k_n_dims, int k_neox, double k_freq_scale, float k_eps, int k_cap, int* k_errflag, int k_code,         \
        long long k_x_tok, long long k_x_head, V_PARAMS(T), int nq, int nk) {                                      \
        PDL_ENTRY();                                                                                               \
        __shared__ float red[MAX_THREADS / WARP_SIZE];                                                             \
        extern __shared__ float normed[];                                                                          \
        const int b = blockIdx.x;                                                                                  \
        if (b < nq)                                                                                                \
            norm_rope_rows(q_x, q_w, q_pos, q_inv_freq, q_y, q_n_heads, q_head_dim, q_n_dims, q_neox, q_freq_scale, \
                           q_eps, q_x_tok, q_x_head, b, red, normed);                                              \
        else if (b < nq + nk)                                                                                      \
            norm_rope_set_rows_rows_##SUF(k_cache, k_x, k_w, k_pos, k_rows, k_inv_freq, k_n_heads, k_head_dim,    \
                                          k_n_dims, k_neox, k_freq_scale, k_eps, k_cap, k_errflag, k_code, k_x_tok, \
                                          k_x_head, b - nq, red, normed);                                          \
        else                                                                                                       \
            V_SEGMENT(SUF, nq + nk);                                                                               \
    }                                                                                                              \
    extern "C" __global__ void qkv_rope_##SUF(                                                                     \
        const float* q_x, const int* __restrict__ q_pos, const double* __restrict__ q_inv_freq, float* q_y,        \
        int q_n_tok, int q_n_heads, int q_head_dim, int q_n_dims, int q_neox, double q_freq_scale,                 \
        long long q_x_tok, long long q_x_head,                                                                     \
        T* k_cache, const float* __restrict__ k_x, const int* __restrict__ k_pos, const int* __restrict__ k_rows,  \
        const double* __restrict__ k_inv_freq, int k_n_tok, int k_n_heads, int k_head_dim, int k_n_dims,           \
        int k_neox, double k_freq_scale, int k_cap, int* k_errflag, int k_code, long long k_x_tok,                 \
        long long k_x_head, V_PARAMS(T), int nq, int nk) {                                                         \
        PDL_ENTRY();                                                                                               \
        const int b = blockIdx.x;                                                                                  \
        if (b < nq)                                                                                                \
            rope_span(q_x, q_pos, q_inv_freq, q_y, q_n_tok, q_n_heads, q_head_dim, q_n_dims, q_neox, q_freq_scale, \
                      q_x_tok, q_x_head, (long long)b * blockDim.x + threadIdx.x, (long long)nq * blockDim.x);    \
        else if (b < nq + nk)                                                                                      \
            rope_set_rows_span_##SUF(k_cache, k_x, k_pos, k_rows, k_inv_freq, k_n_tok, k_n_heads, k_head_dim,      \
                                     k_n_dims, k_neox, k_freq_scale, k_cap, k_errflag, k_code, k_x_tok, k_x_head,  \
                                     (long long)(b - nq) * blockDim.x + threadIdx.x, (long long)nk * blockDim.x);  \
        else                                                                                                       \
            V_SEGMENT(SUF, nq + nk);                                                                               \
    }
DEFINE_QKV(f32, float)
DEFINE_QKV(f16, u16)
