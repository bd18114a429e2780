"""`python -m baton.prefill_node.server --model DIR --port P`: a prefill node process.

Loads the engine, registers its cache pools with NIXL once, serves `AgentMetadata` and lease renewals on
a side channel (port P+1000 unless --side-channel-port), the Worker gRPC service on P, and /metrics and
/health over HTTP (port P+2000 unless --http-port).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import grpc

from baton.engine.engine_config import PREFILL_MAX_NUM_BATCHED_TOKENS
from baton.engine.engine_thread import EngineThread
from baton.engine.parallel.rank_processes import start_engine
from baton.node.cluster_auth import NodeSecurity
from baton.node.drain import NodeDrain
from baton.node.engine_args import engine_config_from_args
from baton.node.metrics import NodeMetrics, start_node_http
from baton.node.rank_transfer import RankLinks, node_transfer
from baton.node.serve import default_engine_id, http_port_of, node_parser, run
from baton.node.transfer_listen import limit_transfer_interfaces
from baton.prefill_node.service import PrefillService
from baton.proto.grpc_decode import DecodeInterceptor
from baton.proto.keepalive import NODE_SERVER_OPTIONS
from baton.proto.message_limits import WORKER_SERVER_OPTIONS
from baton.proto.v1 import worker_pb2_grpc as wk_grpc
from baton.serving.listen_error import run_main
from baton.transfer.held_transfers import HeldTransfers
from baton.transfer.lease import DEFAULT_LEASE_SECONDS, LeaseTable
from baton.transfer.side_channel import SideChannelServer


def parser() -> argparse.ArgumentParser:
    """The node's flags; its step budget defaults to `PREFILL_MAX_NUM_BATCHED_TOKENS`, not the engine's."""
    p = node_parser("prefill", PREFILL_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--side-channel-port", type=int, default=None, help="default: --port + 1000")
    p.add_argument("--lease-seconds", type=float, default=DEFAULT_LEASE_SECONDS)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        security = NodeSecurity.from_args(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine_id = a.engine_id or default_engine_id("prefill", a.host, a.port)
    limit_transfer_interfaces(a.host)
    # This engine only prefills: one state slot per request; with --speculative-tokens it still runs the MTP
    # drafter over the prompt so that the drafter's KV travels with the target's (R8).
    links = None
    try:
        config = dataclasses.replace(engine_config_from_args(a), prefill_only=True)
        links = RankLinks(config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None
        # With --tensor-parallel-size N this starts ranks 1..N-1 too, each registering its pools for the decode
        # nodes' reads.
        engine = start_engine(a.model, config, links.attach(engine_id, a.nixl_progress_delay_us) if links else None)
    except ValueError as e:
        if links is not None:
            links.close()
        print(f"error: prefill node: {e}", file=sys.stderr)
        return 2
    print(f"prefill node: {engine.memory_summary()}", flush=True)
    # Before the listeners open: kernels compile now, not inside the first requests' time to first token.
    if (warm := engine.warm_up()).prompts:
        print(f"prefill node: {warm.summary()}", flush=True)
    agent = node_transfer(engine, engine_id, links, cuda_ipc=a.cuda_ipc, progress_delay_us=a.nixl_progress_delay_us)
    held = HeldTransfers(agent, LeaseTable(a.lease_seconds),
                         free=lambda lease: engine.free_held(lease.block_ids, lease.state_slot))
    side = SideChannelServer(lambda: agent.metadata, held.renew, host=a.host,
                             port=a.side_channel_port if a.side_channel_port is not None else a.port + 1000,
                             credential=security.credential, ssl_context=security.side_channel_server_ssl())
    thread = EngineThread(engine, name="baton-prefill-engine").start()
    has_tokenizer = (Path(a.model) / "tokenizer.json").exists()
    service = PrefillService(thread, held, side.address, str(a.model), has_tokenizer, security.credential)
    metrics = NodeMetrics("prefill", engine_id, agent.stats, held_leases=lambda: len(held.leases))
    drain = NodeDrain(a.drain_timeout_s, metrics, held_leases=lambda: len(held.leases))
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
        print(f"prefill node {engine_id} serving on {a.host}:{a.port} (side channel {side.address[1]}, "
              f"http {http.port})", flush=True)
        return server

    def shutdown() -> None:
        metrics.ready = False
        http.close()
        thread.stop()
        side.close()
        agent.close()

    return run(start, shutdown, drain)


if __name__ == "__main__":
    sys.exit(run_main(main))
