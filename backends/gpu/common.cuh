// Portability layer: every kernel source includes this and compiles unchanged under NVRTC
// (CUDA), hiprtc and hipcc (HIP). Measured facts behind each rule (ROCm 5.2, CUDA 13):
//  - HIP has no __shfl_*_sync; __shfl_xor / __shfl_down take no mask there.
//  - the warp (wavefront) is 64 lanes on gfx9 (gfx90a) and 32 on gfx10+ (gfx1030).
//  - bf16 exists on HIP only as a class whose header breaks under hiprtc, and hip_fp16.h must
//    not be included under hiprtc: 16-bit floats are kept as raw `unsigned short` bits here
//    and converted with integer operations, so no vendor fp16/bf16 header is needed at all.
#ifndef GRAPHIR_COMMON_CUH
#define GRAPHIR_COMMON_CUH

// Parts: a large source (kernels.py PARTS) is compiled as several translation units side by side, one per
// -DGRAPHIR_PART=k, each holding the sections marked `#if IN_PART(k)`; every kernel is in exactly one part
// (tests/test_gpu_kernels_compile.py). Without the define (CI's whole-file compiles, hipcc) every section is in.
#ifndef GRAPHIR_PART
#define GRAPHIR_PART -1
#endif
#define IN_PART(k) (GRAPHIR_PART < 0 || GRAPHIR_PART == (k))
#if GRAPHIR_PART >= 0 && !defined(__HIPCC__)
// A part leaves out kernels whose helpers the file still defines: NVRTC's "declared but never referenced"
#pragma nv_diag_suppress 177
#endif

#if defined(__HIPCC__) && !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif

#ifndef WARP_SIZE
#if defined(__HIP_PLATFORM_AMD__) || defined(__AMDGCN_WAVEFRONT_SIZE)
#define WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#define WARP_SIZE 32
#endif
#endif

#ifndef MAX_THREADS
#define MAX_THREADS 1024  // block-wide reductions size their scratch for this many threads
#endif

typedef unsigned short u16;
typedef unsigned char u8;
// Four floats / four 16-bit values as one 16-byte / 8-byte access (hiprtc has no float4 without its headers).
struct alignas(16) f32x4 {
    float x, y, z, w;
};
struct alignas(8) u16x4 {
    u16 x, y, z, w;
};
struct alignas(16) u32x4 {
    unsigned int x, y, z, w;
};

#if defined(__HIPCC__)
#define SHFL_XOR(v, lane) __shfl_xor((v), (lane))
#else
#define SHFL_XOR(v, lane) __shfl_xor_sync(0xffffffffu, (v), (lane))
#endif

#define DEVICE static __device__ __forceinline__
#define NEG_INF __int_as_float(0xff800000)  // -inf without math.h (absent under NVRTC)

// ---------------------------------------------------------------- 16-bit floats as bits
DEVICE float bf16_to_f32(u16 h) { return __uint_as_float(((unsigned int)h) << 16); }

DEVICE u16 f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

DEVICE float f16_to_f32(u16 h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int exp = (h >> 10) & 0x1fu;
    unsigned int man = h & 0x3ffu;
    if (exp == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (man << 13));  // inf, nan
    if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in f32
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

DEVICE u16 f32_to_f16(float f) {  // round to nearest even, overflow to inf (IEEE, as numpy)
    unsigned int u = __float_as_uint(f);
    unsigned int sign = (u >> 16) & 0x8000u;
    unsigned int a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (u16)(sign | 0x7e00u);  // nan
    if (a >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // rounds to >= 65520: inf
    if (a < 0x38800000u) {  // below 2^-14: subnormal or zero, round(|f| * 2^24) ties to even
        float m = __uint_as_float(a) * 16777216.0f;
        return (u16)(sign | (unsigned int)rintf(m));
    }
    unsigned int r = a + 0xfffu + ((a >> 13) & 1u);  // round mantissa to 10 bits, ties to even
    return (u16)(sign | ((r - 0x38000000u) >> 13));
}

// ---------------------------------------------------------------- reductions
DEVICE float warp_sum(float v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v += SHFL_XOR(v, o);
    return v;
}

DEVICE float warp_max(float v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v = fmaxf(v, SHFL_XOR(v, o));
    return v;
}

// Sum over the whole block; every thread gets the result. `scratch` holds MAX_THREADS/WARP_SIZE floats.
DEVICE float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int n_warps = (blockDim.x + WARP_SIZE - 1) / WARP_SIZE;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

DEVICE float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int n_warps = (blockDim.x + WARP_SIZE - 1) / WARP_SIZE;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : NEG_INF;
    return warp_max(v);
}

// ---------------------------------------------------------------- programmatic dependent launch
// Inside a captured decode graph each kernel is launched with programmatic stream serialization
// (sm_90+, CUDA; backends/gpu/pdl.py): it may start while the kernel before it still runs. Every
// kernel therefore begins with PDL_ENTRY(): PDL_WAIT() then PDL_TRIGGER(). PDL_WAIT returns
// once the kernel before has finished and its writes are visible; nothing may be read from or
// written to activations, State or the error flag before it. PDL_TRIGGER lets the next kernel be
// scheduled once every block of this one has passed its wait. Both are no-ops without the launch
// attribute, on older GPUs and on HIP. tests/test_gpu_pdl.py checks every kernel has them.
// Why the wait comes first: triggering at entry (as until 2026-12-02) let each small kernel after a
// GEMV schedule the next one while it waited itself, so a chain of waiting kernels (norm, norm-rope,
// attention, combine, the next GEMV) held SM slots while the GEMV ahead of them still had blocks to
// run. With the trigger after the wait at most one kernel waits ahead of the running one, and its
// launch still overlaps that kernel. Captured decode step, H200, profile_gpu_decode.py --defines,
// same call each: Qwen3-8B bf16 4,474 -> 4,408 us, q4_0 2,769 -> 2,629; Qwen3-0.6B bf16 867 -> 822,
// q4_0 861 -> 746 (BENCHMARKS.md, eighteenth session). PDL_TRIGGER_BEFORE_WAIT compiles the old order.
// A GEMV prefetching its weight rows into L2 between trigger and wait was measured (H200,
// 2026-12-01, benchmarks/profile_gpu_decode.py --defines) and made Qwen3-8B decode slower
// (4930 -> 5566 us per captured step with bulk requests, 5614 with per-line ones), so none does.
// Nor does the decode add+norm kernel before the q|k|v and gate|up GEMVs, with 32 extra blocks
// asking L2 for the first MiB of the next GEMV's weight (tried 2026-12-02, one H200, captured step):
// Qwen3-0.6B 903-913 us without, 956-962 with 8 MiB, 1,014 with 16; Qwen3-8B 4,534-4,549 without,
// 4,652 with 16 MiB, 4,746 with 32. Issuing the requests lengthened the norm (1.66 -> 2.38 us at
// 8 MiB) and the GEMVs after it did not get faster.
// Nor does one load its first weight batch into registers before the wait (tried 2026-12-01): the
// loop that allowed it made the 145 GEMVs of a Qwen3-8B step 27.39 us a call against 26.08-26.32
// with the plain loop (H200s of one kind, three machines), more than the 15-28 us a step that the
// early loads themselves saved within that loop (A/B with the same code, one machine).
// Nor does the m == 1 GEMV prefetching its first weight batch into L1 before the wait, nor one that
// lets the next kernel be scheduled only after storing its rows (2026-12-02, one H200, Qwen3-8B captured
// step, profile_gpu_decode.py --defines at 29798cf): 4,488 us shipped, 4,541 with the late trigger, 4,880
// with the L1 prefetch, 4,929 with both.
// Retried after the order changed (2026-12-03, one H200, captured step, profile_gpu_decode.py --defines at
// 25371dd): the m == 1 GEMV asking L2 for its first batch before the wait, Qwen3-8B bf16 4,363 -> 4,760 us
// (every block asks, later waves too, so most requests repeat the loads right after), Qwen3-0.6B 821 -> 815;
// the staged 4-bit GEMV loading its first chunk into registers before the wait, Qwen3-8B q4_0 2,629 -> 2,674,
// Qwen3-0.6B q4_0 746 -> 738. Neither kept.
// Nor does the delta-rule step read its State early (no earlier kernel of a graph writes a State its
// step reads): 3.64 us a call that way against 3.65 (Qwen3.5-9B, replayed alone), no gain to keep.
#if !defined(__HIPCC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#ifndef GRAPHIR_TEST_SKIP_PDL_WAIT  // tests/test_gpu_pdl.py plants the bug of a kernel that does not wait
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define PDL_WAIT() ((void)0)
#endif
#else
#define PDL_TRIGGER() ((void)0)
#define PDL_WAIT() ((void)0)
#endif
#ifndef PDL_TRIGGER_BEFORE_WAIT
#define PDL_ENTRY() \
    do {            \
        PDL_WAIT();    \
        PDL_TRIGGER(); \
    } while (0)
#else  // the order before 2026-12-02, for measurements only (profile_gpu_decode.py --defines)
#define PDL_ENTRY() \
    do {            \
        PDL_TRIGGER(); \
        PDL_WAIT();    \
    } while (0)
#endif
// GEMV1_TOKEN_BLOCK(): the decode GEMVs (m == 1 kernels: gemv1v2, gemv1sw, gemv1v3, gemv_tc) serve a verify
// call of m tokens on a grid of m times their blocks: block b runs row block bx = b / m for token b % m, so
// each token's rows are computed exactly as a decode step computes them (the same code, lanes and order:
// greedy speculative decoding then equals plain decoding bit for bit), and the m blocks of a row block run
// side by side, reading its weight rows from DRAM about once and from L2 m times. Needs the kernel's X, Y,
// n_in, n_out and m in scope; declares bx.
#define GEMV1_TOKEN_BLOCK()                                    \
    const int bx = (int)blockIdx.x / m;                        \
    X += (long long)((int)blockIdx.x - bx * m) * n_in;         \
    Y += (long long)((int)blockIdx.x - bx * m) * n_out
// PDL_ENTRY_EARLY(early, READ): PDL_ENTRY for a kernel whose first loads are of graph Inputs (kv_len,
// positions: the host copies them into their buffers before the graph is launched, and no kernel writes
// them). Where `early` is set (the lowering sets it only when every pointer READ loads from is an Input
// node) READ runs before the wait, so those loads overlap the kernel before instead of starting
// the chain after it; otherwise after the wait, as in PDL_ENTRY. READ may touch nothing but Inputs.
// Letting the decode attention's idle splits (past kv_len, known from READ) return before the wait was
// measured slower (H200, 2026-12-02, profile_gpu_decode.py, captured step): Qwen3-0.6B 876.4 us against
// 859.5 with them waiting, Qwen3-8B 4,484.1 against 4,486.1.
#ifndef PDL_TRIGGER_BEFORE_WAIT
#define PDL_ENTRY_EARLY(early, READ) \
    do {                             \
        if (early) {                 \
            READ;                    \
        }                            \
        PDL_WAIT();                  \
        PDL_TRIGGER();               \
        if (!(early)) {              \
            READ;                    \
        }                            \
    } while (0)
#else
#define PDL_ENTRY_EARLY(early, READ) \
    do {                             \
        PDL_TRIGGER();               \
        if (early) {                 \
            READ;                    \
        }                            \
        PDL_WAIT();                  \
        if (!(early)) {              \
            READ;                    \
        }                            \
    } while (0)
#endif

// ---------------------------------------------------------------- asynchronous copies to shared memory
// cp.async (sm_80+, CUDA only): 16 bytes global -> shared without passing through registers; other threads'
// copies are visible after cp_async_wait_all and a __syncthreads.
#if !defined(__HIPCC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
DEVICE unsigned int smem_addr(const void* p) { return (unsigned int)__cvta_generic_to_shared(p); }
DEVICE void cp_async16(void* dst, const void* src, bool valid) {  // !valid: 16 zero bytes, nothing read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
#endif

// ---------------------------------------------------------------- run-time error flag
// Kernels that index with run-time values (token ids, KV rows, kv_len) never touch memory out of
// range. They record the first violation instead: flag[0] = code (the step's number + 1, set by
// the host per launch), flag[1] = the offending value. The host reads the flag once per call.
DEVICE void report_error(int* flag, int code, int value) {
    if (atomicCAS(flag, 0, code) == 0) flag[1] = value;
}

#endif  // GRAPHIR_COMMON_CUH
