"""Requests that are valid-looking but hostile (huge stop strings, text the tokenizer cannot
take, clients that go away) must neither hold the scheduler nor crash a handler."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import requests

from live_server import LiveServer, slow_engine
from llmx.runtime.params import MAX_STOP_CHARS, MAX_STOPS
from llmx.runtime.sequence import StopStrings


def _feed_time(stops: list[str], text: str) -> float:
    best = float("inf")
    for _ in range(3):
        matcher = StopStrings(stops)
        start = time.perf_counter()
        for ch in text:
            matcher.feed(ch)
        best = min(best, time.perf_counter() - start)
    return best


def test_stop_matching_costs_the_same_for_long_and_short_stop_strings():
    # "zzz...": every stop keeps a growing partial match, the worst case for a rescanning matcher.
    text = "z" * 3000
    short = _feed_time(["z" * 15 + "y"] * MAX_STOPS, text)
    long = _feed_time(["z" * (MAX_STOP_CHARS - 1) + "y"] * MAX_STOPS, text)
    assert long < 4 * short + 0.05, (long, short)


@pytest.mark.parametrize("stops, text, shown", [
    (["abcd", "bc"], ["abcd"], ""),  # both in one delta: the earliest start wins
    (["aab"], ["a", "a", "a", "b", "x"], "a"),  # a partial match restarts from its border
    (["xyx"], ["xy", "xy", "x"], ""),
    (["xyz"], ["axy", "xy", "z!"], "axy"),
    (["\n\n"], ["a\n", "b\n", "\n"], "a\nb"),
])
def test_stop_strings_cut_at_the_first_occurrence(stops, text, shown):
    matcher, out = StopStrings(stops), ""
    for delta in text:
        emitted, hit = matcher.feed(delta)
        out += emitted
        if hit:
            break
    assert hit and out == shown


@pytest.fixture(scope="module")
def server(llama_artifact):
    with LiveServer(artifact=llama_artifact, threads=1) as live:
        yield live


def _post(server, body: dict, path: str = "/v1/completions") -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=120)


def test_stop_strings_beyond_the_documented_limits_are_400(server):
    issue = _post(server, {"prompt": "def f(x):", "max_tokens": 16, "stop": ["z" * 240000, "y" * 240000]})
    assert issue.status_code == 400 and f"each 1 to {MAX_STOP_CHARS} characters" in issue.json()["error"]["message"]
    assert issue.json()["error"]["param"] == "stop"
    many = _post(server, {"prompt": "def", "max_tokens": 2, "stop": ["a", "b", "c", "d", "e"]})
    assert many.status_code == 400 and f"at most {MAX_STOPS}" in many.json()["error"]["message"]
    at_limit = _post(server, {"prompt": "def", "max_tokens": 4, "stop": ["z" * MAX_STOP_CHARS] * MAX_STOPS})
    assert at_limit.status_code == 200, at_limit.text


def test_a_hostile_request_does_not_hold_a_normal_one(server):
    normal = {"prompt": "def", "max_tokens": 4, "temperature": 0}
    start = time.perf_counter()
    assert _post(server, normal).status_code == 200
    solo = time.perf_counter() - start
    hostile = {"prompt": "def f(x):", "max_tokens": 16, "stop": ["z" * 240000, "y" * 240000], "ignore_eos": True}
    answers: list[requests.Response] = []
    thread = threading.Thread(target=lambda: answers.append(_post(server, hostile)))
    thread.start()
    time.sleep(0.3)  # the hostile request is in
    start = time.perf_counter()
    assert _post(server, normal).status_code == 200
    beside = time.perf_counter() - start
    thread.join()
    assert answers[0].status_code in (200, 400)
    assert beside < max(10 * solo, 1.0), (beside, solo)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "a\udfffb"], "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud83d"}], "max_tokens": 2}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages[0].content"),
    ("/v1/completions", {"prompt": "def", "max_tokens": 2, "stop": ["\ud800"]}, "stop"),
])
def test_text_the_tokenizer_cannot_take_is_a_400(server, path, body, param):
    answer = _post(server, body, path)  # requests escapes the surrogate as JSON's "\ud800"
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"]
    assert _post(server, {"prompt": "def", "max_tokens": 2}).status_code == 200


def test_a_non_streamed_request_is_cancelled_when_its_client_goes_away(llama_artifact):
    with LiveServer(engine=slow_engine(llama_artifact, 0.02)) as live:
        body = b'{"prompt": "def", "max_tokens": 200, "ignore_eos": true}'
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", live.server.server_port)) as sock:
            sock.sendall(head + body)
            deadline = time.monotonic() + 10
            while live.scheduler.counts()[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert live.scheduler.counts()[0] == 1
        gone = time.monotonic()  # 200 tokens x 20 ms = 4 s if it ran on
        while live.scheduler.counts() != (0, 0) and time.monotonic() < gone + 3:
            time.sleep(0.02)
        assert live.scheduler.counts() == (0, 0)
        assert live.metric("llmx_cancelled_sequences_total") >= 1


@pytest.fixture(scope="module")
def small_server(llama_artifact):
    """A small body limit, a short HTTP timeout and few connections, to reach each bound fast."""
    with LiveServer(engine=slow_engine(llama_artifact, 0), max_body_bytes=4096, timeout=1.0, max_connections=4) as live:
        yield live


def test_a_body_over_the_limit_is_413_even_when_chunked(small_server):
    body = b'{"prompt": "' + b"x" * 8000 + b'", "max_tokens": 2}'
    chunked = requests.post(small_server.url + "/v1/completions", data=iter([body[:100], body[100:]]),
                            headers={"Content-Type": "application/json"}, timeout=10)
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    sized = requests.post(small_server.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"},
                          timeout=10)
    assert sized.status_code == 413
    fits = b'{"prompt": "def", "max_tokens": 2}'
    ok = requests.post(small_server.url + "/v1/completions", data=iter([fits[:5], fits[5:]]),
                       headers={"Content-Type": "application/json"}, timeout=10)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_that_is_not_declared_json_is_415(small_server, content_type):
    # What a cross-site form or fetch without preflight can send: refused, so no page can spend our compute.
    headers = {"Content-Type": content_type} if content_type else {}
    answer = requests.post(small_server.url + "/v1/completions", data=b'{"prompt": "def", "max_tokens": 2}',
                           headers=headers, timeout=10)
    assert answer.status_code == 415 and answer.json()["error"]["code"] == "unsupported_media_type"


def test_silent_and_slow_connections_time_out_and_connections_are_bounded(small_server):
    url, port = small_server.url, small_server.server.server_port
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    idle[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # half-sent headers
    time.sleep(0.2)
    with socket.create_connection(("127.0.0.1", port)) as extra:  # a fifth: refused, not a fifth thread
        extra.settimeout(5)
        assert extra.recv(200).startswith(b"HTTP/1.1 503")
    for sock in idle:  # the server closes each within its 1 s timeout
        sock.settimeout(5)
        assert sock.recv(100) == b""
        sock.close()
    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    start, answer = time.monotonic(), b""
    try:
        for _ in range(40):  # a byte every 0.2 s: each read is in time, the whole body is not
            slow.sendall(b" ")
            time.sleep(0.2)
    except OSError:
        pass
    slow.settimeout(5)
    answer = slow.recv(200)
    slow.close()
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 5
    assert requests.post(url + "/v1/completions", json={"prompt": "def", "max_tokens": 2}, timeout=10).status_code == 200


def test_a_megabyte_prompt_is_refused_by_its_length_before_tokenizing(server):
    answer = _post(server, {"prompt": "x " * 500_000, "max_tokens": 2})  # 1 MB, under the 1 MiB body limit
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "1000000 characters" in error["message"]


def test_tokenizing_a_long_text_lets_other_threads_run(llama_engine):
    text = "def f(x): return x + 1\n" * 20_000
    gaps, done = [], threading.Event()

    def ticker():
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.05)
    start = time.perf_counter()
    llama_engine.tokenizer.encode(text)
    took = time.perf_counter() - start
    done.set()
    thread.join()
    assert max(gaps) < took / 2, (max(gaps), took)  # holding the GIL, one gap would span it all
