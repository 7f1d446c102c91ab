// The gated delta rule for prefill in chunks (the WY/UT form of backends/cpu/recurrent.py's module
// doc), in two kernels. Per chunk of L tokens of v-head h, with G_t = g_1 + ... + g_t (cumulative
// log decay inside the chunk), gamma_t = e^{G_t}, hat-q = scale q/|q|, hat-k = k/|k| (plain q, k
// without l2) and S the state entering the chunk:
//   A  strictly lower, A_tj = beta_t e^{G_t-G_j} (hat-k_t . hat-k_j);  T = (I + A)^-1
//   U  = T (diag(beta) V - diag(beta gamma) hat-K S)
//   O  = diag(gamma) hat-Q S + P U,  P_tj = e^{G_t-G_j} (hat-q_t . hat-k_j) for j <= t
//   S' = gamma_L S + (diag(e^{G_L-G_t}) hat-K)^T U
// gdn_chunk_prep (all chunks at once) computes what depends on q, k and the gates only: T, P and
// per-token row factors, into one record per (chunk, v-head). gdn_chunk_scan then walks the chunks
// in order per (v-head, GDC_TILE state columns), the state tile kept on chip, and reads q and k
// unnormalized: every normalization, gate and scale is one of the record's row factors.
// f32 throughout; G in double (its differences G_t - G_j are what the exponentials see).
#include "common.cuh"

#ifndef GDC_L
#define GDC_L 32  // tokens per chunk; delta_chunked.py mirrors GDC_L, GDC_THREADS and GDC_TILE
#endif
#define GDC_THREADS 128  // both kernels
#define GDC_TILE 16      // state columns per scan block
#define GDC_RG (GDC_THREADS / GDC_TILE)  // row groups of the scan block

// One record per (chunk, v-head): M [L][L] holds P on and below the diagonal and T^T strictly
// above it (M[j][t] = T[t][j], j < t; T's unit diagonal is implicit), then L floats each of beta,
// CK = beta gamma / |k|, RQ = gamma scale / |q|, RK = e^{G_L - G_t} / |k|, then gamma_L (+3 pad).
#define GDC_M 0
#define GDC_BETA (GDC_L * GDC_L)
#define GDC_CK (GDC_BETA + GDC_L)
#define GDC_RQ (GDC_CK + GDC_L)
#define GDC_RK (GDC_RQ + GDC_L)
#define GDC_GC (GDC_RK + GDC_L)
#define GDC_REC (GDC_GC + 4)
#define GDC_F(FIELD) (GDC_##FIELD - GDC_BETA)  // a row factor's offset in the scan's copy sF

DEVICE float gdc_softplus(float z) {  // log(1 + e^z) without overflow (as recurrent.cu)
    return fmaxf(z, 0.0f) + log1pf(expf(-fabsf(z)));
}

// ================================================================ prep: one block per (chunk, v-head)
// Rows past the prompt (the last chunk's tail) get k = q = 0, g = 0 and beta = 0: their A rows,
// T rows (past the diagonal), CK and RK are 0, so they add nothing to U or S.
template <int DK, bool RAW>
DEVICE void gdc_prep_body(const float* __restrict__ q, const float* __restrict__ k,
                          const float* __restrict__ gate0, const float* __restrict__ gate1,
                          const float* __restrict__ a_neg, const float* __restrict__ dt_bias,
                          float* __restrict__ rec, int n, int hk, int hv, int dk, float scale,
                          int a_st, int a_sh, int d_st, int d_sh, int l2, float l2_eps) {
    constexpr int L = GDC_L;
    static_assert(GDC_THREADS >= 3 * L, "the gate scan and the two norms run on three groups of L threads");
    __shared__ float sK[L][DK + 1];  // +1: row-strided reads (norms, Gram columns) hit distinct banks
    __shared__ float sQ[L][DK + 1];
    __shared__ float sA[L][L + 1];
    __shared__ float sT[L][L + 1];  // T, strictly lower part
    __shared__ double sG[L];
    __shared__ float sg[L], sBeta[L], sIk[L], sIq[L];

    const int tid = threadIdx.x;
    const int chunk = blockIdx.x, h = blockIdx.y;
    const int kh = h / (hv / hk);
    const int t0 = chunk * L;
    const int len = n - t0 < L ? n - t0 : L;
    float* out = rec + ((size_t)chunk * hv + h) * GDC_REC;

    for (int e = tid; e < L * DK; e += GDC_THREADS) {
        const int t = e / DK, i = e % DK;
        const bool in = t < len && i < dk;
        const size_t at = ((size_t)(t0 + t) * hk + kh) * dk + i;
        sK[t][i] = in ? k[at] : 0.0f;
        sQ[t][i] = in ? q[at] : 0.0f;
    }
    if (tid < L) {
        float g = 0.0f, beta = 0.0f;
        if (tid < len) {
            const size_t t = (size_t)(t0 + tid), th = t * hv + h;
            if (RAW) {
                const float z = gate0[th] + dt_bias[t * d_st + (size_t)h * d_sh];
                g = a_neg[t * a_st + (size_t)h * a_sh] * gdc_softplus(z);
                beta = 1.0f / (1.0f + expf(-gate1[th]));
            } else {
                g = gate0[th];
                beta = gate1[th];
            }
        }
        sg[tid] = g;
        sBeta[tid] = beta;
    }
    __syncthreads();

    if (tid == 0) {  // serial: L additions; rows past len add g = 0, so sG[L-1] = G of the last token
        double acc = 0.0;
        for (int t = 0; t < L; ++t) {
            acc += (double)sg[t];
            sG[t] = acc;
        }
    } else if (tid >= L && tid < 3 * L) {  // 1/|k_t| and 1/|q_t| (1 without l2), as the l2_norm op
        const int t = tid % L;
        const float(*x)[DK + 1] = tid < 2 * L ? sK : sQ;
        float ss = 0.0f;
        for (int i = 0; i < DK; ++i) ss += x[t][i] * x[t][i];
        const float inv = l2 ? 1.0f / sqrtf(ss + l2_eps) : 1.0f;
        if (tid < 2 * L) sIk[t] = inv;
        else sIq[t] = inv;
    }
    __syncthreads();

    // A (strictly lower, to shared memory) and P (on and below the diagonal, to the record).
    for (int e = tid; e < L * L; e += GDC_THREADS) {
        const int t = e / L, j = e % L;
        float a = 0.0f;
        if (j <= t) {
            float kk = 0.0f, qk = 0.0f;
            for (int i = 0; i < DK; ++i) {
                kk += sK[t][i] * sK[j][i];
                qk += sQ[t][i] * sK[j][i];
            }
            const float decay = expf((float)(sG[t] - sG[j]));  // <= 1 for decaying gates
            if (j < t) a = sBeta[t] * decay * (sIk[t] * sIk[j] * kk);
            out[GDC_M + e] = decay * scale * (sIq[t] * sIk[j] * qk);
        }
        sA[t][j] = a;
    }
    __syncthreads();

    // T = (I + A)^-1 by forward substitution, one row per step: for j < r,
    // T[r][j] = -(A[r][j] + sum_{j<m<r} A[r][m] T[m][j]) (T[m][m] = 1).
    for (int r = 1; r < L; ++r) {
        if (tid < r) {
            float acc = sA[r][tid];
            for (int m = tid + 1; m < r; ++m) acc += sA[r][m] * sT[m][tid];
            sT[r][tid] = -acc;
        }
        __syncthreads();
    }
    for (int e = tid; e < L * L; e += GDC_THREADS) {  // T^T above the diagonal
        const int t = e / L, j = e % L;
        if (j > t) out[GDC_M + e] = sT[j][t];
    }
    if (tid < L) {
        const int t = tid;
        const double g_last = sG[L - 1];
        const float gamma = (float)exp(sG[t]);
        out[GDC_BETA + t] = sBeta[t];
        out[GDC_CK + t] = sBeta[t] * gamma * sIk[t];
        out[GDC_RQ + t] = gamma * scale * sIq[t];
        out[GDC_RK + t] = t < len ? (float)exp(g_last - sG[t]) * sIk[t] : 0.0f;
        if (t < 4) out[GDC_GC + t] = t == 0 ? (float)exp(g_last) : 0.0f;
    }
}

// ================================================================ scan: one block per (v-head, column tile)
// Thread (rg, c) = (tid / GDC_TILE, tid % GDC_TILE) owns state rows rg + GDC_RG m of column c (in
// registers, mirrored in sS for the products that read whole columns) and tokens rg + GDC_RG j of
// the chunk for X = K S, Y = Q S, U and O. The next chunk's q, k, record and v are loaded into
// registers while this chunk computes, so the loads' latency hides behind the arithmetic.
// In place (new_state == state) is allowed: each thread reads its state elements before the chunk
// loop and writes the same elements after it; so state/new_state are not __restrict__.
template <int DK>
DEVICE void gdc_scan_body(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                          const float* __restrict__ rec, const float* state, float* __restrict__ o,
                          float* new_state, int n, int hk, int hv, int dk, int dv) {
    constexpr int L = GDC_L, TILE = GDC_TILE, RG = GDC_RG;
    constexpr int SROWS = DK / RG;                 // state rows per thread
    constexpr int TOK = L / RG;                    // tokens per thread
    constexpr int KQ = L * DK / GDC_THREADS;       // k (and q) elements per thread per chunk
    constexpr int RP = (GDC_REC + GDC_THREADS - 1) / GDC_THREADS;  // record floats per thread
    static_assert(DK % RG == 0 && L % RG == 0 && (L * DK) % GDC_THREADS == 0, "tile shapes");
    __shared__ float sK[L][DK + 1];  // +1: the two (four on 64-wide waves) token rows a warp reads differ in bank
    __shared__ float sQ[L][DK + 1];
    __shared__ float sS[DK][TILE];
    __shared__ float sM[L][L + 1];
    __shared__ float sU[L][TILE];    // R, then U
    __shared__ float sF[GDC_REC - GDC_BETA];  // the record's row factors and gamma_L

    const int tid = threadIdx.x;
    const int rg = tid / TILE, c = tid % TILE;
    const int col = blockIdx.x * TILE + c;
    const int h = blockIdx.y;
    const int kh = h / (hv / hk);
    const bool live = col < dv;
    const int n_chunks = (n + L - 1) / L;

    float s[SROWS];
#pragma unroll
    for (int m = 0; m < SROWS; ++m) {
        const int i = rg + RG * m;
        s[m] = (live && i < dk) ? state[((size_t)h * dk + i) * dv + col] : 0.0f;
        sS[i][c] = s[m];
    }

    float pk[KQ], pq[KQ], pr[RP], pv[TOK];
    auto fetch = [&](int chunk) {
        const int t0 = chunk * L;
        const int len = n - t0 < L ? n - t0 : L;
#pragma unroll
        for (int r = 0; r < KQ; ++r) {
            const int e = tid + GDC_THREADS * r, t = e / DK, i = e % DK;
            const bool in = t < len && i < dk;
            const size_t at = ((size_t)(t0 + t) * hk + kh) * dk + i;
            pk[r] = in ? k[at] : 0.0f;
            pq[r] = in ? q[at] : 0.0f;
        }
        const float* rc = rec + ((size_t)chunk * hv + h) * GDC_REC;
#pragma unroll
        for (int r = 0; r < RP; ++r) {
            const int e = tid + GDC_THREADS * r;
            pr[r] = e < GDC_REC ? rc[e] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < TOK; ++j) {
            const int t = rg + RG * j;
            pv[j] = (live && t < len) ? v[((size_t)(t0 + t) * hv + h) * dv + col] : 0.0f;
        }
    };
    if (n_chunks > 0) fetch(0);

    for (int chunk = 0; chunk < n_chunks; ++chunk) {
        const int t0 = chunk * L;
        const int len = n - t0 < L ? n - t0 : L;
#pragma unroll
        for (int r = 0; r < KQ; ++r) {
            const int e = tid + GDC_THREADS * r;
            sK[e / DK][e % DK] = pk[r];
            sQ[e / DK][e % DK] = pq[r];
        }
#pragma unroll
        for (int r = 0; r < RP; ++r) {
            const int e = tid + GDC_THREADS * r;
            if (e < GDC_BETA) sM[e / L][e % L] = pr[r];
            else if (e < GDC_REC) sF[e - GDC_BETA] = pr[r];
        }
        float vt[TOK];
#pragma unroll
        for (int j = 0; j < TOK; ++j) vt[j] = pv[j];
        __syncthreads();
        if (chunk + 1 < n_chunks) fetch(chunk + 1);

        float x[TOK], y[TOK];  // X = K S and Y = Q S at the thread's tokens
#pragma unroll
        for (int j = 0; j < TOK; ++j) x[j] = y[j] = 0.0f;
#pragma unroll 8
        for (int i = 0; i < DK; ++i) {
            const float si = sS[i][c];
#pragma unroll
            for (int j = 0; j < TOK; ++j) {
                x[j] += sK[rg + RG * j][i] * si;
                y[j] += sQ[rg + RG * j][i] * si;
            }
        }
#pragma unroll
        for (int j = 0; j < TOK; ++j) {  // R = diag(beta) V - diag(beta gamma / |k|) K S
            const int t = rg + RG * j;
            sU[t][c] = sF[GDC_F(BETA) + t] * vt[j] - sF[GDC_F(CK) + t] * x[j];
        }
        __syncthreads();
        float u[TOK];  // U = T R: U_t = R_t + sum_{m<t} T[t][m] R_m, T[t][m] = M[m][t]
#pragma unroll
        for (int j = 0; j < TOK; ++j) {
            const int t = rg + RG * j;
            float acc = sU[t][c];
            for (int m = 0; m < t; ++m) acc += sM[m][t] * sU[m][c];
            u[j] = acc;
        }
        __syncthreads();  // every R read before U overwrites it
#pragma unroll
        for (int j = 0; j < TOK; ++j) sU[rg + RG * j][c] = u[j];
        __syncthreads();
#pragma unroll
        for (int j = 0; j < TOK; ++j) {  // O_t = gamma_t scale/|q_t| (Q S)_t + sum_{m<=t} P[t][m] U_m
            const int t = rg + RG * j;
            float acc = sF[GDC_F(RQ) + t] * y[j];
            for (int m = 0; m <= t; ++m) acc += sM[t][m] * sU[m][c];
            if (live && t < len) o[((size_t)(t0 + t) * hv + h) * dv + col] = acc;
        }
        const float gc = sF[GDC_F(GC)];  // S = gamma_L S + sum_t (e^{G_L-G_t}/|k_t|) k_t U_t^T
#pragma unroll
        for (int m = 0; m < SROWS; ++m) s[m] *= gc;
        for (int t = 0; t < L; ++t) {
            const float w = sF[GDC_F(RK) + t] * sU[t][c];
#pragma unroll
            for (int m = 0; m < SROWS; ++m) s[m] += sK[t][rg + RG * m] * w;
        }
#pragma unroll
        for (int m = 0; m < SROWS; ++m) sS[rg + RG * m][c] = s[m];
        __syncthreads();  // the next chunk overwrites sK, sM, sF and sU, and reads sS
    }

#pragma unroll
    for (int m = 0; m < SROWS; ++m) {
        const int i = rg + RG * m;
        if (live && i < dk) new_state[((size_t)h * dk + i) * dv + col] = s[m];
    }
}

// prep: grid (chunks, hv); scan: grid (cdiv(dv, GDC_TILE), hv); both GDC_THREADS threads.
// DK: the class of d_k (dk <= DK, rows past dk are zeros). The plain prep ignores a_neg, dt_bias
// and their strides (a_neg and dt_bias are read at t * a_st + h * a_sh, 0 on broadcast axes).
#define DEFINE_GDC(DK)                                                                                  \
    extern "C" __global__ void __launch_bounds__(GDC_THREADS) gdn_chunk_prep_d##DK(                     \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ g,          \
        const float* __restrict__ beta, const float* __restrict__ a_neg,                                \
        const float* __restrict__ dt_bias, float* __restrict__ rec, int n, int hk, int hv, int dk,      \
        float scale, int a_st, int a_sh, int d_st, int d_sh, int l2, float l2_eps) {                    \
        gdc_prep_body<DK, false>(q, k, g, beta, a_neg, dt_bias, rec, n, hk, hv, dk, scale, a_st, a_sh,  \
                                 d_st, d_sh, l2, l2_eps);                                               \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GDC_THREADS) gdn_chunk_prep_raw_d##DK(                 \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ alpha,      \
        const float* __restrict__ b, const float* __restrict__ a_neg,                                   \
        const float* __restrict__ dt_bias, float* __restrict__ rec, int n, int hk, int hv, int dk,      \
        float scale, int a_st, int a_sh, int d_st, int d_sh, int l2, float l2_eps) {                    \
        gdc_prep_body<DK, true>(q, k, alpha, b, a_neg, dt_bias, rec, n, hk, hv, dk, scale, a_st, a_sh,  \
                                d_st, d_sh, l2, l2_eps);                                                \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GDC_THREADS) gdn_chunk_scan_d##DK(                     \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,          \
        const float* __restrict__ rec, const float* state, float* __restrict__ o, float* new_state,     \
        int n, int hk, int hv, int dk, int dv) {                                                        \
        gdc_scan_body<DK>(q, k, v, rec, state, o, new_state, n, hk, hv, dk, dv);                        \
    }

DEFINE_GDC(64)   // dk <= 64
DEFINE_GDC(128)  // dk <= 128 (Qwen3.5)
