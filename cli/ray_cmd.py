"""`baton ray up`: router, prefill and decode nodes as Ray actors on a Ray cluster, until Ctrl-C.

Each actor (`ServerActor`, named `router`, `prefill-<i>` or `decode-<i>` in one namespace) runs the real
server (`python -m baton.<role>_node.server` / `baton.router.server`) as a child process bound to its Ray
node's IP, on ports it picks free there, and reports `HOST:PORT` back. Nodes ask for one GPU each when the
cluster has GPUs (and then run with `--device cuda` unless --device says otherwise), else one CPU; every
actor is placed with SPREAD scheduling. The router finds the workers through Ray (`--ray-namespace`,
router/discovery.py `RayDiscovery`), so actors added to the namespace later join its pools.

Trust: the launcher takes the cluster secret from its own BATON_CLUSTER_SECRET or generates one, and hands it to
each actor's constructor; the actor gives it to its server process through the environment (never on a command
line). On SIGINT/SIGTERM the router drains first, then the nodes (`--drain-timeout-s` each).

The model directory must be readable at the same path on every Ray node (a shared filesystem). The actors
belong to this command (not detached): when it ends, Ctrl-C or not, Ray kills them, and each child process
ends with its actor (a watchdog in the child notices that its parent is gone).

This module imports neither torch nor ray at the top: Ray workers import it to build the actor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 300.0
STOP_GRACE_S = 15.0
DRAIN_TIMEOUT_S = 60.0
ROUTER_NAME = "router"
LISTEN_ATTEMPTS = 3  # starts of one server whose picked-free port was taken meanwhile


def register(sub: argparse._SubParsersAction) -> None:
    from baton.cli.up_cmd import add_role_engine_args
    from baton.node.engine_args import add_engine_args

    p = sub.add_parser("ray", help="run Baton on a Ray cluster")
    rsub = p.add_subparsers(dest="ray_command", required=True)
    up = rsub.add_parser("up", help="start router, prefill and decode nodes as Ray actors until Ctrl-C",
                         description="The model directory must exist at the same path on every Ray node.")
    up.add_argument("--address", default="auto", help="the Ray cluster (ray://, HOST:PORT or auto)")
    up.add_argument("--namespace", default=None,
                    help="Ray namespace of the actors (default: a fresh baton-<id>; must not be in use)")
    up.add_argument("--model", required=True, help="model directory, at this path on every Ray node")
    up.add_argument("--prefill-workers", type=int, default=1)
    up.add_argument("--decode-workers", type=int, default=1)
    up.add_argument("--port", type=int, default=50051,
                    help="router gRPC port on its Ray node (0: any free port); nodes pick free ports")
    up.add_argument("--http-port", type=int, default=None,
                    help="router HTTP port (/metrics, /health, /v1/workers; default P+1, any free with P=0)")
    up.add_argument("--local-prefill-threshold", type=int, default=0,
                    help="prompts of at most this many tokens (and always 1) are prefilled on the decode node")
    up.add_argument("--prefill-queue-limit-tokens", type=int, default=0,
                    help="while every prefill worker has more than this many prompt tokens queued, prefill new "
                         "requests on their decode node (0: off)")
    up.add_argument("--gpus-per-node", type=float, default=None,
                    help="GPUs each prefill/decode actor asks for per tensor-parallel rank (default: 1 if the "
                         "cluster has GPUs, else 0)")
    up.add_argument("--cpus-per-node", type=float, default=1.0, help="CPUs each prefill/decode actor asks for")
    up.add_argument("--drain-timeout-s", type=float, default=DRAIN_TIMEOUT_S,
                    help="on Ctrl-C/SIGTERM the router, then the nodes, stop taking requests and give those in flight "
                         "this long to finish")
    up.add_argument("--log-dir", default=None,
                    help="each server writes DIR/<name>.log on its Ray node (default: Ray's worker logs, "
                         "which Ray also forwards to this terminal)")
    add_engine_args(up)
    add_role_engine_args(up)
    up.set_defaults(run=run)


# ---- inside the actor ---------------------------------------------------------------------------------
def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join_host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class ServerExited(RuntimeError):
    """A server process exited before it answered."""

    def __init__(self, name: str, returncode: int) -> None:
        super().__init__(f"{name}: server exited with {returncode} during start")
        self.returncode = returncode


class ServerActor:
    """Runs one Baton server process on its Ray node. Decorated with `ray.remote` by `actor_class()`;
    called concurrently (max_concurrency > 1) so that `address()` answers while `start()` waits."""

    def __init__(self, name: str, cluster_secret: str | None = None) -> None:
        """`cluster_secret`: the cluster's (encoded) secret, put in the server's environment (default: this
        process's BATON_CLUSTER_SECRET, inherited)."""
        self.name = name
        self.cluster_secret = cluster_secret
        self.proc: subprocess.Popen | None = None
        self.addr: str | None = None
        self.http_port: int | None = None

    def start(self, role: str, args: list[str], log_dir: str | None = None, port: int = 0,
              http_port: int | None = None) -> dict[str, Any]:
        """Starts the server of `role` ('prefill', 'decode' or 'router'; `args` are its flags less host and
        ports, with `{gcs}` replaced by the cluster's GCS address) on this Ray node's IP and returns once it
        answers gRPC. Ports left at 0 (HTTP: None) are picked free here; HTTP defaults to `port` + 1 when
        `port` is given."""
        import ray

        ip = ray.util.get_node_ip_address()
        ctx = ray.get_runtime_context()
        args = [a.replace("{gcs}", ctx.gcs_address) for a in args]
        http_port = http_port if http_port is not None else (port + 1 if port else 0)
        out: Any = None  # inherit: Ray's worker log, forwarded to the driver
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            out = open(Path(log_dir) / f"{self.name}.log", "w")  # noqa: SIM115 (lives as long as the process)
        addr = self._spawn_until_listening(ip, role, args, port, http_port, out)
        self.addr = addr
        assert self.proc is not None
        return {"name": self.name, "addr": addr, "http_port": self.http_port, "node_id": ctx.get_node_id(),
                "ip": ip, "pid": self.proc.pid}

    def _spawn_until_listening(self, ip: str, role: str, args: list[str], port: int, http_port: int,
                               out: Any) -> str:
        """Starts the server and waits until it answers. A port picked free here can be taken by another
        process (e.g. a UCX listener of a node starting beside it) before the server binds it; the server
        then exits with `CANNOT_LISTEN_EXIT` and is started again on newly picked ports."""
        from baton.serving.listen_error import CANNOT_LISTEN_EXIT

        module = "baton.router.server" if role == "router" else f"baton.{role}_node.server"
        from baton.proto.auth import CLUSTER_SECRET_ENV

        env = {k: v for k, v in os.environ.items() if k not in ("RAY_JOB_ID", "RAY_ADDRESS")}
        if self.cluster_secret is not None:
            env[CLUSTER_SECRET_ENV] = self.cluster_secret
        picks_ports = not port or not http_port or role == "prefill"
        attempt = 0
        while True:
            attempt += 1
            gport = port or free_port(ip)
            self.http_port = http_port or free_port(ip)
            flags = ["--host", ip, "--port", str(gport), "--http-port", str(self.http_port)]
            if role == "prefill":
                flags += ["--side-channel-port", str(free_port(ip))]
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "baton.cli.ray_cmd", "--parent-pid", str(os.getpid()), module, *flags,
                 *args], stdout=out, stderr=subprocess.STDOUT if out is not None else None, env=env)
            addr = join_host_port(ip, gport)
            try:
                self._wait_ready(addr, role, env)
                return addr
            except ServerExited as e:
                if e.returncode != CANNOT_LISTEN_EXIT or not picks_ports or attempt == LISTEN_ATTEMPTS:
                    raise
                print(f"{self.name}: a port picked free was taken before the server bound it; starting it again "
                      f"on new ports ({attempt}/{LISTEN_ATTEMPTS - 1})", file=sys.stderr, flush=True)

    def _wait_ready(self, addr: str, role: str, env: dict[str, str]) -> None:
        import grpc

        from baton.proto.auth import ClusterCredential
        from baton.proto.v1 import generation_pb2 as gen
        from baton.proto.v1 import generation_pb2_grpc as gen_grpc
        from baton.proto.v1 import worker_pb2 as wk
        from baton.proto.v1 import worker_pb2_grpc as wk_grpc

        credential = ClusterCredential.from_sources(environ=env)
        metadata = credential.grpc_metadata() if credential is not None else ()
        deadline = time.monotonic() + READY_TIMEOUT_S
        with grpc.insecure_channel(addr) as ch:
            # Nodes are ready once they answer Load; the router once it answers Health at all (it reports
            # ok only after discovering its workers, which the launcher waits for).
            call = (lambda: gen_grpc.GenerationStub(ch).Health(gen.HealthRequest(), timeout=1.0)) \
                if role == "router" else (lambda: wk_grpc.WorkerStub(ch).Load(wk.LoadRequest(), timeout=1.0,
                                                                   metadata=metadata))
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise ServerExited(self.name, self.proc.returncode)
                try:
                    call()
                    return
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise TimeoutError(f"{self.name}: {addr} not ready after {READY_TIMEOUT_S} s") from None
                    time.sleep(0.2)

    def address(self) -> str | None:
        """The server's gRPC 'HOST:PORT' once it answers (and while it runs), else None."""
        return self.addr if self.proc is not None and self.proc.poll() is None else None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM the server (it drains for its grace period), SIGKILL it after `grace_s`."""
        self.addr = None
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def actor_class() -> Any:
    import ray

    return ray.remote(max_concurrency=4)(ServerActor)


# ---- the launcher -------------------------------------------------------------------------------------
def _router_sees_all(addr: str, prefill: int, decode: int, timeout_s: float) -> bool:
    """Does the router report every worker healthy? (Its Health turns ok with one decode worker; a request
    sent before the prefill workers are found would be prefilled locally.)"""
    import grpc

    from baton.proto.v1 import generation_pb2 as gen
    from baton.proto.v1 import generation_pb2_grpc as gen_grpc

    with grpc.insecure_channel(addr) as ch:
        try:
            h = gen_grpc.GenerationStub(ch).Health(gen.HealthRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return h.ok and h.prefill_workers >= prefill and h.decode_workers >= decode


class RayCluster:
    """The actors of one `baton ray up`; `start()` then `stop()` (or a `with` block)."""

    def __init__(self, model: str, prefill_workers: int = 1, decode_workers: int = 1, *, port: int = 0,
                 http_port: int | None = None, namespace: str | None = None,
                 local_prefill_threshold: int = 0, engine_args: tuple[str, ...] = (),
                 gpus_per_node: float | None = None, cpus_per_node: float = 1.0,
                 log_dir: str | None = None, prefill_queue_limit_tokens: int = 0,
                 prefill_engine_args: tuple[str, ...] = (), decode_engine_args: tuple[str, ...] = (),
                 drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        from baton.proto.auth import ClusterCredential

        if decode_workers < 1:
            raise ValueError(f"decode_workers: expected at least 1, got {decode_workers}")
        if prefill_workers < 0:
            raise ValueError(f"prefill_workers: expected >= 0, got {prefill_workers}")
        self.model, self.prefill_workers, self.decode_workers = model, prefill_workers, decode_workers
        self.port, self.http_port = port, http_port
        self.namespace = namespace or f"baton-{uuid.uuid4().hex[:8]}"
        self.local_prefill_threshold = local_prefill_threshold
        self.prefill_queue_limit_tokens = prefill_queue_limit_tokens
        self.engine_args = tuple(engine_args)
        # Each role's own engine flags, after engine_args (a later flag wins).
        self.role_engine_args = {"prefill": tuple(prefill_engine_args), "decode": tuple(decode_engine_args)}
        self.gpus_per_node, self.cpus_per_node = gpus_per_node, cpus_per_node
        self.log_dir = log_dir
        if not drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s: expected seconds >= 0, got {drain_timeout_s}")
        self.drain_timeout_s = drain_timeout_s
        self.credential = ClusterCredential.from_sources() or ClusterCredential.generate()
        self.actors: dict[str, Any] = {}
        self.info: dict[str, dict[str, Any]] = {}

    @property
    def router_addr(self) -> str:
        return self.info[ROUTER_NAME]["addr"]

    @property
    def router_http_url(self) -> str:
        r = self.info[ROUTER_NAME]
        return f"http://{join_host_port(r['ip'], r['http_port'])}"

    def addrs(self, role: str) -> list[str]:
        return [i["addr"] for n, i in sorted(self.info.items()) if n.startswith(f"{role}-")]

    def role_ranks(self, role: str) -> int:
        """Tensor-parallel ranks of the role's nodes: each actor asks for that many times `gpus_per_node`."""
        from baton.node.engine_args import flags_ranks

        return flags_ranks((*self.engine_args, *self.role_engine_args[role]))

    def start(self, ready_timeout_s: float = READY_TIMEOUT_S) -> RayCluster:
        import ray

        if ray.util.list_named_actors(all_namespaces=False):
            raise ValueError(f"namespace: {self.namespace!r} already has named actors (another baton ray up?)")
        gpus = self.gpus_per_node
        if gpus is None:
            gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
        engine_args = list(self.engine_args)
        if gpus > 0 and "--device" not in engine_args:
            engine_args += ["--device", "cuda"]
        actor = actor_class()
        drain = ["--drain-timeout-s", str(self.drain_timeout_s)]
        try:
            starts = {}
            for role, n in (("prefill", self.prefill_workers), ("decode", self.decode_workers)):
                for i in range(n):
                    name = f"{role}-{i}"
                    self.actors[name] = actor.options(
                        name=name, namespace=self.namespace, scheduling_strategy="SPREAD",
                        num_gpus=gpus * self.role_ranks(role),
                        num_cpus=self.cpus_per_node).remote(name, self.credential.encoded())
                    starts[name] = self.actors[name].start.remote(
                        role, ["--model", self.model, "--engine-id", name, *engine_args,
                               *self.role_engine_args[role], *drain], self.log_dir)
            router_args = ["--ray-namespace", self.namespace, "--ray-address", "{gcs}",
                           "--local-prefill-threshold", str(self.local_prefill_threshold),
                           "--prefill-queue-limit-tokens", str(self.prefill_queue_limit_tokens), *drain]
            if (Path(self.model) / "tokenizer.json").exists():
                router_args += ["--tokenizer", self.model]
            self.actors[ROUTER_NAME] = actor.options(
                name=ROUTER_NAME, namespace=self.namespace, scheduling_strategy="SPREAD",
                num_cpus=1).remote(ROUTER_NAME, self.credential.encoded())
            starts[ROUTER_NAME] = self.actors[ROUTER_NAME].start.remote(
                "router", router_args, self.log_dir, self.port, self.http_port)
            for name, ref in starts.items():
                self.info[name] = ray.get(ref, timeout=ready_timeout_s)
            deadline = time.monotonic() + ready_timeout_s
            while not _router_sees_all(self.router_addr, self.prefill_workers, self.decode_workers, 2.0):
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"router {self.router_addr} did not find all {self.prefill_workers} prefill "
                                       f"and {self.decode_workers} decode workers in {ready_timeout_s} s")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return self

    def check_alive(self) -> None:
        """Raises RuntimeError when a server process or an actor is gone."""
        import ray

        names = list(self.actors)
        try:
            codes = ray.get([self.actors[n].returncode.remote() for n in names], timeout=30)
        except ray.exceptions.RayError as e:
            raise RuntimeError(f"an actor died: {e}") from e
        dead = {n: c for n, c in zip(names, codes, strict=True) if c is not None}
        if dead:
            raise RuntimeError(f"server processes exited: {dead}")

    def stop(self) -> None:
        """Router first (it stops taking requests and drains), then the nodes; then the actors themselves."""
        import ray

        grace = self.drain_timeout_s + STOP_GRACE_S
        order = sorted(self.actors, key=lambda n: n != ROUTER_NAME)
        for group in ([n for n in order if n == ROUTER_NAME], [n for n in order if n != ROUTER_NAME]):
            refs = [self.actors[n].stop.remote(grace) for n in group]
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(refs, timeout=grace + 10)
        for name in order:
            with contextlib.suppress(Exception):
                ray.kill(self.actors[name])
        self.actors.clear()

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def run(a: argparse.Namespace) -> int:
    from baton.engine.engine_config import PREFILL_MAX_NUM_BATCHED_TOKENS
    from baton.node.engine_args import engine_flags, role_engine_flags

    try:
        import ray
    except ImportError:
        raise ValueError("ray is not installed: pip install 'baton-serve[ray]'") from None
    common = tuple(engine_flags(a))
    prefill_args = role_engine_flags(a.prefill_engine_args, "--prefill-engine-args", common,
                                     PREFILL_MAX_NUM_BATCHED_TOKENS)
    decode_args = role_engine_flags(a.decode_engine_args, "--decode-engine-args", common)
    cluster = RayCluster(str(Path(a.model).resolve()), a.prefill_workers, a.decode_workers, port=a.port,
                         http_port=a.http_port, namespace=a.namespace, local_prefill_threshold=a.local_prefill_threshold,
                         engine_args=common, gpus_per_node=a.gpus_per_node,
                         cpus_per_node=a.cpus_per_node, log_dir=a.log_dir,
                         prefill_queue_limit_tokens=a.prefill_queue_limit_tokens,
                         prefill_engine_args=prefill_args, decode_engine_args=decode_args,
                         drain_timeout_s=a.drain_timeout_s)
    ray.init(address=a.address, namespace=cluster.namespace, logging_level="WARNING")
    # After ray.init, which installs a SIGTERM handler of its own.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        try:
            cluster.start()
        except (RuntimeError, TimeoutError, ray.exceptions.RayError) as e:
            print(f"baton ray up: start failed: {e}", file=sys.stderr, flush=True)
            return 1
        nodes = {i["node_id"] for i in cluster.info.values()}
        print(f"baton ray up: placement {json.dumps(cluster.info, sort_keys=True)}", flush=True)
        print(f"baton ray up: router on {cluster.router_addr} (metrics {cluster.router_http_url}/metrics); "
              f"prefill {cluster.addrs('prefill')}; decode {cluster.addrs('decode')}; namespace "
              f"{cluster.namespace}; {len(nodes)} Ray node(s). Ctrl-C stops.", flush=True)
        while not stop.wait(1.0):
            try:
                cluster.check_alive()
            except RuntimeError as e:
                print(f"baton ray up: {e}; shutting down", flush=True)
                return 1
    finally:
        cluster.stop()
        ray.shutdown()
        print("baton ray up: stopped", flush=True)
    return 0


# ---- the child process: `python -m baton.cli.ray_cmd --parent-pid PID MODULE ARGS...` -------------------
def _child_main(argv: list[str]) -> None:
    """Runs MODULE as __main__ with ARGS, and SIGTERMs itself (then exits) when process PID (its actor) is
    gone: actors killed by Ray must not leave servers behind."""
    import runpy

    if len(argv) < 3 or argv[0] != "--parent-pid":
        sys.exit("usage: python -m baton.cli.ray_cmd --parent-pid PID MODULE [ARGS...]")
    parent, module, args = int(argv[1]), argv[2], argv[3:]

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(STOP_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="baton-parent-watch", daemon=True).start()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
