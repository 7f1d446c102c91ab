"""`graphir.bench` and `graphir bench`: every number is there, positive and finite.

No timing assertions: how fast things are belongs in BENCHMARKS.md, not in tests.
"""

from __future__ import annotations

import functools
import io
import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

import graphir
from graphir import bench as bench_mod
from graphir.bench import NUMBERS, bench, checked_lengths, decode_weight_bytes, token_ids
from graphir.cli import main

TINY = dict(prefill_tokens=16, prompt_tokens=8, decode_tokens=8)


def _check_numbers(result: dict) -> None:
    missing = [k for k in NUMBERS if k not in result]
    assert not missing, f"missing keys {missing}"
    for k in NUMBERS:
        v = result[k]
        assert isinstance(v, (int, float)) and not isinstance(v, bool), (k, v)
        assert math.isfinite(v) and v > 0, (k, v)


def test_bench_returns_every_number() -> None:
    r = bench("random:llama-tiny", repeats=2, bandwidth_mb=16, **TINY)
    _check_numbers(r)
    assert r["programs"] >= 2  # a prefill and the decode Program at least
    assert r["machine"]["cores"] >= 1 and r["machine"]["numba_threads"] >= 1 and r["machine"]["cpu"]
    assert r["date"] and r["backend"] == "cpu" and r["passes"] == "cpu"  # passes "auto": the cpu's pipeline
    assert r["pipeline"] == "default,q16-activations{max_rows=16}"
    assert r["llama_cpp"] is None and "not a GGUF file" in r["llama_cpp_note"]
    assert r["decode_fraction_of_limit"] == pytest.approx(r["decode_tok_s_best"] / r["bandwidth_limit_tok_s"])
    json.dumps(r)  # everything in it is JSON-ready


def test_bench_records_the_cpu_threads_and_gives_a_cpu_peer_the_same(monkeypatch) -> None:
    """The cpu backend's thread setting is in the result and the table, and a CPU peer (llama.cpp) runs with
    graphir's fixed count, else numba's pool, never a fixed 2."""
    from graphir.backends.cpu import threads

    asked = []
    monkeypatch.setattr(bench_mod, "_maybe_llama_cpp",
                        lambda source, prefill, prompt, n, repeats, t: (asked.append(t), (None, "stub"))[1])
    monkeypatch.setattr(threads, "_fixed", 1)
    r = bench("random:llama-tiny", repeats=2, bandwidth_mb=16, **TINY)
    assert r["cpu_threads"] == "1 (fixed)" and asked == [1]
    buf = io.StringIO()
    bench_mod.render(r, None, file=buf, plain=True)
    assert "cpu backend threads: 1 (fixed)" in buf.getvalue()
    monkeypatch.setattr(threads, "_fixed", None)
    r = bench("random:llama-tiny", repeats=3, bandwidth_mb=16, **TINY)
    picked = r["cpu_threads"].removeprefix("auto: ").split(", ")
    assert r["cpu_threads"].startswith("auto: ") and len(picked) == 3, r["cpu_threads"]
    assert all(1 <= int(n) <= threads.pool_size() for n in picked)
    assert asked == [1, threads.pool_size()]


def test_plain_table_has_a_llama_cpp_column_when_it_ran() -> None:
    r = {k: 1.5 for k in NUMBERS} | {
        "machine": bench_mod.machine(), "date": "2026-01-01T00:00:00+00:00", "source": "m.gguf", "backend": "cpu",
        "passes": "", "prefill_tokens": 512, "prompt_tokens": 128, "decode_tokens": 256, "repeats": 3,
        "llama_cpp": {k: 2.5 for k in ("load_s", "decode_tok_s_best")}, "llama_cpp_note": "llama-cpp-python x"}
    buf = io.StringIO()
    bench_mod.render(r, "graphir bench m.gguf", file=buf, plain=True)
    lines = buf.getvalue().splitlines()
    assert lines[2] == "command: graphir bench m.gguf" and "passes (none)" in lines[3]
    assert lines[4].split() == ["metric", "graphir", "llama.cpp", "(same", "run)"]
    decode = next(line for line in lines if line.startswith("decode tok/s, best"))
    assert decode.split()[-2:] == ["1.5", "2.5"]
    assert lines[-1] == "llama-cpp-python x"


def test_bench_rejects_sizes_past_the_context() -> None:
    with pytest.raises(ValueError, match="context"):
        bench("random:llama-tiny", prefill_tokens=4096, prompt_tokens=8, decode_tokens=8, bandwidth_mb=1)
    with pytest.raises(ValueError, match="decode_tokens"):
        bench("random:llama-tiny", prefill_tokens=8, prompt_tokens=8, decode_tokens=0)
    # asked for, a long prefill past the context is refused as the other sizes are (it was dropped without a word:
    # no row, no note); only the gpu's default 4096 is skipped where it does not fit
    with pytest.raises(ValueError, match="long prefill 300 exceeds the model's context of 256"):
        bench("random:llama-tiny", long_prefill_tokens=300, bandwidth_mb=1, **TINY)
    assert checked_lengths(256, 8, 8, 8, None, on_gpu=True) == 0


def test_a_converted_gguf_is_not_compared_with_llama_cpp_on_the_file(tmp_path, monkeypatch) -> None:
    """--dtype q8_0 on a GGUF: graphir runs the converted weights, llama.cpp would run the file as stored, and the
    table's 'x llama.cpp' ratios compared two different models. The comparison is skipped, with a note."""
    from _model_helpers import write_gguf
    from test_api_errors import TINY as CONFIG
    from test_api_errors import tiny_arrays

    asked = []
    monkeypatch.setattr(bench_mod, "_maybe_llama_cpp", lambda *args: (asked.append(args), ({}, ""))[1])
    path = write_gguf(tmp_path / "m.gguf", CONFIG, tiny_arrays())
    r = bench(str(path), repeats=1, bandwidth_mb=1, dtype="q8_0", **TINY)
    assert asked == [] and r["llama_cpp"] is None and "--dtype q8_0" in r["llama_cpp_note"]


def test_weight_bytes_count_a_tied_head_once_and_an_untied_embedding_as_one_row() -> None:
    tied = graphir.load("random:qwen3-tiny")
    assert tied.config.tied_embeddings and "output.weight" not in tied.weights
    assert decode_weight_bytes(tied) == tied.weights.nbytes
    untied = graphir.load("random:llama-tiny")
    emb = untied.weights["token_embd.weight"]
    assert decode_weight_bytes(untied) == untied.weights.nbytes - emb.nbytes + emb.nbytes // emb.shape[0]


def test_token_ids_are_deterministic_and_in_the_vocabulary() -> None:
    model = graphir.load("random:llama-tiny")
    ids = token_ids(model, 300)
    assert len(ids) == 300 and ids == token_ids(model, 300)
    assert all(0 <= i < model.config.n_vocab for i in ids)


def test_cli_prints_the_table_and_writes_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_mod, "measure_bandwidth", functools.partial(bench_mod.measure_bandwidth, 16))
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(main, ["bench", "random:llama-tiny", "--prefill", "16", "--prompt", "8", "--decode", "8",
                                  "--repeats", "1", "--json", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    for text in ("machine:", "numba threads", "date:", "command: graphir bench random:llama-tiny", "decode tok/s",
                 "prefill tok/s", "TTFT", "peak RSS", "bandwidth-limit tok/s"):
        assert text in r.stdout, text
    data = json.loads(out.read_text())
    _check_numbers(data)
    assert data["command"].startswith("graphir bench random:llama-tiny --backend cpu")
    assert data["machine"]["numba_threads"] >= 1


def test_cli_bench_reports_bad_sizes_as_an_error() -> None:
    r = CliRunner().invoke(main, ["bench", "random:llama-tiny", "--prefill", "4096"])
    assert r.exit_code == 1 and "error:" in r.stderr and "context" in r.stderr


def test_bench_dtype_converts_the_weights_it_measures() -> None:
    """--dtype q8_0: the model measured is the quantized one (34 bytes a block of 32 weights, against 128 in
    f32), and the command line it reports says so; a name that is no weight type is a one-line error."""
    f32 = bench("random:llama-tiny", repeats=1, bandwidth_mb=16, llama_cpp=False, **TINY)
    q8 = bench("random:llama-tiny", repeats=1, bandwidth_mb=16, llama_cpp=False, dtype="q8_0", **TINY)
    _check_numbers(q8)
    assert q8["weight_bytes"] < 0.5 * f32["weight_bytes"]
    r = CliRunner().invoke(main, ["bench", "random:llama-tiny", "--dtype", "q8_0", "--prefill", "16", "--prompt", "8",
                                  "--decode", "4", "--repeats", "1", "--no-llama-cpp"])
    assert r.exit_code == 0, r.output
    assert "--dtype q8_0" in r.stdout
    bad = CliRunner().invoke(main, ["bench", "random:llama-tiny", "--dtype", "q9_9", "--no-llama-cpp"])
    assert bad.exit_code == 2 and "error:" in bad.stderr and "q9_9" in bad.stderr  # a bad option, before loading


def test_state_bytes_are_every_deltanet_layers_conv_window_and_state_read_and_written() -> None:
    """decode_state_bytes against the config: a Gated DeltaNet layer (every layer but each 4th) holds a conv
    window [K-1, conv_dim] and a delta state [hv, dk, dv] in f32, each read and written once a token; an
    attention-only model holds none."""
    model = graphir.load("random:qwen35-tiny", backend="reference")
    c = model.config
    layers = sum((i + 1) % c.full_attn_interval != 0 for i in range(c.n_layers))
    conv_dim = 2 * c.ssm_k_heads * c.ssm_k_dim + c.ssm_v_heads * c.ssm_v_dim
    per_layer = (c.ssm_conv_kernel - 1) * conv_dim + c.ssm_v_heads * c.ssm_k_dim * c.ssm_v_dim
    assert layers == 3 and bench_mod.decode_state_bytes(model) == 2 * 4 * layers * per_layer
    assert bench_mod.decode_state_bytes(graphir.load("random:llama-tiny", backend="reference")) == 0


def test_deltanet_kernels_are_the_recurrent_sources_and_the_gated_norm() -> None:
    """kernel_times.is_deltanet_kernel, which `graphir bench` sums for the DeltaNet share, against the kernel
    names the .cu sources define: every kernel of recurrent.cu and delta_chunked.cu and norm.cu's gated norm,
    no other norm kernel and none of the GEMVs' (a renamed kernel fails here, not silently in the bench)."""
    import re

    from graphir.backends.gpu import kernels
    from graphir.backends.gpu.kernel_times import is_deltanet_kernel

    def names(source: str) -> list[str]:
        text = (kernels.KERNEL_DIR / source).read_text()
        heads = [text[m.end():text.index("{", m.end())] for m in re.finditer(r"__global__", text)]
        return [re.findall(r"([\w#]+)\s*\(", h)[-1].split("##")[0] for h in heads]

    mine = names("recurrent.cu") + names("delta_chunked.cu")
    assert len(mine) >= 8 and all(is_deltanet_kernel(n) for n in mine), mine
    others = names("norm.cu") + names("matmul.cu") + names("attention.cu") + names("rope.cu")
    assert [n for n in others if is_deltanet_kernel(n)] == ["rms_norm_mul_gate_f32"]


def test_deltanet_step_times_are_split_into_all_state_and_total(monkeypatch) -> None:
    """bench's DeltaNet numbers from the per-step device times (kernel_times.step_times, faked here: it needs a
    GPU): the DeltaNet kernels (conv, delta rule, chunked prefill, gated norm) against every step, and the
    State-moving ones (conv, delta rule) on their own; nothing where the decode step is not captured."""
    from graphir.backends.gpu import kernel_times

    times = [("gemv1v2_bf16_g128r1", 4.0), ("ssm_conv_silu_k4", 0.5), ("gated_delta_net_raw_step_d128", 2.0),
             ("rms_norm_mul_gate_f32", 0.25), ("add_rms_norm_mul_v4_f32", 1.0), ("gdn_chunk_scan_d128", 0.125)]
    monkeypatch.setattr(kernel_times, "step_times", lambda program: times)

    class FakeModel:
        def __init__(self, captured: bool):
            self.program = type("P", (), {"captured": captured})()

        def _program(self, n, last_only, sampler):
            return self.program

    assert bench_mod._deltanet_kernel_s(FakeModel(True)) == (2.875, 2.5, 7.875)
    assert bench_mod._deltanet_kernel_s(FakeModel(False)) is None
