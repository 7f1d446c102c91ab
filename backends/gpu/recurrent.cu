// Recurrent layers of Gated DeltaNet models (Qwen3.5): the causal depthwise conv step and the
// gated delta rule. Neither sees run-time indices, so neither takes an error flag. Both read their
// input state and write the new state to a separate buffer (the graph assigns it back later).
#include "common.cuh"

// ================================================================ ssm_conv
// y[t, c] = sum_j w[c, j] * xx[t + j, c] with xx = [state; x] (K-1 + n rows), then new_state =
// the last K-1 rows of xx. One thread per (channel, run of CONV_TOKENS tokens): the thread loads
// the K-1 rows before its run into a register window and slides it, so every x element is read
// about once per run, loads are coalesced across channels, and a prefill is parallel over tokens
// as well as channels (a decode step is one run per channel).
#define CONV_BLOCK 128  // threads (channels) per block; recurrent.py mirrors these two
#define CONV_TOKENS 8   // tokens per thread

// KMAX bounds the kernel width k (run-time); register arrays are indexed only with unrolled,
// compile-time indices (a run-time index would put them in local memory).
//
// In place (new_state == state) is allowed when the grid has one token run (n <= CONV_TOKENS, a
// decode or verify step): a thread reads its channel's state before it writes it, and the new
// state is written last, row r from row n + r > r, so no row is read after it was overwritten.
// state and new_state are therefore not __restrict__.
template <int KMAX, bool SILU>
DEVICE void ssm_conv_body(const float* __restrict__ x, const float* state,
                          const float* __restrict__ w, float* __restrict__ y,
                          float* new_state, int n, int channels, int k) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const int hist = k - 1;  // rows of state
    const size_t C = (size_t)channels;

    float wr[KMAX - 1], win[KMAX - 1];
#pragma unroll
    for (int j = 0; j < KMAX - 1; ++j) wr[j] = j < hist ? w[c * (size_t)k + j] : 0.0f;
    const float w_last = w[c * (size_t)k + hist];  // tap of the current token

    const int t0 = blockIdx.y * CONV_TOKENS;
#pragma unroll
    for (int j = 0; j < KMAX - 1; ++j) {  // win[j] = xx[t0 + j]; xx row r >= hist is x row r - hist < t0 <= n - 1
        const int r = t0 + j;
        float v = 0.0f;
        if (j < hist) v = r < hist ? state[r * C + c] : x[(size_t)(r - hist) * C + c];
        win[j] = v;
    }

#pragma unroll
    for (int i = 0; i < CONV_TOKENS; ++i) {
        const int t = t0 + i;
        if (t < n) {
            const float xt = x[(size_t)t * C + c];  // xx[t + hist]
            float acc = 0.0f;  // taps in order j = 0..k-1, as the reference sums them
#pragma unroll
            for (int j = 0; j < KMAX - 1; ++j)
                if (j < hist) acc += wr[j] * win[j];
            acc += w_last * xt;
            if (SILU) acc = acc / (1.0f + expf(-acc));  // expf(-acc) = inf gives -0, silu's limit
            y[(size_t)t * C + c] = acc;
#pragma unroll
            for (int j = 0; j < KMAX - 1; ++j) {  // slide: win[j] = xx[t + 1 + j]
                const int nxt = j + 1 < KMAX - 1 ? j + 1 : j;
                win[j] = j + 1 < hist ? win[nxt] : xt;
            }
        }
    }

    if (blockIdx.y == 0) {  // new_state[r] = xx[n + r]; plain copies, so bit-exact
        for (int r = 0; r < hist; ++r) {
            const int s = n + r;
            new_state[r * C + c] = s < hist ? state[s * C + c] : x[(size_t)(s - hist) * C + c];
        }
    }
}

#define DEFINE_SSM_CONV(KMAX)                                                                           \
    extern "C" __global__ void __launch_bounds__(CONV_BLOCK) ssm_conv_k##KMAX(                          \
        const float* __restrict__ x, const float* state, const float* __restrict__ w,                   \
        float* __restrict__ y, float* new_state, int n, int channels, int k) {                          \
        PDL_ENTRY();                                                                                    \
        ssm_conv_body<KMAX, false>(x, state, w, y, new_state, n, channels, k);                          \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(CONV_BLOCK) ssm_conv_silu_k##KMAX(                     \
        const float* __restrict__ x, const float* state, const float* __restrict__ w,                   \
        float* __restrict__ y, float* new_state, int n, int channels, int k) {                          \
        PDL_ENTRY();                                                                                    \
        ssm_conv_body<KMAX, true>(x, state, w, y, new_state, n, channels, k);                           \
    }

DEFINE_SSM_CONV(4)
DEFINE_SSM_CONV(8)
DEFINE_SSM_CONV(16)

// ================================================================ gated delta rule
// Per v-head h (k-head kh = h / (hv / hk)), token by token:
//   S *= exp(g_t);  kv = k_t^T S;  S += k_t (beta_t (v_t - kv))^T;  o_t = (scale q_t)^T S
// S is [dk, dv] f32. It is read once into registers, kept there across all tokens, and written
// once to new_state. Layout: a block owns GDN_TILE columns of one head's S; each column is split
// over GDN_SPLIT threads by rows (thread part p holds rows p, p + SPLIT, p + 2 SPLIT, ...), so
// k^T S and q^T S are per-thread partial dots finished with two xor shuffles. Within a 32-lane
// group lane = part * GDN_COLS + column: the shuffle partners (xor 8, 16) stay in the group for
// 32- and 64-wide warps, and one row load by the group reads 4 rows x 8 consecutive columns,
// i.e. whole 32-byte sectors. At dk = dv = 128 a thread holds 32 state values and a decode
// step of 16 heads runs 128 blocks of 64 threads (spread over the SMs, not queued on a few).
#define GDN_BLOCK 64  // recurrent.py mirrors GDN_BLOCK, GDN_SPLIT and GDN_TILE
#define GDN_SPLIT 4
#define GDN_GROUP 32
#define GDN_COLS (GDN_GROUP / GDN_SPLIT)   // 8 columns per 32-lane group
#define GDN_TILE (GDN_BLOCK / GDN_SPLIT)   // 16 columns per block

DEVICE float gdn_softplus(float z) {  // log(1 + e^z) = max(z, 0) + log1p(e^-|z|): no overflow (numpy's logaddexp)
    return fmaxf(z, 0.0f) + log1pf(expf(-fabsf(z)));
}

template <int N>
DEVICE float gdn_sum(const float* a) {  // pairwise sum of N (1, 2 or 4) partial sums
    return N == 1 ? a[0] : N == 2 ? a[0] + a[1] : (a[0] + a[1]) + (a[2] + a[3]);
}

// Loads token t's k, q (scaled), v and gates into gdn_body's prefetch registers pk, pq, pv, pa, pb;
// with l2, also each 32-lane group's share of sum(k^2) and sum(q^2) (unscaled q) into pnk, pnq.
#define GDN_FETCH(t)                                                                                    \
    do {                                                                                                \
        const float* kt = k + ((size_t)(t) * hk + kh) * dk;                                             \
        const float* qt = q + ((size_t)(t) * hk + kh) * dk;                                             \
        float ssk = 0.0f, ssq = 0.0f;                                                                   \
        _Pragma("unroll") for (int j = 0; j < STAGE; ++j) {                                             \
            const int e = tid + GDN_BLOCK * j;                                                          \
            const float kv_ = e < dk ? kt[e] : 0.0f, qv_ = e < dk ? qt[e] : 0.0f;                       \
            pk[j] = kv_;                                                                                \
            pq[j] = qv_ * scale;                                                                        \
            ssk += kv_ * kv_;                                                                           \
            ssq += qv_ * qv_;                                                                           \
        }                                                                                               \
        if (l2) {                                                                                       \
            _Pragma("unroll") for (int o = GDN_GROUP / 2; o > 0; o >>= 1) {                             \
                ssk += SHFL_XOR(ssk, o);                                                                \
                ssq += SHFL_XOR(ssq, o);                                                                \
            }                                                                                           \
        }                                                                                               \
        pnk = ssk;                                                                                      \
        pnq = ssq;                                                                                      \
        const size_t th = (size_t)(t) * hv + h;                                                         \
        pv = live ? v[th * dv + col] : 0.0f;                                                            \
        if (RAW) {                                                                                      \
            const float z = gate0[th] + dt_bias[(size_t)(t) * d_st + (size_t)h * d_sh];                 \
            pa = expf(a_neg[(size_t)(t) * a_st + (size_t)h * a_sh] * gdn_softplus(z));                  \
            pb = 1.0f / (1.0f + expf(-gate1[th]));                                                      \
        } else {                                                                                        \
            pa = expf(gate0[th]);                                                                       \
            pb = gate1[th];                                                                             \
        }                                                                                               \
    } while (0)

// ROWS: state rows per thread, so dk <= ROWS * GDN_SPLIT. Rows past dk hold 0 and see k = q = 0
// (staged zeros), so the token loop needs no row guards. RAW: gate0/gate1 are alpha/b and the
// gates are a_neg * softplus(alpha + dt_bias), sigmoid(b); else they are g/beta themselves.
// a_neg and dt_bias are read at t * a_st + h * a_sh (strides 0 on broadcast axes).
// l2 (run-time, uniform): k_t and q_t are first divided by sqrt(sum of squares + l2_eps), as the
// l2_norm op does. The norms cost no extra barrier: each 32-lane group's partial sums are staged
// beside k_t and q_t, and the factors are applied to the dot products (k^T S, q^T S) and to the
// update's delta instead of to every element.
// In place (new_state == state) is allowed: a thread reads its state elements once, before the
// token loop, and writes the same elements once, after it; so state/new_state are not __restrict__.
template <int ROWS, bool RAW>
DEVICE void gdn_body(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                     const float* __restrict__ gate0, const float* __restrict__ gate1,
                     const float* __restrict__ a_neg, const float* __restrict__ dt_bias,
                     const float* state, float* __restrict__ o, float* new_state,
                     int n, int hk, int hv, int dk, int dv, float scale, int a_st, int a_sh, int d_st, int d_sh,
                     int l2, float l2_eps, float* __restrict__ steps) {
    constexpr int DK = ROWS * GDN_SPLIT;  // staged length of k_t, q_t (zero padded past dk)
    constexpr int STAGE = (DK + GDN_BLOCK - 1) / GDN_BLOCK;  // elements of k_t / q_t each thread stages
    constexpr int NACC = ROWS < 4 ? ROWS : 4;
    constexpr int NGROUP = GDN_BLOCK / GDN_GROUP;
    // Double buffered: token t uses buffer t & 1, so one barrier per token suffices (a thread can
    // only overwrite a buffer after every thread passed the next barrier, i.e. finished reading it).
    __shared__ float sk[2][DK];
    __shared__ float sq[2][DK];
    __shared__ float snk[2][NGROUP];  // per-group sums of k_t^2 and q_t^2 (used with l2)
    __shared__ float snq[2][NGROUP];

    const int tid = threadIdx.x;
    const int lane = tid % GDN_GROUP;
    const int part = lane / GDN_COLS;
    const int col = blockIdx.x * GDN_TILE + (tid / GDN_GROUP) * GDN_COLS + lane % GDN_COLS;
    const int h = blockIdx.y;
    const int kh = h / (hv / hk);
    const bool live = col < dv;  // dead columns still run: they take part in the shuffles

    const float* S0 = state + (size_t)h * dk * dv + col;
    float s[ROWS];
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
        const int i = part + GDN_SPLIT * m;
        s[m] = (live && i < dk) ? S0[(size_t)i * dv] : 0.0f;
    }

    // Token t's inputs, loaded into registers one token ahead so their latency hides behind the
    // previous token's arithmetic.
    float pk[STAGE], pq[STAGE], pv = 0.0f, pa = 0.0f, pb = 0.0f, pnk = 0.0f, pnq = 0.0f;
    if (n > 0) GDN_FETCH(0);

    for (int t = 0; t < n; ++t) {
        const int buf = t & 1;
#pragma unroll
        for (int j = 0; j < STAGE; ++j) {
            const int e = tid + GDN_BLOCK * j;
            if (e < DK) {
                sk[buf][e] = pk[j];
                sq[buf][e] = pq[j];
            }
        }
        if (l2 && lane == 0) {
            snk[buf][tid / GDN_GROUP] = pnk;
            snq[buf][tid / GDN_GROUP] = pnq;
        }
        const float decay = pa, beta = pb, vt = pv;
        __syncthreads();
        float inv_k = 1.0f, inv_q = 1.0f;
        if (l2) {
            float nk = 0.0f, nq = 0.0f;
#pragma unroll
            for (int g = 0; g < NGROUP; ++g) {
                nk += snk[buf][g];
                nq += snq[buf][g];
            }
            inv_k = 1.0f / sqrtf(nk + l2_eps);
            inv_q = 1.0f / sqrtf(nq + l2_eps);
        }
        if (t + 1 < n) GDN_FETCH(t + 1);

        // NACC independent partial sums: a single chain of ROWS dependent FMAs would make every
        // token wait ROWS x the FMA latency (the token loop is latency-bound, not throughput-bound).
        float part_kv[NACC];
#pragma unroll
        for (int a = 0; a < NACC; ++a) part_kv[a] = 0.0f;
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
            s[m] *= decay;
            part_kv[m % NACC] += sk[buf][part + GDN_SPLIT * m] * s[m];
        }
        float kv = gdn_sum<NACC>(part_kv);
        kv += SHFL_XOR(kv, GDN_COLS);
        kv += SHFL_XOR(kv, 2 * GDN_COLS);
        // with l2: kv = (k/|k|)^T S and the update adds (k/|k|) delta, so delta carries 1/|k|
        const float delta = beta * (vt - kv * inv_k) * inv_k;
        float part_o[NACC];
#pragma unroll
        for (int a = 0; a < NACC; ++a) part_o[a] = 0.0f;
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
            const int i = part + GDN_SPLIT * m;
            s[m] += sk[buf][i] * delta;
            part_o[m % NACC] += sq[buf][i] * s[m];
        }
        float acc = gdn_sum<NACC>(part_o);
        acc += SHFL_XOR(acc, GDN_COLS);
        acc += SHFL_XOR(acc, 2 * GDN_COLS);
        if (part == 0 && live) o[((size_t)t * hv + h) * dv + col] = acc * inv_q;
        if (steps != nullptr) {  // a verify call keeps the state after every token (steps [n, hv, dk, dv])
            float* St = steps + ((size_t)t * hv + h) * dk * dv + col;
#pragma unroll
            for (int m = 0; m < ROWS; ++m) {
                const int i = part + GDN_SPLIT * m;
                if (live && i < dk) St[(size_t)i * dv] = s[m];
            }
        }
    }

    float* S1 = new_state + (size_t)h * dk * dv + col;
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
        const int i = part + GDN_SPLIT * m;
        if (live && i < dk) S1[(size_t)i * dv] = s[m];
    }
}

// grid (cdiv(dv, GDN_TILE), hv), block GDN_BLOCK; the same arguments for both variants (the plain
// one ignores a_neg, dt_bias and their strides); steps is null, or [n, hv, dk, dv] to keep every
// token's state. The explicit min-blocks 1 of __launch_bounds__ stopped ptxas (sm_90) spilling the
// r16 variant at 72 registers.
#define DEFINE_GDN(ROWS)                                                                                \
    extern "C" __global__ void __launch_bounds__(GDN_BLOCK, 1) gated_delta_net_r##ROWS(                 \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,          \
        const float* __restrict__ g, const float* __restrict__ beta, const float* __restrict__ a_neg,   \
        const float* __restrict__ dt_bias, const float* state, float* __restrict__ o,                   \
        float* new_state, int n, int hk, int hv, int dk, int dv, float scale, int a_st,                 \
        int a_sh, int d_st, int d_sh, int l2, float l2_eps, float* __restrict__ steps) {             \
        PDL_ENTRY();                                                                                 \
        gdn_body<ROWS, false>(q, k, v, g, beta, a_neg, dt_bias, state, o, new_state, n, hk, hv, dk, dv, \
                              scale, a_st, a_sh, d_st, d_sh, l2, l2_eps, steps);                        \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GDN_BLOCK, 1) gated_delta_net_raw_r##ROWS(             \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,          \
        const float* __restrict__ alpha, const float* __restrict__ b, const float* __restrict__ a_neg,  \
        const float* __restrict__ dt_bias, const float* state, float* __restrict__ o,                   \
        float* new_state, int n, int hk, int hv, int dk, int dv, float scale, int a_st,                 \
        int a_sh, int d_st, int d_sh, int l2, float l2_eps, float* __restrict__ steps) {             \
        PDL_ENTRY();                                                                                 \
        gdn_body<ROWS, true>(q, k, v, alpha, b, a_neg, dt_bias, state, o, new_state, n, hk, hv, dk, dv, \
                             scale, a_st, a_sh, d_st, d_sh, l2, l2_eps, steps);                         \
    }

#undef GDN_FETCH

DEFINE_GDN(2)   // dk <= 8
DEFINE_GDN(4)   // dk <= 16
DEFINE_GDN(8)   // dk <= 32
DEFINE_GDN(16)  // dk <= 64
DEFINE_GDN(32)  // dk <= 128 (Qwen3.5)
DEFINE_GDN(64)  // dk <= 256

// ================================================================ delta rule, few tokens (decode, verify)
// The token loop above gives each state column to 4 threads of 32 rows each: 64-thread blocks, 16K
// threads for a 32-head, 128 x 128 state, too few to keep the loads in flight (4.35 us a decode step
// at Qwen3.5-9B shapes, 23 % of the 2 x 2 MiB state traffic at copy bandwidth). Here a 256-thread
// block owns 16 columns of one head: thread (row group rg of 64, column quad cq of 4) holds rows
// rg + 64 r (r < DK/64) as float4s, so the state moves in 16-byte loads by 4x the threads. Column
// sums over rows are an xor-shuffle over the 8 row groups of a 32-lane group, then 8 group partials
// through shared memory. The math, gates, l2 and steps options are gdn_body's; in place is safe
// for the same reason (a thread reads its elements before the token loop and writes them after).
// Needs dv % 4 == 0 and 16-byte aligned state, v, o (and steps): recurrent.py checks.
#define GDS_THREADS 256
#define GDS_COLS 16                          // columns per block
#define GDS_GROUPS (GDS_THREADS / 32)        // 32-lane groups per block (on 32- and 64-wide waves)
#define GDS_RG (GDS_THREADS / (GDS_COLS / 4))  // row groups: 64

DEVICE float4 f4_fma(float a, float4 x, float4 y) {  // a * x + y
    return make_float4(fmaf(a, x.x, y.x), fmaf(a, x.y, y.y), fmaf(a, x.z, y.z), fmaf(a, x.w, y.w));
}

DEVICE float4 f4_xor_sum(float4 v) {  // sum over the 8 lanes of a 32-lane group that share lane % 4
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
        v.x += SHFL_XOR(v.x, o);
        v.y += SHFL_XOR(v.y, o);
        v.z += SHFL_XOR(v.z, o);
        v.w += SHFL_XOR(v.w, o);
    }
    return v;
}

template <int DK, bool RAW>
DEVICE void gds_body(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                     const float* __restrict__ gate0, const float* __restrict__ gate1,
                     const float* __restrict__ a_neg, const float* __restrict__ dt_bias,
                     const float* state, float* __restrict__ o, float* new_state,
                     int n, int hk, int hv, int dk, int dv, float scale, int a_st, int a_sh, int d_st, int d_sh,
                     int l2, float l2_eps, float* __restrict__ steps) {
    constexpr int R = DK / GDS_RG;  // rows per thread
    __shared__ float sk[DK];
    __shared__ float sq[DK];
    __shared__ float snorm[2][GDS_GROUPS];  // per-group sums of k^2 (0) and q^2 (1)
    __shared__ float4 red_kv[GDS_GROUPS][GDS_COLS / 4];
    __shared__ float4 red_o[GDS_GROUPS][GDS_COLS / 4];

    const int tid = threadIdx.x, lane = tid % 32, grp = tid / 32;
    const int cq = lane % 4, rg = grp * 8 + lane / 4;
    const int col = blockIdx.x * GDS_COLS + cq * 4;
    const int h = blockIdx.y, kh = h / (hv / hk);
    const bool live = col < dv;  // dv % 4 == 0: a quad is all in or all out

    float4 s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int i = rg + GDS_RG * r;
        s[r] = (live && i < dk) ? *(const float4*)(state + ((size_t)h * dk + i) * dv + col) : make_float4(0, 0, 0, 0);
    }

    for (int t = 0; t < n; ++t) {
        // stage k_t (threads 0..DK-1) and q_t (DK..2DK-1), zero past dk; with l2, each group's sum of squares
        float e2 = 0.0f;
        if (tid < 2 * DK) {
            const int e = tid % DK;
            const float* src = (tid < DK ? k : q) + ((size_t)t * hk + kh) * dk;
            const float val = e < dk ? src[e] : 0.0f;
            if (tid < DK) sk[e] = val; else sq[e] = val * scale;
            e2 = val * val;
        }
        if (l2) {
#pragma unroll
            for (int o2 = 16; o2 > 0; o2 >>= 1) e2 += SHFL_XOR(e2, o2);
            if (lane == 0 && grp * 32 < 2 * DK) snorm[grp * 32 < DK ? 0 : 1][grp] = e2;
        }
        const size_t th = (size_t)t * hv + h;
        float decay, beta;
        if (RAW) {
            const float z = gate0[th] + dt_bias[(size_t)t * d_st + (size_t)h * d_sh];
            decay = expf(a_neg[(size_t)t * a_st + (size_t)h * a_sh] * gdn_softplus(z));
            beta = 1.0f / (1.0f + expf(-gate1[th]));
        } else {
            decay = expf(gate0[th]);
            beta = gate1[th];
        }
        const float4 vt = live ? *(const float4*)(v + th * dv + col) : make_float4(0, 0, 0, 0);
        __syncthreads();
        float inv_k = 1.0f, inv_q = 1.0f;
        if (l2) {
            float nk = 0.0f, nq = 0.0f;
            for (int g2 = 0; g2 < DK / 32; ++g2) nk += snorm[0][g2];
            for (int g2 = DK / 32; g2 < 2 * DK / 32; ++g2) nq += snorm[1][g2];
            inv_k = 1.0f / sqrtf(nk + l2_eps);
            inv_q = 1.0f / sqrtf(nq + l2_eps);
        }

        float4 kv = make_float4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            s[r] = make_float4(s[r].x * decay, s[r].y * decay, s[r].z * decay, s[r].w * decay);
            kv = f4_fma(sk[rg + GDS_RG * r], s[r], kv);
        }
        kv = f4_xor_sum(kv);
        if (lane < 4) red_kv[grp][cq] = kv;
        __syncthreads();
        kv = red_kv[0][cq];
#pragma unroll
        for (int g2 = 1; g2 < GDS_GROUPS; ++g2) {
            const float4 p = red_kv[g2][cq];
            kv.x += p.x; kv.y += p.y; kv.z += p.z; kv.w += p.w;
        }
        // with l2: kv = (k/|k|)^T S and the update adds (k/|k|) delta, so delta carries 1/|k|
        const float bk = beta * inv_k;
        const float4 delta = make_float4(bk * (vt.x - kv.x * inv_k), bk * (vt.y - kv.y * inv_k),
                                         bk * (vt.z - kv.z * inv_k), bk * (vt.w - kv.w * inv_k));
        float4 op = make_float4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int i = rg + GDS_RG * r;
            s[r] = f4_fma(sk[i], delta, s[r]);
            op = f4_fma(sq[i], s[r], op);
        }
        op = f4_xor_sum(op);
        if (lane < 4) red_o[grp][cq] = op;
        if (steps != nullptr && live) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int i = rg + GDS_RG * r;
                if (i < dk) *(float4*)(steps + (th * dk + i) * dv + col) = s[r];
            }
        }
        __syncthreads();
        if (grp == 0 && lane < 4 && live) {
            float4 acc = red_o[0][cq];
#pragma unroll
            for (int g2 = 1; g2 < GDS_GROUPS; ++g2) {
                const float4 p = red_o[g2][cq];
                acc.x += p.x; acc.y += p.y; acc.z += p.z; acc.w += p.w;
            }
            *(float4*)(o + th * dv + col) = make_float4(acc.x * inv_q, acc.y * inv_q, acc.z * inv_q, acc.w * inv_q);
        }
    }

#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int i = rg + GDS_RG * r;
        if (live && i < dk) *(float4*)(new_state + ((size_t)h * dk + i) * dv + col) = s[r];
    }
}

#define DEFINE_GDS(DK)                                                                                  \
    extern "C" __global__ void __launch_bounds__(GDS_THREADS) gated_delta_net_step_d##DK(               \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,          \
        const float* __restrict__ g, const float* __restrict__ beta, const float* __restrict__ a_neg,   \
        const float* __restrict__ dt_bias, const float* state, float* __restrict__ o,                   \
        float* new_state, int n, int hk, int hv, int dk, int dv, float scale, int a_st,                 \
        int a_sh, int d_st, int d_sh, int l2, float l2_eps, float* __restrict__ steps) {                \
        PDL_ENTRY();                                                                                    \
        gds_body<DK, false>(q, k, v, g, beta, a_neg, dt_bias, state, o, new_state, n, hk, hv, dk, dv,   \
                            scale, a_st, a_sh, d_st, d_sh, l2, l2_eps, steps);                          \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GDS_THREADS) gated_delta_net_raw_step_d##DK(           \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,          \
        const float* __restrict__ alpha, const float* __restrict__ b, const float* __restrict__ a_neg,  \
        const float* __restrict__ dt_bias, const float* state, float* __restrict__ o,                   \
        float* new_state, int n, int hk, int hv, int dk, int dv, float scale, int a_st,                 \
        int a_sh, int d_st, int d_sh, int l2, float l2_eps, float* __restrict__ steps) {                \
        PDL_ENTRY();                                                                                    \
        gds_body<DK, true>(q, k, v, alpha, b, a_neg, dt_bias, state, o, new_state, n, hk, hv, dk, dv,   \
                           scale, a_st, a_sh, d_st, d_sh, l2, l2_eps, steps);                           \
    }

DEFINE_GDS(64)   // dk <= 64: one row per thread
DEFINE_GDS(128)  // dk <= 128 (Qwen3.5): two rows per thread
