"""models.hf_dir against files written by the `safetensors` package, plus broken directories."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from graphir.models.hf_dir import load_hf_dir, read_safetensors
from safetensors.numpy import save_file
from safetensors.torch import save_file as save_torch

from graphir.errors import LoadError

CONFIG = {"model_type": "llama", "hidden_size": 8, "eos_token_id": [2, 7]}


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((5, 8)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(8).astype(np.float16),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "ids": np.arange(6, dtype=np.int32).reshape(2, 3),
        "scalar": np.array(1.25, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def make_dir(root: Path, config: dict | None = CONFIG) -> Path:
    root.mkdir(exist_ok=True)
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    return root


def test_single_file(tmp_path: Path) -> None:
    root = make_dir(tmp_path / "m")
    want = tensors()
    save_file(want, str(root / "model.safetensors"), metadata={"format": "pt"})
    config, w = load_hf_dir(root)
    assert config == CONFIG
    assert set(w) == set(want)
    for name, arr in want.items():
        assert w[name].shape == arr.shape
        assert w[name].data.dtype == arr.dtype
        np.testing.assert_array_equal(w[name].data, arr)
    assert w["model.norm.weight"].dtype == "f16" and w["ids"].dtype == "i32"
    assert isinstance(w["model.embed_tokens.weight"].data, np.memmap)


def test_bf16_and_i64(tmp_path: Path) -> None:
    root = make_dir(tmp_path / "m")
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    ids = torch.tensor([[1, -2, 3]], dtype=torch.int64)
    save_torch({"x": x, "ids": ids}, str(root / "model.safetensors"))
    _, w = load_hf_dir(root)
    assert w["x"].dtype == "bf16" and w["x"].data.dtype == np.uint16 and w["x"].shape == (3, 4)
    np.testing.assert_array_equal(w["x"].data, x.view(torch.int16).numpy().view(np.uint16))
    assert w["ids"].dtype == "i32" and w["ids"].data.dtype == np.int32
    np.testing.assert_array_equal(w["ids"].data, [[1, -2, 3]])
    save_torch({"big": torch.tensor([2**40])}, str(root / "model.safetensors"))
    with pytest.raises(LoadError, match="'big': I64 values do not fit in int32"):
        load_hf_dir(root)


def write_sharded(root: Path) -> dict[str, np.ndarray]:
    want = tensors()
    names = list(want)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: want[k] for k in keys}, str(root / shard))
        weight_map.update({k: shard for k in keys})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return want


def test_sharded(tmp_path: Path) -> None:
    root = make_dir(tmp_path / "m")
    want = write_sharded(root)
    _, w = load_hf_dir(root)
    assert set(w) == set(want)
    for name, arr in want.items():
        np.testing.assert_array_equal(w[name].data, arr)


def test_sharded_errors(tmp_path: Path) -> None:
    root = make_dir(tmp_path / "m")
    write_sharded(root)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost"] = "model-00002-of-00002.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(LoadError, match="model-00002-of-00002.safetensors: tensor 'ghost' listed in"):
        load_hf_dir(root)
    index["weight_map"]["ghost"] = "model-00003-of-00002.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(LoadError, match="model-00003-of-00002.safetensors: shard listed in .* is missing"):
        load_hf_dir(root)
    index["weight_map"]["ghost"] = "../evil.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(LoadError, match="not a plain file name"):
        load_hf_dir(root)
    (root / "model.safetensors.index.json").write_text('{"weight_map": [1]}')
    with pytest.raises(LoadError, match="weight_map"):
        load_hf_dir(root)


def test_missing_things(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match="not a directory"):
        load_hf_dir(tmp_path / "nope")
    root = make_dir(tmp_path / "m", config=None)
    with pytest.raises(LoadError, match="config.json: file not found"):
        load_hf_dir(root)
    (root / "config.json").write_text("{bad json")
    with pytest.raises(LoadError, match="config.json: invalid JSON"):
        load_hf_dir(root)
    (root / "config.json").write_text("[" * 100_000)
    with pytest.raises(LoadError, match="config.json: invalid JSON"):
        load_hf_dir(root)
    (root / "config.json").write_text("[]")
    with pytest.raises(LoadError, match="expected a JSON object"):
        load_hf_dir(root)
    (root / "config.json").write_text("{}")
    with pytest.raises(LoadError, match="no model.safetensors"):
        load_hf_dir(root)


def raw_safetensors(header: object, data: bytes = b"", n: int | None = None) -> bytes:
    h = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(h) if n is None else n) + h + data


F32_ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "blob, message",
    [
        (b"", "too short for the 8-byte header length"),
        (b"\x01\x02\x03", "too short"),
        (raw_safetensors({"w": F32_ENTRY}, b"\0" * 8, n=10**6), "header length 1000000 extends past end of file"),
        (raw_safetensors(b"{nope", b""), "header is not valid JSON"),
        (raw_safetensors(b"\xff\xfe", b""), "header is not valid JSON"),
        (raw_safetensors([1, 2]), "header must be a JSON object"),
        (raw_safetensors({"w": F32_ENTRY}, b"\0" * 4), r"tensor 'w': data \[\d+, \d+\) extends past end of file"),
        (raw_safetensors({"w": {**F32_ENTRY, "dtype": "F8_E4M3"}}, b"\0" * 8), "'w': dtype 'F8_E4M3' is not supported"),
        (raw_safetensors({"w": {**F32_ENTRY, "shape": [3]}}, b"\0" * 8), "'w': data_offsets .* needs 12"),
        (raw_safetensors({"w": {**F32_ENTRY, "shape": [-2]}}, b"\0" * 8), "'w': shape"),
        (raw_safetensors({"w": {**F32_ENTRY, "shape": [True, 2]}}, b"\0" * 8), "'w': shape"),
        (raw_safetensors({"w": {**F32_ENTRY, "data_offsets": [8, 0]}}, b"\0" * 8), "'w': data_offsets"),
        (raw_safetensors({"w": {**F32_ENTRY, "data_offsets": "x"}}, b"\0" * 8), "'w': data_offsets"),
        (raw_safetensors({"w": [1]}, b"\0" * 8), "'w': entry must be an object"),
        (raw_safetensors({"w": {**F32_ENTRY, "shape": [2**62, 2**62]}}, b""), "'w': data_offsets"),
    ],
)
def test_corrupt_safetensors(tmp_path: Path, blob: bytes, message: str) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    with pytest.raises(LoadError, match=message) as e:
        read_safetensors(path)
    assert str(path) in str(e.value)
    make_dir(tmp_path)
    with pytest.raises(LoadError, match=message):
        load_hf_dir(tmp_path)


def test_truncated_everywhere(tmp_path: Path) -> None:
    save_file(tensors(), str(tmp_path / "full.safetensors"))
    blob = (tmp_path / "full.safetensors").read_bytes()
    path = tmp_path / "cut.safetensors"
    for n in range(len(blob)):
        path.write_bytes(blob[:n])
        with pytest.raises(LoadError, match="cut.safetensors"):
            read_safetensors(path)
