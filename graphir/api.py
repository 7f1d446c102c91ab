"""`graphir.load(spec)`: a model ready to score and generate, composed from the pipeline stages.

    model = graphir.load("smollm2-135m")            # or a .gguf path, an HF directory, "random:qwen3-tiny";
                                                    # backend "auto" (gpu if present, else cpu), passes "auto"
    ids = model.tokenizer.encode("The capital of France is")
    text = model.tokenizer.decode(list(model.generate(ids, 16)))

Prefill is cut into chunks of PREFILL_BUCKETS sizes, so a model only ever builds and lowers a
few graphs: one per bucket plus the decode graph (n_tokens=1). Each chunk writes its KV rows at
its own positions; rows at or past kv_len are never read, so a reset only rewinds the position.
That also lets the last chunk be padded up to a bucket (a 5-token prompt is one 8-token call, not
5 decode steps): padding tokens go first in the chunk and write rows past the real tokens', which
no real token reads and the next tokens overwrite. Models with whole-buffer states (recurrent
layers) take exact chunks instead, since a padding token would advance their state.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from graphir import flags, kv_slots
from graphir.backends.registry import get_backend, resolve_backend
from graphir.cache import ProgramCache
from graphir.chat import Conversation
from graphir.dtypes import numpy_dtype
from graphir.errors import GraphError, InputError, LoadError
from graphir.generate import SAMPLING_INPUT, TOKEN_OUTPUT, Settings, check_max_new_tokens, generate, with_sampler
from graphir.ir import Graph
from graphir.models import loader, presets, registry
from graphir.models.default_model import DEFAULT_MODEL, check_spec
from graphir.models.family import ModelConfig
from graphir.models.hf_dir import TOKENIZER_FILE
from graphir.ops import SAMPLING_FIELDS
from graphir.run_inputs import new_state
from graphir.weights import Weights

PREFILL_BUCKETS = (512, 128, 32, 8, 1)
# A call's fixed cost in prefill tokens: SmolLM2 Q4_1 on 2 cores, 8 / 32 / 128 tokens in 54 / 146 / 542 ms
# is about 10 ms a call plus 4.2 ms a token.
CALL_COST = 3
# The gpu backend: larger chunks keep the tensor cores busy (Qwen3-8B, H200: one 4096-token call ran
# at 22k tok/s, eight 512-token calls at 17k), and a call costs ~800 launches from Python, a few ms,
# i.e. about 64 tokens at those rates.
GPU_PREFILL_BUCKETS = (4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 1)
GPU_CALL_COST = 64


class Model:
    """A loaded model: config, tokenizer and weights, a KV cache, and Programs cached per graph."""

    def __init__(self, config: ModelConfig, weights: Weights, tokenizer: Any, *, backend: str = "reference",
                 passes: str = "", eos_ids: Iterable[int] = (), source: str = "", load_s: float = 0.0):
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.backend = backend
        self.passes = _resolved_pipeline(passes, backend)  # what the program cache keys on: never "auto"
        self.eos_ids = set(eos_ids)
        self.source = source
        on_gpu = backend == "gpu"
        self.prefill_buckets: tuple[int, ...] = GPU_PREFILL_BUCKETS if on_gpu else PREFILL_BUCKETS
        self.call_cost = GPU_CALL_COST if on_gpu else CALL_COST
        self.programs = ProgramCache()
        self.stats: dict[str, float] = {"load_s": load_s}
        self._dtypes = {name: w.dtype for name, w in weights.items()}
        self._graphs: dict[tuple[int, bool, bool], Graph] = {}
        self._state: dict[str, np.ndarray] | None = None
        self._state_graphs: set[str] = set()  # signatures of the graphs whose State buffers _state holds
        # a KV slot pool (kv_slots=N): the slots of the sequence's positions, fed as the slot map every call
        pool = getattr(config, "kv_slots", 0)
        self.slots = kv_slots.SlotPool(pool, config.ctx) if pool else None
        self.kv_capacity = min(config.ctx, pool) if pool else config.ctx  # the KV rows a sequence can hold
        self.n_past = 0  # KV rows written (the next token's position)
        self._sequence = 0  # counts reset()s: a generator whose sequence was replaced since refuses to go on
        self.conversation = Conversation(self)  # the chat turns the KV cache holds
        self._padding_ok: bool | None = None  # _pads_safely(), worked out once
        self._state_ahead: int | None = None  # see _check_in_step
        one = lambda: np.zeros(1, np.int32)  # noqa: E731
        self._step_feeds = {"tokens": one(), "pos": one(), "kv_idx": one(), "kv_len": one(),
                            SAMPLING_INPUT: np.zeros((1, len(SAMPLING_FIELDS)), np.float32)}
        self._clear_run_stats()

    # ---- graphs ----

    def graph(self, phase: str = "prefill", n_tokens: int | None = None, last_only: bool = False) -> Graph:
        """The forward graph this model runs (decode: n_tokens=1)."""
        graph = registry.family_of(self.config).build(self.config, phase, n_tokens, self._dtypes, last_only)
        # more tokens than KV rows never runs: it was built, then failed at its first run as set_rows' 'row index
        # out of range 0..255 (got 0..299)' (check(model, n_tokens=300), a researcher's own Program)
        if graph.meta.get("n_tokens", 0) > self.config.ctx:
            raise GraphError(f"n_tokens={graph.meta['n_tokens']} is past the model's context of {self.config.ctx} "
                             f"KV rows; load(..., ctx=N) to raise it")
        return graph

    def _graph(self, n: int, last_only: bool = False, sampler: bool = False) -> Graph:
        """The graph for n tokens, built once; `sampler`: it samples its last logits row itself
        (generate's decode step), returning one id instead of the logits."""
        key = (n, last_only and n > 1, sampler)
        if key not in self._graphs:
            graph = self.graph("decode" if n == 1 else "prefill", n, key[1])
            self._graphs[key] = with_sampler(graph) if sampler else graph
        return self._graphs[key]

    def _program(self, n: int, last_only: bool, sampler: bool = False) -> Any:
        return self.programs.get_program(self._graph(n, last_only, sampler), self.weights, self.backend, self.passes)

    # ---- running ----

    @property
    def n_past(self) -> int:
        return self._n_past

    @n_past.setter
    def n_past(self, n: int) -> None:
        """Moving the sequence's end; with a slot pool, rewinding (a reset, rolling back rejected drafts, past
        a call's padding rows) frees the slots of the positions past it."""
        self._n_past = n
        if self.slots is not None:
            self.slots.release(n)

    def _slot_inputs(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A call's Inputs (kv_idx: the positions n_past.. it writes) on this model's cache: unchanged for a
        contiguous cache; with a slot pool, those positions take slots (an InputError before the call when the
        pool is exhausted), kv_idx names the slots and the slot map is added."""
        if self.slots is None:
            return inputs
        self.slots.release(self.n_past)
        self.slots.hold(self.n_past + len(inputs["kv_idx"]))
        return kv_slots.mapped_inputs(inputs, self.slots.slot_map)

    def reset(self) -> None:
        """Forget the sequence: rewind to position 0 (KV rows past kv_len are never read) and zero
        the conv and recurrent states of hybrid models, which are not indexed by position."""
        self.n_past = 0
        self._sequence += 1
        self._state_ahead = None
        if self._state is not None:
            registry.family_of(self.config).reset_state(self.config, self._state)

    def feed(self, token_ids: Iterable[int], last_only: bool = False) -> np.ndarray:
        """Append tokens at positions n_past.. (writing their KV rows); logits f32 [n, vocab] (or [1, vocab])."""
        ids = self._check_ids(token_ids)
        self._check_in_step()
        if self.n_past + len(ids) > self.config.ctx:
            raise InputError(f"{len(ids)} tokens after {self.n_past} exceed the context of {self.config.ctx} "
                             f"(load(..., ctx=N) to raise it)")
        self._check_slots(self.n_past + len(ids))
        out, start = [], 0
        for b in self.chunks(len(ids), last_only):
            m = min(b, len(ids) - start)  # real tokens in this call; the other b - m pad it (last call only)
            rows = np.arange(self.n_past, self.n_past + b, dtype=np.int32)
            pos = np.concatenate([rows[m:], rows[:m]])  # padding first, at the free rows past the real ones
            tokens = np.concatenate([np.full(b - m, ids[start], np.int32), ids[start:start + m]])
            inputs = {"tokens": tokens, "pos": pos, "kv_idx": pos, "kv_len": np.array([self.n_past + m], np.int32)}
            self._ensure_state(self._graph(b, last_only))
            logits = self._program(b, last_only)(self._slot_inputs(inputs), self._state)["logits"]
            out.append(logits if last_only else logits[b - m:])
            start, self.n_past = start + m, self.n_past + m
        return out[-1] if last_only else np.concatenate(out, axis=0)

    def chunks(self, n: int, last_only: bool = False) -> list[int]:
        """The bucket sizes of the calls that read n tokens from position n_past: the plan of least
        modelled time (a call costs its bucket size plus self.call_cost tokens), where only the last call may
        be padded (its bucket past the tokens left, within the context) and a one-token call (the decode
        graph) only reads a last single token. Models that cannot be padded take exact chunks.
        Whether a model can be padded is read, when a plan first depends on it, from the graph its padded
        plan would run last (`last_only` as the calls will be made): a graph it runs anyway, where the
        decode graph would be one more to build before a prompt's first token."""
        if self._padding_ok is False:
            return self._plan(n, 0)
        padded = self._plan(n, self.kv_capacity - self.n_past)
        if self._padding_ok is None and padded != self._plan(n, 0):
            self._padding_ok = _writes_rows_only(self._graph(padded[-1], last_only))
            if not self._padding_ok:
                return self._plan(n, 0)
        return padded

    def _plan(self, n: int, pad_room: int) -> list[int]:
        """chunks() for a last call that may be padded up to `pad_room` rows past position n_past (0: never).
        Rooms past n + the largest bucket all plan alike: clipped, so plans are reused as n_past moves."""
        buckets = tuple(sorted(set(self.prefill_buckets) - {1}))
        return list(least_cost_plan(n, min(pad_room, n + max(buckets, default=0)), buckets, self.call_cost))

    def _pads_safely(self) -> bool:
        """Whether a padding token leaves the model's state as it found it: every State write is a row
        write (KV caches at kv_idx), none a whole-buffer assign (conv and recurrent states)."""
        if self._padding_ok is None:
            self._padding_ok = _writes_rows_only(self._graph(1))
        return self._padding_ok

    def chat(self, messages: Sequence[Mapping[str, Any]], max_new_tokens: int = 256, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> str:
        """The assistant's reply to `messages` ([{"role": "user", "content": "..."}, ...]), rendered with the
        model's chat template and ended by its end-of-turn token. The KV cache keeps the conversation: a
        follow-up that extends the same messages reads only its new tokens."""
        ids = self.conversation.reply(messages, max_new_tokens, temperature, top_k, top_p, seed)
        return self.tokenizer.decode(list(ids))

    def logits(self, token_ids: Iterable[int]) -> np.ndarray:
        """Logits f32 [n, vocab] of every position, from a fresh KV cache."""
        ids = self._check_ids(token_ids)
        self._check_fits(len(ids), 0)
        self.reset()
        self._clear_run_stats()
        t0 = time.perf_counter()
        out = self.feed(ids)
        self._add_stats("prefill", len(ids), t0)
        return out

    def generate(self, prompt_ids: Iterable[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True, draft: Any = None,
                 draft_len: int = 4) -> Iterator[int]:
        """Yield new token ids as they are produced, from a fresh KV cache. Inputs are checked here,
        before the first token is asked for; an EOS id ends generation and is not yielded.
        `draft` (a loaded Model sharing the vocabulary, "lookup", or a graphir.speculative Drafter) turns on
        speculative decoding with up to `draft_len` drafted tokens per verify call (graphir/speculative.py)."""
        if draft is not None:
            from graphir import speculative

            return speculative.generate(self, draft, prompt_ids, max_new_tokens, draft_len, temperature, top_k,
                                        top_p, seed, stop_at_eos)
        ids = self._check_ids(prompt_ids)
        check_max_new_tokens(max_new_tokens)
        self._check_fits(len(ids), int(max_new_tokens))
        settings = Settings(temperature, top_k, top_p, seed)
        self.reset()
        self._clear_run_stats()
        if self._queues_ahead(stop_at_eos):
            return self._generate_queued(ids.tolist(), int(max_new_tokens), settings, stop_at_eos, self._sequence)
        seq, at = self._sequence, 0  # at: n_past when this generator last yielded

        def prefill(prompt: list[int]) -> int:
            nonlocal seq, at
            seq = self._start_sequence(seq)
            token = self._prefill_sample(prompt, settings)
            at = self.n_past
            return token

        def step(token: int) -> int:
            nonlocal at
            self._check_sequence(seq, at)
            token = self._decode_sample(token, settings)
            at = self.n_past
            return token

        return generate(prefill, step, ids.tolist(), int(max_new_tokens), self.eos_ids, stop_at_eos)

    def _start_sequence(self, seq: int) -> int:
        """The sequence a generator's first token starts: generate()'s own, unless another call used the cache
        between generate() and the first next() (generators run lazily), which takes a fresh one."""
        if self._sequence != seq or self.n_past:
            self.reset()
            self._clear_run_stats()
        return self._sequence

    def _check_sequence(self, seq: int, at: int) -> None:
        """A generator whose sequence another call replaced (a reset) or extended (feed() moves n_past from `at`,
        where the generator left it) between two of its tokens would read on from that cache and yield wrong ids
        without a word."""
        if self._sequence != seq or self.n_past != at:
            raise InputError(f"a generate() of {self.source} was overtaken: a call between two of its tokens "
                             f"started a new sequence or fed the cache (reset(), feed(), logits(), generate() or "
                             f"chat()), so its KV cache is not its own; call generate() again")

    def _prefill_sample(self, ids: list[int], settings: Settings) -> int:
        """Read the prompt; the first new id, sampled on the host from the last logits row (once per prompt)."""
        t0 = time.perf_counter()
        logits = self.feed(ids, last_only=True)[-1]
        token = settings.sample(logits)
        self._add_stats("prefill", len(ids), t0)
        return token

    def _decode_sample(self, token: int, settings: Settings) -> int:
        """One decode step that samples inside the graph: the step's Inputs (token, position, KV row,
        KV length, sampling row) go in, one id comes out. On the gpu backend that is one small copy each
        way around one captured-graph replay; nothing else runs on the host."""
        t0 = time.perf_counter()
        self._check_in_step()
        n = self.n_past
        if n + 1 > self.config.ctx:
            raise InputError(f"1 token after {n} exceeds the context of {self.config.ctx} "
                             f"(load(..., ctx=N) to raise it)")
        self._check_slots(n + 1)
        self._ensure_state(self._graph(1, False, sampler=True))
        feeds = self._step_inputs(n, token, settings)
        out = self._program(1, False, sampler=True)(feeds, self._state)[TOKEN_OUTPUT]
        self.n_past = n + 1
        self._add_stats("decode", 1, t0)
        return int(out[0])

    def _queues_ahead(self, stop_at_eos: bool) -> bool:
        """Whether generate() queues the next decode step on the device before the host has read the last id
        (a backend with a StepQueue: gpu). A step queued ahead runs even when the loop then ends (an EOS id,
        or the caller stopping early); the KV cache takes it back with n_past, a recurrent State cannot. So
        models with one queue ahead only when no EOS can end the loop, and a caller that stops early leaves
        their State ahead, which feed() then refuses (_check_in_step). GRAPHIR_NO_QUEUE=1: never."""
        if getattr(get_backend(self.backend), "StepQueue", None) is None or flags.enabled("GRAPHIR_NO_QUEUE"):
            return False
        return self._pads_safely() or not (stop_at_eos and self.eos_ids)

    def _generate_queued(self, prompt: list[int], max_new_tokens: int, settings: Settings,
                         stop_at_eos: bool, seq: int) -> Iterator[int]:
        """generate()'s loop with decode steps queued on the device ahead of the host (backends/gpu/
        step_queue.py): each step's token is the last step's sampled id, copied on the device, so the host
        reads id i while step i + 1 already runs. The same steps, inputs and draws as the one-step loop."""
        if max_new_tokens <= 0:
            return
        seq = self._start_sequence(seq)
        token = self._prefill_sample(prompt, settings)
        if stop_at_eos and token in self.eos_ids:
            return
        yield token
        steps = max_new_tokens - 1  # the decode steps of the one-step loop: each one's input is yielded first
        if steps == 0:
            return
        self._ensure_state(self._graph(1, False, sampler=True))
        program = self._program(1, False, sampler=True)
        queue = get_backend(self.backend).StepQueue(program, self._state, feedback=(TOKEN_OUTPUT, "tokens"))
        n0, pushed, done = self.n_past, 0, 0
        at = n0  # n_past as this generator left it (each push moves it)
        try:
            while done < steps:
                self._check_sequence(seq, at)  # after each yield: the caller may have used the cache since
                t0 = time.perf_counter()
                while pushed < steps and queue.in_flight < queue.depth:
                    self._push_step(queue, n0 + pushed, token if pushed == 0 else None, settings)
                    pushed += 1
                at = self.n_past
                token = int(queue.pop()[TOKEN_OUTPUT][0])
                done += 1
                self._add_stats("decode", 1, t0)
                if stop_at_eos and token in self.eos_ids:
                    return
                yield token
        finally:
            queue.drain()
            if self._sequence == seq and self.n_past == at:  # else the call that overtook it owns them
                self.n_past = n0 + done  # the steps whose input was yielded; KV rows past it are never read
                if pushed > done and not self._pads_safely():
                    self._state_ahead = self.n_past

    def _push_step(self, queue: Any, pos: int, token: int | None, settings: Settings) -> None:
        """Queue the decode step at `pos`; token None: the last queued step's id, fed back on the device."""
        self.n_past = pos  # the slot pool holds the positions up to the step's
        queue.push(self._step_inputs(pos, 0 if token is None else token, settings), feed_back=token is None)

    def _step_inputs(self, pos: int, token: int, settings: Settings) -> dict[str, np.ndarray]:
        """A sampling decode step's Inputs at `pos` (n_past): token, position, KV row and length, the next
        draw's settings row; with a slot pool, its slots. One set of buffers, refilled every step."""
        feeds = self._step_feeds
        feeds["tokens"][0] = token
        feeds["pos"][0] = feeds["kv_idx"][0] = pos
        feeds["kv_len"][0] = pos + 1
        feeds[SAMPLING_INPUT][0] = settings.row()
        return self._slot_inputs(feeds)

    def _check_in_step(self) -> None:
        """A recurrent State left ahead of n_past by a generate() stopped early cannot be continued."""
        if self._state_ahead is not None:
            raise InputError(f"the recurrent state of {self.source} ran one decode step past position "
                             f"{self._state_ahead}: generate() was stopped early with a step queued ahead on the "
                             f"device. Call reset() (or generate() again) before feeding more tokens")

    def _ensure_state(self, graph: Graph | None = None) -> None:
        """State buffers for `graph` (one of this model's graphs, about to run; default: the decode graph), made
        when a graph first needs them: after the model's passes, which may rename or split them (shard-tp gives
        each rank its own). The graph's passed form is the one its Program is lowered from, so a prompt's first
        token waits for no other graph (the decode graph's passes only come with the first decode step)."""
        graph = graph if graph is not None else self._graph(1)
        if self._state is not None and graph.signature() in self._state_graphs:
            return
        passed = self.programs.passed(graph, self.passes)
        state = {} if self._state is None else self._state
        missing = [n for n in passed.states if n.name not in state]
        if missing:
            backend_state = getattr(get_backend(self.backend), "new_state", new_state)  # gpu: on the device
            try:
                state.update(backend_state(Graph({n.name: n for n in missing})))
            except MemoryError:  # a ctx far past the machine (load checks no size): numpy's traceback said less
                size = sum(int(np.prod(n.shape)) * np.dtype(numpy_dtype(n.dtype)).itemsize for n in missing)
                raise InputError(f"{self.source}: the KV cache and State for a context of {self.config.ctx} tokens "
                                 f"need {_bytes(size)}, more than can be allocated here; lower it with "
                                 f"load(..., ctx=N) (--ctx N on the command line)") from None
        self._state = state
        self._state_graphs.add(graph.signature())

    # ---- checks and stats ----

    def _check_ids(self, token_ids: Iterable[int]) -> np.ndarray:
        try:
            ids = np.asarray(list(token_ids) if not isinstance(token_ids, np.ndarray) else token_ids)
        except TypeError:  # None or a number: list() said only "'NoneType' object is not iterable"
            raise InputError(f"token ids must be a non-empty 1-D sequence of integers, got {token_ids!r}") from None
        if ids.ndim != 1 or ids.size == 0:
            raise InputError(f"token ids must be a non-empty 1-D sequence, got shape {list(ids.shape)}")
        if ids.dtype.kind not in "iu":
            raise InputError(f"token ids must be integers, got {ids.dtype}")
        bad = np.flatnonzero((ids < 0) | (ids >= self.config.n_vocab))
        if bad.size:
            i = int(bad[0])
            raise InputError(f"token id {int(ids[i])} at index {i} is out of range [0, {self.config.n_vocab}) "
                             f"(the vocabulary of {self.source})")
        return ids.astype(np.int32)

    def _check_fits(self, n_prompt: int, n_new: int) -> None:
        if n_prompt + n_new > self.config.ctx:
            raise InputError(f"prompt of {n_prompt} tokens + max_new_tokens {n_new} exceeds the context of "
                             f"{self.config.ctx} (load(..., ctx=N) to raise it)")
        if self.slots is not None and n_prompt + n_new > self.slots.n_slots:
            raise InputError(f"prompt of {n_prompt} tokens + max_new_tokens {n_new} needs {n_prompt + n_new} KV "
                             f"slots, the pool has {self.slots.n_slots} (load(..., kv_slots=N) to raise it)")

    def _check_slots(self, n: int) -> None:
        """A sequence of n tokens fits the slot pool (checked before a call, so the cache is left as it was)."""
        if self.slots is not None and n > self.slots.n_slots:
            raise InputError(f"KV slot pool exhausted: a sequence of {n} tokens needs {n} slots, the pool has "
                             f"{self.slots.n_slots} ({self.n_past} held; load(..., kv_slots=N) to raise it)")

    def _clear_run_stats(self) -> None:
        self.stats.update(prefill_s=0.0, prefill_tokens=0, decode_s=0.0, decode_tokens=0)

    def _add_stats(self, kind: str, n: int, t0: float) -> None:
        self.stats[f"{kind}_s"] += time.perf_counter() - t0
        self.stats[f"{kind}_tokens"] += n

    def __repr__(self) -> str:
        c = self.config
        return (f"<Model {c.arch} {self.source!r}: {c.n_layers} layers, d_model {c.d_model}, vocab {c.n_vocab}, "
                f"ctx {c.ctx}, backend {self.backend}>")


def load(spec: str | os.PathLike[str] = DEFAULT_MODEL, backend: str = "auto", dtype: str | None = None,
         ctx: int | None = None, passes: str = "auto", threads: int | None = None, tp: int = 1,
         kv_slots: int | None = None) -> Model:
    """Load `spec`: a .gguf file, an HF directory (config.json + safetensors), "smollm2-135m", or
    "random:<preset>" (seeded random weights; presets in graphir.models.presets.PRESETS).
    `backend` "auto" is gpu when CuPy sees a device, else cpu; `passes` is the pipeline applied before
    lowering ("" for none); "auto" is the backend's own (graphir.passes.BACKEND_PIPELINES: reference "default",
    cpu "cpu", gpu "gpu"), "default" every product in f32. These are `graphir run`'s defaults too.
    `dtype` None keeps the file's weight types; "f32" (or f16, bf16, q8_0, ...) converts them.
    `ctx` is the KV-cache capacity (default: the model's context, at most loader.DEFAULT_MAX_CTX).
    `threads` fixes the cpu backend's kernel threads (1..numba's pool; per process, as numba's pool is);
    None leaves them as they are: auto unless set, i.e. the whole pool while the machine is quiet and
    one thread fewer per core other programs keep busy (graphir/backends/cpu/threads.py).
    A model from an HF directory without tokenizer.json, or a GGUF file without tokenizer metadata, loads with
    `tokenizer` None.
    `tp` > 1: tensor parallel over that many processes, one per GPU (gpu, NCCL) or sharing memory
    (cpu); the result is a graphir.tp_workers.TensorParallelModel with generate, logits and close.
    `kv_slots` N: the KV cache is a pool of N slots addressed through a slot map (graphir/kv_slots.py;
    the llama family's models: Llama, Mistral, Qwen2, Qwen3); a sequence holds at most min(ctx, N) tokens."""
    t0 = time.perf_counter()
    check_spec(str(spec))
    if threads is not None:
        from graphir.backends.cpu.threads import set_threads

        set_threads(threads)  # a bad count fails before any file is read
    backend = resolve_backend(backend)  # "auto": gpu when CuPy sees a device, else cpu
    get_backend(backend)  # an unknown or unavailable backend fails before any file is read
    passes = _resolved_pipeline(passes, backend)
    check_pipeline(passes)  # so does a bad pipeline, rather than the first call
    # numpy integers too, as generate() takes them; made plain ints, which the config and cache keys hold
    if ctx is not None and (isinstance(ctx, bool) or not isinstance(ctx, (int, np.integer)) or ctx < 1):
        raise InputError(f"ctx must be an int >= 1, got {ctx!r}")
    ctx = None if ctx is None else int(ctx)
    if dtype is not None:
        loader.check_dtype(dtype)  # a bad name fails before any file is read
    if kv_slots is not None and (isinstance(kv_slots, bool) or not isinstance(kv_slots, (int, np.integer))
                                 or kv_slots < 1):
        raise InputError(f"kv_slots must be an int >= 1, got {kv_slots!r}")
    kv_slots = None if kv_slots is None else int(kv_slots)
    if kv_slots is not None and tp != 1:
        raise InputError("kv_slots: tensor-parallel models keep a contiguous KV cache (load with tp=1)")
    if tp != 1 or isinstance(tp, bool):  # the workers load the model themselves, each its rank's part
        from graphir import tp_workers

        return tp_workers.load(str(spec), backend, dtype, ctx, passes, threads, tp)  # type: ignore[return-value]
    config, weights, tokenizer, eos, source = _resolve(str(spec), dtype)
    if tokenizer is not None:  # the model's ids past the tokenizer's own print as markers (models/tokenizer.py)
        tokenizer.n_ids = max(config.n_vocab, tokenizer.vocab_size)
    if dtype is not None and not str(spec).startswith("random:"):
        weights = loader.convert_weights(weights, dtype)
    if ctx is not None:
        config = loader.with_ctx(config, ctx)
    if kv_slots is not None:
        config = _with_kv_slots(config, kv_slots, source)
    return Model(config, weights, tokenizer, backend=backend, passes=passes, eos_ids=eos, source=source,
                 load_s=time.perf_counter() - t0)


def _with_kv_slots(config: ModelConfig, n: int, source: str) -> ModelConfig:
    """`config` with a KV slot pool of n slots; an InputError for a family whose graphs have none."""
    if "kv_slots" not in {f.name for f in dataclasses.fields(config)}:  # type: ignore[arg-type]
        raise InputError(f"kv_slots: {source} ({config.arch}) has no KV slot pool; only the llama family's models "
                         f"have one (Llama, Mistral, Qwen2, Qwen3)")
    return dataclasses.replace(config, kv_slots=n)  # type: ignore[type-var]


def _resolved_pipeline(passes: str, backend: str) -> str:
    """`passes` with "auto" resolved to `backend`'s pipeline name (graphir.passes.resolve_pipeline)."""
    from graphir.passes import resolve_pipeline

    return resolve_pipeline(passes, backend)


def check_pipeline(passes: str) -> None:
    """Parse `passes` without running it: an unknown pass or option raises GraphError naming it."""
    from graphir.passes import parse_pipeline

    if not isinstance(passes, str):
        raise InputError(f"passes must be a pipeline string such as 'auto', 'default' or '' (none), got {passes!r}")
    parse_pipeline(passes)


def _resolve(spec: str, dtype: str | None) -> tuple[ModelConfig, Weights, Any, set[int], str]:
    """(config, weights, tokenizer, eos ids, source label) for a spec string."""
    from graphir.models.default_model import NAMED_MODELS, named_model_path
    from graphir.models.tokenizer import Tokenizer

    if spec.startswith("random:"):
        name = spec.removeprefix("random:")
        if name not in presets.PRESETS:
            raise LoadError(f"{spec}: unknown random preset (known: {', '.join(presets.PRESETS)})")
        config, preset_dtype = presets.PRESETS[name]
        direct = dtype in (None, "f32", "f16", "bf16")
        # a quantized dtype: drawn in the preset's own type, then quantized tensor by tensor (an 8B preset
        # drawn in f32 first would hold 32 GB at once)
        weights = presets.random_weights(config, dtype or preset_dtype if direct else preset_dtype)
        if not direct:
            weights = loader.convert_weights(weights, dtype)
        tok = presets.ByteTokenizer()
        if config.n_vocab < tok.vocab_size:
            raise LoadError(f"{spec}: vocab {config.n_vocab} is smaller than the byte tokenizer's {tok.vocab_size}")
        config = loader.with_ctx(config, min(config.context_length, loader.DEFAULT_MAX_CTX))
        return config, weights, tok, tok.eos_ids, spec
    path = named_model_path(spec) if spec in NAMED_MODELS else Path(spec)
    if path.is_dir():
        config, weights, hf = loader.load_hf(path)
        tok_file = path / TOKENIZER_FILE
        tok = Tokenizer.from_file(tok_file) if tok_file.is_file() else None
        eos = tok.eos_ids if tok else _ids(hf.get("eos_token_id"))
        return config, weights, tok, eos, str(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":  # m.GGUF too
            raise LoadError(f"{path}: not a .gguf file or a model directory")
        config, weights, f = loader.load_gguf(path)
        if "tokenizer.ggml.tokens" not in f.metadata:  # weights alone (as an HF folder without tokenizer.json)
            return config, weights, None, _ids(f.metadata.get("tokenizer.ggml.eos_token_id")), str(path)
        tok = Tokenizer.from_gguf(f.metadata, source=f.label)
        tok.chat_template = tok.chat_template or registry.family_of(config).default_chat_template
        return config, weights, tok, tok.eos_ids, str(path)
    raise LoadError(f"{spec}: no such file or directory, and not a named model ({', '.join(NAMED_MODELS)}) "
                    f"or 'random:<preset>' "
                    f"(presets: {', '.join(presets.PRESETS)})")


def _writes_rows_only(graph: Graph) -> bool:
    """Whether every State write of `graph` is a row write (KV caches at kv_idx), none a whole-buffer assign
    (conv and recurrent states): then a padding token leaves the State as it found it. Every phase graph of
    a model writes the same States the same way, so any of them answers for the model."""
    return all(n.op != "assign" for n in graph.nodes())


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _ids(v: Any) -> set[int]:
    vals = v if isinstance(v, list) else [v]
    return {int(x) for x in vals if isinstance(x, int) and not isinstance(x, bool)}


@functools.lru_cache(maxsize=1024)
def least_cost_plan(n: int, pad_room: int, buckets: tuple[int, ...], call_cost: int) -> tuple[int, ...]:
    """The bucket sizes (from `buckets`, plus one-token calls) of the least modelled cost that read n tokens: a
    call costs its bucket plus call_cost; only the last call may be padded, within pad_room rows. Memoized: a
    4096-token plan takes ~10 ms of Python, which every prefill call paid before its first launch."""
    # cost[k], first[k]: modelled cost of the best plan for the last k tokens, and its first call's bucket
    cost, first = [0.0], [0]
    for k in range(1, n + 1):
        best_c, best_b = (1 + call_cost, 1) if k == 1 else (float("inf"), 0)
        for b in buckets:
            if b <= k:
                c = b + call_cost + cost[k - b]
            elif n - k + b <= pad_room:  # padded, so the plan's last call
                c = b + call_cost
            else:
                continue
            if c < best_c or (c == best_c and b > best_b):  # on a tie, the larger bucket first
                best_c, best_b = c, b
        if best_b == 0:  # nothing fits and nothing may be padded: a one-token call
            best_c, best_b = 1 + call_cost + cost[k - 1], 1
        cost.append(best_c)
        first.append(best_b)
    sizes = []
    while n > 0:
        sizes.append(first[n])
        n -= first[n]
    return tuple(sizes)
