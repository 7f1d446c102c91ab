"""`graphir run --draft`, `graphir bench --draft` and `graphir dump --phase verify` (issue 11), through click's
CliRunner on tiny random models: what they print, not only their exit codes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphir.cli import main

# byte tokens that repeat, so prompt lookup has n-grams to draft from; the random models' next 20 ids are bytes
PROMPT = "abcabcabcabc"


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def speculative_line(stderr: str) -> tuple[int, int, int, float, float]:
    """(verify calls, accepted, drafted, acceptance, tokens per verify) from run's stderr summary."""
    m = re.search(r"speculative \(.*\): (\d+) verify calls, acceptance ([\d.]+) \((\d+)/(\d+) drafts\), "
                  r"([\d.]+) tokens per verify", stderr)
    assert m, stderr
    calls, acc, kept, drafted, per_call = m.groups()
    return int(calls), int(kept), int(drafted), float(acc), float(per_call)


@pytest.mark.parametrize("model", ["random:llama-tiny", "random:qwen35-tiny"])
def test_run_with_a_drafter_prints_the_plain_text_and_the_acceptance(model):
    args = ["run", model, "-p", PROMPT, "-n", "20", "--backend", "cpu"]
    plain = invoke(*args)
    assert plain.exit_code == 0, plain.output
    assert "speculative" not in plain.stderr
    for draft, k in (("lookup", 3), (model, 5)):  # the same random model loaded again: it agrees always
        r = invoke(*args, "--draft", draft, "--draft-len", str(k))
        assert r.exit_code == 0, r.output
        assert r.stdout == plain.stdout  # greedy: the same text
        assert f"speculative ({draft}, draft-len {k}): " in r.stderr
        calls, kept, drafted, acc, per_call = speculative_line(r.stderr)
        assert kept <= drafted <= k * calls and acc == pytest.approx(kept / drafted if drafted else 0.0, abs=0.005)
        assert per_call == pytest.approx((kept + calls) / calls, abs=0.005)  # each call adds its kept drafts + 1
        if draft == model:
            assert (kept, acc) == (drafted, 1.0) and drafted > 0
            assert f"loading draft model {model} on cpu" in r.stderr


def test_run_draft_options_are_checked_before_loading():
    r = CliRunner().invoke(main, ["run", "random:llama-tiny", "--draft-len", "3"])
    assert r.exit_code == 2 and r.stderr.strip() == "error: --draft-len needs --draft MODEL or --draft lookup"
    r = CliRunner().invoke(main, ["run", "random:llama-tiny", "--draft", "lookup", "--draft-len", "16"])
    assert r.exit_code == 2 and "--draft-len" in r.stderr and "16 is not in the range 1<=x<=15" in r.stderr
    r = CliRunner().invoke(main, ["run", "example", "--draft", "lookup"])
    assert r.exit_code == 2 and "--draft needs a model" in r.stderr
    r = CliRunner().invoke(main, ["run", "random:llama-tiny", "--draft", "g.json"])
    assert r.exit_code == 1 and "g.json: a graph file has no weights to run" in r.stderr


def test_run_with_a_draft_model_that_does_not_load_is_an_error(tmp_path: Path):
    missing = tmp_path / "draft.gguf"
    r = CliRunner().invoke(main, ["run", "random:llama-tiny", "-p", "hi", "-n", "4", "--backend", "cpu",
                                  "--draft", str(missing)])
    assert r.exit_code == 1 and r.stdout == ""  # nothing generated before the drafter loaded
    assert r.stderr.splitlines()[-1].startswith(f"error: {missing}: no such file or directory"), r.stderr


def test_bench_with_a_drafter_reports_acceptance_and_speedup_over_plain_decode(tmp_path: Path):
    out = tmp_path / "bench.json"
    r = invoke("bench", "random:llama-tiny", "--backend", "cpu", "--prefill", "16", "--prompt", "16", "--decode",
               "16", "--repeats", "1", "--no-llama-cpp", "--draft", "random:llama-tiny", "--draft-len", "3",
               "--json", str(out))
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["command"].endswith("--draft random:llama-tiny --draft-len 3")
    assert "speculative: draft random:llama-tiny, draft_len 3" in r.stdout
    assert data["draft_equals_plain"] is True and data["draft_acceptance"] == 1.0  # a copy of the target agrees
    # 16 tokens after the first: full calls of 3 drafts + 1, then the last calls cut at the end
    assert 1 < data["draft_tokens_per_verify"] <= 4 and data["draft_verify_calls"] >= 4
    assert data["draft_speedup"] == pytest.approx(data["draft_decode_tok_s_best"] / data["draft_plain_tok_s_best"])
    for label, key, text in (("speculative decode tok/s, best", "draft_decode_tok_s_best", "{:.1f}"),
                             ("plain decode tok/s, best (alternated with it)", "draft_plain_tok_s_best", "{:.1f}"),
                             ("speculative speedup", "draft_speedup", "{:.2f}x"),
                             ("draft acceptance", "draft_acceptance", "{:.2f}"),
                             ("tokens per verify call", "draft_tokens_per_verify", "{:.2f}")):
        row = next(line for line in r.stdout.splitlines() if label in line)
        assert text.format(data[key]) in row, row
    assert re.search(r"speculative output = plain greedy\W+yes", r.stdout)


def test_bench_without_a_drafter_has_no_speculative_rows():
    r = invoke("bench", "random:llama-tiny", "--backend", "cpu", "--prefill", "8", "--prompt", "8", "--decode", "4",
               "--repeats", "1", "--no-llama-cpp")
    assert r.exit_code == 0, r.output
    assert "decode tok/s, best" in r.stdout and "speculative" not in r.stdout and "draft" not in r.stdout
    r = CliRunner().invoke(main, ["bench", "random:llama-tiny", "--draft-len", "2"])
    assert r.exit_code == 2 and "--draft-len needs --draft" in r.stderr


@pytest.mark.parametrize("draft_len, bucket", [(None, 8), (1, 2), (3, 4), (5, 8), (15, 16)])
def test_dump_verify_shows_the_verify_graph_of_the_bucket(draft_len, bucket):
    args = ["dump", "random:llama-tiny", "--phase", "verify"] + (["--draft-len", str(draft_len)] if draft_len else [])
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    header = r.stdout.splitlines()[0]
    assert f"n_tokens={bucket} " in header and "sampler=True" in header and "last_only=False" in header
    assert f'input [{bucket}] i32 "kv_idx"' in r.stdout  # KV rows written at run-time indices
    assert re.search(rf"sample\(.*\) \[{bucket}\] i32", r.stdout)  # an argmax id for every row


def test_dump_verify_of_a_recurrent_model_shows_its_per_token_states():
    r = invoke("dump", "random:qwen35-tiny", "--phase", "verify", "--draft-len", "2")
    assert r.exit_code == 0, r.output
    assert 'phase="verify"' in r.stdout.splitlines()[0]
    for text in ('input [4] i32 "step_rows"', 'state [16, 3, 128] f32 "blk.0.conv_steps"',
                 'state [16, 4, 16, 16] f32 "blk.0.ssm_steps"', "steps=True"):
        assert text in r.stdout, text


def test_dump_verify_options_are_checked():
    r = CliRunner().invoke(main, ["dump", "random:llama-tiny", "--draft-len", "3"])
    assert r.exit_code == 2 and "--draft-len chooses the verify graph's bucket; it needs --phase verify" in r.stderr
    r = CliRunner().invoke(main, ["dump", "example", "--phase", "verify"])
    assert r.exit_code == 2 and "--phase verify builds a model's speculative verify graph" in r.stderr
