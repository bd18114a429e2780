"""The engine thread survives its observers: a step hook or an output callback that raises is logged and counted,
and every other request goes on (a metrics hook that raised once stopped a decode node for good)."""

from __future__ import annotations

import concurrent.futures
import logging
import time

from baton.engine.engine_thread import EngineThread
from baton.engine.llm_engine import LLMEngine, RequestOutput
from baton.engine.sampling_params import SamplingParams
from tests.test_async_scheduling import assert_all_free, new_engine, tiny  # noqa: F401

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def _submit(thread: EngineThread, rid: str, prompt: list[int], callback=None) -> concurrent.futures.Future:
    """Add a request; the Future resolves with its finished output."""
    done: concurrent.futures.Future[RequestOutput] = concurrent.futures.Future()

    def deliver(out: RequestOutput) -> None:
        if callback is not None:
            callback(out)
        if out.finished:
            done.set_result(out)

    def add(engine: LLMEngine) -> None:
        engine.add_request(prompt, PARAMS, request_id=rid)
        thread.on_output(rid, deliver)

    thread.call(add).result(timeout=30)
    return done


def _wait_idle(thread: EngineThread) -> None:
    deadline = time.monotonic() + 30
    while thread.call(lambda e: e.has_unfinished()).result(timeout=30):
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)


def test_a_step_hook_that_raises_is_logged_and_counted_and_the_engine_goes_on(tiny, caplog):  # noqa: F811
    engine = new_engine(tiny, True)
    calls = []

    def flaky(e: LLMEngine) -> None:
        calls.append(e.stats.steps)
        if len(calls) % 3 == 1:
            raise ValueError("Counters can only be incremented by non-negative amounts.")

    thread = EngineThread(engine)
    thread.step_hooks.append(flaky)
    thread.start()
    try:
        with caplog.at_level(logging.ERROR, logger="baton.engine"):
            futures = [_submit(thread, f"r{i}", [3 + i, 4, 5, 6][: 1 + i]) for i in range(4)]
            outs = [f.result(timeout=60) for f in futures]
        assert all(o.finish_reason == "length" and len(o.token_ids) == PARAMS.max_tokens for o in outs)
        assert thread.alive() and thread.error is None
        assert thread.observer_errors == sum(1 for i in range(len(calls)) if i % 3 == 0) > 0
        assert "step hook" in caplog.text and "non-negative" in caplog.text
    finally:
        thread.stop()
    assert_all_free(engine)


def test_an_output_callback_that_raises_aborts_its_request_only(tiny, caplog):  # noqa: F811
    engine = new_engine(tiny, True)
    thread = EngineThread(engine).start()
    try:
        def broken(out: RequestOutput) -> None:
            if out.new_token_ids:
                raise RuntimeError("consumer gone")

        with caplog.at_level(logging.ERROR, logger="baton.engine"):
            bad = _submit(thread, "bad", [7, 8, 9], broken)
            good = _submit(thread, "good", [3, 4])
            assert good.result(timeout=60).finish_reason == "length"
            _wait_idle(thread)
        assert not bad.done()  # its consumer failed on its first token: nothing more was delivered
        assert thread.alive() and thread.observer_errors == 1
        assert "request bad" in caplog.text
        assert "bad" not in engine.scheduler.requests
    finally:
        thread.stop()
    assert_all_free(engine)


def test_an_id_reused_while_its_last_user_ends_in_a_step_in_flight_serves_the_new_request(tiny):  # noqa: F811
    # With async scheduling a request's end is known when its last step is launched, and its id is free at once;
    # that step's read once dropped the runner's sampling state under the id, now the new request's, and the next
    # launch raised KeyError on the engine thread (a decode node then failed every call). Reused the same way after
    # an abort too.
    ref = new_engine(tiny, False).generate([[7, 8, 9]], PARAMS)[0]
    for end in ("finished", "aborted"):
        engine = new_engine(tiny, True)
        engine.add_request([3, 4, 5, 6], PARAMS, request_id="r")
        if end == "finished":
            while "r" in engine.scheduler.requests:
                engine.step()
        else:
            for _ in range(3):
                engine.step()
            assert engine.abort("r")
        assert engine.pipeline.steps  # the old request's last step is not read yet
        engine.add_request([7, 8, 9], PARAMS, request_id="r")
        outs = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.prompt_token_ids == (7, 8, 9):
                    outs[o.request_id] = o
        assert outs["r"].finished and list(outs["r"].token_ids) == list(ref.token_ids), end
        assert_all_free(engine)
        assert not engine._owners and not engine.runner._sampling  # nothing left behind under the id
