"""Which kernel each op lowers to on the CPU, and the layout decisions behind it.

`lower_node(node, ins, out)` returns (value, step): the array (or arrays) the node
produces and a zero-argument callable that computes it, or None for pure views.
Ops without a dedicated kernel fall back to the op table's numpy reference, so every
op runs; the dedicated kernels are the ones a decode step spends its time in.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from graphir.builder import contiguous_strides
from graphir.ir import Graph, Node
from graphir.lowering import ParamRef, fold_params, val  # noqa: F401  (re-exported for program.py)
from graphir.ops import OPS
from graphir.ops.core import sample_row

from . import attention as ATT
from . import attention_prefill as ATP
from . import host_collective as HC
from . import kernels as K
from . import kv_f16 as KF
from . import matmul as MM
from . import precompile
from .direct_call import KernelCall

# While CpuProgram._bind runs, the kernels its steps will call, in step order: ("mm", weight dtype, rows of x,
# or None for get_rows), ("intx", module of an integer-x GEMV) and ("kernel", numba dispatcher, args).
# precompile.py compiles them before the first call, sharing the work with a helper process on a cold cache.
# None: not recording.
RECORD: list | None = None


def _note(*uses: tuple) -> None:
    if RECORD is not None:
        RECORD.extend(uses)
        for use in uses:
            precompile.noted(use)  # a cold cache's helper may start on it before the binding ends


# Elementwise kernels go parallel from this many elements: below it a parallel region's ~4 us
# (waking and joining the other thread) is more than the work it would share.
PARALLEL_MIN_ELEMENTS = 8192


def views_needing_copy(graph: Graph) -> set[int]:
    """View ops whose source is not row-major contiguous: numpy would copy at bind time,
    which would freeze stale data, so the backend copies into a planned slot every step."""
    contiguous: dict[int, bool] = {}
    copies: set[int] = set()
    for n in graph.nodes():
        if n.op in ("permute", "transpose"):
            axes = n.params["axes"] if n.op == "permute" else None
            identity = axes is not None and list(axes) == sorted(axes)
            contiguous[id(n)] = contiguous[id(n.src[0])] and identity
        elif n.op == "reshape":
            if not contiguous[id(n.src[0])]:
                copies.add(id(n))
            contiguous[id(n)] = True
        elif n.op == "view":
            if not contiguous[id(n.src[0])]:
                copies.add(id(n))
            contiguous[id(n)] = tuple(n.params["strides"]) == contiguous_strides(n.shape)
        else:
            contiguous[id(n)] = True
    return copies


# ---------------------------------------------------------------- per-node lowering
def rows2d(a: np.ndarray) -> np.ndarray | None:
    """[..., n] -> [rows, n] without copying, or None if numpy would have to copy."""
    if a.ndim == 2:
        return a
    try:
        return a.reshape(-1, a.shape[-1], copy=False)
    except ValueError:
        return None


def rows3d(a: np.ndarray) -> np.ndarray | None:
    """[..., h, d] -> [rows, h, d] without copying (leading axes of 1 added below 3-D), or None."""
    shape = (1,) * (3 - a.ndim) + a.shape
    try:
        return a.reshape(-1, *shape[-2:], copy=False)
    except ValueError:
        return None


def _rows_axis0(a: np.ndarray) -> np.ndarray | None:
    """[n, ...] -> [n, rest] without copying, or None."""
    try:
        return a.reshape(a.shape[0], -1, copy=False)
    except ValueError:
        return None


def _unary2d(kernel: Callable, x: np.ndarray, out: np.ndarray, *args: Any) -> Callable[[], None]:
    x2, o2 = rows2d(x), rows2d(out)
    if x2 is None:
        return lambda: kernel(np.ascontiguousarray(x).reshape(o2.shape), *args, o2)
    _note(("kernel", kernel, (x2, *args, o2)))
    return KernelCall(kernel, x2, *args, o2)


def lower_node(n: Node, ins: list[Any], out: list[np.ndarray] | None) -> tuple[Any, Callable[[], None] | None]:
    rule = RULES.get(n.op)
    if n.op not in ARRAY_RULES and n.op not in F16_CACHE_RULES and _has_f16(ins, out):
        rule = None  # numba has no float16 arithmetic: f16 activations take the numpy reference
    if rule is not None:
        result = rule(n, ins, out, n.params.as_dict())
        if result is not None:
            return result
    return _fallback(n, ins, out)


def _has_f16(ins: list[Any], out: list[np.ndarray] | None) -> bool:
    arrays = [x for x in ins if isinstance(x, np.ndarray)] + list(out or [])
    return any(a.dtype == np.float16 for a in arrays)


def _fallback(n: Node, ins: list[Any], out: list[np.ndarray] | None):
    ref, params = OPS[n.op].ref, n.params.as_dict()
    args = [val(x) for x in ins]
    if OPS[n.op].writes:
        return args[0], lambda: ref(*args, **params)
    if OPS[n.op].multi:
        def step() -> None:
            for o, r in zip(out, ref(*args, **params)):
                o[...] = r
        return out, step
    o = out[0]

    def step() -> None:
        o[...] = ref(*args, **params)
    return o, step


def _mul_mat(n, ins, out, p):
    w, x, o = ins[0], ins[1], out[0]
    if not isinstance(w, ParamRef) or len(w.shape) != 2 or x.dtype != np.float32:
        return None  # activations x activations, batched weights or f16 activations: numpy reference
    x2, o2 = rows2d(x), rows2d(o)
    raw, dt = w.raw, w.dtype
    _note(("mm", dt, int(np.prod(x.shape[:-1]))))
    if x2 is not None and x2.flags.c_contiguous:
        if x2.shape[0] <= 4:  # decode: q4_0 / q4_1 / q8_0 weights repacked once (gemv_repacked.py)
            from . import gemv_repacked as GR

            fast = GR.prepare(raw, dt, x2, o2, w.weights.derived if w.weights is not None else None, w.key)
            if fast is not None:
                return o, fast
        run, _ = MM.prepare_matmul(raw, dt, x2, o2)  # checks once at bind time: ~3.5 us a call, not ~10
        return o, run
    if x2 is None:
        return o, lambda: MM.matmul(raw, dt, np.ascontiguousarray(x).reshape(-1, x.shape[-1]), o2)
    return o, lambda: MM.matmul(raw, dt, x2, o2)


def _mul_mat_int_x(module: str):
    """The rule of mul_mat_q8x / mul_mat_q16x: `module`'s prepare (gemv_q8x, gemv_q16x), imported on first use, so
    only models run through q8- / q16-activations compile it."""
    def rule(n, ins, out, p):
        w, x, o = ins[0], ins[1], out[0]
        if not isinstance(w, ParamRef) or len(w.shape) != 2:
            return None  # what the op's rule refuses anyway; the reference says so
        x2, o2 = rows2d(x), rows2d(o)
        if x2 is None or not x2.flags.c_contiguous or x2.dtype != np.float32:
            return None  # a strided or f16 x: the numpy reference
        kernels = importlib.import_module(f"{__package__}.{module}")
        _note(("intx", module))
        precompile.wait(f"intx:{module}")  # the helper process may be compiling it: then load it from the cache
        run = kernels.prepare(w.raw, w.dtype, x2, o2, w.weights.derived if w.weights is not None else None, w.key)
        return (o, run) if run is not None else None
    return rule


def _get_rows(n, ins, out, p):
    table, ids, o = ins[0], ins[1], out[0]
    if not isinstance(table, ParamRef):
        return None
    raw, dt = table.raw, table.dtype
    _note(("mm", dt, None))
    if isinstance(ids, np.ndarray) and dt in MM.SUPPORTED and o.dtype == np.float32 and o.flags.c_contiguous:
        run = MM.prepare_get_rows(raw, dt, ids, o)  # views and checks once (the step after the head runs cold)
        if run is not None:
            return o, run

    def step() -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= raw.shape[0]):
            raise IndexError(f"get_rows: id out of range 0..{raw.shape[0] - 1}")
        MM.get_rows(raw, dt, ids, o)
    return o, step


def _sample(n, ins, out, p):
    """Greedy rows (temperature <= 0 or top_k 1: generate's default) take the first index of the largest logit
    straight from the f32 row; the reference finds the same index in the row widened to float64 (exact and
    order-preserving), but the widened copy made it 300 us of a SmolLM2 decode token. Other rows: the reference's
    sample_row, with the settings read as the reference reads them."""
    x, settings, o = rows2d(val(ins[0])), rows2d(val(ins[1])), out[0]
    if x is None or settings is None or x.dtype != np.float32 or not o.flags.c_contiguous:
        return None
    o1 = o.reshape(-1)

    def step() -> None:
        for r in range(x.shape[0]):
            temperature, top_k, top_p, u = settings[r].tolist()
            if temperature <= 0.0 or int(top_k) == 1:
                o1[r] = np.argmax(x[r])
            else:
                o1[r] = sample_row(x[r], temperature, int(top_k), top_p, u)
    return o, step


def _binary(ufunc):
    def rule(n, ins, out, p):
        a, b, o = val(ins[0]), val(ins[1]), out[0]
        return o, lambda: ufunc(a, b, out=o)
    return rule


def _rms_norm(n, ins, out, p):
    return out[0], _unary2d(K.rms_norm, ins[0], out[0], np.float32(p["eps"]))


def _rms_norm_mul_gate(n, ins, out, p):
    x, w, z, o = rows3d(val(ins[0])), val(ins[1]), rows3d(val(ins[2])), rows3d(out[0])
    if x is None or z is None or w.ndim != 1:
        return None
    eps = np.float32(p["eps"])
    _note(("kernel", K.rms_norm_mul_gate, (x, w, z, eps, o)))
    return out[0], KernelCall(K.rms_norm_mul_gate, x, w, z, eps, o)


def _silu(n, ins, out, p):
    return out[0], _unary2d(K.silu, ins[0], out[0])


def _swiglu(n, ins, out, p):
    a, b, o = rows2d(ins[0]), rows2d(ins[1]), rows2d(out[0])
    if a is None or b is None:
        return None
    kernel = K.swiglu_split if a.size >= PARALLEL_MIN_ELEMENTS else K.swiglu
    _note(("kernel", kernel, (a, b, o)))
    return out[0], KernelCall(kernel, a, b, o)


def _mul_sigmoid(n, ins, out, p):
    """a * sigmoid(b) as the unfused ops compute it (the same f32 ufuncs in the same order, so equal
    bit for bit), through one scratch buffer bound with the Program; b may be a strided view."""
    a, b, o = val(ins[0]), val(ins[1]), out[0]
    s = np.empty(b.shape, np.float32)

    def step() -> None:
        with np.errstate(over="ignore"):  # e^-b = inf for very negative b: sigmoid 0, as the reference
            np.exp(np.negative(b, out=s), out=s)
        np.add(1.0, s, out=s)
        np.divide(1.0, s, out=s)
        np.multiply(a, s, out=o)
    return o, step


def _mul_mat_swiglu(n, ins, out, p):
    """The stacked gate|up product into a buffer bound once with the Program, then the activation:
    the same two kernels as the unfused ops (the fusion saves a GPU launch, not CPU work)."""
    o = out[0]
    half = o.shape[-1]
    y = np.empty(o.shape[:-1] + (2 * half,), np.float32)
    return _in_order(o, _mul_mat(n, ins, [y], p), _swiglu(n, [y[..., :half], y[..., half:]], [o], p))


def _in_order(value: Any, *lowered: tuple | None) -> tuple | None:
    """(value, one step running the lowered rules' steps in order), or None (the numpy reference)
    when any of those rules has no kernel for its case."""
    if any(r is None for r in lowered):
        return None
    steps = [r[1] for r in lowered]

    def step() -> None:
        for s in steps:
            s()
    return value, step


def _rope(n, ins, out, p):
    x, pos, o = ins[0], ins[1], out[0]
    inv_freq = _inv_freq(p)
    neox = p["mode"] == "neox"
    _note(("kernel", K.rope, (x, pos, inv_freq, p["n_dims"], neox, p["freq_scale"], o)))
    return o, KernelCall(K.rope, x, pos, inv_freq, p["n_dims"], neox, p["freq_scale"], o)


def _inv_freq(p: dict) -> np.ndarray:
    half = p["n_dims"] // 2
    return p["theta"] ** (-np.arange(half, dtype=np.float64) * 2.0 / p["n_dims"])


def _add_rms_norm_mul(n, ins, out, p):
    w = val(ins[2])
    a, b = rows2d(val(ins[0])), rows2d(val(ins[1]))
    o_norm, o_sum = rows2d(out[0]), rows2d(out[1])
    if a is None or b is None or a.shape != b.shape or w.ndim != 1:
        return None
    eps = np.float32(p["eps"])
    _note(("kernel", K.add_rms_norm_mul, (a, b, w, eps, o_norm, o_sum)))
    return out, KernelCall(K.add_rms_norm_mul, a, b, w, eps, o_norm, o_sum)


def _rms_norm_mul_rope(n, ins, out, p):
    x, w, pos = val(ins[0]), val(ins[1]), ins[2]
    x2, o = rows2d(x), out[0]
    o2 = rows2d(o)
    if w.ndim != 1:
        return None
    packed = None
    if x2 is None or not x2.flags.c_contiguous:
        # Several tokens' heads cut from the stacked q|k|v rows: [n, heads, head_dim] with the stacked row's token
        # stride, which no [rows, head_dim] view spans. Packed into a buffer bound with the Program, they take the
        # decode step's kernel in its C layout, so a verify row is the decode step's bit for bit. The numpy
        # reference, which took them before, rounds its rope in f64: 2.4e-7 apart at q_rope (issue 11).
        packed = np.empty(x.shape, np.float32)
        x2 = packed.reshape(-1, x.shape[-1])
    eps, inv_freq, neox = np.float32(p["eps"]), _inv_freq(p), p["mode"] == "neox"
    _note(("kernel", K.rms_norm_mul, (x2, w, eps, o2)),
          ("kernel", K.rope, (o, pos, inv_freq, p["n_dims"], neox, p["freq_scale"], o)))
    norm = KernelCall(K.rms_norm_mul, x2, w, eps, o2)
    # in place: reads a pair, then writes it
    rope = KernelCall(K.rope, o, pos, inv_freq, p["n_dims"], neox, p["freq_scale"], o)

    def step() -> None:
        if packed is not None:
            np.copyto(packed, x)
        norm()
        rope()
    return o, step


def _rope_set_rows(n, ins, out, p):
    cache, x, pos, idx = ins
    if cache.dtype == np.float16 and x.dtype == np.float32 and x.ndim == 3:  # kv-f16: rope in f32, then round
        roped = np.empty(x.shape, np.float32)
        return _in_order(cache, _rope(n, [x, pos], [roped], p),
                         _set_rows(n, [cache, roped.reshape(x.shape[0], -1), idx], [cache], p))
    if not cache.dtype == x.dtype == np.float32 or x.ndim != 3:
        return None
    c3 = cache.reshape((cache.shape[0],) + x.shape[1:])
    inv_freq, neox = _inv_freq(p), p["mode"] == "neox"
    _note(("kernel", K.rope_set_rows, (c3, x, pos, idx, inv_freq, p["n_dims"], neox, p["freq_scale"])))
    return cache, KernelCall(K.rope_set_rows, c3, x, pos, idx, inv_freq, p["n_dims"], neox, p["freq_scale"])


def _rms_norm_mul_rope_set_rows(n, ins, out, p):
    """The normed, roped rows into a buffer bound once with the Program, then the cache write: the
    unfused ops' kernels (the fusion saves a GPU launch, not CPU work)."""
    cache, x, w, pos, idx = ins
    if val(x).dtype != np.float32 or val(w).dtype != np.float32:
        return None  # f16 activations or weights: numba has no float16 arithmetic
    roped = np.empty(x.shape, np.float32)
    return _in_order(cache, _rms_norm_mul_rope(n, [x, w, pos], [roped], p),
                     _set_rows(n, [cache, roped.reshape(x.shape[0], -1), idx], [cache], p))


def _flash_attn(n, ins, out, p):
    q, k, v, pos, kv_len = ins
    o = out[0]
    scale, window = np.float32(p["scale"]), p["window"]
    cap = k.shape[0]
    threads_at = None  # the argument that takes the threads in use at call time (auto threads change them)
    if ATT.supports(q, k, v):  # decode: each K/V row read once per KV head, keys split across threads
        kern, args = ATT.bind_decode(q, k, v, pos, kv_len, scale, window, o)
    elif ATP.supports(q, k, v):  # prefill: blocks of queries against chunks of keys, as small matrix products
        kern, args, threads_at = ATP.KERNELS[k.shape[2]], (q, k, v, pos, kv_len, scale, window, 2, o), 7
    elif k.dtype == v.dtype == np.float16 and _f16_prefill_ok(q, k, v):
        return _f16_prefill_attention(q, k, v, pos, kv_len, scale, window, o)
    elif k.dtype == v.dtype == q.dtype == np.float32:
        kern, args = K.attention, (q, k, v, pos, kv_len, scale, window, o)
    else:
        return None  # an f16 cache the prefill kernel does not take: numpy reference
    _note(("kernel", kern, args))
    call = KernelCall(kern, *args)

    def step() -> None:
        if not 0 <= kv_len[0] <= cap:
            raise ValueError(f"flash_attn: kv_len {int(kv_len[0])} outside 0..{cap} (the KV capacity)")
        if threads_at is None:
            call()
        else:
            kern(*args[:threads_at], MM._num_threads(), *args[threads_at + 1:])
    return o, step


def _f16_prefill_ok(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> bool:
    """Whether the prefill kernel takes these queries over the f32 widening of f16 caches k, v."""
    wide = [np.empty((0, *a.shape[1:]), np.float32) for a in (k, v)]
    return k.flags.c_contiguous and v.flags.c_contiguous and ATP.supports(q, *wide)


def _f16_prefill_attention(q, k, v, pos, kv_len, scale, window, o):
    """Prefill over f16 caches (kv-f16): the kv_len visible rows widened to f32 (exactly, vectorized), then
    the f32 prefill kernel. The widened rows are made per call, kv_len of them: bound buffers of the whole
    capacity would cost every layer 2 x capacity f32 rows (190 MB for SmolLM2 at 4k), and a call's
    compute is quadratic in its rows while the widening is linear."""
    cap, k16, v16 = k.shape[0], k.view(np.uint16), v.view(np.uint16)
    kern = ATP.KERNELS[k.shape[2]]
    kw0, vw0 = (np.empty((0, *a.shape[1:]), np.float32) for a in (k, v))  # the call-time arrays' types
    _note(("kernel", ATT.widen_f16_rows, (k16, np.int64(cap), kw0)),
          ("kernel", kern, (q, kw0, vw0, pos, kv_len, scale, window, 2, o)))

    def step() -> None:
        length = int(kv_len[0])
        if not 0 <= length <= cap:
            raise ValueError(f"flash_attn: kv_len {length} outside 0..{cap} (the KV capacity)")
        kw = np.empty((length, *k.shape[1:]), np.float32)
        vw = np.empty((length, *v.shape[1:]), np.float32)
        ATT.widen_f16_rows(k16, length, kw)
        ATT.widen_f16_rows(v16, length, vw)
        kern(q, kw, vw, pos, kv_len, scale, window, MM._num_threads(), o)
    return o, step


def _set_rows(n, ins, out, p):
    dst, src, idx = ins
    # rows are axis 0: [capacity, ...] -> [capacity, row elements]
    d2 = _rows_axis0(dst)
    s2 = _rows_axis0(src)
    if d2 is not None and s2 is not None and dst.dtype == np.float16 and src.dtype == np.float32:
        return dst, _f16_row_write(d2, s2, idx)
    if d2 is None or s2 is None or not src.dtype == dst.dtype == np.float32:
        return None
    _note(("kernel", K.set_rows, (d2, s2, idx)))
    return dst, KernelCall(K.set_rows, d2, s2, idx)


def _f16_row_write(d2: np.ndarray, s2: np.ndarray, idx: np.ndarray) -> Callable[[], None]:
    """f32 rows into an f16 cache (kv-f16): rounded as the reference's cast rounds, into the cache's bits."""
    bits = d2.view(np.uint16)
    _note(("kernel", KF.set_rows_f16, (bits, s2, idx)))
    return KernelCall(KF.set_rows_f16, bits, s2, idx)


def _view(n, ins, out, p):
    x = val(ins[0])
    if out is not None:  # source not contiguous: copy every step
        return None
    flat = x.reshape(-1)
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat[p["offset"]:], p["shape"], [s * item for s in p["strides"]]), None


def _reshape(n, ins, out, p):
    if out is not None:
        return None
    return val(ins[0]).reshape(p["shape"]), None


def _cont(n, ins, out, p):
    x, o = val(ins[0]), out[0]
    return o, lambda: np.copyto(o, x)


# rules that only use numpy array operations, which handle every dtype
ARRAY_RULES = ("add", "sub", "mul", "div", "view", "reshape", "permute", "transpose", "cont", "mul_mat",
               "get_rows", "all_reduce", "all_gather")

# rules that read f16 KV caches themselves (as uint16 bits) and return None for other f16 inputs
F16_CACHE_RULES = ("flash_attn", "set_rows", "rope_set_rows", "rms_norm_mul_rope_set_rows")

RULES: dict[str, Callable] = {
    "mul_mat": _mul_mat,
    "mul_mat_q8x": _mul_mat_int_x("gemv_q8x"),
    "mul_mat_q16x": _mul_mat_int_x("gemv_q16x"),
    "get_rows": _get_rows,
    "sample": _sample,
    "add": _binary(np.add),
    "sub": _binary(np.subtract),
    "mul": _binary(np.multiply),
    "div": _binary(np.divide),
    "rms_norm": _rms_norm,
    "silu": _silu,
    "swiglu_split": _swiglu,
    "mul_mat_swiglu": _mul_mat_swiglu,
    "mul_sigmoid": _mul_sigmoid,
    "rms_norm_mul_gate": _rms_norm_mul_gate,
    "rope": _rope,
    "flash_attn": _flash_attn,
    "set_rows": _set_rows,
    "add_rms_norm_mul": _add_rms_norm_mul,
    "rms_norm_mul_rope": _rms_norm_mul_rope,
    "rope_set_rows": _rope_set_rows,
    "rms_norm_mul_rope_set_rows": _rms_norm_mul_rope_set_rows,
    "view": _view,
    "reshape": _reshape,
    "permute": lambda n, ins, out, p: (np.transpose(val(ins[0]), p["axes"]), None),
    "transpose": lambda n, ins, out, p: (np.swapaxes(val(ins[0]), -1, -2), None),
    "cont": _cont,
}


# ---------------------------------------------------------------- recurrent layers (Gated DeltaNet); recurrent.py
from . import recurrent as REC  # noqa: E402


def _ssm_conv(apply_silu: bool):
    def rule(n, ins, out, p):
        x, state, w = val(ins[0]), ins[1], val(ins[2])
        if state.dtype != np.float32 or x.ndim != 2:
            return None
        return out, lambda: REC.ssm_conv(x, state, w, apply_silu, out[0], out[1])
    return rule


def _gated_delta_net(n, ins, out, p):
    q, k, v, gate, beta, state = (val(x) for x in ins)
    if state.dtype != np.float32:
        return None
    steps = out[2] if p["steps"] else None
    return out, lambda: REC.gated_delta_net(q, k, v, gate, beta, state, p["scale"], out[0], out[1], steps=steps)


def _gated_delta_net_raw(n, ins, out, p):
    q, k, v, alpha, b, a_neg, dt_bias, state = (val(x) for x in ins)
    if state.dtype != np.float32 or alpha.ndim != 2:
        return None
    gate, beta = np.empty(alpha.shape, np.float32), np.empty(alpha.shape, np.float32)  # bound once, reused
    eps = p["l2_eps"]
    qn, kn = (q, k) if eps is None else (np.empty(q.shape, np.float32), np.empty(k.shape, np.float32))
    steps = out[2] if p["steps"] else None

    def step() -> None:
        if eps is not None:
            REC.l2_norm(q, np.float32(eps), qn)
            REC.l2_norm(k, np.float32(eps), kn)
        REC.gdn_gates(alpha, b, a_neg, dt_bias, gate, beta)
        REC.gated_delta_net(qn, kn, v, gate, beta, state, p["scale"], out[0], out[1], steps=steps)
    return out, step


def _l2_norm(n, ins, out, p):
    x, o = val(ins[0]), out[0]
    if x.ndim not in (2, 3):
        return None
    x3, o3 = (x[None], o[None]) if x.ndim == 2 else (x, o)
    return o, lambda: REC.l2_norm(x3, np.float32(p["eps"]), o3)


def _assign(n, ins, out, p):
    dst, value = ins[0], val(ins[1])
    return dst, lambda: np.copyto(dst, value)


def _one_rank_collective(n, ins, out, p):
    """One rank's part of a collective, in a process that joined a host group (tp_workers.py): the
    exchange with the other processes. Simulated ranks, or no group, take the reference (which says
    that a one-source collective needs such a process)."""
    if len(ins) != 1 or p["ranks"] == 1:
        return None
    group = HC.current(n)
    if group is None:
        return None
    x, o = val(ins[0]), out[0]
    if n.op == "all_reduce":
        return o, lambda: group.all_reduce(x, o)
    pieces = np.empty((p["ranks"],) + x.shape, x.dtype)  # bound once, reused every call
    axis = p["axis"] % x.ndim

    def gather() -> None:
        group.all_gather(x, pieces)
        np.concatenate(list(pieces), axis=axis, out=o)
    return o, gather


RULES.update({
    "ssm_conv": _ssm_conv(False),
    "ssm_conv_silu": _ssm_conv(True),
    "gated_delta_net": _gated_delta_net,
    "gated_delta_net_raw": _gated_delta_net_raw,
    "l2_norm": _l2_norm,
    "assign": _assign,
    "all_reduce": _one_rank_collective,
    "all_gather": _one_rank_collective,
})
