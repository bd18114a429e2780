"""The router's HTTP port as one ASGI app: the operations routes (`/metrics`, `/health`, `/v1/workers`,
GET, from `http.py`) and the OpenAI-compatible API (`openai_http.py`), on the router's event loop.

Routes are cheap reads of the service's state; they run on the loop. Any exception a handler lets out is
answered as 500 in OpenAI's error shape, and the server goes on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Protocol

from baton.router.http_errors import ApiError
from baton.router.http_exchange import ClientGone, Exchange, Receive, Scope, Send
from baton.router.http_limits import HttpLimits
from baton.serving.ops_http import Route

log = logging.getLogger(__name__)


class Front(Protocol):
    def claims(self, path: str) -> bool:
        """Is `path` (without its query) one of the front's?"""

    async def handle(self, ex: Exchange) -> None:
        """Answers `ex`, whatever its method."""

    def drain(self) -> None:
        """Answers new requests with 503 from now on."""

    def close(self) -> None:
        """Ends the requests still in flight."""


class RouterApp:
    def __init__(self, routes: Mapping[str, Route], front: Front | None, limits: HttpLimits) -> None:
        self.routes = dict(routes)
        self.front = front
        self.limits = limits

    def drain(self) -> None:
        if self.front is not None:
            self.front.drain()

    def close(self) -> None:
        if self.front is not None:
            self.front.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":  # websockets: refused by closing
            await send({"type": "websocket.close"})
            return
        ex = Exchange(scope, receive, send, self.limits)
        path = ex.path.rstrip("/") or "/"
        try:
            if self.front is not None and self.front.claims(path):
                await self.front.handle(ex)
            elif ex.method in ("GET", "HEAD") and (route := self.routes.get(ex.path)) is not None:
                await ex.respond(*route())
            else:
                raise ApiError(404, f"no such path: {ex.path[:200]}", code="not_found")
        except ClientGone:
            pass
        except ApiError as e:
            await _fail(ex, e)
        except Exception as e:  # a bug answers 500; the server goes on
            log.exception("%s %s failed", ex.method, ex.path)
            await _fail(ex, ApiError(500, f"internal error: {e!r}", "server_error"))


async def _fail(ex: Exchange, e: ApiError) -> None:
    with contextlib.suppress(ClientGone):
        await ex.fail(e)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
