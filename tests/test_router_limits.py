"""The router's fairness limits over fake nodes: in-flight caps overall and per client (RESOURCE_EXHAUSTED with
`retry-after`), a client that stops reading loses its request after --stream-write-timeout-s (its slot freed on
the node, other clients served meanwhile), and Abort reaching only the caller's own requests."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from baton.proto.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from baton.router.config import RouterConfig
from baton.router.security import RouterSecurity
from baton.router.server import start_router
from tests.test_router_fakes import (
    FakeWorker,
    cluster,
    eventually,
    expected_tokens,
    run,
    start_fake,
    tokens_of,
)

# A client whose HTTP/2 window stays small (no BDP growth): it stops the router's writes after a few KiB.
SMALL_WINDOW = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384))


OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def _request(ids, request_id="", max_tokens=16):
    return generation_pb2.GenerateRequest(request_id=request_id, token_ids=generation_pb2.TokenIds(ids=ids),
                                          sampling=generation_pb2.SamplingParams(max_tokens=max_tokens))


def _rejected(router, reason: str) -> float:
    return router.service.metrics.registry.get_sample_value("baton_router_rejected_requests_total", {"reason": reason})


async def _refused(call) -> grpc.aio.AioRpcError:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e
    raise AssertionError("the call was served")


def test_global_in_flight_limit_refuses_with_retry_after():
    async def go():
        async with cluster(0, 1, max_inflight_requests=2) as c:
            c.decode[0].token_delay_s = 0.05
            held = [asyncio.create_task(c.generate([1, 2, 3], max_tokens=10)) for _ in range(2)]
            await eventually(lambda: c.router.service.admission.inflight == 2, what="two in flight")
            call = c.stub.Generate(_request([4, 5]), timeout=5)
            e = await _refused(call)
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-inflight-requests 2" in e.details()
            assert ("retry-after", "1") in tuple(e.trailing_metadata())
            assert _rejected(c.router, "max_inflight_requests") == 1
            await asyncio.gather(*held)
            # Slots come back as requests end.
            assert tokens_of(await c.generate([4, 5])) == expected_tokens([4, 5])
            assert c.router.service.admission.inflight == 0
    run(go())


def test_per_client_limit_counts_connections_without_api_keys():
    async def go():
        async with cluster(0, 1, max_inflight_per_client=1) as c:
            c.decode[0].token_delay_s = 0.05
            held = asyncio.create_task(c.generate([1, 2, 3], max_tokens=10))
            await eventually(lambda: c.router.service.admission.inflight == 1, what="one in flight")
            e = await _refused(c.stub.Generate(_request([4, 5]), timeout=5))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-inflight-per-client 1" in e.details()
            assert ("retry-after", "1") in tuple(e.trailing_metadata())
            # Another connection is another client (a channel of its own subchannel pool opens its own).
            async with grpc.aio.insecure_channel(f"127.0.0.1:{c.router.port}", options=OWN_CONNECTION) as other:
                msgs = [m async for m in generation_pb2_grpc.GenerationStub(other).Generate(_request([4, 5]))]
            assert tokens_of(msgs) == expected_tokens([4, 5])
            await held
            assert _rejected(c.router, "max_inflight_per_client") == 1
    run(go())


@contextlib.asynccontextmanager
async def _keyed_router(keys, **config):
    decode, server, addr = await start_fake("decode", "d0")
    router = await start_router(RouterConfig(decode_addrs=(addr,), load_poll_interval_s=0.1, control_timeout_s=1.0,
                                             **config),
                                security=RouterSecurity(api_keys=frozenset(keys)))
    channels = []

    def stub(key):
        channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{router.port}", options=OWN_CONNECTION))
        return generation_pb2_grpc.GenerationStub(channels[-1]), (("authorization", f"Bearer {key}"),)

    try:
        yield decode, router, stub
    finally:
        for ch in channels:
            await ch.close()
        await router.stop(0)
        await server.stop(0)


def test_per_client_limit_counts_api_keys_across_connections():
    async def go():
        async with _keyed_router({"key-a", "key-b"}, max_inflight_per_client=1) as (decode, router, stub):
            decode.token_delay_s = 0.05
            (a1, md_a), (a2, _), (b, md_b) = stub("key-a"), stub("key-a"), stub("key-b")
            held = asyncio.create_task(_collect(a1.Generate(_request([1, 2, 3], max_tokens=10), metadata=md_a)))
            await eventually(lambda: router.service.admission.inflight == 1, what="one in flight")
            # The same key on a new connection is the same client; another key is another.
            e = await _refused(a2.Generate(_request([4, 5]), metadata=md_a, timeout=5))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert tokens_of(await _collect(b.Generate(_request([4, 5]), metadata=md_b))) == expected_tokens([4, 5])
            await held
    run(go())


async def _collect(call) -> list[generation_pb2.GenerateResponse]:
    return [m async for m in call]


def test_abort_reaches_only_the_callers_own_request():
    async def go():
        async with _keyed_router({"key-a", "key-b"}) as (decode, router, stub):
            decode.token_delay_s = 0.05
            (a, md_a), (b, md_b) = stub("key-a"), stub("key-b")
            call_a = a.Generate(_request([1, 2, 3], "r", max_tokens=40), metadata=md_a)
            await eventually(lambda: "r" in decode.active, what="a's request running")
            # b sees a's request exactly as an unknown id, and cannot end it.
            assert not (await b.Abort(generation_pb2.AbortRequest(request_id="r"), metadata=md_b)).found
            assert decode.aborts == []
            # b may use the same id: its request runs beside a's under another id on the worker, and b's answer
            # carries b's id.
            msgs_b = await _collect(b.Generate(_request([4, 5], "r"), metadata=md_b))
            assert tokens_of(msgs_b) == expected_tokens([4, 5]) and {m.request_id for m in msgs_b} == {"r"}
            assert [d.request_id for d in decode.decodes][0] == "r"
            assert decode.decodes[1].request_id.startswith("r~")
            assert decode.aborts == []
            # a's own Abort ends a's request.
            assert (await a.Abort(generation_pb2.AbortRequest(request_id="r"), metadata=md_a)).found
            msgs_a = await _collect(call_a)
            assert msgs_a[-1].finish_reason == generation_pb2.FINISH_REASON_ABORT and decode.aborts == ["r"]
    run(go())


class _BigMessages(FakeWorker):
    """A decode worker whose every message carries many tokens: a client that does not read fills its window
    within a few messages."""

    async def Decode(self, request, context):
        self.decodes.append(request)
        rid = request.request_id
        self.active.add(rid)
        try:
            await context.write(worker_pb2.DecodeResponse(prompt_tokens=len(request.prompt_token_ids)))
            n = request.sampling.max_tokens
            for i in range(n):
                await context.write(worker_pb2.DecodeResponse(
                    token_ids=[7] * 4096, finish_reason=generation_pb2.FINISH_REASON_LENGTH if i == n - 1 else 0))
                if await self._sleep_unless_aborted(rid, 0.001):
                    return
        finally:
            self.active.discard(rid)


def test_a_client_that_stops_reading_loses_its_request_and_frees_its_slot():
    async def go():
        big = _BigMessages("decode", "big")
        big_server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(big, big_server)
        big_addr = f"127.0.0.1:{big_server.add_insecure_port('127.0.0.1:0')}"
        await big_server.start()
        router = await start_router(RouterConfig(decode_addrs=(big_addr,), load_poll_interval_s=0.1,
                                                 control_timeout_s=1.0, stream_write_timeout_s=0.5))
        target = f"127.0.0.1:{router.port}"
        try:
            async with grpc.aio.insecure_channel(target, options=SMALL_WINDOW + OWN_CONNECTION) as stalled_ch, \
                    grpc.aio.insecure_channel(target) as ch:
                stalled = generation_pb2_grpc.GenerationStub(stalled_ch).Generate(_request([1, 2], "slow", 60))
                await eventually(lambda: "slow" in big.active, what="the stalled request running")
                # Others are served while it is stalled.
                quick = await _collect(generation_pb2_grpc.GenerationStub(ch).Generate(_request([3, 4], max_tokens=2)))
                assert len(tokens_of(quick)) == 2 * 4096
                # Cut after the write timeout: the node is told, the router forgets it.
                await eventually(lambda: big.aborts == ["slow"] and not big.active, timeout=5, what="node aborted")
                await eventually(lambda: not router.service._inflight and router.service.admission.inflight == 0,
                                 what="router clean")
                assert _rejected(router, "stream_write_timeout") == 1
                # When the client reads again it finds the reason after what was buffered.
                e = await _refused(stalled)
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--stream-write-timeout-s" in e.details()
        finally:
            await router.stop(0)
            await big_server.stop(0)
    run(go())


def test_an_id_reused_right_after_its_request_ended_gets_a_fresh_id_on_the_workers():
    # A node may still be ending the first (its prefill lease not yet released, its last step in flight): the
    # second must not meet it there under the same id.
    async def go():
        async with _keyed_router({"key-a"}) as (decode, router, stub):
            a, md = stub("key-a")
            for _ in range(2):
                msgs = await _collect(a.Generate(_request([4, 5], "r"), metadata=md))
                assert tokens_of(msgs) == expected_tokens([4, 5]) and {m.request_id for m in msgs} == {"r"}
            first, second = (d.request_id for d in decode.decodes)
            assert first == "r" and second.startswith("r~")
    run(go())
