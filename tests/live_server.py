"""A real llmx server on a loopback port, in a thread of the test process (the bounded threaded
server ``llmx serve`` runs, serve/http_server.py): tests talk to it through a real socket."""

from __future__ import annotations

import threading

from llmx.serve import create_app
from llmx.serve.http_server import make_server


class LiveServer:
    def __init__(self, timeout: float = 30.0, max_connections: int = 256, **app_options):
        self.app = create_app(**app_options)
        self.service = self.app.extensions["llmx"]
        self.worker = self.service.worker  # a Scheduler (decoders) or an EmbeddingBatcher (encoders)
        self.scheduler = getattr(self.service, "scheduler", None)
        self.server = make_server("127.0.0.1", 0, self.app, timeout=timeout, max_connections=max_connections)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        assert self.worker.ready.wait(60), self.worker.load_error
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self.scheduler:
            self.scheduler.stop()

    def client(self, **options):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=options.pop("api_key", "unused"), **options)

    def metric(self, name: str, labels: str = "") -> float:
        """One sample's value from /metrics (0 when absent)."""
        import requests

        text = requests.get(self.url + "/metrics", timeout=10).text
        key = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        return 0.0


class SlowBackend:
    """A real backend whose decode steps take at least ``delay`` seconds: lets tests hold a
    batch row long enough to disconnect, queue or overload deterministically."""

    def __init__(self, backend, delay: float):
        self.backend, self.delay = backend, delay

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def decode(self, cache, input_ids, last_only=False):
        import time

        time.sleep(self.delay)
        return self.backend.decode(cache, input_ids, last_only)


def slow_engine(artifact, delay: float):
    from llmx.runtime.engine import Engine

    engine = Engine.load(artifact, threads=1)
    engine.backend = SlowBackend(engine.backend, delay)
    return engine
