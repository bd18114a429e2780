"""Workers that stop answering, over fake nodes: a worker whose Load polls go unanswered is taken out of rotation
and its requests are retried elsewhere (nothing streamed yet) or ended with UNAVAILABLE (tokens streamed), well
before their deadlines; a worker that refuses polls (draining) keeps the streams it serves."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from baton.proto.v1 import generation_pb2
from baton.router.config import RouterConfig
from tests.test_router_fakes import cluster, eventually, expected_tokens, run, tokens_of

# Polls every 0.1 s with a 0.3 s deadline: two unanswered in a row take well under a second.
FAST = {"load_poll_interval_s": 0.1, "poll_timeout_s": 0.3, "unhealthy_after": 2}
CLIENT_DEADLINE_S = 15.0


def _request(prompt, request_id, max_tokens=16):
    return generation_pb2.GenerateRequest(request_id=request_id, token_ids=generation_pb2.TokenIds(ids=prompt),
                                          sampling=generation_pb2.SamplingParams(max_tokens=max_tokens))


def test_poll_timeout_is_checked():
    with pytest.raises(ValueError, match="poll_timeout_s: expected a finite number of seconds > 0"):
        RouterConfig(decode_addrs=("h:1",), poll_timeout_s=0)


def test_a_decode_worker_that_stops_answering_has_its_requests_retried_or_ended():
    def setup(c):
        c.decode[1].free_state_slots = 1  # d0 looks emptier: two choices pick it

    async def go():
        async with cluster(0, 2, configure=setup, **FAST) as c:
            d0, d1 = c.decode
            d0.token_delay_s = 0.2
            streaming = c.stub.Generate(_request([4, 5, 6], "streaming", max_tokens=60), timeout=CLIENT_DEADLINE_S)
            got = []
            while len(got) < 2:
                got += (await streaming.read()).token_ids
            d0.decode_first_delay_s = 60.0  # the next request waits on d0 before its first token
            waiting = asyncio.create_task(c.generate([7, 8], request_id="waiting", timeout=CLIENT_DEADLINE_S))
            await eventually(lambda: [r.request_id for r in d0.decodes] == ["streaming", "waiting"], what="d0")
            d0.load_silent = True
            started = time.monotonic()
            # Nothing streamed yet: retried on d1, where it is prefilled anew.
            assert tokens_of(await waiting) == expected_tokens([7, 8])
            assert [r.request_id for r in d1.decodes] == ["waiting"]
            # Tokens streamed: ends with UNAVAILABLE saying why, after what it got.
            with pytest.raises(grpc.aio.AioRpcError) as e:
                while (m := await streaming.read()) is not grpc.aio.EOF:
                    got += m.token_ids
            assert time.monotonic() - started < 3.0
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "stopped answering" in e.value.details() and f"after {len(got)} tokens" in e.value.details()
            assert got == expected_tokens([4, 5, 6], 60)[:len(got)] and len(got) < 60
            assert (await c.health()).decode_workers == 1
            # New requests go to d1 while d0 stays silent; once it answers again it is back in rotation.
            assert tokens_of(await c.generate([9], request_id="meanwhile")) == expected_tokens([9])
            assert d1.decodes[-1].request_id == "meanwhile"
            d0.load_silent = False
            await eventually(lambda: c.router.service.decode_pool.healthy_count() == 2, what="d0 back in rotation")
    run(go())


def test_a_prefill_worker_that_stops_answering_has_its_prefill_retried():
    def setup(c):
        c.prefill[1].outstanding_prefill_tokens = 1000  # p0 looks emptier: two choices pick it

    async def go():
        async with cluster(2, 1, configure=setup, **FAST) as c:
            (p0, _), (d,) = c.prefill, c.decode
            p0.prefill_delay_s = 60.0
            prompt = list(range(30, 40))
            task = asyncio.create_task(c.generate(prompt, request_id="r", timeout=CLIENT_DEADLINE_S))
            await eventually(lambda: len(p0.prefills) == 1, what="the prefill on p0")
            p0.load_silent = True
            started = time.monotonic()
            assert tokens_of(await task) == expected_tokens(prompt)
            assert time.monotonic() - started < 3.0
            assert [len(p.prefills) for p in c.prefill] == [1, 1] and d.decodes[-1].handle.engine_id == "p1"
            assert (await c.health()).prefill_workers == 1
    run(go())


def test_an_abort_a_silent_prefill_worker_missed_is_sent_again_once_it_answers():
    """Regression (lease leak after a freeze): a prefill worker that stopped answering may hold the request's lease
    once it runs again (its reply lost, or the decode node gave up its READ), and the router's Abort timed out
    meanwhile; that Abort reaches it once it answers a poll again, and only then."""
    def setup(c):
        c.prefill[1].outstanding_prefill_tokens = 1000  # p0 looks emptier: two choices pick it

    async def go():
        async with cluster(2, 1, configure=setup, **FAST) as c:
            p0, p1 = c.prefill
            p0.prefill_delay_s = 60.0
            prompt = list(range(30, 40))
            task = asyncio.create_task(c.generate(prompt, request_id="r", timeout=CLIENT_DEADLINE_S))
            await eventually(lambda: len(p0.prefills) == 1, what="the prefill on p0")
            p0.load_silent = p0.abort_silent = True
            assert tokens_of(await task) == expected_tokens(prompt)
            assert [r.request_id for r in p1.prefills] == ["r"]
            (w0,) = [w for w in c.router.service.prefill_pool.workers if w.info.engine_id == "p0"]
            await eventually(lambda: "r" in w0.unsent_aborts, what="the abort on p0 to time out")
            assert p0.aborts == []
            p0.load_silent = p0.abort_silent = False
            await eventually(lambda: p0.aborts == ["r"], what="the missed abort sent again")
            await eventually(lambda: not w0.unsent_aborts, what="the abort no longer kept")
            assert p0.aborts == ["r"] and "r" not in p1.aborts
    run(go())


def test_a_worker_that_refuses_polls_keeps_the_streams_it_serves():
    """A draining node answers Load with UNAVAILABLE: it leaves rotation, but what it streams finishes there."""
    def setup(c):
        c.decode[1].free_state_slots = 1

    async def go():
        async with cluster(0, 2, configure=setup, **FAST) as c:
            d0, d1 = c.decode
            d0.token_delay_s = 0.05
            call = c.stub.Generate(_request([3, 4], "r", max_tokens=40), timeout=CLIENT_DEADLINE_S)
            got = list((await call.read()).token_ids)
            d0.load_fails = True
            await eventually(lambda: c.router.service.decode_pool.healthy_count() == 1, what="d0 out of rotation")
            while (m := await call.read()) is not grpc.aio.EOF:
                got += m.token_ids
            assert got == expected_tokens([3, 4], 40)
            assert [r.request_id for r in d0.decodes] == ["r"] and d1.decodes == []
    run(go())


def test_keepalive_pings_do_not_cut_a_silent_stream():
    """A node waits as long as it must before a stream's first token (a long queue, a long local prefill): the
    router's pings on that silent call are accepted by a server with the nodes' options, with no Load poll traffic
    in between (a gRPC server's default policy closes the connection as abusive after a few seconds)."""
    async def go():
        async with cluster(0, 1, load_poll_interval_s=60.0) as c:
            c.decode[0].decode_first_delay_s = 6.0
            assert tokens_of(await c.generate([5, 6], timeout=CLIENT_DEADLINE_S)) == expected_tokens([5, 6])
    run(go())
