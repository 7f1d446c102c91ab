// Rotary position embedding, and the KV cache row writes (roped K, and set_rows for V). The angle
// pos * freq_scale * inv_freq[i] is formed and rotated in double precision, as the op table's
// reference does: at position 4000 an f32 angle is already off by ~2e-4 rad, more than the 1e-5 the
// tests allow. Each pair's sincos is computed once (FP64 is ~1/2 of the FP32 rate on an H200 at best,
// and a double sincos is dozens of DFMAs): per pair in the span kernels, per (token, pair) in the
// norm-rope kernels, whose blocks share one token's table in shared memory.
#include "common.cuh"

// The pair (a, b) rotated by the angle whose cosine and sine are c and s: (a c - b s, a s + b c), each with
// its fused multiply-add spelled out, so that every kernel inlining it rounds alike.
DEVICE void rotate_pair(double a, double b, double c, double s, float* r0, float* r1) {
    *r0 = (float)fma(a, c, -(b * s));
    *r1 = (float)fma(a, s, b * c);
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
// of head rows each (NORM_ROPE_ROWS below). The qkv_* kernels at the end run three bodies side by side
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
// A block is blockDim / 32 lane groups of 32 (a warp on CUDA, half a wavefront on gfx9), each one head
// row; the row's sum of squares is reduced by shuffles within its group, never through shared memory.
// A block takes tb consecutive tokens (lowering: tb > 1 only when n_heads is below the groups) and
// hb = min(n_heads, groups / tb) heads of each; blocks run over token groups, then head groups. The block
// first fills a table of the cos and sin of its tokens' angles (shared, 16 * tb * half bytes), so a
// (token, pair) angle's sincos is computed once a block rather than once an element: the FP64 work of
// a row was 2 * half sincos, it is half * tb / rows-in-the-block.
//
// Lane l of a group holds units u = l + 32 k (k < NORM_ROPE_UNITS) in registers: unit u < half is
// rotation pair u, unit u >= half the pass-through element n_dims + 2 (u - half) and the next one (when
// < head_dim). Hence head_dim <= 2 * 32 * NORM_ROPE_UNITS = 256; lowering.py takes the unfused kernels
// for wider heads. (Keep both numbers in step with lowering.py.)
#define NORM_ROPE_GROUP 32
#define NORM_ROPE_UNITS 4
// Every norm-rope launch has 256 threads (8 rows a block; lowering.py NORM_ROPE_THREADS). Six blocks an SM
// keep 48 warps' row loads in flight: at most 40 registers (sm_90, NVRTC 13: 44-46 without the bound,
// 4-8 bytes of spill with it).
#define NORM_ROPE_THREADS 256
#if defined(__HIPCC__)
#define NORM_ROPE_BOUNDS __launch_bounds__(NORM_ROPE_THREADS)
#else
#define NORM_ROPE_BOUNDS __launch_bounds__(NORM_ROPE_THREADS, 6)
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

// a^2 + b^2 with its one fused multiply-add spelled out, so that the one-row and the _wide bodies, whose code
// around it differs, round a row's sum of squares alike (the compiler's own contraction need not agree).
DEVICE float square_pair(float a, float b) { return fmaf(a, a, b * b); }

// The block's table of its tokens' angles: cs[2 it half + k] = cos of token t0 + it's pair k, then the half
// sines; one sincos per (token, pair) of the block.
DEVICE void fill_rope_table(double* cs, const int* __restrict__ pos, const double* __restrict__ inv_freq,
                            double freq_scale, int t0, int tb, int n_tok, int half) {
    for (int i = threadIdx.x; i < tb * half; i += blockDim.x) {
        const int it = i / half, k = i - it * half;
        if (t0 + it < n_tok) {
            double s, c;
            sincos((double)pos[t0 + it] * freq_scale * inv_freq[k], &s, &c);
            cs[2 * it * half + k] = c;
            cs[(2 * it + 1) * half + k] = s;
        }
    }
}

// A lane's U units of a normed row (va, vb: the unit's two columns) rotated by the token's table c and stored
// at yh; pass-through units stored as they are.
template <int U, typename T>
DEVICE void write_rope_row(T* yh, const float* va, const float* vb, const double* c, int lane, int half,
                           int n_units, int neox, int head_dim) {
#pragma unroll
    for (int k = 0; k < U; ++k) {
        const int u = lane + NORM_ROPE_GROUP * k;
        if (u >= n_units) break;
        int ja, jb;
        unit_cols(u, half, neox, &ja, &jb);
        if (u < half) {
            float r0, r1;
            rotate_pair(va[k], vb[k], c[u], c[half + u], &r0, &r1);
            put(yh + ja, r0);
            put(yh + jb, r1);
        } else {
            put(yh + ja, va[k]);
            if (jb < head_dim) put(yh + jb, vb[k]);
        }
    }
}

// The body of block b: y rows (rows == nullptr: y [n_tok, n_heads, head_dim] contiguous), or K cache rows
// (cache[rows[t], h, :], f32 or f16 bits; a row outside 0..cap-1 is reported, never written). `cs` is the
// block's dynamic shared memory. Every thread reaches the one __syncthreads; a group with no row, or
// whose KV row is out of range, returns after it.
template <typename T>
DEVICE void norm_rope_block(T* out, const int* __restrict__ rows, int cap, int* errflag, int code, const float* x,
                            const float* __restrict__ w, const int* __restrict__ pos,
                            const double* __restrict__ inv_freq, int n_tok, int n_heads, int head_dim, int n_dims,
                            int neox, double freq_scale, float eps, long long x_tok, long long x_head, int tb, int b,
                            double* cs) {
    const int groups = blockDim.x / NORM_ROPE_GROUP, g = threadIdx.x / NORM_ROPE_GROUP;
    const int lane = threadIdx.x % NORM_ROPE_GROUP;
    const int hb = min(n_heads, groups / tb), n_hg = (n_heads + hb - 1) / hb;
    const int t0 = b / n_hg * tb, tt = g / hb, t = t0 + tt, h = b % n_hg * hb + g % hb;
    const bool has_row = tt < tb && t < n_tok && h < n_heads;
    const int half = n_dims / 2, n_units = half + (head_dim - n_dims + 1) / 2;

    // the row, its sum of squares and its normed values (loads issued before the table's FP64 work)
    const float* xh = x + t * x_tok + h * x_head;  // read only when has_row
    float va[NORM_ROPE_UNITS], vb[NORM_ROPE_UNITS], ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_ROPE_UNITS; ++k) {
        const int u = lane + NORM_ROPE_GROUP * k;
        int ja, jb;
        unit_cols(u, half, neox, &ja, &jb);
        va[k] = has_row && u < n_units ? xh[ja] : 0.0f;
        vb[k] = has_row && u < n_units && jb < head_dim ? xh[jb] : 0.0f;
        ss += square_pair(va[k], vb[k]);
    }
    fill_rope_table(cs, pos, inv_freq, freq_scale, t0, tb, n_tok, half);
    ss = group_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)head_dim + eps);
    const int r = has_row && rows ? rows[t] : 0;
    if (has_row) {
#pragma unroll
        for (int k = 0; k < NORM_ROPE_UNITS; ++k) {
            const int u = lane + NORM_ROPE_GROUP * k;
            int ja, jb;
            unit_cols(u, half, neox, &ja, &jb);
            if (u < n_units) va[k] = va[k] * inv * w[ja];
            if (u < n_units && jb < head_dim) vb[k] = vb[k] * inv * w[jb];
        }
    }
    __syncthreads();  // the table is filled
    if (!has_row) return;
    if (rows && (r < 0 || r >= cap)) {
        if (lane == 0) report_error(errflag, code, r);
        return;
    }
    write_rope_row<NORM_ROPE_UNITS>(out + ((long long)(rows ? r : t) * n_heads + h) * head_dim, va, vb,
                                    cs + 2 * tt * half, lane, half, n_units, neox, head_dim);
}

extern "C" __global__ void NORM_ROPE_BOUNDS rms_norm_mul_rope_f32(const float* x, const float* __restrict__ w,
                                                 const int* __restrict__ pos, const double* __restrict__ inv_freq,
                                                 float* y, int n_tok, int n_heads, int head_dim, int n_dims, int neox,
                                                 double freq_scale, float eps, long long x_tok, long long x_head,
                                                 int tb) {
    PDL_ENTRY();
    extern __shared__ double rope_cs[];  // 2 * tb * half
    norm_rope_block(y, (const int*)nullptr, 0, (int*)nullptr, 0, x, w, pos, inv_freq, n_tok, n_heads, head_dim, n_dims,
                    neox, freq_scale, eps, x_tok, x_head, tb, blockIdx.x, rope_cs);
}

// ---------------------------------------------------------------- the same at prefill sizes: rows a lane group
// rms_norm_mul_rope_wide_f32 / rms_norm_mul_rope_set_rows_wide_<kv>: norm_rope_block's result, bit for bit,
// with a lane group taking rpg head rows (lowering: only where the launch keeps NORM_ROPE_FILL_BLOCKS blocks,
// i.e. prefill), so a block covers all heads of its tokens (Qwen3-8B's q: one token's 32 heads a block, its
// table once instead of 4 times; K: 4 tokens a block) and every row load of the block is issued before the
// table's FP64 work, which then hides under their latency. Qwen3-8B's 4096-token q norm-rope: 3.60 -> 2.27 ms
// (H200, 2026-12-01). Decode keeps norm_rope_block: one version of this body serving decode too (a run-time
// rpg of 1) made Qwen3-0.6B's captured step slower (897 -> 995 us in one run), cause not found.
//
// Block row q < tb * hb (token q / hb, head q % hb) is group q % groups's row q / groups, so idle rows spread
// over the groups. A lane holds U units (U = 1, 2, 4: head rows of up to 64, 128, 256 columns) of each of its
// rows, at most NORM_ROPE_SLOTS units in all: rpg <= NORM_ROPE_SLOTS / U. A row's arithmetic, and the order of
// its sum, are norm_rope_block's. `cs`: the cos/sin table, then the tokens' KV rows (tb ints, read with the
// table so no load waits behind the barrier). Every thread reaches the one __syncthreads.
#define NORM_ROPE_SLOTS 8
// 64 registers at most (four blocks an SM, 64 KB of row loads in flight an SM); sm_80/sm_90: 60-64, no spills.
#if defined(__HIPCC__)
#define NORM_ROPE_WIDE_BOUNDS __launch_bounds__(NORM_ROPE_THREADS)
#else
#define NORM_ROPE_WIDE_BOUNDS __launch_bounds__(NORM_ROPE_THREADS, 4)
#endif

template <typename T, int U>
DEVICE void norm_rope_rows(T* out, const int* __restrict__ rows, int cap, int* errflag, int code, const float* x,
                           const float* __restrict__ w, const int* __restrict__ pos,
                           const double* __restrict__ inv_freq, int n_tok, int n_heads, int head_dim, int n_dims,
                           int neox, double freq_scale, float eps, long long x_tok, long long x_head, int tb, int rpg,
                           double* cs) {
    constexpr int R = NORM_ROPE_SLOTS / U;  // rows a lane can hold; rpg <= R
    const int groups = blockDim.x / NORM_ROPE_GROUP, g = threadIdx.x / NORM_ROPE_GROUP;
    const int lane = threadIdx.x % NORM_ROPE_GROUP;
    const int hb = min(n_heads, groups * rpg / tb), n_hg = (n_heads + hb - 1) / hb;
    const int t0 = blockIdx.x / n_hg * tb, h0 = blockIdx.x % n_hg * hb;
    const int half = n_dims / 2, n_units = half + (head_dim - n_dims + 1) / 2;
    int* rs = (int*)(cs + 2 * tb * half);

    // The group's rows: row i is block row g + groups i (th[i] = token << 16 | head, or -1 for none).
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
    if (rows && threadIdx.x < tb && t0 + threadIdx.x < n_tok) rs[threadIdx.x] = rows[t0 + threadIdx.x];
    fill_rope_table(cs, pos, inv_freq, freq_scale, t0, tb, n_tok, half);
    // The weights of the lane's columns, the same in each of its rows, loaded once (not before the table:
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
        for (int k = 0; k < U; ++k) ss += square_pair(va[i][k], vb[i][k]);
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
        const int r = rows ? rs[tt] : t0 + tt;
        if (rows && (r < 0 || r >= cap)) {
            if (lane == 0) report_error(errflag, code, r);
            continue;
        }
        write_rope_row<U>(out + ((long long)r * n_heads + h) * head_dim, va[i], vb[i], cs + 2 * tt * half, lane,
                          half, n_units, neox, head_dim);
    }
}

// The body for the units a lane holds of the rows' width.
template <typename T>
DEVICE void norm_rope_wide(T* out, const int* __restrict__ rows, int cap, int* errflag, int code, const float* x,
                           const float* __restrict__ w, const int* __restrict__ pos,
                           const double* __restrict__ inv_freq, int n_tok, int n_heads, int head_dim, int n_dims,
                           int neox, double freq_scale, float eps, long long x_tok, long long x_head, int tb, int rpg,
                           double* cs) {
    const int n_units = n_dims / 2 + (head_dim - n_dims + 1) / 2;
#define NORM_ROPE_WIDE_BODY(U)                                                                                     \
    norm_rope_rows<T, U>(out, rows, cap, errflag, code, x, w, pos, inv_freq, n_tok, n_heads, head_dim, n_dims, neox, \
                         freq_scale, eps, x_tok, x_head, tb, rpg, cs)
    if (n_units > 2 * NORM_ROPE_GROUP)
        NORM_ROPE_WIDE_BODY(4);
    else if (n_units > NORM_ROPE_GROUP)
        NORM_ROPE_WIDE_BODY(2);
    else
        NORM_ROPE_WIDE_BODY(1);
#undef NORM_ROPE_WIDE_BODY
}

extern "C" __global__ void NORM_ROPE_WIDE_BOUNDS rms_norm_mul_rope_wide_f32(
    const float* x, const float* __restrict__ w, const int* __restrict__ pos, const double* __restrict__ inv_freq,
    float* y, int n_tok, int n_heads, int head_dim, int n_dims, int neox, double freq_scale, float eps, long long x_tok,
    long long x_head, int tb, int rpg) {
    PDL_ENTRY();
    extern __shared__ double rope_cs[];  // 2 * tb * half doubles, then tb ints
    norm_rope_wide(y, (const int*)nullptr, 0, (int*)nullptr, 0, x, w, pos, inv_freq, n_tok, n_heads, head_dim, n_dims,
                   neox, freq_scale, eps, x_tok, x_head, tb, rpg, rope_cs);
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

// set_rows, 4 consecutive elements a thread: one 16-byte load, one 16- or 8-byte store (lowering: inner, both
// outer strides multiples of 4 and both buffers 16-byte aligned). The body above spends three 64-bit
// divisions on each element; a prefill's V write (Qwen3-8B, 4096 tokens) ran at ~25 % of copy bandwidth.
DEVICE void store4(float* p, f32x4 v) { *(f32x4*)p = v; }
DEVICE void store4(u16* p, f32x4 v) { *(u16x4*)p = u16x4{f32_to_f16(v.x), f32_to_f16(v.y), f32_to_f16(v.z), f32_to_f16(v.w)}; }
template <typename T>
DEVICE void set_rows_v4_span(T* dst, const float* __restrict__ src, const int* __restrict__ rows, int n_tok,
                             long long row, int cap, int* errflag, int code, int inner, int d1, long long s0,
                             long long s1, long long first, long long step) {
    const long long n = n_tok * row / 4;
    for (long long i4 = first; i4 < n; i4 += step) {
        const long long i = 4 * i4;
        const int t = (int)(i / row);
        const int r = rows[t];
        if (r < 0 || r >= cap) {
            if (i == (long long)t * row) report_error(errflag, code, r);  // once a row
            continue;
        }
        const long long o = i / inner, o0 = o / d1;
        store4(dst + (long long)r * row + (i - (long long)t * row), *(const f32x4*)(src + o0 * s0 + (o - o0 * d1) * s1 + (i - o * inner)));
    }
}

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
        long long x_head, int tb) {                                                                                \
        PDL_ENTRY();                                                                                               \
        extern __shared__ double rope_cs[];                                                                        \
        norm_rope_block(cache, rows, cap, errflag, code, x, w, pos, inv_freq, n_tok, n_heads, head_dim, n_dims,    \
                        neox, freq_scale, eps, x_tok, x_head, tb, blockIdx.x, rope_cs);                            \
    }                                                                                                              \
    extern "C" __global__ void set_rows_##SUF(T* dst, const float* __restrict__ src, const int* __restrict__ rows, \
                                              int n_tok, long long row, int cap, int* errflag, int code, int inner, \
                                              int d1, long long s0, long long s1) {                                \
        PDL_ENTRY();                                                                                               \
        set_rows_span_##SUF(dst, src, rows, n_tok, row, cap, errflag, code, inner, d1, s0, s1, SPAN_ARGS);         \
    }                                                                                                              \
    extern "C" __global__ void set_rows_v4_##SUF(T* dst, const float* __restrict__ src, const int* __restrict__ rows, \
                                                 int n_tok, long long row, int cap, int* errflag, int code, int inner, \
                                                 int d1, long long s0, long long s1) {                             \
        PDL_ENTRY();                                                                                               \
        set_rows_v4_span(dst, src, rows, n_tok, row, cap, errflag, code, inner, d1, s0, s1, SPAN_ARGS);            \
    }
DEFINE_KV_KERNELS(f32, float)
DEFINE_KV_KERNELS(f16, u16)

#define DEFINE_NORM_ROPE_WIDE_KV(SUF, T)                                                                           \
    extern "C" __global__ void NORM_ROPE_WIDE_BOUNDS rms_norm_mul_rope_set_rows_wide_##SUF(                        \
        T* cache, const float* x, const float* __restrict__ w, const int* __restrict__ pos,                         \
        const int* __restrict__ rows, const double* __restrict__ inv_freq, int n_tok, int n_heads, int head_dim,   \
        int n_dims, int neox, double freq_scale, float eps, int cap, int* errflag, int code, long long x_tok,      \
        long long x_head, int tb, int rpg) {                                                                       \
        PDL_ENTRY();                                                                                               \
        extern __shared__ double rope_cs[];                                                                        \
        norm_rope_wide(cache, rows, cap, errflag, code, x, w, pos, inv_freq, n_tok, n_heads, head_dim, n_dims, neox, \
                       freq_scale, eps, x_tok, x_head, tb, rpg, rope_cs);                                          \
    }
DEFINE_NORM_ROPE_WIDE_KV(f32, float)
DEFINE_NORM_ROPE_WIDE_KV(f16, u16)

// ---------------------------------------------------------------- q, k and v of one attention layer, one launch
// An attention layer's decode step writes three independent things after its q|k|v projection: q roped
// (normed first in Qwen3), K roped into the cache, V into the cache. As three kernels each pays a
// launch-to-launch gap of a captured graph (1.5-2.7 us apiece on an H200, Qwen3-0.6B: 188 us of a
// 1,250 us step); here the three run side by side in one grid: blocks [0, nq) take q's body, [nq, nq + nk)
// K's, the rest V's. The parameters are the three kernels' own, in order (lowering.py merge_kv_writes
// concatenates their launch arguments), then nq, nk and v_vec (V's launch was set_rows_v4); q and K were launched with this block size, and
// the norm-rope bodies take their block index relative to their range. Every body is the one its own
// kernel runs, so the results are bitwise those of the three launches.
#define V_PARAMS(T)                                                                                                \
    T *v_dst, const float *__restrict__ v_src, const int *__restrict__ v_rows, int v_n_tok, long long v_row,      \
        int v_cap, int *v_errflag, int v_code, int v_inner, int v_d1, long long v_s0, long long v_s1
// V's body: set_rows_v4 where V's own launch was (v_vec), else set_rows.
#define V_SEGMENT(SUF, b0)                                                                                         \
    if (v_vec)                                                                                                     \
        set_rows_v4_span(v_dst, v_src, v_rows, v_n_tok, v_row, v_cap, v_errflag, v_code, v_inner, v_d1, v_s0, v_s1, \
                         (long long)(blockIdx.x - (b0)) * blockDim.x + threadIdx.x,                                \
                         (long long)(gridDim.x - (b0)) * blockDim.x);                                              \
    else                                                                                                           \
        set_rows_span_##SUF(v_dst, v_src, v_rows, v_n_tok, v_row, v_cap, v_errflag, v_code, v_inner, v_d1, v_s0, v_s1, \
                            (long long)(blockIdx.x - (b0)) * blockDim.x + threadIdx.x,                             \
                            (long long)(gridDim.x - (b0)) * blockDim.x)

#define DEFINE_QKV(SUF, T)                                                                                         \
    extern "C" __global__ void NORM_ROPE_BOUNDS qkv_norm_rope_##SUF(                                                                \
        const float* q_x, const float* __restrict__ q_w, const int* __restrict__ q_pos,                            \
        const double* __restrict__ q_inv_freq, float* q_y, int q_n_tok, int q_n_heads, int q_head_dim,             \
        int q_n_dims, int q_neox, double q_freq_scale, float q_eps, long long q_x_tok, long long q_x_head, int q_tb, \
        T* k_cache, const float* k_x, const float* __restrict__ k_w, const int* __restrict__ k_pos,                 \
        const int* __restrict__ k_rows, const double* __restrict__ k_inv_freq, int k_n_tok, int k_n_heads,         \
        int k_head_dim, int k_n_dims, int k_neox, double k_freq_scale, float k_eps, int k_cap, int* k_errflag,     \
        int k_code, long long k_x_tok, long long k_x_head, int k_tb, V_PARAMS(T), int nq, int nk, int v_vec) {               \
        PDL_ENTRY();                                                                                               \
        extern __shared__ double rope_cs[];                                                                        \
        const int b = blockIdx.x;                                                                                  \
        if (b < nq)                                                                                                \
            norm_rope_block(q_y, (const int*)nullptr, 0, (int*)nullptr, 0, q_x, q_w, q_pos, q_inv_freq, q_n_tok,   \
                            q_n_heads, q_head_dim, q_n_dims, q_neox, q_freq_scale, q_eps, q_x_tok, q_x_head, q_tb, \
                            b, rope_cs);                                                                           \
        else if (b < nq + nk)                                                                                      \
            norm_rope_block(k_cache, k_rows, k_cap, k_errflag, k_code, k_x, k_w, k_pos, k_inv_freq, k_n_tok,       \
                            k_n_heads, k_head_dim, k_n_dims, k_neox, k_freq_scale, k_eps, k_x_tok, k_x_head, k_tb, \
                            b - nq, rope_cs);                                                                      \
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
        long long k_x_head, V_PARAMS(T), int nq, int nk, int v_vec) {                                                         \
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
