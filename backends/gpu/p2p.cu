// One-shot all-reduce of small f32 tensors over peer memory (CUDA IPC; p2p.py sets it up).
//
// Every rank owns one allocation, mapped into every peer's process, laid out as:
//   flags [P2P_MAX_BLOCKS][P2P_MAX_RANKS] u64   flags[b][r]: the last epoch rank r announced for lane b
//   epoch [P2P_MAX_BLOCKS] u64                  this rank's calls so far on lane b (only this rank writes)
//   broken u64                                  0, or 1 + the rank a timed-out wait waited for (sticky)
//   data  [2][P2P_MAX_BLOCKS][P2P_CHUNK] f32    this rank's input, lane b's slice, by epoch parity
// Block b of a launch is "lane b": it carries elements [b * P2P_CHUNK, (b + 1) * P2P_CHUNK) of the
// tensor, handshakes with lane b of every peer only, and always uses the same data slice. Every rank
// runs the same all-reduces in the same order on one stream, so lane b's epoch counts the same calls
// on every rank, whichever graph (and site) they come from.
//
// Why two buffers suffice: rank A writes lane b's buffer of parity p at epoch e only after its call
// e-1 on lane b has ended (stream order; PDL_WAIT included), and that call waited for every peer's
// flag >= e-1. A peer B sets that flag at the start of its call e-1, which begins after its call e-2
// has ended, and call e-2 is the last one that read A's parity-p buffer. So no reader is left on a
// buffer when it is written again; and B can never be two epochs ahead of A either (its call e+1
// needs A's flag e+1), so a flag read as >= e always belongs to this call or the next one, whose
// data goes to the other buffer.
//
// Bitwise agreement: every rank sums the ranks' values in rank order 0..n-1 with the same f32 adds.
//
// PDL (captured graphs): the kernel starts with PDL_ENTRY like every other, so nothing a peer can see
// (the slot, the flags) is written before the kernel ahead has finished writing x. Its trigger lets
// the next kernel's blocks become resident and wait; by then every block of this one is resident
// and past its own wait (that is when the trigger fires), so spinning blocks never wait for a GPU slot. No block waits
// for another block of its own launch, only for its lane on the peers, which each peer runs once
// its earlier kernels end: no cycle, whatever the block scheduling.
#include "common.cuh"

#ifndef P2P_MAX_RANKS
#define P2P_MAX_RANKS 8
#endif
#ifndef P2P_MAX_BLOCKS
#define P2P_MAX_BLOCKS 64
#endif
#ifndef P2P_CHUNK
#define P2P_CHUNK 1024  // f32 per lane: 4 KiB, so a 16 KiB decode all-reduce handshakes on 4 lanes at once
#endif
// byte offsets inside a rank's allocation (p2p.py allocates P2P_DATA_OFF + the data buffers)
#define P2P_FLAGS_OFF 0
#define P2P_EPOCH_OFF (P2P_MAX_BLOCKS * P2P_MAX_RANKS * 8)
#define P2P_BROKEN_OFF (P2P_EPOCH_OFF + P2P_MAX_BLOCKS * 8)
#define P2P_DATA_OFF 8192
static_assert(P2P_BROKEN_OFF + 8 <= P2P_DATA_OFF, "p2p.cu: flags and epochs overlap the data buffers");

typedef unsigned long long u64;

// Flags are read and written at system scope: the writer is another GPU. The release store orders
// this block's slot writes (made visible to the storing thread by the __syncthreads before it)
// ahead of the flag for every observer; the acquire load orders the peer's slot reads after it.
#if defined(__CUDACC__) && !defined(__HIPCC__)
DEVICE u64 load_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
DEVICE void store_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
DEVICE u64 clock_ticks() {  // nanoseconds (p2p.py converts the timeout to ticks)
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#else
DEVICE u64 load_acquire_sys(const u64* p) {
    return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
DEVICE void store_release_sys(u64* p, u64 v) {
    __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
DEVICE u64 clock_ticks() { return (u64)wall_clock64(); }  // constant-rate counter (p2p.py: its rate)
#endif

DEVICE u64* flags_of(u64 base) { return (u64*)(base + P2P_FLAGS_OFF); }

DEVICE float* slot_of(u64 base, u64 epoch, int lane) {
    return (float*)(base + P2P_DATA_OFF) + ((epoch & 1) * P2P_MAX_BLOCKS + lane) * P2P_CHUNK;
}

// y = sum over ranks of x, in rank order; x may be y. bases[r]: rank r's allocation as mapped in this
// process (bases[rank] is this rank's own). grid: ceil(count / P2P_CHUNK) blocks, count <= the whole
// data buffer. A wait longer than `timeout` ticks reports code with the missing rank and marks this
// rank's group broken, so every later call reports at once instead of mixing epochs.
extern "C" __global__ void all_reduce_p2p_f32(const float* x, float* y, int count, const u64* bases, int rank,
                                              int ranks, long long timeout, int* flag, int code) {
    PDL_ENTRY();
    __shared__ u64 epoch_sh;
    __shared__ int abort_sh;
    const int lane = blockIdx.x, t = threadIdx.x;
    const u64 mine = bases[rank];
    u64* broken = (u64*)(mine + P2P_BROKEN_OFF);
    if (t == 0) {
        u64* epoch = (u64*)(mine + P2P_EPOCH_OFF) + lane;
        abort_sh = 0;
        if (*broken) {
            report_error(flag, code, (int)(*broken - 1));
            abort_sh = 1;
        } else {
            epoch_sh = *epoch + 1;
            *epoch = epoch_sh;  // read by this lane's next call only, after this kernel has ended
        }
    }
    __syncthreads();
    if (abort_sh) return;
    const u64 e = epoch_sh;
    const int lo = lane * P2P_CHUNK;
    const int n = min(P2P_CHUNK, count - lo);

    float* own = slot_of(mine, e, lane);
    for (int i = t; i < n; i += blockDim.x) own[i] = x[lo + i];
    __syncthreads();  // every thread's slot writes happen before the flags below announce them

    // thread r < ranks speaks to rank r: announces this epoch in its memory, then waits for its flag
    if (t < ranks && t != rank) {
        store_release_sys(flags_of(bases[t]) + lane * P2P_MAX_RANKS + rank, e);
        const u64* theirs = flags_of(mine) + lane * P2P_MAX_RANKS + t;
        const u64 start = clock_ticks();
        while (load_acquire_sys(theirs) < e) {  // >=: the peer may already have announced e + 1
            if ((long long)(clock_ticks() - start) > timeout) {
                report_error(flag, code, t);
                atomicCAS(broken, 0ull, (u64)t + 1);
                abort_sh = 1;
                break;
            }
        }
    }
    __syncthreads();  // the acquires above happen before any thread's peer reads below
    if (abort_sh) return;

#ifdef GRAPHIR_TEST_P2P_STALE_PARITY  // tests/test_gpu_p2p.py plants the bug of reading last call's buffer
    const u64 read_epoch = e + 1;
#else
    const u64 read_epoch = e;
#endif
    for (int i = t; i < n; i += blockDim.x) {
        float acc = 0.0f;
        for (int r = 0; r < ranks; ++r) {
            const float v = r == rank ? x[lo + i] : slot_of(bases[r], read_epoch, lane)[i];
            acc = r == 0 ? v : acc + v;  // start from rank 0's value, not 0.0f: -0.0 + -0.0 stays -0.0
        }
        y[lo + i] = acc;
    }
}
