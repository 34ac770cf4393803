"""``POST /v1/embeddings`` for encoder artifacts, in OpenAI's schema, with batching across requests.

One worker thread owns the Embedder. Requests queue their inputs; each turn the worker takes
every input waiting (up to ``max_batch_inputs``) and runs them as one batch, so concurrent
requests share forward passes with no artificial delay. A full queue answers 429 with
Retry-After, like the completion endpoints.

``encoding_format: "base64"`` returns little-endian float32 bytes, what the official client
asks for by default and decodes.
"""

from __future__ import annotations

import base64
import queue
import threading
from dataclasses import dataclass, field

import numpy as np

from llmx.artifact.handle import Artifact
from llmx.runtime.embed import Embedder
from llmx.runtime.params import ParamError, text
from llmx.serve.base_service import RETRY_AFTER_S, BaseService
from llmx.serve.errors import ApiError, bad_request
from llmx.serve.metrics import Metrics
from llmx.serve.protocol import check_fields, from_param, invalid_field, parse_body, string

MAX_INPUTS = 2048  # OpenAI's limit per request


def _encoding_format(value, name):
    if value not in ("float", "base64"):
        raise invalid_field(name, '"float" or "base64"', value)
    return value


def _positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid_field(name, "an integer >= 1", value)
    return value


FIELDS = {
    "model": (string, None),
    "input": (lambda v, n: v, None),  # checked by embedding_inputs: it needs the tokenizer
    "encoding_format": (_encoding_format, "float"),
    "dimensions": (_positive_int, None),
    "user": (string, None),
}


def embedding_inputs(value, tokenizer, vocab_size: int) -> list[list[int]]:
    """OpenAI's input forms: a string, strings, token ids, lists of token ids (none empty)."""
    def is_token(t):
        return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size

    if isinstance(value, str) and value:
        return [tokenizer.encode(text(value, "input"))]
    if isinstance(value, list) and 0 < len(value) <= MAX_INPUTS:
        if all(isinstance(s, str) and s for s in value):
            return [tokenizer.encode(text(s, "input")) for s in value]
        if all(is_token(t) for t in value):
            return [list(value)]
        if all(isinstance(p, list) and p and all(is_token(t) for t in p) for p in value):
            return [list(p) for p in value]
    rule = (f"a non-empty string, a list of non-empty strings, or token ids in [0, {vocab_size}) "
            f"(a list, or a list of lists), at most {MAX_INPUTS} inputs")
    raise invalid_field("input", rule, value)


@dataclass
class _Request:
    ids: list[list[int]]
    done: threading.Event = field(default_factory=threading.Event)
    vectors: np.ndarray | None = None
    token_counts: list[int] | None = None
    error: str | None = None


class EmbeddingBatcher:
    """The worker thread: loads the Embedder, then embeds every waiting request's inputs together."""

    def __init__(self, load, max_batch_inputs: int, max_queue: int, metrics: Metrics):
        self.load, self.max_batch_inputs, self.metrics = load, max_batch_inputs, metrics
        self.queue: queue.Queue[_Request] = queue.Queue(maxsize=max(max_queue, 1))
        self.embedder = None
        self.load_error: str | None = None
        self.load_exception: BaseException | None = None
        self.ready = threading.Event()  # the embedder is loaded and the loop runs
        self.settled = threading.Event()  # loading is over, one way or the other
        self.thread = threading.Thread(target=self._run, name="llmx-embeddings", daemon=True)

    def start(self) -> "EmbeddingBatcher":
        self.thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, ids: list[list[int]]) -> _Request:
        request = _Request(ids)
        try:
            self.queue.put_nowait(request)
        except queue.Full:
            raise ApiError(429, "server is busy (embedding queue full); retry later", code="queue_full",
                           retry_after=RETRY_AFTER_S) from None
        self.metrics.queue_depth.set(self.queue.qsize())
        return request

    def _run(self) -> None:
        try:
            self.embedder = self.load()
        except Exception as exc:  # reported by /ready and every request
            self.load_error, self.load_exception = str(exc) or type(exc).__name__, exc
            return
        finally:
            self.settled.set()
        self.ready.set()
        while True:
            batch = [self.queue.get()]
            while sum(len(r.ids) for r in batch) < self.max_batch_inputs:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            self.metrics.queue_depth.set(self.queue.qsize())
            self._embed(batch)

    def _embed(self, batch: list[_Request]) -> None:
        ids = [t for r in batch for t in r.ids]
        self.metrics.embedding_batch_size.observe(len(ids))
        try:
            result = self.embedder.embed_ids(ids)
        except Exception as exc:
            for r in batch:
                r.error = f"embedding failed: {exc}"
                r.done.set()
            return
        start = 0
        for r in batch:
            r.vectors = result.vectors[start : start + len(r.ids)]
            r.token_counts = result.token_counts[start : start + len(r.ids)]
            start += len(r.ids)
            self.metrics.prompt_tokens.inc(sum(r.token_counts))
            r.done.set()


class EmbeddingService(BaseService):
    kind = "encoder"
    endpoints = ("/v1/embeddings",)

    def __init__(self, batcher: EmbeddingBatcher, model_name: str, api_key: str | None, max_body_bytes: int):
        super().__init__(batcher, model_name, api_key, max_body_bytes=max_body_bytes)
        self.batcher = batcher

    def embedder(self):
        self.check_loaded()
        return self.batcher.embedder

    def ready(self) -> dict:
        self.embedder()
        return {"status": "ready", "model": self.model_name, "waiting": self.batcher.queue.qsize()}

    def max_model_len(self) -> int | None:
        return self.batcher.embedder.max_tokens if self.batcher.embedder is not None else None

    def embed(self, raw: bytes) -> dict:
        self.check_size(raw)
        embedder = self.embedder()
        f = check_fields(parse_body(raw), FIELDS)
        if f["model"] is not None and f["model"] != self.model_name:
            raise ApiError(404, f"The model '{f['model']}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        if f["input"] is None:
            raise bad_request("'input' is required", param="input")
        if f["dimensions"] not in (None, embedder.dim):
            raise bad_request(f"this model's embeddings have {embedder.dim} dimensions; 'dimensions' cannot change that",
                              param="dimensions", code="unsupported_parameter")
        try:
            ids = embedding_inputs(f["input"], embedder.tokenizer, embedder.manifest.model.vocab_size)
        except ParamError as exc:
            raise from_param(exc) from None
        request = self.batcher.submit(ids)
        request.done.wait()
        if request.error:
            raise ApiError(500, request.error, code="embedding_failed")
        encode = _base64 if f["encoding_format"] == "base64" else (lambda v: v.tolist())
        tokens = int(sum(request.token_counts))
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(request.vectors)],
            "model": self.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def _base64(vector: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode("ascii")


def build_embedding_service(artifact: Artifact, model_name: str, api_key: str | None, *, max_batch: int,
                            max_queue: int, max_body_bytes: int, threads: int | None) -> EmbeddingService:
    # --max-batch counts sequences for decoders; an encoder batch of short inputs can hold more.
    batcher = EmbeddingBatcher(lambda: Embedder(artifact, threads=threads), max_batch_inputs=max(32, 8 * max_batch),
                               max_queue=max_queue, metrics=Metrics()).start()
    return EmbeddingService(batcher, model_name, api_key, max_body_bytes)
