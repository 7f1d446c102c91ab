"""Speculative decoding: a drafter proposes a few tokens, the target model checks them all in one call.

    target = graphir.load("smollm2-135m", dtype="f32")
    draft = graphir.load("smollm2-135m")                          # any model with the target's vocabulary
    ids = list(speculative.generate(target, draft, prompt, 64))   # or drafter "lookup": prompt n-grams

A verify call is the target's forward over the pending token and k drafted ones, [t, d1..dk], at
run-time positions n_past.. It is the prefill graph of a VERIFY_BUCKETS size with every row's output
kept (no new builder: positions, KV write rows and the KV length are already Inputs, so one Program
per bucket serves every position and every acceptance pattern; the ProgramCache key holds no
position). Greedy verify graphs end in the `sample` op at temperature 0, so a call returns one argmax
id per row; sampling verify graphs return the logits, which the host needs for the acceptance rule.
A call of m < b tokens is padded as Model.feed pads: padding tokens first, writing the rows past the
real ones, which no real token reads.

Greedy acceptance keeps the longest prefix of drafts equal to the target's argmax, plus the target's
token after it, so the output equals plain greedy decoding token for token. Sampling uses the
speculative-sampling rule (accept d with probability min(1, p(d)/q(d)), else draw from the residual
max(p - q, 0)), so each token is distributed exactly as the target's `sample` chain (top-k, temperature,
top-p) would draw it.

Rollback is by KV length: the rows of rejected drafts lie past the new n_past, so no call reads them
and the next one overwrites them. Whole-buffer State (Qwen3.5's conv and recurrent states, written
with `assign`) cannot roll back that way. For such models a verify call runs the family's "verify"
graph, which also writes the state after each of its tokens into per-token State rows (at the rows an
Input `step_rows` names), and is padded at the end (padding tokens come after the real ones, so they
never touch a state a real token reads). The "commit" graph then makes the row of the last accepted
token the current state (its row is an Input, `state_row`): two ordinary replayed Programs, no host
copy. A recurrent draft model drafts through 1-token verify graphs, keeping its state after the i-th
draft in row i, and rolls back the same way when the target rejects drafts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from graphir.errors import GraphError, InputError
from graphir.generate import SAMPLING_INPUT, TOKEN_OUTPUT, Settings, check_max_new_tokens, with_sampler
from graphir.ir import Graph
from graphir.models import registry
from graphir.ops import SAMPLING_FIELDS

if TYPE_CHECKING:
    from graphir.api import Model

VERIFY_BUCKETS = (2, 4, 8, 16)  # tokens per verify call: the pending token plus up to 15 drafts
MAX_DRAFT_LEN = VERIFY_BUCKETS[-1] - 1
LOOKUP = "lookup"
# Inputs of a family's "verify" and "commit" graphs (models with per-token states: models/qwen35.py)
STEP_ROWS_INPUT = "step_rows"  # [n]: the per-token State row each token's state is written to
STATE_ROW_INPUT = "state_row"  # [1]: the per-token State row that becomes the current state


@dataclass
class Draft:
    """Proposed tokens; `probs` [len(tokens), vocab]: the distribution each was drawn from, or None when
    the drafter chose them deterministically (its distribution is one-hot at the token)."""

    tokens: list[int]
    probs: np.ndarray | None = None


class Drafter(Protocol):
    """Proposes up to k tokens that continue `context` (the prompt, the tokens so far and the pending one)."""

    name: str

    def check(self, target: Model) -> None:
        """Raise InputError if this drafter cannot draft for `target`."""

    def start(self) -> None:
        """A new sequence begins."""

    def propose(self, context: Sequence[int], k: int, settings: Settings) -> Draft:
        """Up to k tokens (fewer, even none, is fine); drawn with `settings` unless greedy."""

    # optional: observe(drafted, accepted), the outcome of the verify call that checked the last proposal


# ---------------------------------------------------------------- sampling distributions
def sampling_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """f64 [vocab]: the distribution `sample_row` draws from (its kept set, softmax at temperature;
    one-hot at the first largest logit when greedy)."""
    x = np.asarray(logits, np.float64).reshape(-1)
    out = np.zeros(x.size)
    if temperature <= 0.0 or int(top_k) == 1:
        out[int(np.argmax(x))] = 1.0
        return out
    order = np.argsort(-x, kind="stable")
    if 0 < int(top_k) < x.size:
        order = order[: int(top_k)]
    w = np.exp((x[order] - x[order[0]]) / temperature)
    if top_p < 1.0:
        keep = np.cumsum(w) - w < top_p * w.sum()
        order, w = order[keep], w[keep]
    out[order] = w / w.sum()
    return out


def draw(probs: np.ndarray, u: float) -> int:
    """The first id (in id order, as `sample_row` walks) whose cumulative probability exceeds u * total."""
    cum = np.cumsum(probs)
    return int(min(int(np.searchsorted(cum, u * cum[-1], side="right")), probs.size - 1))


def _probs(logits: np.ndarray, settings: Settings) -> np.ndarray:
    return sampling_probs(logits, settings.temperature, settings.top_k, settings.top_p)


def accept_greedy(drafts: Sequence[int], target_ids: Sequence[int]) -> list[int]:
    """The longest prefix of drafts on which the target's argmax agrees, plus the target's next token.
    target_ids[i] is the target's choice after the pending token and drafts[:i]."""
    a = 0
    while a < len(drafts) and drafts[a] == target_ids[a]:
        a += 1
    return [*drafts[:a], int(target_ids[a])]


def accept_sampled(draft: Draft, p: np.ndarray, rng: np.random.Generator) -> list[int]:
    """Speculative sampling: draft token d_i (drawn from q_i) is kept with probability min(1, p_i(d)/q_i(d));
    the first rejected one is replaced by a draw from norm(max(p_i - q_i, 0)); if every draft is kept, a
    bonus token is drawn from p_k. p [len(tokens) + 1, vocab]: the target's distributions."""
    out = []
    for i, d in enumerate(draft.tokens):
        q = draft.probs[i] if draft.probs is not None else np.eye(1, p.shape[1], d)[0]
        if rng.random() * q[d] < p[i, d]:  # u < p/q without dividing by a q of 0
            out.append(int(d))
            continue
        residual = np.maximum(p[i] - q, 0.0)
        # a reject happens only where p(d) < q(d), so the residual has mass; guard rounding anyway
        out.append(draw(residual if residual.sum() > 0 else p[i], rng.random()))
        return out
    out.append(draw(p[len(draft.tokens)], rng.random()))
    return out


# ---------------------------------------------------------------- per-token states (recurrent models)
def keeps_states(model: Model) -> bool:
    """Whether the model writes whole State buffers (conv/recurrent states), which cannot roll back by KV
    length: its verify calls keep per-token states and a commit call picks one."""
    return not model._pads_safely()


def steps_graph(model: Model, b: int, sampler: bool = False) -> Graph:
    """The family's b-token "verify" graph (per-token states kept), built once; `sampler`: argmax ids out."""
    key = ("verify", b, sampler)
    if key not in model._graphs:
        graph = registry.family_of(model.config).build(model.config, "verify", b, model._dtypes)
        model._graphs[key] = with_sampler(graph) if sampler else graph
    return model._graphs[key]


def commit_graph(model: Model) -> Graph:
    """The family's "commit" graph (per-token state row STATE_ROW_INPUT becomes current), built once."""
    key = ("commit",)
    if key not in model._graphs:
        model._graphs[key] = registry.family_of(model.config).build(model.config, "commit")
    return model._graphs[key]


def _run_graph(model: Model, graph: Graph, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """Run a graph's cached Program on the model's State, adding the State buffers it writes that the model
    has not made yet (per-token state rows, zeroed: each row is written before a commit reads it)."""
    from graphir.backends.registry import get_backend
    from graphir.run_inputs import new_state

    model._ensure_state()
    passed = model.programs.passed(graph, model.passes)
    missing = [n for n in passed.states if n.name not in model._state]
    if missing:
        backend_state = getattr(get_backend(model.backend), "new_state", new_state)
        model._state.update(backend_state(Graph({n.name: n for n in missing})))
    return model.programs.get_program(graph, model.weights, model.backend, model.passes)(inputs, model._state)


def commit(model: Model, row: int) -> None:
    """Make per-token state row `row` current: the state after tokens 0..row of the last verify call."""
    _run_graph(model, commit_graph(model), {STATE_ROW_INPUT: np.array([row], np.int32)})


def step_logits(model: Model, token: int, row: int) -> np.ndarray:
    """Feed one token at n_past through the 1-token verify graph, keeping its state in row `row` as well as
    current; its logits [vocab]. n_past advances."""
    n = model.n_past
    if n + 1 > model.kv_capacity:
        raise InputError(f"1 token after {n} exceeds the {model.kv_capacity} KV rows of {model.source}")
    inputs = {"tokens": np.array([token], np.int32), "pos": np.array([n], np.int32),
              "kv_idx": np.array([n], np.int32), "kv_len": np.array([n + 1], np.int32),
              STEP_ROWS_INPUT: np.array([row], np.int32)}
    logits = _run_graph(model, steps_graph(model, 1), model._slot_inputs(inputs))["logits"]
    model.n_past = n + 1
    return np.asarray(logits)[0]


# ---------------------------------------------------------------- drafters
def _check_rollback(model: Model, role: str) -> None:
    """A model with whole-buffer State must have a family that builds "verify" and "commit" graphs."""
    if not keeps_states(model):
        return
    try:
        steps_graph(model, VERIFY_BUCKETS[0])
        commit_graph(model)
    except GraphError as e:
        raise InputError(f"speculative decoding: the {role} {model.source} ({model.config.arch}) writes whole "
                         f"State buffers, which cannot roll back by KV length, and its family builds no per-token "
                         f"state graphs ({e})") from None


class DraftModel:
    """A smaller (or quantized) model sharing the target's vocabulary drafts greedily or by sampling.
    It keeps its own KV cache: each proposal rewinds it to the tokens it shares with the context
    (rollback by KV length) and feeds the rest."""

    def __init__(self, model: Model):
        self.model = model
        self.name = f"draft model {model.source}"
        self._fed: list[int] = []  # the tokens whose KV rows the draft model holds
        self._base = 0  # recurrent draft models: per-token state row r holds the state after _fed[:_base + r]

    def check(self, target: Model) -> None:
        if self.model is target:
            raise InputError(f"speculative decoding: the draft model is the target {target.source} itself; the two "
                             f"need their own KV caches, so load the draft model separately")
        _check_vocab(self.model, target)
        _check_rollback(self.model, "draft model")

    def start(self) -> None:
        self.model.reset()
        self._fed = []
        self._base = 0

    def propose(self, context: Sequence[int], k: int, settings: Settings) -> Draft:
        m = self.model
        k = min(k, m.kv_capacity - len(context) + 1)  # the context and k - 1 drafts must fit its KV cache
        if k <= 0:
            return Draft([])
        keep = _common_prefix(self._fed, context, len(context) - 1)  # at least the last token is fed again
        if keeps_states(m):
            return self._propose_keeping_states(context, keep, k, settings)
        m.n_past = keep
        logits = m.feed(context[keep:], last_only=True)[-1]
        fed = list(context)
        tokens: list[int] = []
        probs = []
        for i in range(k):
            if settings.greedy:
                token = int(np.argmax(logits)) if i == 0 else m._decode_sample(tokens[-1], settings)
            else:
                if i:
                    logits = m.feed([tokens[-1]], last_only=True)[-1]
                probs.append(_probs(logits, settings))
                token = draw(probs[-1], settings.rng.random())
            if i:
                fed.append(tokens[-1])
            tokens.append(token)
        self._fed = fed
        return Draft(tokens, np.stack(probs) if probs else None)

    def _propose_keeping_states(self, context: Sequence[int], keep: int, k: int, settings: Settings) -> Draft:
        """A recurrent draft model: roll its state back to context[:keep] (a commit of the row kept when that
        token was fed), feed the rest of the context, the last token and each draft but the last through
        1-token verify graphs that keep their states in rows 0, 1, ..."""
        m = self.model
        if keep < self._base:  # not a continuation of the last proposal: start over
            self.start()
            keep = 0
        elif keep < len(self._fed):
            commit(m, keep - self._base)
        m.n_past = keep
        if len(context) - 1 > keep:
            m.feed(context[keep:-1])  # exact chunks: the current state follows
        tokens: list[int] = []
        probs = []
        logits = step_logits(m, context[-1], 0)
        for i in range(k):
            if i:
                logits = step_logits(m, tokens[-1], i)
            if settings.greedy:
                tokens.append(int(np.argmax(logits)))
            else:
                probs.append(_probs(logits, settings))
                tokens.append(draw(probs[-1], settings.rng.random()))
        self._fed = [*context, *tokens[:-1]]
        self._base = len(context)
        return Draft(tokens, np.stack(probs) if probs else None)


class PromptLookup:
    """No model: find the latest earlier occurrence of the context's last n tokens (n from max_ngram down
    to min_ngram) and propose the tokens that followed it. Its proposals are deterministic.
    `adaptive`: the draft length follows the verify outcomes. Copied spans are accepted whole and free text
    rejects at once, in runs, so it starts at the cap (the k asked for), doubles (2k + 1) after a call that
    kept every draft and halves after one that rejected a draft: lengths 1, 3, 7, 15 fill the verify buckets
    exactly. (Developed on edit prompts of our own, not the benchmark's: on SmolLM2's greedy outputs, with
    the cpu call costs, 2-6% faster than a fixed length at draft_len 7, and long runs of copy reach 15.)"""

    # min_ngram 2: a single repeated token predicts poorly, and a rejected draft costs a verify call of 2-3
    # decode steps on the cpu backend (SmolLM2 on 2 cores: acceptance 0.47 -> 0.81 on a paragraph edit with
    # the same tokens accepted, 0.14 -> 0.22 on a story)
    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, adaptive: bool = True):
        if not 1 <= min_ngram <= max_ngram:
            raise InputError(f"prompt lookup: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.adaptive = max_ngram, min_ngram, adaptive
        self.name = f"prompt lookup (n-grams {min_ngram}..{max_ngram}{', adaptive length' if adaptive else ''})"
        self.length: int | None = None  # adaptive: the current draft length (None: the cap, at the start)
        self._cap = 0

    def check(self, target: Model) -> None:
        pass  # it proposes ids from the context, which are the target's

    def start(self) -> None:
        self.length, self._cap = None, 0

    def observe(self, drafted: int, accepted: int) -> None:
        """Double the length after a call that kept all its drafts, halve it after one that rejected one."""
        if not self.adaptive or drafted == 0 or self.length is None:
            return
        self.length = min(2 * self.length + 1, self._cap) if accepted == drafted else max(1, self.length // 2)

    def propose(self, context: Sequence[int], k: int, settings: Settings) -> Draft:
        if self.adaptive:
            self._cap = max(self._cap, k)
            self.length = k if self.length is None else self.length
            k = min(k, self.length)
        ctx = np.asarray(context)
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            tail = ctx[-n:]
            # candidate starts s with a match ctx[s:s+n] == tail and at least one token after it (s + n < len)
            starts = np.flatnonzero(ctx[: len(ctx) - n] == tail[0])
            for s in starts[::-1]:
                if np.array_equal(ctx[s:s + n], tail):
                    return Draft([int(t) for t in ctx[s + n:s + n + k]])
        return Draft([])


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _check_vocab(draft: Model, target: Model) -> None:
    if draft.config.n_vocab != target.config.n_vocab:
        raise InputError(f"speculative decoding: the draft model {draft.source} has a vocabulary of "
                         f"{draft.config.n_vocab} tokens, the target {target.source} {target.config.n_vocab}; "
                         f"a drafter must share the target's tokenizer")
    a, b = draft.tokenizer, target.tokenizer
    if a is None or b is None:
        return  # an HF directory without tokenizer.json: the vocabulary size is all there is to compare
    if a.vocab_size != b.vocab_size:
        raise InputError(f"speculative decoding: the draft model {draft.source}'s tokenizer has {a.vocab_size} "
                         f"tokens, the target {target.source}'s {b.vocab_size}; a drafter must share the "
                         f"target's tokenizer")
    for i in np.linspace(0, b.vocab_size - 1, 64).astype(int).tolist():  # a sample: cheap, and catches a remap
        if a.token(i) != b.token(i):
            raise InputError(f"speculative decoding: token {i} is {a.token(i)!r} for the draft model "
                             f"{draft.source} but {b.token(i)!r} for the target {target.source}; a drafter "
                             f"must share the target's tokenizer")


def as_drafter(drafter: Any) -> Drafter:
    """A Drafter from a Drafter, a loaded Model (a draft model) or "lookup" (prompt lookup)."""
    from graphir.api import Model

    if isinstance(drafter, Model):
        return DraftModel(drafter)
    if drafter == LOOKUP:
        return PromptLookup()
    if all(hasattr(drafter, a) for a in ("check", "start", "propose")):
        return drafter
    raise InputError(f"speculative decoding: drafter must be a loaded Model, {LOOKUP!r} or a Drafter "
                     f"(check/start/propose), got {drafter!r}")


# ---------------------------------------------------------------- verify
def verify_bucket(m: int, room: int) -> int:
    """The verify call size for m tokens: the smallest bucket >= m whose rows fit the `room` KV rows left."""
    if m == 1:
        return 1
    return min(b for b in VERIFY_BUCKETS if b >= m and b <= room)


def max_verify_tokens(room: int) -> int:
    """The most tokens one verify call may take with `room` KV rows left (1: a plain decode step)."""
    return max([b for b in VERIFY_BUCKETS if b <= room], default=1)


def verify_graph(target: Model, b: int, greedy: bool) -> Graph:
    """The graph of a b-token verify call: the prefill graph with every row's output (the family's "verify"
    graph, keeping per-token states, for recurrent models), ending in the `sample` op (argmax ids) when
    greedy. b == 1 is the decode graph, the one plain decoding replays."""
    if b > 1 and keeps_states(target):
        return steps_graph(target, b, sampler=greedy)
    return target._graph(b, False, sampler=greedy)


def verify_program(target: Model, b: int, greedy: bool) -> Any:
    """The cached Program of verify_graph(target, b, greedy)."""
    return target.programs.get_program(verify_graph(target, b, greedy), target.weights, target.backend,
                                       target.passes)


def verify_inputs(n_past: int, tokens: Sequence[int], b: int, keep_states: bool = False) -> dict[str, np.ndarray]:
    """Inputs of a b-token call reading `tokens` at positions n_past..: the b - m padding tokens go first,
    at the rows past the real ones (which kv_len keeps from every real token), as Model.feed pads.
    `keep_states` (a verify graph keeping per-token states): padding goes last instead, so a recurrent state
    passes through the real tokens first, and token t's state goes to per-token row t."""
    m = len(tokens)
    rows = np.arange(n_past, n_past + b, dtype=np.int32)
    pad = np.full(b - m, tokens[0], np.int32)
    if keep_states:
        ids = np.concatenate([np.asarray(tokens, np.int32), pad])
        return {"tokens": ids, "pos": rows, "kv_idx": rows.copy(), "kv_len": np.array([n_past + m], np.int32),
                STEP_ROWS_INPUT: np.arange(b, dtype=np.int32)}
    pos = np.concatenate([rows[m:], rows[:m]])
    ids = np.concatenate([pad, np.asarray(tokens, np.int32)])
    return {"tokens": ids, "pos": pos, "kv_idx": pos.copy(), "kv_len": np.array([n_past + m], np.int32)}


def verify(target: Model, tokens: Sequence[int], greedy: bool) -> np.ndarray:
    """Feed `tokens` at n_past.. in one call; the target's argmax ids [m] (greedy) or logits [m, vocab].
    n_past is left unchanged: the caller advances it past the accepted tokens (and, for a model keeping
    per-token states, commits the accepted token's row)."""
    m, n = len(tokens), target.n_past
    b = verify_bucket(m, target.kv_capacity - n)
    keep = b > 1 and keeps_states(target)
    inputs = verify_inputs(n, tokens, b, keep)
    if greedy:
        inputs[SAMPLING_INPUT] = np.zeros((b, len(SAMPLING_FIELDS)), np.float32)  # temperature 0: argmax
    inputs = target._slot_inputs(inputs)  # a slot pool: rows n.. take slots; those of rejected drafts come back
    out = np.asarray(_run_graph(target, verify_graph(target, b, greedy), inputs)[TOKEN_OUTPUT if greedy else "logits"])
    return out[:m] if keep else out[b - m:]


# ---------------------------------------------------------------- the loop
@dataclass
class SpecStats:
    verify_calls: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    new_tokens: int = 0  # tokens produced by verify calls (accepted drafts plus the target's own)
    accepted_per_call: list[int] = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return self.new_tokens / self.verify_calls if self.verify_calls else 0.0


def generate(target: Model, drafter: Any, prompt_ids: Sequence[int], max_new_tokens: int, draft_len: int = 4,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
             stop_at_eos: bool = True) -> Iterator[int]:
    """Yield new token ids as Model.generate does, with `drafter` (a Model, "lookup" or a Drafter) proposing
    up to `draft_len` tokens per verify call. Greedy output equals plain greedy decoding token for token;
    sampled output has the target's distribution. Everything is checked before the first token is asked
    for; target.stats gains verify_calls, draft_tokens, accepted_tokens (see `last_stats`)."""
    ids = target._check_ids(prompt_ids)
    check_max_new_tokens(max_new_tokens)
    if isinstance(draft_len, bool) or not isinstance(draft_len, (int, np.integer)) or not 1 <= draft_len:
        raise InputError(f"draft_len must be an int >= 1, got {draft_len!r}")
    if draft_len > MAX_DRAFT_LEN:
        raise InputError(f"draft_len {draft_len} is above the largest verify bucket: a verify call reads the "
                         f"pending token and the drafts, at most {VERIFY_BUCKETS[-1]} tokens "
                         f"(VERIFY_BUCKETS {VERIFY_BUCKETS}), so draft_len <= {MAX_DRAFT_LEN}")
    target._check_fits(len(ids), int(max_new_tokens))
    settings = Settings(temperature, top_k, top_p, seed)
    drafter = as_drafter(drafter)
    _check_rollback(target, "target")
    drafter.check(target)
    return _run(target, drafter, ids.tolist(), int(max_new_tokens), int(draft_len), settings, stop_at_eos)


def last_stats(target: Model) -> SpecStats:
    """The SpecStats of the target's latest speculative generation."""
    return target.stats["speculative"]


def _run(target: Model, drafter: Drafter, prompt: list[int], max_new: int, draft_len: int, settings: Settings,
         stop_at_eos: bool) -> Iterator[int]:
    if max_new <= 0:
        return
    stats = SpecStats()
    target.reset()
    target._clear_run_stats()
    target.stats["speculative"] = stats
    drafter.start()
    context = list(prompt)
    seq = target._sequence
    token = target._prefill_sample(prompt, settings)  # the first token, exactly as plain generation reads it
    at = target.n_past  # where this generator left the cache: a call since the last yield moves it
    produced = 0
    while True:
        if stop_at_eos and token in target.eos_ids:
            return
        yield token
        produced += 1
        context.append(token)
        if produced == max_new:
            return
        target._check_sequence(seq, at)  # a call since the last yield may have used the cache
        t0 = time.perf_counter()
        new = _step(target, drafter, context, min(draft_len, max_new - produced - 1), settings, stats)
        at = target.n_past
        target._add_stats("decode", len(new), t0)
        for t in new[:-1]:  # the last one is the next pending token
            if stop_at_eos and t in target.eos_ids:
                return
            yield t
            produced += 1
            context.append(t)
        token = new[-1]


def _step(target: Model, drafter: Drafter, context: list[int], k: int, settings: Settings,
          stats: SpecStats) -> list[int]:
    """One draft-and-verify round after `context` (its last token pending: not yet fed to the target);
    the new tokens, at least one. target.n_past moves past the pending token and the accepted drafts."""
    k = min(k, max_verify_tokens(target.kv_capacity - target.n_past) - 1)
    draft = drafter.propose(context, k, settings) if k > 0 else Draft([])
    draft = Draft(draft.tokens[:k], None if draft.probs is None else draft.probs[:k])
    tokens = [context[-1], *draft.tokens]
    if settings.greedy:  # nothing drafted: a 1-token call, the decode Program plain decoding replays
        new = accept_greedy(draft.tokens, verify(target, tokens, greedy=True))
    else:
        logits = verify(target, tokens, greedy=False)
        new = accept_sampled(draft, np.stack([_probs(row, settings) for row in logits]), settings.rng)
    if len(tokens) > 1 and keeps_states(target):
        commit(target, len(new) - 1)  # the state after the pending token and the accepted drafts
    target.n_past += len(new)  # the pending token and the accepted drafts; the rest roll back (slots freed)
    stats.verify_calls += 1
    stats.draft_tokens += len(draft.tokens)
    stats.accepted_tokens += len(new) - 1
    stats.new_tokens += len(new)
    stats.accepted_per_call.append(len(new) - 1)
    if hasattr(drafter, "observe"):
        drafter.observe(len(draft.tokens), len(new) - 1)
    return new


# ---------------------------------------------------------------- benchmark (graphir bench --draft)
def _decode_seconds(run: Iterator[int]) -> tuple[list[int], float]:
    """(tokens, seconds from the first token to the last): the decode time after the prompt's token."""
    out = [next(run)]
    t0 = time.perf_counter()
    out += list(run)
    return out, time.perf_counter() - t0


def bench_draft(target: Model, drafter: Any, prompt: Sequence[int], n: int, draft_len: int,
                repeats: int) -> dict[str, Any]:
    """Greedy speculative decoding of n tokens after `prompt` against plain greedy decoding, in this run:
    one untimed round of each (lowering, warm-up), then `repeats` rounds alternating plain and speculative
    (a slow spell of a shared machine hits both alike), best of each kept. Decode tok/s counts the n - 1
    tokens after the first over the time after it, as `graphir bench`'s decode rate does."""
    plain_s, spec_s = [], []
    plain = spec = []
    for r in range(repeats + 1):
        plain, dt_plain = _decode_seconds(iter(target.generate(prompt, n, stop_at_eos=False)))
        spec, dt_spec = _decode_seconds(generate(target, drafter, prompt, n, draft_len, stop_at_eos=False))
        if r:
            plain_s.append(dt_plain)
            spec_s.append(dt_spec)
    st = last_stats(target)
    plain_rate, spec_rate = (n - 1) / min(plain_s), (n - 1) / min(spec_s)
    return {"draft_len": draft_len, "draft_acceptance": st.acceptance, "draft_tokens_per_verify": st.tokens_per_verify,
            "draft_verify_calls": st.verify_calls, "draft_plain_tok_s_best": plain_rate,
            "draft_decode_tok_s_best": spec_rate, "draft_speedup": spec_rate / plain_rate,
            "draft_equals_plain": spec == plain}
