"""Worker discovery and health: a headless-Service DNS name re-resolved while the router runs (workers join,
receive traffic, leave without breaking their in-flight streams), failed lookups, the flags and config fields,
and workers that stop answering leaving rotation and coming back after a restart."""

from __future__ import annotations

import argparse
import asyncio
import socket

import grpc
import pytest

from baton.proto.v1 import generation_pb2, generation_pb2_grpc, worker_pb2_grpc
from baton.router import discovery
from baton.router.config import RouterConfig
from baton.router.discovery import (
    DnsDiscovery,
    StaticDiscovery,
    UnionDiscovery,
    add_discovery_args,
    discovery_for,
    discovery_from_args,
)
from baton.router.policy import Role
from baton.router.server import main, start_router
from baton.router.workers import WorkerPool
from tests.test_router_fakes import (
    FakeWorker,
    cluster,
    eventually,
    expected_tokens,
    run,
    start_fake,
    tokens_of,
)


async def serve_fake(fake: FakeWorker, addr: str) -> grpc.aio.Server:
    """Serves `fake` on exactly `addr` (a restart on the same address, or one port on several IPs)."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
    assert server.add_insecure_port(addr), addr
    await server.start()
    return server


async def generate(stub, ids, request_id="", **sampling):
    req = generation_pb2.GenerateRequest(request_id=request_id, token_ids=generation_pb2.TokenIds(ids=ids),
                                         sampling=generation_pb2.SamplingParams(**sampling))
    return [m async for m in stub.Generate(req, timeout=10)]


# ---- config and flags -----------------------------------------------------------------------------
def test_config_discovery_fields():
    c = RouterConfig(decode_dns="decode.baton.svc:50051")
    assert (c.decode_addrs, c.prefill_dns, c.dns_refresh_s, c.unhealthy_after) == ((), None, 5.0, 2)
    RouterConfig(("p:1",), ("d:1",), prefill_dns="prefill:2", decode_dns="decode:2", unhealthy_after=1)
    bad = [({}, "decode_addrs: expected at least 1 address(es) or decode_dns"),
           ({"decode_dns": "no-port"}, "decode_dns: expected None or 'NAME:PORT'"),
           ({"decode_addrs": ("d:1",), "prefill_dns": "p:0"}, "prefill_dns: expected"),
           ({"decode_addrs": ("d:1",), "dns_refresh_s": 0}, "dns_refresh_s: expected a finite number"),
           ({"decode_addrs": ("d:1",), "unhealthy_after": 0}, "unhealthy_after: expected an integer >= 1, got 0"),
           ({"decode_addrs": ("d:1",), "unhealthy_after": True}, "unhealthy_after: expected an integer")]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
            RouterConfig(**kw)


def test_flags(capsys):
    p = argparse.ArgumentParser()
    add_discovery_args(p)
    a = p.parse_args(["--decode-dns", "decode:7", "--dns-refresh-s", "0.5", "--unhealthy-after", "3"])
    c = RouterConfig(**discovery_from_args(a))
    assert (c.decode_dns, c.prefill_dns, c.dns_refresh_s, c.unhealthy_after) == ("decode:7", None, 0.5, 3)
    assert main(["--port", "0", "--decode-dns", "nope"]) == 2
    assert "decode_dns" in capsys.readouterr().err
    assert main(["--port", "0"]) == 2
    assert "decode_addrs" in capsys.readouterr().err


def test_discovery_objects():
    async def go():
        # The production resolver: the system's getaddrinfo; IPv6 answers come back bracketed for gRPC.
        found = await DnsDiscovery("localhost:4321", 1.0).addresses()
        assert "127.0.0.1:4321" in found and found <= {"127.0.0.1:4321", "[::1]:4321"}

        async def fake(host, port):
            assert (host, port) == ("svc", 9)
            return ["10.0.0.1", "::1", "10.0.0.1"]
        assert await DnsDiscovery("svc:9", 1.0, resolve=fake).addresses() == {"10.0.0.1:9", "[::1]:9"}
        c = RouterConfig(("p:1",), prefill_dns="svc:9", decode_dns="svc:9", dns_refresh_s=0.25)
        both, dns_only = discovery_for(c, Role.PREFILL, fake), discovery_for(c, Role.DECODE, fake)
        assert isinstance(both, UnionDiscovery) and isinstance(dns_only, DnsDiscovery)
        assert await both.addresses() == {"p:1", "10.0.0.1:9", "[::1]:9"} and both.refresh_s == 0.25
        static = discovery_for(RouterConfig(decode_addrs=("d:1",)), Role.DECODE)
        assert isinstance(static, StaticDiscovery) and static.refresh_s is None
    run(go())


# ---- DNS: workers join and leave ------------------------------------------------------------------
def test_dns_workers_join_receive_traffic_and_leave_without_breaking_streams(monkeypatch):
    answer: set[str] = {"127.0.0.2"}
    lookups: list[tuple[str, int]] = []
    fail_lookups = False

    async def resolver(host, port):
        lookups.append((host, port))
        if fail_lookups:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return sorted(answer)

    # start_router builds its DNS discovery with the module's default resolver: this one answers instead.
    monkeypatch.setattr(discovery, "getaddrinfo_resolver", resolver)

    async def go():
        nonlocal fail_lookups
        # A headless Service: every pod listens on the same port, each on its own IP (127.0.0.x here).
        d0, d1 = FakeWorker("decode", "d0"), FakeWorker("decode", "d1")
        s0 = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(d0, s0)
        port = s0.add_insecure_port("127.0.0.2:0")
        await s0.start()
        s1 = await serve_fake(d1, f"127.0.0.3:{port}")
        d0.free_state_slots = 1  # d1, once there, looks emptier: two choices then always pick it
        config = RouterConfig(decode_dns=f"decode.baton.svc:{port}", dns_refresh_s=0.1, load_poll_interval_s=0.1,
                              control_timeout_s=1.0)
        router = await start_router(config)
        pool = router.service.decode_pool
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
        stub = generation_pb2_grpc.GenerationStub(ch)
        try:
            assert lookups[0] == ("decode.baton.svc", port)
            h = await stub.Health(generation_pb2.HealthRequest())
            assert (h.ok, h.decode_workers) == (True, 1)
            assert tokens_of(await generate(stub, [1, 2, 3])) == expected_tokens([1, 2, 3])
            assert (len(d0.decodes), len(d1.decodes)) == (1, 0)

            # A pod joins: picked up within a refresh (plus its first poll), then it gets the traffic.
            answer.add("127.0.0.3")
            await eventually(lambda: pool.healthy_count() == 2, what="d1 discovered and healthy")
            assert (await stub.Health(generation_pb2.HealthRequest())).decode_workers == 2
            for i in range(3):
                assert tokens_of(await generate(stub, [i, 5])) == expected_tokens([i, 5])
            assert (len(d0.decodes), len(d1.decodes)) == (1, 3)

            # It leaves while streaming: the stream finishes, new requests go elsewhere, then its channel closes.
            d1.token_delay_s = 0.05
            w1 = next(w for w in pool.workers if w.addr == f"127.0.0.3:{port}")
            slow = asyncio.create_task(generate(stub, [7, 8, 9], request_id="slow"))
            await eventually(lambda: "slow" in d1.active, what="the slow stream on d1")
            answer.discard("127.0.0.3")
            await eventually(lambda: [w.addr for w in pool.workers] == [f"127.0.0.2:{port}"], what="d1 removed")
            assert w1.retired and not w1.closed and not slow.done()
            for i in range(3):
                assert tokens_of(await generate(stub, [i, 6])) == expected_tokens([i, 6])
            assert (len(d0.decodes), len(d1.decodes)) == (4, 4)
            msgs = await slow
            assert tokens_of(msgs) == expected_tokens([7, 8, 9])
            assert msgs[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
            await eventually(lambda: w1.closed, what="d1's channel closed once idle")
            assert d1.aborts == []  # it ended normally: nothing to abort

            # A failed lookup keeps the workers the pool has; the next good answer applies again.
            fail_lookups = True
            n = len(lookups)
            await eventually(lambda: len(lookups) >= n + 2, what="failed lookups")
            assert pool.healthy_count() == 1
            fail_lookups = False
            answer.add("127.0.0.3")
            await eventually(lambda: pool.healthy_count() == 2, what="d1 back")
            await generate(stub, [4, 4])
            assert len(d1.decodes) == 5
        finally:
            await ch.close()
            await router.stop(0)
            await asyncio.gather(s0.stop(0), s1.stop(0))
    run(go())


# ---- health ---------------------------------------------------------------------------------------
def test_unhealthy_after_counts_failed_polls_in_a_row():
    async def go():
        fake, server, addr = await start_fake("decode", "d0")
        pool = WorkerPool(Role.DECODE, (addr,), poll_interval_s=60.0, control_timeout_s=1.0, unhealthy_after=3)
        try:
            await pool.start()
            (w,) = pool.workers
            assert w.healthy
            fake.load_fails = True
            for _ in range(2):
                await pool.poll_once()
            assert w.healthy and w.failed_polls == 2 and pool.pick() is w
            fake.load_fails = False
            await pool.poll_once()  # a success resets the count
            fake.load_fails = True
            for _ in range(2):
                await pool.poll_once()
            assert w.healthy
            await pool.poll_once()
            assert not w.healthy and pool.pick() is None and pool.healthy_count() == 0
            fake.load_fails = False
            await pool.poll_once()
            assert w.healthy and pool.pick() is w
        finally:
            await pool.close()
            await server.stop(0)
    run(go())


def test_a_killed_worker_leaves_rotation_without_client_errors_and_returns_after_restart():
    async def go():
        async with cluster(1, 2) as c:
            pool = c.router.service.decode_pool
            d0, d1 = c.decode
            addr1 = next(w.addr for w in pool.workers if w.info.engine_id == "d1")
            await c.servers["d1"].stop(0)
            for i in range(6):  # before the polls notice, a request may still pick d1: the retry saves it
                assert tokens_of(await c.generate([i, 1], max_tokens=3)) == expected_tokens([i, 1], 3)
            await eventually(lambda: pool.healthy_count() == 1, what="d1 out of rotation")
            n1 = len(d1.decodes)
            for i in range(4):
                assert tokens_of(await c.generate([i, 2], max_tokens=3)) == expected_tokens([i, 2], 3)
            assert len(d1.decodes) == n1
            assert (await c.health()).decode_workers == 1

            c.servers["d1"] = await serve_fake(d1, addr1)
            d0.free_state_slots = 1  # once back, d1 looks emptier and gets the next request
            await eventually(lambda: pool.healthy_count() == 2, what="d1 back in rotation")
            assert tokens_of(await c.generate([9, 9], max_tokens=3)) == expected_tokens([9, 9], 3)
            assert len(d1.decodes) == n1 + 1
    run(go())


def test_a_removed_worker_waits_for_its_requests_and_can_come_back():
    async def go():
        fakes = [await start_fake("prefill", f"p{i}") for i in range(2)]
        (_, s0, a0), (_, s1, a1) = fakes
        pool = WorkerPool(Role.PREFILL, discovery=StaticDiscovery((a0, a1)), poll_interval_s=0.05,
                          control_timeout_s=1.0)
        try:
            await pool.start()
            w0, w1 = sorted(pool.workers, key=lambda w: w.addr == a1)
            w1.tracker.add("r", 10)  # a request in flight there
            pool.set_addresses({a0})
            assert pool.workers == (w0,) and w1.retired and pool.pick(exclude=[w0]) is None
            await asyncio.sleep(0.2)
            assert not w1.closed  # still serving "r"
            pool.set_addresses({a0, a1})  # back before it closed: the same worker, polled again
            assert set(pool.workers) == {w0, w1} and not w1.retired
            pool.set_addresses({a0})
            w1.tracker.remove("r")
            await eventually(lambda: w1.closed, what="w1 closed once idle")
            assert not await pool.abort(w1, "r")  # skipped: its channel is gone
            pool.set_addresses({a0, a1})  # after it closed: a new worker
            (new1,) = [w for w in pool.workers if w.addr == a1]
            assert new1 is not w1
            await eventually(lambda: pool.healthy_count() == 2, what="new worker healthy")
            new1.tracker.add("r2", 10)
            pool.set_addresses({a0})
        finally:
            await pool.close()  # closes the retiring worker's channel too
            await asyncio.gather(s0.stop(0), s1.stop(0))
        assert new1.closed and w0.closed
    run(go())
