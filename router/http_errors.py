"""Errors of the router's HTTP front in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

A gRPC status the service ended with maps to an HTTP status (INVALID_ARGUMENT 400, RESOURCE_EXHAUSTED 429,
UNAVAILABLE 503, DEADLINE_EXCEEDED 504, ...); an INVALID_ARGUMENT's `param` is the field its message names.
`code` is never null: a refusal that names none gets its status's (`CODE_OF_STATUS`), so that clients can branch
on it as on OpenAI's codes ("invalid_value", "unknown_parameter", "unsupported_parameter", "model_not_found").
"""

from __future__ import annotations

import re
from typing import Any

import grpc

# Seconds a client told to back off (429, 503) should wait before it retries.
RETRY_AFTER_S = 1

_HTTP_OF_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
    grpc.StatusCode.CANCELLED: (499, "server_error"),
}
# The code of an error raised without one, by HTTP status.
CODE_OF_STATUS = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                  408: "request_timeout", 413: "request_too_large", 429: "rate_limit_exceeded", 499: "cancelled",
                  500: "internal_error", 503: "unavailable", 504: "deadline_exceeded"}
# The service's messages start with the field: "sampling field 'top_p': ...", "sampling.max_tokens: ...",
# "prompt.text: ...", "prompt token ids: ..." (OpenAI's names: top_p, max_tokens, prompt).
_SAMPLING_FIELD = re.compile(r"sampling field '(\w+)'")
_LEADING_FIELD = re.compile(r"([a-z_][\w.]*)[: ]")


class ApiError(Exception):
    """Answered as `{"error": {...}}` with `status` (and `retry-after` on 429 and 503)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code or CODE_OF_STATUS.get(status, "error")

    @classmethod
    def of_grpc(cls, code: grpc.StatusCode, message: str) -> ApiError:
        status, type_ = _HTTP_OF_GRPC.get(code, (500, "server_error"))
        param = None
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            m = _SAMPLING_FIELD.match(message) or _LEADING_FIELD.match(message)
            param = m.group(1).removeprefix("sampling.").split(".")[0] if m else None
        # INVALID_ARGUMENT is the HTTP front's own refusals' "invalid_value"; other codes keep their gRPC name.
        name = "invalid_value" if code == grpc.StatusCode.INVALID_ARGUMENT else code.name.lower()
        return cls(status, message, type_, param=param, code=name)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(RETRY_AFTER_S).encode())] if self.status in (429, 503) else []


def bad(param: str, expected: str, got: Any) -> ApiError:
    """400 naming `param`; `got` is shown as its repr, cut short (a client's value may be megabytes)."""
    shown = repr(got)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return ApiError(400, f"{param}: expected {expected}, got {shown}", param=param)


def unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{param}: {what} is not supported by this server", param=param,
                    code="unsupported_parameter")


def busy(what: str) -> ApiError:
    return ApiError(429, f"{what}: the router is at its limit; retry later", "rate_limit_error",
                    code="rate_limit_exceeded")


def shutting_down() -> ApiError:
    return ApiError(503, "the router is shutting down", "server_error", code="unavailable")
