"""Stacked and repacked weights kept on disk (backends/cpu/weight_cache.py): read back only for the same file
bytes and the same deriving code, and a model run from them computes exactly what a fresh one does."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _model_helpers import write_gguf
from graphir.backends.cpu import gemv_repacked, weight_cache
from graphir.models.presets import PRESETS, random_weights

import graphir
from graphir.quant import dequantize, quantize
from graphir.weights import Weight, Weights

ROWS, N_IN = 64, 128
CONCAT = ("concat0", ("param", "a"), ("param", "b"))
SOA = ("gemv_soa", "q8_0", "param", "a")  # as gemv_repacked.prepare builds it for a Param's own weight


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHIR_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_file(path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    blocks = [quantize(rng.standard_normal((ROWS, N_IN)).astype(np.float32), "q8_0") for _ in range(2)]
    path.write_bytes(b"".join(b.tobytes() for b in blocks))


def mapped(path) -> Weights:
    """Weights a and b: q8_0 [ROWS, N_IN] views of the file, as a GGUF load maps them."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    half = mm.size // 2
    return Weights({n: Weight("q8_0", (ROWS, N_IN), mm[i * half:(i + 1) * half].reshape(ROWS, -1))
                    for i, n in enumerate("ab")}, source=str(path))


def derive(w: Weights) -> dict:
    """What lowering puts into weights.derived for CONCAT and SOA, computed afresh."""
    return {CONCAT: np.concatenate([w["a"].data, w["b"].data]), SOA: gemv_repacked.repack(w["a"].data, "q8_0")}


def same(x, y) -> bool:
    xs, ys = (x, y) if isinstance(x, tuple) else ((x,), (y,))
    return all((a is None and b is None) or (a is not None and b is not None and a.shape == b.shape
                                              and a.tobytes() == b.tobytes()) for a, b in zip(xs, ys))


def stored(path) -> Weights:
    w = mapped(path)
    weight_cache.attach(w)
    for k, v in derive(w).items():
        w.derived[k] = v
    weight_cache.flush(w)  # as a Program does after binding
    return w


def from_disk(w: Weights, key) -> bool:
    """Whether `key` is in w.derived only once looked up on disk."""
    weight_cache.attach(w)
    return not dict.__contains__(w.derived, key) and key in w.derived


def test_a_later_process_reads_what_an_earlier_one_derived(tmp_path):
    write_file(tmp_path / "m.bin", 0)
    stored(tmp_path / "m.bin")
    w = mapped(tmp_path / "m.bin")  # another Weights of the same file, as a new process loads it
    fresh = derive(w)
    for key in (CONCAT, SOA):
        assert from_disk(w, key)
        assert same(w.derived[key], fresh[key])
    d, c, qs = w.derived[SOA]
    assert c is None and isinstance(qs.base, np.memmap) and qs.flags.writeable  # mapped, as numba's signature wants


def test_a_rewritten_file_is_never_served_stale(tmp_path):
    path = tmp_path / "m.bin"
    write_file(path, 0)
    stored(path)
    st = os.stat(path)
    write_file(path, 1)  # same size, other bytes, the old mtime put back
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    w = mapped(path)
    assert CONCAT not in w.derived and not from_disk(w, SOA)
    stored(path)  # the new identity's entries replace the old ones
    w = mapped(path)
    assert from_disk(w, CONCAT) and same(w.derived[CONCAT], derive(w)[CONCAT])
    assert len(list(weight_cache.cache_root().glob("*/*"))) == 1


def test_bytes_changed_under_an_unchanged_identity_are_caught(tmp_path, monkeypatch):
    path = tmp_path / "m.bin"
    monkeypatch.setattr(weight_cache, "identity", lambda p: [str(p), 0])  # an identity that cannot see the change
    write_file(path, 0)
    stored(path)
    write_file(path, 1)
    assert not from_disk(mapped(path), CONCAT)


def test_changed_deriving_code_misses(tmp_path, monkeypatch):
    write_file(tmp_path / "m.bin", 0)
    stored(tmp_path / "m.bin")
    monkeypatch.setattr(weight_cache, "code_hash", lambda: "edited")
    assert not from_disk(mapped(tmp_path / "m.bin"), SOA)
    stored(tmp_path / "m.bin")  # the edited code's entries replace the old code's
    assert len(list(weight_cache.cache_root().glob("*/*"))) == 1


def test_every_module_that_repacks_kept_weights_is_in_the_code_hash():
    """An edit to a module that derives kept weights must miss the entries it derived: each backends/cpu module
    defining a `repack` is hashed into the entries' key (code_hash), and the hash moves with its bytes."""
    from pathlib import Path

    here = Path(weight_cache.__file__).parent
    derivers = {p.name for p in here.glob("*.py") if "\ndef repack(" in p.read_text()}
    assert {"gemv_q8x.py", "gemv_repacked.py"} <= derivers <= set(weight_cache._CODE)


def segments() -> list:
    return sorted(weight_cache.cache_root().rglob("*.seg"))


@pytest.mark.parametrize("damage", ["truncated", "array bytes", "header", "magic", "empty"])
def test_a_corrupt_segment_is_derived_again_and_rewritten(tmp_path, damage):
    """A segment cut short, with overwritten array bytes, an unreadable header or no header: its entries miss (no
    exception), are derived afresh, and the next flush writes a segment that later processes read back whole."""
    write_file(tmp_path / "m.bin", 0)
    stored(tmp_path / "m.bin")
    (seg,) = segments()
    data = bytearray(seg.read_bytes())
    if damage == "truncated":
        data = data[:len(data) - 100]
    elif damage == "array bytes":
        data[-10:] = bytes(10)  # the last array's last bytes, where its digest samples
    elif damage == "header":
        data[len(weight_cache.MAGIC) + 12] ^= 0xFF
    elif damage == "magic":
        data[0] ^= 0xFF
    else:
        data = bytearray()
    seg.write_bytes(bytes(data))
    w = mapped(tmp_path / "m.bin")
    fresh = derive(w)
    weight_cache.attach(w)
    missed = [k for k in (CONCAT, SOA) if k not in w.derived]
    assert missed  # a truncated or zeroed tail misses the last entry at least; a bad header misses all
    for k in missed:
        w.derived[k] = fresh[k]
    weight_cache.flush(w)
    w = mapped(tmp_path / "m.bin")
    for key in (CONCAT, SOA):
        assert from_disk(w, key) and same(w.derived[key], fresh[key])


def test_one_segment_a_flush_and_only_new_entries_written(tmp_path):
    """A binding's entries go into one file; a later process that reads them back writes nothing, and one that
    derives a further entry writes that entry alone."""
    write_file(tmp_path / "m.bin", 0)
    w = mapped(tmp_path / "m.bin")
    weight_cache.attach(w)
    w.derived[CONCAT] = derive(w)[CONCAT]
    weight_cache.flush(w)
    assert len(segments()) == 1
    w = mapped(tmp_path / "m.bin")
    weight_cache.attach(w)
    assert CONCAT in w.derived and SOA not in w.derived
    weight_cache.flush(w)
    assert len(segments()) == 1  # nothing new
    w.derived[SOA] = derive(w)[SOA]
    weight_cache.flush(w)
    assert len(segments()) == 2
    w = mapped(tmp_path / "m.bin")
    assert from_disk(w, CONCAT) and from_disk(w, SOA)


def test_too_many_segments_are_cleared_before_the_next(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_cache, "MAX_SEGMENTS", 3)
    write_file(tmp_path / "m.bin", 0)
    for _ in range(5):
        stored(tmp_path / "m.bin")
    assert 1 <= len(segments()) <= 3
    assert from_disk(mapped(tmp_path / "m.bin"), SOA)


def test_kept_arrays_are_aligned_for_numba(tmp_path):
    write_file(tmp_path / "m.bin", 0)
    stored(tmp_path / "m.bin")
    w = mapped(tmp_path / "m.bin")
    weight_cache.attach(w)
    for a in (w.derived[CONCAT], *[x for x in w.derived[SOA] if x is not None]):
        assert a.flags.aligned and a.ctypes.data % weight_cache.ALIGN == 0


def test_weights_not_mapped_from_a_file_are_not_kept(tmp_path):
    w = mapped_in_memory = Weights({n: Weight("q8_0", (ROWS, N_IN), np.zeros((ROWS, 136), np.uint8)) for n in "ab"})
    weight_cache.attach(mapped_in_memory)
    w.derived[CONCAT] = np.zeros((2 * ROWS, 136), np.uint8)
    weight_cache.flush(w)
    assert not weight_cache.cache_root().exists()


def test_a_model_run_from_kept_weights_matches_a_fresh_one(tmp_path):
    config, _ = PRESETS["llama-tiny"]
    arrays = {n: dequantize(w.data, w.dtype, w.shape) for n, w in random_weights(config).items()}
    path = str(write_gguf(tmp_path / "tiny.gguf", config, arrays))
    ids = [3, 1, 4, 1, 5]

    def run() -> tuple[graphir.api.Model, np.ndarray]:
        m = graphir.load(path, backend="cpu")
        return m, np.concatenate([m.logits(ids), m.feed([9])])

    first, expected = run()
    assert not any(isinstance(getattr(v, "base", None), np.memmap) for v in first.weights.derived.values())
    second, got = run()  # a new load: its stacked weights come from disk
    kept = [v for v in second.weights.derived.values() if isinstance(getattr(v, "base", None), np.memmap)]
    assert kept and np.array_equal(got, expected)


def test_the_off_switch_neither_reads_nor_writes(tmp_path, cache_dir, monkeypatch):
    """GRAPHIR_NO_WEIGHT_CACHE=1: a process derives afresh although an earlier one stored the entry, and a
    process with the switch on stores nothing."""
    write_file(tmp_path / "m.bin", 0)
    stored(tmp_path / "m.bin")
    monkeypatch.setenv("GRAPHIR_NO_WEIGHT_CACHE", "1")
    assert not from_disk(mapped(tmp_path / "m.bin"), CONCAT)
    write_file(tmp_path / "n.bin", 1)
    before = sorted(p for p in cache_dir.rglob("*") if p.is_file())
    stored(tmp_path / "n.bin")
    assert sorted(p for p in cache_dir.rglob("*") if p.is_file()) == before
    monkeypatch.delenv("GRAPHIR_NO_WEIGHT_CACHE")
    assert from_disk(mapped(tmp_path / "m.bin"), CONCAT)  # the entry was there all along


def test_an_unwritable_cache_derives_every_time(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("GRAPHIR_CACHE_DIR", str(blocker))  # a file where the folder would go
    write_file(tmp_path / "m.bin", 0)
    stored(tmp_path / "m.bin")
    assert not from_disk(mapped(tmp_path / "m.bin"), CONCAT)
