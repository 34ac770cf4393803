"""The server's routes and the checks every request passes, once for every way it is run.

The Flask app (``llmx serve``, gunicorn) and the Ray Serve deployment are adapters: each turns its
framework's request into these calls and the answer back into its framework's response.

    route = find(path, method)              # 404 / 405 (Flask's own router does this for Flask)
    admit(service, path, method, authorization, mimetype, routed=True)   # 401, 415
    check_length(content_length, limit)     # 413 before reading; BodyLimit while reading
    result = route.call(service, body, client_gone)   # dict (JSON), EventStream (SSE) or Page
    count(service, path or None, status)    # the Prometheus request counter
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from llmx.serve.errors import ApiError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PROTECTED = ("/tokenize", "/detokenize")  # besides everything under /v1/


@dataclass(frozen=True)
class Page:
    """A non-JSON answer (Prometheus' text format)."""

    body: bytes | str
    content_type: str


@dataclass(frozen=True)
class Route:
    method: str
    call: Callable[[Any, bytes, Callable[[], bool] | None], Any]  # (service, body, client_gone) -> answer


def _metrics(service, body, client_gone) -> Page:
    return Page(*service.metrics.render())


ROUTES: dict[str, Route] = {
    "/v1/completions": Route("POST", lambda s, body, gone: s.generate(body, chat=False, client_gone=gone)),
    "/v1/chat/completions": Route("POST", lambda s, body, gone: s.generate(body, chat=True, client_gone=gone)),
    "/v1/responses": Route("POST", lambda s, body, gone: s.respond(body, client_gone=gone)),
    "/v1/embeddings": Route("POST", lambda s, body, gone: s.embed(body)),
    "/tokenize": Route("POST", lambda s, body, gone: s.tokenize(body)),
    "/detokenize": Route("POST", lambda s, body, gone: s.detokenize(body)),
    "/v1/models": Route("GET", lambda s, body, gone: s.models()),
    "/health": Route("GET", lambda s, body, gone: s.health()),
    "/ready": Route("GET", lambda s, body, gone: s.ready()),
    "/metrics": Route("GET", _metrics),
}


def find(path: str, method: str) -> Route | None:
    """The route for ``method`` on ``path``, None when there is none (``refuse_unrouted`` says why)."""
    route = ROUTES.get(path)
    return route if route is not None and method in (route.method, "HEAD" if route.method == "GET" else None) else None


def refuse_unrouted(path: str) -> ApiError:
    if path not in ROUTES:
        return ApiError(404, f"no route {path}", code="not_found")
    return ApiError(405, f"use {ROUTES[path].method}", code="method_not_allowed")


def admit(service, path: str, method: str, authorization: str | None, mimetype: str | None, routed: bool) -> None:
    """The checks before any route runs: the API key (also before a 404, which would tell a
    stranger which paths exist), then the body's declared type."""
    if path.startswith("/v1/") or path in PROTECTED:
        service.authorize(authorization)
    if method == "POST" and routed and mimetype != "application/json":
        # Also what stops a web page from making its visitors' browsers spend this server's
        # compute: a cross-site POST without a CORS preflight cannot send application/json.
        raise ApiError(415, f"Content-Type must be application/json, got {mimetype or 'none'!r}",
                       code="unsupported_media_type")


def mimetype(content_type: str | None) -> str:
    """``application/json; charset=utf-8`` -> ``application/json``, as Flask's ``request.mimetype``."""
    return (content_type or "").partition(";")[0].strip().lower()


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")


def check_length(length: int | None, limit: int) -> None:
    if length is not None and length > limit:
        raise too_large(limit)


class BodyLimit:
    """Counts a body's bytes as they arrive: 413 past ``limit``, with a Content-Length or chunked."""

    def __init__(self, limit: int):
        self.limit, self.parts, self.size = limit, [], 0

    def add(self, part: bytes) -> None:
        self.parts.append(part)
        self.size += len(part)
        if self.size > self.limit:
            raise too_large(self.limit)

    def body(self) -> bytes:
        return b"".join(self.parts)


def count(service, path: str | None, status: int) -> None:
    service.metrics.requests.labels(path or "unmatched", str(status)).inc()
