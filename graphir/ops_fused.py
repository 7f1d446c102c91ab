"""Fused ops: one table entry each, registered into graphir.ops.OPS, produced only by passes.

Each reference is written as the composition of the unfused ops' references, so a fused op
means exactly what the pattern it replaces means; tests compare the two on random data.
"""

from __future__ import annotations

import numpy as np

from graphir.ops import OPS, REQUIRED, Type, _binary_infer, _norm_ref, _rope_infer, _set_rows_infer, need, numel, op

_rms_norm = _norm_ref("rms")
_rope_params = {"n_dims": (int, REQUIRED), "mode": (str, "norm"), "theta": (float, 10000.0),
                "freq_scale": (float, 1.0)}


def _add_rms_norm_mul_infer(ts: list[Type], p: dict) -> list[Type]:
    a, b, w = ts
    s = _binary_infer([a, b], p)  # the residual sum a + b
    _binary_infer([s, w], p)  # the norm weight broadcasts onto it
    return [s, s]


def _add_rms_norm_mul_ref(a: np.ndarray, b: np.ndarray, w: np.ndarray, eps: float):
    s = OPS["add"].ref(a, b)
    return OPS["mul"].ref(_rms_norm(s, eps), w), s


op("add_rms_norm_mul", 3,
   "s = a + b; returns (rms_norm(s, eps) * w, s): the normalized input of the next block and the residual",
   {"eps": (float, REQUIRED)}, multi=True)((_add_rms_norm_mul_infer, _add_rms_norm_mul_ref))


def _rms_norm_mul_rope_infer(ts: list[Type], p: dict) -> Type:
    x, w, pos = ts
    _binary_infer([x, w], p)
    return _rope_infer([x, pos], p)


def _rms_norm_mul_rope_ref(x, w, pos, eps: float, **rope) -> np.ndarray:
    return OPS["rope"].ref(OPS["mul"].ref(_rms_norm(x, eps), w), pos, **rope)


op("rms_norm_mul_rope", 3, "rope(rms_norm(x, eps) * w, positions): per-head q/k norm then rotary (Qwen3)",
   {"eps": (float, REQUIRED), **_rope_params})((_rms_norm_mul_rope_infer, _rms_norm_mul_rope_ref))


def _rope_set_rows_infer(ts: list[Type], p: dict) -> Type:
    cache, x, pos, idx = ts
    roped = _rope_infer([x, pos], p)
    need(numel(roped[0][1:]) == numel(cache[0][1:]),
         f"a roped row {list(roped[0][1:])} does not fill a cache row {list(cache[0][1:])}")
    return _set_rows_infer([cache, ((x[0][0],) + cache[0][1:], x[1]), idx], p)


def _rope_set_rows_ref(cache, x, pos, idx, **rope) -> np.ndarray:
    y = OPS["rope"].ref(x, pos, **rope).reshape((x.shape[0],) + cache.shape[1:])
    return OPS["set_rows"].ref(cache, y, idx)


op("rope_set_rows", 4, "cache[idx[i]] = rope(x, positions)[i], in place (roped K straight into the KV cache)",
   _rope_params, writes=True)((_rope_set_rows_infer, _rope_set_rows_ref))
