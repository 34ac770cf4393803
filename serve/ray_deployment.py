"""Ray Serve: the same server as a Ray Serve deployment, to scale out over replicas and nodes.

    serve run llmx.serve.ray_deployment:build_app artifact=/abs/path/art num_replicas=2 threads=2

Each replica is a Ray actor holding one ``Service`` (one engine, its own continuous batching),
created inside the actor's process, so nothing native crosses a fork. Ray's HTTP proxy spreads
requests over the replicas, on one machine or a cluster; the routes, request checks (API key,
content type, body size), errors and streams are the Flask app's: both adapt serve/routes.py
over the same Service. Ray is imported only by
``build_app``: the llmx package does not depend on it (``pip install 'llmx[ray]'``).
"""

from __future__ import annotations

import asyncio

from llmx.errors import require
from llmx.serve.errors import ApiError
from llmx.serve.routes import SSE_HEADERS, BodyLimit, Page, admit, check_length, count, find, mimetype, refuse_unrouted
from llmx.serve.service import EventStream, build_service

INT_OPTIONS = ("max_batch", "max_queue", "prefill_chunk", "threads", "max_body_bytes")


class LlmxReplica:
    """One replica: a Service behind an async ``__call__`` that Ray Serve's proxy invokes."""

    def __init__(self, artifact: str, **options):
        self.service = build_service(artifact, **options)
        self.service.worker.ready.wait()  # take traffic only once the engine is loaded
        if self.service.worker.load_error:
            raise RuntimeError(f"llmx engine failed to load: {self.service.worker.load_error}")

    def check_health(self) -> None:
        """Ray Serve calls this; raising makes it replace the replica."""
        if not self.service.worker.alive:
            raise RuntimeError("llmx scheduler thread stopped")

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        try:
            response = await self._route(request)
        except ApiError as err:
            response = JSONResponse(err.body(), err.status, headers=err.headers())
        path = request.url.path
        count(self.service, path if find(path, request.method) else None, response.status_code)
        return response

    async def _route(self, request):
        from starlette.responses import JSONResponse, Response, StreamingResponse

        service, method, path, headers = self.service, request.method, request.url.path, request.headers
        route = find(path, method)
        admit(service, path, method, headers.get("authorization"), mimetype(headers.get("content-type")),
              routed=route is not None)
        if route is None:
            raise refuse_unrouted(path)
        body = b"" if route.method == "GET" else await _read_body(request, service.max_body_bytes)
        result = await asyncio.to_thread(route.call, service, body, None)
        if isinstance(result, EventStream):
            return StreamingResponse(_relay(result), media_type="text/event-stream", headers=SSE_HEADERS)
        if isinstance(result, Page):
            return Response(result.body, media_type=result.content_type)
        return JSONResponse(result)


async def _read_body(request, limit: int) -> bytes:
    """The body as it arrives, refused once past ``limit`` (a chunked body has no length to check)."""
    length = request.headers.get("content-length")
    check_length(int(length) if length and length.isdigit() else None, limit)
    body = BodyLimit(limit)
    async for part in request.stream():
        body.add(part)
    return body.body()


async def _relay(stream: EventStream):
    """The blocking EventStream, read in a worker thread; a disconnect (cancellation) closes it."""
    try:
        while (item := await asyncio.to_thread(next, stream, None)) is not None:
            yield item
    finally:
        stream.close()


def build_app(args: dict):
    """Ray Serve application builder; ``args`` as ``serve run`` passes them (strings are fine):
    artifact (required), num_replicas, num_cpus (per replica, default: threads or 1), and any
    build_service option (max_batch, max_queue, prefill_chunk, threads, api_key, model_name...)."""
    serve = require("ray.serve", "the Ray Serve deployment", "ray")
    options = dict(args)
    artifact = options.pop("artifact")
    replicas = int(options.pop("num_replicas", 1))
    for name in INT_OPTIONS:
        if name in options:
            options[name] = int(options[name])
    if "keepalive_s" in options:
        options["keepalive_s"] = float(options["keepalive_s"])
    cpus = float(options.pop("num_cpus", options.get("threads") or 1))
    concurrency = options.get("max_batch", 8) + options.get("max_queue", 64) + 8  # queueing is llmx's job, not Ray's
    deployment = serve.deployment(LlmxReplica, name="llmx", num_replicas=replicas, ray_actor_options={"num_cpus": cpus},
                                  max_ongoing_requests=concurrency)
    return deployment.bind(str(artifact), **options)
