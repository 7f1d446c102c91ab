// A probe for issue 10's decode targets (bench_gpu_megakernel_probe.py): a whole Qwen3-style bf16 decode step
// (every layer's norms, q|k|v, q/k norm and rope, the KV write, attention, o, gate|up with swiglu, down; then
// the final norm and the LM head) in one persistent kernel, one block an SM.
//
// Why a new probe: the decode step is bound by its ~258 kernel boundaries, not its bytes (BENCHMARKS.md,
// "the per-kernel floor"), and the twelfth session's persistent probe only ran GEMVs back to back, where
// DRAM is never idle. Here weights do not depend on activations, so each block streams its whole step's weight
// tiles (every layer, then the head) through a ring of shared-memory slots with TMA bulk copies, MK_SLOTS
// tiles ahead of its use, across stage boundaries; the warps wait only for the activations they need. While
// a few blocks run attention or every block waits for a stage's inputs, DRAM keeps filling the rings.
//
// No grid barriers: every activation a block hands to other blocks (q|k|v, attention partials, the residual
// stream, swiglu's output) is written as 8-byte words that hold the value and a generation (NCCL's "LL"
// protocol), and a reader polls the words themselves until each carries the generation of the stage that
// writes it: no fence and no arrival count, meant to hand a stage's output on in about one L2 round trip
// (measured: 2.4-4.1 us from the last writer to every reader, below). A generation
// is the launch's epoch (a device counter the last block out advances) times 1024 plus the stage. Every
// block must be resident (the polls wait on other blocks): cooperative launch.
// CUDA only, sm_90 (cp.async.bulk, mbarrier tx counts). Not part of the backend; compiled with NVRTC.
//
// Measured (H200, 2026-12-03; BENCHMARKS.md, twenty-third session): 855-884 us a Qwen3-0.6B step at position
// 128 against the backend's 814 us captured graph of 258 kernels. Per layer (27 us): the stages' own work
// 1.2-2.7 us each, attention ~6 us on its blocks, and each hand-off (the last writer's words to every
// reader) 2.4-4.1 us, so five hand-offs a layer cost what nine PDL kernel boundaries do. Switches kept for
// measurements: MK_NO_WAIT (no waiting: 683 us, wrong results), MK_POLL_SLEEP=N (ns between polls: no
// change), MK_LL_VOLATILE (system-scope accesses: 978 vs 942 us), MK_COUNTER (a per-stage count, then one
// read: 930 vs 855 us), MK_SLOTS=4 (1,107 vs 1,132 us before the tile table).
typedef unsigned short u16;
typedef unsigned long long u64;

#define MK_CONSUMERS 8                          // warps a block (8: 255 registers a thread are allowed)
#define MK_THREADS (MK_CONSUMERS * 32)
#ifndef MK_SLOTS
#define MK_SLOTS 6
#endif
#define MK_SLOT_BYTES 32768
// The GEMV widths are compile-time (Qwen3-0.6B's): the products unroll over them.
#define MK_HIDDEN 1024
#define MK_ATT 2048                             // query heads x 128
#define MK_INTER 3072
#define MK_MAX_IN MK_INTER                      // largest GEMV input
#define MK_MAX_HIDDEN MK_HIDDEN
#define MK_MAX_SPLITS 4                         // attention key splits a head (MK_SPLIT_KEYS keys each, then more)
#define MK_SPLIT_KEYS 64                        // = MK_KEY_BATCH x MK_CONSUMERS: one batch a warp
#define MK_PART 132                             // a partial: max, sum, 128 values, padded to 16 bytes
#define MK_KEY_BATCH 8                          // keys a warp loads before using any
#define MK_HEAD_DIM 128
#define MK_CONSUMER_BAR 1                       // named barrier of the block's warps (all of them consume tiles)
#define MK_NEG_INF __int_as_float(0xff800000)   // NVRTC has no math.h INFINITY

struct Layer {
    const u16* wqkv;  // [(n_q + 2 n_kv) * 128, hidden]
    const u16* wo;    // [hidden, n_q * 128]
    const u16* wgu;   // [2 * inter, hidden]: row 2j gate j, row 2j + 1 up j
    const u16* wd;    // [hidden, inter]
    const float* attn_norm;  // [hidden]
    const float* ffn_norm;   // [hidden]
    const float* q_norm;     // [128]
    const float* k_norm;     // [128]
    u16* kc;          // [n_kv, ctx, 128] bf16
    u16* vc;          // [n_kv, ctx, 128] bf16
};

struct Model {
    const Layer* layers;
    const u16* head;        // [vocab, hidden]
    const float* out_norm;  // [hidden]
    const float* h0;        // the step's input hidden state (the token's embedding row)
    u64* h;                 // [hidden] LL words: the residual stream
    u64* qkv;               // [(n_q + 2 n_kv) * 128] LL words
    u64* part;              // [n_q][MK_MAX_SPLITS][MK_PART] LL words: attention partials (max, sum, 128 values)
    u64* f;                 // [inter] LL words: swiglu's output
    float* logits;          // [vocab]
    const int* pos;         // the step's position: a runtime value, read on the device
    unsigned* epoch;        // [2 + 5 n_layers]: the launch's epoch, blocks done (the last block out advances the
                            // epoch), then MK_COUNTER's per-stage counts
    u64* stamps;            // [blocks][10 n_layers + 2] globaltimer when each stage's inputs had arrived and when
                            // its work was done (q|k|v, attention, o, gate|up, down; then the head), or null
    int n_layers, hidden, n_q, n_kv, inter, vocab, ctx;
    float eps, rope_theta;
};

// ---- mbarrier and bulk-copy PTX (sm_90) ----
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u64* b, unsigned count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(u64* b, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* b, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done) : "r"(smem_addr(b)), "r"(parity) : "memory");
    }
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, u64* b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(b)) : "memory");
}
#ifdef MK_LL_VOLATILE  // measurement switch: system-scope volatile accesses instead of gpu-scope relaxed ones
#define MK_LL_ST "st.volatile.global.u64"
#define MK_LL_LD "ld.volatile.global.v2.u64"
#else
#define MK_LL_ST "st.relaxed.gpu.global.u64"
#define MK_LL_LD "ld.relaxed.gpu.global.v2.u64"
#endif
__device__ __forceinline__ void ll_store(u64* p, float v, unsigned gen) {
    asm volatile(MK_LL_ST " [%0], %1;" ::"l"(p), "l"(((u64)gen << 32) | __float_as_uint(v)) : "memory");
}
__device__ __forceinline__ void ll_load2(const u64* p, u64& a, u64& b) {  // two words, one 16-byte load
    asm volatile(MK_LL_LD " {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}
// MK_NO_WAIT (measurement only, wrong results): take the words as they are, to time the step without its waits.
__device__ __forceinline__ bool ll_ready(u64 a, u64 b, unsigned gen) {
#ifdef MK_NO_WAIT
    return true;
#else
    return (unsigned)(a >> 32) == gen && (unsigned)(b >> 32) == gen;
#endif
}
__device__ __forceinline__ void poll_pause() {  // between polls of words not yet written
#if defined(MK_POLL_SLEEP) && MK_POLL_SLEEP > 0
    __nanosleep(MK_POLL_SLEEP);
#endif
}
// MK_COUNTER (measurement switch): a stage's readers first wait, one thread a block, for a per-stage count of
// the blocks done writing it (epoch[2 + stage], monotonic over launches), then read the words once, instead of
// every thread polling the words themselves (which puts every block's polls on the same few L2 lines).
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float ll_value(u64 w) { return __uint_as_float((unsigned)w); }
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync %0, %1;" ::"n"(MK_CONSUMER_BAR), "n"(MK_CONSUMERS * 32) : "memory"); }
__device__ __forceinline__ u64 globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ float bf_lo(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(unsigned v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ float bf16_round(float x) {  // round to nearest even, as the cache stores it
    unsigned u = __float_as_uint(x);
    u += 0x7fffu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xffff0000u);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// A lane's share of a row of P * 256 bf16 (in shared memory) against x: 16-byte pieces lane, lane + 32, ...;
// every load issued before the first product. x is the lane's 8 P values of the GEMV input, in registers:
// read from shared memory once a stage, not once a row (x in f32 is twice the weight row's bytes, and every
// warp would read all of it for every row).
__device__ __forceinline__ float dot8r(uint4 q, const float* x) {
    float s = bf_lo(q.x) * x[0];
    s = fmaf(bf_hi(q.x), x[1], s);
    s = fmaf(bf_lo(q.y), x[2], s);
    s = fmaf(bf_hi(q.y), x[3], s);
    s = fmaf(bf_lo(q.z), x[4], s);
    s = fmaf(bf_hi(q.z), x[5], s);
    s = fmaf(bf_lo(q.w), x[6], s);
    return fmaf(bf_hi(q.w), x[7], s);
}

template <int P>
__device__ __forceinline__ float row_part(const uint4* row, const float* x, int lane) {
    uint4 q[P];
#pragma unroll
    for (int i = 0; i < P; ++i) q[i] = row[lane + 32 * i];
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < P; ++i) acc += dot8r(q[i], x + 8 * i);
    return acc;
}


__device__ __forceinline__ void stage_signal(const Model& m, int k) {
#ifdef MK_COUNTER
    consumers_sync();  // every warp's words written before the count
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(m.epoch + 2 + k, 1u);
    }
#endif
}
__device__ __forceinline__ void stage_wait(const Model& m, int k, unsigned target) {
#ifdef MK_COUNTER
    if (threadIdx.x == 0)
        while (load_acquire(m.epoch + 2 + k) < target) poll_pause();
    consumers_sync();
#endif
}

// ---- the tile schedule ----
// A GEMV's items (rows, or gate|up row pairs) are split evenly over the blocks; a block's share goes through
// the ring in tiles of at most MK_CONSUMERS items, one item a consumer warp.
struct Span { int lo, hi; };
__device__ __forceinline__ Span share(int n, int b, int nb) {
    return {(int)((long long)n * b / nb), (int)((long long)n * (b + 1) / nb)};
}
#define MK_ITEMS_A_WARP 2  // a warp takes items w and w + MK_CONSUMERS of a tile, their loads interleaved
__device__ __forceinline__ int items_a_tile(int item_bytes) {
    return min(MK_ITEMS_A_WARP * MK_CONSUMERS, MK_SLOT_BYTES / item_bytes);
}

// The block's tiles, in the order it uses them: each layer's q|k|v, o, gate|up and down shares, then the head's.
// Stateless: tile k's source and size from k alone, so whichever warp frees a slot can refill it. The block's
// shares (the same in every layer) are worked out once, at the start: a refill sits on the critical path, and
// share()'s 64-bit divisions cost a single thread about a microsecond.
struct TileTab {
    int lo[5], hi[5], per[5], item_bytes[5], count[5];  // stages 0-3 of a layer, 4 the head
    int a_layer;                                        // tiles a layer
};

__device__ void tile_tab_init(const Model& m, TileTab& t) {
    const int n[5] = {(m.n_q + 2 * m.n_kv) * MK_HEAD_DIM, m.hidden, m.inter, m.hidden, m.vocab};
    const int ib[5] = {2 * m.hidden, 2 * m.n_q * MK_HEAD_DIM, 4 * m.hidden, 2 * m.inter, 2 * m.hidden};
    t.a_layer = 0;
    for (int st = 0; st < 5; ++st) {
        const Span s = share(n[st], blockIdx.x, gridDim.x);
        t.lo[st] = s.lo;
        t.hi[st] = s.hi;
        t.item_bytes[st] = ib[st];
        t.per[st] = items_a_tile(ib[st]);
        t.count[st] = (s.hi - s.lo + t.per[st] - 1) / t.per[st];
        if (st < 4) t.a_layer += t.count[st];
    }
}

__device__ bool tile_at(const Model& m, const TileTab& t, unsigned k, const char*& src, unsigned& bytes) {
    int st = 0, j;
    const u16* w;
    if (k < (unsigned)(t.a_layer * m.n_layers)) {
        const int layer = k / t.a_layer;
        j = k - layer * t.a_layer;
        while (j >= t.count[st]) j -= t.count[st++];
        const Layer& L = m.layers[layer];
        w = st == 0 ? L.wqkv : st == 1 ? L.wo : st == 2 ? L.wgu : L.wd;
    } else {
        st = 4;
        j = k - t.a_layer * m.n_layers;
        if (j >= t.count[4]) return false;
        w = m.head;
    }
    const int i = t.lo[st] + j * t.per[st];
    src = (const char*)w + (size_t)i * t.item_bytes[st];
    bytes = (unsigned)(min(t.per[st], t.hi[st] - i) * t.item_bytes[st]);
    return true;
}

// A ring of MK_SLOTS weight tiles in shared memory: tile k lives in slot k % MK_SLOTS; the last warp done with a
// tile loads tile k + MK_SLOTS into its slot (TMA), so the ring runs MK_SLOTS tiles ahead of the slowest warp.
struct Ring {
    const Model* m;
    const TileTab* tab;
    char* slots;
    u64* full;        // [MK_SLOTS] mbarriers: a slot's bytes have landed
    unsigned* done;   // [MK_SLOTS] warps done with the slot's tile
    unsigned fill;    // tiles used so far (every consumer thread counts alike)
};

__device__ void load_tile(Ring& r, unsigned k) {
    const char* src;
    unsigned bytes;
    if (!tile_at(*r.m, *r.tab, k, src, bytes)) return;
    const unsigned slot = k % MK_SLOTS;
    mbar_expect_tx(&r.full[slot], bytes);
    bulk_load(r.slots + (size_t)slot * MK_SLOT_BYTES, src, bytes, &r.full[slot]);
}

// A warp is done with tile r.fill (call from every lane): the last warp refills its slot.
__device__ void tile_done(Ring& r) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
        const unsigned slot = r.fill % MK_SLOTS;
        __threadfence_block();  // this warp's reads of the slot before its count
        if (atomicAdd(&r.done[slot], 1u) == MK_CONSUMERS - 1) {
            r.done[slot] = 0u;
            __threadfence_block();
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the reads before the TMA's write
            load_tile(r, r.fill + MK_SLOTS);
        }
    }
}

enum Mode { LOGITS, PLAIN, RESIDUAL, SWIGLU };

// The consumer side of one GEMV: x (n_in floats) in shared memory. LOGITS: logits[item] = dot (floats);
// PLAIN: out[item] = dot; RESIDUAL: out[item] = res[item] + dot (res in shared memory); SWIGLU:
// out[item] = silu(gate) * up. All but LOGITS write LL words of generation gen.
template <Mode MODE, int P>  // P: 16-byte pieces a lane of a row (n_in = 256 P)
__device__ void consume(Ring& r, int n_items, const float* x, u64* out, float* plain, const float* res, unsigned gen) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_in = 256 * P;
    const int item_bytes = 2 * n_in * (MODE == SWIGLU ? 2 : 1);
    const Span s = share(n_items, blockIdx.x, gridDim.x);
    const int per = items_a_tile(item_bytes);
    float xr[8 * P];  // the lane's x values, read from shared memory once a stage
    {
#pragma unroll
        for (int i = 0; i < P; ++i) {
            *(float4*)(xr + 8 * i) = *(const float4*)(x + 8 * (lane + 32 * i));
            *(float4*)(xr + 8 * i + 4) = *(const float4*)(x + 8 * (lane + 32 * i) + 4);
        }
    }
    for (int i = s.lo; i < s.hi; i += per, ++r.fill) {
        const unsigned slot = r.fill % MK_SLOTS, round = r.fill / MK_SLOTS;
        const int n = min(per, s.hi - i);
        mbar_wait(&r.full[slot], round & 1);
        if (P > 4 && warp < n) {  // wide rows: one item a warp (a tile holds at most MK_CONSUMERS of them)
            const uint4* r0 = (const uint4*)(r.slots + (size_t)slot * MK_SLOT_BYTES + (size_t)warp * item_bytes);
            float a0 = row_part<P>(r0, xr, lane), u0 = 0.0f;
            if (MODE == SWIGLU) u0 = row_part<P>(r0 + 32 * P, xr, lane);
            a0 = warp_sum(a0);
            if (MODE == SWIGLU) u0 = warp_sum(u0);
            if (lane == 0) {
                const int item = i + warp;
                if (MODE == SWIGLU) ll_store(out + item, a0 / (1.0f + __expf(-a0)) * u0, gen);
                else if (MODE == RESIDUAL) ll_store(out + item, res[item] + a0, gen);
                else if (MODE == PLAIN) ll_store(out + item, a0, gen);
                else plain[item] = a0;
            }
        } else if (P <= 4 && warp < n) {
            const char* tile = r.slots + (size_t)slot * MK_SLOT_BYTES;
            // items warp and warp + MK_CONSUMERS; a missing second item reads the first again (branch-free)
            const int j1 = warp + MK_CONSUMERS < n ? warp + MK_CONSUMERS : warp;
            const uint4* r0 = (const uint4*)(tile + (size_t)warp * item_bytes);
            const uint4* r1 = (const uint4*)(tile + (size_t)j1 * item_bytes);
            float a0 = row_part<P>(r0, xr, lane), a1 = row_part<P>(r1, xr, lane), u0 = 0.0f, u1 = 0.0f;
            if (MODE == SWIGLU) {
                u0 = row_part<P>(r0 + 32 * P, xr, lane);
                u1 = row_part<P>(r1 + 32 * P, xr, lane);
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                a0 += __shfl_xor_sync(0xffffffffu, a0, o);
                a1 += __shfl_xor_sync(0xffffffffu, a1, o);
                if (MODE == SWIGLU) {
                    u0 += __shfl_xor_sync(0xffffffffu, u0, o);
                    u1 += __shfl_xor_sync(0xffffffffu, u1, o);
                }
            }
            if (lane < 2 && (lane == 0 || j1 != warp)) {
                const int item = i + (lane == 0 ? warp : j1);
                const float a = lane == 0 ? a0 : a1, u = lane == 0 ? u0 : u1;
                if (MODE == SWIGLU) ll_store(out + item, a / (1.0f + __expf(-a)) * u, gen);
                else if (MODE == RESIDUAL) ll_store(out + item, res[item] + a, gen);
                else if (MODE == PLAIN) ll_store(out + item, a, gen);
                else plain[item] = a;
            }
        }
        tile_done(r);
    }
}

#define MK_GATHER_PAIRS (MK_MAX_IN / (2 * MK_CONSUMERS * 32))  // 16-byte loads a consumer thread keeps in flight

// x[0..n) = the values of LL words src[0..n) once each carries `gen` (n even). All loads are issued before
// any is checked, and only the words not yet written are loaded again.
__device__ void ll_gather(const u64* src, int n, unsigned gen, float* x) {
    u64 a[MK_GATHER_PAIRS], b[MK_GATHER_PAIRS];
    bool pending = true;
#pragma unroll
    for (int j = 0; j < MK_GATHER_PAIRS; ++j) {
        const int i = 2 * (threadIdx.x + j * MK_CONSUMERS * 32);
        if (i < n) ll_load2(src + i, a[j], b[j]);
    }
    while (pending) {
        pending = false;
#pragma unroll
        for (int j = 0; j < MK_GATHER_PAIRS; ++j) {
            const int i = 2 * (threadIdx.x + j * MK_CONSUMERS * 32);
            if (i < n && !ll_ready(a[j], b[j], gen)) {
                ll_load2(src + i, a[j], b[j]);
                pending = true;
            }
        }
        if (pending) poll_pause();
    }
    consumers_sync();  // every warp is done with x (and the stage's other shared inputs) before it changes
#pragma unroll
    for (int j = 0; j < MK_GATHER_PAIRS; ++j) {
        const int i = 2 * (threadIdx.x + j * MK_CONSUMERS * 32);
        if (i < n) {
            x[i] = ll_value(a[j]);
            x[i + 1] = ll_value(b[j]);
        }
    }
    consumers_sync();
}

// Sum over the consumer threads (256), the same order in every thread.
__device__ float consumers_sum(float v, float* red) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    consumers_sync();
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < MK_CONSUMERS; ++w) t += red[w];
    consumers_sync();
    return t;
}

// hraw = the residual stream (LL words of `gen`, or the step's input h0), x = rmsnorm(hraw) * w.
__device__ void load_normed(const Model& m, int first, unsigned gen, const float* w, float* hraw, float* x, float* red) {
    if (first) {  // the kernel's start: nothing reads hraw yet
        for (int i = threadIdx.x; i < m.hidden; i += MK_CONSUMERS * 32) hraw[i] = m.h0[i];
        consumers_sync();
    } else {
        ll_gather(m.h, m.hidden, gen, hraw);
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < m.hidden; i += MK_CONSUMERS * 32) ss += hraw[i] * hraw[i];
    const float inv = rsqrtf(consumers_sum(ss, red) / m.hidden + m.eps);
    for (int i = threadIdx.x; i < m.hidden; i += MK_CONSUMERS * 32) x[i] = hraw[i] * inv * w[i];
    consumers_sync();
}

// One warp: v (128 values, 4 a lane at lane + 32 j) = rope(rmsnorm(v) * w) at position pos, NeoX halves.
__device__ void norm_rope(float v[4], const float* w, int pos, float eps, float theta, int lane) {
    const float inv = rsqrtf(warp_sum(v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3]) / MK_HEAD_DIM + eps);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = v[j] * inv * w[lane + 32 * j];
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // pairs (i, i + 64) with i = lane + 32 j
        const int i = lane + 32 * j;
        const float ang = (float)pos * powf(theta, -2.0f * i / MK_HEAD_DIM);
        float sn, cs;
        sincosf(ang, &sn, &cs);
        const float a = v[j], b = v[j + 2];
        v[j] = a * cs - b * sn;
        v[j + 2] = b * cs + a * sn;
    }
}

__device__ __forceinline__ int attention_splits(int pos) {
    return min(MK_MAX_SPLITS, (pos + MK_SPLIT_KEYS) / MK_SPLIT_KEYS);  // ceil((pos + 1) / MK_SPLIT_KEYS)
}

// One warp's 128 values of an LL vector (4 a lane at lane + 32 j... as pairs: lane's words 2 lane, 2 lane + 1
// and 64 + 2 lane, 65 + 2 lane), polled until they carry gen; returned in norm_rope's order (lane + 32 j).
__device__ void ll_head(const u64* src, unsigned gen, float v[4], float* tmp) {
    const int lane = threadIdx.x & 31;
    u64 a0, b0, a1, b1;
    ll_load2(src + 2 * lane, a0, b0);
    ll_load2(src + 64 + 2 * lane, a1, b1);
    while (!ll_ready(a0, b0, gen) || !ll_ready(a1, b1, gen)) {
        poll_pause();
        ll_load2(src + 2 * lane, a0, b0);
        ll_load2(src + 64 + 2 * lane, a1, b1);
    }
    tmp[2 * lane] = ll_value(a0);
    tmp[2 * lane + 1] = ll_value(b0);
    tmp[64 + 2 * lane] = ll_value(a1);
    tmp[65 + 2 * lane] = ll_value(b1);
    __syncwarp();
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = tmp[lane + 32 * j];
    __syncwarp();
}

// A warp's batch of keys base, base + MK_CONSUMERS, ... (< t1) from the cache, as f32 (the lane's 4 dims);
// zeros past t1 and at pos (this step's row, not in the cache when the batch is loaded).
__device__ __forceinline__ void load_keys(const u16* kbase, const u16* vbase, int base, int t1, int pos,
                                          float4 (&k)[MK_KEY_BATCH], float4 (&v)[MK_KEY_BATCH]) {
#pragma unroll
    for (int i = 0; i < MK_KEY_BATCH; ++i) {
        const int t = base + i * MK_CONSUMERS;
        if (t < t1 && t < pos) {
            const uint2 kr = *(const uint2*)(kbase + (size_t)t * MK_HEAD_DIM);
            const uint2 vr = *(const uint2*)(vbase + (size_t)t * MK_HEAD_DIM);
            k[i] = make_float4(bf_lo(kr.x), bf_hi(kr.x), bf_lo(kr.y), bf_hi(kr.y));
            v[i] = make_float4(bf_lo(vr.x), bf_hi(vr.x), bf_lo(vr.y), bf_hi(vr.y));
        } else {
            k[i] = v[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
}

// Attention partial for query head hq over its split's keys (key pos: this step's k and v, rounded as the
// cache holds them): the split's max score, sum of exponentials and weighted values, as LL words. The first
// batch of cached keys is loaded before waiting for this step's q|k|v: it does not depend on them.
__device__ void attention(const Model& m, const Layer& L, int hq, int sp, int n_sp, int pos, unsigned gen_in,
                          unsigned gen, float* sm, int stage_in, unsigned target) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, D = MK_HEAD_DIM;
    const int grp = m.n_q / m.n_kv, kvh = hq / grp;
    const int n_keys = pos + 1, t0 = (int)((long long)n_keys * sp / n_sp), t1 = (int)((long long)n_keys * (sp + 1) / n_sp);
    const bool last = sp == n_sp - 1;  // the split holding key pos
    float* qs = sm;                    // [128] the query, normed and roped
    float* kn = sm + D;                // [128] this step's key
    float* vn = sm + 2 * D;            // [128] this step's value
    float* part = sm + 3 * D;          // [MK_CONSUMERS][2 + 128]: each warp's max, sum and weighted values
    float* tmp = part + MK_CONSUMERS * (2 + D);  // [3][128] staging for ll_head
    const u16* kbase = L.kc + (size_t)kvh * m.ctx * D + 4 * lane;
    const u16* vbase = L.vc + (size_t)kvh * m.ctx * D + 4 * lane;
    float4 k[MK_KEY_BATCH], v[MK_KEY_BATCH];
    load_keys(kbase, vbase, t0 + warp, t1, pos, k, v);
    stage_wait(m, stage_in, target);
    if (warp == 0 || (last && warp < 3)) {
        const int off = warp == 0 ? hq * D : warp == 1 ? (m.n_q + kvh) * D : (m.n_q + m.n_kv + kvh) * D;
        float x[4];
        ll_head(m.qkv + off, gen_in, x, tmp + warp * D);
        if (warp < 2) norm_rope(x, warp == 0 ? L.q_norm : L.k_norm, pos, m.eps, m.rope_theta, lane);
        float* dst = warp == 0 ? qs : warp == 1 ? kn : vn;
#pragma unroll
        for (int j = 0; j < 4; ++j) dst[lane + 32 * j] = warp == 0 ? x[j] : bf16_round(x[j]);
        if (warp > 0 && hq % grp == 0) {  // the group's first head writes the cache row
            u16* c = (warp == 1 ? L.kc : L.vc) + ((size_t)kvh * m.ctx + pos) * D;
#pragma unroll
            for (int j = 0; j < 4; ++j) c[lane + 32 * j] = (u16)(__float_as_uint(bf16_round(x[j])) >> 16);
        }
    }
    consumers_sync();
    const float scale = rsqrtf((float)D);
    const float4 q = *(const float4*)(qs + 4 * lane);  // lane holds dims 4 lane .. 4 lane + 3
    float mx = MK_NEG_INF, sum = 0.0f, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int base = t0 + warp; base < t1; base += MK_KEY_BATCH * MK_CONSUMERS) {
        if (base != t0 + warp) load_keys(kbase, vbase, base, t1, pos, k, v);
        float s[MK_KEY_BATCH];
#pragma unroll
        for (int i = 0; i < MK_KEY_BATCH; ++i) {
            if (base + i * MK_CONSUMERS == pos) {
                k[i] = *(const float4*)(kn + 4 * lane);
                v[i] = *(const float4*)(vn + 4 * lane);
            }
            s[i] = q.x * k[i].x + q.y * k[i].y + q.z * k[i].z + q.w * k[i].w;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int i = 0; i < MK_KEY_BATCH; ++i) s[i] += __shfl_xor_sync(0xffffffffu, s[i], o);
        }
        float nm = mx;
#pragma unroll
        for (int i = 0; i < MK_KEY_BATCH; ++i)
            if (base + i * MK_CONSUMERS < t1) nm = fmaxf(nm, s[i] * scale);
        const float c = __expf(mx - nm);
        sum *= c;
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[j] *= c;
#pragma unroll
        for (int i = 0; i < MK_KEY_BATCH; ++i) {
            if (base + i * MK_CONSUMERS >= t1) continue;
            const float p = __expf(s[i] * scale - nm);
            sum += p;
            acc[0] += p * v[i].x;
            acc[1] += p * v[i].y;
            acc[2] += p * v[i].z;
            acc[3] += p * v[i].w;
        }
        mx = nm;
    }
    float* mine = part + warp * (2 + D);
    if (lane == 0) {
        mine[0] = mx;
        mine[1] = sum;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) mine[2 + 4 * lane + j] = acc[j];
    consumers_sync();
    if (threadIdx.x < D) {
        float gm = MK_NEG_INF;
        for (int w = 0; w < MK_CONSUMERS; ++w) gm = fmaxf(gm, part[w * (2 + D)]);
        float l = 0.0f, o = 0.0f;
        for (int w = 0; w < MK_CONSUMERS; ++w) {
            const float* p = part + w * (2 + D);
            if (p[0] == MK_NEG_INF) continue;  // a warp with no key
            const float c = __expf(p[0] - gm);
            l += p[1] * c;
            o += p[2 + threadIdx.x] * c;
        }
        u64* dst = m.part + (size_t)(hq * MK_MAX_SPLITS + sp) * MK_PART;
        ll_store(dst + 2 + threadIdx.x, o, gen);
        if (threadIdx.x == 0) {
            ll_store(dst, gm, gen);
            ll_store(dst + 1, l, gen);
        }
    }
    consumers_sync();  // scratch is reused by the next layer's attention
}

// x[h * 128 + d] = the attention output: each head's split partials (LL words of gen) merged. 16 threads a
// head, 8 values a thread (n_q * 16 == 256); every split's words are loaded at once.
__device__ void load_attention(const Model& m, int n_sp, unsigned gen, float* x) {
    const int hq = threadIdx.x >> 4, d0 = (threadIdx.x & 15) * 8;
    u64 w[MK_MAX_SPLITS][10];
    bool ok[MK_MAX_SPLITS];
#pragma unroll
    for (int sp = 0; sp < MK_MAX_SPLITS; ++sp) ok[sp] = sp >= n_sp;
    for (bool first = true;; first = false) {
        if (!first) poll_pause();
#pragma unroll
        for (int sp = 0; sp < MK_MAX_SPLITS; ++sp) {
            if (ok[sp]) continue;
            const u64* src = m.part + (size_t)(hq * MK_MAX_SPLITS + sp) * MK_PART;
            ll_load2(src, w[sp][0], w[sp][1]);
#pragma unroll
            for (int j = 0; j < 4; ++j) ll_load2(src + 2 + d0 + 2 * j, w[sp][2 + 2 * j], w[sp][3 + 2 * j]);
        }
        bool all = true;
#pragma unroll
        for (int sp = 0; sp < MK_MAX_SPLITS; ++sp) {
            if (ok[sp]) continue;
            bool r = true;
#pragma unroll
            for (int j = 0; j < 5; ++j) r = r && ll_ready(w[sp][2 * j], w[sp][2 * j + 1], gen);
            ok[sp] = r;
            all = all && r;
        }
        if (all) break;
    }
    float gm = MK_NEG_INF, l = 0.0f, o[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = 0.0f;
#pragma unroll
    for (int sp = 0; sp < MK_MAX_SPLITS; ++sp) {
        if (sp >= n_sp) break;
        const float sm = ll_value(w[sp][0]), nm = fmaxf(gm, sm), c = __expf(gm - nm), cs = __expf(sm - nm);
        l = l * c + ll_value(w[sp][1]) * cs;
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = o[j] * c + ll_value(w[sp][2 + j]) * cs;
        gm = nm;
    }
    consumers_sync();  // every warp is done with x before it changes
#pragma unroll
    for (int j = 0; j < 8; ++j) x[hq * MK_HEAD_DIM + d0 + j] = o[j] / l;
    consumers_sync();
}

__device__ __forceinline__ void stamp(const Model& m, int k) {
    if (m.stamps && threadIdx.x == 0) m.stamps[(size_t)blockIdx.x * (10 * m.n_layers + 2) + k] = globaltimer();
}

__device__ void consumers(const Model& m, Ring& r, char* smem_tail) {
    float* x = (float*)smem_tail;             // [MK_MAX_IN] the GEMV input
    float* hraw = x + MK_MAX_IN;              // [MK_MAX_HIDDEN] the residual stream
    float* red = hraw + MK_MAX_HIDDEN;        // [MK_CONSUMERS]
    float* scratch = red + MK_CONSUMERS;      // attention's
    const int pos = *m.pos, n_sp = attention_splits(pos);
    const unsigned epoch = *(volatile unsigned*)m.epoch, base = epoch * 1024u;  // stage k's generation: base + k
    const unsigned target = (epoch + 1) * gridDim.x;  // MK_COUNTER: every block has counted this launch's stage
    const int qkv_rows = (m.n_q + 2 * m.n_kv) * MK_HEAD_DIM;
    for (int l = 0; l < m.n_layers; ++l) {
        const Layer& L = m.layers[l];
        const unsigned g = base + 5 * l;  // g + 1: q|k|v, + 2: attention, + 3: o, + 4: gate|up, + 5: down
        const int st = 10 * l;
        const int sg = 5 * l;             // MK_COUNTER's stage counters: sg + 0 .. sg + 4 in the same order
        if (l) stage_wait(m, sg - 1, target);
        load_normed(m, l == 0, g, L.attn_norm, hraw, x, red);
        stamp(m, st);
        consume<PLAIN, MK_HIDDEN / 256>(r, qkv_rows, x, m.qkv, nullptr, nullptr, g + 1);
        stage_signal(m, sg);
        stamp(m, st + 1);
        stamp(m, st + 2);
        if ((int)blockIdx.x < m.n_q * n_sp)
            attention(m, L, blockIdx.x / n_sp, blockIdx.x % n_sp, n_sp, pos, g + 1, g + 2, scratch, sg, target);
        stage_signal(m, sg + 1);
        stamp(m, st + 3);
        stage_wait(m, sg + 1, target);
        load_attention(m, n_sp, g + 2, x);
        stamp(m, st + 4);
        consume<RESIDUAL, MK_ATT / 256>(r, m.hidden, x, m.h, nullptr, hraw, g + 3);
        stage_signal(m, sg + 2);
        stamp(m, st + 5);
        stage_wait(m, sg + 2, target);
        load_normed(m, 0, g + 3, L.ffn_norm, hraw, x, red);
        stamp(m, st + 6);
        consume<SWIGLU, MK_HIDDEN / 256>(r, m.inter, x, m.f, nullptr, nullptr, g + 4);
        stage_signal(m, sg + 3);
        stamp(m, st + 7);
        stage_wait(m, sg + 3, target);
        ll_gather(m.f, m.inter, g + 4, x);
        stamp(m, st + 8);
        consume<RESIDUAL, MK_INTER / 256>(r, m.hidden, x, m.h, nullptr, hraw, g + 5);
        stage_signal(m, sg + 4);
        stamp(m, st + 9);
    }
    stage_wait(m, 5 * m.n_layers - 1, target);
    load_normed(m, 0, base + 5 * m.n_layers, m.out_norm, hraw, x, red);
    stamp(m, 10 * m.n_layers);
    consume<LOGITS, MK_HIDDEN / 256>(r, m.vocab, x, nullptr, m.logits, nullptr, 0u);
    stamp(m, 10 * m.n_layers + 1);
}

extern "C" __global__ void __launch_bounds__(MK_THREADS, 1) decode_step(Model m) {
    extern __shared__ __align__(128) char smem[];
    u64* full = (u64*)smem;
    TileTab* tab = (TileTab*)(smem + 512);
    Ring r{&m, tab, smem + 1024, full, (unsigned*)(full + MK_SLOTS), 0u};
    if (threadIdx.x == 0) {
        tile_tab_init(m, *tab);
        for (int i = 0; i < MK_SLOTS; ++i) {
            mbar_init(&r.full[i], 1);
            r.done[i] = 0u;
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (unsigned k = 0; k < MK_SLOTS; ++k) load_tile(r, k);
    }
    __syncthreads();
    consumers(m, r, smem + 1024 + (size_t)MK_SLOTS * MK_SLOT_BYTES);
    __syncthreads();
    // The last block out advances the epoch: every block has read it (at its start) by then.
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(m.epoch + 1, 1u) == gridDim.x - 1) {
            m.epoch[1] = 0u;
            m.epoch[0] += 1u;
            __threadfence();
        }
    }
}
