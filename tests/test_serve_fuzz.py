"""Fuzzing the HTTP API with hypothesis. Through a real socket: hundreds of malformed requests
(bad JSON, wrong types, out-of-range values, unknown fields, bad keys, oversized bodies, wrong
routes, wrong content types), each a 4xx with an OpenAI-shaped error. In process (Flask's test
client, for volume): over a thousand requests putting JSON of every type in every field, invalid
UTF-8, lone surrogates, huge numbers and deep nesting: never a 5xx. The server must still answer.
"""

from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from live_server import LiveServer

KEY = "fuzz-key"
JSON_HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
MAX_BODY = 4096
GOOD = {
    "/v1/completions": {"model": "llama", "prompt": "def", "max_tokens": 2},
    "/v1/chat/completions": {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}

# Values that are never valid for a field of each kind (null is valid everywhere: it means default).
junk = st.one_of(st.text(max_size=8), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
not_int = st.one_of(junk, st.booleans(), st.floats(allow_nan=True, allow_infinity=True))
not_number = st.one_of(junk, st.booleans(), st.just(float("nan")), st.just(float("inf")))
not_bool = st.one_of(junk, st.integers(), st.floats(allow_nan=False))


def number_outside(lo: float, hi: float, lo_open: bool = False) -> st.SearchStrategy:
    below = st.floats(max_value=lo, exclude_max=not lo_open, allow_nan=False)
    above = st.floats(min_value=hi, exclude_min=True, allow_nan=False)
    return st.one_of(not_number, below, above)


def int_outside(lo: int, hi: int | None = None) -> st.SearchStrategy:
    return st.one_of(not_int, st.integers(max_value=lo - 1), st.integers(min_value=hi + 1) if hi is not None else st.nothing())


COMMON = {
    "model": st.one_of(st.integers(), st.booleans(), st.lists(st.text(max_size=3), max_size=2), st.text(max_size=10).filter(lambda s: s != "llama")),
    "max_tokens": st.one_of(int_outside(1), st.integers(min_value=300)),
    "temperature": number_outside(0, 2),
    "top_p": number_outside(0, 1, lo_open=True),
    "top_k": int_outside(-1),
    "min_p": number_outside(0, 1),
    "presence_penalty": number_outside(-2, 2),
    "frequency_penalty": number_outside(-2, 2),
    "repetition_penalty": number_outside(0, 10, lo_open=True),
    "stop": st.one_of(st.integers(), st.booleans(), st.just(""), st.lists(st.integers(), min_size=1, max_size=3),
                      st.lists(st.text(min_size=1, max_size=3), min_size=5, max_size=8)),
    "seed": int_outside(0, 2**63 - 1),
    "n": int_outside(1, 64),
    "stream": not_bool,
    "ignore_eos": not_bool,
    "logit_bias": st.one_of(st.text(max_size=8), st.lists(st.integers(), max_size=3),
                            st.dictionaries(st.text(max_size=3).filter(lambda k: not (k.isascii() and k.isdigit())), st.integers(), min_size=1),
                            st.dictionaries(st.sampled_from(["1", "2", "99999"]), st.integers().filter(lambda v: abs(v) > 100), min_size=1)),
    "response_format": st.one_of(junk, st.just({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}})),
    "structured_outputs": st.one_of(junk, st.just({"regex": "("}), st.just({"grammar": 'start: x\nx: x "a"'}),
                                    st.just({"regex": "a", "choice": ["a"]})),
    "stream_options": st.one_of(junk, st.just({"include_usage": True})),  # the latter without stream: true
}
FIELDS = {
    "/v1/completions": {
        **COMMON,
        "prompt": st.one_of(st.integers(), st.booleans(), st.floats(), st.just([]), st.dictionaries(st.text(max_size=3), st.text(max_size=3), min_size=1),
                            st.lists(st.integers(min_value=10**6), min_size=1, max_size=3), st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
                            st.lists(st.one_of(st.booleans(), st.floats(), st.none()), min_size=1, max_size=3),
                            st.just("def " * 300)),
        "logprobs": int_outside(0, 20),
        "echo": st.one_of(st.just(True), not_bool),
        "best_of": st.integers(min_value=2, max_value=64),
    },
    "/v1/chat/completions": {
        **COMMON,
        "messages": st.one_of(junk,
                              st.lists(st.one_of(st.integers(), st.text(max_size=5), st.just({"content": "hi"}),
                                                 st.builds(dict, role=st.text(max_size=6).filter(lambda r: r not in ("system", "developer", "user", "assistant", "tool")), content=st.just("hi")),
                                                 st.builds(dict, role=st.just("user"), content=st.one_of(st.integers(), st.lists(st.integers(), min_size=1)))),
                                       min_size=1, max_size=3)),
        "logprobs": not_bool,
        "top_logprobs": st.integers(min_value=0, max_value=20),  # without logprobs: true
        "max_completion_tokens": int_outside(1),
        "tools": st.lists(st.dictionaries(st.text(max_size=3), st.text(max_size=3)), min_size=1, max_size=2),
    },
}


@st.composite
def bad_field(draw):
    path = draw(st.sampled_from(sorted(FIELDS)))
    field = draw(st.sampled_from(sorted(FIELDS[path])))
    return "POST", path, JSON_HEADERS, json.dumps({**GOOD[path], field: draw(FIELDS[path][field])}).encode()


@st.composite
def bad_document(draw):
    path = draw(st.sampled_from(sorted(FIELDS)))
    body = draw(st.one_of(
        st.binary(max_size=64).filter(lambda b: not _parses(b)),  # not JSON at all
        st.text(max_size=32).map(str.encode).filter(lambda b: not _parses(b)),
        st.one_of(st.integers(), st.text(max_size=8), st.lists(st.integers(), max_size=3), st.none(), st.booleans()).map(lambda v: json.dumps(v).encode()),
        st.text(min_size=1, max_size=12).filter(lambda k: k not in FIELDS[path]).map(lambda k: json.dumps({**GOOD[path], k: 1}).encode()),
        st.integers(min_value=MAX_BODY + 1, max_value=4 * MAX_BODY).map(lambda n: json.dumps({**GOOD[path], "user": "x" * n}).encode()),
        st.integers(min_value=10, max_value=2000).map(lambda depth: b"[" * depth + b"]" * depth),  # deep nesting
    ))
    return "POST", path, JSON_HEADERS, body


@st.composite
def bad_request_line(draw):
    # Printable, no spaces: never "Bearer <key>".
    auth = draw(st.one_of(st.none(), st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=20)))
    path = draw(st.sampled_from(sorted(FIELDS)))
    headers = {"Content-Type": "application/json"} if auth is None else {"Authorization": auth, "Content-Type": "application/json"}
    if draw(st.booleans()):
        return "POST", path, headers, json.dumps(GOOD[path]).encode()  # wrong or missing key
    if draw(st.booleans()):
        content_type = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""]))
        return "POST", path, {**JSON_HEADERS, "Content-Type": content_type}, json.dumps(GOOD[path]).encode()
    method, where = draw(st.sampled_from([("GET", path), ("PUT", path), ("DELETE", "/v1/models"), ("POST", "/health"),
                                          ("GET", "/v1/nothing"), ("POST", "/v1/embeddings")]))
    return method, where, JSON_HEADERS, b"{}"


def _parses(raw: bytes) -> bool:
    try:
        json.loads(raw)
        return True
    except (ValueError, RecursionError):
        return False


@pytest.fixture(scope="module")
def server(llama_artifact):
    with LiveServer(artifact=llama_artifact, threads=1, api_key=KEY, max_body_bytes=MAX_BODY) as live:
        yield live


def assert_openai_error(response: requests.Response) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)


def test_malformed_requests_get_openai_4xx_and_the_server_survives(server):
    answered: list[int] = []
    session = requests.Session()

    @settings(max_examples=320, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(bad_field(), bad_document(), bad_request_line()))
    def check(case):
        method, path, headers, body = case
        response = session.request(method, server.url + path, data=body, headers=headers, timeout=30)
        assert_openai_error(response)
        answered.append(response.status_code)

    check()
    assert len(answered) >= 200
    assert {400, 401, 404, 405, 413, 415} <= set(answered), sorted(set(answered))
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert_healthy(server)


def assert_healthy(server) -> None:
    ok = requests.post(server.url + "/v1/completions", json=GOOD["/v1/completions"], headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2
    assert requests.get(server.url + "/ready", timeout=10).status_code == 200


# -- any JSON in any field, through the app in process ------------------------------------------

SURROGATE = st.integers(0xD800, 0xDFFF).map(chr)
any_text = st.one_of(st.text(max_size=12), st.lists(st.one_of(st.characters(), SURROGATE), max_size=6).map("".join))
extreme = st.sampled_from([10**100, -10**100, 2**63, 2**64, -1, 0, 1e308, -1e308, 5e-324, 1e400, -0.0, 10**4000])
any_json = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), any_text, extreme),
                        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(any_text, inner, max_size=3)),
                        max_leaves=12)
deep = st.integers(min_value=50, max_value=5000).map(lambda depth: "[" * depth + "1" + "]" * depth)
ALL_FIELDS = {path: sorted(fields) + ["messages" if "chat" in path else "prompt", "max_tokens"] for path, fields in FIELDS.items()}


@st.composite
def any_value_anywhere(draw):
    """GOOD with one field (or several) set to arbitrary JSON, in text or bytes the parser must judge."""
    path = draw(st.sampled_from(sorted(FIELDS)))
    body = dict(GOOD[path])
    for field in draw(st.lists(st.sampled_from(ALL_FIELDS[path]), min_size=1, max_size=3)):
        body[field] = draw(any_json)
    if draw(st.integers(0, 3)) == 0:  # text the tokenizer cannot take, where text goes
        bad = draw(st.text(max_size=4)) + draw(SURROGATE) + draw(st.text(max_size=4))
        where = draw(st.sampled_from(["prompt", "prompts", "content", "parts", "stop"]))
        if "chat" in path:
            content = [{"type": "text", "text": bad}] if where == "parts" else bad
            body["messages"] = [{"role": "user", "content": content}] if where != "stop" else body["messages"]
        else:
            body["prompt"] = ["ok", bad] if where == "prompts" else bad
        body["stop"] = bad if where == "stop" else body.get("stop")
    raw = json.dumps(body, allow_nan=True)  # 1e400 is written as Infinity, big ints in full
    how = draw(st.sampled_from(["as is", "deep", "invalid utf-8", "raw surrogate"]))
    if how == "deep":
        raw = raw[:-1] + f', "{draw(st.sampled_from(ALL_FIELDS[path]))}": {draw(deep)}}}'
    data = raw.encode()
    if how == "invalid utf-8":
        data = data.replace(b'"max_tokens"', b'"max_tokens\xff\xfe"'.decode("unicode_escape").encode("latin-1"), 1)
    if how == "raw surrogate":
        data = data[:-1] + b', "user": "\xed\xa0\x80"}'.decode("unicode_escape").encode("latin-1")
    return path, body, data


def test_any_json_in_any_field_never_gets_a_5xx(server):
    client = server.app.test_client()
    statuses: list[int] = []

    @settings(max_examples=1100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(any_value_anywhere())
    def check(case):
        path, body, data = case
        response = client.post(path, data=data, headers=JSON_HEADERS)
        statuses.append(response.status_code)
        assert response.status_code < 500, (response.status_code, response.get_data()[:300], data[:300])
        if response.status_code != 200:
            error = response.get_json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error

    check()
    assert len(statuses) >= 1000 and statuses.count(200) < len(statuses) / 2, sorted(set(statuses))
    assert_healthy(server)
