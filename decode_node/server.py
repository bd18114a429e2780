"""`python -m baton.decode_node.server --model DIR --port P`: a decode node process.

Loads the engine, registers its cache pools with NIXL once (it READs into them), and serves the Worker
gRPC service on P, and /metrics and /health over HTTP (port P+2000 unless --http-port).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import grpc

from baton.decode_node.puller import Puller
from baton.decode_node.service import DecodeService
from baton.engine.engine_thread import EngineThread
from baton.engine.parallel.rank_processes import start_engine
from baton.node.cluster_auth import NodeSecurity
from baton.node.drain import NodeDrain
from baton.node.engine_args import engine_config_from_args
from baton.node.metrics import NodeMetrics, start_node_http
from baton.node.rank_transfer import RankLinks, node_transfer
from baton.node.serve import default_engine_id, http_port_of, node_parser, run
from baton.node.transfer_listen import limit_transfer_interfaces
from baton.proto.grpc_decode import DecodeInterceptor
from baton.proto.keepalive import NODE_SERVER_OPTIONS
from baton.proto.message_limits import WORKER_SERVER_OPTIONS
from baton.proto.v1 import worker_pb2_grpc as wk_grpc
from baton.serving.listen_error import run_main
from baton.transfer.agent import READ_ORDERS


def parser() -> argparse.ArgumentParser:
    """The decode node's flags: every node's (`node_parser`), the engine's, and the NIXL reads'."""
    p = node_parser("decode")
    p.add_argument("--read-timeout", type=float, default=10.0,
                   help="seconds one NIXL READ may take, and a first handshake with its prefill node")
    p.add_argument("--nixl-read-order", choices=READ_ORDERS, default="state-first",
                   help="state-first (default): a NIXL read posts the request's state slot as its own READ before "
                        "it plans and posts the KV blocks' (the link starts sooner); one-read: blocks and state in "
                        "one READ")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        security = NodeSecurity.from_args(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine_id = a.engine_id or default_engine_id("decode", a.host, a.port)
    limit_transfer_interfaces(a.host)
    links = None
    try:
        config = engine_config_from_args(a)
        links = RankLinks(config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None
        # With --tensor-parallel-size N this starts ranks 1..N-1 too (this process is rank 0, which serves); each
        # of them registers its pools for transfers as well.
        engine = start_engine(a.model, config, links.attach(engine_id, a.nixl_progress_delay_us) if links else None)
    except ValueError as e:
        if links is not None:
            links.close()
        print(f"error: decode node: {e}", file=sys.stderr)
        return 2
    # Capture every decode batch size's CUDA graph before taking traffic (no request waits on a capture).
    t0 = time.perf_counter()
    if captured := engine.capture_graphs():
        print(f"decode node: captured {captured} CUDA graphs in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"decode node: {engine.memory_summary()}", flush=True)
    # Before the warm-up, so that the CUDA IPC copier's kernel compiles with the others before the node serves.
    agent = node_transfer(engine, engine_id, links, cuda_ipc=a.cuda_ipc, progress_delay_us=a.nixl_progress_delay_us,
                          state_first=a.nixl_read_order == "state-first", ipc_reads=True)
    # Before the listeners open: kernels compile now, not inside the first requests' time to first token.
    if (warm := engine.warm_up()).prompts:
        print(f"decode node: {warm.summary()}", flush=True)
    thread = EngineThread(engine, name="baton-decode-engine").start()
    puller = Puller(agent, thread, read_timeout_s=a.read_timeout, credential=security.credential,
                    ssl_context=security.side_channel_client_ssl())
    has_tokenizer = (Path(a.model) / "tokenizer.json").exists()
    service = DecodeService(thread, puller, engine_id, str(a.model), has_tokenizer, security.credential)
    metrics = NodeMetrics("decode", engine_id, agent.stats, fallbacks=lambda: puller.num_fallbacks)
    drain = NodeDrain(a.drain_timeout_s, metrics)
    thread.step_hooks.append(metrics.on_step)
    http = start_node_http(metrics, thread, a.host, http_port_of(a))
    service.http_port = http.port

    async def start() -> grpc.aio.Server:
        # The router's keepalive pings accepted; requests up to the router's limit; undecodable bytes judged last,
        # once the caller is known to be of the cluster.
        server = grpc.aio.server(options=(*WORKER_SERVER_OPTIONS, *NODE_SERVER_OPTIONS),
                                 interceptors=[*security.interceptors(), drain.interceptor, DecodeInterceptor()])
        wk_grpc.add_WorkerServicer_to_server(service, server)
        security.add_port(server, a.host, a.port)
        await server.start()
        metrics.ready = True
        print(f"decode node {engine_id} serving on {a.host}:{a.port} (http {http.port})", flush=True)
        return server

    def shutdown() -> None:
        metrics.ready = False
        http.close()
        thread.stop()
        engine.close()
        puller.close()
        agent.close()

    return run(start, shutdown, drain)


if __name__ == "__main__":
    sys.exit(run_main(main))
