"""The chunked gated delta rule (backends/gpu/delta_chunked.cu, .py) against the reference ops and
against the token-loop kernel (recurrent.cu), for gated_delta_net and gated_delta_net_raw, with and
without l2 normalization of q and k, on a nonzero initial state.

Two ways to run the kernels:
- on a GPU (marker gpu): `chunked_launches` as the backend calls it;
- on the host, no GPU needed: the same .cu compiled by g++ with a small shim (one OS thread per GPU
  thread, a std::barrier for __syncthreads, `static` for __shared__), the launches recorded from
  `chunked_launches` and replayed there. Every buffer is fenced by NaN guards (a write outside a
  tensor is caught, a read outside one poisons the result) and outputs start as NaN (an element
  never written shows up). The kernels use no warp-level operations, so the shim's semantics are
  theirs; warp width and the vendor compilers are the GPU suite's part.
"""

from __future__ import annotations

import ctypes
import math
import re

import _host_emulation as host_emulation
import numpy as np
import pytest
from _gpu_helpers import gpu_only
from graphir.backends.gpu import delta_chunked as DC
from graphir.backends.gpu import kernels

from graphir.errors import BackendError
from graphir.ops import OPS

TOL = 1e-5  # max |got - want| <= TOL * max |want|, per tensor (o and the new state)


# ---------------------------------------------------------------- cases and the reference
def _gate_strides(shape: tuple[int, ...], n: int, hv: int) -> tuple[int, int]:
    """Element strides per token and per v-head of a gate tensor broadcast onto [n, hv] (0 on size-1 axes)."""
    full = (1,) * (2 - len(shape)) + shape
    return (full[1] if full[0] == n and n > 1 else 0), (1 if full[1] == hv and hv > 1 else 0)


def make_case(rng: np.random.Generator, n: int, hk: int, hv: int, dk: int, dv: int, raw: bool,
              l2_eps: float | None, gate_shape: str = "hv") -> dict:
    """Random inputs (never zeros). Without l2, q and k rows have unit norm, as the model's l2_norm
    feeds them (a delta rule with |k| >> 1 diverges); with l2, their norms are far from 1."""
    def normal(shape, s=1.0):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    if l2_eps is None:
        q, k = (normal((n, hk, dk)) for _ in range(2))
        q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    else:
        q, k = normal((n, hk, dk), 3.0), normal((n, hk, dk), 0.2)
    case = dict(q=q.astype(np.float32), k=k.astype(np.float32), v=normal((n, hv, dv)),
                state=normal((hv, dk, dv), 0.3), scale=1 / math.sqrt(dk), raw=raw, l2_eps=l2_eps)
    if raw:
        shape = {"hv": (hv,), "n,hv": (n, hv), "1": (1,)}[gate_shape]
        case |= dict(gate0=normal((n, hv)), gate1=normal((n, hv)), a_neg=-np.exp(normal(shape, 0.5)),
                     dt_bias=normal(shape))
    else:
        case |= dict(gate0=(-np.logaddexp(0, normal((n, hv)))).astype(np.float32),  # log of a decay in (0, 1)
                     gate1=(1 / (1 + np.exp(-normal((n, hv))))).astype(np.float32))
    return case


def reference(c: dict) -> tuple[np.ndarray, np.ndarray]:
    """(o, new_state) from the op table's numpy references."""
    if c["raw"]:
        return OPS["gated_delta_net_raw"].ref(c["q"], c["k"], c["v"], c["gate0"], c["gate1"], c["a_neg"],
                                              c["dt_bias"], c["state"], scale=c["scale"], l2_eps=c["l2_eps"])
    q, k = c["q"], c["k"]
    if c["l2_eps"] is not None:
        q, k = OPS["l2_norm"].ref(q, eps=c["l2_eps"]), OPS["l2_norm"].ref(k, eps=c["l2_eps"])
    return OPS["gated_delta_net"].ref(q, k, c["v"], c["gate0"], c["gate1"], c["state"], scale=c["scale"])


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, what
    assert np.isfinite(got).all(), f"{what}: non-finite values (an unwritten or poisoned element)"
    if want.size == 0:
        return
    err, size = float(np.abs(got - want).max()), float(np.abs(want).max())
    assert err <= TOL * size, f"{what}: max |diff| {err:.3g} > {TOL} * max |want| {size:.3g}"


def launches(lw, c: dict, d: dict, n: int, inplace: bool = False) -> list:
    """chunked_launches for case `c` on buffers `d` (device or host arrays of the case's tensors)."""
    hk, dk = c["q"].shape[1:]
    hv, dv = c["v"].shape[1:]
    if c["raw"]:
        a_st, a_sh = _gate_strides(c["a_neg"].shape, n, hv)
        d_st, d_sh = _gate_strides(c["dt_bias"].shape, n, hv)
        a_neg, dt_bias = d["a_neg"], d["dt_bias"]
    else:
        a_st = a_sh = d_st = d_sh = 0
        a_neg = dt_bias = d["gate0"]
    new_state = d["state"] if inplace else d["new_state"]
    return DC.chunked_launches(lw, None, d["q"], d["k"], d["v"], d["gate0"], d["gate1"], a_neg, dt_bias,
                               np.int32(a_st), np.int32(a_sh), np.int32(d_st), np.int32(d_sh), d["state"], d["o"],
                               new_state, n, hk, hv, dk, dv, c["scale"], c["raw"], c["l2_eps"])


TENSORS = ("q", "k", "v", "gate0", "gate1", "a_neg", "dt_bias", "state")
# (n, hk, hv, dk, dv): the brief's lengths at two head shapes, Qwen3.5-9B's heads at n = 130
SHAPES = [(n, 1, 1, 64, 64) for n in (1, 7, 63, 64, 65, 130, 4096)] + \
         [(n, 2, 4, 128, 128) for n in (1, 7, 63, 64, 65, 130, 4096)] + [(130, 16, 32, 128, 128)]


# ---------------------------------------------------------------- host-side checks (no GPU)
def test_python_constants_mirror_the_kernel_source():
    src = (kernels.KERNEL_DIR / DC.SOURCE).read_text()
    defined = dict(re.findall(r"#define (GDC_L|GDC_THREADS|GDC_TILE) (\d+)", src))
    assert {k: int(v) for k, v in defined.items()} == {"GDC_L": DC.CHUNK, "GDC_THREADS": DC.THREADS,
                                                        "GDC_TILE": DC.TILE}
    assert DC.RECORD == DC.CHUNK * DC.CHUNK + 4 * DC.CHUNK + 4  # GDC_REC
    assert set(re.findall(r"DEFINE_GDC\((\d+)\)", src)) == {str(d) for d in DC.DK_CLASSES}
    assert DC.SOURCE in kernels.SOURCES


def test_record_scratch_size():
    assert DC.record_floats(0, 32) == 0
    assert DC.record_floats(1, 3) == 3 * DC.RECORD  # a partial chunk takes a whole record
    assert DC.record_floats(4096, 32) == 128 * 32 * DC.RECORD
    assert DC.record_floats(4097, 32) == 129 * 32 * DC.RECORD


def test_rejects_head_dims_past_the_largest_class():
    assert DC.supports(128) and not DC.supports(129)
    with pytest.raises(BackendError, match="d_k 129"):
        DC.chunked_launches(None, None, *[None] * 7, *[np.int32(0)] * 4, None, None, None, 80, 1, 1, 129, 8,
                            1.0, False, None)


# ---------------------------------------------------------------- host emulation of the kernels
# The kernels' C signatures: P float pointer, i int, f float.
SIGNATURES = {"gdn_chunk_prep": "PPPPPPPiiiifiiiiif", "gdn_chunk_prep_raw": "PPPPPPPiiiifiiiiif",
              "gdn_chunk_scan": "PPPPPPPiiiii"}
GUARD = 64  # NaN elements either side of every host buffer


def _trampoline(kernel: str, sig: str) -> str:
    cast = {"P": "(float*)a[{}]", "i": "*(int*)a[{}]", "f": "*(float*)a[{}]"}
    args = ", ".join(cast[s].format(j) for j, s in enumerate(sig))
    return (f'extern "C" void emu_{kernel}(void** a, unsigned gx, unsigned gy, unsigned threads) '
            f"{{ emu_launch(gx, gy, threads, [&] {{ {kernel}({args}); }}); }}\n")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    launchers = "".join(_trampoline(f"{name}_d{dk}", sig) for dk in DC.DK_CLASSES for name, sig in SIGNATURES.items())
    return host_emulation.build(tmp_path_factory.mktemp("emu"), DC.SOURCE, launchers)


class HostLaunch:
    """Stands in for launch.Launch: records the kernel and its arguments."""

    def __init__(self, file: str, name: str, grid, block, args, shared: int = 0):
        self.file, self.name, self.args = file, name, args
        self.grid = grid if isinstance(grid, tuple) else (grid,)
        self.block = block if isinstance(block, tuple) else (block,)


class HostLowering:
    """Stands in for launch.Lowering: scratch as NaN-guarded host arrays."""

    def __init__(self):
        self.buffers: list[tuple[np.ndarray, np.ndarray]] = []

    def scratch(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        return guarded(np.full(shape, np.nan, dtype), self.buffers)


def guarded(a: np.ndarray, fences: list) -> np.ndarray:
    """A copy of `a` inside a NaN-filled buffer GUARD elements larger each side; (buffer, view) is
    added to `fences` for check_fences."""
    buf = np.full(a.size + 2 * GUARD, np.nan, np.float32)
    view = buf[GUARD:GUARD + a.size].reshape(a.shape)
    view[...] = a
    fences.append((buf, view))
    return view


def check_fences(fences: list) -> None:
    for buf, view in fences:
        assert np.isnan(buf[:GUARD]).all() and np.isnan(buf[GUARD + view.size:]).all(), \
            f"a kernel wrote outside a buffer of shape {view.shape}"


def run_on_host(emu, steps: list) -> None:
    for st in steps:
        base = st.name.rsplit("_d", 1)[0]
        sig = SIGNATURES[base]
        kinds = "".join("P" if isinstance(a, np.ndarray) else "i" if isinstance(a, np.int32) else "f"
                        if isinstance(a, np.float32) else "?" for a in st.args)
        assert kinds == sig, f"{st.name}: arguments {kinds} do not match the kernel's signature {sig}"
        keep = [np.array(a) if not isinstance(a, np.ndarray) else a for a in st.args]
        ptrs = (ctypes.c_void_p * len(keep))(*[a.ctypes.data for a in keep])
        assert len(st.grid) == 2 and st.block == (DC.THREADS,), st.name
        getattr(emu, f"emu_{st.name}")(ptrs, ctypes.c_uint(st.grid[0]), ctypes.c_uint(st.grid[1]),
                                       ctypes.c_uint(st.block[0]))


def emulate(emu, monkeypatch, c: dict, inplace: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(o, new_state) of the chunked kernels run on the host for case `c`."""
    monkeypatch.setattr(DC, "Launch", HostLaunch)
    n = c["q"].shape[0]
    lw = HostLowering()
    d = {name: guarded(c[name], lw.buffers) for name in TENSORS if name in c}
    d["o"] = guarded(np.full(c["v"].shape, np.nan, np.float32), lw.buffers)
    d["new_state"] = guarded(np.full(c["state"].shape, np.nan, np.float32), lw.buffers)
    run_on_host(emu, launches(lw, c, d, n, inplace))
    check_fences(lw.buffers)
    for name in TENSORS:  # inputs are read only (the state too, unless it is the output)
        if name in c and not (inplace and name == "state"):
            np.testing.assert_array_equal(d[name], c[name], err_msg=f"input {name} was written")
    return d["o"].copy(), (d["state"] if inplace else d["new_state"]).copy()


# n around the chunk (32) and the whole-record boundaries; dk in both classes, odd sizes (padding
# rows, dead state columns in the last tile)
EMU_SHAPES = [(1, 1, 1, 16, 8), (7, 1, 2, 33, 20), (31, 2, 4, 64, 16), (33, 1, 1, 8, 5), (65, 2, 2, 128, 17),
              (70, 1, 3, 100, 33), (300, 1, 1, 128, 16)]


@pytest.mark.parametrize("l2_eps", [None, 1e-6])
@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("shape", EMU_SHAPES, ids=lambda s: "n{}-hk{}-hv{}-dk{}-dv{}".format(*s))
def test_host_emulation_equals_reference(shape, raw, l2_eps, emulator, monkeypatch):
    rng = np.random.default_rng(sum(shape) + 7 * raw + (l2_eps is not None))
    c = make_case(rng, *shape, raw=raw, l2_eps=l2_eps)
    o, s1 = emulate(emulator, monkeypatch, c)
    want_o, want_s = reference(c)
    assert_close(o, want_o, "o")
    assert_close(s1, want_s, "new state")


@pytest.mark.parametrize("gate_shape", ["n,hv", "1"])
def test_host_emulation_broadcast_gates_and_in_place(gate_shape, emulator, monkeypatch):
    """a_neg / dt_bias per token or one scalar; the new state written over the input state."""
    c = make_case(np.random.default_rng(5), 40, 1, 2, 24, 16, raw=True, l2_eps=1e-6, gate_shape=gate_shape)
    o, s1 = emulate(emulator, monkeypatch, c, inplace=True)
    want_o, want_s = reference(c)
    assert_close(o, want_o, "o")
    assert_close(s1, want_s, "new state")


def test_host_emulation_l2_eps_zero_with_a_partial_chunk(emulator, monkeypatch):
    """l2_eps = 0 is finite on real rows; the zero rows that pad the last chunk must stay out of it."""
    c = make_case(np.random.default_rng(9), 40, 1, 2, 24, 16, raw=False, l2_eps=0.0)
    o, s1 = emulate(emulator, monkeypatch, c)
    want_o, want_s = reference(c)
    assert_close(o, want_o, "o")
    assert_close(s1, want_s, "new state")


def test_host_emulation_zero_tokens_copies_the_state(emulator, monkeypatch):
    c = make_case(np.random.default_rng(3), 0, 1, 2, 16, 8, raw=False, l2_eps=None)
    o, s1 = emulate(emulator, monkeypatch, c)
    assert o.shape == (0, 2, 8)
    np.testing.assert_array_equal(s1, c["state"])


# ---------------------------------------------------------------- on the GPU
def run_on_gpu(c: dict, inplace: bool = False) -> tuple[np.ndarray, np.ndarray]:
    import cupy as cp
    from graphir.backends.gpu.launch import Lowering

    n = c["q"].shape[0]
    d = {name: cp.asarray(c[name]) for name in TENSORS if name in c}
    d["o"] = cp.full(c["v"].shape, np.nan, np.float32)
    d["new_state"] = cp.full(c["state"].shape, np.nan, np.float32)
    for st in launches(Lowering(None), c, d, n, inplace):
        st()
    for name in TENSORS:
        if name in c and not (inplace and name == "state"):
            np.testing.assert_array_equal(d[name].get(), c[name], err_msg=f"input {name} was written")
    return d["o"].get(), (d["state"] if inplace else d["new_state"]).get()


def token_loop_on_gpu(c: dict, monkeypatch) -> tuple[np.ndarray, np.ndarray]:
    """The backend's rule (recurrent.py) with the chunked path switched off: its token-loop kernel."""
    import cupy as cp
    from graphir.backends.gpu import recurrent as R
    from graphir.backends.gpu.launch import Lowering

    monkeypatch.setattr(DC, "CHUNKED_MIN_TOKENS", 1 << 30)
    n, _, dk = c["q"].shape
    hv, dv = c["v"].shape[1:]
    names = TENSORS if c["raw"] else ("q", "k", "v", "gate0", "gate1", "state")
    rule = R.lower_gated_delta_net_raw if c["raw"] else R.lower_gated_delta_net
    outs = [cp.full((n, hv, dv), np.nan, np.float32), cp.full(c["state"].shape, np.nan, np.float32)]
    steps = rule(Lowering(None), None, [cp.asarray(c[nm]) for nm in names], outs,
                 {"scale": c["scale"], "l2_eps": c["l2_eps"]})
    assert [st.name.startswith("gated_delta_net") for st in steps] == [True], \
        f"expected the token-loop kernel alone, got {[st.name for st in steps]}"
    for st in steps:
        st()
    return outs[0].get(), outs[1].get()


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("l2_eps", [None, 1e-6])
@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-hk{}-hv{}-dk{}-dv{}".format(*s))
def test_gpu_chunked_equals_reference_and_token_loop(shape, raw, l2_eps, monkeypatch):
    rng = np.random.default_rng(sum(shape) + 7 * raw + (l2_eps is not None))
    c = make_case(rng, *shape, raw=raw, l2_eps=l2_eps)
    o, s1 = run_on_gpu(c)
    want_o, want_s = reference(c)
    assert_close(o, want_o, "o vs reference")
    assert_close(s1, want_s, "new state vs reference")
    loop_o, loop_s = token_loop_on_gpu(c, monkeypatch)
    assert_close(o, loop_o, "o vs token loop")
    assert_close(s1, loop_s, "new state vs token loop")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("shape", EMU_SHAPES + [(0, 1, 2, 16, 8)],
                         ids=lambda s: "n{}-hk{}-hv{}-dk{}-dv{}".format(*s))
def test_gpu_odd_sizes_broadcast_gates_in_place(shape):
    """Odd head dims (padding rows, dead columns), per-token gate parameters, output over the state."""
    c = make_case(np.random.default_rng(sum(shape)), *shape, raw=True, l2_eps=1e-6, gate_shape="n,hv")
    o, s1 = run_on_gpu(c, inplace=True)
    want_o, want_s = reference(c)
    assert_close(o, want_o, "o")
    if shape[0] == 0:
        np.testing.assert_array_equal(s1, c["state"])
    assert_close(s1, want_s, "new state")
