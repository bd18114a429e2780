"""Errors of the client: every failed call raises a `BatonError` carrying the gRPC status code's name."""

from __future__ import annotations

import grpc


class BatonError(Exception):
    """A call failed. `code` is the gRPC status code's name, e.g. "INVALID_ARGUMENT", "UNAVAILABLE"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class InvalidArgumentError(BatonError):
    """The request is malformed (bad sampling parameters, prompt too long, text without a tokenizer)."""


class UnavailableError(BatonError):
    """No router or no worker could serve the call, after the client's retries."""


class ResourceExhaustedError(BatonError):
    """The server is out of capacity for now."""


class DeadlineExceededError(BatonError):
    """The call ran past the client's timeout."""


class UnauthenticatedError(BatonError):
    """The API key is missing or wrong."""


_BY_CODE: dict[str, type[BatonError]] = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "UNAVAILABLE": UnavailableError,
    "RESOURCE_EXHAUSTED": ResourceExhaustedError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "UNAUTHENTICATED": UnauthenticatedError,
}


def error_for(code: str, message: str) -> BatonError:
    return _BY_CODE.get(code, BatonError)(code, message)


def from_rpc_error(e: grpc.RpcError) -> BatonError:
    # The errors of calls (sync and grpc.aio) carry code() and details(); a bare RpcError does not.
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else None
    return error_for(code.name if code is not None else "UNKNOWN", details or str(e))
