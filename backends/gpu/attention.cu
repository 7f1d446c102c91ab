// flash_attn (graphir/ops.py): causal, windowed, GQA attention over a KV cache whose valid
// length kv_len and query positions are read on the device, so one launch serves every call.
//
//   attn_decode_*   split-K flash decoding for a few queries: grid (split, kv head x head chunk,
//                   query). Each block scores the rows of its split for every q head of one GQA
//                   group (each K/V row is read once per kv head) and writes a partial
//                   (max, sum, acc[dv]) per (query, head, split). The shape classes (_d64_g4 ...)
//                   take R rows per row group per step with 16-byte loads (attn_decode_tile);
//                   `_any` (odd head dims, unaligned K/V) one row at a time with element loads
//                   (attn_decode_row).
//   attn_combine    merges the partials of the active splits into the output.
//   attn_prefill_*  many queries: a block takes QT queries x one GQA head chunk, streams K/V tiles
//                   through shared memory (converted to f32 once) and skips tiles outside the
//                   union of its queries' visible ranges.
//
// Layout inside a block: T consecutive lanes ("row group") share one K/V row (decode) or one
// query (prefill); lane t owns NV 4-element vectors of a row, so a group's lanes read consecutive
// 16-byte pieces (coalesced; broadcast in shared memory) and a dot product needs log2(T)
// shuffles. T divides 32, so groups never straddle a warp (32 or 64).
// Scores are in the log2 domain: q is pre-scaled by scale*log2(e) and exp2f is used throughout.
#include "common.cuh"

#ifndef ATTN_DECODE_THREADS
#define ATTN_DECODE_THREADS 128
#endif
#ifndef ATTN_PREFILL_THREADS
#define ATTN_PREFILL_THREADS 128  // 2 blocks per SM at ~200 registers: one loads a tile while the other computes
#endif
#ifndef ATTN_COMBINE_THREADS
#define ATTN_COMBINE_THREADS 256
#endif
#ifndef ATTN_MAX_SPLITS
#define ATTN_MAX_SPLITS 1024  // the combine kernel keeps one weight per split in shared memory
#endif
#ifndef ATTN_TILE_FLOATS
#define ATTN_TILE_FLOATS 4096  // prefill K tile rows x DK (and the same for V): 2 x 16 KiB of shared memory
#endif

struct alignas(16) vf4 {
    float x, y, z, w;
};
struct alignas(8) vh4 {  // four f16 as raw bits: 8-byte loads, converted after the load lands
    unsigned int lo, hi;
};

// f16 -> f32 with the hardware conversion (one instruction, exact for every f16 value incl.
// subnormals, inf and nan): the integer version in common.cuh costs ~8 instructions per element,
// and the decode loop converts 2*d elements per K/V row at full memory bandwidth.
#if defined(__HIPCC__) || !defined(__CUDA_ARCH__)  // HIP, and the host build of the tests (_host_emulation.py)
DEVICE float h2f(unsigned int h) { return (float)__builtin_bit_cast(_Float16, (u16)h); }
#else
DEVICE float h2f(unsigned int h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)h));
    return f;
}
#endif

DEVICE vf4 zero4() { return vf4{0.0f, 0.0f, 0.0f, 0.0f}; }
DEVICE vf4 to_f32(vf4 r) { return r; }
DEVICE vf4 to_f32(vh4 r) { return vf4{h2f(r.lo & 0xffffu), h2f(r.lo >> 16), h2f(r.hi & 0xffffu), h2f(r.hi >> 16)}; }

// Elements e..e+3 of a row of n elements, raw, zeros at and past n. VEC: n % 4 == 0 and rows
// aligned (checked at lowering), so one vector load; otherwise element by element.
template <bool VEC>
DEVICE vf4 load_raw(const float* __restrict__ row, int e, int n) {
    if (VEC) return e < n ? *(const vf4*)(row + e) : zero4();
    vf4 r;
    r.x = e < n ? row[e] : 0.0f;
    r.y = e + 1 < n ? row[e + 1] : 0.0f;
    r.z = e + 2 < n ? row[e + 2] : 0.0f;
    r.w = e + 3 < n ? row[e + 3] : 0.0f;
    return r;
}

template <bool VEC>
DEVICE vh4 load_raw(const u16* __restrict__ row, int e, int n) {
    if (VEC) return e < n ? *(const vh4*)(row + e) : vh4{0u, 0u};
    unsigned int a = e < n ? row[e] : 0u, b = e + 1 < n ? row[e + 1] : 0u;
    unsigned int c = e + 2 < n ? row[e + 2] : 0u, d = e + 3 < n ? row[e + 3] : 0u;
    return vh4{a | (b << 16), c | (d << 16)};
}

template <typename KV> struct RawOf;
template <> struct RawOf<float> { typedef vf4 type; };
template <> struct RawOf<u16> { typedef vh4 type; };

template <int T>
DEVICE float group_sum(float v) {  // xor butterfly within T aligned lanes: every lane gets the same bits
#pragma unroll
    for (int o = T / 2; o > 0; o >>= 1) v += SHFL_XOR(v, o);
    return v;
}

DEVICE int cdiv_i(int a, int b) { return (a + b - 1) / b; }

// Rows [lo, hi) query position p may see among the first L rows (all <= cap). Empty: hi <= lo.
DEVICE void visible_range(int p, int L, int window, int& lo, int& hi) {
    if (p < 0) {  // sees no key (j <= p is impossible)
        lo = 0, hi = 0;
        return;
    }
    hi = p < L ? p + 1 : L;
    lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;  // p >= 0, window > 0: no overflow
}

// Split s of n_split covers rows [s*chunk, min((s+1)*chunk, Ls)): chunk follows the rows the query can
// see, Ls = split_len(p, L) (never below min_chunk), so short contexts use few splits and long ones use
// them all. attn_combine uses the same formula to know which splits wrote a partial. Ls is the query's own
// end (p + 1), not the call's kv_len: a verify call's query at position p is then cut into the splits of
// the decode step at p (whose kv_len is p + 1), and with the same n_split (attention.py) its partials and
// their merge are that step's bit for bit.
DEVICE int split_len(int p, int L) { return p >= 0 && p < L ? p + 1 : L; }

DEVICE int split_chunk(int Ls, int n_split, int min_chunk) {
    int c = cdiv_i(Ls, n_split);
    return c > min_chunk ? c : min_chunk;
}

// Scores one K/V row for the GB heads of a group and folds it into their online softmax.
// Every lane runs the shuffles (warp-uniform control flow); only `take` rows are folded in.
// The running max only moves up, so acc and l are rescaled only when a row raises it.
template <int GB, int NV, int T>
DEVICE void attend_row(const vf4 (&qr)[GB][NV], const vf4 (&kr)[NV], const vf4 (&vr)[NV], int ng, bool take,
                       float (&m)[GB], float (&l)[GB], vf4 (&acc)[GB][NV]) {
#pragma unroll
    for (int g = 0; g < GB; ++g) {
        if (g < ng) {  // ng is block-uniform
            float s = 0.0f;
#pragma unroll
            for (int n = 0; n < NV; ++n)
                s += qr[g][n].x * kr[n].x + qr[g][n].y * kr[n].y + qr[g][n].z * kr[n].z + qr[g][n].w * kr[n].w;
            s = group_sum<T>(s);
            if (take) {
                if (s > m[g]) {
                    const float c = exp2f(m[g] - s);  // 0 on the first row (m = -inf)
                    l[g] *= c;
#pragma unroll
                    for (int n = 0; n < NV; ++n) {
                        acc[g][n].x *= c, acc[g][n].y *= c, acc[g][n].z *= c, acc[g][n].w *= c;
                    }
                    m[g] = s;
                }
                const float pr = exp2f(s - m[g]);
                l[g] += pr;
#pragma unroll
                for (int n = 0; n < NV; ++n) {
                    acc[g][n].x += pr * vr[n].x, acc[g][n].y += pr * vr[n].y;
                    acc[g][n].z += pr * vr[n].z, acc[g][n].w += pr * vr[n].w;
                }
            }
        }
    }
}

// q rows of the block's heads, pre-scaled, in the lane's vectors (zeros past d).
template <int GB, int NV, int T>
DEVICE void load_q(const float* __restrict__ q, long long qrow0, int d, int ng, int t, float scale2, bool active,
                   vf4 (&qr)[GB][NV]) {
#pragma unroll
    for (int g = 0; g < GB; ++g) {
#pragma unroll
        for (int n = 0; n < NV; ++n) {
            const int e = (n * T + t) * 4;
            vf4 r = zero4();
            if (active && g < ng) r = load_raw<false>(q + qrow0 + (long long)g * d, e, d);
            qr[g][n] = vf4{r.x * scale2, r.y * scale2, r.z * scale2, r.w * scale2};
        }
    }
}

// ---------------------------------------------------------------- decode: split-K
// A decode lane owns NV 4-element vectors of a row: vector n of lane t holds elements
// tile_elem(n, t) .. +3, W consecutive vectors per 16-byte load (W = 1: vectors n*T + t).
template <int T, int W>
DEVICE int tile_elem(int n, int t) { return ((n / W) * T + t) * (4 * W) + (n % W) * 4; }

// The block's partials for heads h0 + g (g < ng) from the online softmax (m, l, acc) of every row
// group: each group is rescaled to the block max and summed through shared memory.
template <int GB, int NV, int T, int W>
DEVICE void write_partials(const float (&m)[GB], const float (&l)[GB], const vf4 (&acc)[GB][NV], int ng,
                           long long pbase, int n_split, int dv, float* __restrict__ part_m,
                           float* __restrict__ part_l, float* __restrict__ part_acc) {
    constexpr int NT = ATTN_DECODE_THREADS, RG = NT / T, DK = T * NV * 4;
    __shared__ float sm_m[RG][GB], sm_l[RG][GB];
    __shared__ vf4 sm_acc[RG][DK / 4];
    const int tid = threadIdx.x, t = tid % T, rg = tid / T;
    if (t == 0) {
#pragma unroll
        for (int g = 0; g < GB; ++g) sm_m[rg][g] = m[g];
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < GB; ++g) {
        if (g >= ng) continue;  // ng is block-uniform (not break: the loop must unroll, acc stays in registers)
        float M = NEG_INF;
        for (int r = 0; r < RG; ++r) M = fmaxf(M, sm_m[r][g]);
        const float f = m[g] == NEG_INF ? 0.0f : exp2f(m[g] - M);  // a group that saw no row adds nothing
#pragma unroll
        for (int n = 0; n < NV; ++n)
            sm_acc[rg][tile_elem<T, W>(n, t) / 4] = vf4{acc[g][n].x * f, acc[g][n].y * f, acc[g][n].z * f, acc[g][n].w * f};
        if (t == 0) sm_l[rg][g] = l[g] * f;
        __syncthreads();
        const float* sa = (const float*)&sm_acc[0][0];
        float* pa = part_acc + (pbase + (long long)g * n_split) * dv;
        for (int e = tid; e < dv; e += NT) {
            float a = 0.0f;
            for (int r = 0; r < RG; ++r) a += sa[r * DK + e];
            pa[e] = a;
        }
        if (tid == 0) {
            float ls = 0.0f;
            for (int r = 0; r < RG; ++r) ls += sm_l[r][g];
            part_m[pbase + (long long)g * n_split] = M;
            part_l[pbase + (long long)g * n_split] = ls;
        }
        __syncthreads();  // sm_acc is rewritten for the next head
    }
}

// ---------------------------------------------------------------- decode: split-K, row by row
// The `_any` fallback: element loads (any d, dv, any alignment), one row per row group at a time
// (the next row's loads are issued before this one is used). Same grid, split formula and
// partials as attn_decode_tile; attn_combine merges either.
template <typename KV, int GB, int NV, int T>
DEVICE void attn_decode_row(int s, const float* __restrict__ q, const KV* __restrict__ k, const KV* __restrict__ v,
                            int p, int L, float* __restrict__ part_m,
                            float* __restrict__ part_l, float* __restrict__ part_acc, int hq, int hk, int d, int dv,
                            int cap, int n_split, int min_chunk, float scale2, int window, int n_gch, int* errflag,
                            int code) {
    typedef typename RawOf<KV>::type Raw;
    constexpr int RG = ATTN_DECODE_THREADS / T;

    const int tid = threadIdx.x, t = tid % T, rg = tid / T;
    const int qi = blockIdx.z;
    const int kvh = blockIdx.y / n_gch, gc = blockIdx.y % n_gch;
    const int G = hq / hk, h0 = kvh * G + gc * GB;
    const int ng = G - gc * GB < GB ? G - gc * GB : GB;

    if (L < 0 || L > cap) {  // attn_combine writes zeros
        if (s == 0 && blockIdx.y == 0 && qi == 0 && tid == 0) report_error(errflag, code, L);
        return;
    }
    const int Ls = split_len(p, L), chunk = split_chunk(Ls, n_split, min_chunk);
    const int s0 = s * chunk;
    if (s0 >= Ls) return;  // inactive split: attn_combine does not read it
    const int s1 = s0 + chunk < Ls ? s0 + chunk : Ls;

    int lo, hi;
    visible_range(p, L, window, lo, hi);
    lo = lo > s0 ? lo : s0;
    hi = hi < s1 ? hi : s1;
    const long long pbase = ((long long)qi * hq + h0) * n_split + s;  // partial of head h0 + g: pbase + g*n_split
    if (lo >= hi) {  // nothing visible here: a neutral partial (combine never reads its acc)
        if (tid < ng) part_m[pbase + (long long)tid * n_split] = NEG_INF, part_l[pbase + (long long)tid * n_split] = 0.0f;
        return;
    }

    vf4 qr[GB][NV];
    load_q<GB, NV, T>(q, ((long long)qi * hq + h0) * d, d, ng, t, scale2, true, qr);
    float m[GB], l[GB];
    vf4 acc[GB][NV];
#pragma unroll
    for (int g = 0; g < GB; ++g) {
        m[g] = NEG_INF, l[g] = 0.0f;
#pragma unroll
        for (int n = 0; n < NV; ++n) acc[g][n] = zero4();
    }

    // Row group rg takes rows lo + rg, lo + rg + RG, ...; the next row's raw K/V is loaded before
    // the current one is used, so two rows per group are in flight. The trip count is the same
    // for every group (shuffles need the whole warp); rows at or past hi are never loaded.
    const long long kstride = (long long)hk * d, vstride = (long long)hk * dv;
    const KV* kb = k + (long long)kvh * d;
    const KV* vb = v + (long long)kvh * dv;
    Raw nk[NV], nv[NV];
    int j = lo + rg;
#pragma unroll
    for (int n = 0; n < NV; ++n) {
        const int e = (n * T + t) * 4;
        nk[n] = j < hi ? load_raw<false>(kb + j * kstride, e, d) : Raw{};
        nv[n] = j < hi ? load_raw<false>(vb + j * vstride, e, dv) : Raw{};
    }
    for (int base = lo; base < hi; base += RG, j += RG) {
        vf4 kr[NV], vr[NV];
#pragma unroll
        for (int n = 0; n < NV; ++n) kr[n] = to_f32(nk[n]), vr[n] = to_f32(nv[n]);
        const int jn = j + RG;
        if (jn < hi) {
#pragma unroll
            for (int n = 0; n < NV; ++n) {
                const int e = (n * T + t) * 4;
                nk[n] = load_raw<false>(kb + jn * kstride, e, d);
                nv[n] = load_raw<false>(vb + jn * vstride, e, dv);
            }
        }
        attend_row<GB, NV, T>(qr, kr, vr, ng, j < hi, m, l, acc);
    }

    write_partials<GB, NV, T, 1>(m, l, acc, ng, pbase, n_split, dv, part_m, part_l, part_acc);
}

// ---------------------------------------------------------------- decode: split-K, tiles of rows
// Same grid, partials and split formula as attn_decode_row, built for bytes in flight (measured,
// H200, Qwen3-8B at 8k: the row-at-a-time kernel reached 27% of copy bandwidth for f16, 44% for
// f32, latency bound; this one with R=2 41.5% and 53.1%):
//  - each row group takes R rows per step (rows base + r*RG + rg), so a lane has R K rows and
//    R V rows of loads outstanding; K for the next step is issued as soon as this step's scores
//    are formed and V as soon as its products are accumulated, so loads overlap all compute;
//  - the R scores of a step are folded with one max, one rescale of acc and R exp2f (no serial
//    compare-rescale chain per row);
//  - f16 rows are read 16 bytes (8 halves) per lane and load, f32 rows 16 bytes per load.
// A lane owns NV 4-element vectors of a row; W of them (2 for f16 with NV even, else 1) come
// from one load: vector n of lane t holds elements tile_elem(n, t) .. +3.
template <typename KV, int NV> struct TileW { static constexpr int value = 1; };
template <> struct TileW<u16, 2> { static constexpr int value = 2; };
template <> struct TileW<u16, 4> { static constexpr int value = 2; };

struct alignas(16) vh8 {  // eight f16 as raw bits: one 16-byte load
    unsigned int a, b, c, d;
};

// Raw loads of the W vectors at elements e .. e+4W-1 of one row, zeros past its end (the whole
// load is in the row or past it: n % (4W) == 0, checked at lowering), and their conversion.
DEVICE void tload(vf4& r, const float* __restrict__ row, int e, int n) { r = e < n ? *(const vf4*)(row + e) : zero4(); }
DEVICE void tload(vh4& r, const u16* __restrict__ row, int e, int n) { r = e < n ? *(const vh4*)(row + e) : vh4{0u, 0u}; }
DEVICE void tload(vh8& r, const u16* __restrict__ row, int e, int n) {
    r = e < n ? *(const vh8*)(row + e) : vh8{0u, 0u, 0u, 0u};
}
DEVICE void tcvt(vf4 r, vf4* o) { o[0] = r; }
DEVICE void tcvt(vh4 r, vf4* o) { o[0] = to_f32(r); }
DEVICE void tcvt(vh8 r, vf4* o) { o[0] = to_f32(vh4{r.a, r.b}), o[1] = to_f32(vh4{r.c, r.d}); }

template <typename KV, int W> struct TileRaw { typedef vf4 type; };
template <> struct TileRaw<u16, 1> { typedef vh4 type; };
template <> struct TileRaw<u16, 2> { typedef vh8 type; };

template <typename KV, int GB, int NV, int T, int R>
DEVICE void attn_decode_tile(int s, const float* __restrict__ q, const KV* __restrict__ k, const KV* __restrict__ v,
                             int p, int L, float* __restrict__ part_m,
                             float* __restrict__ part_l, float* __restrict__ part_acc, int hq, int hk, int d, int dv,
                             int cap, int n_split, int min_chunk, float scale2, int window, int n_gch, int* errflag,
                             int code) {
    constexpr int W = TileW<KV, NV>::value, NL = NV / W;  // NL loads per lane per row
    typedef typename TileRaw<KV, W>::type Raw;
    constexpr int RG = ATTN_DECODE_THREADS / T, STEP = RG * R;

    const int tid = threadIdx.x, t = tid % T, rg = tid / T;
    const int qi = blockIdx.z;
    const int kvh = blockIdx.y / n_gch, gc = blockIdx.y % n_gch;
    const int G = hq / hk, h0 = kvh * G + gc * GB;
    const int ng = G - gc * GB < GB ? G - gc * GB : GB;

    if (L < 0 || L > cap) {  // attn_combine writes zeros
        if (s == 0 && blockIdx.y == 0 && qi == 0 && tid == 0) report_error(errflag, code, L);
        return;
    }
    const int Ls = split_len(p, L), chunk = split_chunk(Ls, n_split, min_chunk);
    const int s0 = s * chunk;
    if (s0 >= Ls) return;  // inactive split: the combine does not read it
    const int s1 = s0 + chunk < Ls ? s0 + chunk : Ls;

    int lo, hi;
    visible_range(p, L, window, lo, hi);
    lo = lo > s0 ? lo : s0;
    hi = hi < s1 ? hi : s1;
    const long long pbase = ((long long)qi * hq + h0) * n_split + s;  // partial of head h0 + g: pbase + g*n_split
    if (lo >= hi) {  // nothing visible here: a neutral partial (the combine never reads its acc)
        if (tid < ng) part_m[pbase + (long long)tid * n_split] = NEG_INF, part_l[pbase + (long long)tid * n_split] = 0.0f;
        return;
    }

    const long long kstride = (long long)hk * d, vstride = (long long)hk * dv;
    const KV* kb = k + (long long)kvh * d;
    const KV* vb = v + (long long)kvh * dv;
    // First step's K and V are issued before q is read and scaled.
    Raw rk[R][NL], rv[R][NL];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int j = lo + r * RG + rg;
#pragma unroll
        for (int c = 0; c < NL; ++c) {
            const int e = tile_elem<T, W>(c * W, t);
            if (j < hi) tload(rk[r][c], kb + j * kstride, e, d); else rk[r][c] = Raw{};
            if (j < hi) tload(rv[r][c], vb + j * vstride, e, dv); else rv[r][c] = Raw{};
        }
    }

    vf4 qr[GB][NV];
#pragma unroll
    for (int g = 0; g < GB; ++g) {
#pragma unroll
        for (int n = 0; n < NV; ++n) {
            vf4 x = zero4();
            if (g < ng) x = load_raw<false>(q + ((long long)qi * hq + h0 + g) * d, tile_elem<T, W>(n, t), d);
            qr[g][n] = vf4{x.x * scale2, x.y * scale2, x.z * scale2, x.w * scale2};
        }
    }
    float m[GB], l[GB];
    vf4 acc[GB][NV];
#pragma unroll
    for (int g = 0; g < GB; ++g) {
        m[g] = NEG_INF, l[g] = 0.0f;
#pragma unroll
        for (int n = 0; n < NV; ++n) acc[g][n] = zero4();
    }

    // The trip count is block-uniform (shuffles need whole warps); rows at or past hi are never
    // loaded (zeros) and never folded in.
    for (int base = lo; base < hi; base += STEP) {
        float sc[R][GB];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            vf4 kr[NV];
#pragma unroll
            for (int c = 0; c < NL; ++c) tcvt(rk[r][c], &kr[c * W]);
#pragma unroll
            for (int g = 0; g < GB; ++g) {
                float a = 0.0f;
#pragma unroll
                for (int n = 0; n < NV; ++n)
                    a += qr[g][n].x * kr[n].x + qr[g][n].y * kr[n].y + qr[g][n].z * kr[n].z + qr[g][n].w * kr[n].w;
                sc[r][g] = a;
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int g = 0; g < GB; ++g) sc[r][g] = group_sum<T>(sc[r][g]);
        }
        const int nb = base + STEP;
#pragma unroll
        for (int r = 0; r < R; ++r) {  // next step's K into the registers just consumed
            const int j = nb + r * RG + rg;
#pragma unroll
            for (int c = 0; c < NL; ++c) {
                if (j < hi) tload(rk[r][c], kb + j * kstride, tile_elem<T, W>(c * W, t), d); else rk[r][c] = Raw{};
            }
        }
#pragma unroll
        for (int g = 0; g < GB; ++g) {  // scores become probabilities in place
            float mx = m[g];
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (base + r * RG + rg < hi) mx = fmaxf(mx, sc[r][g]);
            // mx = -inf only when this group has seen no row yet and has none in this step: nothing to fold
            const float c = mx == NEG_INF ? 1.0f : exp2f(m[g] - mx);  // 0 on the group's first row
            float ls = 0.0f;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                sc[r][g] = base + r * RG + rg < hi ? exp2f(sc[r][g] - mx) : 0.0f;
                ls += sc[r][g];
            }
            l[g] = l[g] * c + ls;
            m[g] = mx;
#pragma unroll
            for (int n = 0; n < NV; ++n) acc[g][n] = vf4{acc[g][n].x * c, acc[g][n].y * c, acc[g][n].z * c, acc[g][n].w * c};
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            vf4 vr[NV];
#pragma unroll
            for (int c = 0; c < NL; ++c) tcvt(rv[r][c], &vr[c * W]);
            const int j = nb + r * RG + rg;
#pragma unroll
            for (int c = 0; c < NL; ++c) {
                if (j < hi) tload(rv[r][c], vb + j * vstride, tile_elem<T, W>(c * W, t), dv); else rv[r][c] = Raw{};
            }
#pragma unroll
            for (int g = 0; g < GB; ++g) {
                const float w = sc[r][g];
#pragma unroll
                for (int n = 0; n < NV; ++n) {
                    acc[g][n].x += w * vr[n].x, acc[g][n].y += w * vr[n].y;
                    acc[g][n].z += w * vr[n].z, acc[g][n].w += w * vr[n].w;
                }
            }
        }
    }

    write_partials<GB, NV, T, W>(m, l, acc, ng, pbase, n_split, dv, part_m, part_l, part_acc);
}

// ---------------------------------------------------------------- combine
// out[qi, h, :] from the partials of the splits that ran. grid (hq, n_q). The splits are spread
// over CSG thread groups (each a run of 4-element column vectors), so the partials are read with
// CSG x unroll loads in flight instead of one split after another.
// The kernel is a chain of round trips after the decode kernel (kv_len, then the maxima, then the
// weighted rows), so everything it can read without knowing kv_len is read at once: kv_len itself
// before the wait where it is an Input (PDL_ENTRY_EARLY), and right after the wait each thread's
// maximum and sum and the first COMBINE_PRE splits' rows of its column run, for every split the grid
// has (those past the active ones hold stale values and are never used).
// Merging in the decode kernel instead (the last block of a kv-head group to finish, found with a
// fence and an atomic counter, merges that group's GB heads) was measured slower (H200, 2026-12-02,
// profile_gpu_decode.py): Qwen3-8B 17.61 us a layer against 4.90 + 3.26 here, Qwen3-0.6B 10.98
// against 3.90 + 3.22. The merge's dependent L2 round trips (counter, maxima, weights and sums, for
// each head in turn) then run after the splits on one block; this kernel's launch overlaps under PDL.
#ifndef COMBINE_PRE
#define COMBINE_PRE 4
#endif
#if IN_PART(0)
extern "C" __global__ void __launch_bounds__(ATTN_COMBINE_THREADS)
attn_combine(const float* __restrict__ part_m, const float* __restrict__ part_l, const float* __restrict__ part_acc,
             const int* __restrict__ pos, const int* __restrict__ kv_len, float* __restrict__ out, int hq, int dv,
             int cap, int n_split, int min_chunk, int early) {
    int L, p;
    PDL_ENTRY_EARLY(early, (L = kv_len[0], p = pos[blockIdx.y]));
    constexpr int NT = ATTN_COMBINE_THREADS, CW = 32, CSG = NT / CW;  // CW column vectors x CSG split groups
    __shared__ float w[ATTN_MAX_SPLITS];
    __shared__ float red[MAX_THREADS / WARP_SIZE];
    __shared__ vf4 sm[CSG][CW];
    const int tid = threadIdx.x, cl = tid % CW, sg = tid / CW;
    const long long row = (long long)blockIdx.y * hq + blockIdx.x;
    const long long base = row * n_split;
    const bool vec = (dv & 3) == 0;  // partial rows 16-byte aligned (scratch base is)
    const int nvec = (dv + 3) / 4;
    // Issued before kv_len is looked at: no load below waits for another.
    const float m0 = tid < n_split ? part_m[base + tid] : NEG_INF;
    const float l0 = tid < n_split ? part_l[base + tid] : 0.0f;
    vf4 pre[COMBINE_PRE];
#pragma unroll
    for (int i = 0; i < COMBINE_PRE; ++i) {
        const int sp = sg + CSG * i;
        const float* src = part_acc + (base + sp) * dv;
        pre[i] = sp < n_split && cl < nvec ? (vec ? *(const vf4*)(src + cl * 4) : load_raw<false>(src, cl * 4, dv))
                                           : zero4();
    }
    float* o = out + row * dv;
    if (L <= 0 || L > cap) {  // empty cache, or a bad kv_len the decode kernel reported
        for (int e = tid; e < dv; e += NT) o[e] = 0.0f;
        return;
    }
    const int Ls = split_len(p, L), chunk = split_chunk(Ls, n_split, min_chunk);
    const int na = cdiv_i(Ls, chunk);  // <= n_split
    float M = tid < na ? m0 : NEG_INF;
    for (int s = tid + NT; s < na; s += NT) M = fmaxf(M, part_m[base + s]);
    M = block_max(M, red);
    if (M == NEG_INF) {  // no visible key for this query
        for (int e = tid; e < dv; e += NT) o[e] = 0.0f;
        return;
    }
    float ls = 0.0f;
    for (int s = tid; s < na; s += NT) {
        const float ms = s == tid ? m0 : part_m[base + s];
        const float ws = exp2f(ms - M);  // 0 for empty splits (m = -inf)
        w[s] = ws;
        ls += ws != 0.0f ? ws * (s == tid ? l0 : part_l[base + s]) : 0.0f;
    }
    ls = block_sum(ls, red);  // its barriers also publish w[]
    const float inv = 1.0f / ls;  // >= 1: the split holding M contributes exp2(0) * (l >= 1)
    for (int c0 = 0; c0 < nvec; c0 += CW) {  // block-uniform trip count (barriers inside)
        const int cv = c0 + cl, e = cv * 4;
        vf4 a = zero4();
        if (cv < nvec) {
            int s = sg;
            if (c0 == 0) {  // the rows loaded above, in the same order as the loop below would add them
#pragma unroll
                for (int i = 0; i < COMBINE_PRE; ++i, s += CSG) {
                    const float ws = s < na ? w[s] : 0.0f;
                    if (ws != 0.0f) {  // empty splits' acc is never written (may hold anything)
                        a.x += ws * pre[i].x, a.y += ws * pre[i].y, a.z += ws * pre[i].z, a.w += ws * pre[i].w;
                    }
                }
            }
#pragma unroll 8
            for (; s < na; s += CSG) {
                const float ws = w[s];
                const float* src = part_acc + (base + s) * dv;
                const vf4 x = vec ? *(const vf4*)(src + e) : load_raw<false>(src, e, dv);
                if (ws != 0.0f) {
                    a.x += ws * x.x, a.y += ws * x.y, a.z += ws * x.z, a.w += ws * x.w;
                }
            }
        }
        sm[sg][cl] = a;
        __syncthreads();
        if (sg == 0 && cv < nvec) {
            vf4 r = zero4();
            for (int i = 0; i < CSG; ++i) r.x += sm[i][cl].x, r.y += sm[i][cl].y, r.z += sm[i][cl].z, r.w += sm[i][cl].w;
            const float rr[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (e + c < dv) o[e + c] = rr[c] * inv;
        }
        __syncthreads();  // sm is rewritten by the next column run
    }
}
#endif  // IN_PART(0)

// ---------------------------------------------------------------- prefill
template <typename KV, int GB, int NV, int T, bool VEC>
DEVICE void attn_prefill(const float* __restrict__ q, const KV* __restrict__ k, const KV* __restrict__ v,
                         const int* __restrict__ pos, const int* __restrict__ kv_len, float* __restrict__ out,
                         int n_q, int hq, int hk, int d, int dv, int cap, float scale2, int window, int n_gch,
                         int* errflag, int code) {
    constexpr int NT = ATTN_PREFILL_THREADS, QT = NT / T, DK = T * NV * 4, BK = ATTN_TILE_FLOATS / DK;
    __shared__ vf4 sm_k[BK][DK / 4], sm_v[BK][DK / 4];
    __shared__ int blo, bhi;

    const int tid = threadIdx.x, t = tid % T, rg = tid / T;
    const int qi = blockIdx.x * QT + rg;
    const int kvh = blockIdx.y / n_gch, gc = blockIdx.y % n_gch;
    const int G = hq / hk, h0 = kvh * G + gc * GB;
    const int ng = G - gc * GB < GB ? G - gc * GB : GB;
    const bool active = qi < n_q;

    const int L = kv_len[0];
    const bool bad = L < 0 || L > cap;
    if (bad && blockIdx.x == 0 && blockIdx.y == 0 && tid == 0) report_error(errflag, code, L);
    int lo = 0, hi = 0;
    if (active && !bad) visible_range(pos[qi], L, window, lo, hi);
    if (tid == 0) blo = 0x7fffffff, bhi = 0;
    __syncthreads();
    if (t == 0 && lo < hi) atomicMin(&blo, lo), atomicMax(&bhi, hi);
    __syncthreads();
    const int jlo = blo, jhi = bhi;  // union of the block's visible ranges (empty when bad)

    vf4 qr[GB][NV];
    load_q<GB, NV, T>(q, ((long long)qi * hq + h0) * d, d, ng, t, scale2, active, qr);
    float m[GB], l[GB];
    vf4 acc[GB][NV];
#pragma unroll
    for (int g = 0; g < GB; ++g) {
        m[g] = NEG_INF, l[g] = 0.0f;
#pragma unroll
        for (int n = 0; n < NV; ++n) acc[g][n] = zero4();
    }

    const long long kstride = (long long)hk * d, vstride = (long long)hk * dv;
    const KV* kb = k + (long long)kvh * d;
    const KV* vb = v + (long long)kvh * dv;
    const int kvec = (d + 3) / 4, vvec = (dv + 3) / 4;
    for (int j0 = jlo; j0 < jhi; j0 += BK) {
        const int rows = jhi - j0 < BK ? jhi - j0 : BK;  // rows j0.. < jhi <= L <= cap
        for (int i = tid; i < rows * kvec; i += NT) {
            const int r = i / kvec, c = i - r * kvec;
            sm_k[r][c] = to_f32(load_raw<VEC>(kb + (j0 + r) * kstride, c * 4, d));
        }
        for (int i = tid; i < rows * vvec; i += NT) {
            const int r = i / vvec, c = i - r * vvec;
            sm_v[r][c] = to_f32(load_raw<VEC>(vb + (j0 + r) * vstride, c * 4, dv));
        }
        __syncthreads();
        for (int r = 0; r < rows; ++r) {
            const int j = j0 + r;
            vf4 kr[NV], vr[NV];
#pragma unroll
            for (int n = 0; n < NV; ++n) {  // columns past d (dv) were never written: read as zeros
                const int c = n * T + t;
                kr[n] = c < kvec ? sm_k[r][c] : zero4();
                vr[n] = c < vvec ? sm_v[r][c] : zero4();
            }
            attend_row<GB, NV, T>(qr, kr, vr, ng, j >= lo && j < hi, m, l, acc);
        }
        __syncthreads();  // the tile is overwritten next
    }

    if (!active) return;
#pragma unroll
    for (int g = 0; g < GB; ++g) {
        if (g >= ng) continue;  // ng is block-uniform (not break: the loop must unroll, acc stays in registers)
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;  // no visible key: 0
        float* o = out + ((long long)qi * hq + h0 + g) * dv;
#pragma unroll
        for (int n = 0; n < NV; ++n) {
            const int e = (n * T + t) * 4;
            const float a[4] = {acc[g][n].x, acc[g][n].y, acc[g][n].z, acc[g][n].w};
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (e + c < dv) o[e + c] = a[c] * inv;
        }
    }
}

// ---------------------------------------------------------------- specializations
// Name suffix: KV dtype, DK (the largest head dim served: max(d, dv) <= DK) and GB (q heads per
// block; a GQA group is cut into chunks of GB). NV (4-element vectors per lane) sets T = DK/(4*NV).
// q and acc take GB*NV*4 registers each. Prefill (compute bound) keeps NV=4 where it fits for
// fewer shuffles per score. `_any` takes any d, dv <= 256 and any alignment (element loads), one
// head per block: the fallback. attention.py mirrors NVP (it sizes the prefill grid).
#define ATTN_DEFINE_PREFILL(KVNAME, KVT, DK, GB, NVP, VEC, SUFFIX)                                                \
    extern "C" __global__ void __launch_bounds__(ATTN_PREFILL_THREADS) attn_prefill_##KVNAME##SUFFIX(            \
        const float* q, const KVT* k, const KVT* v, const int* pos, const int* kv_len, float* out, int n_q,       \
        int hq, int hk, int d, int dv, int cap, float scale2, int window, int n_gch, int* errflag, int code) {    \
        PDL_ENTRY();                                                                                              \
        attn_prefill<KVT, GB, NVP, (DK) / (4 * (NVP)), VEC>(q, k, v, pos, kv_len, out, n_q, hq, hk, d, dv, cap,   \
                                                             scale2, window, n_gch, errflag, code);               \
    }
//                                                DK   GB NVP
#define ATTN_DEFINE_KV(KVNAME, KVT)                                   \
    ATTN_DEFINE_PREFILL(KVNAME, KVT, 64, 1, 4, true, _d64_g1)         \
    ATTN_DEFINE_PREFILL(KVNAME, KVT, 64, 4, 4, true, _d64_g4)         \
    ATTN_DEFINE_PREFILL(KVNAME, KVT, 64, 8, 2, true, _d64_g8)         \
    ATTN_DEFINE_PREFILL(KVNAME, KVT, 128, 1, 4, true, _d128_g1)       \
    ATTN_DEFINE_PREFILL(KVNAME, KVT, 128, 4, 4, true, _d128_g4)       \
    ATTN_DEFINE_PREFILL(KVNAME, KVT, 128, 8, 2, true, _d128_g8)       \
    ATTN_DEFINE_PREFILL(KVNAME, KVT, 256, 1, 4, true, _d256_g1)       \
    ATTN_DEFINE_PREFILL(KVNAME, KVT, 256, 4, 4, true, _d256_g4)       \
    ATTN_DEFINE_PREFILL(KVNAME, KVT, 256, 8, 2, true, _d256_g8)       \
    ATTN_DEFINE_PREFILL(KVNAME, KVT, 256, 1, 4, false, _any)

#if IN_PART(0)
ATTN_DEFINE_KV(f32, float)
#endif
#if IN_PART(1)
ATTN_DEFINE_KV(f16, u16)
#endif

// Decode: attn_decode_<kv><suffix>, the same suffixes as prefill. The shape classes run
// attn_decode_tile (16-byte loads: attention.py sends shapes it cannot load to `_any`, which runs
// attn_decode_row with element loads, one head per block). NV (tile): 2 where q and acc
// (GB*NV*4 registers each) leave room for R rows of raw K/V, 1 for GB=8 below DK=256.
// R: rows per row group per step. Registers do not depend on DK (ptxas, sm_90): f16 GB=4 R=2/4/8
// 128/168/254, f32 GB=4 R=1/2/4 127/139/209, i.e. 4, 3 and 2 blocks of 128 threads per SM.
// Measured on an H200 (2026-11-30, d128_g4, % of copy bandwidth at 1k/8k/32k): f16 R=2
// 7.3/41.5/58.5, R=4 9.1/38.4/58.4, R=8 8.8/39.3/51.3; f32 R=1 13.5/52.1/78.2, R=2 16.9/53.1/85.6,
// R=4 16.8/51.6/84.0. GB=1 and GB=8 keep the R chosen from registers (not measured).
// Each shape class has two entry points: attn_decode_* (a decode step: block x is split x) and
// attn_decode_walk_* (a verify call: gridDim.x < n_split, block x walks splits x, x + gridDim.x, ...), the
// same body per split. A verify call's query thus keeps the decode step's splits and their arithmetic (its
// partials are that step's bit for bit) in about one wave of blocks for all its queries, where a block a
// split took n_q waves. The loop is kept out of the decode kernels: it costs them registers (ptxas, sm_90:
// f32 d128_g4 143 -> 182, f16 d128_g4 128 -> 168, one resident block fewer per SM).
#define ATTN_DECODE_PARAMS(KVT)                                                                                   \
    const float *q, const KVT *k, const KVT *v, const int *pos, const int *kv_len, float *part_m, float *part_l, \
        float *part_acc, int hq, int hk, int d, int dv, int cap, int n_split, int min_chunk, float scale2,       \
        int window, int n_gch, int *errflag, int code, int early
#define ATTN_DECODE_ARGS q, k, v, p, L, part_m, part_l, part_acc, hq, hk, d, dv, cap, n_split, min_chunk, scale2, \
    window, n_gch, errflag, code
#define ATTN_DEFINE_ENTRIES(KVNAME, KVT, SUFFIX, BODY)                                                            \
    extern "C" __global__ void __launch_bounds__(ATTN_DECODE_THREADS) attn_decode_##KVNAME##SUFFIX(              \
        ATTN_DECODE_PARAMS(KVT)) {                                                                                \
        int L, p;                                                                                                 \
        PDL_ENTRY_EARLY(early, (L = kv_len[0], p = pos[blockIdx.z]));                                             \
        BODY(blockIdx.x, ATTN_DECODE_ARGS);                                                                       \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(ATTN_DECODE_THREADS) attn_decode_walk_##KVNAME##SUFFIX(         \
        ATTN_DECODE_PARAMS(KVT)) {                                                                                \
        int L, p;                                                                                                 \
        PDL_ENTRY_EARLY(early, (L = kv_len[0], p = pos[blockIdx.z]));                                             \
        for (int s = blockIdx.x; s < n_split; s += gridDim.x) BODY(s, ATTN_DECODE_ARGS);                          \
    }
#define ATTN_DEFINE_TILE(KVNAME, KVT, DK, GB, NV, R, SUFFIX) \
    ATTN_DEFINE_ENTRIES(KVNAME, KVT, SUFFIX, (attn_decode_tile<KVT, GB, NV, (DK) / (4 * (NV)), R>))
#define ATTN_DEFINE_ROW(KVNAME, KVT, DK, GB, NV, SUFFIX) \
    ATTN_DEFINE_ENTRIES(KVNAME, KVT, SUFFIX, (attn_decode_row<KVT, GB, NV, (DK) / (4 * (NV))>))
//                                                      DK  GB NV
#define ATTN_DEFINE_DECODE_KV(KVNAME, KVT, R1, R4, R8)                 \
    ATTN_DEFINE_TILE(KVNAME, KVT, 64, 1, 2, R1, _d64_g1)               \
    ATTN_DEFINE_TILE(KVNAME, KVT, 64, 4, 2, R4, _d64_g4)               \
    ATTN_DEFINE_TILE(KVNAME, KVT, 64, 8, 1, R8, _d64_g8)               \
    ATTN_DEFINE_TILE(KVNAME, KVT, 128, 1, 2, R1, _d128_g1)             \
    ATTN_DEFINE_TILE(KVNAME, KVT, 128, 4, 2, R4, _d128_g4)             \
    ATTN_DEFINE_TILE(KVNAME, KVT, 128, 8, 1, R8, _d128_g8)             \
    ATTN_DEFINE_TILE(KVNAME, KVT, 256, 1, 2, R1, _d256_g1)             \
    ATTN_DEFINE_TILE(KVNAME, KVT, 256, 4, 2, R4, _d256_g4)             \
    ATTN_DEFINE_TILE(KVNAME, KVT, 256, 8, 2, R8, _d256_g8)             \
    ATTN_DEFINE_ROW(KVNAME, KVT, 256, 1, 4, _any)

// The shipped R per (KV dtype, GQA class):  g1 g4 g8
#if IN_PART(2)
ATTN_DEFINE_DECODE_KV(f16, u16,              4, 2, 2)
#endif
#if IN_PART(3)
ATTN_DEFINE_DECODE_KV(f32, float,            2, 2, 1)
#endif
