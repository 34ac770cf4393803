"""Structured output through a live server on the demo model, driven by the official client:
20 pydantic models through ``chat.completions.parse`` (whole, streamed, n=3) all parse and
validate; vLLM's ``structured_outputs`` (regex, grammar, choice, json), json_object,
logit_bias, /tokenize and /detokenize; bad schemas and grammars are 400s before any work."""

from __future__ import annotations

import datetime
import enum
import json
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal, Optional, Union

import pytest
import requests
from pydantic import BaseModel, Field

from live_server import LiveServer


# Strings carry a max_length: a 4.9M-parameter code model, greedy, may never close a free string.
Word = Annotated[str, Field(max_length=12)]


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


class Point(BaseModel):
    x: float
    y: float


class Paint(BaseModel):
    color: Color
    litres: float = Field(gt=0, le=20)


class Item(BaseModel):
    sku: str = Field(max_length=8)
    qty: int = Field(ge=1, le=9)


class Order(BaseModel):
    id: int
    items: list[Item] = Field(min_length=1, max_length=3)


class Profile(BaseModel):
    nickname: Optional[str] = Field(max_length=10)
    age: Optional[int]


class Tags(BaseModel):
    tags: list[Word] = Field(min_length=1, max_length=3)


class Status(BaseModel):
    status: Literal["open", "closed", "pending"]


class Birthday(BaseModel):
    day: datetime.date


class Event(BaseModel):
    at: datetime.datetime


class Record(BaseModel):
    key: uuid.UUID


class Flags(BaseModel):
    enabled: bool
    visible: bool


class Geo(BaseModel):
    lat: float = Field(ge=-90, le=90)
    lon: float = Field(ge=-180, le=180)


class Address(BaseModel):
    city: str = Field(max_length=12)
    geo: Geo


class Company(BaseModel):
    name: str = Field(max_length=12)
    address: Address


class Bounds(BaseModel):
    ratio: float = Field(ge=0, le=1)
    small: int = Field(gt=-5, lt=5)


class Either(BaseModel):
    value: Union[int, Word]


class Palette(BaseModel):
    colors: list[Color] = Field(min_length=1, max_length=4)


class Code(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")


class Route(BaseModel):
    start: Geo  # one $defs entry referenced twice
    end: Geo


class Alarm(BaseModel):
    at: datetime.time
    label: Literal["wake", "sleep"]


MODELS = [Person, Point, Paint, Order, Profile, Tags, Status, Birthday, Event, Record, Flags, Company, Bounds, Either,
          Palette, Code, Route, Alarm, Address, Item]
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def server(demo_artifact):
    from llmx.runtime.engine import Engine

    with LiveServer(engine=Engine.load(demo_artifact, threads=1), model_name="demo", max_batch=16) as srv:
        yield srv


def each_model(call) -> list:
    """Run ``call(model)`` for every model at once: the server batches them."""
    with ThreadPoolExecutor(len(MODELS)) as pool:
        return list(pool.map(call, MODELS))


def test_twenty_pydantic_models_parse(server):
    client = server.client()

    def call(model):
        return client.chat.completions.parse(model="demo", messages=MESSAGES, response_format=model, max_tokens=300,
                                             temperature=0)

    for model, answer in zip(MODELS, each_model(call)):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
        assert isinstance(choice.message.parsed, model), (model.__name__, choice.message.content)


def test_twenty_pydantic_models_parse_streamed(server):
    client = server.client()

    def call(model):
        with client.chat.completions.stream(model="demo", messages=MESSAGES, response_format=model, max_tokens=300,
                                            temperature=0.8, seed=7) as stream:
            deltas = sum(1 for event in stream if event.type == "content.delta")
            return deltas, stream.get_final_completion()

    for model, (deltas, answer) in zip(MODELS, each_model(call)):
        assert deltas > 1, model.__name__  # streamed in pieces, not in one chunk
        assert isinstance(answer.choices[0].message.parsed, model), (model.__name__, answer.choices[0].message.content)


def test_twenty_pydantic_models_parse_with_n3(server):
    client = server.client()

    def call(model):
        return client.chat.completions.parse(model="demo", messages=MESSAGES, response_format=model, max_tokens=300,
                                             temperature=1.0, seed=11, n=3)

    distinct = 0
    for model, answer in zip(MODELS, each_model(call)):
        assert len(answer.choices) == 3
        for choice in answer.choices:
            assert isinstance(choice.message.parsed, model), (model.__name__, choice.message.content)
        distinct += len({c.message.content for c in answer.choices}) > 1
    assert distinct >= 10  # sampled choices differ (each has its own seed), yet all follow the schema


def post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=60)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_json_object_on_both_endpoints(server, endpoint):
    # Free JSON lets a tiny code model write keys without end: each choice that stops is an object.
    body = {"response_format": {"type": "json_object"}, "max_tokens": 120, "temperature": 1.0, "seed": 1, "n": 12}
    body.update({"messages": [{"role": "user", "content": "d = dict("}]} if "chat" in endpoint else {"prompt": "d = dict("})
    choices = post(server, endpoint, body).json()["choices"]
    done = [c.get("text") or c["message"]["content"] for c in choices if c["finish_reason"] == "stop"]
    assert done and all(isinstance(json.loads(t), dict) for t in done)
    assert all(t.startswith("{") for t in [c.get("text") or c["message"]["content"] for c in choices])


def test_structured_outputs_regex_grammar_choice_json(server):
    def complete(spec, **extra):
        r = post(server, "/v1/completions", {"prompt": "x = ", "max_tokens": 60, "structured_outputs": spec, **extra})
        assert r.status_code == 200, r.text
        return [c["text"] for c in r.json()["choices"]]

    assert all(re.fullmatch(r"[0-9]{3}-[0-9]{4}", t) for t in complete({"regex": r"[0-9]{3}-[0-9]{4}"}, n=3, temperature=1, seed=1))
    assert all(re.fullmatch(r"(yes|no)!", t) for t in complete({"grammar": 'start: ("yes" | "no") "!"'}, n=3, temperature=1))
    assert all(t in ("alpha", "beta") for t in complete({"choice": ["alpha", "beta"]}, n=3, temperature=1, seed=2))
    assert all(isinstance(json.loads(t), int) for t in complete({"json": {"type": "integer", "minimum": 3, "maximum": 9}}))


def test_openai_client_extra_body_grammar_streams(server):
    stream = server.client().chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=40, stream=True, temperature=0,
        extra_body={"structured_outputs": {"regex": r"[a-z]{2,6}( [a-z]{2,6}){2}"}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){2}", text), text


def test_logit_bias_ban_and_boost(server):
    def complete(bias):
        return post(server, "/v1/completions", {"prompt": "def main():", "max_tokens": 4, "temperature": 0,
                                                "logit_bias": bias}).json()["choices"][0]["text"]

    plain = complete({})
    first = post(server, "/tokenize", {"prompt": plain, "add_special_tokens": False}).json()["tokens"][0]
    assert post(server, "/tokenize", {"prompt": complete({str(first): -100}), "add_special_tokens": False}).json()["tokens"][0] != first
    banana = post(server, "/tokenize", {"prompt": " banana", "add_special_tokens": False}).json()["tokens"][0]
    assert complete({str(banana): 100}) == post(server, "/detokenize", {"tokens": [banana] * 4}).json()["prompt"]


def test_tokenize_round_trip(server):
    text = "def f(x):\n    return x + 1  # ünïcode"
    out = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) and out["max_model_len"] == 512
    assert post(server, "/detokenize", {"tokens": out["tokens"][1:]}).json()["prompt"] == text  # [0] is BOS
    chat = post(server, "/tokenize", {"messages": MESSAGES}).json()
    assert post(server, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"].endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "Invalid type: strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format", 'Unimplemented keys: ["not"]'),
    ({"response_format": {"type": "yaml"}}, "response_format", "must be one of"),
    ({"structured_outputs": {"grammar": 'start: x\nx: x "a"'}}, "structured_outputs", "cannot match any text"),
    ({"structured_outputs": {"regex": "a(?=b)"}}, "structured_outputs", "look-around"),
    ({"structured_outputs": {"regex": "a", "grammar": "start: \"a\""}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs", "not valid JSON"),
    ({"logit_bias": {"4096": 5}}, "logit_bias[\"4096\"]", "token id in [0, 4096)"),
    ({"logit_bias": {"7": 101}}, "logit_bias[\"7\"]", "[-100, 100]"),
    ({"logit_bias": ""}, "logit_bias", "an object mapping"),  # falsy but not null: still a wrong type
    ({"response_format": {"type": "json_object"}, "use_beam_search": True, "n": 2}, "response_format", "beam search"),
])
def test_bad_constraints_are_400_before_any_work(server, body, param, words):
    before = server.metric("llmx_requests_total", 'endpoint="/v1/chat/completions",status="200"')
    r = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"
    assert server.scheduler.counts() == (0, 0)
    assert server.metric("llmx_requests_total", 'endpoint="/v1/chat/completions",status="200"') == before


def test_client_raises_bad_request_for_a_bad_schema(server):
    import openai

    with pytest.raises(openai.BadRequestError, match="Unimplemented keys"):
        server.client().chat.completions.create(model="demo", messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}})
