"""The server's request handling, free of any web framework: Flask (app.py) and the Ray Serve
deployment (ray_deployment.py) are thin adapters around one ``Service``.

A generation request is checked (protocol.py), turned into Sequences, submitted to the
scheduler (429 with Retry-After when full) and answered either whole or as a stream of
Server-Sent Events. A stream that is closed early (the client went away) cancels its
sequences, which frees their batch rows at the scheduler's next turn.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from llmx.artifact.handle import Artifact
from llmx.errors import InputError
from llmx.runtime.drafters import EXPLICIT, check_speculative, make_drafter
from llmx.runtime.engine import Engine, engine_options
from llmx.runtime.sequence import Sequence
from llmx.serve.base_service import API_KEY_ENV, DEFAULT_MAX_BODY_BYTES, RETRY_AFTER_S, BaseService
from llmx.serve.embeddings import build_embedding_service
from llmx.serve.errors import ApiError
from llmx.serve.metrics import Metrics
from llmx.serve.prefix_cache import default_bytes as default_prefix_bytes
from llmx.serve.protocol import Job, parse_job
from llmx.serve import responses_api
from llmx.runtime.reasoning import CHOICES as REASONING_CHOICES
from llmx.serve.tool_calls import FORMATS, ToolFormat
from llmx.serve.responses import ChoiceResult, Responder, sse
from llmx.serve.scheduler import Failure, QueueFull, Scheduler, Ticket
from llmx.serve.tokenize import detokenize, tokenize

CLIENT_CHECK_S = 0.25  # how often a whole answer's wait looks whether its client is still there


def build_service(artifact: str | Path | Artifact | None = None, *, engine=None, model_name: str | None = None,
                  max_batch: int = 8, max_queue: int = 64, prefill_chunk: int = 256, api_key: str | None = None,
                  max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, keepalive_s: float = 10.0, backend: str = "ort-cpu",
                  threads: int | None = None, spin: bool | None = None, low_memory: bool = False,
                  prefix_cache_mb: int | None = None, speculative: str = "auto",
                  draft: str | None = None, num_draft_tokens: int | None = None, tool_call_format: str | None = None,
                  reasoning_format: str = "auto", stream_interval_ms: float = 10.0) -> "Service":
    """A Service with its scheduler thread started; the thread loads the engine unless one is given.

    ``api_key`` defaults to the LLMX_API_KEY environment variable; without either, no key is asked.
    ``spin`` lets ONNX Runtime's threads spin while a graph runs; None decides from the cores free
    at start-up (runtime/cpu_plan.py): on a quiet host spinning, stopped after every run, is
    1.13-1.24x the server's aggregate decode; on a busy one the plan takes one thread that
    never spins (docs/serving.md). ``low_memory`` (ort-cpu, unquantized artifacts) serves from
    one memory-mapped copy of the weights, shared with other processes serving the same artifact
    (docs/performance.md). ``prefix_cache_mb`` bounds the prefix cache (0: off; None: the KV of ``max_batch``
    full-context sequences, at most 256 MiB, serve/prefix_cache.py);
    ``speculative``: "auto" drafts by prompt lookup where it pays (a lone running request with
    text to copy), "ngram" always, "draft" with ``draft`` (an artifact), "off" never;
    ``num_draft_tokens`` per step (auto's cap; docs/decoding.md). ``tool_call_format`` names how the model writes
    tool calls (serve/tool_calls.py FORMATS) where its chat template does not tell.
    ``reasoning_format`` "auto" returns a thinking template's reasoning as ``reasoning_content``
    (runtime/reasoning.py); "none" leaves it in ``content``. ``stream_interval_ms``: a stream's
    new text goes out at most this often (first token and end at once; 0: every token).
    """
    if (artifact is None) == (engine is None):
        raise InputError("the server needs an artifact directory or a loaded engine (one of them)")
    for name, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0), ("prefill_chunk", prefill_chunk, 1),
                             ("max_body_bytes", max_body_bytes, 1), ("prefix_cache_mb", 0 if prefix_cache_mb is None else prefix_cache_mb, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
    if tool_call_format is not None and tool_call_format not in FORMATS:
        raise InputError(f"unknown tool-call format {tool_call_format!r}: one of {', '.join(FORMATS)}")
    if isinstance(stream_interval_ms, bool) or not isinstance(stream_interval_ms, (int, float)) or not stream_interval_ms >= 0:
        raise InputError(f"stream_interval_ms must be a number >= 0, got {stream_interval_ms!r}")
    if reasoning_format not in REASONING_CHOICES:
        raise InputError(f"unknown reasoning format {reasoning_format!r}: one of {', '.join(REASONING_CHOICES)}")
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    # A wrong path fails here, loudly, not later in the scheduler thread.
    artifact = engine.artifact if engine is not None else Artifact.of(artifact)
    name = model_name or artifact.root.resolve().name
    check_speculative(speculative, draft, num_draft_tokens)
    if engine is None:
        if artifact.manifest.kind == "encoder":
            if speculative in EXPLICIT:
                raise InputError("speculative decoding applies to text generation; this artifact is an encoder")
            return build_embedding_service(artifact, name, key, max_batch=max_batch, max_queue=max_queue,
                                           max_body_bytes=max_body_bytes, threads=threads)
        options = engine_options(backend, threads, low_memory, spin)
        load = lambda: Engine.load(artifact, backend=backend, **options)  # noqa: E731
    else:
        load = lambda: engine  # noqa: E731
    load_drafter = None
    if speculative != "off":
        load_drafter = lambda target: make_drafter(speculative, target, num_draft_tokens, draft,  # noqa: E731
                                                   backend=backend, threads=threads)
    if prefix_cache_mb is None:
        prefix_bytes = default_prefix_bytes(artifact.manifest, max_batch)
    else:
        prefix_bytes = prefix_cache_mb << 20
    scheduler = Scheduler(load, max_batch, max_queue, prefill_chunk, Metrics(), prefix_bytes, load_drafter,
                          stream_interval_ms / 1000).start()
    service = Service(scheduler, name, key, keepalive_s, max_body_bytes)
    service.tool_format = FORMATS.get(tool_call_format)
    service.reasoning_format = reasoning_format
    return service


class Service(BaseService):
    def __init__(self, scheduler: Scheduler, model_name: str, api_key: str | None = None, keepalive_s: float = 10.0,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        super().__init__(scheduler, model_name, api_key, keepalive_s, max_body_bytes)
        self.scheduler = scheduler
        self.draining = threading.Event()  # set on SIGTERM: admit nothing new
        self.tool_format: ToolFormat | None = None  # None: read from the model's chat template
        self.reasoning_format = "auto"
        self._inflight = 0  # generation answers not yet fully sent (guarded by _lock)
        self._lock = threading.Lock()

    # -- shutdown ------------------------------------------------------------------------------

    def drain(self, timeout: float) -> bool:
        """Graceful shutdown: refuse new requests (503, /ready false), end queued ones with a clean
        error, let running ones finish for up to ``timeout`` s, end the rest, and wait until every
        answer has been sent. True when nothing had to be cut."""
        self.draining.set()
        self.scheduler.shed("the server is shutting down; retry on another instance")
        deadline = time.monotonic() + timeout
        while self.scheduler.counts() != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        clean = self.scheduler.counts() == (0, 0)
        if not clean:
            self.scheduler.shed(f"the server is shutting down (drain timeout {timeout:g} s)", running=True)
        last_words = time.monotonic() + max(self.keepalive_s, 2.0)  # handlers write their final events
        while self.inflight and time.monotonic() < last_words:
            time.sleep(0.05)
        return clean

    @property
    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def _opened(self, delta: int) -> None:
        with self._lock:
            self._inflight += delta

    # -- checks --------------------------------------------------------------------------------

    def engine(self):
        self.check_loaded()
        return self.scheduler.engine

    def check_admitting(self) -> None:
        if self.draining.is_set():
            raise ApiError(503, "the server is shutting down; retry on another instance", code="server_shutting_down",
                           retry_after=RETRY_AFTER_S)

    # -- endpoints -----------------------------------------------------------------------------

    def ready(self) -> dict:
        """/ready: 200 once the model is loaded and the scheduler runs, else a 503 ApiError."""
        self.engine()
        self.check_admitting()
        running, waiting = self.scheduler.counts()
        return {"status": "ready", "model": self.model_name, "running": running, "waiting": waiting}

    def max_model_len(self) -> int | None:
        return self.scheduler.engine.max_seq_len if self.scheduler.engine is not None else None

    def generate(self, raw: bytes, chat: bool, client_gone: Callable[[], bool] | None = None) -> dict | "EventStream":
        """A completion: the whole answer as a dict, or an EventStream of SSE text. ``client_gone``
        tells a whole answer's wait that nobody will read it (a stream learns that on its own)."""
        self.check_size(raw)
        self.check_admitting()
        engine = self.engine()
        job = parse_job(raw, chat, engine, self.model_name, self.tool_format, self.reasoning_format)
        seqs = [Sequence(job.prompts[i // job.n], p, engine.tokenizer, engine.max_seq_len) for i, p in enumerate(job.params)]
        if len(seqs) > self.scheduler.capacity:
            raise ApiError(400, f"request asks for {len(seqs)} sequences; this server holds at most "
                                f"{self.scheduler.capacity} (--max-batch + --max-queue)", param="n")
        if job.beam and sum(p.num_beams for p in job.beam) > self.scheduler.max_batch:
            raise ApiError(400, f"beam search over {len(job.beam)} prompt(s) x {job.beam[0].num_beams} beams needs more rows "
                                f"than this server's --max-batch {self.scheduler.max_batch}", param="best_of" if not job.chat else "n")
        try:
            ticket = self.scheduler.submit(seqs, job.beam)
        except QueueFull as exc:
            raise ApiError(429, f"server is busy ({exc}); retry later", code="queue_full",
                           retry_after=RETRY_AFTER_S) from None
        responder = Responder(job, self.model_name)
        self._opened(+1)
        if job.stream:
            return EventStream(self, ticket, job, responder)
        try:
            return responder.response(self._collect(ticket, len(seqs), client_gone))
        finally:
            self._opened(-1)

    def respond(self, raw: bytes, client_gone: Callable[[], bool] | None = None) -> dict | "EventStream":
        """/v1/responses: the request run as a chat completion (serve/responses_api.py)."""
        self.check_size(raw)
        chat_raw, echo = responses_api.chat_request(raw)
        try:
            result = self.generate(chat_raw, chat=True, client_gone=client_gone)
        except ApiError as exc:
            raise responses_api.renamed(exc) from None
        if isinstance(result, EventStream):
            result.encode = responses_api.ResponseEvents(self.model_name, echo)
            return result
        return responses_api.response_object(result, echo)

    def tokenize(self, raw: bytes) -> dict:
        self.check_size(raw)
        return tokenize(raw, self.engine())

    def detokenize(self, raw: bytes) -> dict:
        self.check_size(raw)
        return detokenize(raw, self.engine())

    def _collect(self, ticket: Ticket, k: int, client_gone: Callable[[], bool] | None) -> list[ChoiceResult]:
        results = [ChoiceResult() for _ in range(k)]
        pending, checked = k, time.monotonic()
        while pending:
            if client_gone is not None and time.monotonic() - checked > CLIENT_CHECK_S:
                checked = time.monotonic()
                if client_gone():
                    self.scheduler.cancel(ticket)
                    raise ApiError(499, "the client closed the connection", code="client_closed_request")
            try:
                u = ticket.updates.get(timeout=CLIENT_CHECK_S)
            except queue.Empty:
                if not self.scheduler.alive:
                    raise ApiError(503, "the engine stopped", code="engine_stopped") from None
                continue
            if isinstance(u, Failure):
                code = "server_shutting_down" if u.status == 503 else "generation_failed"
                raise ApiError(u.status, u.message, code=code, retry_after=RETRY_AFTER_S if u.status == 503 else None)
            results[u.index].add(u)
            pending -= u.finish_reason is not None
        return results


class EventStream:
    """The SSE body of a streamed completion; closing it early cancels the request's sequences.

    A class rather than a bare generator because servers call ``close()`` on the body when the
    client disconnects, and a generator that has not started yet would ignore that.
    """

    def __init__(self, service: Service, ticket: Ticket, job: Job, responder: Responder):
        self.service, self.ticket, self.job, self.responder = service, ticket, job, responder
        self.encode = lambda chunk: [sse(chunk)]  # each chunk dict (or "[DONE]") as SSE text; /v1/responses swaps it
        self.complete = False
        self._closed = False
        self._events = self._generate()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._events)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.service._opened(-1)
        if not self.complete:
            self.service.scheduler.cancel(self.ticket)
        try:
            self._events.close()
        except ValueError:
            pass  # still running in another thread (the async adapter); it ends on its own

    def _generate(self) -> Iterator[str]:
        r, k = self.responder, len(self.job.params)
        tokens, cached, pending = [0] * k, [0] * k, k
        if self.job.chat:
            yield from self.encode(r.role_chunk())
        while pending:
            try:
                u = self.ticket.updates.get(timeout=self.service.keepalive_s)
            except queue.Empty:
                if not self.service.scheduler.alive:
                    u = Failure("the engine stopped")
                else:
                    yield ": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see traffic
                    continue
            if isinstance(u, Failure):
                self.complete = True
                code = "server_shutting_down" if u.status == 503 else "generation_failed"
                yield from self.encode({"error": {"message": u.message, "type": "server_error", "param": None, "code": code}})
                yield from self.encode("[DONE]")  # the stream ends cleanly: clients tell this from a dropped connection
                return
            tokens[u.index], cached[u.index] = u.tokens, u.cached_tokens
            for chunk in r.delta_chunks(u):
                yield from self.encode(chunk)
            if u.finish_reason is not None:
                pending -= 1
                for chunk in r.finish_chunks(u.index, u.finish_reason):
                    yield from self.encode(chunk)
        self.complete = True
        if self.job.include_usage:
            yield from self.encode(r.usage_chunk(sum(tokens), r.prompt_cached(cached)))
        yield from self.encode("[DONE]")
