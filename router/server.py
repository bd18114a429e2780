"""Starting the router: `serve()` in-process, or `python -m baton.router.server` as its own process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from baton.engine.tokenizer import TOKENIZER_FILE, TextTokenizer, load_tokenizer
from baton.proto.grpc.health.v1 import health_pb2_grpc
from baton.proto.grpc_decode import DecodeInterceptor
from baton.proto.message_limits import server_options
from baton.proto.v1 import generation_pb2, generation_pb2_grpc
from baton.router.asgi_app import RouterApp
from baton.router.asgi_server import AsgiServer
from baton.router.cluster_client import ClusterClient
from baton.router.config import RouterConfig
from baton.router.discovery import add_discovery_args, discovery_from_args
from baton.router.flow import Flow
from baton.router.http_limits import HttpLimits, add_http_limit_args, http_limits_from_args
from baton.router.limits import add_grpc_limit_args, grpc_limits_from_args
from baton.router.openai_http import OpenAIFront, load_chat_template
from baton.router.policy import Role
from baton.router.security import API_KEYS_ENV, RouterSecurity
from baton.router.service import GenerationService
from baton.router.workers import WorkerPool
from baton.serving.grpc_health import HEALTH_SERVICE, HealthService
from baton.serving.grpc_reflection import add_reflection
from baton.serving.listen_error import CannotListen, run_main
from baton.serving.ops_http import health_route, json_response, metrics_route

log = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass
class Router:
    """A started router: its server, the port it is bound to (useful with port 0) and its service."""

    server: grpc.aio.Server
    port: int
    service: GenerationService
    cleanup: asyncio.Task[None]
    # /metrics, /health, /v1/workers and the OpenAI API (None when started without an HTTP port); closed by
    # the clean-up.
    http: AsgiServer | None = None

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stops serving (in-flight requests get `grace` seconds), then waits for the clean-up."""
        await self.server.stop(grace)
        await self.cleanup


# The loop keeps only weak references to tasks: these live until the server they clean up after stops.
_cleanup_tasks: set[asyncio.Task[None]] = set()


def router_tokenizer(path: str) -> TextTokenizer:
    """`path` is a model directory or its `tokenizer.json` (special ids come from the files beside it)."""
    p = Path(path)
    tok = load_tokenizer(p.parent if p.name == TOKENIZER_FILE else p)
    if tok is None:
        raise ValueError(f"tokenizer_path: expected a {TOKENIZER_FILE} or a directory holding one, got {path!r}")
    return tok


async def _close_when_stopped(server: grpc.aio.Server, service: GenerationService,
                              http: AsgiServer | None = None) -> None:
    # grpc.aio.Server has no stop hook: this task waits for termination, then lets the Abort RPCs of the
    # requests that were cancelled by the shutdown finish before the worker channels close.
    await server.wait_for_termination()
    if http is not None:
        await http.close()
    # The stop cancelled the remaining Generate calls; their clean-up starts the Abort RPCs.
    await service.wait_idle(service.flow.config.control_timeout_s)
    await service.flow.drain()
    await asyncio.gather(service.prefill_pool.close(), service.decode_pool.close())


def add_services(server: grpc.aio.Server, service: GenerationService) -> None:
    """`baton.v1.Generation`, plus what probes and tools expect of any gRPC server: the standard health service
    (SERVING while `service.health().ok`: a healthy decode worker and no drain) and server reflection."""
    generation_pb2_grpc.add_GenerationServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(HealthService([GENERATION_SERVICE], lambda: service.health().ok),
                                                 server)
    add_reflection(server, [GENERATION_SERVICE, HEALTH_SERVICE])


def http_routes(service: GenerationService) -> dict:
    def detail() -> dict:
        h = service.health()
        return {"prefill_workers": h.prefill_workers, "decode_workers": h.decode_workers}

    return {"/metrics": metrics_route(service.metrics.registry),
            "/health": health_route(lambda: service.health().ok, detail),
            "/live": health_route(lambda: True),
            "/v1/workers": lambda: json_response(service.workers())}


async def start_router(config: RouterConfig, port: int = 0, host: str = "127.0.0.1",
                       http_port: int | None = None, served_model_name: str | None = None,
                       security: RouterSecurity | None = None, cluster: ClusterClient | None = None,
                       http_limits: HttpLimits | None = None) -> Router:
    """Polls every worker once, then starts serving. The router starts even if no worker answers yet:
    nodes may come up after it; Health says when it can serve. With `http_port` (0: any free port) it also
    serves /metrics, /health, /v1/workers and the OpenAI-compatible API (`openai_http.py`; the model is
    `served_model_name`, default the name of the workers' model directory) over HTTP. `cluster`: how the nodes are
    called (default: with the cluster secret in BATON_CLUSTER_SECRET, if set)."""
    tokenizer = router_tokenizer(config.tokenizer_path) if config.tokenizer_path else None
    if cluster is None:
        cluster = ClusterClient.from_sources(insecure=True)
    prefill = WorkerPool.from_config(config, Role.PREFILL, cluster=cluster)
    decode = WorkerPool.from_config(config, Role.DECODE, cluster=cluster)
    await asyncio.gather(prefill.start(), decode.start())
    security = security or RouterSecurity()
    service = GenerationService(Flow(config, prefill, decode), tokenizer, keyed_clients=security.requires_key,
                                served_model_name=served_model_name)
    # Long prompts arrive as repeated uint32 (up to 5 bytes a token): gRPC's 4 MB default is lifted to the limit.
    server = grpc.aio.server(options=server_options(config.max_request_bytes),
                             interceptors=[*security.interceptors(), DecodeInterceptor()])
    add_services(server, service)
    creds = security.server_credentials()
    try:
        bound = (server.add_secure_port(f"{host}:{port}", creds) if creds is not None
                 else server.add_insecure_port(f"{host}:{port}"))
    except RuntimeError as e:
        await asyncio.gather(prefill.close(), decode.close())
        raise CannotListen(f"router: cannot listen on {host}:{port}: {e}") from e
    http = None
    if http_port is not None:
        try:
            limits = http_limits or HttpLimits()
            front = OpenAIFront(service, load_chat_template(config.tokenizer_path), security, limits)
            tls = (security.tls_cert_chain, security.tls_private_key) if security.tls else None
            http = AsgiServer.start(RouterApp(http_routes(service), front, limits), host, http_port, limits,
                                    name="baton-router-http", tls=tls)
        except (OSError, ValueError):
            await asyncio.gather(prefill.close(), decode.close())
            raise
    await server.start()
    task = asyncio.create_task(_close_when_stopped(server, service, http), name="baton-router-cleanup")
    _cleanup_tasks.add(task)
    task.add_done_callback(_cleanup_tasks.discard)
    log.info("router listening on %s:%d (%d prefill, %d decode workers)", host, bound,
             len(prefill.workers), len(decode.workers))
    return Router(server, bound, service, task, http)


async def serve(config: RouterConfig, port: int, host: str = "127.0.0.1") -> grpc.aio.Server:
    """Starts the router on `host:port` and returns its (started) server; `server.stop()` shuts it down,
    worker polling and channels included."""
    return (await start_router(config, port, host)).server


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m baton.router.server", description="Baton's router")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=None,
                   help="port of /metrics, /health, /v1/workers and the OpenAI-compatible API "
                        "(default: --port + 1; 0: any free port)")
    p.add_argument("--api-keys-file", default=None,
                   help=f"clients must send 'authorization: Bearer <key>' with a key from this file (one per "
                        f"line) or from ${API_KEYS_ENV} (comma-separated); Health, /health, /metrics stay open")
    p.add_argument("--tls-cert", default=None,
                   help="PEM certificate chain: serve gRPC and the HTTP port (HTTPS) over TLS only")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--cluster-secret-file", default=None,
                   help="file holding the cluster secret (default: $BATON_CLUSTER_SECRET); every call to a node "
                        "presents its token")
    p.add_argument("--insecure-no-cluster-auth", action="store_true",
                   help="call the nodes without a cluster secret (nodes started with --insecure-no-cluster-auth)")
    p.add_argument("--cluster-tls-ca", default=None,
                   help="PEM CA bundle: call the nodes over TLS, checking their certificates against it")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name to clients: the OpenAI API's model id and gRPC ModelInfo's model "
                        "(default: the name of the workers' model directory)")
    p.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="HOST:PORT",
                   help="prefill workers (none: every prompt is prefilled on the decode node)")
    p.add_argument("--decode", nargs="+", action="extend", default=[], metavar="HOST:PORT",
                   help="decode workers (at least one, unless --decode-dns is given)")
    p.add_argument("--local-prefill-threshold", type=int, default=0,
                   help="prompts of at most this many tokens are prefilled on the decode node")
    p.add_argument("--prefill-queue-limit-tokens", type=int, default=0,
                   help="while every prefill worker has more than this many prompt tokens queued, prefill new "
                        "requests on their decode node (0: off)")
    p.add_argument("--prefix-affinity-weight", type=float, default=0.0,
                   help="route a prompt to a worker predicted to hold its prefix in its prefix cache (from this "
                        "router's own routing history) while that worker's extra queued prompt tokens are at most "
                        "this weight times the prefix tokens it holds beyond the other candidate's (0: off, load "
                        "alone decides)")
    p.add_argument("--prefix-index-blocks", type=int, default=32768,
                   help="prefix block hashes remembered per worker for --prefix-affinity-weight, least recently "
                        "sent forgotten first")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, or a model directory holding one")
    p.add_argument("--load-poll-interval", type=float, default=0.5, help="seconds between Load polls")
    p.add_argument("--prefill-timeout", type=float, default=120.0, help="seconds for one Prefill RPC")
    p.add_argument("--decode-idle-timeout", type=float, default=120.0,
                   help="longest silence (s) tolerated on a Decode stream")
    p.add_argument("--drain-timeout-s", "--grace", dest="grace", type=float, default=60.0,
                   help="on SIGTERM/SIGINT the router refuses new requests (Health says not ok) and gives those in "
                        "flight this long to finish before it stops")
    add_discovery_args(p)
    add_http_limit_args(p)
    add_grpc_limit_args(p)
    return p


async def _run(config: RouterConfig, port: int, host: str, grace: float, http_port: int | None,
               served_model_name: str | None = None, security: RouterSecurity | None = None,
               cluster: ClusterClient | None = None, http_limits: HttpLimits | None = None) -> None:
    # --port 0 (any free port) has no "next" port: then HTTP takes any free port too.
    if http_port is None:
        http_port = port + 1 if port else 0
    router = await start_router(config, port, host, http_port, served_model_name, security, cluster,
                                http_limits)
    # Parent processes (`baton up`) wait for this line to know the router is listening.
    print(f"baton router listening on {host}:{router.port} (http {router.http.port})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: new requests are refused and Health says not ok (clients and Kubernetes stop sending); requests in
    # flight, over gRPC or HTTP, get `grace` seconds to finish. A second signal cuts the drain short.
    router.service.draining = True
    log.warning("router draining: requests in flight get up to %g s", grace)
    again = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, again.set)
    waits = [asyncio.ensure_future(router.service.wait_idle(grace)), asyncio.ensure_future(again.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    left = router.service.end_all(grpc.StatusCode.UNAVAILABLE, "router shut down before this request finished: "
                                  + ("a second signal cut its drain short" if again.is_set()
                                     else f"its drain timeout ({grace:g} s) passed"))
    if left:
        log.warning("router drained; %d request(s) still in flight ended with UNAVAILABLE", left)
        await router.service.wait_idle(5.0)
    log.warning("router drained; stopping")
    await router.stop(1.0)


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = RouterConfig(prefill_addrs=tuple(a.prefill), decode_addrs=tuple(a.decode),
                              local_prefill_threshold=a.local_prefill_threshold,
                              prefill_queue_limit_tokens=a.prefill_queue_limit_tokens, tokenizer_path=a.tokenizer,
                              prefix_affinity_weight=a.prefix_affinity_weight,
                              prefix_index_blocks=a.prefix_index_blocks,
                              load_poll_interval_s=a.load_poll_interval, prefill_timeout_s=a.prefill_timeout,
                              decode_idle_timeout_s=a.decode_idle_timeout,
                              max_request_bytes=a.http_max_request_bytes, **grpc_limits_from_args(a),
                              **discovery_from_args(a))
        security = RouterSecurity.from_sources(a.api_keys_file, a.tls_cert, a.tls_key)
        cluster = ClusterClient.from_sources(a.cluster_secret_file, a.cluster_tls_ca, a.insecure_no_cluster_auth)
        http_limits = http_limits_from_args(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if not security.requires_key:
            log.warning("no API keys configured: any client that reaches the router may use it")
        asyncio.run(_run(config, a.port, a.host, a.grace, a.http_port, a.served_model_name, security, cluster,
                         http_limits))
    except CannotListen:
        raise
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
