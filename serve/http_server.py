"""The built-in HTTP server of ``llmx serve``: werkzeug's threaded server with bounds.

werkzeug starts one thread per connection and waits on a silent socket forever, so 1,000
half-sent requests meant 1,000 threads. Here every socket read or write times out after
``timeout`` seconds (an idle keep-alive connection is closed), a request body must arrive
within ``timeout`` in all (app.py reads it), and at most ``max_connections`` are served at
once: the next one is answered 503 with Retry-After and closed. For many clients, put the
same app under gunicorn behind a proxy that buffers requests (docs/serving.md).
"""

from __future__ import annotations

import json
import socket
import threading

from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 256
_BUSY = json.dumps({"error": {"message": "server has too many open connections; retry later",
                              "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY)


class BoundedWSGIServer(ThreadedWSGIServer):
    def __init__(self, host: str, port: int, app, *, timeout: float = DEFAULT_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, fd: int | None = None):
        handler = type("TimedRequestHandler", (WSGIRequestHandler,), {"timeout": timeout})
        super().__init__(host, port, app, handler=handler, fd=fd)
        self.request_timeout = timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections

    def process_request(self, request: socket.socket, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)
                request.sendall(BUSY_RESPONSE)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: socket.socket, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def make_server(host: str, port: int, app, *, timeout: float = DEFAULT_TIMEOUT_S,
                max_connections: int = DEFAULT_MAX_CONNECTIONS, fd: int | None = None) -> BoundedWSGIServer:
    app.config["LLMX_BODY_TIMEOUT_S"] = timeout
    return BoundedWSGIServer(host, port, app, timeout=timeout, max_connections=max_connections, fd=fd)
