"""The Flask app: OpenAI-compatible routes over one ``Service`` (one engine per process).

    create_app("./art")                     # the gunicorn app factory: llmx.serve:create_app("./art")
    create_app(engine=Engine.load("./art")) # with an engine loaded already (llmx serve, tests)

Routes (serve/routes.py, with the checks before them: the same for the Ray Serve deployment):
POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings (encoder artifacts; the
others answer it with a 400, and vice versa), POST /tokenize and /detokenize (vLLM's shapes,
serve/tokenize.py), GET /v1/models, GET /health (the process answers), GET /ready (model
loaded), GET /metrics (Prometheus). Every error, including the ones Flask raises itself (404,
405, 413 body too large), is OpenAI-shaped JSON.
"""

from __future__ import annotations

import logging
import select
import socket
import time

from llmx.errors import require
from llmx.serve.errors import ApiError, from_status
from llmx.serve.routes import ROUTES, SSE_HEADERS, BodyLimit, Page, Route, admit, check_length, count
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
    def check():
        admit(service, request.path, request.method, request.headers.get("Authorization"), request.mimetype,
              routed=request.url_rule is not None)

    @app.after_request
    def counted(response):
        count(service, request.url_rule.rule if request.url_rule else None, response.status_code)
        return response

    def answer(result):
        if isinstance(result, EventStream):
            return flask.Response(result, mimetype="text/event-stream", headers=SSE_HEADERS)
        if isinstance(result, Page):
            return flask.Response(result.body, content_type=result.content_type)
        return flask.jsonify(result)

    def view(route: Route):
        def run():
            body = b"" if route.method == "GET" else read_body(request.environ, request.content_length,
                                                                service.max_body_bytes, app.config.get("LLMX_BODY_TIMEOUT_S"))
            return answer(route.call(service, body, client_gone(request.environ)))

        return run

    for path, route in ROUTES.items():
        app.add_url_rule(path, endpoint=path, view_func=view(route), methods=[route.method])


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
    check_length(length, limit)
    if length is None and not environ.get("wsgi.input_terminated"):
        return b""  # no length and a server that does not end the stream: nothing is safe to read
    stream, want = environ["wsgi.input"], limit + 1 if length is None else length
    read = getattr(stream, "read1", stream.read)  # one socket read at a time, so the deadline is seen
    deadline = None if timeout is None else time.monotonic() + timeout
    body = BodyLimit(limit)
    while body.size < want:
        part = read(min(want - body.size, 1 << 16))
        if not part:
            break
        body.add(part)
        if deadline is not None and time.monotonic() > deadline:
            raise ApiError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout")
    return body.body()
