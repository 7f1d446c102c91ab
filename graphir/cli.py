"""The `graphir` command line: composes model building, passes, backends and dumps.

    graphir passes                                   list registered passes
    graphir dump example --layers 0 -o g.html        look at a graph (text, dot, json, html)
    graphir dump example --passes default --diff     what a pipeline changes (-o diff.html: side by side)
    graphir run example -p "Hi" -n 8                 run the built-in example graph
    graphir run smollm2-135m -p "Once upon a time"   generate text with a model
    graphir check smollm2-135m -p default            does a pipeline keep the math? (exit 1 if not)
    graphir coverage smollm2-135m -p default         where each pass of a pipeline fired, or why not
    graphir bench smollm2-135m --json bench.json     load, TTFT, prefill and decode tok/s, RSS, bandwidth limit

Modules that other stages provide (graphir.api, graphir.passes) are imported lazily, so
`dump` and `run example` work before any model or pass exists. Options (backend, pass pipeline,
layers, numbers) are checked before any model loads. Every failure is one line on stderr, never
a traceback: `error: <message>`, exit code 2 for a bad option, 1 for a GraphirError.
"""

from __future__ import annotations

import importlib
import io
import math
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import click
import numpy as np
from click.core import ParameterSource

from graphir import __version__
from graphir.backends.registry import AUTO, BACKENDS
from graphir.dump import FORMATS, diff_graphs, dump, load_json, parse_layers
from graphir.errors import GraphirError, LoadError
from graphir.ir import Graph
from graphir.models.default_model import DEFAULT_MODEL, check_spec
from graphir.models.hf_dir import TOKENIZER_FILE, read_text
from graphir.models.loader import DEFAULT_MAX_CTX, check_dtype
from graphir.passes import AUTO as AUTO_PIPELINE
from graphir.passes import PASSES, parse_pipeline, pipelines, resolve_pipeline, run_pipeline, spell_pipeline

DEFAULT_DRAFT_LEN = 4
MAX_DRAFT_LEN = 15  # graphir.speculative.MAX_DRAFT_LEN (not imported here: it pulls in the model stack)
_EXTENSIONS = {".txt": "text", ".dot": "dot", ".gv": "dot", ".json": "json", ".html": "html", ".htm": "html"}


class CliError(click.ClickException):
    """A user-facing failure: printed as `error: <message>`, exit code 1."""

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class CliUsageError(click.UsageError):
    """A bad command line: printed as one `error: <message>` line (no usage block), exit code 2."""

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class GraphirGroup(click.Group):
    """Turns any GraphirError or usage error raised by a command into a one-line error."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except GraphirError as e:
            raise CliError(str(e)) from None
        except click.UsageError as e:  # includes BadParameter from option types and callbacks
            if isinstance(e, CliUsageError):
                raise
            raise CliUsageError(e.format_message(), e.ctx) from None


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that refuses nan and inf, which pass FloatRange's bounds (every nan comparison is False)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


BACKEND_CHOICE = click.Choice([*BACKENDS, AUTO])


def _pipeline_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Parse a --passes pipeline without running it, so a bad name or option fails before any model loads."""
    if value:
        try:
            parse_pipeline(value)
        except GraphirError as e:
            raise click.BadParameter(str(e), ctx, param) from None
    return value


def _backend_pipeline_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A --passes of a command that runs on a backend: "auto" (that backend's pipeline, resolved once the backend
    is known) or a pipeline checked as _pipeline_option checks it."""
    return value if value == AUTO_PIPELINE else _pipeline_option(ctx, param, value)


# --passes of run, chat and bench: each backend's own pipeline unless told
PASSES_DEFAULT_HELP = ("  [default: auto: the backend's pipeline, reference `default`, cpu `cpu`, gpu `gpu`; "
                       "`default` keeps every product in f32]")


def _checked_backend(name: str) -> str:
    """The backend `name` resolves to ("auto": gpu or cpu), importable here; checked before any model loads."""
    from graphir.backends import registry

    resolved = registry.resolve_backend(name)
    registry.get_backend(resolved)  # gpu without CuPy or a device: a one-line BackendError now, not after loading
    return resolved


@click.group(cls=GraphirGroup)
@click.version_option(__version__, prog_name="graphir")
def main() -> None:
    """graphir: see and change what a language model computes."""


# ---------------------------------------------------------------- passes
@main.command("passes")
def passes_cmd() -> None:
    """List the registered graph passes with a one-line description each, then each named pipeline's passes."""
    width = max(len(name) for name in PASSES)
    for name, p in PASSES.items():
        click.echo(f"{name:<{width}}  {p.description}")
    click.echo("\npipelines (a name in --passes runs these in order):")
    for name, members in pipelines().items():
        click.echo(f"{name} = {', '.join(members)}")


# ---------------------------------------------------------------- dump
def _output_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An output file whose folder exists: a typo in the folder fails now, not after the model ran (bench) and
    not as a traceback."""
    if value is not None:
        folder = Path(value).parent
        if not folder.exists():
            raise click.BadParameter(f"{value}: folder '{folder}' does not exist", ctx, param)
        if not folder.is_dir():
            raise click.BadParameter(f"{value}: '{folder}' is not a folder", ctx, param)
    return value


def _write_file(path: str, text: str) -> None:
    """Write an output file; a failure the option check could not foresee (no permission, a full disk) is one
    line naming the file."""
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise CliError(f"{path}: cannot write: {e.strerror or e}") from None


def _layers_option(ctx: click.Context, param: click.Parameter, value: str | None) -> set[int] | None:
    try:
        return parse_layers(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def load_graph(spec: str, phase: str, draft_len: int = 4) -> Graph:
    """`example`, a `.json` graph file, or a model spec resolved by graphir.api. Phase "verify": the greedy
    verify graph of a speculative decoding call with `draft_len` drafts (the bucket that call uses)."""
    if phase == "verify":
        if spec == "example" or spec.endswith(".json"):
            raise CliUsageError("--phase verify builds a model's speculative verify graph; give a model spec")
        from graphir import speculative

        model = _load_for_graphs(spec)
        most = speculative.max_verify_tokens(model.config.ctx) - 1  # the bucket's rows must fit the KV cache
        if draft_len > most:
            raise CliError(f"--draft-len {draft_len}: a verify call of {draft_len + 1} tokens does not fit the "
                           f"context of {model.config.ctx} tokens" + (f" (at most --draft-len {most})" if most else ""))
        bucket = speculative.verify_bucket(draft_len + 1, model.config.ctx)
        return speculative.verify_graph(model, bucket, greedy=True)
    if spec == "example":
        from graphir.examples import build_example

        return build_example(phase)
    if spec.endswith(".json"):
        path = Path(spec)
        if not path.is_file():
            raise CliError(f"{spec}: no such graph file")
        text = read_text(path)  # a binary file is a LoadError naming it
        try:
            graph = load_json(text)
        except GraphirError as e:
            raise LoadError(f"{spec}: {e}") from None
        # --phase builds a model's graph: a file holds one, so another phase asked for printed it without a word
        ctx = click.get_current_context(silent=True)
        given = ctx is not None and ctx.get_parameter_source("phase") not in (None, ParameterSource.DEFAULT)
        if given and graph.meta.get("phase", phase) != phase:
            raise CliUsageError(f"{spec} holds a {graph.meta['phase']} graph; --phase {phase} chooses which graph "
                                f"of a model to build")
        return graph
    return _load_for_graphs(spec).graph(phase)


def _load_for_graphs(spec: str) -> Any:
    """A model whose graphs and weights are read, never run: no backend to import, no passes to apply."""
    return _api().load(spec, backend="reference", passes="")


def _api() -> Any:
    """graphir.api, imported when a command needs a model (it pulls in the model stack)."""
    return importlib.import_module("graphir.api")


def _emit(text: str, output: str | None) -> None:
    if output is None:
        click.echo(text, nl=False)
        return
    _write_file(output, text)
    click.echo(f"wrote {output} ({len(text.encode())} bytes)", err=True)


@main.command("dump")
@click.argument("spec")
@click.option("--phase", type=click.Choice(["prefill", "decode", "verify"]), default="prefill", show_default=True,
              help="which graph of a model to build (verify: a speculative decoding verify call, greedy)")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="output format; default from -o's extension, else text")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, callback=_output_option,
              help="write here instead of stdout")
@click.option("--layers", default=None, callback=_layers_option,
              help="show only these layers (blk.N), fold the rest: 0..1, 3, 0,2,5 or all")
@click.option("--passes", "pipeline", default=None, callback=_pipeline_option,
              help="run this pass pipeline first (see `graphir passes`)")
@click.option("--diff", is_flag=True,
              help="print what --passes changed (op counts, then lines) instead; -o x.html: side by side")
@click.option("--draft-len", type=click.IntRange(1, MAX_DRAFT_LEN), default=None,
              help="--phase verify: drafts per call; the verify graph is the smallest bucket holding them and "
                   "the pending token  [default: 4]")
def dump_cmd(spec: str, phase: str, fmt: str | None, output: str | None, layers: set[int] | None,
             pipeline: str | None, diff: bool, draft_len: int | None) -> None:
    """Print a graph. SPEC: `example`, a graph .json file, or a model spec (e.g. smollm2-135m)."""
    if diff and not pipeline:
        raise click.UsageError("--diff needs --passes P: the pipeline whose changes to show")
    if diff and fmt not in (None, "text", "html"):
        raise click.UsageError(f"--diff writes text or html, not --format {fmt}")
    if fmt is None:
        fmt = _EXTENSIONS.get(Path(output).suffix.lower(), "text") if output else "text"
        if diff and fmt != "html":  # a diff is text or a side-by-side page: -o diff.txt (or .dot) gets text
            fmt = "text"
    if fmt == "json" and layers is not None:
        raise click.UsageError("--layers folds text, dot and html views; JSON always holds the whole graph")
    if draft_len is not None and phase != "verify":
        raise click.UsageError("--draft-len chooses the verify graph's bucket; it needs --phase verify")
    graph = load_graph(spec, phase, draft_len or DEFAULT_DRAFT_LEN)
    if pipeline:
        after = run_pipeline(graph, pipeline)
        if diff:
            from graphir.diff import diff_html  # html and the side-by-side view: not on `run`'s path

            _emit((diff_html if fmt == "html" else diff_graphs)(graph, after, layers), output)
            return
        graph = after
    _emit(dump(graph, fmt, layers), output)


# ---------------------------------------------------------------- run
def _sampling_options(fn: Callable) -> Callable:
    """--temperature, --top-k, --top-p and --seed, as run and chat take them. Greedy by default, so
    a command line in the README prints the same text every time."""
    options = [
        click.option("--temperature", type=FiniteFloatRange(min=0.0), default=0.0, show_default=True,
                     help="0 is greedy (top-k/top-p then do nothing); llama.cpp's default is 0.8"),
        click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True, help="0 disables"),
        click.option("--top-p", type=FiniteFloatRange(0.0, 1.0, min_open=True), default=0.95, show_default=True,
                     help="1 disables"),
        click.option("--seed", type=click.IntRange(min=0), default=None,
                     help="sampling seed (default: fresh each run)"),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _draft_options(fn: Callable) -> Callable:
    """--draft and --draft-len, as run and bench take them."""
    fn = click.option("--draft-len", type=click.IntRange(1, MAX_DRAFT_LEN), default=None,
                      help=f"--draft: tokens drafted per verify call  [default: {DEFAULT_DRAFT_LEN}]")(fn)
    return click.option("--draft", default=None, metavar="MODEL|lookup",
                        help="speculative decoding: a draft model sharing the tokenizer (a model spec), or "
                             "'lookup' (prompt n-grams); output equals plain decoding when greedy")(fn)


def _load_options(backend_help: str, passes_help: str, ctx_holds: str) -> Callable[[Callable], Callable]:
    """--backend, --passes and --ctx, as run and chat take them; `ctx_holds` says what the KV cache keeps."""
    options = [
        click.option("--backend", type=BACKEND_CHOICE, default=None, help=backend_help),
        click.option("--passes", "pipeline", default=AUTO_PIPELINE, callback=_backend_pipeline_option,
                     help=passes_help + PASSES_DEFAULT_HELP),
        click.option("--ctx", type=click.IntRange(min=1), default=None,
                     help=f"KV-cache capacity in tokens, {ctx_holds}  [default: the model's context, at most "
                          f"{DEFAULT_MAX_CTX}]"),
    ]

    def add(fn: Callable) -> Callable:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return add


def _checked_dtype(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A --dtype that is no weight type fails before the model loads, as every other option does."""
    if value is not None:
        try:
            check_dtype(value)
        except GraphirError as e:
            raise click.BadParameter(str(e), ctx, param) from None
    return value


def _dtype_option(fn: Callable) -> Callable:
    return click.option("--dtype", default=None, callback=_checked_dtype,
                        help="convert the weights on load, e.g. q4_0 (the project's quantizer) or bf16  [default: as "
                             "stored]")(fn)


def _threads_option(fn: Callable) -> Callable:
    return click.option("--threads", type=click.IntRange(min=1), default=None,
                        help="cpu backend kernel threads  [default: auto: all of numba's pool while the machine is "
                             "quiet, one fewer per core other programs keep busy]")(fn)


def _tp_option(fn: Callable) -> Callable:
    return click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
                        help="tensor parallel over N processes: one per GPU (NCCL) on gpu, sharing memory on cpu")(fn)


@main.command("run")
@click.argument("model", default=DEFAULT_MODEL)
@click.option("-p", "--prompt", default="The capital of France is", show_default=True)
@click.option("-n", "--max-new-tokens", "n", type=click.IntRange(min=0), default=32, show_default=True)
@_sampling_options
@_load_options(backend_help="default: auto (gpu when CuPy sees a device, else cpu); reference for `example`",
               passes_help="pass pipeline applied before lowering ('' for none; see `graphir passes`)",
               ctx_holds="prompt included")
@_dtype_option
@_threads_option
@_draft_options
@_tp_option
def run_cmd(model: str, prompt: str, n: int, temperature: float, top_k: int, top_p: float, seed: int | None,
            backend: str | None, pipeline: str, ctx: int | None, dtype: str | None, threads: int | None,
            draft: str | None, draft_len: int | None, tp: int) -> None:
    """Generate text: stream it to stdout, progress and timings to stderr.

    MODEL `example` runs the built-in 2-layer example graph instead: random weights,
    prompt bytes as token ids, greedy decoding, and a summary of the logits.
    """
    if model == "example":
        if dtype:
            raise click.UsageError("--dtype needs a model: the example graph draws its own f32 weights")
        if draft:
            raise click.UsageError("--draft needs a model: the example graph has no tokenizer to share")
        _check_example_options()
        _run_example(prompt, n, seed or 0, backend or "reference")
        return
    _check_draft_len(draft, draft_len)
    if tp > 1 and draft:
        raise click.UsageError("--draft does not run with --tp yet")
    backend = _checked_backend(backend or AUTO)
    pipeline = resolve_pipeline(pipeline, backend)
    _check_runnable(model)
    if draft and draft != "lookup":
        _check_runnable(draft)
    api = _api()
    click.echo(f"loading {model} on {backend} (passes {pipeline or '(none)'}) ...", err=True)
    t0 = time.perf_counter()
    # --threads only when given: without it load() leaves the thread setting as it is (auto)
    lm = api.load(model, backend=backend, passes=pipeline, ctx=ctx, dtype=dtype,
                  **({"threads": threads} if threads else {}), **({"tp": tp} if tp > 1 else {}))
    load_s = time.perf_counter() - t0
    if lm.tokenizer is None:  # a GGUF file without tokenizer metadata (folders are checked before loading)
        raise CliError(f"{model}: has no tokenizer (no tokenizer.ggml.tokens); `graphir run` needs one to encode "
                       f"the prompt (graphir.load() loads this model without a tokenizer: generate from token ids)")
    ids = lm.tokenizer.encode(prompt)
    click.echo(f"prompt: {len(ids)} tokens", err=True)
    if not ids:  # -p '' and a tokenizer that adds no BOS: the model's own check speaks of an array's shape
        raise CliError(f"{model}: the prompt is empty (0 tokens); give -p TEXT")
    _check_context(lm.config, len(ids), n)
    drafter = _load_drafter(api, draft, backend, pipeline, lm.config.ctx)
    spec = {"draft": drafter, "draft_len": draft_len or DEFAULT_DRAFT_LEN} if drafter is not None else {}
    # generate() checks its arguments when called, so every error so far precedes the echoed prompt.
    tokens = lm.generate(ids, max_new_tokens=n, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         **spec)
    first_s, count, total_s = _stream_text(prompt, tokens, lm.tokenizer)
    stats = dict(getattr(lm, "stats", None) or {})
    click.echo(_timings(stats, load_s, first_s, count, total_s), err=True)
    if drafter is not None and "speculative" in stats:
        click.echo(_speculative_line(stats["speculative"], draft, spec["draft_len"]), err=True)


# run's options that `run example` has no use for (it decodes its fixed graph greedily, in one process, with no
# passes and its own KV capacity): given, they changed nothing without a word
_NOT_FOR_EXAMPLE = ("ctx", "pipeline", "threads", "tp", "temperature", "top_k", "top_p")


def _check_example_options() -> None:
    ctx = click.get_current_context()
    for param in ctx.command.params:
        if param.name in _NOT_FOR_EXAMPLE and ctx.get_parameter_source(param.name) is not ParameterSource.DEFAULT:
            raise click.UsageError(f"{param.opts[-1]} needs a model: `run example` decodes its fixed 2-layer graph "
                                   f"(its own KV capacity) greedily, with no passes, in one process")


def _check_draft_len(draft: str | None, draft_len: int | None) -> None:
    if draft_len is not None and not draft:
        raise click.UsageError("--draft-len needs --draft MODEL or --draft lookup")


def _load_drafter(api: Any, draft: str | None, backend: str, pipeline: str, ctx: int) -> Any:
    """None, "lookup", or the draft model loaded like the target (backend, passes, the target's context)."""
    if not draft or draft == "lookup":
        return draft or None
    click.echo(f"loading draft model {draft} on {backend} ...", err=True)
    return api.load(draft, backend=backend, passes=pipeline, ctx=ctx)


def _speculative_line(st: Any, draft: str | None, draft_len: int) -> str:
    return (f"speculative ({draft}, draft-len {draft_len}): {st.verify_calls} verify calls, "
            f"acceptance {st.acceptance:.2f} ({st.accepted_tokens}/{st.draft_tokens} drafts), "
            f"{st.tokens_per_verify:.2f} tokens per verify")


# ---------------------------------------------------------------- chat
@main.command("chat")
@click.argument("model", default=DEFAULT_MODEL)
@click.option("-p", "--prompt", default=None, help="one user turn: print the reply and exit (default: interactive)")
@click.option("--system", default=None, help="a system message before the first turn")
@click.option("-n", "--max-new-tokens", "n", type=click.IntRange(min=1), default=256, show_default=True,
              help="longest reply, in tokens")
@_sampling_options
@_load_options(backend_help="default: auto (gpu when CuPy sees a device, else cpu)",
               passes_help="pass pipeline applied before lowering ('' for none)",
               ctx_holds="the whole conversation included")
@_dtype_option
def chat_cmd(model: str, prompt: str | None, system: str | None, n: int, temperature: float, top_k: int,
             top_p: float, seed: int | None, backend: str | None, pipeline: str, ctx: int | None,
             dtype: str | None) -> None:
    """Talk to MODEL with its own chat template: one turn with -p, else read turns from stdin until EOF.

    The conversation stays in the KV cache, so each turn reads only its new tokens.
    """
    backend = _checked_backend(backend or AUTO)
    pipeline = resolve_pipeline(pipeline, backend)
    _check_runnable(model)
    click.echo(f"loading {model} on {backend} (passes {pipeline or '(none)'}) ...", err=True)
    lm = _api().load(model, backend=backend, passes=pipeline, ctx=ctx, dtype=dtype)
    if lm.tokenizer is None or not getattr(lm.tokenizer, "chat_template", None):
        raise CliError(f"{model}: no chat template in the model's files; use `graphir run` for raw completion")
    messages = [{"role": "system", "content": system}] if system else []
    turns = [prompt] if prompt is not None else _stdin_turns()
    for text in turns:
        messages.append({"role": "user", "content": text})
        _check_context(lm.config, len(lm.conversation.prompt_ids(messages)), n, "the conversation ({} tokens)")
        ids = lm.conversation.reply(messages, n, temperature, top_k, top_p, seed)
        add_token, flush = _text_stream(lm.tokenizer)
        pieces = []
        for token in ids:
            pieces.append(add_token(int(token)))
            click.echo(pieces[-1], nl=False)  # click.echo flushes, so the reply streams
        pieces.append(flush())
        click.echo(pieces[-1])
        messages.append({"role": "assistant", "content": "".join(pieces)})


def _stdin_turns() -> Iterable[str]:
    """User turns typed at a '> ' prompt (on stderr, so stdout holds only replies), until EOF."""
    # One UTF-8 wrapper of the byte stream (a second one would lose what the first buffered); click's
    # get_text_stream did this but is deprecated and goes in Click 9.
    stdin = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8") if hasattr(sys.stdin, "buffer") else sys.stdin
    while True:
        click.echo("> ", err=True, nl=False)
        try:
            line = stdin.readline()
        except UnicodeDecodeError as e:  # a line in another encoding: the codec's traceback named no input
            raise CliError(f"stdin is not valid UTF-8: byte {e.object[e.start:e.start + 1].hex()} "
                           f"({e.reason})") from None
        if not line:
            click.echo(err=True)
            return
        if line.strip():
            yield line.rstrip("\n")


def _no_weights(spec: str) -> CliError:
    return CliError(f"{spec}: a graph file has no weights to run; use a model spec or `example`")


def _check_runnable(spec: str) -> None:
    """What `run` can tell before loading: a graph file has no weights, an HF directory needs its tokenizer."""
    if spec.endswith(".json"):
        raise _no_weights(spec)
    check_spec(spec)
    path = Path(spec)
    # a folder without config.json is no model folder: load() names that, the missing tokenizer would mislead
    if path.is_dir() and (path / "config.json").is_file() and not (path / TOKENIZER_FILE).is_file():
        raise LoadError(f"{path / TOKENIZER_FILE}: missing; `graphir run` needs it to encode the prompt "
                        f"(graphir.load() loads this model without a tokenizer)")


def _check_context(config: Any, n_prompt: int, n_new: int, what: str = "prompt of {} tokens") -> None:
    """The model's own check names load(..., ctx=N); on the command line the knob is --ctx."""
    if n_prompt + n_new > config.ctx:
        raise CliError(f"{what.format(n_prompt)} + -n {n_new} exceeds the context of {config.ctx} tokens; "
                       f"raise it with --ctx N (the model was trained for {config.context_length})")


def _stream_text(prompt: str, tokens: Iterable[int], tokenizer: Any) -> tuple[float | None, int, float]:
    """Echo the prompt, then each token's text as it comes; (first token s, tokens, total s).
    A failure mid-stream ends the line first, so its error message starts a line of its own."""
    add_token, flush = _text_stream(tokenizer)
    click.echo(prompt, nl=False)
    t0 = time.perf_counter()
    first_s: float | None = None
    count = 0
    try:
        for token in tokens:
            if first_s is None:
                first_s = time.perf_counter() - t0
            count += 1
            click.echo(add_token(int(token)), nl=False)  # click.echo flushes, so text streams
    except BaseException:  # KeyboardInterrupt too: the shell prompt should not land on the text either
        click.echo()
        raise
    click.echo(flush())
    return first_s, count, time.perf_counter() - t0


def _text_stream(tokenizer: Any) -> tuple[Callable[[int], str], Callable[[], str]]:
    """(push one id -> text, flush -> rest) from the tokenizer's streaming decoder, `stream()`."""
    if not hasattr(tokenizer, "stream"):
        raise CliError(f"tokenizer {type(tokenizer).__name__} has no streaming decoder (stream())")
    decoder = tokenizer.stream()
    return decoder.push, decoder.flush


def _rate(tokens: Any, seconds: Any) -> str:
    if not tokens or not seconds:
        return "-"
    return f"{tokens} tok, {tokens / seconds:.1f} tok/s"


def _timings(stats: dict[str, Any], load_s: float, first_s: float | None, count: int, total_s: float) -> str:
    """One stderr line; model.stats wins where present, else our own wall-clock measurements."""
    decode_tokens = stats.get("decode_tokens", max(count - 1, 0))
    decode_s = stats.get("decode_s", total_s - (first_s or 0.0))
    parts = [f"load {stats.get('load_s', load_s):.2f} s",
             "first token " + (f"{first_s:.3f} s" if first_s is not None else "-"),
             "prefill " + _rate(stats.get("prefill_tokens"), stats.get("prefill_s")),
             "decode " + _rate(decode_tokens, decode_s)]
    return " | ".join(parts)


def _run_example(prompt: str, n: int, seed: int, backend: str) -> None:
    from graphir.examples import ExampleConfig, run_example

    ids = list(prompt.encode("utf-8"))
    config = ExampleConfig()
    click.echo(f"example: {config.n_layers}-layer decoder, random weights (seed {seed}), {backend} backend; "
               f"prompt = {len(ids)} byte tokens", err=True)
    run = run_example(ids, max_new_tokens=n, seed=seed, backend=backend, config=config)
    logits = run.prefill_logits
    click.echo(f"logits {list(logits.shape)} f32: min {logits.min():.4f} max {logits.max():.4f} "
               f"mean {logits.mean():.4f} std {logits.std():.4f}")
    click.echo("last row, first 8: " + np.array2string(logits[-1, :8], precision=4, separator=", "))
    click.echo(f"generated ids (greedy): {' '.join(map(str, run.generated)) or '(none)'}")
    t = run.timings
    click.echo(f"prefill {len(ids)} tok in {t['prefill_s']:.3f} s | "
               f"decode {_rate(max(n - 1, 0), t['decode_s'])} (replaying one Program)", err=True)


# ---------------------------------------------------------------- check, coverage
_SITES_HELP = "sites listed per pass, matched and rejected each (0: all)"
_ALL_SITES = 1 << 30


@main.command("check")
@click.argument("model", default=DEFAULT_MODEL)
@click.option("-p", "--passes", "pipeline", default="default", show_default=True, callback=_pipeline_option,
              help="the pass pipeline to check (see `graphir passes`)")
@click.option("--phase", type=click.Choice(["prefill", "decode"]), default="prefill", show_default=True)
@click.option("--n-tokens", type=click.IntRange(min=1), default=None,
              help="prefill length  [default: 7; decode is always 1]")
@click.option("--tol", type=FiniteFloatRange(min=0.0), default=None,
              help="largest allowed error relative to a tensor's max |value|  [default: 1e-4]")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="seed of the random inputs and state")
@click.option("--sites", type=click.IntRange(min=0), default=4, show_default=True, help=_SITES_HELP)
def check_cmd(model: str, pipeline: str, phase: str, n_tokens: int | None, tol: float | None, seed: int,
              sites: int) -> None:
    """Check that a pass pipeline keeps the math, on the reference backend.

    Runs MODEL's graph without and with the pipeline on the same random valid inputs (positions
    0..n-1 on an empty cache, then later positions on a random cache and state), prints each
    output's and State buffer's error, the first named tensor that diverges, and the pipeline's
    coverage report. Exits 1 when any of them is beyond tolerance. MODEL: a model spec
    (smollm2-135m, random:llama-tiny, a .gguf, an HF directory) or `example`.
    """
    from graphir.check import DEFAULT_TOL, check

    if phase == "decode" and n_tokens not in (None, 1):
        raise click.UsageError("--phase decode runs one token; drop --n-tokens")
    n = 1 if phase == "decode" else n_tokens or 7
    graph, weights = _graph_and_weights(model, phase, n)
    t0 = time.perf_counter()
    report = check(graph, weights, pipeline, tol=DEFAULT_TOL if tol is None else tol, seed=seed)
    click.echo(report.text(coverage=True, max_sites=sites or _ALL_SITES, summary=False), nl=False)
    click.echo(f"checked in {time.perf_counter() - t0:.1f} s", err=True)
    if not report.ok:
        raise CliError(report.summary())
    click.echo(report.summary())


def _graph_and_weights(spec: str, phase: str, n_tokens: int) -> tuple[Graph, Any]:
    """The graph to check and its weights: `example` (random weights) or a model spec."""
    if spec == "example":
        from graphir.examples import ExampleConfig, build_example, example_weights

        _check_n_tokens(spec, n_tokens, ExampleConfig().ctx)
        graph = build_example(phase, n_tokens)
        return graph, example_weights(graph)
    if spec.endswith(".json"):
        raise _no_weights(spec)
    lm = _load_for_graphs(spec)
    _check_n_tokens(spec, n_tokens, lm.config.ctx)
    return lm.graph(phase, n_tokens), lm.weights


def _check_n_tokens(spec: str, n_tokens: int, ctx: int) -> None:
    """The checked prefill writes KV rows 0..n-1: past the cache, the failure was a set_rows node's row range."""
    if n_tokens > ctx:
        raise CliError(f"--n-tokens {n_tokens} exceeds the context of {spec} ({ctx} tokens)")


@main.command("coverage")
@click.argument("spec", default=DEFAULT_MODEL)
@click.option("-p", "--passes", "pipeline", default="default", show_default=True, callback=_pipeline_option,
              help="the pass pipeline to report on (see `graphir passes`)")
@click.option("--phase", type=click.Choice(["prefill", "decode"]), default="prefill", show_default=True)
@click.option("--sites", type=click.IntRange(min=0), default=4, show_default=True, help=_SITES_HELP)
def coverage_cmd(spec: str, pipeline: str, phase: str, sites: int) -> None:
    """Print where each pass of a pipeline fired (matched sites) and the candidates it rejected, with why.

    Per pass: sites matched, sites rejected and node counts before -> after. A fusion that stops
    firing shows up here as a rejected site and its reason. SPEC: as for `graphir dump`.
    Runs nothing; `graphir check` adds the numerical comparison.
    """
    from graphir.passes import coverage

    click.echo(coverage(load_graph(spec, phase), pipeline).text(max_sites=sites or _ALL_SITES), nl=False)


# ---------------------------------------------------------------- bench
@main.command("bench")
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--backend", type=BACKEND_CHOICE, default=AUTO, show_default=True,
              help="auto: gpu when CuPy sees a device, else cpu")
@click.option("--passes", "pipeline", default=AUTO_PIPELINE, callback=_backend_pipeline_option,
              help="pass pipeline applied before lowering ('' for none)" + PASSES_DEFAULT_HELP)
@click.option("--prefill", type=click.IntRange(min=1), default=512, show_default=True,
              help="tokens fed at once for the prefill rate")
@click.option("--prompt", type=click.IntRange(min=1), default=128, show_default=True,
              help="prompt tokens before the first token (TTFT) and before decode")
@click.option("--decode", type=click.IntRange(min=1), default=256, show_default=True,
              help="greedy tokens timed for the decode rate (EOS ignored)")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="timed prefill and decode runs (best and median reported)")
@click.option("--long-prefill", type=click.IntRange(min=0), default=None,
              help="also time a prefill of this many tokens [default: 4096 on gpu, 0 (off) elsewhere]")
@click.option("--new-process", is_flag=True,
              help="also time the first token in a new process, with warm and with empty kernel caches")
@click.option("--no-llama-cpp", is_flag=True, help="skip the same-run llama-cpp-python comparison")
@click.option("--compare", "compare", type=click.Choice(["hf", "hf-eager"]), default=None,
              help="also run HF transformers on the same weights: eager and static cache + torch.compile (hf), "
                   "or eager only (hf-eager)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=_output_option,
              help="also write the numbers (and machine, date, command) to this JSON file")
@_threads_option
@_dtype_option
@_draft_options
@_tp_option
def bench_cmd(model: str, backend: str, pipeline: str, prefill: int, prompt: int, decode: int, repeats: int,
              long_prefill: int | None, new_process: bool, no_llama_cpp: bool, compare: str | None,
              json_path: str | None, threads: int | None, dtype: str | None, draft: str | None,
              draft_len: int | None, tp: int) -> None:
    """Measure load, time to first token (first and warm), prefill and decode tok/s, peak RSS, arena size,
    and the memory-bandwidth limit of decode, on this machine with wall-clock time.

    When llama-cpp-python is importable and MODEL is a GGUF file, llama.cpp is measured in the same run,
    with --threads threads (default: numba's pool). Numbers go to stdout as a table; progress to stderr.
    """
    import json
    import shlex
    import sys

    from graphir.bench import bench, render

    _check_draft_len(draft, draft_len)
    if draft and draft != "lookup":
        _check_runnable(draft)
    backend = _checked_backend(backend)
    pipeline = resolve_pipeline(pipeline, backend)  # numbers name the pipeline that made them, never "auto"
    if threads is not None:  # per process, like numba's pool: bench's own load() then runs with it
        from graphir.backends.cpu.threads import set_threads

        set_threads(threads)
    click.echo(f"benchmarking {model} on {backend} (passes {pipeline or '(none)'}) ...", err=True)
    try:
        result = bench(model, backend=backend, passes=pipeline, prefill_tokens=prefill, prompt_tokens=prompt,
                       decode_tokens=decode, repeats=repeats, llama_cpp=not no_llama_cpp,
                       long_prefill_tokens=long_prefill, new_process=new_process, compare_hf=compare is not None,
                       hf_compiled=compare == "hf", draft=draft, draft_len=draft_len or DEFAULT_DRAFT_LEN, tp=tp,
                       dtype=dtype)
    except ValueError as e:
        raise CliError(str(e)) from None
    command = shlex.join(["graphir", "bench", model, "--backend", backend, "--passes", spell_pipeline(pipeline),
                          "--prefill", str(prefill), "--prompt", str(prompt), "--decode", str(decode),
                          "--repeats", str(repeats)]
                         + (["--long-prefill", str(long_prefill)] if long_prefill is not None else [])
                         + (["--new-process"] if new_process else [])
                         + (["--no-llama-cpp"] if no_llama_cpp else [])
                         + (["--compare", compare] if compare else [])
                         + (["--threads", str(threads)] if threads is not None else [])
                         + (["--dtype", dtype] if dtype else [])
                         + (["--tp", str(tp)] if tp > 1 else [])
                         + (["--draft", draft, "--draft-len", str(draft_len or DEFAULT_DRAFT_LEN)] if draft else []))
    result["command"] = command
    render(result, command, file=sys.stdout)
    if json_path:
        _write_file(json_path, json.dumps(result, indent=2) + "\n")
        click.echo(f"wrote {json_path}", err=True)
