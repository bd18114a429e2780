"""Failures the router reports to its client as a gRPC status."""

from __future__ import annotations

import grpc


class RouterError(Exception):
    """Ends a Generate call with `code` and a message that says which worker failed and how."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RequestAborted(Exception):
    """The request was aborted by id (Generation.Abort): the stream ends with FINISH_REASON_ABORT."""


class StreamStalled(Exception):
    """A response write to the client did not complete within `stream_write_timeout_s`: it stopped reading."""


def describe(worker: object, err: grpc.aio.AioRpcError) -> str:
    return f"{worker!r}: {err.code().name}: {err.details()}"
