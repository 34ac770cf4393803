"""Reasoning apart from the answer (runtime/reasoning.py): the parser on its own, then the real
server with a Qwen3-style thinking template, driven by the official ``openai`` client.

The tiny model is noise, so its replies are fixed by a ``choice`` constraint (vLLM's
structured_outputs): the text is known, and what is tested is how it comes back.
"""

from __future__ import annotations

import json
import shutil

import openai
import pytest
import requests
from hypothesis import given, settings, strategies as st

from live_server import LiveServer
from llmx.runtime.reasoning import FORMATS, Reasoning, ReasoningParser, detect_format, split_reasoning

# Qwen3's template, cut to what matters here: ChatML turns, and with enable_thinking false an
# empty thinking block written into the prompt.
THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
THINK = FORMATS["think"]
REPLY = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello there"


# -- the parser ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, inside, expected", [
    (REPLY, False, ("The user greets me.\nI greet back.", "Hello there")),
    ("Hello there", False, ("", "Hello there")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("x <think>y</think>", False, ("", "x <think>y</think>")),  # reasoning opens a reply or not at all
    ("<think>\ncut off by max_tokens\n", False, ("cut off by max_tokens\n", "")),
    ("\nthe prompt opened it\n</think>\n\nanswer", True, ("the prompt opened it", "answer")),
    ("<thin", False, ("", "<thin")),  # a marker's beginning that never completes is text
])
def test_whole_replies_split_into_reasoning_and_content(text, inside, expected):
    assert split_reasoning(Reasoning(THINK, inside), text) == expected


@pytest.mark.parametrize("fmt, text, expected", [
    ("granite", "<think>Weigh it.</think>\n<response>\nIt is 4.\n</response>", ("Weigh it.", "It is 4.")),
    ("granite", "<think>Weigh it.</think><response>It is 4.", ("Weigh it.", "It is 4.")),  # cut by max_tokens
    ("granite", "No thinking asked: a plain answer.", ("", "No thinking asked: a plain answer.")),
    ("granite", "<think>a</think>b </response> c", ("a", "b </response> c")),  # only a wrapper that opens is one
    ("granite_text", "Here is my thought process:\nAdd.\nHere is my response:\n4", ("Add.", "4")),
    ("granite_text", "Here's my thought process: Add. Here's my response: 4", ("Add.", "4")),
    ("brackets", "[THINK]a[/THINK]b", ("a", "b")),
])
def test_each_format_splits_its_own_markers(fmt, text, expected):
    assert split_reasoning(Reasoning(FORMATS[fmt], False), text) == expected


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "\n", "\n\n", "a", "b c", " ",
                                 "<response>", "</response>", "<resp", "onse>", "Here is my ", "Here's my ",
                                 "thought process:", "response:"]), max_size=12),
       st.lists(st.integers(1, 7), min_size=1, max_size=20), st.booleans(), st.sampled_from(["think", "granite", "granite_text"]))
def test_a_stream_splits_like_the_whole_reply_at_any_chunking(pieces, cuts, inside, name):
    text, fmt = "".join(pieces), FORMATS[name]
    parser, reasoning, content, at = ReasoningParser(Reasoning(fmt, inside)), "", "", 0
    for k in cuts * (len(text) // max(1, sum(cuts)) + 1):
        r, c = parser.feed(text[at:at + k])
        reasoning, content, at = reasoning + r, content + c, at + k
        if at >= len(text):
            break
    r, c = parser.finish()
    assert (reasoning + r, content + c) == split_reasoning(Reasoning(fmt, inside), text)


def test_formats_are_read_from_the_template_and_the_prompt():
    assert detect_format(THINKING_TEMPLATE) is THINK
    assert detect_format("{{ messages }}") is None and detect_format(None) is None
    assert detect_format("... [THINK]{{ thought }}[/THINK] ...") is FORMATS["brackets"]
    granite_33 = ("{%- if thinking %}Write your thoughts between <think></think> and write your response between "
                  "<response></response> for each user query.{%- endif %}")
    granite_32 = "Write your thoughts after 'Here is my thought process:' and write your response after 'Here is my response:'"
    assert detect_format(granite_33) is FORMATS["granite"] and detect_format(granite_32) is FORMATS["granite_text"]
    assert Reasoning.for_prompt(THINK, "<|im_start|>assistant\n") == Reasoning(THINK, False)
    assert Reasoning.for_prompt(THINK, "<|im_start|>assistant\n<think>\n") == Reasoning(THINK, True)  # DeepSeek-R1
    assert Reasoning.for_prompt(THINK, "<|im_start|>assistant\n<think>\n\n</think>\n\n") is None  # thinking off
    assert Reasoning.for_prompt(None, "anything") is None


# -- llmx generate --chat ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_artifact(llama_artifact, tmp_path_factory):
    """The tiny Llama with the thinking template."""
    art = tmp_path_factory.mktemp("thinking") / "art"
    shutil.copytree(llama_artifact, art)
    (art / "tokenizer" / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return art


FORCE_REPLY = REPLY.replace(".", "\\.").replace("\n", "\\n")  # the reply as a regex (--regex fixes it)


def test_generate_chat_shows_reasoning_apart(thinking_artifact, capsys):
    from llmx.cli import main

    args = ["generate", str(thinking_artifact), "hi", "--chat", "--regex", FORCE_REPLY, "--max-new-tokens", "80"]
    main(args)
    out, err = capsys.readouterr()
    assert out == "Hello there\n" and "The user greets me.\nI greet back." in err
    main([*args, "--json"])
    result = json.loads(capsys.readouterr().out)
    assert (result["text"], result["reasoning_content"]) == ("Hello there", "The user greets me.\nI greet back.")
    main(["generate", str(thinking_artifact), "hi", "--regex", FORCE_REPLY, "--max-new-tokens", "80", "--json"])
    plain = json.loads(capsys.readouterr().out)  # no --chat: no template, the text is left whole
    assert plain["text"] == REPLY and "reasoning_content" not in plain


# -- through the server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(thinking_artifact):
    """The tiny Llama with the thinking template, served with --reasoning-format auto and none."""
    art = thinking_artifact
    with LiveServer(artifact=art, model_name="m", threads=1, max_batch=4) as auto, \
            LiveServer(artifact=art, model_name="m", threads=1, max_batch=4, reasoning_format="none") as raw:
        yield {"auto": auto, "none": raw}


def ask(server, stream: bool = False, **extra):
    body = {"structured_outputs": {"choice": [REPLY]}, **extra}
    return server.client(max_retries=0, timeout=60).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=60, temperature=0, stream=stream,
        extra_body=body)


def test_reasoning_comes_back_apart_from_the_answer(servers):
    message = ask(servers["auto"]).choices[0].message
    assert message.content == "Hello there"
    extra = message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] == "The user greets me.\nI greet back."


def test_streamed_reasoning_arrives_as_reasoning_deltas_then_the_answer(servers):
    reasoning = content = ""
    finish = None
    for chunk in ask(servers["auto"], stream=True):
        for c in chunk.choices:
            delta = c.delta.model_extra or {}
            assert not (delta.get("reasoning_content") and c.delta.content)  # never both in one delta
            reasoning += delta.get("reasoning_content") or ""
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert (reasoning, content, finish) == ("The user greets me.\nI greet back.", "Hello there", "stop")


def test_reasoning_format_none_leaves_the_text_whole(servers):
    message = ask(servers["none"]).choices[0].message
    assert message.content == REPLY and "reasoning_content" not in (message.model_extra or {})


def test_chat_template_kwargs_reach_the_template(servers):
    """enable_thinking false: the template writes an empty thinking block into the prompt, so
    the prompt is longer and whatever the reply holds is its answer."""
    on, off = ask(servers["auto"]), ask(servers["auto"], chat_template_kwargs={"enable_thinking": False})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert off.choices[0].message.content == REPLY
    url = servers["auto"].url
    counts = [requests.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}], **extra}).json()["count"]
              for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}})]
    assert counts[1] == counts[0] + (off.usage.prompt_tokens - on.usage.prompt_tokens)


@pytest.mark.parametrize("kwargs, message", [
    ([1], "must be an object"),
    ({"messages": []}, "may not set 'messages'"),
    ({"add_generation_prompt": False}, "may not set 'add_generation_prompt'"),
])
def test_bad_chat_template_kwargs_are_one_400(servers, kwargs, message):
    with pytest.raises(openai.BadRequestError) as err:
        ask(servers["auto"], chat_template_kwargs=kwargs)
    assert err.value.status_code == 400 and message in err.value.body["message"]
    assert err.value.body["param"] == "chat_template_kwargs"
