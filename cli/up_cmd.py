"""`baton up`: router + prefill and decode nodes on this machine, as separate processes, until Ctrl-C.

It supervises them (a process that exits is started again, `cli/supervisor.py`) and serves its own /metrics
(`baton_up_process_restarts_total`). Ctrl-C or SIGTERM drains: the router stops taking requests and lets those in
flight finish, then the nodes; a second signal cuts the drains short.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import threading

from baton.cli.cluster import NODE_HTTP_OFFSET, PROCESS_DRAIN_TIMEOUT_S, Cluster
from baton.cli.supervisor import Supervisor
from baton.engine.engine_config import PREFILL_MAX_NUM_BATCHED_TOKENS, EngineConfig
from baton.node.engine_args import add_engine_args, engine_flags, role_engine_flags


def gpu_list(text: str) -> tuple[int, ...]:
    """`--node-gpus 0,1` -> (0, 1): distinct non-negative integers, comma-separated."""
    parts = [x.strip() for x in text.split(",")]
    if not all(x.isascii() and x.isdigit() for x in parts) or len(set(map(int, parts))) != len(parts):
        raise argparse.ArgumentTypeError(f"expected distinct comma-separated non-negative integers (e.g. 0,1), "
                                         f"got {text!r}")
    return tuple(int(x) for x in parts)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start router, prefill and decode nodes on this machine")
    p.add_argument("--model", required=True)
    p.add_argument("--prefill-workers", type=int, default=None,
                   help="prefill nodes (default: 0 where one GPU is visible, where aggregated serving does best; "
                        "else 1)")
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--port", type=int, default=50051,
                   help="router gRPC port P; nodes take P+2.. (their HTTP endpoints port + 2000)")
    p.add_argument("--http-port", type=int, default=None,
                   help="router HTTP port (/metrics, /health, /v1/workers; default P+1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--local-prefill-threshold", type=int, default=0,
                   help="prompts of at most this many tokens (and always 1) are prefilled on the decode node")
    p.add_argument("--prefill-queue-limit-tokens", type=int, default=0,
                   help="while every prefill node has more than this many prompt tokens queued, prefill new requests "
                        "on their decode node (0: off)")
    p.add_argument("--api-keys-file", default=None,
                   help="clients must send 'authorization: Bearer <key>' with a key from this file (one per line); "
                        "BATON_API_KEYS (comma-separated) works too")
    p.add_argument("--log-dir", default=None, help="write each process's output to DIR/<name>.log")
    p.add_argument("--drain-timeout-s", type=float, default=PROCESS_DRAIN_TIMEOUT_S,
                   help="on Ctrl-C/SIGTERM the router, then the nodes, stop taking requests and give those in flight "
                        "this long to finish")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="port of baton up's own /metrics (process restarts; default P+2000, which no node uses; "
                        "0: any free port)")
    p.add_argument("--node-gpus", type=gpu_list, default=(), metavar="G,G,...",
                   help="spread the nodes over these GPUs: node i (prefill nodes first) gets CUDA_VISIBLE_DEVICES = "
                        "its GPU (the i-th, cyclically) first, then the others (default: environment unchanged)")
    p.add_argument("--cuda-ipc", action=argparse.BooleanOptionalAction, default=None,
                   help="move caches between the nodes through CUDA IPC mappings instead of NIXL's UCX copy (default: "
                        "on where the nodes run on GPUs, which this machine's nodes share)")
    add_engine_args(p)
    add_role_engine_args(p)
    p.set_defaults(run=run)


def add_role_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-engine-args", default="", metavar="FLAGS",
                   help="engine flags of the prefill nodes only, after the engine flags above (a later flag wins), "
                        "e.g. '--max-num-batched-tokens 4096'; where neither gives a step budget a prefill node "
                        f"takes {PREFILL_MAX_NUM_BATCHED_TOKENS} (its steps carry no decode rows)")
    p.add_argument("--decode-engine-args", default="", metavar="FLAGS",
                   help="engine flags of the decode nodes only, after the engine flags above")
    p.add_argument("--router-args", default="", metavar="FLAGS",
                   help="flags of the router process (`python -m baton.router.server --help`), e.g. "
                        "'--max-inflight-per-client 64 --max-request-bytes 1048576'")


def router_flags(text: str) -> tuple[str, ...]:
    """`--router-args`, split into words and checked against the router's own flags before any process starts."""
    from baton.router.server import _parser

    try:
        flags = tuple(shlex.split(text))
    except ValueError as e:  # an unclosed quote
        raise ValueError(f"--router-args: expected shell words, got {text!r}: {e}") from None
    parser = _parser()

    def error(message: str) -> None:
        raise ValueError(f"--router-args: {message}")

    parser.error = error  # type: ignore[method-assign]
    parser.parse_args(["--port", "1", "--decode", "127.0.0.1:1", *flags])
    return flags


def visible_gpus(device: str | None) -> int:
    """GPUs the nodes would compute on: none with `--device cpu` or where CUDA sees none."""
    if device is not None and device.startswith("cpu"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_share(nodes: int, node_gpus: tuple[int, ...]) -> float:
    """Each node's --gpu-memory-utilization where `nodes` nodes share the GPUs (`node_gpus`, () = all on one)."""
    per_gpu = -(-nodes // len(node_gpus)) if node_gpus else nodes
    return int(EngineConfig().gpu_memory_utilization / per_gpu * 100) / 100


def shared_gpu_flags(a: argparse.Namespace, nodes: int, node_gpus: tuple[int, ...], gpus: int) -> tuple[str, ...]:
    """`--gpu-memory-utilization` for nodes that share GPUs (`gpu_share`), where the flags size no pool."""
    if not gpus or any(v is not None for v in (a.gpu_memory_utilization, a.cache_memory_mb, a.num_kv_blocks)):
        return ()
    share = gpu_share(nodes, node_gpus)
    return ("--gpu-memory-utilization", str(share)) if share < EngineConfig().gpu_memory_utilization else ()


def cluster_from_args(a: argparse.Namespace, gpus: int | None = None) -> Cluster:
    """The (not yet started) cluster `baton up` runs; bad engine flags raise ValueError here. `gpus`: the GPUs
    visible (default: asked of CUDA), which decide the defaults: on one GPU no prefill node (aggregated serving
    does best there), CUDA IPC between GPU nodes, and nodes sharing a GPU each a share of its memory."""
    gpus = visible_gpus(a.device) if gpus is None else gpus
    prefill = a.prefill_workers if a.prefill_workers is not None else 0 if gpus == 1 else 1
    cuda_ipc = a.cuda_ipc if a.cuda_ipc is not None else gpus > 0
    common = tuple(engine_flags(a)) + shared_gpu_flags(a, prefill + a.decode_workers, a.node_gpus, gpus)
    prefill_args = role_engine_flags(a.prefill_engine_args, "--prefill-engine-args", common,
                                     PREFILL_MAX_NUM_BATCHED_TOKENS)
    decode_args = role_engine_flags(a.decode_engine_args, "--decode-engine-args", common)
    return Cluster(a.model, prefill_workers=prefill, decode_workers=a.decode_workers, port=a.port,
                   http_port=a.http_port, host=a.host, local_prefill_threshold=a.local_prefill_threshold,
                   engine_args=common, node_args=("--cuda-ipc",) if cuda_ipc else (),
                   prefill_args=prefill_args, decode_args=decode_args,
                   log_dir=a.log_dir, node_gpus=a.node_gpus, drain_timeout_s=a.drain_timeout_s,
                   router_args=(("--api-keys-file", a.api_keys_file) if a.api_keys_file else ())
                   + (("--prefill-queue-limit-tokens", str(a.prefill_queue_limit_tokens))
                      if a.prefill_queue_limit_tokens else ()) + router_flags(a.router_args))


def metrics_port_of(a: argparse.Namespace, cluster: Cluster) -> int:
    """--metrics-port, else the router's port + 2000 (among the ports `free_port_block` checks; no node's)."""
    port = a.metrics_port if a.metrics_port is not None else cluster.port + NODE_HTTP_OFFSET
    taken = {cluster.port, cluster.http_port, *(p + off for p in cluster.node_ports for off in (0, 1000, 2000))}
    if port in taken:
        raise ValueError(f"--metrics-port: expected a port no process of the cluster uses, got {port}")
    return port


def run(a: argparse.Namespace) -> int:
    from baton.serving.ops_http import HttpServer, metrics_route

    cluster = cluster_from_args(a)
    metrics_port = metrics_port_of(a, cluster)
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        if stop.is_set():
            cluster.hurry()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    print(f"baton up: {len(cluster.prefill_addrs)} prefill and {len(cluster.decode_addrs)} decode nodes"
          + (" (aggregated: decode nodes prefill)" if not cluster.prefill_addrs else "")
          + (", caches moved through CUDA IPC" if "--cuda-ipc" in cluster.node_args else "")
          + (f", engine flags {' '.join(cluster.engine_args)}" if cluster.engine_args else "")
          + "; starting", flush=True)
    http = None
    try:
        cluster.start()
        supervisor = Supervisor(cluster)
        http = HttpServer({"/metrics": metrics_route(supervisor.registry)}, cluster.host, metrics_port,
                          name="baton-up-http")
        print(f"baton up: router on {cluster.router_addr} (metrics {cluster.router_http_url}/metrics); "
              f"prefill {cluster.prefill_addrs}; decode {cluster.decode_addrs}; restarts at "
              f"http://{cluster.host}:{http.port}/metrics. Ctrl-C stops.", flush=True)
        while not stop.wait(0.5):
            supervisor.tick()
    finally:
        print(f"baton up: draining (router, then nodes; up to {cluster.drain_timeout_s:g} s each)", flush=True)
        cluster.stop()
        if http is not None:
            http.close()
        print("baton up: stopped", flush=True)
    return 0
