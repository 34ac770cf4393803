"""gunicorn settings for llmx's server (docs/serving.md explains each choice).

    gunicorn 'llmx.serve:create_app("./art", threads=4)' -c deploy/gunicorn.conf.py

Environment: LLMX_BIND (127.0.0.1:8000), LLMX_WORKERS (1), LLMX_WORKER_THREADS (96),
LLMX_DRAIN_TIMEOUT (30: seconds running requests get on SIGTERM, as `llmx serve --drain-timeout`),
LLMX_API_KEY (require 'Authorization: Bearer KEY'), PROMETHEUS_MULTIPROC_DIR (set here when
several workers run, so /metrics merges them).
"""

import os
import shutil
import tempfile

bind = os.environ.get("LLMX_BIND", "127.0.0.1:8000")
# Every worker loads its own engine: memory = workers x (model + KV cache). On a CPU host one
# worker using all cores (create_app(..., threads=N)) usually beats several small ones.
workers = int(os.environ.get("LLMX_WORKERS", "1"))
# A streamed completion holds a thread for its whole length: sync workers would serve one
# stream at a time. Threads per worker must cover max_batch + max_queue streams plus probes.
worker_class = "gthread"
threads = int(os.environ.get("LLMX_WORKER_THREADS", "96"))
# ONNX Runtime's thread pools hang across fork (gunicorn #2478, onnxruntime #9800): the app,
# and so the engine, is created in each worker after it starts. Never --preload.
preload_app = False
# gthread workers heartbeat from their main loop, so long streams do not trip `timeout`.
# On SIGTERM each worker drains its llmx server (post_worker_init below); graceful_timeout
# must outlast the drain, or the master kills workers mid-answer.
timeout = 120
drain_timeout = float(os.environ.get("LLMX_DRAIN_TIMEOUT", "30"))
graceful_timeout = int(drain_timeout) + 15
keepalive = 5
limit_request_line = 8190
limit_request_fields = 100

if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    # Must be set before workers import prometheus_client; the master's environment is inherited.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="llmx-prometheus-")
    _OWN_METRICS_DIR = os.environ["PROMETHEUS_MULTIPROC_DIR"]
else:
    _OWN_METRICS_DIR = None


def post_worker_init(worker):
    """SIGTERM drains as under `llmx serve`: new requests 503, queued ones end with a clean error
    (SSE error event, then [DONE]), running ones get drain_timeout s; then the worker stops."""
    import signal
    import threading

    service = getattr(worker.wsgi, "extensions", {}).get("llmx")
    if not hasattr(service, "drain"):
        return
    stop_worker = worker.handle_exit

    def drain_then_exit(signum, frame):
        threading.Thread(target=lambda: (service.drain(drain_timeout), stop_worker(signum, frame)),
                         name="llmx-drain", daemon=True).start()

    signal.signal(signal.SIGTERM, drain_then_exit)


def child_exit(server, worker):
    """A dead worker's gauges (queue depth, running) stop counting in /metrics."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)


def on_exit(server):
    if _OWN_METRICS_DIR:
        shutil.rmtree(_OWN_METRICS_DIR, ignore_errors=True)
