"""The engine thread -> asyncio hand-over (`node/bridge.py`): order, batching of wake-ups, merging of outputs a
slow consumer has not taken yet."""

import asyncio
import threading

from baton.engine.llm_engine import RequestOutput
from baton.engine.token_logprob import TokenLogprob
from baton.node import bridge


def out(i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id="r", prompt_token_ids=(1, 2), token_ids=tuple(range(i + 1)), new_token_ids=(i,),
                         finished=finished, finish_reason="length" if finished else None, num_drafted=i)


def test_outputs_waiting_for_a_slow_consumer_arrive_merged_in_order():
    async def main():
        stream = bridge.OutputStream()
        # The engine thread pushes a whole request's outputs before the consumer runs.
        t = threading.Thread(target=lambda: [stream.push(out(i, i == 9)) for i in range(10)])
        t.start()
        t.join()
        return [o async for o in stream]

    got = asyncio.run(main())
    assert len(got) == 1
    (o,) = got
    assert o.new_token_ids == tuple(range(10)) and o.token_ids == tuple(range(10))
    assert o.finished and o.finish_reason == "length" and o.num_drafted == 9


def test_merged_outputs_keep_every_tokens_logprobs_and_the_prompt_logprobs():
    prompt_lps = (None, TokenLogprob(2, -0.5))
    first = RequestOutput(request_id="r", prompt_token_ids=(1, 2), token_ids=(5,), new_token_ids=(5,), finished=False,
                          finish_reason=None, logprobs=(TokenLogprob(5, -1.0, ((5, -1.0),)),),
                          prompt_logprobs=prompt_lps)
    then = RequestOutput(request_id="r", prompt_token_ids=(1, 2), token_ids=(5, 6, 7), new_token_ids=(6, 7),
                         finished=True, finish_reason="length",
                         logprobs=(TokenLogprob(6, -2.0, ((4, -0.1),)), TokenLogprob(7, -3.0, ((7, -3.0),))))
    o = bridge.merge_outputs(first, then)
    assert o.new_token_ids == (5, 6, 7) and [x.token_id for x in o.logprobs] == [5, 6, 7]
    assert o.prompt_logprobs == prompt_lps and o.finished
    plain = bridge.merge_outputs(out(0), out(1))
    assert plain.logprobs is None and plain.prompt_logprobs is None


def test_a_keeping_up_consumer_gets_every_output_and_nothing_is_lost():
    async def main():
        stream = bridge.OutputStream()
        loop = asyncio.get_running_loop()
        got = []

        async def consume():
            async for o in stream:
                got.append(o)

        task = asyncio.create_task(consume())
        for i in range(20):
            await loop.run_in_executor(None, stream.push, out(i, i == 19))
            await asyncio.sleep(0.001)
        await task
        return got

    got = asyncio.run(main())
    assert [t for o in got for t in o.new_token_ids] == list(range(20))
    assert got[-1].finished and not any(o.finished for o in got[:-1])
    assert len(got) > 1


def test_one_wake_up_per_batch_of_outputs(monkeypatch):
    async def main():
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe
        monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *a: calls.append(a) or real(*a))
        streams = [bridge.OutputStream() for _ in range(50)]
        # One decode step at batch 50, handed over while the loop is busy: one wake-up.
        t = threading.Thread(target=lambda: [s.push(out(0, True)) for s in streams])
        t.start()
        t.join()
        results = [[o async for o in s] for s in streams]
        return calls, results

    calls, results = asyncio.run(main())
    assert len(calls) == 1
    assert all(len(r) == 1 and r[0].finished for r in results)
