"""A GGUF header kept on disk (models/gguf_cache.py): a later GGUFFile of the same bytes reads it back instead of
parsing, and gets exactly what a parse gives; a changed file, changed parsing code or a damaged entry parses
again (no exception, never a stale header) and writes a fresh entry."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _gguf_helpers import all_dtype_tensors, write_with_gguf_py
from graphir.models import gguf_cache, gguf_file
from graphir.models.gguf_file import GGUFFile


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHIR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GRAPHIR_NO_HEADER_CACHE", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def parses(monkeypatch) -> list:
    """The paths GGUFFile parsed (not read back from the cache), in order."""
    seen: list = []
    real = GGUFFile._parse

    def counting(self, mm):
        seen.append(self.path)
        return real(self, mm)

    monkeypatch.setattr(GGUFFile, "_parse", counting)
    return seen


def write(path, seed: int = 0):
    write_with_gguf_py(path, all_dtype_tensors(seed))
    return path


def same(a: GGUFFile, b: GGUFFile) -> bool:
    def meta(g):
        return {k: (v.dtype.str, v.tolist()) if isinstance(v, np.ndarray) else (type(v), v) for k, v in
                g.metadata.items()}

    return (a.version, a.alignment, a.data_offset, a.file_size, a.tensors, list(a.metadata)) == \
        (b.version, b.alignment, b.data_offset, b.file_size, b.tensors, list(b.metadata)) and meta(a) == meta(b)


def entries(cache_dir) -> list:
    return sorted((cache_dir / "gguf").glob("*.pkl"))


def test_a_later_open_reads_the_kept_header(tmp_path, parses, cache_dir):
    path = write(tmp_path / "m.gguf")
    first = GGUFFile(path)
    second = GGUFFile(path)
    assert parses == [path] and len(entries(cache_dir)) == 1
    assert same(first, second)
    for t in first.tensors.values():  # tensor data mapped from the same offsets
        assert np.array_equal(first.weights()[t.name].data, second.weights()[t.name].data)


def test_a_rewritten_file_is_parsed_again(tmp_path, parses):
    path = write(tmp_path / "m.gguf")
    GGUFFile(path)
    st = os.stat(path)
    write(path, seed=1)  # other tensor bytes, same header size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = GGUFFile(path)
    assert parses == [path, path] and same(again, GGUFFile(path))
    assert len(parses) == 2  # the rewritten file's entry replaced the old one


def test_header_bytes_changed_under_an_unchanged_identity_are_caught(tmp_path, parses, monkeypatch):
    path = write(tmp_path / "m.gguf")
    monkeypatch.setattr(gguf_cache, "identity", lambda p: [str(p), 0])  # an identity blind to the change
    GGUFFile(path)
    data = bytearray(path.read_bytes())
    i = data.index(b"hello")  # in a metadata string array
    data[i:i + 5] = b"jello"
    path.write_bytes(bytes(data))
    g = GGUFFile(path)
    assert len(parses) == 2 and g.metadata["a.str"][2] == "Ġjello"


def test_changed_parsing_code_misses(tmp_path, parses, monkeypatch):
    path = write(tmp_path / "m.gguf")
    GGUFFile(path)
    monkeypatch.setattr(gguf_cache, "code_hash", lambda: "edited")
    GGUFFile(path)
    assert len(parses) == 2


def test_the_parsing_modules_are_in_the_code_hash():
    from pathlib import Path

    import graphir.dtypes

    hashed = {Path(gguf_file.__file__), Path(gguf_cache.__file__), Path(graphir.dtypes.__file__)}
    assert all(p.is_file() for p in hashed)
    h = gguf_cache.code_hash()
    gguf_cache.code_hash.cache_clear()
    assert gguf_cache.code_hash() == h


@pytest.mark.parametrize("damage", ["truncated", "payload byte", "digest byte", "magic", "empty", "not a pickle"])
def test_a_damaged_entry_is_parsed_again_and_rewritten(tmp_path, parses, cache_dir, damage):
    path = write(tmp_path / "m.gguf")
    fresh = GGUFFile(path)
    (entry,) = entries(cache_dir)
    data = bytearray(entry.read_bytes())
    head = len(gguf_cache.MAGIC)
    if damage == "truncated":
        data = data[:len(data) // 2]
    elif damage == "payload byte":
        data[-20] ^= 0x01
    elif damage == "digest byte":
        data[head] ^= 0x01
    elif damage == "magic":
        data[0] ^= 0x01
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(gguf_cache.MAGIC + bytes(32) + b"garbage")
    entry.write_bytes(bytes(data))
    again = GGUFFile(path)
    assert len(parses) == 2 and same(again, fresh)
    GGUFFile(path)  # the rewritten entry is read back
    assert len(parses) == 2


def test_the_off_switch_neither_reads_nor_writes(tmp_path, parses, cache_dir, monkeypatch):
    path = write(tmp_path / "m.gguf")
    GGUFFile(path)
    monkeypatch.setenv("GRAPHIR_NO_HEADER_CACHE", "1")
    GGUFFile(path)
    other = write(tmp_path / "n.gguf", seed=1)
    GGUFFile(other)
    assert len(parses) == 3 and len(entries(cache_dir)) == 1


def test_an_unwritable_cache_parses_every_time(tmp_path, parses, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("GRAPHIR_CACHE_DIR", str(blocker))  # a file where the folder would go
    path = write(tmp_path / "m.gguf")
    a, b = GGUFFile(path), GGUFFile(path)
    assert len(parses) == 2 and same(a, b)
