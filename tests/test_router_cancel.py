"""Cancellation: a client that goes away, a client deadline, and Generation.Abort by request id all abort
the request on every node that may hold something of it, and leave nothing behind in the router."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from baton.proto.v1 import generation_pb2
from tests.test_router_fakes import Cluster, cluster, eventually, expected_tokens, run

ABORT = generation_pb2.FINISH_REASON_ABORT


def _request(ids, request_id):
    return generation_pb2.GenerateRequest(request_id=request_id, token_ids=generation_pb2.TokenIds(ids=ids),
                                          sampling=generation_pb2.SamplingParams(max_tokens=50))


async def _read_rest(call) -> list[generation_pb2.GenerateResponse]:
    out = []
    while (m := await call.read()) is not grpc.aio.EOF:
        out.append(m)
    return out


def _router_is_clean(c: Cluster) -> bool:
    svc = c.router.service
    trackers = [w.tracker.in_flight for w in svc.prefill_pool.workers + svc.decode_pool.workers]
    return not svc._inflight and not any(trackers)


def test_client_cancel_mid_stream_aborts_the_decode_node():
    async def go():
        async with cluster(1, 1) as c:
            (p,), (d,) = c.prefill, c.decode
            d.token_delay_s = 0.05
            call = c.stub.Generate(_request(list(range(10)), "r"))
            got = []
            while len(got) < 2:
                got.extend((await call.read()).token_ids)
            call.cancel()
            await eventually(lambda: d.aborts == ["r"], what="decode abort")
            await eventually(lambda: not d.active, what="decode stream ended")
            assert got == expected_tokens(list(range(10)))[:2]
            # The handle was consumed by the decode node: nothing to abort on the prefill node.
            assert p.aborts == []
            await eventually(lambda: _router_is_clean(c), what="router clean")
    run(go())


def test_client_cancel_during_prefill_aborts_the_prefill_node():
    async def go():
        async with cluster(1, 1) as c:
            (p,), (d,) = c.prefill, c.decode
            p.prefill_delay_s = 5.0
            call = c.stub.Generate(_request(list(range(10)), "r"))
            await eventually(lambda: "r" in p.active, what="prefill started")
            call.cancel()
            await eventually(lambda: p.aborts == ["r"], what="prefill abort")
            await eventually(lambda: _router_is_clean(c), what="router clean")
            assert d.decodes == [] and d.aborts == []
    run(go())


def test_client_cancel_while_decode_pulls_aborts_both_nodes():
    async def go():
        async with cluster(1, 1) as c:
            (p,), (d,) = c.prefill, c.decode
            d.decode_first_delay_s = 5.0  # the pull: the handle is issued but not yet consumed
            call = c.stub.Generate(_request(list(range(10)), "r"))
            await eventually(lambda: "r" in d.active, what="decode started")
            call.cancel()
            await eventually(lambda: p.aborts == ["r"] and d.aborts == ["r"], what="aborts on both nodes")
            await eventually(lambda: _router_is_clean(c), what="router clean")
    run(go())


def test_client_deadline_aborts_the_nodes():
    async def go():
        async with cluster(0, 1) as c:
            c.decode[0].token_delay_s = 0.1
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in c.stub.Generate(_request([1, 2], "r"), timeout=0.35):
                    pass
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await eventually(lambda: c.decode[0].aborts == ["r"], what="decode abort")
            await eventually(lambda: _router_is_clean(c), what="router clean")
    run(go())


def test_abort_by_id_mid_stream_ends_the_stream_with_abort():
    async def go():
        async with cluster(1, 1) as c:
            (p,), (d,) = c.prefill, c.decode
            d.token_delay_s = 0.05
            call = c.stub.Generate(_request(list(range(10)), "abc"))
            first = await call.read()
            while not first.token_ids:
                first = await call.read()
            resp = await c.stub.Abort(generation_pb2.AbortRequest(request_id="abc"))
            assert resp.found and d.aborts == ["abc"]  # the node was told before Abort returned
            rest = await _read_rest(call)
            assert rest and rest[-1].finish_reason == ABORT and rest[-1].request_id == "abc"
            n = len(first.token_ids) + sum(len(m.token_ids) for m in rest)
            assert rest[-1].usage.completion_tokens == n < 50 and rest[-1].usage.prompt_tokens == 10
            assert await call.code() == grpc.StatusCode.OK
            assert p.aborts == []
            assert not (await c.stub.Abort(generation_pb2.AbortRequest(request_id="abc"))).found
            assert not (await c.stub.Abort(generation_pb2.AbortRequest(request_id="nope"))).found
            await eventually(lambda: _router_is_clean(c), what="router clean")
    run(go())


def test_abort_by_id_during_prefill():
    async def go():
        async with cluster(1, 1) as c:
            (p,), (d,) = c.prefill, c.decode
            p.prefill_delay_s = 5.0
            call = c.stub.Generate(_request(list(range(10)), "abc"))
            await eventually(lambda: "abc" in p.active, what="prefill started")
            assert (await c.stub.Abort(generation_pb2.AbortRequest(request_id="abc"))).found
            msgs = [m async for m in call]
            assert [m.finish_reason for m in msgs] == [ABORT] and msgs[0].usage.completion_tokens == 0
            assert p.aborts == ["abc"] and d.decodes == []  # no fallback to a local prefill
            await eventually(lambda: _router_is_clean(c), what="router clean")
    run(go())


def test_duplicate_request_id_in_flight_is_rejected():
    async def go():
        async with cluster(0, 1) as c:
            c.decode[0].token_delay_s = 0.05
            call = c.stub.Generate(_request([1, 2], "dup"))
            await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate([3], request_id="dup")
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already in flight" in e.value.details()
            call.cancel()
            await eventually(lambda: _router_is_clean(c), what="router clean")
    run(go())


def test_many_cancellations_leave_nothing_behind():
    async def go():
        async with cluster(2, 2) as c:
            for w in c.prefill + c.decode:
                w.token_delay_s = 0.02
                w.prefill_delay_s = 0.02

            async def one(i):
                call = c.stub.Generate(_request(list(range(i % 5 + 1)), f"r{i}"))
                await asyncio.sleep(0.01 * (i % 6))
                call.cancel()

            await asyncio.gather(*(one(i) for i in range(30)))
            await eventually(lambda: _router_is_clean(c), what="router clean")
            await eventually(lambda: not any(w.active for w in c.prefill + c.decode), what="nodes idle")
    run(go())
