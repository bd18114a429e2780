"""A local Baton cluster: router + prefill nodes + decode nodes as separate OS processes on this machine.

Used by `baton up`, `baton demo` and the end-to-end tests. Ports: router gRPC P and HTTP P+1 (`/metrics`,
`/health`, `/v1/workers`; another port with `http_port`), prefill nodes P+2.., decode nodes after them;
each node's HTTP endpoints (`/metrics`, `/health`) listen on its port + 2000 and each prefill node's side
channel on its port + 1000.

GPUs: with `node_gpus` (e.g. `(0, 1)`), node i in launch order (prefill nodes, then decode nodes) runs with
`CUDA_VISIBLE_DEVICES` = node_gpus[i % len(node_gpus)] first, then the other listed GPUs: it computes on
`cuda` (= its own GPU) while its peers' GPUs stay visible for CUDA IPC (NIXL's cuda_ipc transport). The router
and, without `node_gpus`, every process inherit this process's environment otherwise unchanged.

Trust: every process gets the cluster secret in `BATON_CLUSTER_SECRET` (never on its command line, which any user
of the host can read): this process's own if it has one, else one generated per cluster.

Stopping drains: the router first (it refuses new requests and lets those in flight finish), then the nodes
(leases held for decode nodes are pulled first); each gets its drain timeout, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from baton.node.engine_args import flags_ranks
from baton.proto.auth import CLUSTER_SECRET_ENV, ClusterCredential

# How long a node may take to load, measure its memory and capture its CUDA graphs: a large checkpoint on a fresh GPU
# host (Triton compiling every kernel first) takes minutes, and a dead process ends the wait at once anyway.
READY_TIMEOUT_S = 900.0


NODE_SIDE_CHANNEL_OFFSET = 1000
NODE_HTTP_OFFSET = 2000
# The processes' own drain timeout where `drain_timeout_s` leaves it (router and nodes take the same).
PROCESS_DRAIN_TIMEOUT_S = 60.0
# How much longer than its drain timeout a process gets after SIGTERM before SIGKILL (its own clean-up).
STOP_MARGIN_S = 10.0


def free_port_block(n: int, start: int = 20000, stop: int = 57000) -> int:
    """A base port P such that P..P+n-1, P+1000..P+1000+n-1 and P+2000..P+2000+n-1 are all free right now."""
    for base in range(start + (os.getpid() * 37) % 5000, stop, n + 3):
        ports = [p + off for off in (0, NODE_SIDE_CHANNEL_OFFSET, NODE_HTTP_OFFSET) for p in range(base, base + n)]
        if all(_is_free(p) for p in ports):
            return base
    raise RuntimeError("no free block of ports found")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Cluster:
    model: str
    prefill_workers: int = 1
    decode_workers: int = 1
    port: int | None = None
    # The router's HTTP port (default port + 1, which no node uses).
    http_port: int | None = None
    host: str = "127.0.0.1"
    local_prefill_threshold: int = 0
    engine_args: tuple[str, ...] = ()
    # Node flags of every node that are not engine flags (e.g. `--cuda-ipc`).
    node_args: tuple[str, ...] = ()
    # Extra arguments of the prefill nodes only (e.g. `--lease-seconds`).
    prefill_args: tuple[str, ...] = ()
    # Extra arguments of the decode nodes only (e.g. a smaller step budget for what they prefill themselves).
    decode_args: tuple[str, ...] = ()
    # Extra flags of the router process only (e.g. --api-keys-file).
    router_args: tuple[str, ...] = ()
    log_dir: str | None = None
    # GPU ids (as CUDA_VISIBLE_DEVICES takes them) to spread the nodes over; () = leave the environment alone.
    node_gpus: tuple[int, ...] = ()
    # --drain-timeout-s of every process (None: their default).
    drain_timeout_s: float | None = None
    # The cluster's secret (default: BATON_CLUSTER_SECRET of this process, else a new one).
    credential: ClusterCredential | None = field(default=None, repr=False)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    # How each process was started (module, arguments, environment): `respawn` starts it again alike.
    commands: dict[str, tuple[str, list[str], dict[str, str]]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.decode_workers < 1:
            raise ValueError(f"decode_workers: expected at least 1, got {self.decode_workers}")
        if self.prefill_workers < 0:
            raise ValueError(f"prefill_workers: expected >= 0, got {self.prefill_workers}")
        self.node_gpus = tuple(self.node_gpus)
        if (any(type(g) is not int or g < 0 for g in self.node_gpus)
                or len(set(self.node_gpus)) != len(self.node_gpus)):
            raise ValueError(f"node_gpus: expected distinct non-negative integer GPU ids, got {self.node_gpus}")
        if self.drain_timeout_s is not None and not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s: expected seconds >= 0, got {self.drain_timeout_s}")
        if self.credential is None:
            self.credential = ClusterCredential.from_sources() or ClusterCredential.generate()
        if self.port is None:
            self.port = free_port_block(2 + self.prefill_workers + self.decode_workers)
        if self.http_port is None:
            self.http_port = self.port + 1
        taken = {self.port, *(p + off for p in self.node_ports
                              for off in (0, NODE_SIDE_CHANNEL_OFFSET, NODE_HTTP_OFFSET))}
        if self.http_port in taken:
            raise ValueError(f"http_port: expected a port no process of the cluster uses (router {self.port}, "
                             f"nodes {self.node_ports} + 0/1000/2000), got {self.http_port}")

    @property
    def router_addr(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def router_http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def node_ports(self) -> list[int]:
        """gRPC ports of the prefill nodes, then of the decode nodes."""
        return [self.port + 2 + i for i in range(self.prefill_workers + self.decode_workers)]

    @property
    def prefill_addrs(self) -> list[str]:
        return [f"{self.host}:{p}" for p in self.node_ports[:self.prefill_workers]]

    @property
    def decode_addrs(self) -> list[str]:
        return [f"{self.host}:{p}" for p in self.node_ports[self.prefill_workers:]]

    def node_http_url(self, addr: str) -> str:
        """The HTTP endpoints of the node serving gRPC on `addr`."""
        host, _, port = addr.rpartition(":")
        return f"http://{host}:{int(port) + NODE_HTTP_OFFSET}"

    @property
    def node_names(self) -> list[str]:
        """Process names of the nodes in launch order: prefill-0.., then decode-0.."""
        return [f"prefill-{i}" for i in range(self.prefill_workers)] + \
               [f"decode-{i}" for i in range(self.decode_workers)]

    def node_ranks(self, name: str) -> int:
        """Node `name`'s tensor-parallel ranks (its command line's `flags_ranks`)."""
        return flags_ranks(self.node_argv(name))

    def node_gpu_ids(self, name: str) -> list[int]:
        """The GPUs node `name` computes on, one per rank: nodes in launch order take the next `node_gpus` each
        (cyclically, so that nodes share GPUs only once every GPU has one); [] without `node_gpus`."""
        if not self.node_gpus:
            return []
        names = self.node_names
        start = sum(self.node_ranks(n) for n in names[:names.index(name)])
        n = len(self.node_gpus)
        return list(dict.fromkeys(self.node_gpus[(start + k) % n] for k in range(self.node_ranks(name))))

    def node_gpu(self, name: str) -> int | None:
        """The GPU node `name`'s rank 0 computes on (first in its CUDA_VISIBLE_DEVICES), or None without
        `node_gpus`."""
        gpus = self.node_gpu_ids(name)
        return gpus[0] if gpus else None

    def node_env(self, name: str) -> dict[str, str] | None:
        """The environment of node `name`: this process's with CUDA_VISIBLE_DEVICES set to its GPUs first (one per
        rank, `node_gpu_ids`), then the other `node_gpus`; None (inherit unchanged) without `node_gpus`."""
        mine = self.node_gpu_ids(name)
        if not mine:
            return None
        order = [*mine, *(g for g in self.node_gpus if g not in mine)]
        return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, order))}

    def process_env(self, name: str) -> dict[str, str]:
        """The environment of process `name` (a node or "router"): this process's, the cluster secret, and a node's
        CUDA_VISIBLE_DEVICES (`node_env`)."""
        base = (self.node_env(name) if name != "router" else None) or dict(os.environ)
        assert self.credential is not None
        return {**base, CLUSTER_SECRET_ENV: self.credential.encoded()}

    def _spawn(self, name: str, module: str, args: list[str]) -> None:
        self.commands[name] = (module, args, self.process_env(name))
        self._popen(name, "w")

    def _popen(self, name: str, log_mode: str) -> None:
        module, args, env = self.commands[name]
        out = subprocess.DEVNULL
        if self.log_dir is not None:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
            out = open(Path(self.log_dir) / f"{name}.log", log_mode)  # noqa: SIM115 (lives as long as the process)
        self.procs[name] = subprocess.Popen([sys.executable, "-m", module, *args], stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def respawn(self, name: str) -> subprocess.Popen:
        """Starts process `name` again as it was first started (same ports; its log is appended to). The router
        takes a node back into rotation once it answers its Load polls; nodes need no router to come back."""
        if self.procs[name].poll() is None:
            raise ValueError(f"respawn: expected a process that has exited, got {name!r} still running")
        self._popen(name, "a")
        return self.procs[name]

    def _drain_args(self) -> list[str]:
        return [] if self.drain_timeout_s is None else ["--drain-timeout-s", str(self.drain_timeout_s)]

    def node_argv(self, name: str) -> list[str]:
        """The arguments of node `name` ("prefill-0", "decode-1", ...): the common flags, its port, then its role's
        extra flags (a later flag wins)."""
        role, i = name.rsplit("-", 1)
        addrs = {"prefill": self.prefill_addrs, "decode": self.decode_addrs}[role]
        port = int(addrs[int(i)].rsplit(":", 1)[1])
        return ["--model", str(self.model), "--host", self.host, *self.engine_args, *self.node_args,
                "--port", str(port), "--http-port", str(port + NODE_HTTP_OFFSET), "--engine-id", name,
                *self._drain_args(), *(self.prefill_args if role == "prefill" else self.decode_args)]

    def start(self, router: bool = True) -> Cluster:
        """Start the nodes, wait until they answer, then (unless router=False) the router."""
        for role, addrs in (("prefill", self.prefill_addrs), ("decode", self.decode_addrs)):
            for i in range(len(addrs)):
                name = f"{role}-{i}"
                self._spawn(name, f"baton.{role}_node.server", self.node_argv(name))
        self._wait_workers()
        if router:
            self._start_router()
        return self

    def _start_router(self) -> None:
        router = ["--host", self.host, "--port", str(self.port), "--http-port", str(self.http_port),
                  "--local-prefill-threshold", str(self.local_prefill_threshold), *self._drain_args()]
        for a in self.prefill_addrs:
            router += ["--prefill", a]
        for a in self.decode_addrs:
            router += ["--decode", a]
        if (Path(self.model) / "tokenizer.json").exists():
            router += ["--tokenizer", str(Path(self.model) / "tokenizer.json")]
        self._spawn("router", "baton.router.server", [*router, *self.router_args])
        self._wait_router()

    def _check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            self.stop()
            raise RuntimeError(f"cluster processes exited during start: {dead}"
                               + (f" (logs in {self.log_dir})" if self.log_dir else ""))

    def _wait_workers(self) -> None:
        from baton.proto.v1 import worker_pb2 as wk
        from baton.proto.v1 import worker_pb2_grpc as wk_grpc

        assert self.credential is not None
        metadata = self.credential.grpc_metadata()
        deadline = time.monotonic() + READY_TIMEOUT_S
        for addr in [*self.prefill_addrs, *self.decode_addrs]:
            with grpc.insecure_channel(addr) as ch:
                stub = wk_grpc.WorkerStub(ch)
                while True:
                    self._check_alive()
                    try:
                        stub.Load(wk.LoadRequest(), timeout=1.0, metadata=metadata)
                        break
                    except grpc.RpcError:
                        if time.monotonic() > deadline:
                            self.stop()
                            raise TimeoutError(f"worker {addr} not ready after {READY_TIMEOUT_S} s") from None
                        time.sleep(0.1)

    def _wait_router(self) -> None:
        from baton.proto.v1 import generation_pb2 as gen
        from baton.proto.v1 import generation_pb2_grpc as gen_grpc

        deadline = time.monotonic() + READY_TIMEOUT_S
        with grpc.insecure_channel(self.router_addr) as ch:
            stub = gen_grpc.GenerationStub(ch)
            while True:
                self._check_alive()
                try:
                    if stub.Health(gen.HealthRequest(), timeout=1.0).ok:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"router {self.router_addr} not healthy after {READY_TIMEOUT_S} s")
                time.sleep(0.1)

    def kill(self, name: str) -> None:
        """SIGKILL one process (failure tests)."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def stop(self, timeout: float | None = None) -> None:
        """Drains and stops everything: SIGTERM to the router, which refuses new requests and lets those in flight
        finish, then to the nodes, which finish what they still hold; each group gets `timeout` seconds (default:
        the drain timeout + `STOP_MARGIN_S`) before SIGKILL."""
        if timeout is None:
            drain = self.drain_timeout_s if self.drain_timeout_s is not None else PROCESS_DRAIN_TIMEOUT_S
            timeout = drain + STOP_MARGIN_S
        for group in ([n for n in self.procs if n == "router"], [n for n in self.procs if n != "router"]):
            for name in group:
                proc = self.procs[name]
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for name in group:
                proc = self.procs[name]
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5)

    def hurry(self) -> None:
        """SIGTERM again to every process still running: a second signal cuts a drain short."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
