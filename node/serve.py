"""Node process bootstrap: flags, engine + engine thread, the gRPC server, and a drain then a clean shutdown."""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
from collections.abc import Awaitable, Callable

import grpc

from baton.node.cluster_auth import add_cluster_auth_args
from baton.node.drain import DEFAULT_DRAIN_TIMEOUT_S, NodeDrain
from baton.node.engine_args import add_engine_args
from baton.serving.listen_error import CannotListen
from baton.transfer.agent import DEFAULT_PROGRESS_DELAY_US

# Calls still running once the drain is over (Abort, Info) get this long before the server stops.
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
    p.add_argument("--drain-timeout-s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="on SIGTERM/SIGINT the node stops taking requests (Load and /health say so) and waits this "
                        "long for the requests in flight (and, on a prefill node, the leases held) to finish; what is "
                        f"left then ends with UNAVAILABLE (default {DEFAULT_DRAIN_TIMEOUT_S:g})")
    add_engine_args(p, max_num_batched_tokens)
    add_cluster_auth_args(p)
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


async def serve_until_signalled(start: Callable[[], Awaitable[grpc.aio.Server]], shutdown: Callable[[], None],
                                drain: NodeDrain | None = None) -> None:
    """Start the server, then wait for SIGINT/SIGTERM; drain (a second signal cuts the drain short), stop the
    server, clean up."""
    server = await start()
    signals = 0
    stop, again = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        (stop if signals == 1 else again).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    if drain is not None:
        await drain.run(cut_short=again)
    await server.stop(GRACE_S)
    shutdown()


def run(start: Callable[[], Awaitable[grpc.aio.Server]], shutdown: Callable[[], None],
        drain: NodeDrain | None = None) -> int:
    asyncio.run(serve_until_signalled(start, shutdown, drain))
    return 0
