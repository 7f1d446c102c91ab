"""Writing f32 rows into an f16 KV cache (the kv-f16 pass) on the CPU; reading them: attention.py.

numba has no float16, so the cache is written as uint16 bits, rounded to nearest even exactly as the
reference's numpy cast (`src.astype(float16)`) rounds. numpy's fancy-index assignment did the same
but cost ~10 us a call (SmolLM2 decode at 1k keys, 2 threads: K and V writes 0.85 ms a token against
0.24 for f32 rows), more than this kernel's whole row.
"""

from __future__ import annotations

import numpy as np
from numba import njit

EXACT = dict(cache=True, nogil=True)  # rounding by bits and one exact add: no fast-math

_HALF = np.float32(0.5)  # adding it puts a tiny f32's f16 subnormal bits in the low mantissa, rounded by the FPU


@njit(**EXACT)
def f32_to_f16(x):
    """The f16 bits (as uint32) nearest the f32 x, ties to even; overflow to inf; a nan stays a nan."""
    b = np.uint32(np.float32(x).view(np.uint32))
    sign = np.uint32((b >> np.uint32(16)) & np.uint32(0x8000))
    a = np.uint32(b & np.uint32(0x7FFFFFFF))
    if a >= np.uint32(0x7F800000):  # inf, or nan with its payload's top 10 bits (numpy's choice)
        h = np.uint32(0x7C00) | ((a & np.uint32(0x7FFFFF)) >> np.uint32(13))
        if a > np.uint32(0x7F800000) and h == np.uint32(0x7C00):
            h += np.uint32(1)  # a payload only in the dropped bits: still a nan
    elif a >= np.uint32(0x477FF000):  # 65520 and up round to inf
        h = np.uint32(0x7C00)
    elif a >= np.uint32(0x38800000):  # normal halves: rebias the exponent (127 -> 15), round 13 bits away
        h = np.uint32((a - np.uint32(0x38000000)) >> np.uint32(13))
        rest = a & np.uint32(0x1FFF)
        if rest > np.uint32(0x1000) or (rest == np.uint32(0x1000) and (h & np.uint32(1))):
            h += np.uint32(1)  # a carry into the exponent is still the right half
    else:  # subnormal halves and zero
        h = np.uint32(np.float32(np.uint32(a).view(np.float32) + _HALF).view(np.uint32) - np.uint32(0x3F000000))
    return np.uint32(h | sign)


@njit(**EXACT)
def set_rows_f16(dst, src, idx):
    """dst[idx[r]] = f16(src[r]): dst [capacity, row] uint16 (an f16 cache's bits), src [n, row] f32."""
    for r in range(src.shape[0]):
        row = idx[r]
        if row < 0 or row >= dst.shape[0]:
            raise IndexError("set_rows: row index out of range")
        for i in range(src.shape[1]):
            dst[row, i] = np.uint16(f32_to_f16(src[r, i]))
