// Sampling one token per row of logits on the device (the `sample` op): one block per row.
//
// The op's meaning (graphir.ops.sample_row): greedy when temperature <= 0 or top_k == 1;
// otherwise keep the top_k largest logits (ties: lower id first), weight them by
// exp((x - max) / temperature), keep the most likely ones while the mass before them is below
// top_p of the total (ties: lower id first), and draw the first kept token, in id order, whose
// cumulative weight exceeds u times the kept total.
//
// No sort: each thread owns one contiguous segment of the row, so thread order is id order.
// The top_k and top_p cuts are found by radix selection on the logits' order-preserving integer
// keys (4 passes of 8 bits, counting for top_k, summing weights for top_p); ties at a cut are
// resolved in id order with one block scan; the draw is one more block scan.
#include "common.cuh"

#define SAMPLE_THREADS 1024
#define NONE 0x7fffffff

// An unsigned key with the same order as the float (larger float, larger key).
DEVICE unsigned int order_key(float f) {
    const unsigned int b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Exclusive prefix sum over the block in thread order, and the block total.
template <typename T>
DEVICE T block_exclusive_scan(T v, T* buf, T& total) {
    const int t = threadIdx.x;
    __syncthreads();
    buf[t] = v;
    __syncthreads();
    for (int o = 1; o < blockDim.x; o <<= 1) {  // Hillis-Steele, inclusive
        const T add = t >= o ? buf[t - o] : (T)0;
        __syncthreads();
        buf[t] += add;
        __syncthreads();
    }
    total = buf[blockDim.x - 1];
    return buf[t] - v;
}

struct Cut {             // keep an element when its key > key, or when key == key and it is among
    unsigned int key;    // the first `ties` such elements in id order; ties < 0: no cut, keep all
    long long ties;
};

DEVICE bool above(unsigned int k, const Cut& c, long long& tie_rank) {
    if (c.ties < 0 || k > c.key) return true;
    if (k < c.key) return false;
    return tie_rank++ < c.ties;
}

// Better of two (value, index) candidates: larger value, then lower index; NONE loses to anything.
DEVICE void better(float& bv, int& bi, float ov, int oi) {
    if (oi != NONE && (bi == NONE || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
}

// Stage 1 of the largest logit: block (g, row) scans ARGMAX_CHUNK logits of the row and writes its
// best (value, index) to part_v/part_i[row * gridDim.x + g]. One block reading a 150k-250k row
// alone took 30-48 us (H200, `profile_gpu_decode.py`); spread over ~40-60 blocks it is a few us.
#define ARGMAX_THREADS 256
#define ARGMAX_CHUNK 4096
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) row_argmax_part_f32(
    const float* __restrict__ logits, float* __restrict__ part_v, int* __restrict__ part_i, int ncols) {
    PDL_ENTRY();
    __shared__ float sv[ARGMAX_THREADS / WARP_SIZE];
    __shared__ int si[ARGMAX_THREADS / WARP_SIZE];
    const float* x = logits + (long long)blockIdx.y * ncols;
    const int lo = blockIdx.x * ARGMAX_CHUNK, hi = min(ncols, lo + ARGMAX_CHUNK);
    float bv = NEG_INF;
    int bi = NONE;
#pragma unroll 4
    for (int i = lo + threadIdx.x; i < hi; i += ARGMAX_THREADS) better(bv, bi, x[i], i);
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) better(bv, bi, SHFL_XOR(bv, o), SHFL_XOR(bi, o));
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < ARGMAX_THREADS / WARP_SIZE; ++w) better(bv, bi, sv[w], si[w]);
        part_v[blockIdx.y * gridDim.x + blockIdx.x] = bv;
        part_i[blockIdx.y * gridDim.x + blockIdx.x] = bi;
    }
}

// n_part > 0: the row's largest logit is merged from row_argmax_part_f32's n_part candidates
// instead of scanned here.
extern "C" __global__ void sample_f32(const float* __restrict__ logits, const float* __restrict__ settings,
                                      int* __restrict__ out, int ncols, const float* __restrict__ part_v,
                                      const int* __restrict__ part_i, int n_part) {
    PDL_ENTRY();
    __shared__ float sv[MAX_THREADS / WARP_SIZE];
    __shared__ int si[MAX_THREADS / WARP_SIZE];
    __shared__ unsigned int count_hist[256];
    __shared__ float mass_hist[256];
    __shared__ float fscan[SAMPLE_THREADS];
    __shared__ long long iscan[SAMPLE_THREADS];
    __shared__ unsigned int pick_bin;
    __shared__ long long pick_rest;
    __shared__ float pick_mass;
    __shared__ int chosen;

    const float* x = logits + (long long)blockIdx.x * ncols;
    const float temperature = settings[blockIdx.x * 4 + 0];
    int top_k = (int)settings[blockIdx.x * 4 + 1];
    const float top_p = settings[blockIdx.x * 4 + 2];
    const float u = settings[blockIdx.x * 4 + 3];
    const int seg = (ncols + blockDim.x - 1) / blockDim.x;
    const int lo = min(ncols, (int)threadIdx.x * seg), hi = min(ncols, lo + seg);

    // 1. the largest logit, first index on ties (strided, so a warp's loads coalesce: this pass is
    //    all that greedy decoding runs)
    float bv = NEG_INF;
    int bi = NONE;
    if (n_part > 0) {
        for (int j = threadIdx.x; j < n_part; j += blockDim.x)
            better(bv, bi, part_v[blockIdx.x * n_part + j], part_i[blockIdx.x * n_part + j]);
    } else {
        for (int i = threadIdx.x; i < ncols; i += blockDim.x)
            if (bi == NONE || x[i] > bv) { bv = x[i]; bi = i; }
    }
    {   // block-wide best: larger value, then lower index
        const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
        const int n_warps = (blockDim.x + WARP_SIZE - 1) / WARP_SIZE;
        for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
            for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
                const float ov = SHFL_XOR(bv, o);
                const int oi = SHFL_XOR(bi, o);
                if (oi != NONE && (bi == NONE || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
            }
            if (pass == 1) break;
            __syncthreads();
            if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
            __syncthreads();
            bv = lane < n_warps ? sv[lane] : NEG_INF;
            bi = lane < n_warps ? si[lane] : NONE;
        }
    }
    const float xmax = bv;
    if (!(temperature > 0.0f) || top_k == 1) {
        if (threadIdx.x == 0) out[blockIdx.x] = bi;
        return;
    }
    const float inv_t = 1.0f / temperature;

    // 2. top_k: the k-th largest key, and how many elements equal to it are kept
    Cut kcut = {0u, -1};
    if (top_k > 0 && top_k < ncols) {
        unsigned int prefix = 0u, mask = 0u;
        long long rest = top_k;  // still to take within the elements matching prefix
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = threadIdx.x; b < 256; b += blockDim.x) count_hist[b] = 0u;
            __syncthreads();
            for (int i = lo; i < hi; ++i) {
                const unsigned int k = order_key(x[i]);
                if ((k & mask) == prefix) atomicAdd(&count_hist[(k >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                long long above_bins = 0;
                int b = 255;
                for (; b > 0 && above_bins + count_hist[b] < rest; --b) above_bins += count_hist[b];
                pick_bin = (unsigned int)b;
                pick_rest = rest - above_bins;
            }
            __syncthreads();
            prefix |= pick_bin << shift;
            mask |= 255u << shift;
            rest = pick_rest;
        }
        kcut.key = prefix;
        kcut.ties = rest;
    }
    // the rank of this thread's first tie at the top_k cut among all ties, in id order
    long long k_base = 0;
    if (kcut.ties >= 0) {
        long long mine = 0, total;
        for (int i = lo; i < hi; ++i) mine += order_key(x[i]) == kcut.key;
        k_base = block_exclusive_scan<long long>(mine, iscan, total);
    }

    // 3. top_p: among the top_k survivors, the key of the last kept element by weight
    float z_local = 0.0f;
    {
        long long r = k_base;
        for (int i = lo; i < hi; ++i)
            if (above(order_key(x[i]), kcut, r)) z_local += __expf((x[i] - xmax) * inv_t);
    }
    float z_total;
    block_exclusive_scan<float>(z_local, fscan, z_total);
    bool p_cut = false;  // the top_p cut is active: keep keys above p_key, and ties at it by weight
    unsigned int p_key = 0u;
    float mass_above_cut = 0.0f;
    const float target = top_p * z_total;
    if (top_p < 1.0f) {
        unsigned int prefix = 0u, mask = 0u;
        float above_mass = 0.0f;  // weight of survivors with keys above the prefix's range
        bool found = true;
        for (int shift = 24; shift >= 0 && found; shift -= 8) {
            for (int b = threadIdx.x; b < 256; b += blockDim.x) { mass_hist[b] = 0.0f; count_hist[b] = 0u; }
            __syncthreads();
            long long r = k_base;
            for (int i = lo; i < hi; ++i) {
                const unsigned int k = order_key(x[i]);
                if (above(k, kcut, r) && (k & mask) == prefix) {
                    atomicAdd(&mass_hist[(k >> shift) & 255u], __expf((x[i] - xmax) * inv_t));
                    atomicAdd(&count_hist[(k >> shift) & 255u], 1u);
                }
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                // the bin holding the first element (largest first) at which the mass reaches target
                float m = above_mass;
                int b = 255, pick = -1;
                for (; b >= 0; --b) {
                    if (!count_hist[b]) continue;
                    if (m + mass_hist[b] >= target) { pick = b; break; }
                    m += mass_hist[b];
                }
                pick_bin = (unsigned int)pick;
                pick_mass = m;
            }
            __syncthreads();
            if ((int)pick_bin < 0) {
                found = false;  // rounding left the whole mass below target: keep every survivor
            } else {
                prefix |= pick_bin << shift;
                mask |= 255u << shift;
                above_mass = pick_mass;
            }
        }
        if (found) {
            p_cut = true;
            p_key = prefix;
            mass_above_cut = above_mass;
        }
    }
    // ties at the top_p cut: kept in id order while the mass before them is below target
    float p_base = 0.0f;
    if (p_cut) {
        float mine = 0.0f, total;
        long long r = k_base;
        for (int i = lo; i < hi; ++i) {
            const unsigned int k = order_key(x[i]);
            if (above(k, kcut, r) && k == p_key) mine += __expf((x[i] - xmax) * inv_t);
        }
        p_base = block_exclusive_scan<float>(mine, fscan, total);
    }

    // 4. the draw: the kept weights of this thread, the block's prefix, then a walk in id order
    const auto kept = [&](unsigned int k, long long& rk, float& before_tie, float w) -> bool {
        if (!above(k, kcut, rk)) return false;
        if (!p_cut || k > p_key) return true;
        if (k < p_key) return false;
        const bool keep = mass_above_cut + before_tie < target;
        before_tie += w;
        return keep;
    };
    float mine = 0.0f;
    {
        long long rk = k_base;
        float bt = p_base;
        for (int i = lo; i < hi; ++i) {
            const float w = __expf((x[i] - xmax) * inv_t);
            if (kept(order_key(x[i]), rk, bt, w)) mine += w;
        }
    }
    float kept_total;
    const float base = block_exclusive_scan<float>(mine, fscan, kept_total);
    const float r = u * kept_total;
    if (threadIdx.x == 0) chosen = NONE;
    __syncthreads();
    int last_kept = -1;
    {
        long long rk = k_base;
        float bt = p_base, c = base;
        for (int i = lo; i < hi; ++i) {
            const float w = __expf((x[i] - xmax) * inv_t);
            if (!kept(order_key(x[i]), rk, bt, w) || w <= 0.0f) continue;
            last_kept = i;
            c += w;
            if (c > r) { atomicMin(&chosen, i); break; }
        }
    }
    __syncthreads();
    if (chosen == NONE) {  // rounding put r at or past the summed total: the last kept token
        __shared__ int last;
        if (threadIdx.x == 0) last = -1;
        __syncthreads();
        if (last_kept >= 0) atomicMax(&last, last_kept);
        __syncthreads();
        if (threadIdx.x == 0) out[blockIdx.x] = last >= 0 ? last : bi;
    } else if (threadIdx.x == 0) {
        out[blockIdx.x] = chosen;
    }
}
