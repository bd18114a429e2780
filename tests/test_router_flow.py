"""The request flow through the router over fake nodes: routing by length, prefill retry and local
fallback, decode retry before the first token, errors passed through with their status."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from baton.proto.v1 import generation_pb2
from tests.test_router_fakes import cluster, eventually, expected_tokens, run, spec_totals, tokens_of

LENGTH = generation_pb2.FINISH_REASON_LENGTH


def _check_answer(msgs, prompt, n=16):
    assert tokens_of(msgs) == expected_tokens(prompt, n)
    last = msgs[-1]
    assert last.finish_reason == LENGTH and all(m.finish_reason == 0 for m in msgs[:-1])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), n)
    assert all(not m.HasField("usage") for m in msgs[:-1])
    assert len({m.request_id for m in msgs}) == 1 and msgs[0].request_id


def test_routing_by_length_and_threshold():
    async def go():
        async with cluster(1, 1, local_prefill_threshold=4) as c:
            (p,), (d,) = c.prefill, c.decode
            for n in (1, 2, 4):  # <= threshold (and always 1): straight to decode, no handle
                msgs = await c.generate(list(range(10, 10 + n)), max_tokens=5)
                _check_answer(msgs, list(range(10, 10 + n)), 5)
                assert not d.decodes[-1].HasField("handle")
            assert p.prefills == []
            prompt = list(range(20, 25))  # 5 > threshold: prefill N-1 there, decode with the handle
            msgs = await c.generate(prompt, request_id="r5")
            _check_answer(msgs, prompt)
            assert msgs[0].request_id == "r5"
            assert list(p.prefills[-1].prompt_token_ids) == prompt and p.prefills[-1].request_id == "r5"
            h = d.decodes[-1].handle
            assert d.decodes[-1].HasField("handle") and h.engine_id == "p0" and h.num_tokens == 4
            # A consumed handle is not aborted; a request that ended normally aborts nothing.
            assert p.aborts == [] and d.aborts == []
    run(go())


def test_default_threshold_disaggregates_from_two_tokens_and_no_prefill_workers_means_local():
    async def go():
        async with cluster(1, 1) as c:
            await c.generate([5])
            await c.generate([5, 6])
            assert [len(r.prompt_token_ids) for r in c.prefill[0].prefills] == [2]
            assert [r.HasField("handle") for r in c.decode[0].decodes] == [False, True]
        async with cluster(0, 1) as c:
            _check_answer(await c.generate(list(range(30))), list(range(30)))
            assert not c.decode[0].decodes[0].HasField("handle")
    run(go())


def test_prefill_overflow_routes_to_the_decode_node_while_every_prefill_queue_is_past_the_limit():
    """prefill_queue_limit_tokens: a prompt goes to a prefill node unless every healthy one has more than the limit
    queued, counting what its last Load reported plus what this router sent since; then its decode node prefills
    it ("prefill_overflow"), until a queue drains."""
    def decisions(c):
        reg = c.router.service.metrics.registry
        return {d: reg.get_sample_value("baton_router_routing_decisions_total", {"decision": d})
                for d in ("disaggregated", "local_prefill", "prefill_overflow", "fallback")}

    async def go():
        def setup(c):
            for p in c.prefill:
                p.prefill_delay_s = 2.0  # prefills stay queued while the next requests arrive
                p.max_num_batched_tokens = 8  # two steps in flight: 16 of a worker's tokens are not queued

        # No poll after the first: the router's own count of what it sent is all it knows of the queues.
        async with cluster(2, 1, configure=setup, prefill_queue_limit_tokens=100, load_poll_interval_s=60.0) as c:
            (p0, p1), (d,) = c.prefill, c.decode
            prompt = list(range(10, 70))  # 60 tokens: the router counts 59 outstanding per prefill it sends
            first = [asyncio.create_task(c.generate(prompt, request_id=f"r{i}")) for i in range(4)]
            await eventually(lambda: len(p0.prefills) + len(p1.prefills) == 4, what="four prefills")
            # Each worker has 2 x 59 - 16 = 102 > 100 queued: the fifth request is prefilled on the decode node.
            assert sorted((len(p0.prefills), len(p1.prefills))) == [2, 2]
            late = await c.generate(list(range(100, 160)), request_id="late")
            _check_answer(late, list(range(100, 160)))
            assert not d.decodes[-1].HasField("handle") and d.decodes[-1].request_id == "late"
            for t in first:
                _check_answer(await t, prompt)
            assert decisions(c) == {"disaggregated": 4, "local_prefill": 0, "prefill_overflow": 1, "fallback": 0}
            # The queues drained (the prefills were answered): the next prompt goes to a prefill node again.
            await c.generate(prompt, request_id="after")
            assert d.decodes[-1].HasField("handle") and len(p0.prefills) + len(p1.prefills) == 5
            assert decisions(c)["disaggregated"] == 5
    run(go())


def test_prefill_overflow_does_not_count_the_steps_a_prefill_worker_has_in_flight():
    """The router counts a prompt until its Prefill call returns, yet a prefill node computing with async scheduling
    has up to two steps launched (one on the device, the next queued behind it) and the prompts in them are not
    waiting. Only what lies past two steps of the worker's budget is queued against prefill_queue_limit_tokens:
    otherwise a limit of two steps overflows prompts while the worker's queue is empty, and it idles."""
    async def go():
        def setup(c):
            c.prefill[0].prefill_delay_s = 2.0  # prefills stay outstanding while the next requests arrive

        async with cluster(1, 1, configure=setup, prefill_queue_limit_tokens=100, load_poll_interval_s=60.0) as c:
            (p,), (d,) = c.prefill, c.decode
            assert p.max_num_batched_tokens == 64  # its Info: up to 2 x 64 tokens in flight
            prompt = list(range(10, 70))  # 59 tokens outstanding per prefill
            first = [asyncio.create_task(c.generate(prompt, request_id=f"r{i}")) for i in range(4)]
            # 3 x 59 - 128 = 49 queued when the fourth arrives: it is prefilled there too.
            await eventually(lambda: len(p.prefills) == 4, what="four prefills")
            # 4 x 59 - 128 = 108 > 100: the fifth goes to the decode node.
            await c.generate(list(range(100, 160)), request_id="late")
            assert not d.decodes[-1].HasField("handle") and d.decodes[-1].request_id == "late"
            for t in first:
                _check_answer(await t, prompt)
    run(go())


def test_decode_workers_with_a_prefill_backlog_get_no_new_prompts_until_it_drains():
    """Aggregated serving (no prefill workers): a decode node that reports whole steps of prompts still to prefill
    gets no new prompt while another has none, even with more free slots; once it reports none, slots decide."""
    def setup(c):
        c.decode[0].free_state_slots, c.decode[0].outstanding_prefill_tokens = 50, 1000  # ~15 steps of 64
        c.decode[1].free_state_slots = 8

    async def go():
        async with cluster(0, 2, configure=setup) as c:
            d0, d1 = c.decode
            for i in range(6):
                await c.generate(list(range(10, 30)), request_id=f"a{i}", max_tokens=2)
            assert (len(d0.decodes), len(d1.decodes)) == (0, 6)
            d0.outstanding_prefill_tokens = 0
            (w0,) = [w for w in c.router.service.decode_pool.workers if w.info.engine_id == "d0"]
            await eventually(lambda: w0.tracker.load(True).outstanding_prefill_tokens == 0, what="a poll of d0")
            for i in range(6):
                await c.generate(list(range(10, 30)), request_id=f"b{i}", max_tokens=2)
            assert len(d0.decodes) == 6  # 50 free slots against 8: d0 wins every pair now
    run(go())


async def _read_all(call):
    while (m := await call.read()) is not grpc.aio.EOF:
        yield m


def test_mtp_totals_of_the_last_decode_message_go_into_usage():
    async def go():
        async with cluster(1, 1) as c:
            prompt = list(range(20, 30))
            msgs = await c.generate(prompt, max_tokens=7)
            _check_answer(msgs, prompt, 7)
            # A decode node without speculative decoding reports zeros.
            assert (msgs[-1].usage.num_drafted_tokens, msgs[-1].usage.num_accepted_tokens) == (0, 0)
            c.decode[0].spec_k = 2
            for p in (prompt, [5]):  # disaggregated, and prefilled on the decode node
                msgs = await c.generate(p, max_tokens=7)
                _check_answer(msgs, p, 7)
                usage = msgs[-1].usage
                assert (usage.num_drafted_tokens, usage.num_accepted_tokens) == spec_totals(2, 7) == (14, 3)
            # Aborted mid-stream: the last message's Usage holds the totals of what was streamed.
            c.decode[0].token_delay_s = 0.05
            req = generation_pb2.GenerateRequest(request_id="ab", token_ids=generation_pb2.TokenIds(ids=prompt),
                                                 sampling=generation_pb2.SamplingParams(max_tokens=50))
            call = c.stub.Generate(req, timeout=10)
            got = []
            while len(got) < 3:
                got += (await call.read()).token_ids
            assert (await c.stub.Abort(generation_pb2.AbortRequest(request_id="ab"))).found
            rest = [m async for m in _read_all(call)]
            n = len(got) + sum(len(m.token_ids) for m in rest)
            usage = rest[-1].usage
            assert rest[-1].finish_reason == generation_pb2.FINISH_REASON_ABORT and usage.completion_tokens == n < 50
            assert (usage.num_drafted_tokens, usage.num_accepted_tokens) == spec_totals(2, n)
    run(go())


def test_prefill_failure_retries_on_another_worker():
    async def go():
        def setup(c):
            # p1 reports a long queue, so two choices pick p0 first; p0 fails.
            c.prefill[0].prefill_failures = -1
            c.prefill[1].outstanding_prefill_tokens = 1000

        async with cluster(2, 1, configure=setup) as c:
            (p0, p1), (d,) = c.prefill, c.decode
            prompt = list(range(40, 48))
            _check_answer(await c.generate(prompt, request_id="r"), prompt)
            assert [len(p.prefills) for p in c.prefill] == [1, 1]
            assert d.decodes[0].handle.engine_id == "p1"
            # The failed worker is told to drop whatever it may hold; the winner's handle was consumed.
            await eventually(lambda: p0.aborts == ["r"], what="abort")
            assert p1.aborts == []
    run(go())


def test_prefill_failing_everywhere_falls_back_to_local_prefill():
    async def go():
        async with cluster(2, 1) as c:
            for p in c.prefill:
                p.prefill_failures = -1
            prompt = list(range(7, 17))
            _check_answer(await c.generate(prompt), prompt)
            assert [len(p.prefills) for p in c.prefill] == [1, 1]  # one retry, not more
            assert not c.decode[0].decodes[0].HasField("handle")
    run(go())


def test_single_prefill_worker_failing_falls_back_without_a_retry():
    async def go():
        async with cluster(1, 1) as c:
            c.prefill[0].prefill_failures = -1
            prompt = list(range(3, 9))
            _check_answer(await c.generate(prompt), prompt)
            assert len(c.prefill[0].prefills) == 1
            assert not c.decode[0].decodes[0].HasField("handle")
    run(go())


def test_prefill_timeout_and_a_wrong_handle_fall_back():
    async def go():
        async with cluster(1, 1, prefill_timeout_s=0.2) as c:
            (p,), (d,) = c.prefill, c.decode
            p.prefill_delay_s = 5.0
            prompt = list(range(50, 60))
            _check_answer(await c.generate(prompt, request_id="slow"), prompt)
            assert not d.decodes[-1].HasField("handle")
            await eventually(lambda: "slow" in p.aborts, what="abort of the timed-out prefill")
            # R1 guard: a handle covering all N tokens is refused (and released), decode prefills locally.
            p.prefill_delay_s, p.prefill_wrong_tokens = 0.0, True
            _check_answer(await c.generate(prompt, request_id="wrong"), prompt)
            assert not d.decodes[-1].HasField("handle")
            await eventually(lambda: "wrong" in p.aborts, what="release of the wrong handle")
    run(go())


def test_failed_pull_releases_the_prefill_lease():
    async def go():
        async with cluster(1, 1) as c:
            c.decode[0].pull_fails = True  # the decode node prefilled locally although it got a handle
            prompt = list(range(60, 70))
            _check_answer(await c.generate(prompt, request_id="r"), prompt)
            await eventually(lambda: c.prefill[0].aborts == ["r"], what="lease release")
    run(go())


def test_decode_unavailable_before_first_token_is_retried_on_another_worker():
    async def go():
        def setup(c):
            # d0 looks emptier, so two choices pick it first; it fails before any token.
            c.decode[0].decode_error = grpc.StatusCode.UNAVAILABLE
            c.decode[1].free_state_slots = 1

        async with cluster(1, 2, configure=setup) as c:
            (p,), (d0, d1) = c.prefill, c.decode
            prompt = list(range(9, 19))
            _check_answer(await c.generate(prompt, request_id="r"), prompt)
            assert len(d0.decodes) == 1 and len(d1.decodes) == 1
            assert d0.decodes[0].HasField("handle")
            # The retry prefills locally (the failed node may have consumed part of the handle), and the
            # handle's lease is released on the prefill node.
            assert not d1.decodes[0].HasField("handle")
            await eventually(lambda: p.aborts == ["r"] and d0.aborts == ["r"], what="aborts")
            assert (await c.health()).decode_workers == 1  # d0 is out of rotation until it answers a poll
    run(go())


def test_decode_failing_on_every_worker_is_unavailable():
    async def go():
        async with cluster(0, 2) as c:
            for d in c.decode:
                d.decode_error = grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate([1, 2, 3])
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "retry failed too" in e.value.details() and "d0" in e.value.details()
            assert [len(d.decodes) for d in c.decode] == [1, 1]
        async with cluster(0, 1) as c:
            c.decode[0].decode_error = grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate([1, 2, 3])
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no other healthy decode worker" in e.value.details()
    run(go())


def test_decode_failure_after_tokens_is_unavailable_without_retry():
    async def go():
        async with cluster(0, 2) as c:
            for d in c.decode:
                d.decode_fail_after = 3
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as e:
                req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[4, 5]))
                async for m in c.stub.Generate(req, timeout=10):
                    got.extend(m.token_ids)
            assert got == expected_tokens([4, 5])[:3]
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "after 3 tokens were streamed" in e.value.details()
            assert sum(len(d.decodes) for d in c.decode) == 1
    run(go())


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT])
def test_decode_errors_pass_through(code):
    async def go():
        async with cluster(0, 2) as c:
            for d in c.decode:
                d.decode_error = code
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate([1, 2, 3])
            assert e.value.code() == code and "decode failed (fake)" in e.value.details()
            assert sum(len(d.decodes) for d in c.decode) == 1  # not retried
    run(go())


def test_silent_decode_worker_hits_the_idle_deadline():
    async def go():
        async with cluster(0, 1, decode_idle_timeout_s=0.3) as c:
            c.decode[0].token_delay_s = 5.0
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate([1, 2], request_id="idle")
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "sent nothing for 0.3 s" in e.value.details()
            await eventually(lambda: c.decode[0].aborts == ["idle"], what="abort")
    run(go())


def test_many_requests_in_flight_at_once():
    import asyncio

    async def go():
        async with cluster(2, 2) as c:
            for w in c.prefill + c.decode:
                w.token_delay_s = 0.01
            prompts = [list(range(i, i + 1 + i % 7)) for i in range(40)]
            outs = await asyncio.gather(*(c.generate(p, max_tokens=8) for p in prompts))
            for p, msgs in zip(prompts, outs, strict=True):
                _check_answer(msgs, p, 8)
            assert all(d.active == set() for d in c.decode)
    run(go())
