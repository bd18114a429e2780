"""Drain on SIGTERM, as real processes on loopback: a decode node, a prefill node (its held leases are pulled before
it exits) and the router stop admission and let what is in flight finish, then exit 0; what is left when the drain
ends (its timeout, or a second signal) ends with UNAVAILABLE saying so. Every listener binds only where --host says.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request

import grpc
import pytest

from baton.cli.cluster import Cluster
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from baton.proto.convert import sampling_to_proto
from baton.proto.v1 import generation_pb2 as gen
from baton.proto.v1 import generation_pb2_grpc as gen_grpc
from baton.proto.v1 import worker_pb2 as wk
from baton.proto.v1 import worker_pb2_grpc as wk_grpc
from tests.live_streams import Streams, listening_addresses
from tests.node_channel import node_channel

ENGINE_ARGS = ("--num-kv-blocks", "256")
# Long enough to be in flight when the signal comes, short enough for a 2-core machine.
STREAM_TOKENS = 400


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("drain") / "tiny"
    make_model(out, preset="tiny", seed=5, progress=False, overrides={"vocab_size": 64})
    return str(out)


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    c = Cluster(model, prefill_workers=1, decode_workers=1, engine_args=ENGINE_ARGS, drain_timeout_s=30,
                log_dir=str(tmp_path_factory.mktemp("logs")))
    c.start()
    yield c
    c.stop()


def terminate(cluster: Cluster, name: str, sig: int = signal.SIGTERM) -> None:
    os.killpg(cluster.procs[name].pid, sig)


def node_load_status(addr: str) -> tuple[grpc.StatusCode, str]:
    with node_channel(addr) as ch:
        try:
            wk_grpc.WorkerStub(ch).Load(wk.LoadRequest(), timeout=5)
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def restart_and_wait(cluster: Cluster, name: str) -> None:
    """Starts `name` again and waits until the router has every worker back in rotation."""
    cluster.respawn(name)
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(cluster.router_addr) as ch:
        while time.monotonic() < deadline:
            try:
                h = gen_grpc.GenerationStub(ch).Health(gen.HealthRequest(), timeout=2)
                if h.ok and h.prefill_workers == cluster.prefill_workers and h.decode_workers == cluster.decode_workers:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise AssertionError(f"{name} did not come back into rotation")


def test_every_listener_binds_only_the_loopback_address_it_was_given(cluster):
    for name, proc in cluster.procs.items():
        addrs = listening_addresses(proc.pid)
        assert addrs, f"{name} listens on nothing"
        # Node: gRPC, HTTP, side channel and the transfer (UCX) listener; router: gRPC and HTTP.
        assert all(a.is_loopback for a, _ in addrs), f"{name} listens beyond loopback: {addrs}"


def test_a_decode_node_drains_its_streams_then_exits(cluster):
    streams = Streams(cluster.router_addr, 6, STREAM_TOKENS)
    assert streams.started.wait(60)
    addr = cluster.decode_addrs[0]
    terminate(cluster, "decode-0")
    # Draining: out of the router's rotation (Load refused) and not ready for Kubernetes (/health 503).
    deadline = time.monotonic() + 10
    while node_load_status(addr)[0] == grpc.StatusCode.OK and time.monotonic() < deadline:
        time.sleep(0.05)
    code, details = node_load_status(addr)
    assert code == grpc.StatusCode.UNAVAILABLE and "draining" in details
    assert http_status(cluster.node_http_url(addr) + "/health") == 503
    streams.join(60)
    assert streams.all_finished(), streams.results
    assert cluster.procs["decode-0"].wait(30) == 0
    restart_and_wait(cluster, "decode-0")


def test_a_prefill_node_keeps_a_held_lease_until_the_decode_node_pulls_it(cluster):
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    with node_channel(cluster.prefill_addrs[0]) as pch, node_channel(cluster.decode_addrs[0]) as dch:
        pstub, dstub = wk_grpc.WorkerStub(pch), wk_grpc.WorkerStub(dch)
        handle = pstub.Prefill(wk.PrefillRequest(request_id="held", prompt_token_ids=prompt), timeout=60).handle
        terminate(cluster, "prefill-0")
        # New work is refused while the lease keeps the node (and its side channel) up.
        with pytest.raises(grpc.RpcError) as refused:
            for _ in range(100):
                pstub.Prefill(wk.PrefillRequest(request_id="late", prompt_token_ids=prompt), timeout=10)
                time.sleep(0.05)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
        time.sleep(1.0)
        assert cluster.procs["prefill-0"].poll() is None
        req = wk.DecodeRequest(request_id="held", prompt_token_ids=prompt, handle=handle,
                               sampling=sampling_to_proto(SamplingParams(max_tokens=4, ignore_eos=True)))
        msgs = list(dstub.Decode(req, timeout=60))
    assert not msgs[0].prefilled_locally and sum(len(m.token_ids) for m in msgs) == 4
    # The pull freed the lease: nothing holds the node any more.
    assert cluster.procs["prefill-0"].wait(20) == 0
    restart_and_wait(cluster, "prefill-0")


def test_a_second_signal_cuts_the_drain_short_with_a_clear_status(cluster):
    streams = Streams(cluster.router_addr, 4, 4000)
    assert streams.started.wait(60)
    terminate(cluster, "decode-0")
    time.sleep(0.5)
    terminate(cluster, "decode-0")
    results = streams.join(30)
    assert all(r.status == "UNAVAILABLE" and "before this call finished" in r.details for r in results), results
    assert cluster.procs["decode-0"].wait(30) == 0
    restart_and_wait(cluster, "decode-0")


def test_the_router_drains_its_streams_and_refuses_new_ones(cluster):
    streams = Streams(cluster.router_addr, 6, STREAM_TOKENS)
    assert streams.started.wait(60)
    terminate(cluster, "router")
    with grpc.insecure_channel(cluster.router_addr) as ch:
        stub = gen_grpc.GenerationStub(ch)
        deadline = time.monotonic() + 10
        while stub.Health(gen.HealthRequest(), timeout=5).ok and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(gen.GenerateRequest(token_ids=gen.TokenIds(ids=[3, 4, 5])), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
    assert http_status(cluster.router_http_url + "/health") == 503
    streams.join(60)
    assert streams.all_finished(), streams.results
    assert cluster.procs["router"].wait(30) == 0


@pytest.fixture(scope="module")
def short_drain(model, tmp_path_factory):
    """A router and a decode node that drain for one second: the router's test ends the router, then the decode
    node's test (which calls the node directly) ends the node."""
    c = Cluster(model, prefill_workers=0, decode_workers=1, engine_args=ENGINE_ARGS, drain_timeout_s=1,
                log_dir=str(tmp_path_factory.mktemp("short-drain-logs")))
    c.start()
    yield c
    c.stop()


def test_a_router_drain_that_times_out_ends_the_streams_left_with_a_clear_status(short_drain):
    c = short_drain
    streams = Streams(c.router_addr, 3, 4000)
    assert streams.started.wait(60)
    terminate(c, "router")
    t0 = time.monotonic()
    results = streams.join(30)
    assert time.monotonic() - t0 < 15
    assert all(r.status == "UNAVAILABLE" and "drain timeout (1 s)" in r.details for r in results), results
    assert c.procs["router"].wait(30) == 0
    # The decode node was told: nothing of the cut streams stays allocated there.
    with node_channel(c.decode_addrs[0]) as ch:
        deadline = time.monotonic() + 10
        while (load := wk_grpc.WorkerStub(ch).Load(wk.LoadRequest(), timeout=5)).running and \
                time.monotonic() < deadline:
            time.sleep(0.1)
    assert load.running == 0 and load.free_kv_blocks == load.total_kv_blocks


def test_a_drain_that_times_out_ends_the_streams_left_with_a_clear_status(short_drain):
    c = short_drain
    with node_channel(c.decode_addrs[0]) as ch:
        req = wk.DecodeRequest(request_id="long", prompt_token_ids=[3, 4, 5],
                               sampling=sampling_to_proto(SamplingParams(max_tokens=4000, ignore_eos=True)))
        call = wk_grpc.WorkerStub(ch).Decode(req, timeout=60)
        next(call)
        terminate(c, "decode-0")
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as cut:
            for _ in call:
                pass
        assert time.monotonic() - t0 < 10
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE and "drain timeout (1 s)" in cut.value.details()
    assert c.procs["decode-0"].wait(30) == 0
