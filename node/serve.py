"""Node process bootstrap: flags, engine + engine thread, the gRPC server, and a clean shutdown."""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
from collections.abc import Awaitable, Callable

import grpc

from baton.cli.engine_args import add_engine_args
from baton.cli.listen_error import CannotListen
from baton.transfer.agent import DEFAULT_PROGRESS_DELAY_US

GRACE_S = 5.0
# A node's default HTTP port is its gRPC port + this; side channels use + 1000 (cli/cluster.py lays them out).
HTTP_PORT_OFFSET = 2000


def node_parser(role: str, max_num_batched_tokens: int | None = None) -> argparse.ArgumentParser:
    """The node's flags; `max_num_batched_tokens`: its step budget when the flag is left out (None: the engine's)."""
    p = argparse.ArgumentParser(prog=f"baton-{role}", description=f"Baton {role} node")
    p.add_argument("--model", required=True, help="HF NemotronH checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="gRPC port of the Worker service")
    p.add_argument("--http-port", type=int, default=None,
                   help="port of /metrics and /health (default: --port + 2000; 0: any free port)")
    p.add_argument("--engine-id", default=None, help=f"unique id of this node (default {role}-HOST-PORT)")
    p.add_argument("--cuda-ipc", action="store_true",
                   help="GPU nodes on one host: move caches through CUDA IPC mappings of the prefill node's pools "
                        "instead of NIXL's UCX copy (both nodes need the flag; other peers still use NIXL)")
    p.add_argument("--nixl-progress-delay-us", type=int, default=DEFAULT_PROGRESS_DELAY_US,
                   help="longest sleep (us) of NIXL's progress thread between passes; 0: it spins, one busy core "
                        f"(default {DEFAULT_PROGRESS_DELAY_US})")
    add_engine_args(p, max_num_batched_tokens)
    return p


def http_port_of(a: argparse.Namespace) -> int:
    """--http-port, else the gRPC port + 2000 (any free port when that is past 65535 or --port is 0)."""
    if a.http_port is not None:
        return a.http_port
    return a.port + HTTP_PORT_OFFSET if 0 < a.port + HTTP_PORT_OFFSET <= 65535 and a.port else 0


def add_port(server: grpc.aio.Server, host: str, port: int) -> None:
    """Bind the node's gRPC port; a port it cannot bind raises `CannotListen` (grpc says RuntimeError)."""
    try:
        server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:
        raise CannotListen(f"node: cannot listen on {host}:{port}: {e}") from e


def default_engine_id(role: str, host: str, port: int) -> str:
    return f"{role}-{socket.gethostname()}-{host}-{port}"


async def serve_until_signalled(start: Callable[[], Awaitable[grpc.aio.Server]],
                                shutdown: Callable[[], None]) -> None:
    """Start the server, then wait for SIGINT/SIGTERM; stop accepting, drain for a grace period, clean up."""
    server = await start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(GRACE_S)
    shutdown()


def run(start: Callable[[], Awaitable[grpc.aio.Server]], shutdown: Callable[[], None]) -> int:
    asyncio.run(serve_until_signalled(start, shutdown))
    return 0
