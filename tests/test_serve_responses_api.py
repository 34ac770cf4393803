"""``POST /v1/responses`` through the real server and the official ``openai`` client: plain,
streamed (the client's own ``responses.stream`` accumulator checks every event), with a
json_schema text format, with a function tool and its output sent back, and the 400s.

Each answer is compared with what chat completions gives for the same request on the same
server: the Responses API is a translation of it (serve/responses_api.py), not a second engine.
"""

from __future__ import annotations

import json

import openai
import pytest
import requests

from live_server import LiveServer
from tool_templates import HERMES_TEMPLATE, HERMES_TOKENS, make_tool_checkpoint

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A tiny model with a Hermes (Qwen) template: it has a tool format and a system turn."""
    from llmx.export import export_checkpoint

    root = tmp_path_factory.mktemp("responses")
    ckpt = make_tool_checkpoint(root / "ckpt", HERMES_TEMPLATE, HERMES_TOKENS)
    export_checkpoint(ckpt, root / "art")
    with LiveServer(artifact=root / "art", model_name="m", threads=1, max_batch=4) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return server.client(max_retries=0, timeout=60)


def test_plain_text_matches_chat_completions(client):
    r = client.responses.create(model="m", input="Say something.", instructions="Be brief.", max_output_tokens=12,
                                temperature=0)
    chat = client.chat.completions.create(model="m", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "m"
    assert r.output_text == chat.choices[0].message.content
    assert [item.type for item in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if chat.choices[0].finish_reason == "length":  # the tiny model rarely stops on its own
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"
    assert r.instructions == "Be brief." and r.max_output_tokens == 12 and r.store is False


def test_message_items_in_input_are_a_conversation(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "And now?"}]
    r = client.responses.create(model="m", input=items, max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And now?"}])
    assert r.output_text == chat.choices[0].message.content


def test_streamed_events_assemble_to_the_whole_answer(client):
    args = dict(model="m", input="Say something.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**args)
    with client.responses.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_raw_stream_numbers_its_events_and_sends_no_done(server):
    resp = requests.post(f"{server.url}/v1/responses", stream=True, timeout=60,
                         json={"model": "m", "input": "x", "max_output_tokens": 4, "stream": True, "temperature": 0})
    events = [json.loads(line[6:]) for line in resp.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]
    assert done["usage"]["output_tokens"] == 4 and done["status"] == "incomplete"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert done["output"][0]["content"][0]["text"] == deltas


def test_json_schema_text_format_gives_parseable_json(client):
    r = client.responses.create(model="m", input="Is Paris in France?", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}})
    assert json.loads(r.output_text)["answer"] in ("yes", "no")


def test_a_function_call_and_its_output_round_trip(client):
    r = client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                          tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
                                          tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    assert [(c.name, c.arguments) for c in calls] == [(c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls]
    assert calls[0].call_id.startswith("call_")
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    follow = [{"role": "user", "content": "Weather in Paris?"},
              {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, sunny"}]
    r2 = client.responses.create(model="m", input=follow, tools=[WEATHER], max_output_tokens=8, temperature=0)
    assert r2.output and r2.output[-1].type in ("message", "function_call")
    with client.responses.stream(model="m", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=60, temperature=0) as stream:
        streamed = [item for item in stream.get_final_response().output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "bogus": 1}, "bogus"),
    ({}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
])
def test_bad_requests_are_openai_shaped_400s_naming_the_responses_field(server, body, param):
    resp = requests.post(f"{server.url}/v1/responses", json={"model": "m", **body}, timeout=30)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == param and error["message"] and error["type"]


def test_a_stream_that_fails_ends_with_response_failed_not_completed():
    from llmx.serve.responses_api import ResponseEvents

    events = ResponseEvents("m", {})
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    text = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
    error = {"error": {"message": "the engine stopped", "type": "server_error", "param": None, "code": "generation_failed"}}
    sent = [json.loads(e.split("data: ", 1)[1]) for c in (role, text, error, "[DONE]") for e in events(c)]
    kinds = [e["type"] for e in sent]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-2:] == ["error", "response.failed"]
    assert "response.completed" not in kinds and sent[-1]["response"]["error"]["message"] == "the engine stopped"
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
