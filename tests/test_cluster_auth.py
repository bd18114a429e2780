"""Every hop behind the router authenticated, and no request able to reach another's caches (issue #46): the
attacks that once worked against bare nodes, each refused now; TLS on the router -> node and node -> node hops."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from baton.cli.cluster import Cluster
from baton.client import AsyncClient
from baton.engine.llm_engine import LLMEngine
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from baton.proto.auth import CLUSTER_SECRET_ENV, ClusterCredential
from baton.proto.convert import sampling_to_proto
from baton.proto.v1 import worker_pb2 as wk
from baton.proto.v1 import worker_pb2_grpc as wk_grpc
from baton.router.cluster_client import ClusterClient
from baton.router.config import RouterConfig
from baton.router.server import start_router
from baton.transfer.errors import PeerUnauthenticated
from baton.transfer.side_channel import SideChannelClient
from tests.node_channel import node_channel
from tests.tls_certs import write_certs

ENGINE_ARGS = ("--block-size", "8", "--max-num-batched-tokens", "32", "--max-num-seqs", "8", "--num-kv-blocks", "128")
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("auth") / "tiny"
    make_model(out, preset="tiny", seed=5, progress=False)
    return str(out)


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    c = Cluster(model, prefill_workers=1, decode_workers=1, engine_args=ENGINE_ARGS,
                log_dir=str(tmp_path_factory.mktemp("logs")))
    c.start(router=False)
    yield c
    c.stop()


def calls(prefill: bool) -> list[tuple[str, object]]:
    """One call of every Worker method (what a stranger on the network tried)."""
    out = [("Info", wk.InfoRequest()), ("Load", wk.LoadRequest()), ("Abort", wk.WorkerAbortRequest(request_id="x"))]
    if prefill:
        out.append(("Prefill", wk.PrefillRequest(request_id="x", prompt_token_ids=[3, 4, 5, 6])))
    else:
        out.append(("Decode", wk.DecodeRequest(request_id="x", prompt_token_ids=[3, 4, 5],
                                               sampling=sampling_to_proto(PARAMS))))
    return out


def call(stub: wk_grpc.WorkerStub, method: str, req: object, metadata=None) -> object:
    fn = getattr(stub, method)
    if method == "Decode":
        return list(fn(req, timeout=30, metadata=metadata))
    return fn(req, timeout=30, metadata=metadata)


def decode(stub, rid, prompt, handle=None):
    req = wk.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(PARAMS))
    if handle is not None:
        req.handle.CopyFrom(handle)
    return [t for msg in stub.Decode(req, timeout=60) for t in msg.token_ids]


def test_nodes_refuse_every_call_without_the_cluster_token(cluster):
    stranger = ClusterCredential.generate().grpc_metadata()
    for addr, prefill in ((cluster.prefill_addrs[0], True), (cluster.decode_addrs[0], False)):
        with grpc.insecure_channel(addr) as ch:
            stub = wk_grpc.WorkerStub(ch)
            for method, req in calls(prefill):
                for metadata in (None, stranger):
                    with pytest.raises(grpc.RpcError) as e:
                        call(stub, method, req, metadata)
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (addr, method, e.value.details())
        with node_channel(addr) as ch:  # the cluster's own token is served
            assert wk_grpc.WorkerStub(ch).Info(wk.InfoRequest(), timeout=30).role == ("prefill" if prefill
                                                                                     else "decode")
    # The bare Prefill calls leased nothing.
    with node_channel(cluster.prefill_addrs[0]) as ch:
        load = wk_grpc.WorkerStub(ch).Load(wk.LoadRequest(), timeout=30)
    assert load.held_leases == 0 and load.free_kv_blocks == load.total_kv_blocks


def test_the_side_channel_reveals_nothing_without_the_token(cluster):
    port = int(cluster.prefill_addrs[0].rsplit(":", 1)[1]) + 1000
    for credential in (None, ClusterCredential.generate()):
        with pytest.raises(PeerUnauthenticated):
            SideChannelClient("127.0.0.1", port, credential=credential).metadata()
    meta = SideChannelClient("127.0.0.1", port, credential=ClusterCredential.from_sources()).metadata()
    assert meta.regions  # the cluster's own nodes still handshake


class Listener:
    """A TCP listener standing for an address an attacker names: counts the connections it gets."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.accepted = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sock.close()


def test_forged_transfer_handles_are_refused_before_any_connection_or_read(cluster):
    victim = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    ref = [list(o.token_ids) for o in LLMEngine.from_pretrained(cluster.model).generate([victim], PARAMS)][0]
    listener = Listener()
    try:
        with node_channel(cluster.prefill_addrs[0]) as pch, node_channel(cluster.decode_addrs[0]) as dch:
            pstub, dstub = wk_grpc.WorkerStub(pch), wk_grpc.WorkerStub(dch)
            h = pstub.Prefill(wk.PrefillRequest(request_id="victim", prompt_token_ids=victim), timeout=60).handle
            attacker = [50, 51, 52, 53, 54, 55, 56, 57, 58]

            def forged(**change) -> wk.TransferHandle:
                f = wk.TransferHandle()
                f.CopyFrom(h)
                for k, v in change.items():
                    if k == "kv_block_ids":
                        del f.kv_block_ids[:]
                        f.kv_block_ids.extend(v)
                    else:
                        setattr(f, k, v)
                return f

            attempts = {
                "another request's handle": ("thief", h),
                "the request id rewritten": ("thief", forged(request_id="thief")),
                "block ids rewritten": ("victim2", forged(request_id="victim2", kv_block_ids=[0, 1])),
                "slot rewritten": ("victim", forged(state_slot=h.state_slot + 1)),
                "an address of the attacker's choosing": (
                    "victim", forged(side_channel_host="127.0.0.1", side_channel_port=listener.sock.getsockname()[1])),
                "no signature": ("victim", forged(mac=b"")),
            }
            for what, (rid, handle) in attempts.items():
                with pytest.raises(grpc.RpcError) as e:
                    decode(dstub, rid, attacker, handle)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (what, e.value.details())
            assert listener.accepted == 0  # no connection to the named address was ever opened
            # The victim's own request is untouched: its caches were never read by anyone else.
            assert decode(dstub, "victim", victim, h) == ref
            load = dstub.Load(wk.LoadRequest(), timeout=30)
            assert load.free_kv_blocks == load.total_kv_blocks and load.free_state_slots == load.total_state_slots
    finally:
        listener.close()


def test_a_node_without_a_cluster_secret_refuses_to_start(model, monkeypatch, capsys):
    from baton.decode_node.server import main as decode_main
    from baton.prefill_node.server import main as prefill_main

    monkeypatch.delenv(CLUSTER_SECRET_ENV)
    for main in (prefill_main, decode_main):
        assert main(["--model", model, "--port", "1"]) == 2
        err = capsys.readouterr().err
        assert CLUSTER_SECRET_ENV in err and "--insecure-no-cluster-auth" in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_node(role: str, model: str, port: int, tls: tuple[str, str, str], log) -> subprocess.Popen:
    ca, cert, key = tls
    argv = [sys.executable, "-m", f"baton.{role}_node.server", "--model", model, "--port", str(port),
            "--http-port", "0", "--engine-id", f"{role}-tls", *ENGINE_ARGS, "--tls-cert", cert, "--tls-key", key,
            "--tls-ca", ca]
    if role == "prefill":
        argv += ["--side-channel-port", "0"]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_tls_on_every_hop_behind_the_router(model, tmp_path):
    """Router -> nodes over TLS (checked against the cluster CA), the decode node's handshake with the prefill
    node's side channel over TLS, a disaggregated request served exactly; a plain-text caller is refused."""
    tls = write_certs(tmp_path)
    ports = {"prefill": _free_port(), "decode": _free_port()}
    procs = []
    with open(tmp_path / "nodes.log", "wb") as log:
        try:
            for role, port in ports.items():
                procs.append(_start_node(role, model, port, tls, log))

            async def main() -> list[int]:
                config = RouterConfig(prefill_addrs=(f"127.0.0.1:{ports['prefill']}",),
                                      decode_addrs=(f"127.0.0.1:{ports['decode']}",))
                cluster = ClusterClient.from_sources(tls_ca=tls[0])
                router = await start_router(config, cluster=cluster)
                try:
                    deadline = time.monotonic() + 240
                    while not (router.service.health().ok and router.service.prefill_pool.healthy_count()):
                        assert time.monotonic() < deadline, (tmp_path / "nodes.log").read_text()[-3000:]
                        assert all(p.poll() is None for p in procs), (tmp_path / "nodes.log").read_text()[-3000:]
                        await asyncio.sleep(0.2)
                    async with AsyncClient(f"127.0.0.1:{router.port}", timeout=60, retries=0) as c:
                        out = await c.generate(list(range(3, 40)), max_tokens=6, ignore_eos=True)
                    routed = router.service.metrics.registry.get_sample_value(
                        "baton_router_routing_decisions_total", {"decision": "disaggregated"})
                    return list(out.token_ids), routed
                finally:
                    await router.stop(1.0)

            tokens, disaggregated = asyncio.run(main())
            ref = [list(o.token_ids) for o in LLMEngine.from_pretrained(model).generate([list(range(3, 40))], PARAMS)]
            assert tokens == ref[0]
            assert disaggregated == 1  # prefilled remotely and pulled: no fallback to a local prefill
            # Plain text reaches nothing.
            with grpc.insecure_channel(f"127.0.0.1:{ports['decode']}") as ch, pytest.raises(grpc.RpcError):
                wk_grpc.WorkerStub(ch).Load(wk.LoadRequest(), timeout=5,
                                            metadata=ClusterCredential.from_sources().grpc_metadata())
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


def test_baton_secret_prints_and_writes_a_usable_secret(tmp_path, capsys):
    from baton.cli.main import main

    out = tmp_path / "secret"
    assert main(["secret", "--out", str(out)]) == 0
    assert out.stat().st_mode & 0o777 == 0o600
    assert ClusterCredential.from_sources(str(out)).token()
    assert main(["secret", "--out", str(out)]) == 2  # never overwrites a secret
    capsys.readouterr()
    assert main(["secret"]) == 0
    printed = capsys.readouterr().out
    assert ClusterCredential.parse(printed).secret != ClusterCredential.from_sources(str(out)).secret
