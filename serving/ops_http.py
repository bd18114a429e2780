"""Operations endpoints (`/metrics`, `/health`): the routes, and the small threaded server nodes serve
them with.

The routes are shared: the router serves them from its ASGI app (`router/asgi_app.py`), on its loop. A node serves
them with `HttpServer`, on its own threads (it imports neither torch nor the engine): handlers must only
read state that is safe to read from there (ints, bools, objects replaced whole) and never call into an
asyncio loop or the engine. A client that sends nothing for `IDLE_TIMEOUT_S` is dropped, so that held
connections do not keep threads.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from baton.serving.listen_error import CannotListen

# (status, content type, body)
Response = tuple[int, str, bytes]
Route = Callable[[], Response]
IDLE_TIMEOUT_S = 5.0


def json_response(obj: object, status: int = 200) -> Response:
    return status, "application/json", json.dumps(obj).encode()


def metrics_route(registry: CollectorRegistry) -> Route:
    return lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry))


def health_route(ok: Callable[[], bool], detail: Callable[[], dict] = dict) -> Route:
    """200 with `{"ok": true, ...}` when `ok()`, else 503."""

    def route() -> Response:
        healthy = ok()
        return json_response({"ok": healthy, **detail()}, 200 if healthy else 503)

    return route


class HttpServer:
    """Serves GET `routes` on `host:port` (0: any free port; `.port` is the bound one) until `close()`."""

    def __init__(self, routes: Mapping[str, Route], host: str = "127.0.0.1", port: int = 0,
                 name: str = "baton-http") -> None:
        table = dict(routes)

        class Handler(BaseHTTPRequestHandler):
            timeout = IDLE_TIMEOUT_S  # the socket's: a half-sent request does not hold its thread for long

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                route = table.get(self.path.split("?", 1)[0])
                if route is None:
                    status, ctype, body = json_response({"error": f"no such path: {self.path}"}, 404)
                else:
                    try:
                        status, ctype, body = route()
                    except Exception as e:  # a broken route answers 500, the server goes on
                        status, ctype, body = json_response({"error": repr(e)}, 500)
                self._send(status, ctype, body)

            def _send(self, status: int, ctype: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # scrapes every few seconds: stay quiet
                pass

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise CannotListen(f"{name}: cannot listen on {host}:{port}: {e}") from e
        self._server.daemon_threads = True
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops serving and closes the socket (blocks up to one poll interval)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
