"""OpenAI-shaped errors: every 4xx/5xx the server sends is ``{"error": {message, type, param, code}}``.

The official client reads ``error.message`` into its exception, and retries 429/5xx honouring
``Retry-After``; so overload answers carry that header.
"""

from __future__ import annotations

from http import HTTPStatus

from llmx.errors import InputError, LlmxError

# OpenAI's error ``type`` for each status family it uses.
TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # what OpenAI answers for a wrong key (code invalid_api_key)
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """An HTTP error answer: raise it anywhere in request handling."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def from_llmx(exc: LlmxError, param: str | None = None) -> ApiError:
    """A runtime error raised on the user's input becomes a 400; anything else is ours (500)."""
    if isinstance(exc, InputError):
        return ApiError(400, str(exc), param)
    return ApiError(500, str(exc), code="internal_error")


def from_status(status: int, description: str | None = None) -> ApiError:
    """For errors the web framework raises itself (404, 405, 413, ...)."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "error"
    return ApiError(status, description or phrase, code=phrase.lower().replace(" ", "_"))
