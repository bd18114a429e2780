"""`baton ray up` on a two-node local Ray cluster (CPU only, both nodes on this machine): the router and the
nodes run as Ray actors spread over both Ray nodes, the router finds the workers through Ray, a long prompt
is served disaggregated with the offline engine's greedy tokens, and Ctrl-C tears everything down.
Also: `RayDiscovery` against a fake lookup, and its flags."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from baton.router.config import RouterConfig
from baton.router.discovery import (
    RayDiscovery,
    StaticDiscovery,
    UnionDiscovery,
    add_discovery_args,
    discovery_for,
    discovery_from_args,
)
from baton.router.policy import Role

ENGINE = {"block_size": 8, "max_num_batched_tokens": 32, "max_num_seqs": 4, "num_kv_blocks": 128}
ENGINE_ARGS = [x for k, v in ENGINE.items() for x in ("--" + k.replace("_", "-"), str(v))]
THRESHOLD, MAX_TOKENS = 4, 8


def test_ray_discovery_lists_the_ready_actors_of_its_role():
    calls = []

    def lookup(namespace, prefix, timeout_s):
        calls.append((namespace, prefix))
        return [(f"{prefix}0", "10.0.0.1:5000"), (f"{prefix}1", None)]  # the second is still starting

    d = RayDiscovery("ns", Role.DECODE, 0.5, lookup=lookup)
    assert asyncio.run(d.addresses()) == frozenset({"10.0.0.1:5000"})
    assert calls == [("ns", "decode-")] and d.refresh_s == 0.5 and "ns/decode-*" in d.describe()

    p = argparse.ArgumentParser()
    add_discovery_args(p)
    c = RouterConfig(**discovery_from_args(p.parse_args(["--ray-namespace", "ns", "--ray-refresh-s", "3"])))
    assert (c.ray_namespace, c.ray_address, c.ray_refresh_s, c.decode_addrs) == ("ns", None, 3.0, ())
    d = discovery_for(c, Role.PREFILL, ray_lookup=lookup)
    assert isinstance(d, RayDiscovery) and d.prefix == "prefill-"
    u = discovery_for(RouterConfig(decode_addrs=("h:1",), ray_namespace="ns"), Role.DECODE, ray_lookup=lookup)
    assert isinstance(u, UnionDiscovery) and isinstance(u.parts[0], StaticDiscovery)
    assert asyncio.run(u.addresses()) == frozenset({"h:1", "10.0.0.1:5000"})
    with pytest.raises(ValueError, match="ray_namespace"):
        RouterConfig(decode_addrs=("h:1",), ray_namespace="")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (not yet reaped by its dead parent) is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_processes_under(path: str) -> None:
    """SIGKILL every process whose command line names `path`, and their descendants (Ray's agents rename
    themselves)."""
    parents: dict[int, int] = {}
    named: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if path.encode() in f.read():
                    named.add(int(entry))
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    doomed, grew = set(named), True
    while grew:
        kids = {pid for pid, ppid in parents.items() if ppid in doomed} - doomed
        doomed |= kids
        grew = bool(kids)
    for pid in doomed - {os.getpid()}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _start_cluster(cluster_cls, monkeypatch, attempts: int = 3):
    """A local Ray cluster of two nodes, in a Ray temp dir of our own (sessions, the current-cluster file) that
    `baton ray up` inherits; short, since Unix socket paths live under it. Ray gives its raylet a fixed 30 s to
    register on start, and its GCS server as long to write its port file, which a loaded 2-core machine can miss:
    such a start is torn down and tried again, and the last one's raylet and GCS logs come with the failure."""
    for attempt in range(1, attempts + 1):
        temp = tempfile.mkdtemp(prefix="bray", dir="/tmp")
        monkeypatch.setenv("RAY_TMPDIR", temp)
        cluster = None
        try:
            # Both Ray nodes on this machine's IP (Ray turns a loopback --address into it anyway).
            cluster = cluster_cls(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
            cluster.add_node(num_cpus=2)
            cluster.wait_for_nodes()
            return temp, cluster
        except Exception as e:
            if not any(m in str(e) for m in ("timed out during startup", "Timed out waiting for file")):
                raise
            if cluster is not None:
                with contextlib.suppress(Exception):
                    cluster.shutdown()
            _kill_processes_under(temp)
            logs = ""
            for name in ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err"):
                for f in sorted(glob.glob(f"{temp}/ray/session_*/logs/{name}")):
                    with open(f, errors="replace") as fh:
                        logs += f"--- {name} (tail)\n" + "".join(fh.readlines()[-15:])
            shutil.rmtree(temp, ignore_errors=True)
            print(f"Ray cluster start {attempt}/{attempts} timed out; {'trying again' if attempt < attempts else 'giving up'}")
            if attempt == attempts:
                raise AssertionError(f"Ray's local cluster did not start in {attempts} attempts:\n{logs}") from e
    raise AssertionError("unreachable")


def test_baton_ray_up_two_nodes_end_to_end(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from baton.client import Client
    from baton.engine.engine_config import EngineConfig
    from baton.engine.llm_engine import LLMEngine
    from baton.engine.make_model import make_model
    from baton.engine.sampling_params import SamplingParams

    t0 = time.monotonic()
    model = tmp_path / "tiny"
    make_model(model, preset="tiny", seed=31, progress=False)
    prompt = [(11 * i + 5) % 500 + 3 for i in range(40)]  # > THRESHOLD: prefill node + KV transfer
    ref = LLMEngine.from_pretrained(str(model), EngineConfig(**ENGINE)).generate(
        [prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids

    temp, cluster = _start_cluster(Cluster, monkeypatch)
    proc = None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "baton.cli.main", "ray", "up", "--address", cluster.address,
             "--model", str(model), "--prefill-workers", "1", "--decode-workers", "1", "--port", "0",
             "--local-prefill-threshold", str(THRESHOLD), *ENGINE_ARGS,
             "--prefill-engine-args", "--max-num-batched-tokens 48"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        placement, lines = None, []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.match(r"baton ray up: placement (.*)$", line):
                placement = json.loads(m.group(1))
            if "Ctrl-C stops" in line:
                break
        assert placement is not None, "".join(lines[-60:])
        assert set(placement) == {"router", "prefill-0", "decode-0"}
        # SPREAD over two Ray nodes with room for everything: the three actors use both.
        assert len({p["node_id"] for p in placement.values()}) == 2, placement
        router = placement["router"]["addr"]

        with Client(router) as c:
            out = c.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert list(out.token_ids) == list(ref)
        http = f"http://{placement['router']['ip']}:{placement['router']['http_port']}"
        metrics = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
        assert 'baton_router_routing_decisions_total{decision="disaggregated"} 1.0' in metrics
        # --prefill-engine-args reached the prefill node only (its Info, as the router lists it).
        workers = json.loads(urllib.request.urlopen(f"{http}/v1/workers", timeout=10).read())
        assert {w["role"]: w["max_num_batched_tokens"] for w in workers} == {"prefill": 48, "decode": 32}

        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, rest[-3000:]
        assert "baton ray up: stopped" in rest
        deadline = time.monotonic() + 20
        while any(_alive(p["pid"]) for p in placement.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p["pid"]) for p in placement.values())
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    print(f"baton ray up end to end: {time.monotonic() - t0:.1f} s")


def test_a_server_whose_picked_port_was_taken_is_started_again_on_new_ports(tmp_path, monkeypatch, capfd):
    # `baton ray up` picks ports free, then the server binds them: another process (a UCX listener of a node
    # starting beside it) can take one in between. The router then exits with CANNOT_LISTEN_EXIT, and its
    # actor starts it again on newly picked ports. No Ray needed: the actor's spawning runs as is.
    import socket

    from baton.cli import ray_cmd
    from baton.router.server import main as router_main
    from baton.serving.listen_error import CANNOT_LISTEN_EXIT, CannotListen

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        # Alone: one line and the exit code, no traceback.
        r = subprocess.run([sys.executable, "-m", "baton.router.server", "--host", "127.0.0.1", "--port", str(port),
                            "--decode", "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
        assert r.returncode == CANNOT_LISTEN_EXIT and "cannot listen on 127.0.0.1:" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        with pytest.raises(CannotListen):
            router_main(["--host", "127.0.0.1", "--port", str(port), "--decode", "127.0.0.1:1"])

        picks = iter([port])  # the first pick is the taken port, later ones are free
        real = ray_cmd.free_port
        monkeypatch.setattr(ray_cmd, "free_port", lambda host: next(picks, None) or real(host))
        actor = ray_cmd.ServerActor("router")
        try:
            addr = actor._spawn_until_listening("127.0.0.1", "router", ["--decode", "127.0.0.1:1"], 0, 0, None)
            assert addr.startswith("127.0.0.1:") and addr != f"127.0.0.1:{port}"
            assert actor.returncode() is None
            assert "taken before the server bound it; starting it again on new ports (1/2)" in capfd.readouterr().err
        finally:
            actor.stop()

        # A port given by the user is not retried: its failure is reported at once.
        actor = ray_cmd.ServerActor("router")
        with pytest.raises(ray_cmd.ServerExited) as e:
            actor._spawn_until_listening("127.0.0.1", "router", ["--decode", "127.0.0.1:1"], port, port + 1, None)
        assert e.value.returncode == CANNOT_LISTEN_EXIT
    finally:
        taken.close()


def test_an_actor_gives_its_cluster_secret_to_its_server_through_the_environment_only(tmp_path):
    # The secret a launcher hands the actor, not this process's: the node must take calls with its token only.
    import grpc

    from baton.cli import ray_cmd
    from baton.engine.make_model import make_model
    from baton.proto.auth import CLUSTER_SECRET_ENV, ClusterCredential
    from baton.proto.v1 import worker_pb2 as wk
    from baton.proto.v1 import worker_pb2_grpc as wk_grpc

    model = make_model(tmp_path / "tiny", preset="tiny", seed=31, progress=False)
    credential = ClusterCredential.generate()
    assert os.environ.get(CLUSTER_SECRET_ENV) != credential.encoded()
    actor = ray_cmd.ServerActor("decode-0", credential.encoded())
    try:
        # It returns once the node answers Load, which takes the actor's token.
        addr = actor._spawn_until_listening("127.0.0.1", "decode", ["--model", str(model), *ENGINE_ARGS], 0, 0, None)
        pid = actor.proc.pid
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        assert env[CLUSTER_SECRET_ENV.encode()] == credential.encoded().encode()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert credential.encoded().encode() not in f.read()
        with grpc.insecure_channel(addr) as ch:
            stub = wk_grpc.WorkerStub(ch)
            assert stub.Load(wk.LoadRequest(), timeout=10, metadata=credential.grpc_metadata()).role == "decode"
            other = ClusterCredential.from_sources()
            with pytest.raises(grpc.RpcError) as refused:
                stub.Load(wk.LoadRequest(), timeout=10, metadata=other.grpc_metadata())
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        assert actor.stop() == 0
