"""models.gguf_file against gguf-py's GGUFReader, plus malformed files that must raise LoadError."""

from __future__ import annotations

import struct
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from _gguf_helpers import ARRAYS, METADATA, all_dtype_tensors, build_gguf, small_raw_gguf, write_with_gguf_py
from graphir.models.default_model import smollm2_path
from graphir.models.gguf_file import GGUFFile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphir.dtypes import BY_GGML_ID
from graphir.errors import LoadError


def reader_metadata(r: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def assert_same_as_reader(path: Path) -> GGUFFile:
    g = GGUFFile(path)
    r = gguf.GGUFReader(path)
    ref = reader_metadata(r)
    assert list(g.metadata) == list(ref)
    for k, want in ref.items():
        got = g.metadata[k]
        if isinstance(got, np.ndarray):
            assert got.tolist() == want, k
        else:
            assert got == want and type(got) is type(want), k
    assert list(g.tensors) == [t.name for t in r.tensors]
    w = g.weights()
    for rt in r.tensors:
        t = g.tensors[rt.name]
        assert t.dtype == BY_GGML_ID[int(rt.tensor_type)].name
        assert t.shape == tuple(reversed(rt.shape.tolist()))
        assert t.offset == rt.data_offset and t.nbytes == rt.n_bytes
        data = w[rt.name].data
        assert isinstance(data, np.memmap)
        assert data.tobytes() == np.asarray(rt.data).tobytes(), rt.name
    return g


def test_smollm2_matches_gguf_py() -> None:
    path = smollm2_path()
    t0 = time.perf_counter()
    g = GGUFFile(path)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, f"opening SmolLM2's header took {elapsed:.2f} s"
    assert g.metadata["tokenizer.ggml.pre"] == "smollm" and len(g.metadata["tokenizer.ggml.tokens"]) == 49152
    assert g.tensors["token_embd.weight"].dtype == "q8_0"
    assert g.tensors["token_embd.weight"].shape == (49152, 576)
    assert_same_as_reader(path)


@pytest.mark.parametrize("alignment", [None, 64])
def test_all_dtypes_match_gguf_py(tmp_path: Path, alignment: int | None) -> None:
    tensors = all_dtype_tensors()
    path = tmp_path / "all.gguf"
    write_with_gguf_py(path, tensors, alignment)
    g = assert_same_as_reader(path)
    assert g.alignment == (alignment or 32)
    for key, (val, _) in METADATA.items():
        assert g.metadata[key] == pytest.approx(val) if isinstance(val, float) else g.metadata[key] == val
    assert g.metadata["a.str"] == ARRAYS["a.str"]
    assert g.metadata["a.bool"].dtype == np.bool_ and g.metadata["a.bool"].tolist() == ARRAYS["a.bool"]
    w = g.weights()
    for name in ("f32_1d", "f32_4d", "f16", "i32"):
        np.testing.assert_array_equal(w[name].data, tensors[name][0])
        assert w[name].data.dtype == tensors[name][0].dtype and w[name].shape == tensors[name][0].shape
    assert w["bf16"].dtype == "bf16" and w["bf16"].data.dtype == np.uint16 and w["bf16"].shape == (3, 8)
    assert w["q4_1"].shape == (4, 64) and w["q4_1"].data.shape == (4, 2 * 20) and w["q4_1"].data.dtype == np.uint8
    assert w["q6_k"].shape == (3, 512) and w["q6_k"].data.shape == (3, 2 * 210)


def test_nested_arrays_and_raw_builder(tmp_path: Path) -> None:
    path = tmp_path / "raw.gguf"
    path.write_bytes(small_raw_gguf())
    g = GGUFFile(path)
    assert g.metadata["toks"] == ["a", "bc", "Ġd"]
    assert [a.tolist() for a in g.metadata["nested"]] == [[1, 2], [3]]
    w = g.weights()
    np.testing.assert_array_equal(w["w"].data, np.arange(8, dtype=np.float32).reshape(2, 4))
    assert w["q"].data.tobytes() == bytes(range(34)) and w["q"].shape == (1, 32)


# ---- malformed files ----


def load_bytes(tmp_path: Path, blob: bytes, name: str = "bad.gguf") -> GGUFFile:
    path = tmp_path / name
    path.write_bytes(blob)
    return GGUFFile(path)


def expect_error(tmp_path: Path, blob: bytes, *fragments: str) -> str:
    with pytest.raises(LoadError) as e:
        load_bytes(tmp_path, blob)
    msg = str(e.value)
    assert "bad.gguf" in msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


F32_2 = ("w", [2], 0, b"\0" * 8)


def test_missing_and_empty(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match="cannot read"):
        GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(LoadError, match="cannot read"):
        GGUFFile(tmp_path)
    expect_error(tmp_path, b"", "empty file")
    expect_error(tmp_path, b"GG", "truncated: file size is 2, too short for the magic")
    expect_error(tmp_path, b"GX", "not a GGUF file: 2 bytes")


def test_bad_magic_and_version(tmp_path: Path) -> None:
    expect_error(tmp_path, build_gguf([], [F32_2], magic=b"GGML"), "magic")
    expect_error(tmp_path, build_gguf([], [F32_2], version=1), "unsupported GGUF version 1")
    expect_error(tmp_path, build_gguf([], [F32_2], version=4), "unsupported GGUF version 4")
    expect_error(tmp_path, build_gguf([], [F32_2], version=3 << 24), "big-endian")
    assert load_bytes(tmp_path, build_gguf([], [F32_2], version=2)).version == 2


def test_truncated_everywhere(tmp_path: Path) -> None:
    blob = small_raw_gguf()
    path = tmp_path / "bad.gguf"
    for n in range(1, len(blob) - (-34 % 32)):  # the last tensor is 34 bytes, then padding that may go
        path.write_bytes(blob[:n])
        with pytest.raises(LoadError, match=f"bad.gguf: truncated.*file size is {n}"):
            GGUFFile(path)
    header_end = blob.index(np.arange(8, dtype=np.float32).tobytes())
    expect_error(tmp_path, blob[: header_end + 4], "truncated", "tensor 'w' data", "extends past end of file")
    expect_error(tmp_path, b"", "empty file", "not a GGUF file")


def test_tensor_rules(tmp_path: Path) -> None:
    expect_error(tmp_path, build_gguf([], [("w", [2], 77, b"")]), "unknown ggml type id 77")
    expect_error(tmp_path, build_gguf([], [("w", [32], 10, b"")]), "Q2_K", "not supported")
    expect_error(tmp_path, build_gguf([], [("w", [1] * 5, 0, b"\0" * 4)]), "5 dims")
    expect_error(tmp_path, build_gguf([], [("w", [16], 8, b"\0" * 34)]), "not a multiple of q8_0's block 32")
    expect_error(tmp_path, build_gguf([], [("w", [2**40, 2**40], 0, b"")]), "more than the file")
    expect_error(tmp_path, build_gguf([], [F32_2, F32_2]), "duplicate tensor name 'w'")
    # An offset that is not aligned: patch the second tensor's offset from 32 to 36.
    blob = bytearray(build_gguf([], [F32_2, ("v", [2], 0, b"\0" * 8)]))
    pos = blob.index(struct.pack("<Q", 32), 24)
    blob[pos : pos + 8] = struct.pack("<Q", 36)
    expect_error(tmp_path, bytes(blob), "offset 36 is not a multiple of the alignment 32")


def test_metadata_rules(tmp_path: Path) -> None:
    expect_error(tmp_path, build_gguf([("k", 4, 1), ("k", 4, 2)], []), "duplicate metadata key 'k'")
    expect_error(tmp_path, build_gguf([("k", 13, 0)], []), "unknown value type 13")
    expect_error(tmp_path, build_gguf([("k", 8, b"\xff\xfe")], []), "'k' is not valid UTF-8")
    expect_error(tmp_path, build_gguf([("k", 9, (8, [b"ok", b"\xc3"]))], []), "'k'[1] is not valid UTF-8")
    expect_error(tmp_path, build_gguf([("general.alignment", 4, 0)], []), "power of two")
    expect_error(tmp_path, build_gguf([("general.alignment", 4, 48)], []), "power of two")
    expect_error(tmp_path, build_gguf([("general.alignment", 8, "32")], []), "power of two")
    nested = (5, [1])
    for _ in range(10):
        nested = (9, [nested])
    expect_error(tmp_path, build_gguf([("k", 9, nested)], []), "nested deeper")


@pytest.mark.parametrize(
    "what, patch",
    [
        ("tensor count", lambda b: b[:8] + struct.pack("<Q", 2**62) + b[16:]),
        ("metadata key/value count", lambda b: b[:16] + struct.pack("<Q", 2**64 - 1) + b[24:]),
        ("key #0 length 9223372036854775808", lambda b: b[:24] + struct.pack("<Q", 2**63) + b[32:]),
    ],
)
def test_absurd_counts_fail_fast(tmp_path: Path, what: str, patch) -> None:
    blob = patch(small_raw_gguf())
    t0 = time.perf_counter()
    expect_error(tmp_path, blob, what)
    assert time.perf_counter() - t0 < 0.5


def test_absurd_array_length(tmp_path: Path) -> None:
    blob = bytearray(build_gguf([("k", 9, (8, ["x"]))], []))
    pos = blob.index(struct.pack("<IQ", 8, 1))  # element type STRING, count 1
    blob[pos + 4 : pos + 12] = struct.pack("<Q", 2**60)
    expect_error(tmp_path, bytes(blob), "element count 1152921504606846976 needs at least")


@settings(max_examples=200, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_only_load_error(data: st.DataObject) -> None:
    blob = bytearray(small_raw_gguf())
    for _ in range(data.draw(st.integers(1, 8), label="n_edits")):
        kind = data.draw(st.sampled_from(["set", "flip", "truncate", "insert"]))
        pos = data.draw(st.integers(0, len(blob) - 1))
        if kind == "set":
            blob[pos] = data.draw(st.integers(0, 255))
        elif kind == "flip":
            blob[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "truncate":
            del blob[pos:]
        else:
            blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
        if not blob:
            break
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzz.gguf"
        path.write_bytes(bytes(blob))
        try:
            g = GGUFFile(path)
        except LoadError:
            return
        for w in g.weights().values():
            w.data.tobytes()
