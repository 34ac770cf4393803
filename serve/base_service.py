"""What every served model shares, whatever its kind: the API key, the body limit, the fork
check, health, the model card and the 400 for another kind's endpoint. ``Service``
(serve/service.py) serves decoders, ``EmbeddingService`` (serve/embeddings.py) encoders.
"""

from __future__ import annotations

import hmac
import os
import time
from typing import Callable

from llmx.serve.errors import ApiError

RETRY_AFTER_S = 1
API_KEY_ENV = "LLMX_API_KEY"
DEFAULT_MAX_BODY_BYTES = 1 << 20


class BaseService:
    """What every served artifact shares: API key, body limit, fork check, health, metrics.

    A decoder artifact is served by ``Service`` (completions), an encoder by
    ``EmbeddingService`` (serve/embeddings.py); each answers the other's endpoints with a 400
    that says which endpoints this model has.
    """

    kind = "decoder"
    endpoints = ("/v1/completions", "/v1/chat/completions", "/v1/responses")

    def __init__(self, worker, model_name: str, api_key: str | None = None, keepalive_s: float = 10.0,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        # The worker thread owns the model: a Scheduler (decoders) or an EmbeddingBatcher
        # (encoders). Both load it in their own thread and expose ready/settled/alive/load_error.
        self.worker, self.metrics, self.model_name, self.api_key = worker, worker.metrics, model_name, api_key
        self.keepalive_s, self.max_body_bytes = keepalive_s, max_body_bytes
        self.pid = os.getpid()
        self.created = int(time.time())

    def authorize(self, header: str | None) -> None:
        if not self.api_key:
            return
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    def check_size(self, raw: bytes) -> None:
        if len(raw) > self.max_body_bytes:
            raise ApiError(413, f"request body is larger than {self.max_body_bytes} bytes", code="request_too_large")

    def check_process(self) -> None:
        if os.getpid() != self.pid:
            raise ApiError(500, "the engine was created before this process forked (gunicorn --preload?); "
                                "load it in each worker: run without --preload", code="engine_forked")

    def health(self) -> dict:
        return {"status": "ok"}

    def drain(self, timeout: float) -> bool:
        """Graceful shutdown. Embedding requests are short and run to the end as they are; the
        generation Service overrides this to end queued and overlong work cleanly."""
        return True

    def wait_loaded(self) -> None:
        """Block until the model has loaded; re-raise its load error (the CLI prints one line)."""
        self.worker.settled.wait()
        if self.worker.load_exception is not None:
            raise self.worker.load_exception

    def check_loaded(self) -> None:
        """A 503 until the worker has loaded the model, or with the reason it could not."""
        self.check_process()
        if self.worker.load_error:
            raise ApiError(503, f"model failed to load: {self.worker.load_error}", code="model_not_loaded")
        if not self.worker.ready.is_set() or not self.worker.alive:
            raise ApiError(503, "model is loading", code="model_not_ready", retry_after=RETRY_AFTER_S)

    def max_model_len(self) -> int | None:
        """The longest input the loaded model takes (None while loading)."""
        return None

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "llmx"}
        if self.worker.ready.is_set() and (limit := self.max_model_len()) is not None:
            card["max_model_len"] = limit
        return {"object": "list", "data": [card]}

    def wrong_kind(self, endpoint: str) -> ApiError:
        return ApiError(400, f"model '{self.model_name}' ({self.kind}) does not serve {endpoint}; "
                             f"it serves {', '.join(self.endpoints)}", code="unsupported_endpoint")

    def generate(self, raw: bytes, chat: bool, client_gone: Callable[[], bool] | None = None):
        raise self.wrong_kind("/v1/chat/completions" if chat else "/v1/completions")

    def respond(self, raw: bytes, client_gone: Callable[[], bool] | None = None):
        raise self.wrong_kind("/v1/responses")

    def embed(self, raw: bytes):
        raise self.wrong_kind("/v1/embeddings")

    def tokenize(self, raw: bytes):
        raise self.wrong_kind("/tokenize")

    def detokenize(self, raw: bytes):
        raise self.wrong_kind("/detokenize")
