"""SIGTERM drains ``llmx serve`` and the gunicorn recipe: a real server process, running and queued streams, a signal.
Every stream must end in ``[DONE]`` (after its finish or a clean error event), none cut
silently; new work is refused with 503 meanwhile; the process exits 0 within the drain timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

DRAIN_S = 2.0


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["llmx-serve", "gunicorn"])
def serve_process(request, demo_artifact):
    if request.param == "llmx-serve":
        cmd = [sys.executable, "-m", "llmx.cli", "serve", str(demo_artifact), "--port", "0", "--threads", "1", "--quiet",
               "--max-batch", "2", "--max-queue", "8", "--drain-timeout", str(DRAIN_S), "--prefix-cache-mb", "0"]
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        listening = r"on (http://127\.0\.0\.1:\d+)/v1"
    else:
        pytest.importorskip("gunicorn")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = {**os.environ, "LLMX_BIND": f"127.0.0.1:{port}", "LLMX_WORKERS": "1", "LLMX_WORKER_THREADS": "16",
               "LLMX_DRAIN_TIMEOUT": str(DRAIN_S)}
        app = f'llmx.serve:create_app("{demo_artifact}", threads=1, max_batch=2, max_queue=8, prefix_cache_mb=0)'
        proc = subprocess.Popen([sys.executable, "-m", "gunicorn", app, "-c", str(ROOT / "deploy" / "gunicorn.conf.py")],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        listening = r"Listening at: (http://127\.0\.0\.1:\d+)"
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if match := re.search(listening, line):
            break
    else:
        pytest.fail("".join(lines))
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    url = match.group(1)
    deadline = time.monotonic() + 60
    while requests.get(url + "/ready", timeout=5).status_code != 200:  # gunicorn loads the model after listening
        assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)
    yield proc, url, lines
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _stream(url: str, events: list) -> None:
    body = {"prompt": "def", "max_tokens": 480, "stream": True, "ignore_eos": True}
    try:
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as answer:
            for line in answer.iter_lines():
                if line.startswith(b"data: "):
                    data = line[6:].decode()
                    events.append(data if data == "[DONE]" else json.loads(data))
    except requests.RequestException as exc:
        events.append(exc)


def test_sigterm_drains_running_and_queued_streams_then_exits_0(serve_process):
    proc, url, log = serve_process
    streams = [[] for _ in range(6)]
    threads = [threading.Thread(target=_stream, args=(url, events)) for events in streams]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready = requests.get(url + "/ready", timeout=5).json()
        if (ready["running"], ready["waiting"]) == (2, 4):
            break
        time.sleep(0.05)
    assert (ready["running"], ready["waiting"]) == (2, 4), ready
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    time.sleep(0.2)
    refused = requests.post(url + "/v1/completions", json={"prompt": "def", "max_tokens": 2}, timeout=5)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert requests.get(url + "/ready", timeout=5).status_code == 503
    assert proc.wait(timeout=DRAIN_S + 15) == 0, "".join(log)
    assert time.monotonic() - signalled < DRAIN_S + 5
    for t in threads:
        t.join(10)
    endings = []
    for events in streams:
        assert events and events[-1] == "[DONE]", events[-3:]  # never cut silently
        last = events[-2]
        if "error" in last:
            assert last["error"]["code"] == "server_shutting_down"
            endings.append("error")
        else:
            endings.append(last["choices"][0]["finish_reason"])
    assert endings.count("error") >= 4, endings  # the queued four at least
