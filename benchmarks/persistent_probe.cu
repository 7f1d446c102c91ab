// A probe for the persistent decode kernel (bench_gpu_persistent_probe.py): a chain of dependent bf16 GEMVs
// (y_s = W_s x_s, x_{s+1} = the first n_in of y_s) run by one kernel whose blocks stay resident and meet at a
// grid barrier between stages, instead of one kernel a GEMV. With EARLY, each warp loads its first weight
// batch of the next stage before the barrier, so weight traffic overlaps the wait; that overlap is what a
// persistent kernel can have and separate kernels (which may not read before the previous one ends) cannot.
// CUDA only, sm_70+ (the probe is not part of the backend; it compiles with NVRTC).
typedef unsigned short u16;

struct Stage {
    const uint4* w;  // n_out rows of n_in bf16 (n_in % 8 == 0), 16-byte pieces
    const float* x;  // n_in floats, written by the stage before (or the input)
    float* y;        // n_out floats
    int n_out, n_in;
};

#define PROBE_THREADS 512
#define PROBE_WARPS (PROBE_THREADS / 32)
#ifndef PROBE_NB
#define PROBE_NB 8  // 16-byte pieces a lane loads before using any (a batch): 32 lanes x 8 x 8 = 2,048 values
#endif

__device__ __forceinline__ float bf_lo(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(unsigned v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ float dot8(uint4 q, const float* x) {
    const float4 a = *(const float4*)x, b = *(const float4*)(x + 4);
    float s = bf_lo(q.x) * a.x;
    s = fmaf(bf_hi(q.x), a.y, s);
    s = fmaf(bf_lo(q.y), a.z, s);
    s = fmaf(bf_hi(q.y), a.w, s);
    s = fmaf(bf_lo(q.z), b.x, s);
    s = fmaf(bf_hi(q.z), b.y, s);
    s = fmaf(bf_lo(q.w), b.z, s);
    return fmaf(bf_hi(q.w), b.w, s);
}

// Every block of the grid arrives; the last resets the count and advances the generation the others spin on.
// bar[0]: arrivals, bar[1]: generation. Needs every block resident (cooperative launch).
__device__ void grid_barrier(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned* vb = bar;
        const unsigned gen = vb[1];
        __threadfence();
        if (atomicAdd(bar, 1u) == gridDim.x - 1) {
            vb[0] = 0u;
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (vb[1] == gen) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}

template <bool EARLY>
__device__ void chain(const Stage* __restrict__ stages, int n_stages, unsigned* bar) {
    extern __shared__ float xs[];  // the stage's x (up to 12,288 floats: 48 KiB)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gw = blockIdx.x * PROBE_WARPS + warp, nw = gridDim.x * PROBE_WARPS;
    uint4 pre[PROBE_NB];
    bool have_pre = false;
    for (int s = 0; s < n_stages; ++s) {
        const Stage st = stages[s];
        // x from L2 (__ldcg: the stage before wrote it from other SMs, whose writes L1 does not see)
        for (int i = threadIdx.x; i < st.n_in / 4; i += PROBE_THREADS) ((float4*)xs)[i] = __ldcg((const float4*)st.x + i);
        __syncthreads();
        const int pieces = st.n_in / 8;
        for (int r = gw; r < st.n_out; r += nw) {
            const uint4* wr = st.w + (long long)r * pieces;
            float acc = 0.0f;
            for (int p0 = 0; p0 < pieces; p0 += 32 * PROBE_NB) {
                uint4 q[PROBE_NB];
                if (EARLY && have_pre && p0 == 0 && r == gw) {
#pragma unroll
                    for (int k = 0; k < PROBE_NB; ++k) q[k] = pre[k];
                } else {
#pragma unroll
                    for (int k = 0; k < PROBE_NB; ++k) {
                        const int p = p0 + k * 32 + lane;
                        q[k] = p < pieces ? __ldcs(wr + p) : make_uint4(0u, 0u, 0u, 0u);
                    }
                }
#pragma unroll
                for (int k = 0; k < PROBE_NB; ++k) {
                    const int p = p0 + k * 32 + lane;
                    if (p < pieces) acc += dot8(q[k], xs + 8 * p);
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (lane == 0) st.y[r] = acc;
        }
        if (s + 1 == n_stages) break;
        have_pre = false;
        if (EARLY) {  // the next stage's first batch of this warp's first row, before the barrier
            const Stage nx = stages[s + 1];
            if (gw < nx.n_out) {
                const int np = nx.n_in / 8;
                const uint4* wr = nx.w + (long long)gw * np;
#pragma unroll
                for (int k = 0; k < PROBE_NB; ++k) {
                    const int p = k * 32 + lane;
                    pre[k] = p < np ? __ldcs(wr + p) : make_uint4(0u, 0u, 0u, 0u);
                }
                have_pre = true;
            }
        }
        grid_barrier(bar);
    }
}

extern "C" __global__ void __launch_bounds__(PROBE_THREADS, 1)
probe_chain(const Stage* stages, int n_stages, unsigned* bar) { chain<false>(stages, n_stages, bar); }

extern "C" __global__ void __launch_bounds__(PROBE_THREADS, 1)
probe_chain_early(const Stage* stages, int n_stages, unsigned* bar) { chain<true>(stages, n_stages, bar); }
