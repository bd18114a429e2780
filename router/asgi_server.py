"""The router's HTTP server: an ASGI app served by Hypercorn on the router's own asyncio loop.

Why Hypercorn (over uvicorn, and over the stdlib's threading server it replaces): it serves HTTP/1.1 with
keep-alive and HTTP/2 (h2c, by prior knowledge or upgrade) from maintained sans-I/O protocol libraries
(h11, h2); it embeds in a running loop (`serve` with a shutdown trigger, no signal handlers of its own)
and takes a socket we bound ourselves; and its idle timer runs from the moment a connection opens, so a
connection that never completes its request headers is closed after `idle_timeout_s` (uvicorn's keep-alive
timer starts only after a first response, leaving half-sent requests held). Each connection is a task on
the loop, not a thread: held connections cost memory only until the idle timer closes them.

The socket binds only where `host` says, listens with `backlog` at once (connections queue while Hypercorn
starts), and `close()` stops accepting, lets requests in flight run up to `grace` seconds, then ends them. With a
certificate (the router's `--tls-cert` / `--tls-key`) the port speaks HTTPS only, as the gRPC port does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Protocol

from hypercorn.asyncio.run import worker_serve
from hypercorn.config import Config, Sockets
from hypercorn.utils import wrap_app

from baton.router.http_limits import HttpLimits
from baton.serving.listen_error import CannotListen

log = logging.getLogger(__name__)

# Seconds close() waits for Hypercorn's own shutdown beyond the grace period before cancelling it.
_CLOSE_SLACK_S = 5.0


def bind(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on `host:port` (IPv4 or IPv6 as `host` resolves), non-blocking."""
    try:
        family, type_, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, type_, proto)
    except OSError as e:
        raise CannotListen(f"cannot listen on {host}:{port}: {e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise CannotListen(f"cannot listen on {host}:{port}: {e}") from e
    return sock


def _config(limits: HttpLimits, name: str, tls_dir: str | None) -> Config:
    c = Config()
    c.keep_alive_timeout = limits.idle_timeout_s
    c.backlog = limits.backlog
    c.graceful_timeout = 0.0
    c.accesslog = None
    c.errorlog = logging.getLogger(name)
    if tls_dir is not None:
        c.certfile, c.keyfile = str(Path(tls_dir, "cert.pem")), str(Path(tls_dir, "key.pem"))
    return c


def _tls_dir(tls: tuple[bytes, bytes] | None) -> str | None:
    """The PEM chain and key as files (Hypercorn loads them from files), in a directory only this user reads."""
    if tls is None:
        return None
    d = tempfile.mkdtemp(prefix="baton-http-tls-")
    for name, data in (("cert.pem", tls[0]), ("key.pem", tls[1])):
        Path(d, name).write_bytes(data)
    return d


class App(Protocol):
    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """ASGI 3."""

    def drain(self) -> None:
        """Refuse new requests from now on (the server is closing)."""

    def close(self) -> None:
        """Cancel the requests still in flight."""


class AsgiServer:
    """Serves `app` on `host:port` (0: any free port; `.port` is the bound one) until `close()`."""

    def __init__(self, app: App, sock: socket.socket, limits: HttpLimits, name: str,
                 tls: tuple[bytes, bytes] | None = None) -> None:
        self.app = app
        self.host, self.port = sock.getsockname()[:2]
        self.tls = tls is not None
        self._tls_dir = _tls_dir(tls)
        self._config = _config(limits, name, self._tls_dir)
        self._stop = asyncio.Event()
        sockets = Sockets([sock], [], []) if self.tls else Sockets([], [sock], [])
        self._task = asyncio.create_task(
            worker_serve(wrap_app(app, self._config.wsgi_max_body_size, "asgi"), self._config,
                         sockets=sockets, shutdown_trigger=self._stop.wait), name=name)
        self._task.add_done_callback(self._ended)

    @classmethod
    def start(cls, app: App, host: str, port: int, limits: HttpLimits, name: str = "baton-http",
              tls: tuple[bytes, bytes] | None = None) -> AsgiServer:
        """Binds (CannotListen if it cannot) and starts serving on the running loop; `tls`: (PEM certificate
        chain, PEM key) to serve HTTPS only."""
        return cls(app, bind(host, port, limits.backlog), limits, name, tls)

    @staticmethod
    def _ended(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("HTTP server stopped: %r", task.exception())

    async def close(self, grace: float = 0.0) -> None:
        """Stops accepting connections; requests in flight get `grace` seconds, then are cancelled."""
        self.app.drain()
        # The app ends its own requests when the grace period is over; Hypercorn's cancelling of connection
        # tasks is the last resort (a cancelled connection task is logged as an error by asyncio).
        self._config.graceful_timeout = grace + _CLOSE_SLACK_S
        self._stop.set()
        await asyncio.wait({self._task}, timeout=grace)
        self.app.close()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), 2 * _CLOSE_SLACK_S)
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        except Exception:  # already logged by _ended
            pass
        finally:
            if self._tls_dir is not None:
                shutil.rmtree(self._tls_dir, ignore_errors=True)
