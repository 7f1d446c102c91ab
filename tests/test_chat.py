"""Chat (graphir/chat.py, Model.chat, `graphir chat`): templates render exactly as transformers'
apply_chat_template; a two-turn chat reads only the new tokens and replies as a fresh run would;
a template that fails to render gives the template's error in one line."""

from __future__ import annotations

import pytest
from graphir.models.gemma3 import CHAT_TEMPLATE as GEMMA3_TEMPLATE

import graphir
from graphir.chat import ChatTemplateError, end_of_turn_id, render

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi there"}],
    "system-user-assistant-user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2? "},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3 — in 日本語? 😀"},
    ],
}


@pytest.fixture(scope="module")
def smollm2_template():
    from graphir.models.default_model import smollm2_path
    from graphir.models.gguf_file import GGUFFile

    try:
        return GGUFFile(smollm2_path()).metadata["tokenizer.chat_template"]
    except graphir.LoadError as e:
        pytest.skip(str(e))


def hf_tokenizer(bos: str, eos: str):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    vocab = {bos: 0, eos: 1, "<unk>": 2}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                                bos_token=bos, eos_token=eos, unk_token="<unk>")


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_templates_render_as_transformers_does(smollm2_template, which, conversation, generation_prompt):
    template, bos, eos = ((smollm2_template, "<|im_start|>", "<|im_end|>") if which == "smollm2"
                          else (GEMMA3_TEMPLATE, "<bos>", "<eos>"))
    messages = CONVERSATIONS[conversation]
    want = hf_tokenizer(bos, eos).apply_chat_template(messages, chat_template=template, tokenize=False,
                                                     add_generation_prompt=generation_prompt)
    got = render(template, messages, generation_prompt, bos_token=bos, eos_token=eos)
    assert got == want


def test_gemma3_template_writes_gemma_turns():
    got = render(GEMMA3_TEMPLATE, CONVERSATIONS["system-user-assistant-user"], True, bos_token="<bos>")
    assert got == ("<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n"
                   "<start_of_turn>model\n4<end_of_turn>\n"
                   "<start_of_turn>user\nAnd 3+3 — in 日本語? 😀<end_of_turn>\n<start_of_turn>model\n")


def test_template_errors_are_one_line():
    with pytest.raises(ChatTemplateError, match=r"^chat template: roles must alternate user, assistant"):
        render(GEMMA3_TEMPLATE, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError) as e:
        render("{% for m in messages %}{{ m.content }", CONVERSATIONS["user"])
    assert str(e.value).startswith("chat template: TemplateSyntaxError: ") and "\n" not in str(e.value)
    with pytest.raises(graphir.InputError, match=r"messages\[0\] = .* needs a 'role' string and a 'content'"):
        render(GEMMA3_TEMPLATE, [{"content": "no role"}])


@pytest.fixture(scope="module")
def smollm2():
    try:
        return graphir.load("smollm2-135m", backend="cpu")
    except graphir.LoadError as e:
        pytest.skip(str(e))


def test_end_of_turn_token_comes_from_the_template(smollm2, smollm2_template):
    tok = smollm2.tokenizer
    specials = {"bos_token": tok.token(tok.bos_id)} if tok.bos_id is not None else {}
    assert tok.token(end_of_turn_id(tok, smollm2_template, specials)) == "<|im_end|>"


@pytest.mark.slow
def test_two_turn_chat_reuses_the_kv_cache(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = smollm2.chat(messages, max_new_tokens=12)
    held = len(smollm2.conversation.cached)  # prompt, reply and its end-of-turn token
    assert "Paris" in first and smollm2.n_past == held
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And of Italy?"}]
    second = smollm2.chat(messages, max_new_tokens=12)
    n_prompt = len(smollm2.tokenizer.encode(render(smollm2.tokenizer.chat_template, messages), add_bos=False))
    assert smollm2.conversation.last_prefill == n_prompt - held < 20
    smollm2.reset()  # a fresh run of the whole second prompt replies the same
    assert smollm2.chat(messages, max_new_tokens=12) == second
    assert smollm2.conversation.last_prefill == n_prompt


def test_chat_edited_part_way_replies_as_a_fresh_run():
    """A turn whose prompt shares only a prefix with the cached conversation (an edited message) must not
    keep the cache past the fork: its reply equals a fresh model's, and it reads the whole prompt."""
    m = graphir.load("random:llama-tiny", backend="reference", passes="", ctx=97)
    m.tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                                 "{% if add_generation_prompt %}<assistant>{% endif %}")
    m.chat([{"role": "user", "content": "Hi there, how are you today?"}], max_new_tokens=7)
    edited = [{"role": "user", "content": "Hi there, who are you, then?"}]
    prompt = m.tokenizer.encode(render(m.tokenizer.chat_template, edited), add_bos=False)
    shared = next(i for i, (a, b) in enumerate(zip(prompt, m.conversation.cached, strict=False)) if a != b)
    assert 0 < shared < m.n_past  # the fork is part way into the cache
    m.chat(edited, max_new_tokens=7)
    got, read = list(m.conversation.cached), m.conversation.last_prefill
    fresh = graphir.load("random:llama-tiny", backend="reference", passes="", ctx=97)
    fresh.tokenizer.chat_template = m.tokenizer.chat_template
    fresh.chat(edited, max_new_tokens=7)
    assert got == fresh.conversation.cached and got[:len(prompt)] == prompt
    assert read == len(prompt)


def test_a_cache_overwritten_by_the_same_length_starts_over():
    """logits() of as many tokens as the conversation holds leaves n_past where the chat left it, but other rows:
    the next turn reused them and replied to the wrong text ('Caaaa' where a fresh model says something else)."""
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    first = [{"role": "user", "content": "Hi there"}]
    follow = first + [{"role": "assistant", "content": ""}, {"role": "user", "content": "more"}]
    replies = []
    for overwrite in (False, True):
        m = graphir.load("random:llama-tiny", backend="reference", passes="", ctx=97)
        m.tokenizer.chat_template = template
        m.chat(first, max_new_tokens=0)  # the cache holds the first prompt, a prefix of the follow-up's
        if overwrite:
            m.logits([65] * len(m.conversation.cached))
        replies.append(m.chat(follow, max_new_tokens=5))
        n_follow, n_first = len(m.conversation.prompt_ids(follow)), len(m.conversation.prompt_ids(first))
        assert m.conversation.last_prefill == (n_follow if overwrite else n_follow - n_first)
    assert replies[1] == replies[0]


def test_cli_chat_one_turn(smollm2):
    from click.testing import CliRunner

    from graphir.cli import main

    r = CliRunner().invoke(main, ["chat", "smollm2-135m", "-p", "What is the capital of France?", "-n", "12",
                                  "--backend", "cpu"])
    assert r.exit_code == 0, r.output
    assert "Paris" in r.output.splitlines()[-1]


def test_cli_chat_past_the_context_names_the_option(smollm2):
    """A conversation longer than --ctx is one line naming --ctx, as `run` says it (it named the Python API's
    load(..., ctx=N), which the command line has no way to pass)."""
    from click.testing import CliRunner

    from graphir.cli import main

    r = CliRunner().invoke(main, ["chat", "smollm2-135m", "-p", "hi", "-n", "4", "--ctx", "10", "--backend", "cpu"])
    assert r.exit_code == 1, r.output
    last = r.stderr.splitlines()[-1]
    assert last.startswith("error: the conversation (") and "exceeds the context of 10 tokens" in last, last
    assert "--ctx N" in last and "load(" not in last, last


@pytest.mark.parametrize("n", [-1, 2.5, "3", True])
def test_chat_checks_max_new_tokens_as_generate_does(n):
    """-1 and True replied as if they were 0 and 1; 2.5 and '3' were TypeErrors from range() and '+'."""
    m = graphir.load("random:llama-tiny", backend="reference", passes="", ctx=97)
    m.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    with pytest.raises(graphir.InputError, match="max_new_tokens must be an int >= 0"):
        m.chat([{"role": "user", "content": "hi"}], max_new_tokens=n)
    assert m.chat([{"role": "user", "content": "hi"}], max_new_tokens=0) == ""


def test_no_template_is_a_clear_error():
    m = graphir.load("random:llama-tiny", backend="reference", passes="")
    with pytest.raises(graphir.InputError, match=r"random:llama-tiny: no chat template"):
        m.chat([{"role": "user", "content": "hi"}])
