"""The op table: every op's arity, parameter schema, shape/dtype rule and numpy reference.

The reference functions *define* what each op means; every backend and pass is tested
against them. They receive dequantized float32 arrays for Params (the reference backend
dequantizes), and return new arrays, except ops marked `writes`, which update src[0]
(a State, or another write to one) in place and return it.

Adding an op: one `@op(...)` entry here (or in fused.py for fused ops, collective.py for
collectives) plus tests; tests/test_ops_table.py fails if an op has no numpy-formula test.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphir.dtypes import DTYPES, FLOAT
from graphir.errors import GraphError

Type = tuple[tuple[int, ...], str]  # (shape, dtype)
REQUIRED = object()


@dataclass(frozen=True)
class OpDef:
    name: str
    arity: tuple[int, int]  # (min, max) number of sources
    params: dict[str, tuple[type | tuple[type, ...], Any]]  # key -> (python type, default or REQUIRED)
    infer: Callable[[list[Type], dict[str, Any]], Type | list[Type]]
    ref: Callable[..., Any]
    doc: str
    writes: bool = False  # updates src[0] in place (State only)
    view: bool = False  # result aliases src[0]'s storage
    multi: bool = False  # returns a tuple; read items with `item`
    choices: dict[str, tuple[Any, ...]] = field(default_factory=dict)


OPS: dict[str, OpDef] = {}


def op(name: str, arity: int | tuple[int, int], doc: str, params: dict | None = None, **flags: Any):
    """Register `infer` (decorated) with reference `ref` under `name`."""

    def deco(pair: tuple[Callable, Callable]) -> tuple[Callable, Callable]:
        infer, ref = pair
        ar = (arity, arity) if isinstance(arity, int) else arity
        OPS[name] = OpDef(name, ar, dict(params or {}), infer, ref, doc, **flags)
        return pair

    return deco


def fail(rule: str) -> None:
    raise GraphError(rule)


def need(cond: bool, rule: str) -> None:
    if not cond:
        raise GraphError(rule)


def need_float(t: Type, what: str) -> None:
    need(t[1] in FLOAT, f"{what} must be a float tensor (f32/f16/bf16), got {t[1]}")


def need_axis(t: Type, what: str) -> None:
    """An op over the last axis needs one: a 0-d x failed in the shape rule (top_k's IndexError) or as a
    reference/rule mismatch."""
    need(len(t[0]) >= 1, f"{what} needs at least one axis (the op works over the last), got a 0-d tensor")


def need_i32(t: Type, what: str) -> None:
    need(t[1] == "i32", f"{what} must be i32, got {t[1]}")


def need_dims(value: Any, what: str, nonneg: bool = True) -> None:
    """A shape-like param (a view's shape or strides, a reshape's shape, a permutation) holds ints: reshape
    (-7, -16) of [7, 16] built a node of shape [-7, -16], a view of shape (2.5, 2) silently became [2, 2], and
    a string or float axis was a TypeError from inside the rule."""
    bad = [v for v in value if not isinstance(v, int) or isinstance(v, bool) or nonneg and v < 0]
    need(not bad, f"{what} {list(value)} must hold {'non-negative ' if nonneg else ''}ints, got {bad[0]!r}"
         if bad else "")


def numel(shape: tuple[int, ...]) -> int:
    return int(math.prod(shape))


def broadcastable(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    """b may be broadcast onto a (ggml's repeat rule, numpy alignment): each axis equal or 1."""
    if len(small) > len(big):
        return False
    return all(s in (1, b) for s, b in zip(small[::-1], big[::-1]))


# ---------------------------------------------------------------- leaves
def _leaf_infer(ts: list[Type], p: dict) -> Type:
    fail("leaf nodes are built with input/param/state/const, not through the op table")


op("input", 0, "runtime tensor fed at every call (token ids, positions, KV write indices, lengths)")(
    (_leaf_infer, None))
op("param", 0, "named weight; data lives in the weight store")((_leaf_infer, None))
op("state", 0, "persistent tensor updated in place across calls (KV cache, conv and recurrent state)")(
    (_leaf_infer, None))
op("const", 0, "small literal tensor; values in params", {"value": (tuple, REQUIRED)})((_leaf_infer, None))


# ---------------------------------------------------------------- elementwise
def _binary_infer(ts: list[Type], p: dict) -> Type:
    (sa, da), (sb, db) = ts
    need_float(ts[0], "a")
    need_float(ts[1], "b")
    need(broadcastable(sb, sa),
         f"b {list(sb)} does not broadcast onto a {list(sa)} (each axis of b must equal a's or be 1)")
    return sa, da


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable:
    return lambda a, b: fn(a, b).astype(a.dtype, copy=False)


op("add", 2, "a + b, b broadcast onto a")((_binary_infer, _binary(np.add)))
op("sub", 2, "a - b, b broadcast onto a")((_binary_infer, _binary(np.subtract)))
op("mul", 2, "a * b, b broadcast onto a")((_binary_infer, _binary(np.multiply)))
op("div", 2, "a / b, b broadcast onto a")((_binary_infer, _binary(np.divide)))


def _unary_infer(ts: list[Type], p: dict) -> Type:
    need_float(ts[0], "x")
    return ts[0]


def _silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # e^-x = inf for very negative x gives the right limit, 0
        return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    # log(1 + e^x) without overflow for large x
    return np.logaddexp(0.0, x).astype(x.dtype)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    # math.sqrt gives a Python float: an np.float64 factor would promote f32 inputs to f64
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


op("neg", 1, "-x")((_unary_infer, lambda x: -x))
op("exp", 1, "e^x")((_unary_infer, np.exp))
op("silu", 1, "x * sigmoid(x)")((_unary_infer, _silu))
op("gelu", 1, "gelu, tanh approximation")((_unary_infer, _gelu_tanh))
op("sigmoid", 1, "1 / (1 + e^-x)")((_unary_infer, _sigmoid))
op("softplus", 1, "log(1 + e^x)")((_unary_infer, _softplus))
op("scale", 1, "x * s + b", {"s": (float, REQUIRED), "b": (float, 0.0)})(
    (_unary_infer, lambda x, s, b: (x * np.float32(s) + np.float32(b)).astype(x.dtype)))
op("swiglu_split", 2, "silu(a) * b")(
    (lambda ts, p: (_binary_infer(ts, p), need(ts[0][0] == ts[1][0], "a and b must have the same shape"))[0],
     lambda a, b: _silu(a) * b))


# ---------------------------------------------------------------- norms (over the last axis)
def _norm_ref(kind: str) -> Callable:
    def ref(x: np.ndarray, eps: float) -> np.ndarray:
        x32 = x.astype(np.float32)
        if kind == "rms":
            y = x32 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        elif kind == "l2":
            y = x32 / np.sqrt(np.sum(x32 * x32, axis=-1, keepdims=True) + eps)
        else:
            c = x32 - x32.mean(axis=-1, keepdims=True)
            y = c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps)
        return y.astype(x.dtype)

    return ref


def _last_axis_infer(ts: list[Type], p: dict) -> Type:
    need_axis(ts[0], "x")
    return _unary_infer(ts, p)


op("rms_norm", 1, "x / sqrt(mean(x^2) + eps) over the last axis", {"eps": (float, REQUIRED)})(
    (_last_axis_infer, _norm_ref("rms")))
op("l2_norm", 1, "x / sqrt(sum(x^2) + eps) over the last axis", {"eps": (float, REQUIRED)})(
    (_last_axis_infer, _norm_ref("l2")))
op("norm", 1, "(x - mean) / sqrt(var + eps) over the last axis", {"eps": (float, REQUIRED)})(
    (_last_axis_infer, _norm_ref("norm")))


# ---------------------------------------------------------------- reductions
op("sum_rows", 1, "sum over the last axis, kept as size 1")(
    (lambda ts, p: (need_float(ts[0], "x"), need_axis(ts[0], "x"), (ts[0][0][:-1] + (1,), ts[0][1]))[2],
     lambda x: x.sum(axis=-1, keepdims=True, dtype=np.float32).astype(x.dtype)))
op("mean", 1, "mean over the last axis, kept as size 1")(
    (lambda ts, p: (need_float(ts[0], "x"), need_axis(ts[0], "x"), (ts[0][0][:-1] + (1,), ts[0][1]))[2],
     lambda x: x.mean(axis=-1, keepdims=True, dtype=np.float32).astype(x.dtype)))
def need_values(t: Type, what: str) -> None:
    """An op that picks an index along the last axis needs one to pick: over 0 values argmax and sample failed at
    run time (numpy's 'attempt to get argmax of an empty sequence', 'cannot reshape array of size 0')."""
    need_axis(t, what)
    need(t[0][-1] >= 1, f"{what} {list(t[0])} has no values along its last axis to pick an index from")


op("argmax", 1, "index of the largest value along the last axis (first on ties)")(
    (lambda ts, p: (need_float(ts[0], "x"), need_values(ts[0], "x"), (ts[0][0][:-1], "i32"))[2],
     lambda x: np.argmax(x, axis=-1).astype(np.int32)))


def _top_k_infer(ts: list[Type], p: dict) -> Type:
    need_float(ts[0], "x")
    need_axis(ts[0], "x")
    need(1 <= p["k"] <= ts[0][0][-1], f"k={p['k']} must be in 1..{ts[0][0][-1]} (the last axis)")
    return ts[0][0][:-1] + (p["k"],), "i32"


def _top_k_ref(x: np.ndarray, k: int) -> np.ndarray:
    # stable sort on -x: larger values first, lower index first among equals
    return np.argsort(-x, axis=-1, kind="stable")[..., :k].astype(np.int32)


op("top_k", 1, "indices of the k largest values along the last axis, largest first", {"k": (int, REQUIRED)})(
    (_top_k_infer, _top_k_ref))


# Sampling settings travel as one f32 Input row per sampled row, so a captured decode graph samples
# with whatever settings and random number the caller writes before each replay.
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "u")


def _sample_infer(ts: list[Type], p: dict) -> Type:
    (sx, dx), (ss, ds) = ts
    need_float((sx, dx), "logits")
    need_values((sx, dx), "logits")
    need(ds == "f32", f"sampling settings must be f32, got {ds}")
    need(ss == sx[:-1] + (len(SAMPLING_FIELDS),),
         f"sampling settings {list(ss)} must be {list(sx[:-1]) + [len(SAMPLING_FIELDS)]}: one row "
         f"({', '.join(SAMPLING_FIELDS)}) per logits row")
    return sx[:-1], "i32"


def sample_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """One draw from `logits` [vocab]. The kept set follows llama.cpp's default chain: top-k (0: off),
    then softmax at `temperature`, then top-p (the smallest most-likely-first set whose mass reaches
    p; ties in logit value are ordered by lower id first). temperature <= 0 or top_k 1 is greedy:
    the first index of the largest logit. The draw walks the kept tokens in id order and returns the
    first whose cumulative probability exceeds `u` in [0, 1): any fixed order gives the same
    distribution, and id order is the one a GPU block can scan without sorting."""
    x = np.asarray(logits, np.float64).reshape(-1)
    k = int(top_k)
    if temperature <= 0.0 or k == 1:
        return int(np.argmax(x))
    order = np.argsort(-x, kind="stable")
    if 0 < k < x.size:
        order = order[:k]
    w = np.exp((x[order] - x[order[0]]) / temperature)
    if top_p < 1.0:
        before = np.cumsum(w) - w
        keep = before < top_p * w.sum()
        keep[0] = True  # the most likely token, always (llama.cpp's min_keep): NaN logits kept none, an IndexError
        order, w = order[keep], w[keep]
    by_id = np.argsort(order)
    ids, cum = order[by_id], np.cumsum(w[by_id])
    return int(ids[min(int(np.searchsorted(cum, u * cum[-1], side="right")), ids.size - 1)])


def _sample_ref(x: np.ndarray, settings: np.ndarray) -> np.ndarray:
    rows = x.reshape(-1, x.shape[-1])
    sets = settings.reshape(-1, len(SAMPLING_FIELDS))
    out = [sample_row(r, float(s[0]), int(s[1]), float(s[2]), float(s[3])) for r, s in zip(rows, sets, strict=True)]
    return np.asarray(out, np.int32).reshape(x.shape[:-1])


op("sample", 2, "one token id per row of logits, drawn with the row's (temperature, top_k, top_p, u) settings")(
    (_sample_infer, _sample_ref))


# ---------------------------------------------------------------- matrix ops
def _mul_mat_infer(ts: list[Type], p: dict) -> Type:
    (sw, dw), (sx, dx) = ts
    need(len(sw) >= 2 and len(sx) >= 2, f"w {list(sw)} and x {list(sx)} need at least 2 axes")
    need(dw in DTYPES and dw != "i32", f"w has unsupported dtype {dw}")
    need_float(ts[1], "x")
    need(sw[-1] == sx[-1], f"inner sizes differ: w {list(sw)} has n_in {sw[-1]}, x {list(sx)} has {sx[-1]}")
    need(broadcastable(sw[:-2], sx[:-2]), f"w batch axes {list(sw[:-2])} do not broadcast onto x's {list(sx[:-2])}")
    return sx[:-1] + (sw[-2],), "f32"


op("mul_mat", 2, "x @ w^T: w [..., n_out, n_in] (any dtype), x [..., n, n_in] -> [..., n, n_out] f32")(
    (_mul_mat_infer, lambda w, x: np.matmul(x.astype(np.float32, copy=False),
                                            np.swapaxes(w, -1, -2).astype(np.float32, copy=False))))


def _get_rows_infer(ts: list[Type], p: dict) -> Type:
    (st, dt), (si, di) = ts
    need(len(st) == 2, f"table must be 2-D [rows, dim], got {list(st)}")
    need_i32(ts[1], "ids")
    need(len(si) == 1, f"ids must be 1-D, got {list(si)}")
    return (si[0], st[1]), "f32"


def _get_rows_ref(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        bad = int(ids[(ids < 0) | (ids >= table.shape[0])][0])
        raise GraphError(f"get_rows: id {bad} out of range 0..{table.shape[0] - 1}")
    return table[ids].astype(np.float32)


op("get_rows", 2, "table[ids]: gather rows (embedding lookup), any table dtype -> f32")(
    (_get_rows_infer, _get_rows_ref))


# ---------------------------------------------------------------- rope
def _rope_infer(ts: list[Type], p: dict) -> Type:
    (sx, dx), (sp, dp) = ts
    need_float(ts[0], "x")
    need(len(sx) == 3, f"x must be [n_tokens, n_heads, head_dim], got {list(sx)}")
    need_i32(ts[1], "positions")
    need(sp == (sx[0],), f"positions must be [n_tokens]={[sx[0]]}, got {list(sp)}")
    need(0 < p["n_dims"] <= sx[2] and p["n_dims"] % 2 == 0, f"n_dims={p['n_dims']} must be even and in 2..{sx[2]}")
    need(p["mode"] in ("norm", "neox"), f"mode must be 'norm' or 'neox', got {p['mode']!r}")
    return ts[0]


def _rope_ref(x: np.ndarray, pos: np.ndarray, n_dims: int, mode: str, theta: float, freq_scale: float) -> np.ndarray:
    half = n_dims // 2
    inv_freq = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / n_dims)
    ang = (pos.astype(np.float64)[:, None] * freq_scale) * inv_freq[None, :]  # [n, half]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    y = x.astype(np.float64).copy()
    if mode == "neox":  # rotate pairs (i, i + half)
        a, b = x[..., :half], x[..., half:n_dims]
        y[..., :half] = a * cos - b * sin
        y[..., half:n_dims] = a * sin + b * cos
    else:  # norm: rotate adjacent pairs (2i, 2i + 1)
        a, b = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        y[..., 0:n_dims:2] = a * cos - b * sin
        y[..., 1:n_dims:2] = a * sin + b * cos
    return y.astype(x.dtype)


op("rope", 2, "rotary embedding of the first n_dims of each head at positions[i] (norm: adjacent pairs, neox: halves)",
   {"n_dims": (int, REQUIRED), "mode": (str, "norm"), "theta": (float, 10000.0), "freq_scale": (float, 1.0)})(
    (_rope_infer, _rope_ref))


# ---------------------------------------------------------------- attention
def _softmax_infer(ts: list[Type], p: dict) -> Type:
    need_float(ts[0], "x")
    need_axis(ts[0], "x")
    if len(ts) == 2:
        need_float(ts[1], "mask")
        need(broadcastable(ts[1][0], ts[0][0]), f"mask {list(ts[1][0])} does not broadcast onto x {list(ts[0][0])}")
    return ts[0]


def _softmax_ref(x: np.ndarray, mask: np.ndarray | None = None, scale: float = 1.0) -> np.ndarray:
    z = x.astype(np.float32) * np.float32(scale)
    if mask is not None:
        z = z + mask
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)


op("softmax", (1, 2), "softmax(x * scale + mask) over the last axis", {"scale": (float, 1.0)})(
    (_softmax_infer, _softmax_ref))


def _flash_attn_infer(ts: list[Type], p: dict) -> Type:
    (sq, _), (sk, _), (sv, _), (sp, _), (sl, _) = ts
    for t, w in zip(ts[:3], "qkv"):
        need_float(t, w)
        need(len(t[0]) == 3, f"{w} must be [tokens, heads, head_dim], got {list(t[0])}")
    need_i32(ts[3], "positions")
    need_i32(ts[4], "kv_len")
    need(sp == (sq[0],), f"positions must be [n_q]={[sq[0]]}, got {list(sp)}")
    need(sl == (1,), f"kv_len must be [1], got {list(sl)}")
    need(sk[0] == sv[0] and sk[1] == sv[1], f"k {list(sk)} and v {list(sv)} must agree on rows and heads")
    need(sq[2] == sk[2], f"q head_dim {sq[2]} != k head_dim {sk[2]}")
    # sk[1] >= 1 first: 0 kv heads was a ZeroDivisionError from the modulo
    need(sk[1] >= 1 and sq[1] % sk[1] == 0, f"q heads {sq[1]} must be a multiple of kv heads {sk[1]} (GQA)")
    need(p["window"] >= 0, f"window must be >= 0, got {p['window']}")
    return (sq[0], sq[1], sv[2]), "f32"


def _flash_attn_ref(q, k, v, pos, kv_len, scale: float, window: int) -> np.ndarray:
    n_q, hq, _ = q.shape
    n_kv, hk, _ = k.shape
    length = int(kv_len[0])
    if not 0 <= length <= n_kv:
        raise GraphError(f"flash_attn: kv_len {length} outside 0..{n_kv} (the KV capacity)")
    j = np.arange(length)
    allowed = j[None, :] <= pos[:, None]  # causal: a query sees keys at or before its position
    if window:
        allowed &= pos[:, None] - j[None, :] < window
    group = hq // hk
    kk = np.repeat(k[:length].astype(np.float32), group, axis=1)  # [L, hq, d]
    vv = np.repeat(v[:length].astype(np.float32), group, axis=1)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float32), kk) * np.float32(scale)
    s = np.where(allowed[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)  # initial: kv_len may be 0
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    denom = e.sum(axis=-1, keepdims=True)
    prob = np.divide(e, denom, out=np.zeros_like(e), where=denom > 0)  # a query with no visible key gives 0
    return np.einsum("hqk,khd->qhd", prob, vv).astype(np.float32)


op("flash_attn", 5,
   "causal attention(q, k, v, positions, kv_len): query i sees key rows j < kv_len with j <= positions[i] "
   "(and positions[i] - j < window when window > 0); GQA when q has more heads",
   {"scale": (float, REQUIRED), "window": (int, 0)})((_flash_attn_infer, _flash_attn_ref))


# ---------------------------------------------------------------- layout
def _view_infer(ts: list[Type], p: dict) -> Type:
    (sx, dx) = ts[0]
    shape, strides, offset = p["shape"], p["strides"], p["offset"]
    need_dims(shape, "view shape")
    need_dims(strides, "view strides", nonneg=False)  # a negative stride is refused below, by its own rule
    need(len(shape) == len(strides), f"view shape {list(shape)} and strides {list(strides)} differ in length")
    need(all(s >= 0 for s in strides) and offset >= 0, "view strides and offset must be >= 0")
    need(DTYPES[dx].block == 1, f"views of quantized tensors ({dx}) are not supported")
    last = offset + sum((n - 1) * s for n, s in zip(shape, strides)) if numel(shape) else offset
    need(numel(shape) == 0 or last < numel(sx),
         f"view reaches element {last} but the source {list(sx)} has {numel(sx)} elements")
    return tuple(shape), dx


def _view_ref(x: np.ndarray, shape, strides, offset) -> np.ndarray:
    flat = np.ascontiguousarray(x).reshape(-1)
    idx = np.full(tuple(shape), offset, dtype=np.int64)
    for axis, (n, s) in enumerate(zip(shape, strides)):
        idx = idx + (np.arange(n) * s).reshape((n,) + (1,) * (len(shape) - axis - 1))
    return flat[idx]


op("view", 1, "elements offset + sum(i_k * strides_k) of x's row-major element sequence (units: elements)",
   {"shape": (tuple, REQUIRED), "strides": (tuple, REQUIRED), "offset": (int, 0)}, view=True)(
    (_view_infer, _view_ref))


def _reshape_infer(ts: list[Type], p: dict) -> Type:
    need_dims(p["shape"], "reshape shape")
    need(numel(p["shape"]) == numel(ts[0][0]), f"cannot reshape {list(ts[0][0])} to {list(p['shape'])}: sizes differ")
    need(DTYPES[ts[0][1]].block == 1, "reshape of quantized tensors is not supported")
    return tuple(p["shape"]), ts[0][1]


op("reshape", 1, "same elements in row-major order, new shape", {"shape": (tuple, REQUIRED)}, view=True)(
    (_reshape_infer, lambda x, shape: x.reshape(shape)))


def _permute_infer(ts: list[Type], p: dict) -> Type:
    sx = ts[0][0]
    need_dims(p["axes"], "permute axes")
    need(sorted(p["axes"]) == list(range(len(sx))), f"axes {list(p['axes'])} is not a permutation of 0..{len(sx) - 1}")
    return tuple(sx[a] for a in p["axes"]), ts[0][1]


op("permute", 1, "result axis i is source axis axes[i] (numpy transpose)", {"axes": (tuple, REQUIRED)}, view=True)(
    (_permute_infer, lambda x, axes: np.transpose(x, axes)))
op("transpose", 1, "swap the last two axes", view=True)(
    (lambda ts, p: (need(len(ts[0][0]) >= 2, "transpose needs 2+ axes"),
                    (ts[0][0][:-2] + ts[0][0][-1:] + ts[0][0][-2:-1], ts[0][1]))[1],
     lambda x: np.swapaxes(x, -1, -2)))
op("cont", 1, "a contiguous copy (materializes a view)")(
    (lambda ts, p: ts[0], lambda x: np.array(x, order="C", copy=True)))  # ascontiguousarray makes 0-d [1]


def _concat_infer(ts: list[Type], p: dict) -> Type:
    (sa, da), (sb, db) = ts
    ax = p["axis"]
    need(len(sa) == len(sb) and -len(sa) <= ax < len(sa), f"axis {ax} invalid for {list(sa)} and {list(sb)}")
    ax %= len(sa)
    need(da == db, f"dtypes differ: {da} vs {db}")
    need(all(a == b for i, (a, b) in enumerate(zip(sa, sb)) if i != ax),
         f"shapes {list(sa)} and {list(sb)} differ outside axis {ax}")
    return tuple(a + b if i == ax else a for i, (a, b) in enumerate(zip(sa, sb))), da


op("concat", 2, "join a and b along axis", {"axis": (int, REQUIRED)})(
    (_concat_infer, lambda a, b, axis: np.concatenate([a, b], axis=axis)))


def _cast_infer(ts: list[Type], p: dict) -> Type:
    need(p["dtype"] in ("f32", "f16", "i32"), f"cast target must be f32, f16 or i32, got {p['dtype']}")
    return ts[0][0], p["dtype"]


op("cast", 1, "convert to dtype (f32, f16, i32); float -> int truncates toward zero", {"dtype": (str, REQUIRED)})(
    (_cast_infer, lambda x, dtype: x.astype({"f32": np.float32, "f16": np.float16, "i32": np.int32}[dtype])))


# ---------------------------------------------------------------- in-place writes into State
def _set_rows_infer(ts: list[Type], p: dict) -> Type:
    (sd, dd), (ss, ds), (si, di) = ts
    need(dd in ("f32", "f16"), f"dst must be f32 or f16 State, got {dd}")
    need_float(ts[1], "src")
    need_i32(ts[2], "row indices")
    need(len(ss) >= 1, "src must have a row axis, got a 0-d tensor")  # ss[0] was an IndexError
    need(si == (ss[0],), f"row indices must be [n]={[ss[0]]}, got {list(si)}")
    need(ss[1:] == sd[1:], f"src rows {list(ss[1:])} do not match dst rows {list(sd[1:])}")
    return ts[0]


def _set_rows_ref(dst: np.ndarray, src: np.ndarray, idx: np.ndarray) -> np.ndarray:
    if idx.size and (idx.min() < 0 or idx.max() >= dst.shape[0]):
        raise GraphError(f"set_rows: row index out of range 0..{dst.shape[0] - 1} (got {idx.min()}..{idx.max()})")
    dst[idx] = src.astype(dst.dtype)
    return dst


op("set_rows", 3, "dst[idx[i]] = src[i], in place (KV-cache write at run-time rows); returns dst", writes=True)(
    (_set_rows_infer, _set_rows_ref))


def _assign_infer(ts: list[Type], p: dict) -> Type:
    need(ts[0][0] == ts[1][0], f"value {list(ts[1][0])} must have the State's shape {list(ts[0][0])}")
    need_float(ts[1], "value")
    return ts[0]


def _assign_ref(dst: np.ndarray, value: np.ndarray) -> np.ndarray:
    dst[...] = value.astype(dst.dtype)
    return dst


op("assign", 2, "dst[...] = value, in place (conv/recurrent state write-back); returns dst", writes=True)(
    (_assign_infer, _assign_ref))


# ---------------------------------------------------------------- multi-output plumbing
op("item", 1, "the index-th result of a multi-output op", {"index": (int, REQUIRED)})(
    (lambda ts, p: fail("item is typed from its source's types"), lambda x, index: x[index]))


# ---------------------------------------------------------------- recurrent (linear attention) ops
def _ssm_conv_infer(ts: list[Type], p: dict) -> list[Type]:
    (sx, dx), (ss, ds), (sw, dw) = ts
    need_float(ts[0], "x")
    need(len(sx) == 2, f"x must be [n_tokens, channels], got {list(sx)}")
    need(len(sw) == 2 and sw[0] == sx[1], f"w must be [channels={sx[1]}, kernel], got {list(sw)}")
    need(ss == (sw[1] - 1, sx[1]), f"state must be [kernel-1, channels]={[sw[1] - 1, sx[1]]}, got {list(ss)}")
    return [(sx, "f32"), (ss, ds)]


def _ssm_conv_ref(x, state, w):
    k = w.shape[1]
    xx = np.concatenate([state.astype(np.float32), x.astype(np.float32)], axis=0)  # [k-1+n, c]
    n = x.shape[0]
    y = np.zeros(x.shape, np.float32)
    for j in range(k):
        y += xx[j:j + n] * w[:, j].astype(np.float32)
    return y, xx[n:].astype(state.dtype)


op("ssm_conv", 3,
   "causal depthwise conv: y[t,c] = sum_j w[c,j] * [state; x][t+j, c]; returns (y, new_state = last kernel-1 rows)",
   multi=True)((_ssm_conv_infer, _ssm_conv_ref))


def _gdn_infer(ts: list[Type], p: dict) -> list[Type]:
    (sq, _), (sk, _), (sv, _), (sg, _), (sb, _), (ss, ds) = ts
    for t, w in zip(ts, ("q", "k", "v", "g", "beta", "state")):
        need_float(t, w)
    need(len(sq) == 3 and sq == sk, f"q {list(sq)} and k {list(sk)} must be equal [tokens, k_heads, d_k]")
    need(len(sv) == 3 and sv[0] == sq[0], f"v must be [tokens={sq[0]}, v_heads, d_v], got {list(sv)}")
    n, hk, dk = sq
    hv, dv = sv[1], sv[2]
    need(hk >= 1 and hv % hk == 0, f"v heads {hv} must be a multiple of k heads {hk}")  # hk 0: ZeroDivisionError
    need(sg == (n, hv) and sb == (n, hv), f"g {list(sg)} and beta {list(sb)} must be [tokens, v_heads]={[n, hv]}")
    need(ss == (hv, dk, dv), f"state must be [v_heads, d_k, d_v]={[hv, dk, dv]}, got {list(ss)}")
    out = [((n, hv, dv), "f32"), (ss, ds)]
    return out + [((n, *ss), ds)] if p.get("steps") else out


def _gdn_ref(q, k, v, g, beta, state, scale: float, steps: bool = False):
    n, hk, dk = q.shape
    hv = v.shape[1]
    rep = hv // hk
    q = np.repeat(q.astype(np.float32), rep, axis=1) * np.float32(scale)  # head h reads k-head h // rep
    k = np.repeat(k.astype(np.float32), rep, axis=1)
    s = state.astype(np.float32).copy()  # [hv, dk, dv]
    out = np.zeros((n, hv, v.shape[2]), np.float32)
    after = np.zeros((n, *state.shape), state.dtype)  # the state after each token (steps=True)
    for t in range(n):
        s *= np.exp(g[t])[:, None, None]
        kv_mem = np.einsum("hk,hkv->hv", k[t], s)
        delta = (v[t] - kv_mem) * beta[t][:, None]
        s += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hk,hkv->hv", q[t], s)
        after[t] = s
    return (out, s.astype(state.dtype), after) if steps else (out, s.astype(state.dtype))


# steps=True keeps the state after every token as a third result [tokens, v_heads, d_k, d_v]: a speculative
# verify call makes the state after its last accepted token current (graphir/speculative.py), since a
# recurrent state cannot roll back by length as a KV cache does.
op("gated_delta_net", 6,
   "gated delta rule over tokens t: S *= exp(g_t); S += k_t (beta_t (v_t - k_t^T S))^T; o_t = (scale q_t)^T S; "
   "state [v_heads, d_k, d_v]; returns (o, new_state), and with steps also S after each token [tokens, *state]",
   {"scale": (float, REQUIRED), "steps": (bool, False)}, multi=True)((_gdn_infer, _gdn_ref))
