"""`baton up` as a supervisor, as a user runs it: it gives every process one cluster secret (generated when its own
environment has none) through the environment only, starts a killed node or router again (logged, counted on its
/metrics) while the rest keeps serving, and on SIGTERM drains the streams in flight and exits 0. The restart backoff
itself is checked against a clock the test moves."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from baton.cli.cluster import Cluster, free_port_block
from baton.cli.supervisor import RestartPolicy, Supervisor
from baton.engine.make_model import make_model
from baton.proto.auth import CLUSTER_SECRET_ENV, ClusterCredential
from baton.proto.v1 import generation_pb2 as gen
from baton.proto.v1 import generation_pb2_grpc as gen_grpc
from baton.proto.v1 import worker_pb2 as wk
from baton.proto.v1 import worker_pb2_grpc as wk_grpc
from tests.live_streams import Streams


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("up") / "tiny"
    make_model(out, preset="tiny", seed=5, progress=False, overrides={"vocab_size": 64})
    return str(out)


class Lines:
    """A process's output, line by line, read on a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.seen: list[str] = []
        self._q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self._q.put(line)

    def wait_for(self, needle: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.seen.append(line)
            if needle in line:
                return line
        raise AssertionError(f"no line with {needle!r}; got:\n{''.join(self.seen)}")


def children(pid: int) -> dict[str, int]:
    """The processes `baton up` started, by name (router, prefill-0, ...)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            args = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != pid:
            continue
        if b"baton.router.server" in args:
            out["router"] = int(d.name)
        elif b"--engine-id" in args:
            out[args[args.index(b"--engine-id") + 1].decode()] = int(d.name)
    return out


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.decode().split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def router_health(addr: str) -> gen.HealthResponse | None:
    with grpc.insecure_channel(addr) as ch:
        try:
            return gen_grpc.GenerationStub(ch).Health(gen.HealthRequest(), timeout=2)
        except grpc.RpcError:
            return None


def wait_all_healthy(addr: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = router_health(addr)
        if h is not None and h.ok and h.prefill_workers == 1 and h.decode_workers == 1:
            return
        time.sleep(0.2)
    raise AssertionError(f"router {addr} did not see every worker healthy")


def generate(addr: str) -> int:
    req = gen.GenerateRequest(token_ids=gen.TokenIds(ids=[3, 4, 5, 6, 7, 8]),
                              sampling=gen.SamplingParams(max_tokens=4, ignore_eos=True))
    with grpc.insecure_channel(addr) as ch:
        return sum(len(m.token_ids) for m in gen_grpc.GenerationStub(ch).Generate(req, timeout=60))


def restarts(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("baton_up_process_restarts_total{"):
            name = line.split('process="', 1)[1].split('"', 1)[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def test_baton_up_shares_one_secret_restarts_what_dies_and_drains_on_sigterm(model, tmp_path):
    port = free_port_block(4)
    env = {k: v for k, v in os.environ.items() if k != CLUSTER_SECRET_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "baton.cli.main", "up", "--model", model, "--port", str(port),
                             "--num-kv-blocks", "256", "--drain-timeout-s", "30", "--log-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = Lines(proc)
    router = f"127.0.0.1:{port}"
    try:
        out.wait_for("Ctrl-C stops")
        kids = children(proc.pid)
        assert set(kids) == {"router", "prefill-0", "decode-0"}
        # One secret, generated by baton up, in every child's environment and on no command line.
        secrets = {environ(pid).get(CLUSTER_SECRET_ENV) for pid in kids.values()}
        assert len(secrets) == 1 and None not in secrets
        secret = secrets.pop()
        credential = ClusterCredential.parse(secret)
        for pid in kids.values():
            assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        # The nodes take calls with its token only.
        with grpc.insecure_channel(f"127.0.0.1:{port + 2}") as ch:
            stub = wk_grpc.WorkerStub(ch)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Load(wk.LoadRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.Load(wk.LoadRequest(), timeout=5, metadata=credential.grpc_metadata()).role == "prefill"

        os.kill(kids["prefill-0"], signal.SIGKILL)
        out.wait_for("prefill-0 exited with code -9")
        # Served meanwhile (prefilled on the decode node), and the node is started again.
        assert generate(router) == 4
        out.wait_for("started prefill-0 again")
        wait_all_healthy(router)
        assert generate(router) == 4

        os.kill(children(proc.pid)["router"], signal.SIGKILL)
        out.wait_for("router exited with code -9")
        out.wait_for("started router again")
        wait_all_healthy(router)
        counts = restarts(f"http://127.0.0.1:{port + 2000}/metrics")
        assert counts == {"router": 1.0, "prefill-0": 1.0, "decode-0": 0.0}

        streams = Streams(router, 4, 300)
        assert streams.started.wait(60)
        proc.send_signal(signal.SIGTERM)
        streams.join(60)
        assert streams.all_finished(), streams.results
        out.wait_for("baton up: stopped")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # Nothing of the cluster is left behind.
    assert not children(proc.pid)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_restarts_back_off_doubling_to_a_cap_and_start_over_after_a_long_run(model, tmp_path):
    # A "node" that exits at once: the real supervisor restarts the real process.
    c = Cluster(model, prefill_workers=0, decode_workers=1, log_dir=str(tmp_path))
    c.commands["decode-0"] = ("this", [], c.process_env("decode-0"))
    c._popen("decode-0", "w")
    clock, lines = _Clock(), []
    sup = Supervisor(c, RestartPolicy(initial_s=1, max_s=4, reset_after_s=60), clock=clock, log=lines.append)
    delays = []
    for _ in range(5):
        c.procs["decode-0"].wait(30)
        sup.tick()
        (delay,) = sup.waiting().values()
        delays.append(delay)
        clock.now += delay
        sup.tick()
    assert delays == [1, 2, 4, 4, 4] and sup.counts["decode-0"] == 5
    # Up for longer than reset_after_s before it died: the backoff starts over.
    c.procs["decode-0"].wait(30)
    clock.now += 61
    sup.tick()
    assert list(sup.waiting().values()) == [1]
    assert sum("exited with code" in line for line in lines) == 6
    c.procs["decode-0"].wait(30)


def test_a_cluster_uses_the_secret_of_its_environment_and_gives_it_to_every_process(monkeypatch):
    secret = ClusterCredential.generate().encoded()
    monkeypatch.setenv(CLUSTER_SECRET_ENV, secret)
    c = Cluster("m", prefill_workers=1, decode_workers=1, port=41000)
    assert all(c.process_env(n)[CLUSTER_SECRET_ENV] == secret for n in ["router", *c.node_names])
    assert not any(secret in a for n in c.node_names for a in c.node_argv(n))
    monkeypatch.delenv(CLUSTER_SECRET_ENV)
    assert Cluster("m", port=41000).credential != Cluster("m", port=41000).credential
