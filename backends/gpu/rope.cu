// Rotary position embedding, and the KV cache row writes (roped K, and set_rows for V). The angle
// pos * freq_scale * inv_freq[i] is formed and rotated in double precision, as the op table's
// reference does: at position 4000 an f32 angle is already off by ~2e-4 rad, more than the 1e-5 the
// tests allow. Each pair's sincos is computed once (FP64 is ~1/2 of the FP32 rate on an H200 at best,
// and a double sincos is dozens of DFMAs): per pair in the span kernels, per (token, pair) and block in
// the norm-rope kernels, whose blocks share their tokens' table in shared memory.
#include "common.cuh"

// The pair (a, b) rotated by the angle whose cosine and sine are c and s: (a c - b s, a s + b c).
DEVICE void rotate_pair(double a, double b, double c, double s, float* r0, float* r1) {
    *r0 = (float)(a * c - b * s);
    *r1 = (float)(a * s + b * c);
}

// The columns of rotation pair i of a head: neox (i, i + half), norm (2i, 2i + 1).
DEVICE void pair_cols(int i, int half, int neox, int* first, int* second) {
    *first = neox ? i : 2 * i;
    *second = neox ? i + half : 2 * i + 1;
}

DEVICE void put(float* p, float v) { *p = v; }
DEVICE void put(u16* p, float v) { *p = f32_to_f16(v); }

// Each kernel below is a DEVICE body run over its whole grid: the `_span` bodies a grid-stride loop
// (first = the thread's index, step = the threads of the grid), the norm-rope `_block` bodies one block
// of head rows each (below). The qkv_* kernels at the end run three bodies side by side
// in one launch, each over its own range of blocks.

// Work item g of a span body over x [n_tok, n_heads, head_dim]: one per rotation pair and one per
// pass-through element (dims past n_dims) of each head. Sets th = t * n_heads + h and k (k < half: pair
// k, else element n_dims + k - half).
DEVICE void span_item(long long g, int n_heads, int head_dim, int n_dims, int* t, long long* th, int* k) {
    const int per_head = n_dims / 2 + (head_dim - n_dims);
    *k = (int)(g % per_head);
    *th = g / per_head;
    *t = (int)(*th / n_heads);
}

// y[t, h, j] for x [n_tok, n_heads, head_dim], y contiguous; head (t, h) of x starts at
// x + t * x_tok + h * x_head (a row-strided view read in place, e.g. q of a stacked q|k|v product).
// y may alias x (in-place rope after a norm, x then contiguous): one thread owns both elements of a
// pair, reading both before writing either.
DEVICE void rope_span(const float* x, const int* __restrict__ pos, const double* __restrict__ inv_freq, float* y,
                      int n_tok, int n_heads, int head_dim, int n_dims, int neox, double freq_scale, long long x_tok,
                      long long x_head, long long first, long long step) {
    const int half = n_dims / 2;
    const long long n = (long long)n_tok * n_heads * (half + head_dim - n_dims);
    for (long long g = first; g < n; g += step) {
        int t, k;
        long long th;
        span_item(g, n_heads, head_dim, n_dims, &t, &th, &k);
        const float* xh = x + t * x_tok + (th - (long long)t * n_heads) * x_head;
        float* yh = y + th * head_dim;
        if (k >= half) {  // dims past n_dims pass through
            const int j = n_dims + (k - half);
            yh[j] = xh[j];
            continue;
        }
        int j0, j1;
        pair_cols(k, half, neox, &j0, &j1);
        double s, c;
        sincos((double)pos[t] * freq_scale * inv_freq[k], &s, &c);
        float r0, r1;
        rotate_pair(xh[j0], xh[j1], c, s, &r0, &r1);
        yh[j0] = r0;
        yh[j1] = r1;
    }
}

#define SPAN_ARGS (long long)blockIdx.x * blockDim.x + threadIdx.x, (long long)gridDim.x * blockDim.x

extern "C" __global__ void rope_f32(const float* x, const int* __restrict__ pos, const double* __restrict__ inv_freq,
                                    float* y, int n_tok, int n_heads, int head_dim, int n_dims, int neox,
                                    double freq_scale, long long x_tok, long long x_head) {
    PDL_ENTRY();
    rope_span(x, pos, inv_freq, y, n_tok, n_heads, head_dim, n_dims, neox, freq_scale, x_tok, x_head, SPAN_ARGS);
}

// cache[rows[t], :] = rope(x, pos)[t] for x [n_tok, n_heads, head_dim], roped K written straight into
// the cache (f32 or f16 bits); head (t, h) of x starts at x + t * x_tok + h * x_head (K read in place
// from a stacked q|k|v product). A row outside 0..cap-1 is reported, never written.
template <typename T>
DEVICE void rope_set_rows_span(T* cache, const float* __restrict__ x, const int* __restrict__ pos,
                               const int* __restrict__ rows, const double* __restrict__ inv_freq, int n_tok,
                               int n_heads, int head_dim, int n_dims, int neox, double freq_scale, int cap,
                               int* errflag, int code, long long x_tok, long long x_head, long long first,
                               long long step) {
    const int half = n_dims / 2;
    const long long n = (long long)n_tok * n_heads * (half + head_dim - n_dims);
    for (long long g = first; g < n; g += step) {
        int t, k;
        long long th;
        span_item(g, n_heads, head_dim, n_dims, &t, &th, &k);
        const int r = rows[t];
        if (r < 0 || r >= cap) {
            report_error(errflag, code, r);
            continue;
        }
        const float* xh = x + t * x_tok + (th - (long long)t * n_heads) * x_head;
        T* ch = cache + ((long long)r * n_heads + (th - (long long)t * n_heads)) * head_dim;
        if (k >= half) {
            const int j = n_dims + (k - half);
            put(ch + j, xh[j]);
            continue;
        }
        int j0, j1;
        pair_cols(k, half, neox, &j0, &j1);
        double s, c;
        sincos((double)pos[t] * freq_scale * inv_freq[k], &s, &c);
        float r0, r1;
        rotate_pair(xh[j0], xh[j1], c, s, &r0, &r1);
        put(ch + j0, r0);
        put(ch + j1, r1);
    }
}

// ---------------------------------------------------------------- q/k norm and rope, a lane group per head row
// y[t, h, :] = rope(rms_norm(x[t, h, :]) * w, pos[t]) for x [n_tok, n_heads, head_dim] and w [head_dim]:
// the q/k norm of Qwen3-style attention and its rotation in one pass (the rms in f32, the normed value
// v * inv * w[j] in f32, rotated in double). Head (t, h) of x starts at x + t * x_tok + h * x_head: q read
// in place from the projection (Qwen3.5 interleaves q and its gate per head; Qwen3 stacks q|k|v).
//
// A block is blockDim / 32 lane groups of 32 (a warp on CUDA, half a wavefront on gfx9); a group takes rpg
// head rows (rows per group, lowering: 1 for small grids, decode; up to NORM_ROPE_SLOTS / U at prefill
// sizes), each row's sum of squares reduced by shuffles within the group, never through shared memory.
// The block's groups * rpg rows are tb consecutive tokens (lowering: tb > 1 only when n_heads is below
// the rows) times hb = min(n_heads, groups * rpg / tb) heads of each; blocks run over token groups, then
// head groups. Row q < tb * hb of the block (token q / hb, head q % hb) is group q % groups's row
// q / groups, so a block's idle rows spread over its groups. At prefill sizes a block covers all heads of
// its tokens: Qwen3-8B's q (32 heads of 128) one token a block, its K (8 heads) four.
//
// The block fills a table of the cos and sin of its tokens' angles (shared, 16 * tb * half bytes), so a
// (token, pair) angle's sincos is computed once a block, once a token when the block covers all its heads.
// Every row load of the block is issued before that FP64 work, which so hides under their latency (the
// rows' sums of squares come after it). A row's arithmetic, and the order of its sum, do not depend on
// the geometry: any rpg gives the bits of rpg 1.
//
// Lane l of a group holds units u = l + 32 k (k < U) of each of its rows in registers: unit u < half is
// rotation pair u, unit u >= half the pass-through element n_dims + 2 (u - half) and the next one (when
// < head_dim). U (1, 2 or 4: head rows of up to 64, 128, 256 columns) is a template argument, so a lane
// holds rpg <= NORM_ROPE_SLOTS / U rows of U units; head_dim <= 2 * 32 * 4 = 256, lowering.py takes the
// unfused kernels for wider heads. (Keep these numbers in step with lowering.py.)
#define NORM_ROPE_GROUP 32
#define NORM_ROPE_SLOTS 8
// Every norm-rope launch has 256 threads (lowering.py NORM_ROPE_THREADS); a thread keeps up to 8 units (64
// bytes) of row loads in flight, and four blocks an SM (at most 64 registers) 64 KB an SM. sm_80/sm_90,
// nvcc 13.0 and NVRTC 13.5: 60-64 registers, no spills (the 40-byte stack frame is sincos's slow path);
// gfx90a: 80 VGPRs, no scratch.
#define NORM_ROPE_THREADS 256
#if defined(__HIPCC__)
#define NORM_ROPE_BOUNDS __launch_bounds__(NORM_ROPE_THREADS)
#else
#define NORM_ROPE_BOUNDS __launch_bounds__(NORM_ROPE_THREADS, 4)
#endif

// Sum over the 32 lanes of a lane group (the XOR partners of offsets < 32 stay inside it in any wave size).
DEVICE float group_sum(float v) {
#pragma unroll
    for (int o = NORM_ROPE_GROUP / 2; o > 0; o >>= 1) v += SHFL_XOR(v, o);
    return v;
}

// The columns of unit u (above): neox pairs (u, u + half), else (2u, 2u + 1), which is also where the
// pass-through unit u >= half starts (n_dims + 2 (u - half) = 2u).
DEVICE void unit_cols(int u, int half, int neox, int* ja, int* jb) {
    const bool split = neox && u < half;
    *ja = split ? u : 2 * u;
    *jb = *ja + (split ? half : 1);
}

// Where the rows of the norm-rope bodies go: y [n_tok, n_heads, head_dim] contiguous (rows == nullptr),
// or K cache rows cache[rows[t], h, :] (f32 or f16 bits; a row outside 0..cap-1 is reported, never
// written).
template <typename T>
struct NormRopeOut {
    T* out;
    const int* __restrict__ rows;
    int cap;
    int* errflag;
    int code;
};

// The body of block b for rows of U units a lane (above). `cs` is the block's dynamic shared memory: the
// cos/sin table (2 * tb * half doubles), then the tokens' KV rows (tb ints, read with the table so that no
// load waits behind the barrier). Every thread reaches the one __syncthreads.
template <typename T, int U>
DEVICE void norm_rope_rows(NormRopeOut<T> o, const float* x, const float* __restrict__ w,
                           const int* __restrict__ pos, const double* __restrict__ inv_freq, int n_tok, int n_heads,
                           int head_dim, int n_dims, int neox, double freq_scale, float eps, long long x_tok,
                           long long x_head, int tb, int rpg, int b, double* cs) {
    constexpr int R = NORM_ROPE_SLOTS / U;  // rows a lane can hold; rpg <= R
    const int groups = blockDim.x / NORM_ROPE_GROUP, g = threadIdx.x / NORM_ROPE_GROUP;
    const int lane = threadIdx.x % NORM_ROPE_GROUP;
    const int hb = min(n_heads, groups * rpg / tb), n_hg = (n_heads + hb - 1) / hb;
    const int t0 = b / n_hg * tb, h0 = b % n_hg * hb;
    const int half = n_dims / 2, n_units = half + (head_dim - n_dims + 1) / 2;
    int* rs = (int*)(cs + 2 * tb * half);

    // The group's rows: row i is block row g + groups i, token tt = its quotient by hb, head h0 + the rest
    // (th[i] = tt << 16 | head, or -1 when it has none). Their loads are issued before the table's FP64 work.
    int th[R];
    float va[R][U], vb[R][U];
    {
        int tt = g / hb, hr = g - tt * hb;  // row 0, then a step of groups rows at a time
        const int dt = groups / hb, dr = groups - dt * hb;
#pragma unroll
        for (int i = 0; i < R; ++i) {
            if (i >= rpg) continue;  // uniform over the block (continue, not break: hipcc then unrolls)
            const bool has = tt < tb && t0 + tt < n_tok && h0 + hr < n_heads;
            th[i] = has ? tt << 16 | (h0 + hr) : -1;
            const float* xh = x + (t0 + tt) * x_tok + (h0 + hr) * x_head;  // read only when has
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const int u = lane + NORM_ROPE_GROUP * k;
                int ja, jb;
                unit_cols(u, half, neox, &ja, &jb);
                va[i][k] = has && u < n_units ? xh[ja] : 0.0f;
                vb[i][k] = has && u < n_units && jb < head_dim ? xh[jb] : 0.0f;
            }
            tt += dt;
            hr += dr;
            if (hr >= hb) {
                hr -= hb;
                ++tt;
            }
        }
    }
    if (o.rows && threadIdx.x < tb && t0 + threadIdx.x < n_tok) rs[threadIdx.x] = o.rows[t0 + threadIdx.x];
    for (int i = threadIdx.x; i < tb * half; i += blockDim.x) {  // cs[2 it half + k] = cos, then half sines
        const int it = i / half, k = i - it * half;
        if (t0 + it < n_tok) {
            double s, c;
            sincos((double)pos[t0 + it] * freq_scale * inv_freq[k], &s, &c);
            cs[2 * it * half + k] = c;
            cs[(2 * it + 1) * half + k] = s;
        }
    }
    // Each row normed: its sum of squares over the group (a lane's units in order, then the butterfly). The
    // weights of the lane's columns, the same in each of its rows, are loaded once (not before the table:
    // their registers would be live through its FP64 work).
    float wa[U], wb[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
        const int u = lane + NORM_ROPE_GROUP * k;
        int ja, jb;
        unit_cols(u, half, neox, &ja, &jb);
        wa[k] = u < n_units ? w[ja] : 0.0f;
        wb[k] = u < n_units && jb < head_dim ? w[jb] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
        if (i >= rpg) continue;  // every lane of a group shuffles
        float ss = 0.0f;
#pragma unroll
        for (int k = 0; k < U; ++k) ss += va[i][k] * va[i][k] + vb[i][k] * vb[i][k];
        const float inv = 1.0f / sqrtf(group_sum(ss) / (float)head_dim + eps);
#pragma unroll
        for (int k = 0; k < U; ++k) {
            va[i][k] = va[i][k] * inv * wa[k];
            vb[i][k] = vb[i][k] * inv * wb[k];
        }
    }
    __syncthreads();  // the table is filled
#pragma unroll
    for (int i = 0; i < R; ++i) {
        if (i >= rpg || th[i] < 0) continue;
        const int tt = th[i] >> 16, h = th[i] & 0xffff;
        const int r = o.rows ? rs[tt] : t0 + tt;
        if (o.rows && (r < 0 || r >= o.cap)) {
            if (lane == 0) report_error(o.errflag, o.code, r);
            continue;
        }
        T* yh = o.out + ((long long)r * n_heads + h) * head_dim;
        const double* c = cs + 2 * tt * half;
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int u = lane + NORM_ROPE_GROUP * k;
            if (u >= n_units) continue;
            int ja, jb;
            unit_cols(u, half, neox, &ja, &jb);
            if (u < half) {
                float r0, r1;
                rotate_pair(va[i][k], vb[i][k], c[u], c[half + u], &r0, &r1);
                put(yh + ja, r0);
                put(yh + jb, r1);
            } else {
                put(yh + ja, va[i][k]);
                if (jb < head_dim) put(yh + jb, vb[i][k]);
            }
        }
    }
}

// Block b of a norm-rope launch: the body for the units a lane holds of the rows' width.
template <typename T>
DEVICE void norm_rope_block(NormRopeOut<T> o, const float* x, const float* __restrict__ w,
                            const int* __restrict__ pos, const double* __restrict__ inv_freq, int n_tok, int n_heads,
                            int head_dim, int n_dims, int neox, double freq_scale, float eps, long long x_tok,
                            long long x_head, int tb, int rpg, int b, double* cs) {
    const int n_units = n_dims / 2 + (head_dim - n_dims + 1) / 2;
    if (n_units > 2 * NORM_ROPE_GROUP)
        norm_rope_rows<T, 4>(o, x, w, pos, inv_freq, n_tok, n_heads, head_dim, n_dims, neox, freq_scale, eps, x_tok,
                             x_head, tb, rpg, b, cs);
    else if (n_units > NORM_ROPE_GROUP)
        norm_rope_rows<T, 2>(o, x, w, pos, inv_freq, n_tok, n_heads, head_dim, n_dims, neox, freq_scale, eps, x_tok,
                             x_head, tb, rpg, b, cs);
    else
        norm_rope_rows<T, 1>(o, x, w, pos, inv_freq, n_tok, n_heads, head_dim, n_dims, neox, freq_scale, eps, x_tok,
                             x_head, tb, rpg, b, cs);
}

extern "C" __global__ void NORM_ROPE_BOUNDS rms_norm_mul_rope_f32(const float* x, const float* __restrict__ w,
                                                 const int* __restrict__ pos, const double* __restrict__ inv_freq,
                                                 float* y, int n_tok, int n_heads, int head_dim, int n_dims, int neox,
                                                 double freq_scale, float eps, long long x_tok, long long x_head,
                                                 int tb, int rpg) {
    PDL_ENTRY();
    extern __shared__ double rope_cs[];  // 2 * tb * half
    norm_rope_block(NormRopeOut<float>{y, nullptr, 0, nullptr, 0}, x, w, pos, inv_freq, n_tok, n_heads, head_dim,
                    n_dims, neox, freq_scale, eps, x_tok, x_head, tb, rpg, blockIdx.x, rope_cs);
}

// dst[rows[t], :] = src[t, :] for src [n_tok, ...] f32 into an f32 or f16 State [cap, ...] (set_rows).
// src is row-strided: element c of outer index o (its axes but the last, flattened) is at
// src[(o / d1) * s0 + (o % d1) * s1 + c], c < inner (lowering.py collapses the outer axes to two).
// A row outside 0..cap-1 is reported and not written.
#define DEFINE_SET_ROWS_SPAN(SUF, T, STORE)                                                                        \
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
DEVICE float store_f32(float v) { return v; }
DEFINE_SET_ROWS_SPAN(f32, float, store_f32)
DEFINE_SET_ROWS_SPAN(f16, u16, f32_to_f16)

// The KV cache kernels, per cache type: rope_set_rows (above), rms_norm_mul_rope_set_rows (the norm-rope
// rows written straight into the cache: Qwen3's K, the body of rms_norm_mul_rope_f32, so it equals that
// kernel followed by set_rows bit for bit with an f32 cache), set_rows.
#define DEFINE_KV_KERNELS(SUF, T)                                                                                  \
    extern "C" __global__ void rope_set_rows_##SUF(T* cache, const float* __restrict__ x, const int* __restrict__ pos, \
                                                   const int* __restrict__ rows, const double* __restrict__ inv_freq, \
                                                   int n_tok, int n_heads, int head_dim, int n_dims, int neox,     \
                                                   double freq_scale, int cap, int* errflag, int code,             \
                                                   long long x_tok, long long x_head) {                            \
        PDL_ENTRY();                                                                                               \
        rope_set_rows_span(cache, x, pos, rows, inv_freq, n_tok, n_heads, head_dim, n_dims, neox, freq_scale, cap, \
                           errflag, code, x_tok, x_head, SPAN_ARGS);                                               \
    }                                                                                                              \
    extern "C" __global__ void NORM_ROPE_BOUNDS rms_norm_mul_rope_set_rows_##SUF(                                                   \
        T* cache, const float* x, const float* __restrict__ w, const int* __restrict__ pos,                         \
        const int* __restrict__ rows, const double* __restrict__ inv_freq, int n_tok, int n_heads, int head_dim,   \
        int n_dims, int neox, double freq_scale, float eps, int cap, int* errflag, int code, long long x_tok,      \
        long long x_head, int tb, int rpg) {                                                                       \
        PDL_ENTRY();                                                                                               \
        extern __shared__ double rope_cs[];                                                                        \
        norm_rope_block(NormRopeOut<T>{cache, rows, cap, errflag, code}, x, w, pos, inv_freq, n_tok, n_heads,      \
                        head_dim, n_dims, neox, freq_scale, eps, x_tok, x_head, tb, rpg, blockIdx.x, rope_cs);     \
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
// concatenates their launch arguments), then nq and nk; q and K were launched with this block size, and
// the norm-rope bodies take their block index relative to their range. Every body is the one its own
// kernel runs, so the results are bitwise those of the three launches.
#define V_PARAMS(T)                                                                                                \
    T *v_dst, const float *__restrict__ v_src, const int *__restrict__ v_rows, int v_n_tok, long long v_row,      \
        int v_cap, int *v_errflag, int v_code, int v_inner, int v_d1, long long v_s0, long long v_s1
#define V_SEGMENT(SUF, b0)                                                                                         \
    set_rows_span_##SUF(v_dst, v_src, v_rows, v_n_tok, v_row, v_cap, v_errflag, v_code, v_inner, v_d1, v_s0, v_s1, \
                        (long long)(blockIdx.x - (b0)) * blockDim.x + threadIdx.x,                                 \
                        (long long)(gridDim.x - (b0)) * blockDim.x)

#define DEFINE_QKV(SUF, T)                                                                                         \
    extern "C" __global__ void NORM_ROPE_BOUNDS qkv_norm_rope_##SUF(                                                                \
        const float* q_x, const float* __restrict__ q_w, const int* __restrict__ q_pos,                            \
        const double* __restrict__ q_inv_freq, float* q_y, int q_n_tok, int q_n_heads, int q_head_dim,             \
        int q_n_dims, int q_neox, double q_freq_scale, float q_eps, long long q_x_tok, long long q_x_head, int q_tb, \
        int q_rpg, T* k_cache, const float* k_x, const float* __restrict__ k_w, const int* __restrict__ k_pos,      \
        const int* __restrict__ k_rows, const double* __restrict__ k_inv_freq, int k_n_tok, int k_n_heads,         \
        int k_head_dim, int k_n_dims, int k_neox, double k_freq_scale, float k_eps, int k_cap, int* k_errflag,     \
        int k_code, long long k_x_tok, long long k_x_head, int k_tb, int k_rpg, V_PARAMS(T), int nq, int nk) {    \
        PDL_ENTRY();                                                                                               \
        extern __shared__ double rope_cs[];                                                                        \
        const int b = blockIdx.x;                                                                                  \
        if (b < nq)                                                                                                \
            norm_rope_block(NormRopeOut<float>{q_y, nullptr, 0, nullptr, 0}, q_x, q_w, q_pos, q_inv_freq, q_n_tok, \
                            q_n_heads, q_head_dim, q_n_dims, q_neox, q_freq_scale, q_eps, q_x_tok, q_x_head, q_tb, \
                            q_rpg, b, rope_cs);                                                                    \
        else if (b < nq + nk)                                                                                      \
            norm_rope_block(NormRopeOut<T>{k_cache, k_rows, k_cap, k_errflag, k_code}, k_x, k_w, k_pos, k_inv_freq, \
                            k_n_tok, k_n_heads, k_head_dim, k_n_dims, k_neox, k_freq_scale, k_eps, k_x_tok,        \
                            k_x_head, k_tb, k_rpg, b - nq, rope_cs);                                               \
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
            rope_set_rows_span(k_cache, k_x, k_pos, k_rows, k_inv_freq, k_n_tok, k_n_heads, k_head_dim, k_n_dims,  \
                               k_neox, k_freq_scale, k_cap, k_errflag, k_code, k_x_tok, k_x_head,                  \
                               (long long)(b - nq) * blockDim.x + threadIdx.x, (long long)nk * blockDim.x);        \
        else                                                                                                       \
            V_SEGMENT(SUF, nq + nk);                                                                               \
    }
DEFINE_QKV(f32, float)
DEFINE_QKV(f16, u16)
