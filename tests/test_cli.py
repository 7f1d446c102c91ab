"""The `graphir` command line, through click's CliRunner (no subprocesses, so it stays fast)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import graphir
from graphir import Graph, LoadError, g
from graphir.cli import main
from graphir.dump import dump_text, load_json
from graphir.examples import build_example


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_help_lists_commands() -> None:
    r = invoke("--help")
    assert r.exit_code == 0
    for cmd in ("dump", "run", "passes", "check", "coverage"):
        assert cmd in r.stdout
    assert "--layers" in invoke("dump", "--help").stdout
    assert "--top-p" in invoke("run", "--help").stdout


def test_passes_lists_the_registry() -> None:
    from graphir.passes import PASSES, pipelines

    lines = invoke("passes").stdout.splitlines()
    width = max(map(len, PASSES))
    assert lines[:len(PASSES)] == [f"{name:<{width}}  {p.description}" for name, p in PASSES.items()]
    assert f"default = {', '.join(pipelines()['default'])}" in lines


@pytest.mark.parametrize("fmt, marker", [("text", '"blk.0.attn_norm"'), ("dot", "digraph graphir {"),
                                         ("json", '"nodes": ['), ("html", "<!DOCTYPE html>")])
def test_dump_formats_to_stdout(fmt: str, marker: str) -> None:
    r = invoke("dump", "example", "--format", fmt)
    assert r.exit_code == 0, r.output
    assert marker in r.stdout


@pytest.mark.parametrize("ext, marker", [(".txt", "%0 = param"), (".dot", "digraph"), (".json", '"outputs"'),
                                         (".html", 'id="graph-json"')])
def test_dump_to_file_infers_format(tmp_path: Path, ext: str, marker: str) -> None:
    out = tmp_path / f"graph{ext}"
    r = invoke("dump", "example", "-o", str(out))
    assert r.exit_code == 0
    assert r.stdout == "" and f"wrote {out}" in r.stderr
    assert marker in out.read_text()


def test_dump_json_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "decode.json"
    assert invoke("dump", "example", "--phase", "decode", "--format", "json", "-o", str(path)).exit_code == 0
    assert load_json(path.read_text()) == build_example("decode")
    r = invoke("dump", str(path))
    assert r.stdout == dump_text(build_example("decode"))


def test_dump_verify_past_the_context_names_the_longest_draft(tmp_path: Path) -> None:
    """A verify graph of --draft-len 15 is 16 rows: past a context of 8 it was min()'s ValueError traceback."""
    from test_api_errors import hf_dir

    d = hf_dir(tmp_path, max_position_embeddings=8)
    one_line_error(invoke("dump", str(d), "--phase", "verify", "--draft-len", "15"), 1,
                   "--draft-len 15", "context of 8 tokens", "--draft-len 7", alone=False)
    assert invoke("dump", str(d), "--phase", "verify", "--draft-len", "7").exit_code == 0


def test_a_graph_files_phase_is_its_own(tmp_path: Path) -> None:
    """--phase of dump and coverage builds a model's graph; on a graph file holding another phase it printed the
    file's graph without a word. The file's own phase, or no --phase, is fine."""
    path = tmp_path / "decode.json"
    assert invoke("dump", "example", "--phase", "decode", "-o", str(path)).exit_code == 0
    for cmd in ("dump", "coverage"):
        one_line_error(invoke(cmd, str(path), "--phase", "prefill"), 2, "holds a decode graph", "--phase prefill")
        assert invoke(cmd, str(path), "--phase", "decode").exit_code == 0
        assert invoke(cmd, str(path)).exit_code == 0


def test_dump_layers_and_phase() -> None:
    r = invoke("dump", "example", "--layers", "1", "--phase", "decode")
    assert r.exit_code == 0
    assert "# folded 34 nodes of layer 0; showing layers 1" in r.stdout
    assert "[1] i32" in r.stdout
    bad = invoke("dump", "example", "--layers", "one")
    assert bad.exit_code == 2 and "bad layer spec" in bad.stderr
    assert invoke("dump", "example", "--layers", "0", "--format", "json").exit_code == 2


@pytest.fixture
def silu_out_pass():
    """A test-only registered pass: silu on every output."""
    from graphir.passes import PASSES, register_pass

    @register_pass("silu-out", "silu on every output (tests only)")
    def silu_out(graph: Graph) -> Graph:
        return Graph({k: g.silu(v) for k, v in graph.outputs.items()}, graph.updates, graph.meta)

    yield
    del PASSES["silu-out"]


def test_dump_passes_and_diff(silu_out_pass) -> None:
    r = invoke("dump", "example", "--diff")
    assert r.exit_code == 2 and "--diff needs --passes" in r.stderr
    r = invoke("dump", "example", "--passes", "silu-out", "--diff")
    assert r.exit_code == 0
    assert r.stdout.startswith("# before: 79 nodes, after: 80 nodes\n")  # the diff's format: tests/test_dump.py
    assert "+%79 = silu(%78) [7, 256] f32" in r.stdout
    r = invoke("dump", "example", "--passes", "silu-out")
    assert '%79 = silu(%78)' in r.stdout and 'output "logits" = %79' in r.stdout


def test_run_example() -> None:
    r = invoke("run", "example", "-p", "Hello", "-n", "3")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("logits [5, 256] f32: min ")
    assert "generated ids (greedy): " in r.stdout
    assert len(r.stdout.split("generated ids (greedy): ")[1].split()) == 3
    assert "prefill 5 tok" in r.stderr and "reference backend" in r.stderr


@pytest.mark.parametrize("option", [("--ctx", "5"), ("--passes", "cpu"), ("--threads", "1"), ("--tp", "2"),
                                    ("--temperature", "0.8"), ("--top-k", "3"), ("--top-p", "0.5")])
def test_run_example_refuses_the_options_it_would_ignore(option: tuple[str, ...]) -> None:
    """`run example` runs a fixed graph greedily on one process: these options changed nothing, without a word
    (as --dtype and --draft are, they are refused)."""
    one_line_error(invoke("run", "example", "-n", "2", *option), 2, option[0], "example")
    assert invoke("run", "example", "-n", "2", "--seed", "3", "--backend", "reference").exit_code == 0


def test_run_and_chat_convert_weights_with_dtype() -> None:
    """--dtype reaches graphir.load in run (as in bench): q8_0 generates what the API's q8_0 model generates; q4_k on
    the tiny preset's 64-wide rows says its matrices stay f32; an unknown type is an error naming the known ones."""
    import graphir

    args = ("random:qwen3-tiny", "--backend", "reference", "-p", "hello", "-n", "6")
    r = invoke("run", *args, "--dtype", "q8_0")
    assert r.exit_code == 0, r.output
    model = graphir.load("random:qwen3-tiny", backend="reference", dtype="q8_0")
    ids = model.tokenizer.encode("hello")
    assert r.stdout.strip() == ("hello" + model.tokenizer.decode(list(model.generate(ids, 6)))).strip()
    assert "matrices stay f32, not q4_k" in invoke("run", *args, "--dtype", "q4_k").stderr
    bad = invoke("run", *args, "--dtype", "q9")
    assert bad.exit_code == 2 and "'q9' is not a weight type" in bad.stderr and "q4_0" in bad.stderr  # an option
    assert invoke("run", "example", "--dtype", "q8_0").exit_code == 2
    assert "--dtype" in invoke("chat", "--help").stdout


def test_bad_specs_exit_1_with_message(tmp_path: Path) -> None:
    r = invoke("dump", str(tmp_path / "missing.json"))
    assert r.exit_code == 1 and r.stderr == f"error: {tmp_path / 'missing.json'}: no such graph file\n"
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"nodes": [{"id": 0}]}))
    r = invoke("dump", str(broken))
    assert r.exit_code == 1 and "not a graphir graph record" in r.stderr and "Traceback" not in r.output
    r = invoke("dump", "no-such-model")
    assert r.exit_code == 1 and "no-such-model: no such file or directory" in r.stderr
    assert invoke("run", "no-such-model").exit_code == 1


def test_run_a_folder_that_is_no_model_and_an_upper_case_gguf(tmp_path: Path) -> None:
    """A folder without config.json is named as such (run said its tokenizer.json was missing, as if it were a
    model folder); a GGUF file named m.GGUF loads (it was 'not a .gguf file or a model directory')."""
    from _model_helpers import write_gguf
    from test_api_errors import TINY, tiny_arrays

    one_line_error(invoke("run", str(tmp_path), "-n", "1"), 1, f"{tmp_path / 'config.json'}: file not found",
                   alone=False)
    path = write_gguf(tmp_path / "m.GGUF", TINY, tiny_arrays())
    r = invoke("run", str(path), "-p", "hi", "-n", "2", "--backend", "reference")
    assert r.exit_code == 0, r.output


def test_graphir_errors_become_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def load(spec: str, backend: str | None = None, passes: str = "", ctx: int | None = None,
             dtype: str | None = None):
        raise LoadError(f"{spec}.gguf: truncated at tensor 'blk.3.attn_q.weight'")

    monkeypatch.setitem(sys.modules, "graphir.api", types.SimpleNamespace(load=load))
    for args in (("dump", "tiny"), ("run", "tiny", "--backend", "reference")):
        r = invoke(*args)
        assert r.exit_code == 1
        assert r.stderr.endswith("error: tiny.gguf: truncated at tensor 'blk.3.attn_q.weight'\n")
    r = invoke("run", "example", "--backend", "no-such-backend")
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and "'no-such-backend' is not one of" in r.stderr


class FakeDecoder:
    def push(self, token: int) -> str:
        return f"<{token}>"

    def flush(self) -> str:
        return "!"


class FakeModel:
    def __init__(self, backend: str, ctx: int = 4096):
        self.backend = backend
        self.config = types.SimpleNamespace(ctx=ctx, context_length=8192)
        self.tokenizer = types.SimpleNamespace(encode=lambda s: list(range(len(s))), stream=FakeDecoder)
        self.stats = {"load_s": 1.5, "prefill_s": 0.5, "prefill_tokens": 5, "decode_s": 2.0, "decode_tokens": 8}
        self.calls: list[tuple] = []

    def generate(self, ids, max_new_tokens, temperature, top_k, top_p, seed):
        self.calls.append((list(ids), max_new_tokens, temperature, top_k, top_p, seed))
        yield from range(100, 100 + max_new_tokens)


def test_run_model_streams_text_and_timings(monkeypatch: pytest.MonkeyPatch) -> None:
    models: list[FakeModel] = []

    def load(spec: str, backend: str | None = None, passes: str = "", ctx: int | None = None,
             dtype: str | None = None) -> FakeModel:
        assert spec == "smollm2-135m"  # the default MODEL
        models.append(FakeModel(backend))
        return models[-1]

    monkeypatch.setitem(sys.modules, "graphir.api", types.SimpleNamespace(load=load))
    r = invoke("run", "-p", "Hello", "-n", "3", "--temperature", "0", "--top-k", "5", "--top-p", "0.9",
               "--seed", "7", "--backend", "reference")
    assert r.exit_code == 0, r.output
    assert r.stdout == "Hello<100><101><102>!\n"
    assert models[0].backend == "reference"
    assert models[0].calls == [([0, 1, 2, 3, 4], 3, 0.0, 5, 0.9, 7)]
    check = ["loading smollm2-135m on reference", "prompt: 5 tokens", "load 1.50 s", "first token ",
             "prefill 5 tok, 10.0 tok/s", "decode 8 tok, 4.0 tok/s"]
    pos = 0
    for want in check:
        pos = r.stderr.index(want, pos)


def test_run_without_model_stats_times_decode_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model with no stats still streams its text, and run times decode with its own clock."""
    model = FakeModel("reference")
    push = types.SimpleNamespace(push=lambda t: chr(t), flush=lambda: "")
    model.tokenizer = types.SimpleNamespace(encode=lambda s: [1], stream=lambda: push)
    model.stats = {}
    fake_api = types.SimpleNamespace(load=lambda spec, backend=None, passes="", ctx=None, dtype=None: model)
    monkeypatch.setitem(sys.modules, "graphir.api", fake_api)
    r = invoke("run", "tiny", "-p", "x", "-n", "2")
    assert r.exit_code == 0, r.output
    assert r.stdout == "xde\n"  # ids 100, 101
    assert "prefill -" in r.stderr and "decode 1 tok" in r.stderr  # no stats: our own clock for decode


# ---------------------------------------------------------------- check, coverage
@pytest.mark.parametrize("model, phase", [("random:llama-tiny", "prefill"), ("random:qwen3-tiny", "decode"),
                                          ("example", "prefill")])
def test_check_default_passes(model: str, phase: str) -> None:
    r = invoke("check", model, "-p", "default", "--phase", phase)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert out.startswith(f"check: pipeline 'default' on the {phase} graph")
    assert "case 1: position" in out and "case 2: position" in out and "output 'logits'" in out
    assert "\ncoverage:\nreplay-lint: 0 matched" in out and "stack-projections: 4 matched" in out
    assert out.splitlines()[-1].startswith("ok: pipeline 'default' keeps every output and State within 1e-04")
    assert "checked in" in r.stderr


def test_check_fails_on_a_wrong_pass_naming_the_tensor() -> None:
    from test_check import add_to_sub

    with add_to_sub() as name:
        r = invoke("check", "random:llama-tiny", "-p", name, "--n-tokens", "5")
    assert r.exit_code == 1
    assert "first diverging tensor: 'blk.1.attn_res'" in r.stdout and "[add [5, 64] -> sub [5, 64]]" in r.stdout
    assert "  + add 'blk.1.attn_res' -> wrong" in r.stdout  # the coverage report is still printed
    error = r.stderr.splitlines()[-1]
    assert error.startswith(f"error: pipeline '{name}' changes the math beyond 1e-04: worst 'logits' rel ")
    assert "; first diverging tensor 'blk.1.attn_res' (rel " in error


def test_check_options() -> None:
    from test_check import wrong_eps

    with wrong_eps() as name:
        assert invoke("check", "random:llama-tiny", "-p", name, "--tol", "1").exit_code == 0
        assert invoke("check", "random:llama-tiny", "-p", name).exit_code == 1
    r = invoke("check", "random:llama-tiny", "--sites", "0")
    assert "... " not in r.stdout and "  + reshape" in r.stdout  # every site listed
    assert invoke("check", "random:llama-tiny", "--phase", "decode", "--n-tokens", "3").exit_code == 2
    bad = invoke("check", "random:llama-tiny", "-p", "no-such-pass")
    assert bad.exit_code == 2 and "unknown pass 'no-such-pass'" in bad.stderr
    assert "no weights" in invoke("check", "graph.json").stderr


@pytest.mark.parametrize("spec, ctx", [("random:llama-tiny", 256), ("example", 128)])
def test_check_n_tokens_past_the_context_names_the_option(spec: str, ctx: int) -> None:
    """--n-tokens longer than the graph's KV cache: one line naming the option and the context (it was a
    set_rows node's 'row index out of range 0..255 (got 0..256)', after the model loaded)."""
    one_line_error(invoke("check", spec, "--n-tokens", str(ctx + 1)), 1,
                   f"--n-tokens {ctx + 1} exceeds the context of {spec} ({ctx} tokens)", alone=False)
    assert invoke("check", spec, "--n-tokens", str(ctx), "-p", "").exit_code == 0


def test_run_an_empty_prompt_says_so() -> None:
    """-p '' with a tokenizer that adds no BOS is no tokens: said as `run example` says it (it was the API's
    'token ids must be a non-empty 1-D sequence, got shape [0]')."""
    one_line_error(invoke("run", "random:llama-tiny", "-p", "", "-n", "2"), 1,
                   "random:llama-tiny: the prompt is empty (0 tokens); give -p TEXT", alone=False)


def test_text_that_is_not_utf8_is_one_line() -> None:
    """-p with a byte the terminal could not decode, and such a line on chat's stdin: one line each (they were a
    UnicodeEncodeError and a UnicodeDecodeError traceback)."""
    one_line_error(invoke("run", "random:llama-tiny", "-p", "ab\udcffcd", "-n", "1"), 1, "not valid UTF-8",
                   alone=False)
    r = CliRunner().invoke(main, ["chat", "smollm2-135m", "--backend", "reference", "-n", "2"],
                           input=b"hi \xff there\n", catch_exceptions=False)
    assert r.exit_code == 1 and "Traceback" not in r.output  # the error follows chat's '> ' prompt on its line
    assert r.stderr.splitlines()[-1] == "> error: stdin is not valid UTF-8: byte ff (invalid start byte)"


def test_check_smollm2_default() -> None:
    """The default model with the default pipeline: about 12 s on two slow cores."""
    try:
        graphir.load("smollm2-135m")
    except LoadError as e:
        pytest.skip(str(e))
    r = invoke("check", "smollm2-135m", "-p", "default")
    assert r.exit_code == 0, r.output
    assert "(1060 -> 969 nodes)" in r.stdout and "state: 60 buffers ok" in r.stdout
    assert "swiglu-split: 30 matched, 0 rejected" in r.stdout
    assert "fuse-mul-mat-swiglu: 30 matched, 0 rejected" in r.stdout  # the real model's FFNs, every layer
    assert r.stdout.splitlines()[-1].startswith("ok: pipeline 'default'")


def test_coverage_prints_only_the_report() -> None:
    r = invoke("coverage", "random:llama-tiny", "-p", "swiglu-split,fuse-add-rms-norm-mul")
    assert r.exit_code == 0, r.output
    assert r.stdout == ("swiglu-split: 2 matched, 0 rejected, nodes 81 -> 79\n"
                        "  + mul 'blk.0.ffn_act' -> swiglu_split\n"
                        "  + mul 'blk.1.ffn_act' -> swiglu_split\n"
                        "fuse-add-rms-norm-mul: 4 matched, 0 rejected, nodes 79 -> 78\n"
                        "  + mul 'blk.0.ffn_norm' -> add_rms_norm_mul\n"
                        "  + mul 'blk.1.attn_norm' -> add_rms_norm_mul\n"
                        "  + mul 'blk.1.ffn_norm' -> add_rms_norm_mul\n"
                        "  + mul 'output_norm' -> add_rms_norm_mul\n")
    short = invoke("coverage", "example", "--sites", "1").stdout
    assert "  + ... 3 more" in short


# ---------------------------------------------------------------- checks before loading
def one_line_error(r, exit_code: int, *fragments: str, alone: bool = True) -> None:
    """The command failed with one `error: ...` line containing every fragment, last on stderr;
    `alone`: it is all of stderr (nothing was loaded, so no progress line came before it)."""
    assert r.exit_code == exit_code, r.output
    lines = r.stderr.splitlines()
    assert lines[-1].startswith("error: ") and r.stderr.endswith("\n") and "Traceback" not in r.output, r.stderr
    assert len(lines) == 1 or not alone, r.stderr
    for fragment in fragments:
        assert fragment in lines[-1], r.stderr


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """graphir.api and graphir.bench whose every entry point fails the test: nothing may load."""
    import graphir.bench

    def load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"loaded {args} before checking the options")

    monkeypatch.setitem(sys.modules, "graphir.api", types.SimpleNamespace(load=load))
    monkeypatch.setattr(graphir.bench, "bench", load)


@pytest.mark.parametrize("args, fragment", [
    (("run", "tiny", "--backend", "tpu"), "--backend"),
    (("run", "tiny", "--passes", "nonsense"), "unknown pass 'nonsense'"),
    (("run", "tiny", "--passes", "dce{x=1}"), "unknown option 'x'"),
    (("run", "tiny", "--passes", "dce,,{"), "cannot parse"),
    (("run", "tiny", "--temperature", "nan"), "--temperature"),
    (("run", "tiny", "--temperature", "inf"), "--temperature"),
    (("run", "tiny", "--top-p", "0"), "--top-p"),
    (("run", "tiny", "--top-p", "nan"), "--top-p"),
    (("run", "tiny", "--top-k", "-1"), "--top-k"),
    (("run", "tiny", "--seed", "-1"), "--seed"),
    (("run", "tiny", "--ctx", "0"), "--ctx"),
    (("run", "tiny", "-n", "-1"), "-n"),
    (("dump", "tiny", "--layers", "one"), "bad layer spec"),
    (("dump", "tiny", "--passes", "nonsense"), "unknown pass 'nonsense'"),
    (("check", "tiny", "-p", "nonsense"), "unknown pass 'nonsense'"),
    (("check", "tiny", "--tol", "nan"), "--tol"),
    (("check", "tiny", "--seed", "-1"), "--seed"),
    (("coverage", "tiny", "-p", "nonsense"), "unknown pass 'nonsense'"),
    (("bench", "tiny", "--backend", "tpu"), "--backend"),
    (("bench", "tiny", "--passes", "nonsense"), "unknown pass 'nonsense'"),
    (("run", "tiny", "--dtype", "q4"), "dtype 'q4' is not a weight type"),
    (("chat", "tiny", "--dtype", "F16"), "dtype 'F16' is not a weight type"),
    (("bench", "tiny", "--dtype", "int8"), "dtype 'int8' is not a weight type"),
    (("dump", "tiny", "-o", "/no-such-dir/g.html"), "'/no-such-dir'"),
    (("bench", "tiny", "--json", "/no-such-dir/b.json"), "'/no-such-dir'"),
])
def test_bad_options_fail_before_loading(no_loading: None, args: tuple[str, ...], fragment: str) -> None:
    r = invoke(*args)
    one_line_error(r, 2, fragment)
    assert r.stdout == ""


def test_an_output_file_that_cannot_be_written_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-o under a plain file is refused before loading; a write that fails anyway (a full disk, no permission)
    names the file, never a traceback (both were FileNotFoundError tracebacks, bench's after the whole run)."""
    (tmp_path / "f").write_text("")
    one_line_error(invoke("dump", "example", "-o", str(tmp_path / "f" / "g.txt")), 2, "is not a folder")

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "write_text", refuse)
    one_line_error(invoke("dump", "example", "-o", str(tmp_path / "g.txt")), 1, "g.txt", "Permission denied")


def test_unavailable_backend_fails_before_loading(no_loading: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from graphir.backends import registry

    from graphir.errors import BackendError

    def get_backend(name: str) -> None:
        raise BackendError(f"backend {name!r} is not available here: No module named 'cupy'")

    monkeypatch.setattr(registry, "get_backend", get_backend)
    one_line_error(invoke("run", "tiny", "--backend", "gpu"), 1, "backend 'gpu' is not available here")


def test_gpu_without_a_device_fails_before_loading(no_loading: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from graphir.backends.gpu import device

    monkeypatch.setattr(device, "cupy", lambda: object())  # CuPy imports ...
    monkeypatch.setattr(device, "available", lambda: False)  # ... but sees no device
    for cmd in ("run", "bench"):
        one_line_error(invoke(cmd, "tiny", "--backend", "gpu"), 1, "sees no CUDA/HIP device", "--backend cpu")


def test_passes_shows_each_pipeline() -> None:
    from graphir.passes import default_pipeline

    lines = invoke("passes").stdout.splitlines()
    want = "default = " + ", ".join(default_pipeline())
    assert want.startswith("default = replay-lint, dce, cse, stack-projections, ")
    assert want in lines


def fake_api(monkeypatch: pytest.MonkeyPatch, model: Any) -> list[dict[str, Any]]:
    """graphir.api whose load returns `model`; the keyword arguments of each call are recorded."""
    calls: list[dict[str, Any]] = []

    def load(spec: str, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return model

    monkeypatch.setitem(sys.modules, "graphir.api", types.SimpleNamespace(load=load))
    return calls


def test_run_uses_the_defaults_of_load(monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    from graphir.backends.registry import resolve_backend

    from graphir.api import load
    from graphir.passes import BACKEND_PIPELINES

    defaults = {k: p.default for k, p in inspect.signature(load).parameters.items()}
    assert (defaults["backend"], defaults["passes"], defaults["ctx"], defaults["dtype"]) == ("auto", "auto", None, None)
    calls = fake_api(monkeypatch, FakeModel("cpu"))
    assert invoke("run", "tiny", "-n", "1").exit_code == 0
    backend = resolve_backend("auto")  # and its pipeline, resolved before load as load resolves it
    assert calls == [{"backend": backend, "passes": BACKEND_PIPELINES[backend], "ctx": None, "dtype": None}]


def test_run_ctx_sets_the_kv_capacity_and_the_context_error_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_api(monkeypatch, FakeModel("reference", ctx=16))
    r = invoke("run", "tiny", "-p", "x" * 10, "-n", "7", "--ctx", "16")
    assert calls[-1]["ctx"] == 16
    one_line_error(r, 1, "10 tokens", "-n 7", "context of 16", "--ctx", alone=False)
    assert r.stdout == ""  # checked before the prompt is echoed
    assert invoke("run", "tiny", "-p", "x" * 10, "-n", "6").exit_code == 0


def test_run_ctx_on_a_real_model() -> None:
    args = ("run", "random:llama-tiny", "--backend", "reference", "--passes", "", "-p", "hello", "-n", "3")
    one_line_error(invoke(*args, "--ctx", "7"), 1, "5 tokens", "context of 7", "--ctx", alone=False)
    r = invoke(*args, "--ctx", "8")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("hello")


def test_an_error_mid_stream_starts_a_new_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphir.errors import BackendError

    model = FakeModel("cpu")

    def generate(*args: Any, **kwargs: Any) -> Any:
        yield 100
        raise BackendError("node %7 'blk.0.kv': KV row 99 past the capacity")

    model.generate = generate
    fake_api(monkeypatch, model)
    r = invoke("run", "tiny", "-p", "Hi", "-n", "3")
    one_line_error(r, 1, "KV row 99", alone=False)
    assert r.stdout == "Hi<100>\n"
    assert "<100>\nerror: node %7" in r.output  # the error starts its own line


@pytest.mark.parametrize("cmd", ["dump", "coverage", "run"])
def test_binary_json_is_a_one_line_error_naming_the_file(tmp_path: Path, cmd: str) -> None:
    path = tmp_path / "graph.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01")
    r = invoke(cmd, str(path))
    one_line_error(r, 1, f"error: {path}: ")
    assert r.stdout == ""


def test_load_graph_of_non_utf8_json_is_a_load_error(tmp_path: Path) -> None:
    from graphir.cli import load_graph

    path = tmp_path / "latin1.json"
    path.write_bytes('{"name": "caf\xe9"}'.encode("latin-1"))
    with pytest.raises(LoadError, match=f"{path}: not UTF-8 text .*byte 0xe9 at offset 13"):
        load_graph(str(path), "prefill")


def test_run_hf_dir_without_tokenizer_names_the_file(tmp_path: Path) -> None:
    from test_api_errors import hf_dir

    d = hf_dir(tmp_path)
    r = invoke("run", str(d), "--backend", "reference")
    one_line_error(r, 1, f"{d / 'tokenizer.json'}: missing")
    assert r.stdout == ""
    assert graphir.load(str(d), backend="reference").tokenizer is None  # the API still loads the model


def test_run_truncated_gguf_says_truncated(tmp_path: Path) -> None:
    from _model_helpers import write_gguf
    from test_api_errors import TINY, tiny_arrays

    blob = write_gguf(tmp_path / "full.gguf", TINY, tiny_arrays()).read_bytes()
    for cut in (len(blob) // 3, len(blob) - 100):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(blob[:cut])
        one_line_error(invoke("run", str(path)), 1, f"{path}: truncated", alone=False)
