"""The Flask app: OpenAI-compatible routes over one ``Service`` (one engine per process).

    create_app("./art")                     # the gunicorn app factory: llmx.serve:create_app("./art")
    create_app(engine=Engine.load("./art")) # with an engine loaded already (llmx serve, tests)

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings (encoder
artifacts; the others answer it with a 400, and vice versa), POST /tokenize and /detokenize
(vLLM's shapes, serve/tokenize.py), GET /v1/models, GET /health (the
process answers), GET /ready (model loaded), GET /metrics (Prometheus). Every error, including
the ones Flask raises itself (404, 405, 413 body too large), is OpenAI-shaped JSON.
"""

from __future__ import annotations

import logging
import select
import socket
import time

from llmx.errors import require
from llmx.serve.errors import ApiError, from_status
from llmx.serve.service import EventStream, Service, build_service

log = logging.getLogger("llmx.serve")


def create_app(artifact=None, **options):
    """The Flask app over a new Service; ``options`` are build_service's (max_batch, max_queue,
    prefill_chunk, api_key, max_body_bytes, keepalive_s, backend, threads, engine, model_name)."""
    flask = require("flask", "llmx serve", "serve")
    service = build_service(artifact, **options)
    app = flask.Flask("llmx.serve")
    app.config["MAX_CONTENT_LENGTH"] = service.max_body_bytes  # refused before the body is read
    app.extensions["llmx"] = service
    _routes(app, flask, service)
    return app


def _routes(app, flask, service: Service) -> None:
    from werkzeug.exceptions import HTTPException

    request = flask.request

    def error_response(err: ApiError):
        return flask.jsonify(err.body()), err.status, err.headers()

    app.register_error_handler(ApiError, error_response)
    app.register_error_handler(HTTPException, lambda e: error_response(from_status(e.code or 500, e.description)))

    @app.errorhandler(Exception)
    def internal(exc):
        log.exception("unhandled error")
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error"))

    @app.before_request
    def authorize():
        if request.path.startswith("/v1/") or request.path in ("/tokenize", "/detokenize"):
            service.authorize(request.headers.get("Authorization"))
        if request.method == "POST" and request.url_rule is not None and request.mimetype != "application/json":
            # Also what stops a web page from making its visitors' browsers spend this server's
            # compute: a cross-site POST without a CORS preflight cannot send application/json.
            raise ApiError(415, f"Content-Type must be application/json, got {request.mimetype or 'none'!r}",
                           code="unsupported_media_type")

    def body() -> bytes:
        return read_body(request.environ, request.content_length, service.max_body_bytes,
                         app.config.get("LLMX_BODY_TIMEOUT_S"))

    @app.after_request
    def count(response):
        endpoint = request.url_rule.rule if request.url_rule else "unmatched"
        service.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    def answer(result):
        if isinstance(result, EventStream):
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return flask.Response(result, mimetype="text/event-stream", headers=headers)
        return flask.jsonify(result)

    @app.post("/v1/completions")
    def completions():
        return answer(service.generate(body(), chat=False, client_gone=client_gone(request.environ)))

    @app.post("/v1/chat/completions")
    def chat_completions():
        return answer(service.generate(body(), chat=True, client_gone=client_gone(request.environ)))

    @app.post("/v1/embeddings")
    def embeddings():
        return flask.jsonify(service.embed(body()))

    @app.post("/tokenize")
    def tokenize():
        return flask.jsonify(service.tokenize(body()))

    @app.post("/detokenize")
    def detokenize():
        return flask.jsonify(service.detokenize(body()))

    @app.get("/v1/models")
    def models():
        return flask.jsonify(service.models())

    @app.get("/health")
    def health():
        return flask.jsonify(service.health())

    @app.get("/ready")
    def ready():
        return flask.jsonify(service.ready())

    @app.get("/metrics")
    def prometheus():
        body, content_type = service.metrics.render()
        return flask.Response(body, content_type=content_type)


def client_gone(environ: dict):
    """A check that the client has closed its connection, from the socket the WSGI server
    exposes (werkzeug's and gunicorn's do); None where there is none to look at."""
    sock = environ.get("werkzeug.socket") or environ.get("gunicorn.socket")
    if sock is None:
        return None

    def gone() -> bool:
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""  # readable with no data: EOF
        except (ConnectionError, OSError):
            return True
        except ValueError:  # a TLS socket refuses MSG_PEEK: cannot tell, assume present
            return False

    return gone


def read_body(environ: dict, length: int | None, limit: int, timeout: float | None) -> bytes:
    """The request body, 413 past ``limit`` bytes whether it has a Content-Length or is chunked,
    408 when it takes longer than ``timeout`` seconds in all (a slow-loris client)."""
    if length is not None and length > limit:
        raise too_large(limit)
    if length is None and not environ.get("wsgi.input_terminated"):
        return b""  # no length and a server that does not end the stream: nothing is safe to read
    stream, want = environ["wsgi.input"], limit + 1 if length is None else length
    read = getattr(stream, "read1", stream.read)  # one socket read at a time, so the deadline is seen
    deadline = None if timeout is None else time.monotonic() + timeout
    parts, got = [], 0
    while got < want:
        part = read(min(want - got, 1 << 16))
        if not part:
            break
        parts.append(part)
        got += len(part)
        if deadline is not None and time.monotonic() > deadline:
            raise ApiError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout")
    if got > limit:
        raise too_large(limit)
    return b"".join(parts)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")
