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

#define GDC_L 32  // tokens per chunk; delta_chunked.py mirrors GDC_L, GDC_THREADS and GDC_TILE
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

struct alignas(16) gdc_f4 {
    float x, y, z, w;
};

DEVICE gdc_f4 gdc_ld4(const float* p) { return *(const gdc_f4*)p; }
DEVICE float gdc_dot4(gdc_f4 a, gdc_f4 b, float acc) { return acc + a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }

// ================================================================ prep: one block per (chunk, v-head)
// Rows past the prompt (the last chunk's tail) get k = q = 0, g = 0, beta = 0 and 1/|k| = 0: their
// A rows, T rows (past the diagonal), CK and RK are 0, so they add nothing to U or S.
// The Gram products k_t.k_j and q_t.k_j: thread (t, jg) = (tid % L, tid / L) takes row t against
// columns j = jg + 4 m, 16-byte reads; a quarter-warp reads 8 rows 4 banks apart (rows padded to
// DK + 4) and one shared column row (a broadcast).
template <int DK, bool RAW>
DEVICE void gdc_prep_body(const float* __restrict__ q, const float* __restrict__ k,
                          const float* __restrict__ gate0, const float* __restrict__ gate1,
                          const float* __restrict__ a_neg, const float* __restrict__ dt_bias,
                          float* __restrict__ rec, int n, int hk, int hv, int dk, float scale,
                          int a_st, int a_sh, int d_st, int d_sh, int l2, float l2_eps) {
    constexpr int L = GDC_L, NT = GDC_THREADS, JG = NT / L, JM = L / JG;
    static_assert(NT >= 3 * L && NT % L == 0, "the gate scan and the two norms run on three groups of L threads");
    __shared__ gdc_f4 sK4[L][DK / 4 + 1], sQ4[L][DK / 4 + 1];  // 16-byte aligned float rows of DK + 4
    float(*sK)[DK + 4] = reinterpret_cast<float(*)[DK + 4]>(sK4);
    float(*sQ)[DK + 4] = reinterpret_cast<float(*)[DK + 4]>(sQ4);
    __shared__ float sA[L][L + 1];  // A, strictly lower
    __shared__ float sT[L][L + 1];  // T = (I + A)^-1, strictly lower part
    __shared__ float sP[L][L + 1];  // P, on and below the diagonal
    __shared__ double sG[L];
    __shared__ float sg[L], sBeta[L], sIk[L], sIq[L];

    const int tid = threadIdx.x;
    const int chunk = blockIdx.x, h = blockIdx.y;
    const int kh = h / (hv / hk);
    const int t0 = chunk * L;
    const int len = n - t0 < L ? n - t0 : L;
    float* out = rec + ((size_t)chunk * hv + h) * GDC_REC;

    for (int e = tid; e < L * DK; e += NT) {
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
        const float(*x)[DK + 4] = tid < 2 * L ? sK : sQ;
        float ss = 0.0f;
        for (int i = 0; i < DK; i += 4) {
            const gdc_f4 x4 = gdc_ld4(&x[t][i]);
            ss = gdc_dot4(x4, x4, ss);
        }
        // 0 on padding rows: with l2_eps = 0 their 1/|0| would turn the zeros they multiply into NaN
        const float inv = t >= len ? 0.0f : l2 ? 1.0f / sqrtf(ss + l2_eps) : 1.0f;
        if (tid < 2 * L) sIk[t] = inv;
        else sIq[t] = inv;
    }
    __syncthreads();

    {  // A (strictly lower) and P (on and below the diagonal)
        const int t = tid % L, jg = tid / L;
        float kk[JM], qk[JM];
#pragma unroll
        for (int m = 0; m < JM; ++m) kk[m] = qk[m] = 0.0f;
        for (int i = 0; i < DK; i += 4) {
            const gdc_f4 kt = gdc_ld4(&sK[t][i]), qt = gdc_ld4(&sQ[t][i]);
#pragma unroll
            for (int m = 0; m < JM; ++m) {
                const gdc_f4 kj = gdc_ld4(&sK[jg + JG * m][i]);
                kk[m] = gdc_dot4(kt, kj, kk[m]);
                qk[m] = gdc_dot4(qt, kj, qk[m]);
            }
        }
#pragma unroll
        for (int m = 0; m < JM; ++m) {
            const int j = jg + JG * m;
            const float decay = j <= t ? expf((float)(sG[t] - sG[j])) : 0.0f;  // <= 1 for decaying gates
            sA[t][j] = j < t ? sBeta[t] * decay * (sIk[t] * sIk[j] * kk[m]) : 0.0f;
            sP[t][j] = decay * scale * (sIq[t] * sIk[j] * qk[m]);
        }
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
    for (int e = tid; e < L * L; e += NT) {  // M: P on and below the diagonal, T^T above it
        const int t = e / L, j = e % L;
        out[GDC_M + e] = j <= t ? sP[t][j] : sT[j][t];
    }
    if (tid < L) {
        const int t = tid;
        const double g_last = sG[L - 1];
        const float gamma = (float)exp(sG[t]);
        out[GDC_BETA + t] = sBeta[t];
        out[GDC_CK + t] = sBeta[t] * gamma * sIk[t];
        out[GDC_RQ + t] = gamma * scale * sIq[t];
        out[GDC_RK + t] = (float)exp(g_last - sG[t]) * sIk[t];  // 0 past len (1/|k| = 0 there)
        if (t < 4) out[GDC_GC + t] = t == 0 ? (float)exp(g_last) : 0.0f;
    }
}

// ================================================================ scan: one block per (v-head, column tile)
// Thread (rg, c) = (tid / GDC_TILE, tid % GDC_TILE) owns column c of the tile and
//  - tokens 4 rg .. 4 rg + 3 of the chunk, for X = K S, Y = Q S, U and O;
//  - state rows 4 rg + 32 m + e (e < 4) of column c, in registers; sST holds the tile transposed
//    (sST[c][i] = S[i][c]) for the products that read whole columns.
// Every shared read of a quarter-warp (the 8 lanes one 16-byte access serves at a time) is either
// one address (the lanes share rg: K, Q and M rows) or 8 addresses 4 banks apart (sST rows of
// c..c+7, padded to DK + 4), so 16-byte reads run without bank conflicts.
// The next chunk's q, k, record and v are loaded into registers while this chunk computes, so the
// loads' latency hides behind the arithmetic.
// In place (new_state == state) is allowed: each thread reads its state elements before the chunk
// loop and writes the same elements after it; so state/new_state are not __restrict__.
template <int DK>
DEVICE void gdc_scan_body(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                          const float* __restrict__ rec, const float* state, float* __restrict__ o,
                          float* new_state, int n, int hk, int hv, int dk, int dv) {
    constexpr int L = GDC_L, TILE = GDC_TILE, NT = GDC_THREADS;
    constexpr int SV = DK / 32;                     // 4-row state vectors per thread
    constexpr int KQ = L * DK / NT;                 // k (and q) elements per thread per chunk
    constexpr int TSTEP = NT / DK;                  // tokens between a thread's k elements
    constexpr int RP = (GDC_REC + NT - 1) / NT;     // record floats per thread
    static_assert(GDC_RG * 4 == L && GDC_RG * 4 * SV == DK && NT % DK == 0, "tile shapes");
    // declared as 16-byte vectors for their alignment, used as float rows
    __shared__ gdc_f4 sK4[L][DK / 4], sQ4[L][DK / 4], sST4[TILE][DK / 4 + 1], sM4[L][L / 4];
    float(*sK)[DK] = reinterpret_cast<float(*)[DK]>(sK4);
    float(*sQ)[DK] = reinterpret_cast<float(*)[DK]>(sQ4);
    float(*sST)[DK + 4] = reinterpret_cast<float(*)[DK + 4]>(sST4);
    float(*sM)[L] = reinterpret_cast<float(*)[L]>(sM4);
    __shared__ float sU[L][TILE];  // R, then U
    __shared__ float sF[GDC_REC - GDC_BETA];  // the record's row factors and gamma_L

    const int tid = threadIdx.x;
    const int rg = tid / TILE, c = tid % TILE;
    const int t4 = 4 * rg;  // the thread's first token
    const int col = blockIdx.x * TILE + c;
    const int h = blockIdx.y;
    const int kh = h / (hv / hk);
    const bool live = col < dv;
    const int n_chunks = (n + L - 1) / L;

    float s[SV][4];
#pragma unroll
    for (int m = 0; m < SV; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = t4 + 32 * m + e;
            s[m][e] = (live && i < dk) ? state[((size_t)h * dk + i) * dv + col] : 0.0f;
            sST[c][i] = s[m][e];
        }

    float pk[KQ], pq[KQ], pr[RP], pv[4];
    auto fetch = [&](int chunk) {
        const int t0 = chunk * L;
        const int len = n - t0 < L ? n - t0 : L;
        const int ti = tid / DK, i = tid % DK;  // element e = tid + NT r is (token ti + TSTEP r, i)
        const size_t at = ((size_t)(t0 + ti) * hk + kh) * dk + i, step = (size_t)TSTEP * hk * dk;
#pragma unroll
        for (int r = 0; r < KQ; ++r) {
            const bool in = ti + TSTEP * r < len && i < dk;
            pk[r] = in ? k[at + step * r] : 0.0f;
            pq[r] = in ? q[at + step * r] : 0.0f;
        }
        const float* rc = rec + ((size_t)chunk * hv + h) * GDC_REC;
#pragma unroll
        for (int r = 0; r < RP; ++r) {
            const int e = tid + NT * r;
            pr[r] = e < GDC_REC ? rc[e] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int t = t4 + j;
            pv[j] = (live && t < len) ? v[((size_t)(t0 + t) * hv + h) * dv + col] : 0.0f;
        }
    };
    if (n_chunks > 0) fetch(0);

    for (int chunk = 0; chunk < n_chunks; ++chunk) {
        const int t0 = chunk * L;
        const int len = n - t0 < L ? n - t0 : L;
#pragma unroll
        for (int r = 0; r < KQ; ++r) {
            const int e = tid + NT * r;
            sK[e / DK][e % DK] = pk[r];
            sQ[e / DK][e % DK] = pq[r];
        }
#pragma unroll
        for (int r = 0; r < RP; ++r) {
            const int e = tid + NT * r;
            if (e < GDC_BETA) sM[e / L][e % L] = pr[r];
            else if (e < GDC_REC) sF[e - GDC_BETA] = pr[r];
        }
        float vt[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) vt[j] = pv[j];
        __syncthreads();
        if (chunk + 1 < n_chunks) fetch(chunk + 1);

        float x[4], y[4];  // X = K S and Y = Q S at the thread's tokens
#pragma unroll
        for (int j = 0; j < 4; ++j) x[j] = y[j] = 0.0f;
#pragma unroll 1  // unrolled further, ptxas hoists the loads past 255 registers and spills
        for (int i = 0; i < DK; i += 4) {
            const gdc_f4 s4 = gdc_ld4(&sST[c][i]);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                x[j] = gdc_dot4(gdc_ld4(&sK[t4 + j][i]), s4, x[j]);
                y[j] = gdc_dot4(gdc_ld4(&sQ[t4 + j][i]), s4, y[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // R = diag(beta) V - diag(beta gamma / |k|) K S
            const int t = t4 + j;
            sU[t][c] = sF[GDC_F(BETA) + t] * vt[j] - sF[GDC_F(CK) + t] * x[j];
        }
        __syncthreads();

        // U = T R: U_t = R_t + sum_{m<t} T[t][m] R_m, with T[t][m] = M[m][t]: rows m < t4 serve all
        // four tokens, the rows of the diagonal block m = t4 .. t4 + 2 only the tokens past them.
        float u[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) u[j] = sU[t4 + j][c];
        for (int m = 0; m < t4; ++m) {
            const gdc_f4 tm = gdc_ld4(&sM[m][t4]);
            const float r = sU[m][c];
            u[0] += tm.x * r;
            u[1] += tm.y * r;
            u[2] += tm.z * r;
            u[3] += tm.w * r;
        }
#pragma unroll
        for (int a = 0; a < 3; ++a) {
            const float r = sU[t4 + a][c];
#pragma unroll
            for (int j = a + 1; j < 4; ++j) u[j] += sM[t4 + a][t4 + j] * r;
        }
        __syncthreads();  // every R read before U overwrites it
#pragma unroll
        for (int j = 0; j < 4; ++j) sU[t4 + j][c] = u[j];
        __syncthreads();

        // O_t = gamma_t scale/|q_t| (Q S)_t + sum_{m<=t} P[t][m] U_m, P[t][m] = M[t][m]: 4-column
        // blocks of M below the diagonal block, then the diagonal block's lower triangle.
        float acc[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[j] = sF[GDC_F(RQ) + t4 + j] * y[j];
        for (int m = 0; m < t4; m += 4) {
            const gdc_f4 u4 = {sU[m][c], sU[m + 1][c], sU[m + 2][c], sU[m + 3][c]};
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[j] = gdc_dot4(gdc_ld4(&sM[t4 + j][m]), u4, acc[j]);
        }
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const float um = sU[t4 + a][c];
#pragma unroll
            for (int j = a; j < 4; ++j) acc[j] += sM[t4 + j][t4 + a] * um;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (live && t4 + j < len) o[((size_t)(t0 + t4 + j) * hv + h) * dv + col] = acc[j];

        // S = gamma_L S + sum_t (e^{G_L-G_t}/|k_t|) k_t U_t^T
        const float gc = sF[GDC_F(GC)];
#pragma unroll
        for (int m = 0; m < SV; ++m)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[m][e] *= gc;
        for (int t = 0; t < L; ++t) {
            const float w = sF[GDC_F(RK) + t] * sU[t][c];
#pragma unroll
            for (int m = 0; m < SV; ++m) {
                const gdc_f4 k4 = gdc_ld4(&sK[t][t4 + 32 * m]);
                s[m][0] += k4.x * w;
                s[m][1] += k4.y * w;
                s[m][2] += k4.z * w;
                s[m][3] += k4.w * w;
            }
        }
#pragma unroll
        for (int m = 0; m < SV; ++m) *(gdc_f4*)&sST[c][t4 + 32 * m] = gdc_f4{s[m][0], s[m][1], s[m][2], s[m][3]};
        __syncthreads();  // the next chunk overwrites sK, sM, sF and sU, and reads sST
    }

#pragma unroll
    for (int m = 0; m < SV; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = t4 + 32 * m + e;
            if (live && i < dk) new_state[((size_t)h * dk + i) * dv + col] = s[m][e];
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
        PDL_ENTRY();                                                                                    \
        gdc_prep_body<DK, false>(q, k, g, beta, a_neg, dt_bias, rec, n, hk, hv, dk, scale, a_st, a_sh,  \
                                 d_st, d_sh, l2, l2_eps);                                               \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GDC_THREADS) gdn_chunk_prep_raw_d##DK(                 \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ alpha,      \
        const float* __restrict__ b, const float* __restrict__ a_neg,                                   \
        const float* __restrict__ dt_bias, float* __restrict__ rec, int n, int hk, int hv, int dk,      \
        float scale, int a_st, int a_sh, int d_st, int d_sh, int l2, float l2_eps) {                    \
        PDL_ENTRY();                                                                                    \
        gdc_prep_body<DK, true>(q, k, alpha, b, a_neg, dt_bias, rec, n, hk, hv, dk, scale, a_st, a_sh,  \
                                d_st, d_sh, l2, l2_eps);                                                \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GDC_THREADS) gdn_chunk_scan_d##DK(                     \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,          \
        const float* __restrict__ rec, const float* state, float* __restrict__ o, float* new_state,     \
        int n, int hk, int hv, int dk, int dv) {                                                        \
        PDL_ENTRY();                                                                                    \
        gdc_scan_body<DK>(q, k, v, rec, state, o, new_state, n, hk, hv, dk, dv);                        \
    }

DEFINE_GDC(64)   // dk <= 64
DEFINE_GDC(128)  // dk <= 128 (Qwen3.5)
