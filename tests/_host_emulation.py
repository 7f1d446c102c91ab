"""GPU kernel sources run on the host, for tests that need no GPU: a .cu file compiled by g++ with a shim.

One OS thread per GPU thread, std::barrier for __syncthreads, `static` for __shared__ (so blocks run one at a
time), warps of 32 lanes whose shuffles (of floats and ints) meet at a barrier of the warp, and __dp4a. A
kernel's index arithmetic, shared-memory layout and reductions run as on the device; float results may differ
from the GPU's (fma as fmaf, expf the host's), never between two kernels of one build. Callers add extern "C"
launchers that call emu_launch(grid x, grid y, threads, lambda running the kernel).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
from graphir.backends.gpu import kernels

SHIM = r"""
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __constant__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
struct emu_dim3 { unsigned x = 0, y = 0, z = 0; };
inline thread_local emu_dim3 threadIdx;
inline thread_local unsigned emu_shuffles = 0;
inline emu_dim3 blockIdx, blockDim, gridDim;
inline std::barrier<>* emu_barrier = nullptr;
inline std::vector<std::unique_ptr<std::barrier<>>> emu_warps;
inline std::vector<float> emu_posted;  // [2][threads]: consecutive shuffles alternate halves
inline void __syncthreads() { emu_barrier->arrive_and_wait(); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
// Every lane of the warp posts its value and reads its partner's after the warp's barrier. A half of
// emu_posted is written again two shuffles later, after the next barrier: every read of it is done by then.
inline float __shfl_xor_sync(unsigned, float v, int o) {
    float* posted = emu_posted.data() + (emu_shuffles++ % 2) * blockDim.x;
    posted[threadIdx.x] = v;
    emu_warps[threadIdx.x / 32]->arrive_and_wait();
    return posted[threadIdx.x ^ (unsigned)o];
}
inline int __shfl_xor_sync(unsigned mask, int v, int o) {  // the same exchange, of the int's bits
    float f;
    std::memcpy(&f, &v, 4);
    f = __shfl_xor_sync(mask, f, o);
    std::memcpy(&v, &f, 4);
    return v;
}
inline int __dp4a(int a, int b, int c) {  // c + the products of the 4 signed bytes of a and b
    for (int k = 0; k < 32; k += 8) c += (int)(signed char)(a >> k) * (int)(signed char)(b >> k);
    return c;
}
inline int atomicCAS(int* p, int cmp, int val) { int old = *p; if (old == cmp) *p = val; return old; }
inline void emu_launch(unsigned gx, unsigned gy, unsigned threads, const std::function<void()>& kernel) {
    gridDim = {gx, gy, 1};
    blockDim = {threads, 1, 1};
    emu_posted.assign(2 * threads, 0.0f);
    emu_warps.clear();
    for (unsigned w = 0; w < (threads + 31) / 32; ++w) emu_warps.emplace_back(new std::barrier<>(32));
    for (unsigned y = 0; y < gy; ++y)
        for (unsigned x = 0; x < gx; ++x) {  // one block at a time: `static` shared memory is the block's
            blockIdx = {x, y, 0};
            std::barrier<> bar(threads);
            emu_barrier = &bar;
            std::vector<std::thread> pool;
            for (unsigned t = 0; t < threads; ++t)
                pool.emplace_back([&kernel, t] { threadIdx = {t, 0, 0}; emu_shuffles = 0; kernel(); });
            for (auto& th : pool) th.join();
        }
}
"""


def build(d: Path, source: str, launchers: str, flags: tuple[str, ...] = (), prelude: str = "") -> ctypes.CDLL:
    """backends/gpu/<source> with the shim and `launchers` (extern "C" functions), built by g++ in d;
    `prelude` goes between the shim and the source (host definitions a source leaves to its tests). The test
    skips where g++ is missing."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not installed: the host emulation of the kernels needs it")
    (d / "emu.cpp").write_text(f'{SHIM}\n{prelude}\n#include "{kernels.KERNEL_DIR / source}"\n{launchers}')
    cmd = [gxx, "-std=c++20", "-O1", *flags, "-shared", "-fPIC", "-pthread", f"-I{kernels.KERNEL_DIR}",
           str(d / "emu.cpp"), "-o", str(d / "emu.so")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return ctypes.CDLL(str(d / "emu.so"))
