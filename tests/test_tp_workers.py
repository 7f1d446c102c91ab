"""Tensor parallelism in real processes on the cpu backend (graphir/tp_workers.py with the host
collective, backends/cpu/host_collective.py): what the gpu backend does over NCCL, tested without GPUs.

Oracles for the logits: the unsharded model on the same backend, within REL = 1e-5 of max |logit| as in
tests/test_shard_tp.py (sharding only regroups f32 sums: 3e-7 llama-tiny, 2.5e-6 qwen35-tiny); the
all-ranks graph on simulated ranks in one process, bitwise (the host collective sums in the reference's
order); and the numpy reference on the unsharded graph, within the cpu backend's own tolerance against
it, REL_BACKENDS (tests/test_cpu_models.py: cpu vs reference is 1.1e-5 on qwen35-tiny unsharded). For
ids: the single-process cpu model.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
from graphir.backends.cpu import host_collective
from graphir.backends.registry import get_backend

import graphir
from graphir import tp_workers
from graphir.errors import BackendError, InputError
from graphir.passes import run_pipeline
from graphir.run_inputs import new_state
from graphir.tp_workers import TpWorkerError

REL = 1e-5
REL_BACKENDS = 1e-4
TINY = ["random:llama-tiny", "random:qwen3-tiny", "random:qwen2-tiny", "random:qwen35-tiny"]
PROMPT = [(7 * i + 3) % 256 for i in range(37)]  # 37 tokens: a 32-token chunk and a padded (or exact) rest
DEATH_S = 4.0  # a failure must surface within a few seconds (about 0.1 s here; a stuck peer is never waited for)


def rel(want: np.ndarray, got: np.ndarray) -> float:
    return float(np.abs(want.astype(np.float64) - got).max() / np.abs(want).max())


@pytest.fixture(scope="module", params=TINY)
def pair(request):
    """(tp=2 model on cpu, the single-process cpu model) for one preset."""
    model = graphir.load(request.param, backend="cpu", tp=2)
    yield model, graphir.load(request.param, backend="cpu")
    model.close()


def test_logits_equal_the_unsharded_model(pair):
    model, plain = pair
    got = model.logits(PROMPT)
    want = plain.logits(PROMPT)
    assert got.shape == want.shape == (len(PROMPT), model.config.n_vocab)
    assert rel(want, got) <= REL, f"logits differ by {rel(want, got):.3g} of max |logit|"
    simulated = graphir.load(model.source, backend="cpu", passes="shard-tp{n=2},default").logits(PROMPT)
    # Not bitwise: with numba's cache cold (a fresh clone, as in CI), a worker that compiles its kernels itself
    # computed the prompt's last rows up to 1e-6 apart from one that loads them from the cache (2.4e-7 of the
    # largest logit; seen at ca71ea6 too), the f32 rounding of another summation order. A wrong shard is off by
    # far more than this.
    assert rel(simulated, got) <= 1e-6, f"tp=2 differs from the simulated ranks by {rel(simulated, got):.3g}"
    reference = graphir.load(model.source, backend="reference", passes="").logits(PROMPT)
    assert rel(reference, got) <= REL_BACKENDS
    assert model.stats["prefill_tokens"] == len(PROMPT)  # rank 0's stats reach the parent


def test_generate_equals_the_single_process_model(pair):
    model, plain = pair
    want = list(plain.generate(PROMPT, 32, stop_at_eos=False))
    assert list(model.generate(PROMPT, 32, stop_at_eos=False)) == want
    assert model.stats["decode_tokens"] == 31
    # a second sequence starts from reset state (Qwen3.5's per-rank recurrent states are zeroed too)
    assert list(model.generate(PROMPT, 32, stop_at_eos=False)) == want
    sampled = {"temperature": 0.9, "top_k": 20, "top_p": 0.95, "seed": 11}
    assert list(model.generate(PROMPT, 24, **sampled)) == list(plain.generate(PROMPT, 24, **sampled))


def test_a_dropped_stream_is_finished_before_the_next_command(pair):
    model, plain = pair
    stream = model.generate(PROMPT, 20, stop_at_eos=False)
    first = next(stream)
    del stream  # the workers still produce the other 19 ids; the next command collects them first
    assert list(model.generate(PROMPT, 5, stop_at_eos=False)) == list(plain.generate(PROMPT, 5, stop_at_eos=False))
    assert first == next(plain.generate(PROMPT, 1))


def test_bad_arguments_are_refused_in_the_parent(pair):
    model, _ = pair
    with pytest.raises(InputError, match="out of range"):
        list(model.generate([model.config.n_vocab], 3))
    with pytest.raises(InputError, match="exceeds the context"):
        model.generate(PROMPT, model.config.ctx)
    with pytest.raises(InputError, match="temperature"):
        model.generate(PROMPT, 3, temperature=-1.0)
    assert len(list(model.generate(PROMPT, 3, stop_at_eos=False))) == 3  # the workers are still there


def test_logits_and_feed_past_the_context_are_refused_in_the_parent(pair):
    """As generate()'s arguments are: a rank raising it ended every worker and closed the model."""
    model, single = pair
    ctx = model.config.ctx
    with pytest.raises(InputError, match=f"{ctx + 1} tokens after 0 exceed the context of {ctx}"):
        model.logits([1] * (ctx + 1))
    model.reset()
    model.feed(PROMPT)
    with pytest.raises(InputError, match=f"{ctx} tokens after {len(PROMPT)} exceed the context of {ctx}"):
        model.feed([1] * ctx)
    single.reset()
    single.feed(PROMPT)
    assert rel(single.feed([5, 6]), model.feed([5, 6])) < REL  # the workers are still there, at position 37


def _procs_gone(model) -> bool:
    return all(not p.is_alive() for p in model._procs)


@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_worker_ends_all_with_a_clear_error(victim):
    model = graphir.load("random:qwen3-tiny", backend="cpu", tp=2)
    stream = model.generate(PROMPT, 200, stop_at_eos=False)
    next(stream)
    os.kill(model.pids[victim], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TpWorkerError, match=rf"rank {victim} of 2 .*pid {model.pids[victim]}.* killed by signal "
                                            rf"SIGKILL while generating; all 2 workers ended"):
        for _ in stream:
            pass
    assert time.monotonic() - t0 < DEATH_S
    assert _procs_gone(model)
    with pytest.raises(TpWorkerError, match="is closed"):
        model.logits(PROMPT)


def _raise_on(model, rank: int) -> None:
    """Rank `rank` raises; the other ranks read a prompt, which blocks in its first collective."""
    if tp_workers.worker_rank() == rank:
        raise RuntimeError("planted failure")
    model.logits(PROMPT)


def test_a_worker_that_raises_ends_its_blocked_peers():
    model = graphir.load("random:llama-tiny", backend="cpu", tp=2)
    t0 = time.monotonic()
    with pytest.raises(TpWorkerError, match=r"rank 1 of 2 .*RuntimeError: planted failure \(while running "
                                            r"_raise_on\)") as info:
        model.call(_raise_on, 1)
    assert time.monotonic() - t0 < DEATH_S
    assert "rank 1's traceback" in str(info.value) and isinstance(info.value.__cause__, RuntimeError)
    assert _procs_gone(model)


def test_close_ends_the_workers():
    with graphir.load("random:llama-tiny", backend="cpu", tp=2) as model:
        assert len(set(model.pids)) == 2 and os.getpid() not in model.pids
        procs = model._procs
    assert all(p.exitcode == 0 for p in procs)  # they left their loop, not killed


def test_bad_tp_is_a_clear_error(monkeypatch):
    for tp in (0, -2, 2.0, True):
        with pytest.raises(InputError, match="tp must be an int >= 1"):
            graphir.load("random:llama-tiny", backend="cpu", tp=tp)
    with pytest.raises(InputError, match="backend 'reference' has no collective between processes"):
        graphir.load("random:llama-tiny", backend="reference", tp=2)
    with pytest.raises(InputError, match="already hold shard-tp"):
        graphir.load("random:llama-tiny", backend="cpu", tp=2, passes="shard-tp{n=2},default")
    monkeypatch.setattr(tp_workers, "gpu_count", lambda: 2)
    with pytest.raises(InputError, match="tp=4 needs 4 GPUs .*CuPy sees 2"):
        tp_workers.check_tp(4, "gpu", "default")


def test_one_rank_graph_without_a_group_is_refused_on_cpu():
    model = graphir.load("random:llama-tiny", backend="cpu", passes="")
    graph = run_pipeline(model.graph("decode"), "shard-tp{n=2,rank=0}")
    feeds = {"tokens": np.array([5], np.int32), "pos": np.array([0], np.int32), "kv_idx": np.array([0], np.int32),
             "kv_len": np.array([1], np.int32)}
    with pytest.raises(BackendError, match="holds one rank of 2; it needs a backend that exchanges data"):
        get_backend("cpu").lower(graph, model.weights)(feeds, new_state(graph))


# ---------------------------------------------------------------- the host collective alone
SIZES = [1, 7, 65, 1025]  # elements; with 64-byte slots, 1025 f32 take 65 rounds (a last round of 1)


def _exchange(link, rank: int, out) -> None:
    group = host_collective.HostGroup(link, rank)
    for k, n in enumerate(SIZES):
        x = _piece(rank, n, k)
        summed = np.empty_like(x)
        group.all_reduce(x, summed)
        pieces = np.empty((link.ranks,) + x.shape, x.dtype)
        group.all_gather(x, pieces)
        out.put((rank, k, summed, pieces))


def _piece(rank: int, n: int, k: int) -> np.ndarray:
    return np.random.default_rng(100 * rank + k).uniform(-2, 2, (n,)).astype(np.float32)


def test_host_collective_in_small_rounds():
    ranks = 3
    ctx = mp.get_context("spawn")
    link = host_collective.HostLink.create(ctx, ranks, slot_bytes=64)
    out = ctx.Queue()
    procs = [ctx.Process(target=_exchange, args=(link, r, out), daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in range(ranks * len(SIZES))]
    for p in procs:
        p.join(10)
    assert all(p.exitcode == 0 for p in procs)
    for rank, k, summed, pieces in results:
        parts = [_piece(r, SIZES[k], k) for r in range(ranks)]
        want = parts[0].copy()
        for p in parts[1:]:
            want = want + p  # rank order, in f32, as the reference all_reduce
        np.testing.assert_array_equal(summed, want, err_msg=f"all_reduce on rank {rank}, {SIZES[k]} elements")
        np.testing.assert_array_equal(pieces, np.stack(parts), err_msg=f"all_gather on rank {rank}")


# ---------------------------------------------------------------- cli and bench
def test_cli_run_with_tp_prints_the_single_process_text():
    from click.testing import CliRunner

    from graphir.cli import main

    args = ["run", "random:qwen3-tiny", "--backend", "cpu", "-n", "12", "-p", "Hello"]
    plain = CliRunner().invoke(main, args, catch_exceptions=False)
    sharded = CliRunner().invoke(main, args + ["--tp", "2"], catch_exceptions=False)
    assert sharded.exit_code == plain.exit_code == 0
    assert sharded.stdout == plain.stdout and len(plain.stdout) > len("Hello")


def test_bench_with_tp_returns_every_number():
    from graphir.bench import NUMBERS, bench

    r = bench("random:llama-tiny", backend="cpu", tp=2, prefill_tokens=16, prompt_tokens=8, decode_tokens=8,
              repeats=1)
    for k in NUMBERS:
        assert isinstance(r[k], (int, float)) and np.isfinite(r[k]) and r[k] > 0, (k, r[k])
    assert r["tp"] == 2 and r["collective_share"] == 0.0  # measured on gpu only
    with pytest.raises(ValueError, match="do not run with --tp"):
        bench("random:llama-tiny", backend="cpu", tp=2, draft="lookup")


def test_rank_weight_bytes_are_the_rank_slices():
    """Summed over ranks: every weight once, plus what each further rank holds again (norms, and the
    untied embedding's one looked-up row)."""
    from graphir.bench import decode_weight_bytes
    from graphir.bench_tp import rank_decode_bytes

    plain = graphir.load("random:llama-tiny", backend="cpu")
    ranks = [graphir.load("random:llama-tiny", backend="cpu", passes=f"shard-tp{{n=2,rank={r}}},default")
             for r in range(2)]
    emb = plain.weights["token_embd.weight"]
    norms = sum(w.nbytes for name, w in plain.weights.items() if "norm" in name)
    again = norms + emb.nbytes // emb.shape[0]
    assert sum(rank_decode_bytes(m)[0] for m in ranks) == decode_weight_bytes(plain) + again


ORPHAN = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
import graphir
from test_tp_workers import _stall

if __name__ == "__main__":
    model = graphir.load("random:llama-tiny", backend="cpu", tp=2)
    with open(sys.argv[2], "w") as f:
        print(*model.pids, file=f)
    model._send(("call", _stall, ()))
    time.sleep(1.0)  # rank 0 waits in a collective, rank 1 sleeps: neither reads its pipe
    os._exit(0)  # no close, no atexit: the workers must notice on their own
"""


def _stall(model) -> None:
    if tp_workers.worker_rank() == 1:
        time.sleep(600)
    model.logits(PROMPT)


def test_workers_exit_when_the_parent_dies(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    pid_file = tmp_path / "pids"
    # no pipes: orphans holding the parent's stdout would keep run() waiting
    subprocess.run([sys.executable, str(script), os.path.dirname(__file__), str(pid_file)], timeout=120, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + DEATH_S
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    """Running (a zombie left unreaped by a container's init counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.mark.parametrize("spec", ["random:llama-tiny", "random:qwen35-tiny"])
def test_four_ranks_with_replicated_kv_heads(spec):
    """4 processes: 2 KV heads over 4 ranks are each held by two (tests/test_shard_tp.py), the host
    collective sums 4 parts; logits and greedy ids as with one process."""
    plain = graphir.load(spec, backend="cpu")
    with graphir.load(spec, backend="cpu", tp=4) as model:
        assert rel(plain.logits(PROMPT), model.logits(PROMPT)) <= REL
        assert list(model.generate(PROMPT, 16, stop_at_eos=False)) == list(plain.generate(PROMPT, 16,
                                                                                           stop_at_eos=False))


def test_three_ranks_with_a_head_that_does_not_split_evenly():
    """3 processes on llama-tiny: its 272 vocabulary rows are not 3 equal pieces, so every rank computes the whole
    head (shard-tp leaves it unsplit); logits and greedy ids as with one process."""
    plain = graphir.load("random:llama-tiny", backend="cpu")
    with graphir.load("random:llama-tiny", backend="cpu", tp=3) as model:
        assert rel(plain.logits(PROMPT), model.logits(PROMPT)) <= REL
        assert list(model.generate(PROMPT, 16, stop_at_eos=False)) == list(plain.generate(PROMPT, 16,
                                                                                           stop_at_eos=False))
