"""Tool-call formats without a server: parsing whole and streamed replies, format detection,
the constraint grammars (sampled under llguidance, then read back by the parser), and tool
messages rendered as transformers renders them."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from llmx.serve.tool_calls import FORMATS, Call, ToolCallParser, detect_format, parse_tool_calls
from llmx.serve.tool_request import ToolRequest, check_tools
from tool_templates import HERMES_TEMPLATE, HERMES_TOKENS, LLAMA3_TEMPLATE, MISTRAL_SNIPPET

WEATHER = Call("get_weather", '{"city": "Paris", "days": 3}')
CLOCK = Call("get_time", "{}")

# (format, reply, expected content, expected calls)
REPLIES = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     "Let me look.\n", [WEATHER]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', None, [WEATHER, CLOCK]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}', None, [CLOCK]),  # closing tag never came
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None, [WEATHER]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {}}', None, [WEATHER, CLOCK]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "get_time", "arguments": {}}]', None, [WEATHER, CLOCK]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "Sure. ", [CLOCK]),
]

# Replies that are not (wholly) calls: what cannot be read as a call comes back as content.
MALFORMED = [
    ("hermes", 'Plain words, no call.', "Plain words, no call.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', []),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> and then text',
     " and then text", [CLOCK]),
    ("llama3_json", 'The set {1, 2} has two members.', 'The set {1, 2} has two members.', []),
    ("llama3_json", '{"name": "get_time", "parameters": [1, 2]}', '{"name": "get_time", "parameters": [1, 2]}', []),
    ("mistral", '[TOOL_CALLS] not json', '[TOOL_CALLS] not json', []),
]


@pytest.mark.parametrize("fmt,reply,content,calls", REPLIES + MALFORMED)
def test_whole_reply_parses_into_content_and_calls(fmt, reply, content, calls):
    assert parse_tool_calls(FORMATS[fmt], reply) == (content, calls)


@pytest.mark.parametrize("fmt,reply,content,calls", REPLIES + MALFORMED)
def test_streamed_reply_in_random_pieces_gives_the_same_content_and_calls(fmt, reply, content, calls):
    rng = random.Random(len(reply))
    cuts = sorted(rng.sample(range(1, len(reply)), min(12, len(reply) - 1)))
    pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
    parser = ToolCallParser(FORMATS[fmt])
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    assert [e.call for e in events if e.call] == calls
    assert "".join(e.content for e in events) == (content or "")
    call_at = next((i for i, e in enumerate(events) if e.call), len(events))
    streamed_before = "".join(e.content for e in events[:call_at])
    assert reply.startswith(streamed_before)  # content is streamed in order, before the calls


@pytest.mark.parametrize("fmt,reply,complete", [
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_we', [CLOCK]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "get_', []),  # one JSON list, never closed
    ("generic", '{"name": "get_ti', []),
])
def test_a_call_cut_by_max_tokens_in_a_calls_only_reply_is_dropped_not_content(fmt, reply, complete):
    """"required" or a named function: everything is calls, so a tail that is not one was cut short."""
    assert parse_tool_calls(FORMATS[fmt], reply, calls_only=True) == (None if complete else "", complete)
    parser = ToolCallParser(FORMATS[fmt], calls_only=True)
    events = [e for k in range(0, len(reply), 5) for e in parser.feed(reply[k:k + 5])] + parser.finish()
    assert [e.call for e in events if e.call] == complete and not "".join(e.content for e in events)
    assert parse_tool_calls(FORMATS[fmt], reply)[0]  # "auto" keeps what it cannot read as content


def test_content_streams_before_the_call_is_complete():
    parser = ToolCallParser(FORMATS["hermes"])
    assert [e.content for e in parser.feed("Checking the weather <tool")] == ["Checking the weather "]
    assert parser.feed('_call>\n{"name": "get_time", ') == []  # held: may still become a call
    assert [e.call for e in parser.feed('"arguments": {}}\n</tool_call>')] == [CLOCK]


@pytest.mark.parametrize("template,name", [(HERMES_TEMPLATE, "hermes"), (LLAMA3_TEMPLATE, "llama3_json"),
                                           (MISTRAL_SNIPPET, "mistral"), ("{{ messages }}", None), (None, None)])
def test_format_is_detected_from_the_chat_template(template, name):
    fmt = detect_format(template)
    assert (fmt.name if fmt else None) == name


# -- grammars: what the constraint allows is what the parser reads ------------------------------

TOOLS = check_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time"}},
])


def tiny_tokenizer(directory, added: tuple[str, ...]):
    """(llguidance's tokenizer, the tokenizers one, added tokens) of the tiny test tokenizer."""
    import llguidance
    from tokenizers import Tokenizer

    from checkpoints import train_tokenizer

    train_tokenizer(directory, added_tokens=added)
    hf = Tokenizer.from_file(str(directory / "tokenizer.json"))
    added = {t.content: i for i, t in hf.get_added_tokens_decoder().items()}
    return llguidance.LLTokenizer(str(directory / "tokenizer.json"), eos_token=2), hf, added


@pytest.fixture(scope="module")
def llg_tokenizer(tmp_path_factory):
    """With Hermes' and Mistral's markers as tokens of their own."""
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"), (*HERMES_TOKENS, "[TOOL_CALLS]"))


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory):
    """Without them: a marker is plain text, spelled by ordinary tokens."""
    return tiny_tokenizer(tmp_path_factory.mktemp("plain"), ())


def sample_under(grammar: str, tok, hf, seed: int, first: int | None = None, steps: int = 200, prefix: str = "",
                 complete: bool = True) -> str:
    """Random tokens under ``grammar`` after ``prefix`` (``first`` forced as the first token when given);
    ``complete``: the grammar must have ended (a call), not just the steps (free text)."""
    import llguidance

    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    out = hf.encode(prefix, add_special_tokens=False).ids
    assert matcher.consume_tokens(out), matcher.get_error()
    rng = np.random.default_rng(seed)
    for step in range(steps):
        if matcher.is_stopped():
            break
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = bits[: tok.vocab_size].astype(bool)
        logits = rng.normal(size=tok.vocab_size)
        if step == 0 and first is not None:
            logits[first] += 100
        logits[~allowed] = -np.inf
        token = int(np.argmax(logits))
        if token == tok.eos_token:
            break
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    assert matcher.is_accepting() or not complete
    return hf.decode(out, skip_special_tokens=False)


def valid_call(call: Call) -> bool:
    args = json.loads(call.arguments)
    if call.name == "get_time":
        return args == {}
    return call.name == "get_weather" and args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7 and len(args) == 2


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("choice,parallel", [("required", False), ("required", True), ("get_weather", False)])
def test_constrained_replies_are_valid_calls_the_parser_reads(llg_tokenizer, fmt, choice, parallel):
    tok, hf, added = llg_tokenizer
    grammar = ToolRequest(FORMATS[fmt], TOOLS, choice, parallel).grammar(added)
    for seed in range(4):
        content, calls = parse_tool_calls(FORMATS[fmt], sample_under(grammar, tok, hf, seed, steps=800))
        assert content is None and calls and all(map(valid_call, calls))
        if not parallel or FORMATS[fmt].max_calls == 1:
            assert len(calls) == 1
        if choice == "get_weather":
            assert {c.name for c in calls} == {"get_weather"}


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
def test_auto_is_free_text_until_the_marker_then_a_valid_call(llg_tokenizer, fmt):
    tok, hf, added = llg_tokenizer
    grammar = ToolRequest(FORMATS[fmt], TOOLS, "auto", False).grammar(added)
    free = sample_under(grammar, tok, hf, seed=1, steps=30, complete=False)
    assert parse_tool_calls(FORMATS[fmt], free) == (free, [])
    other = sample_under(grammar, tok, hf, seed=1, first=added["<|user|>"], steps=30, complete=False)
    assert other.startswith("<|user|>")  # added tokens that are not the format's stay possible (a <think>, say)
    marker = added[FORMATS[fmt].markers[0]]
    content, calls = parse_tool_calls(FORMATS[fmt], sample_under(grammar, tok, hf, seed=2, first=marker))
    assert len(calls) == 1 and valid_call(calls[0])


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
def test_auto_with_a_marker_made_of_plain_text_constrains_the_call_after_it(plain_tokenizer, fmt):
    tok, hf, added = plain_tokenizer
    grammar = ToolRequest(FORMATS[fmt], TOOLS, "auto", False).grammar(added)
    assert "[lazy]" in grammar
    text = sample_under(grammar, tok, hf, seed=4, prefix="Let me see. ", complete=False)
    assert parse_tool_calls(FORMATS[fmt], text)[1] == []
    for seed in range(3):
        content, calls = parse_tool_calls(FORMATS[fmt], sample_under(grammar, tok, hf, seed, prefix="Sure. " + FORMATS[fmt].markers[0]))
        assert content == "Sure. " and len(calls) == 1 and valid_call(calls[0])


def test_llama3_auto_reply_opening_with_a_brace_is_a_valid_call(llg_tokenizer):
    tok, hf, added = llg_tokenizer
    grammar = ToolRequest(FORMATS["llama3_json"], TOOLS, "auto", True).grammar(added)
    content, calls = parse_tool_calls(FORMATS["llama3_json"], sample_under(grammar, tok, hf, 3, first=hf.token_to_id("{")))
    assert content is None and len(calls) == 1 and valid_call(calls[0])
    for seed in range(3):  # anything else is text, never a call
        text = sample_under(grammar, tok, hf, seed, steps=40, complete=False)
        assert parse_tool_calls(FORMATS["llama3_json"], text)[1] == []


# -- messages with calls and results render as transformers renders them -----------------------

@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    from checkpoints import train_tokenizer

    directory = tmp_path_factory.mktemp("hf")
    train_tokenizer(directory, added_tokens=tuple(HERMES_TOKENS))
    return PreTrainedTokenizerFast.from_pretrained(directory)


@pytest.mark.parametrize("template", [HERMES_TEMPLATE, LLAMA3_TEMPLATE], ids=["hermes", "llama3"])
def test_tool_messages_render_as_transformers_renders_them(hf_tokenizer, template):
    from llmx.runtime.chat import render_chat
    from llmx.serve.protocol import chat_messages

    request = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Oslo", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
    convention = [request[0], {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
        {"role": "tool", "content": "cold"}]

    class Tok:
        chat_template, bos_token, eos_token = template, hf_tokenizer.bos_token, hf_tokenizer.eos_token

    ours = render_chat(Tok, chat_messages(request), tools=[{"type": "function", "function": t["function"]} for t in TOOLS])
    theirs = hf_tokenizer.apply_chat_template(convention, tools=TOOLS, chat_template=template, tokenize=False,
                                              add_generation_prompt=True)
    assert ours == theirs and "Oslo" in ours and "cold" in ours
