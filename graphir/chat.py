"""Chat: a conversation rendered with the model's own chat template, kept in the KV cache across turns.

The template (GGUF `tokenizer.chat_template`, the HF tokenizer config, or the family's default for
files that carry none) is rendered with jinja2 the way transformers' apply_chat_template renders it:
a sandboxed environment with trim_blocks and lstrip_blocks, the loop-controls extension, and
`raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII text. The rendered text is
tokenized without an added BOS (templates write their own).

Each turn renders the whole conversation, but only the tokens after the longest prefix already in the
KV cache are read: the cache holds the previous prompt, the reply and its end-of-turn token, which is
exactly how the next rendering begins. The reply stops at the template's end-of-turn token (found by
rendering a probe exchange and reading the token that follows the assistant's text) or an EOS id.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

from graphir.errors import InputError
from graphir.generate import Settings, check_max_new_tokens

_PROBE_REPLY = "Xq7Zr"  # an assistant text that no template writes by itself


class ChatTemplateError(InputError):
    """A chat template that fails to render: the template's own message, one line."""


def _environment() -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"chat template: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def render(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
           **special_tokens: Any) -> str:
    """The conversation as the template writes it; `special_tokens` (bos_token, eos_token, ...) are
    template variables, as transformers passes them."""
    import jinja2

    check_messages(messages)
    try:
        compiled = _environment().from_string(template)
        return compiled.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                               **special_tokens)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ChatTemplateError(f"chat template: {type(e).__name__}: {e}{where}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:  # Python's, from the template's code
        raise ChatTemplateError(f"chat template: {type(e).__name__}: {e}") from None


def check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InputError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
            raise InputError(f"messages[{i}] = {m!r} needs a 'role' string and a 'content'")
        if not isinstance(m["content"], (str, list)):  # a number or None reached the template's '+'
            raise InputError(f"messages[{i}]['content'] must be a string or a list of content parts, "
                             f"got {m['content']!r}")


def special_tokens(tokenizer: Any) -> dict[str, str]:
    """bos_token and eos_token as text, the template variables every template may use."""
    out = {}
    if getattr(tokenizer, "bos_id", None) is not None:
        out["bos_token"] = tokenizer.token(tokenizer.bos_id)
    eos = sorted(getattr(tokenizer, "eos_ids", ()))
    if eos:
        out["eos_token"] = tokenizer.token(eos[0])
    return out


def end_of_turn_id(tokenizer: Any, template: str, specials: Mapping[str, str]) -> int | None:
    """The token that closes an assistant turn: the first token after the assistant's text in a rendered
    probe exchange, when it is a single token whose text is not plain (e.g. <|im_end|>, <end_of_turn>)."""
    text = render(template, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE_REPLY}],
                  add_generation_prompt=False, **specials)
    after = text[text.rfind(_PROBE_REPLY) + len(_PROBE_REPLY):] if _PROBE_REPLY in text else ""
    ids = tokenizer.encode(after, add_bos=False) if after.strip() else []
    if not ids:
        return None
    first = tokenizer.decode(ids[:1])
    return ids[0] if len(first) > 1 and after.startswith(first) and not first.isalnum() else None


class Conversation:
    """The chat state of one Model: the token ids its KV cache holds for the conversation so far."""

    def __init__(self, model: Any):
        self.model = model
        self.cached: list[int] = []
        self.last_prefill = 0  # tokens the last turn read (the rest was reused from the cache)
        self.sequence: int | None = None  # the model's sequence (Model._sequence) the cached tokens are in

    def template(self) -> str:
        tok = self.model.tokenizer
        template = getattr(tok, "chat_template", None)
        if not template:
            raise InputError(f"{self.model.source}: no chat template in the model's files (GGUF "
                             f"tokenizer.chat_template or tokenizer_config.json) and none for its family")
        return template

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The ids of `messages` rendered for the assistant's turn: what reply() reads (from the cache or not)."""
        tok = self.model.tokenizer
        return tok.encode(render(self.template(), messages, True, **special_tokens(tok)), add_bos=False)

    def reply(self, messages: Sequence[Mapping[str, Any]], max_new_tokens: int = 256, temperature: float = 0.0,
              top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> Iterator[int]:
        """Token ids of the assistant's reply to `messages` (the end-of-turn token not included)."""
        m, tok = self.model, self.model.tokenizer
        check_max_new_tokens(max_new_tokens)  # as generate() does: range() took -1 as 0, '+' failed on a str
        template, specials = self.template(), special_tokens(tok)
        ids = self.prompt_ids(messages)
        stops = set(m.eos_ids)
        end = end_of_turn_id(tok, template, specials)
        if end is not None:
            stops.add(end)
        if len(ids) + max_new_tokens > m.config.ctx:
            raise InputError(f"the conversation ({len(ids)} tokens) + max_new_tokens {max_new_tokens} exceeds the "
                             f"context of {m.config.ctx} (load(..., ctx=N) to raise it)")
        return self._run(ids, stops, max_new_tokens, Settings(temperature, top_k, top_p, seed))

    def _run(self, ids: list[int], stops: set[int], max_new: int, settings: Settings) -> Iterator[int]:
        m, keep = self.model, 0
        # else the cache was used for something else since the last turn: another sequence (logits() of as many
        # tokens leaves n_past where it was, over other rows), or tokens fed after ours
        if m._sequence == self.sequence and m.n_past == len(self.cached):
            while keep < min(len(self.cached), len(ids) - 1) and self.cached[keep] == ids[keep]:
                keep += 1
        if keep == 0 or keep < m.n_past:  # rows past `keep` differ: start over (recurrent state cannot rewind)
            m.reset()
            keep = 0
        self.cached, self.last_prefill, self.sequence = list(ids), len(ids) - keep, m._sequence
        # generate()'s own steps: on the gpu each token is one captured step that samples on the device
        token = m._prefill_sample(ids[keep:], settings)
        for _ in range(max_new):
            after = m._decode_sample(token, settings)  # the end-of-turn token too: the next rendering starts with it
            self.cached.append(token)
            if token in stops:
                return
            yield token
            token = after
