"""Tool calling through the real server and the official ``openai`` client.

Tiny random models with chat templates in the Hermes/Qwen and Llama 3.1 styles: the model is
noise, so every call below is made by the constraint ("required", a named function) or, for
"auto", by a test-only logit_bias that makes the reply open with the call marker, after which
the lazy grammar holds it to a valid call. Each round trip goes tools -> tool_calls -> tool
message -> final answer, whole and streamed (assembled by the client's own stream helper).
"""

from __future__ import annotations

import json
import shutil

import openai
import pytest
import requests

from live_server import LiveServer
from tool_templates import HERMES_TEMPLATE, HERMES_TOKENS, LLAMA3_TEMPLATE, make_tool_checkpoint

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo"]},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
FORMATS = ("hermes", "llama3_json")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tool_checkpoint(tmp_path_factory.mktemp("tools") / "ckpt", HERMES_TEMPLATE, HERMES_TOKENS)


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory):
    """One exported model, served twice: with the Hermes template and with the Llama 3.1 one."""
    from llmx.export import export_checkpoint

    root = tmp_path_factory.mktemp("tool-art")
    export_checkpoint(checkpoint, root / "hermes")
    shutil.copytree(root / "hermes", root / "llama3_json")
    (root / "llama3_json" / "tokenizer" / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
    with LiveServer(artifact=root / "hermes", model_name="m", threads=1, max_batch=4) as hermes, \
            LiveServer(artifact=root / "llama3_json", model_name="m", threads=1, max_batch=4) as llama:
        yield {"hermes": hermes, "llama3_json": llama}


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(checkpoint)


def opening_bias(fmt: str, tok) -> dict[str, int]:
    """Test-only: make the reply's first token the format's call opening ("auto" is otherwise free)."""
    return {str(tok.convert_tokens_to_ids("<tool_call>" if fmt == "hermes" else "{")): 100}


def choice_args(mode: str, fmt: str, tok) -> dict:
    if mode == "auto":
        return {"tool_choice": "auto", "logit_bias": opening_bias(fmt, tok)}
    if mode == "named":
        return {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    return {"tool_choice": "required"}


def check_call(call, names=("get_weather", "get_time")) -> None:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["city"] in ("Paris", "Oslo")
    else:
        assert args == {}


def ask(client, stream: bool, **args):
    if not stream:
        return client.chat.completions.create(model="m", **args)
    with client.chat.completions.stream(model="m", stream_options={"include_usage": True}, **args) as events:
        for _ in events:
            pass
        return events.get_final_completion()


def prompt_tokens(tok, template: str, messages: list[dict], tools: list[dict] | None) -> int:
    """What transformers renders for this conversation (tool call arguments as dicts), in tokens."""
    convention = [{**m, "tool_calls": [{"type": "function", "function": {"name": c["function"]["name"],
                                                                          "arguments": json.loads(c["function"]["arguments"])}}
                                        for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    text = tok.apply_chat_template(convention, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", ["required", "named", "auto"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_tools_call_result_answer(servers, hf_tokenizer, fmt, mode, stream):
    client = servers[fmt].client(max_retries=0, timeout=60)
    template = HERMES_TEMPLATE if fmt == "hermes" else LLAMA3_TEMPLATE
    first = ask(client, stream, messages=QUESTION, tools=TOOLS, parallel_tool_calls=False, max_tokens=200,
                temperature=0, **choice_args(mode, fmt, hf_tokenizer))
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    check_call(call, ("get_weather",) if mode == "named" else ("get_weather", "get_time"))
    assert first.usage.prompt_tokens == prompt_tokens(hf_tokenizer, template, QUESTION, TOOLS)

    history = QUESTION + [{"role": "assistant", "content": choice.message.content, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}]
    # The answer may end at max_tokens, which the client's stream helper refuses: a plain stream here.
    final = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=6, temperature=0,
                                           stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
    chunks = list(final) if stream else None
    answer = final if not stream else None
    if stream:
        assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
        assert chunks[-1].usage.prompt_tokens == prompt_tokens(hf_tokenizer, template, history, TOOLS)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    else:
        assert answer.choices[0].finish_reason in ("stop", "length") and not answer.choices[0].message.tool_calls
        assert isinstance(answer.choices[0].message.content, str)
        assert answer.usage.prompt_tokens == prompt_tokens(hf_tokenizer, template, history, TOOLS)


def raw_stream(server, body: dict) -> list[dict]:
    reply = requests.post(server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60, stream=True)
    assert reply.status_code == 200
    lines = [line[6:] for line in reply.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streamed_calls_arrive_as_openai_tool_call_deltas_per_choice(servers):
    body = {"messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 200, "n": 2, "temperature": 1.0, "seed": 3}
    chunks = raw_stream(servers["hermes"], body)
    for index in (0, 1):
        deltas = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        calls = [d["delta"]["tool_calls"] for d in deltas if d["delta"].get("tool_calls")]
        head, args = calls[0][0], calls[1][0]
        assert head["index"] == 0 and head["type"] == "function" and head["id"].startswith("call_")
        assert head["function"]["arguments"] == "" and args == {"index": 0, "function": {"arguments": args["function"]["arguments"]}}
        assert json.loads(args["function"]["arguments"]) is not None
        assert deltas[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_named_function_is_called_once_and_the_reply_ends(servers, fmt):
    """Even with parallel calls allowed: no second call running into max_tokens, no fragment in content."""
    client = servers[fmt].client(max_retries=0, timeout=60)
    choice = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, max_tokens=300, temperature=0.9,
                                            seed=5, **choice_args("named", fmt, None)).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


def test_parallel_calls_each_match_their_function(servers):
    client = servers["hermes"].client(max_retries=0, timeout=60)
    out = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                         max_tokens=300, temperature=0.9, seed=5)
    calls = out.choices[0].message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    for call in calls:
        check_call(call)


def test_tool_choice_none_neither_shows_nor_parses_tools(servers, hf_tokenizer):
    client = servers["hermes"].client(max_retries=0, timeout=60)
    out = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=4,
                                         temperature=0)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == prompt_tokens(hf_tokenizer, HERMES_TEMPLATE, QUESTION, None)


BAD = {
    "duplicate name": ({"tools": [TOOLS[0], TOOLS[0]]}, "defined twice"),
    "schema that does not compile": ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}]}, "JSON schema"),
    "bad name": ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "letters, digits"),
    "not a function": ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    "unknown named function": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                               "not in 'tools'"),
    "tool_choice without tools": ({"tool_choice": "required"}, "only allowed when 'tools'"),
    "bad tool_choice": ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    "tool message without id": ({"messages": QUESTION + [{"role": "tool", "content": "x"}]}, "tool_call_id"),
    "call arguments not JSON": ({"messages": QUESTION + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}]}]}, "not valid JSON"),
    "beam search": ({"tools": TOOLS, "use_beam_search": True, "n": 2}, "beam"),
    "with a response format": ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "do not combine"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_tools_are_openai_shaped_400s_before_any_work(servers, case):
    fields, words = BAD[case]
    reply = requests.post(servers["hermes"].url + "/v1/chat/completions",
                          json={"messages": QUESTION, "max_tokens": 4, **fields}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"]


def test_a_template_without_a_tool_format_gets_the_generic_one(generic_server):
    """Tools are described in a system turn llmx writes; calls made earlier are written as the
    JSON asked for, results as a user turn (merged, for templates that alternate roles)."""
    from llmx.serve.protocol import parse_job
    from llmx.serve.tool_calls import FORMATS as TABLE

    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    engine = generic_server.app.extensions["llmx"].engine()
    job = parse_job(json.dumps({"messages": history, "tools": TOOLS}).encode(), True, engine, "m")
    assert job.tools.fmt is TABLE["generic"] and job.params[0].constraint is not None
    prompt = engine.tokenizer.decode(job.prompts[0], skip_special_tokens=False)
    assert "You can call these functions" in prompt and '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '{"tool_response": {"name": "get_weather", "content": "sunny"}}' in prompt
    job = parse_job(json.dumps({"messages": QUESTION, "tools": TOOLS}).encode(), True, engine, "m", TABLE["hermes"])
    assert job.tools.fmt.name == "hermes"  # --tool-call-format still names one


PLAIN_CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def generic_server(checkpoint, tmp_path_factory):
    """The tool checkpoint with a ChatML template that renders no tools (most small chat models')."""
    from llmx.export import export_checkpoint

    art = tmp_path_factory.mktemp("generic") / "art"
    export_checkpoint(checkpoint, art)
    (art / "tokenizer" / "chat_template.jinja").write_text(PLAIN_CHATML)
    with LiveServer(artifact=art, model_name="m", threads=1, max_batch=4) as live:
        yield live


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", ["required", "named"])
def test_generic_format_calls_are_complete_and_schema_valid(generic_server, mode, stream):
    client = generic_server.client(max_retries=0, timeout=60)
    choice = ask(client, stream, messages=QUESTION, tools=TOOLS, max_tokens=100, temperature=0.7, seed=1,
                 **choice_args(mode, "generic", None)).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    check_call(call, ("get_weather",) if mode == "named" else ("get_weather", "get_time"))


def test_control_tokens_are_shown_when_a_marker_is_one(llama_engine):
    """Mistral's [TOOL_CALLS] is a control token: decoded as usual it would vanish before the parser."""
    from llmx.runtime.tokenizer import IncrementalDetokenizer

    tok = llama_engine.tokenizer
    marker = "<|user|>"  # a control token of the tiny tokenizer, standing in for [TOOL_CALLS]
    assert marker in tok.added_tokens(special_only=True)
    ids = [tok.added_tokens()[marker], *tok.encode("[1]", add_special_tokens=False)]
    for skip, shown in ((True, "[1]"), (False, marker + "[1]")):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        assert "".join(detok.push(i) for i in ids) + detok.flush() == shown


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_pydantic_tools_come_back_parsed_by_the_client(servers, stream):
    """Strict tools from the client's pydantic_function_tool: its parse helpers validate the
    arguments into the model, whole and from the stream's assembled deltas."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        city: Literal["Paris", "Oslo"]
        days: int = Field(ge=1, le=7)

    client = servers["hermes"].client(max_retries=0, timeout=60)
    args = dict(model="m", messages=QUESTION, tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
                parallel_tool_calls=False, max_tokens=200, temperature=0)
    if stream:
        with client.chat.completions.stream(**args) as events:
            kinds = {e.type for e in events}
            out = events.get_final_completion()
        assert {"tool_calls.function.arguments.delta", "tool_calls.function.arguments.done"} <= kinds
    else:
        out = client.chat.completions.parse(**args)
    call = out.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather) and call.function.name == "GetWeather"


def test_demo_model_calls_tools_through_its_own_template(demo_artifact):
    """The quickstart's model: its ChatML-like template renders tools and <tool_call> calls."""
    with LiveServer(artifact=demo_artifact, model_name="m", threads=1, max_batch=2) as server:
        client = server.client(max_retries=0, timeout=60)
        first = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=80, temperature=0)
        assert first.choices[0].finish_reason == "tool_calls"
        call = first.choices[0].message.tool_calls[0]
        check_call(call)
        history = QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        final = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
        assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert final.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_a_runaway_number_argument_still_closes_the_call(generic_server, hf_tokenizer):
    """Every digit boosted: the argument's number closes at its bound (runtime/json_numbers.py)
    instead of running until max_tokens cuts the call off."""
    from llmx.runtime.json_numbers import INT_DIGITS

    forecast = [{"type": "function", "function": {"name": "forecast", "parameters": {
        "type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"], "additionalProperties": False}}}]
    digits = {str(t): 100 for t in range(len(hf_tokenizer))
              if (text := hf_tokenizer.decode([t])).isdigit() and not text.startswith("0")}
    client = generic_server.client(max_retries=0, timeout=60)
    choice = client.chat.completions.create(model="m", messages=QUESTION, tools=forecast, max_tokens=100, temperature=0,
                                            logit_bias=digits, tool_choice={"type": "function", "function": {"name": "forecast"}}).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    days = json.loads(choice.message.tool_calls[0].function.arguments)["days"]
    assert len(str(abs(days))) == INT_DIGITS
