"""The ways the server is run for real: ``llmx serve`` (a subprocess), gunicorn with the
documented config and app factory (two workers, merged metrics), and the Ray Serve deployment
on a local Ray instance (the ``ray`` marker: skipped where Ray is not installed, a failure under
.ci/run, whose test install has it)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import gunicorn  # noqa: F401  (a test dependency: a broken install fails here, it never skips)
import openai
import pytest
import requests

from llmx.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 90, in_a_row: int = 1) -> None:
    """``in_a_row``: 200s on that many new connections running, so that with several workers (each
    loading its own engine, answering 503 until then) every one is likely ready, not just the first."""
    deadline, ready = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        try:
            ready = ready + 1 if requests.get(url + "/ready", timeout=2).status_code == 200 else 0
        except requests.ConnectionError:
            ready = 0
        if ready >= in_a_row:
            return
        if not ready:
            time.sleep(0.3)
    raise AssertionError("server never became ready")


def check_answers(base_url: str, model: str, engine) -> None:
    """Whole and streamed completions equal the generation loop's."""
    ref = engine.generate(["def"], SamplingParams(max_new_tokens=10, temperature=0.9, seed=3))[0]
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model=model, prompt="def", max_tokens=10, temperature=0.9, seed=3)
    assert out.choices[0].text == ref.text
    chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
    assert [c.choices[0].finish_reason for c in chunks][-1] in ("stop", "length")
    json_type = {"Content-Type": "application/json"}
    bad = requests.post(base_url + "/v1/completions", data=b"{not json", headers=json_type, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    untyped = requests.post(base_url + "/v1/completions", data=b'{"prompt": "def"}', timeout=10)
    assert untyped.status_code == 415 and untyped.json()["error"]["code"] == "unsupported_media_type"
    over = b'{"prompt": "' + b"x" * (1 << 20) + b'"}'
    chunked = requests.post(base_url + "/v1/completions", data=iter([over[:1000], over[1000 : (1 << 20) + 1]]),
                            headers=json_type, timeout=30)
    assert chunked.status_code == 413


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_llmx_serve_command(llama_artifact, llama_engine):
    proc = subprocess.Popen([sys.executable, "-m", "llmx.cli", "serve", str(llama_artifact), "--port", "0", "--threads", "1",
                             "--quiet"], stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        match = re.search(r"serving llama on (http://127\.0\.0\.1:\d+)/v1 \(max batch 8, queue 64, no API key\)", line)
        assert match, line
        check_answers(match.group(1), "llama", llama_engine)
    finally:
        stop(proc, signal.SIGINT)


@pytest.fixture
def broken_artifact(llama_artifact, tmp_path) -> Path:
    """A copy whose decode graph is garbage: the manifest reads fine, the engine cannot load."""
    copy = tmp_path / "broken"
    shutil.copytree(llama_artifact, copy)
    (copy / "decode.onnx").write_bytes(b"not an onnx graph")
    return copy


@pytest.mark.parametrize(
    "args, message",
    [
        (["serve", "{missing}"], "does not exist"),
        (["serve", "{art}", "--port", "{busy}"], "cannot listen on 127.0.0.1:{busy}"),
        (["serve", "{broken}", "--port", "0"], "cannot load decode.onnx"),
        (["serve", "{art}", "--max-batch", "0"], "0 is not in the range x>=1"),
    ],
    ids=["missing-artifact", "port-in-use", "corrupt-graph", "bad-option"],
)
def test_llmx_serve_bad_input_is_one_error_line(llama_artifact, broken_artifact, tmp_path, args, message):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        fill = dict(missing=tmp_path / "nope", art=llama_artifact, broken=broken_artifact, busy=busy.getsockname()[1])
        argv = [a.format(**fill) for a in args]
        proc = subprocess.run([sys.executable, "-m", "llmx.cli", *argv, "--threads", "1"], capture_output=True, text=True, timeout=120)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode != 0 and lines[-1].lower().startswith("error: ") and message.format(**fill) in lines[-1], proc.stderr


def test_an_engine_that_failed_to_load_answers_503_not_ready(broken_artifact):
    from werkzeug.serving import make_server

    from llmx.serve import create_app

    app = create_app(broken_artifact, threads=1)  # as gunicorn's factory call would
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert app.extensions["llmx"].scheduler.settled.wait(60)
        url = f"http://127.0.0.1:{server.server_port}"
        ready = requests.get(url + "/ready", timeout=10)
        assert ready.status_code == 503 and "model failed to load" in ready.json()["error"]["message"]
        assert requests.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 503
        assert requests.get(url + "/health", timeout=10).status_code == 200
    finally:
        server.shutdown()
        server.server_close()


def test_gunicorn_recipe_serves_with_two_workers(llama_artifact, llama_engine, tmp_path):
    port = free_port()
    env = {**os.environ, "LLMX_BIND": f"127.0.0.1:{port}", "LLMX_WORKERS": "2", "LLMX_WORKER_THREADS": "16"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    app = f'llmx.serve:create_app("{llama_artifact}", threads=1)'
    # The server's log goes to a file, not a pipe nobody reads while it runs: a pipe that fills
    # would block the server's logging and look like a hung request.
    log_path = tmp_path / "gunicorn.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "gunicorn", app, "-c", str(ROOT / "deploy" / "gunicorn.conf.py"),
                                 "--control-socket", str(tmp_path / "gunicorn.ctl")],
                                env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log_file, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, in_a_row=10)
        for _ in range(3):
            check_answers(url, "llama", llama_engine)
        metrics = requests.get(url + "/metrics", timeout=10).text
        served = re.search(r'llmx_requests_total\{endpoint="/v1/completions",status="200"\} (\d+)', metrics)
        assert served and int(served.group(1)) == 3  # merged over both workers (multiprocess mode)
    except Exception as err:
        stop(proc)
        raise AssertionError(f"{err!r}; the server's log:\n{log_path.read_text()[-4000:]}") from err
    finally:
        stop(proc)
    log = log_path.read_text()
    assert log.count("Booting worker") == 2 and "gthread" in log, log


def test_gunicorn_preload_is_refused_with_a_clear_error(llama_artifact, tmp_path):
    """--preload would create the engine in the master and fork it: llmx answers 500, never hangs."""
    port = free_port()
    env = {**os.environ, "LLMX_BIND": f"127.0.0.1:{port}", "LLMX_WORKERS": "1", "LLMX_WORKER_THREADS": "4"}
    app = f'llmx.serve:create_app("{llama_artifact}", threads=1)'
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", app, "-c", str(ROOT / "deploy" / "gunicorn.conf.py"), "--preload",
                             "--control-socket", str(tmp_path / "gunicorn.ctl")],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                ready = requests.get(f"http://127.0.0.1:{port}/ready", timeout=5)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.3)
        assert ready.status_code == 500 and "--preload" in ready.json()["error"]["message"]
    finally:
        stop(proc)


def start_serve_on_a_free_port(serve, attempts: int = 3) -> int:
    """Ray's own processes bind ephemeral ports while it starts, so a port found free beforehand
    can be taken by the time Serve's proxy binds it (seen once in CI); another port is asked for
    only on that failure."""
    for attempt in range(attempts):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except RuntimeError as exc:
            if "Failed to bind" not in str(exc) or attempt == attempts - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


@pytest.mark.ray
def test_ray_serve_deployment_on_a_local_ray_instance(llama_artifact, llama_engine):
    import ray
    from ray import serve

    from llmx.serve.ray_deployment import build_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = start_serve_on_a_free_port(serve)
        serve.run(build_app({"artifact": str(llama_artifact), "threads": "1", "max_batch": "4"}), route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        assert requests.get(url + "/ready", timeout=10).json()["status"] == "ready"
        check_answers(url, "llama", llama_engine)
        assert requests.get(url + "/v1/nothing", timeout=10).json()["error"]["code"] == "not_found"
        # Every route of the Flask app, counted in the same metrics (serve/routes.py serves both).
        tokenized = requests.post(url + "/tokenize", json={"prompt": "def"}, timeout=10).json()
        assert tokenized["tokens"] and tokenized["count"] == len(tokenized["tokens"])
        assert requests.get(url + "/v1/completions", timeout=10).json()["error"]["code"] == "method_not_allowed"
        metrics = requests.get(url + "/metrics", timeout=10).text
        assert re.search(r'llmx_requests_total\{endpoint="/v1/completions",status="415"\} 1', metrics), metrics
    finally:
        serve.shutdown()
        ray.shutdown()
