"""Streams over a raw socket: a client that disconnects mid-stream frees its batch slot, and a
stream waiting for a row gets SSE keep-alive comments. The backend is slowed (a real one plus
a sleep per decode step) so that a stream outlives the client by seconds."""

from __future__ import annotations

import json
import socket
import time

import pytest

from live_server import LiveServer, slow_engine

DELAY = 0.02  # seconds per decode step: 200 tokens take >= 4 s


def open_stream(url: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    return sock


def read_until(sock: socket.socket, marker: bytes, count: int = 1) -> bytes:
    data = b""
    while data.count(marker) < count:
        chunk = sock.recv(65536)
        assert chunk, f"stream ended early: {data[-300:]!r}"
        data += chunk
    return data


@pytest.fixture
def slow_server(llama_artifact):
    with LiveServer(engine=slow_engine(llama_artifact, DELAY), max_batch=1, max_queue=4, keepalive_s=0.1) as live:
        yield live


def wait_for(condition, timeout: float) -> float:
    start = time.perf_counter()
    while not condition():
        assert time.perf_counter() - start < timeout, "timed out"
        time.sleep(0.01)
    return time.perf_counter() - start


def test_disconnecting_mid_stream_frees_the_batch_slot(slow_server):
    body = {"prompt": "def", "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    sock = open_stream(slow_server.url, body)
    read_until(sock, b"data: ", 3)  # three tokens in
    assert slow_server.scheduler.counts() == (1, 0)
    sock.close()
    freed_after = wait_for(lambda: slow_server.scheduler.counts() == (0, 0), timeout=2.0)
    assert freed_after < 1.0  # the stream had ~190 tokens (>= 3.8 s) left
    assert slow_server.metric("llmx_cancelled_sequences_total") == 1
    # The freed row serves the next request.
    done = read_until(open_stream(slow_server.url, {**body, "max_tokens": 3}), b"data: [DONE]")
    assert done.count(b'"finish_reason": "length"') == 1


def test_waiting_stream_gets_keep_alive_comments_then_its_tokens(slow_server):
    first = open_stream(slow_server.url, {"prompt": "def", "max_tokens": 40, "stream": True, "ignore_eos": True})
    read_until(first, b"data: ")  # holds the only row for ~0.8 s
    second = open_stream(slow_server.url, {"prompt": "x", "max_tokens": 3, "stream": True, "ignore_eos": True})
    data = read_until(second, b"data: [DONE]")
    head, _, _ = data.partition(b"data: {")
    assert head.count(b": keep-alive\n\n") >= 2  # sent every 0.1 s while it waited for the row
    assert data.count(b'"finish_reason": "length"') == 1
    first.close()


def test_client_gone_before_its_first_token_is_cancelled_too(slow_server):
    body = {"prompt": "def", "max_tokens": 200, "stream": True, "ignore_eos": True}
    holder = open_stream(slow_server.url, body)
    read_until(holder, b"data: ")
    queued = open_stream(slow_server.url, body)
    read_until(queued, b": keep-alive")  # waiting for the row, not yet started
    queued.close()
    wait_for(lambda: slow_server.scheduler.counts() == (1, 0), timeout=2.0)
    holder.close()
    wait_for(lambda: slow_server.scheduler.counts() == (0, 0), timeout=2.0)
    assert slow_server.metric("llmx_cancelled_sequences_total") == 2
