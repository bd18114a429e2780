"""One HTTP request and its answer over ASGI: the body read within limits, a JSON answer or an SSE stream,
and the client's disconnect.

Reading: a `content-length` above the limit is refused (413) before any byte of the body is read; a body
without one is counted as it arrives (past the limit it is read on and dropped up to once more the limit,
then refused); the whole body must arrive within the body timeout (408). Writing: a
write that stalls longer than the write timeout (the client stopped reading) counts as the client gone.
After the body, `wait_gone()` returns when the client disconnects (ASGI's `http.disconnect`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from baton.router.http_errors import ApiError
from baton.router.http_limits import HttpLimits

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
Headers = Iterable[tuple[bytes, bytes]]


class ClientGone(Exception):
    """The client disconnected, or stopped reading for longer than the write timeout."""


class Exchange:
    def __init__(self, scope: Scope, receive: Receive, send: Send, limits: HttpLimits) -> None:
        self.scope, self._receive, self._send, self.limits = scope, receive, send, limits
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.started = False  # the response's status line is sent: errors go into the stream
        self.finished = False
        self._gone = asyncio.Event()
        self._body_read = False

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        for k, v in self.scope["headers"]:
            if k == key:
                return v.decode("latin-1")
        return None

    # ---- reading ----
    async def body(self) -> bytes:
        """The whole request body (ApiError 413 / 408 / 400 when it breaks a limit)."""
        limit = self.limits.max_request_bytes
        declared = self.header("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(400, f"content-length: expected a number of bytes, got {declared[:40]!r}",
                               param="content-length")
            if int(declared) > limit:
                raise ApiError(413, f"body: expected at most {limit} bytes (--max-request-bytes), got "
                                    f"{declared}", param="body", code="request_too_large")
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                while True:
                    message = await self._receive()
                    if message["type"] == "http.disconnect":
                        self._gone.set()
                        raise ClientGone
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    more = message.get("more_body", False)
                    if size > limit:
                        if more and size <= 2 * limit:
                            # Read on (up to once more the limit) and drop: a connection closed with unread
                            # bytes is reset, and the client would never see the 413.
                            chunks.clear()
                            continue
                        raise ApiError(413, f"body: expected at most {limit} bytes (--max-request-bytes), got "
                                            "more", param="body", code="request_too_large")
                    chunks.append(chunk)
                    if not more:
                        break
        except TimeoutError:
            raise ApiError(408, f"body: expected it within {self.limits.body_timeout_s} s of the headers "
                                "(--http-body-timeout-s)", param="body", code="request_timeout") from None
        self._body_read = True
        return b"".join(chunks)

    async def wait_gone(self) -> None:
        """Returns once the client has disconnected (call after `body()`)."""
        while not self._gone.is_set():
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._gone.set()

    # ---- writing ----
    async def _write(self, message: dict) -> None:
        try:
            async with asyncio.timeout(self.limits.write_timeout_s):
                await self._send(message)
        except TimeoutError:
            raise ClientGone from None
        except OSError as e:
            raise ClientGone from e

    async def respond(self, status: int, ctype: str, body: bytes, headers: Headers = ()) -> None:
        self.started = True
        await self._write({"type": "http.response.start", "status": status,
                           "headers": [(b"content-type", ctype.encode()),
                                       (b"content-length", str(len(body)).encode()), *headers]})
        await self._write({"type": "http.response.body", "body": body})
        self.finished = True

    async def json(self, status: int, obj: object, headers: Headers = ()) -> None:
        await self.respond(status, "application/json", json.dumps(obj).encode(), headers)

    async def event(self, obj: object) -> None:
        """One SSE event (`data: <json>`); the first one starts the stream."""
        if not self.started:
            self.started = True
            await self._write({"type": "http.response.start", "status": 200,
                               "headers": [(b"content-type", b"text/event-stream"),
                                           (b"cache-control", b"no-cache")]})
        data = obj if isinstance(obj, str) else json.dumps(obj)
        await self._write({"type": "http.response.body", "body": f"data: {data}\n\n".encode(),
                           "more_body": True})

    async def end_stream(self) -> None:
        await self._write({"type": "http.response.body", "body": b""})
        self.finished = True

    async def fail(self, e: ApiError) -> None:
        """Answers `e`: as an error body, or as a last event when a stream has started."""
        if self.finished:
            return
        if not self.started:
            await self.json(e.status, e.body(), e.headers())
        else:  # mid-stream: OpenAI clients raise on an event that carries an error
            await self.event(e.body())
            await self.end_stream()
