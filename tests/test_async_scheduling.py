"""Async scheduling (issue #7 item 3): step n+1 is scheduled and launched before step n's tokens are read.

Checked here: the same outputs as one-step-at-a-time (greedy, seeded sampling, stops, length limits,
preemption, prefill-only), the launch/read order that makes the overlap possible, the quarantine of caches
freed while a step is in flight (R5/R7: nothing a step in flight may write is handed out), and on a GPU that
a pipelined step never synchronises the host with the device except through the event of its tokens."""

import random
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

from baton.engine.engine_config import EngineConfig
from baton.engine.engine_thread import EngineThread
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.pending_step import PendingStep, device_mark
from baton.engine.request import PENDING
from baton.engine.sampling_params import SamplingParams

BASE = {"max_num_seqs": 8, "max_num_batched_tokens": 32, "block_size": 8}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    make_model(out, preset="tiny", seed=5, progress=False)
    return load_checkpoint(out)


def new_engine(tiny, async_on: bool, **kw) -> LLMEngine:
    cfg, weights = tiny
    return LLMEngine(cfg, weights, EngineConfig(**{**BASE, "async_scheduling": async_on, **kw}))


def serve(engine: LLMEngine, arrivals: list[list[tuple[str, list[int], SamplingParams]]]) -> dict:
    """Requests added in waves (wave i before step i), stepped to the end; request id -> final output."""
    done, i = {}, 0
    while i < len(arrivals) or engine.has_unfinished():
        for rid, prompt, params in arrivals[i] if i < len(arrivals) else ():
            engine.add_request(prompt, params, request_id=rid)
        i += 1
        for o in engine.step():
            assert PENDING not in o.token_ids
            if o.finished:
                assert o.request_id not in done
                done[o.request_id] = o
    return done


def assert_all_free(engine: LLMEngine) -> None:
    s = engine.scheduler
    assert not s.cache.quarantine
    assert s.cache.blocks.num_free == s.cache.blocks.capacity and s.cache.slots.num_free == s.cache.slots.capacity


def workload(seed: int, vocab: int, stop_every: int = 0) -> list[list[tuple[str, list[int], SamplingParams]]]:
    """Staggered arrivals: prompts of 1..40 tokens, greedy and seeded top-k/top-p rows, various max_tokens."""
    rng = random.Random(seed)
    waves = []
    for w in range(6):
        wave = []
        for j in range(rng.randrange(1, 4)):
            n = rng.choice([1, 2, 7, 8, 9, 17, 40])
            prompt = [rng.randrange(3, vocab) for _ in range(n)]
            if rng.random() < 0.5:
                params = SamplingParams(max_tokens=rng.randrange(1, 14), ignore_eos=True)
            else:
                params = SamplingParams(max_tokens=rng.randrange(1, 14), temperature=0.9, top_k=20, top_p=0.9,
                                        seed=rng.randrange(1000), ignore_eos=True)
            wave.append((f"w{w}-{j}", prompt, params))
        waves.append(wave)
    return waves


def with_stops(waves, ref: dict):
    """The same waves, each request stopping on the token its reference output has at position 2 (so that
    stops land mid-stream, on a step whose successor was already launched)."""
    out = []
    for wave in waves:
        out.append([(rid, p, SamplingParams(**{**_fields(sp), "stop_token_ids": (ref[rid].token_ids[2],)}))
                    if len(ref[rid].token_ids) > 3 else (rid, p, sp) for rid, p, sp in wave])
    return out


def _fields(sp: SamplingParams) -> dict:
    return {f: getattr(sp, f) for f in ("max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos")}


def summary(done: dict) -> dict:
    return {r: (o.token_ids, o.finish_reason) for r, o in done.items()}


@pytest.mark.parametrize("seed", [0, 1])
def test_async_outputs_equal_one_step_at_a_time(tiny, seed):
    vocab = tiny[0].vocab_size
    waves = workload(seed, vocab)
    sync_engine = new_engine(tiny, False)
    ref = serve(sync_engine, waves)
    engine = new_engine(tiny, True)
    assert engine.depth == 1 and sync_engine.depth == 0
    got = serve(engine, waves)
    assert summary(got) == summary(ref)
    assert_all_free(engine)
    # Stops land on tokens whose request was already scheduled into the next step: that row is dropped.
    stop_waves = with_stops(waves, ref)
    ref_stop = serve(new_engine(tiny, False), stop_waves)
    assert any(o.finish_reason == "stop" for o in ref_stop.values())
    engine = new_engine(tiny, True)
    got_stop = serve(engine, stop_waves)
    assert summary(got_stop) == summary(ref_stop)
    assert_all_free(engine)


def test_cpu_steps_count_no_gpu_time(tiny):
    """GPU time (`EngineStats.device_seconds`) comes from CUDA events only: a CPU engine's steps count none."""
    engine = new_engine(tiny, True)
    serve(engine, workload(2, tiny[0].vocab_size))
    assert engine.stats.steps > 0 and engine.stats.step_seconds > 0
    assert engine.stats.device_seconds == 0.0


def test_async_with_preemption_equals_one_step_at_a_time(tiny):
    """A pool too small for every running request: preemption by recompute while a step is in flight."""
    vocab = tiny[0].vocab_size
    rng = random.Random(7)
    waves = [[(f"r{i}", [rng.randrange(3, vocab) for _ in range(20)], SamplingParams(max_tokens=24, ignore_eos=True))
              for i in range(6)]]
    ref_engine = new_engine(tiny, False, num_kv_blocks=14)
    ref = serve(ref_engine, waves)
    assert ref_engine.scheduler.num_preemptions > 0
    engine = new_engine(tiny, True, num_kv_blocks=14)
    got = serve(engine, waves)
    assert engine.scheduler.num_preemptions > 0
    assert summary(got) == summary(ref)
    assert_all_free(engine)


def test_step_n_plus_1_is_launched_before_step_n_is_read(tiny, monkeypatch):
    engine = new_engine(tiny, True)
    log: list[str] = []
    launch, result = engine.runner.launch, PendingStep.result

    def spy_launch(out, prev=None, **kw):
        log.append(f"launch {sorted(r.request_id for r in out.rows)}")
        return launch(out, prev, **kw)

    def spy_result(self):
        log.append("read")
        return result(self)

    monkeypatch.setattr(engine.runner, "launch", spy_launch)
    monkeypatch.setattr(PendingStep, "result", spy_result)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), request_id="a")
    assert engine.step() == []  # step 1 launched; nothing read yet
    assert engine.has_unfinished()
    outs = engine.step()  # step 2 launched (its input is step 1's token, on the device), then step 1 read
    assert [o.new_token_ids for o in outs] == [(engine.scheduler.requests["a"].output_token_ids[0],)]
    assert engine.scheduler.requests["a"].output_token_ids[1] == PENDING
    while engine.has_unfinished():
        engine.step()
    # Step 3 is the last (max_tokens = 3, known when it is launched): nothing is launched after it.
    assert log == ["launch ['a']", "launch ['a']", "read", "launch ['a']", "read", "read"]
    assert_all_free(engine)


def test_caches_freed_while_a_step_is_in_flight_are_not_handed_out(tiny):
    """R5/R7: an aborted request's blocks and slot may still be written by the step in flight; reserve() (a
    transfer's target) and new requests must not get them until that step is read."""
    engine = new_engine(tiny, True, num_kv_blocks=6, max_num_seqs=2)
    s = engine.scheduler
    engine.add_request(list(range(3, 30)), SamplingParams(max_tokens=8, ignore_eos=True), request_id="a")
    engine.step()  # a's prefill is in flight (4 blocks, 1 slot)
    free_blocks, free_slots = s.cache.blocks.num_free, s.cache.slots.num_free
    assert free_blocks == 2 and free_slots == 1
    assert engine.abort("a")
    assert (s.cache.blocks.num_free, s.cache.slots.num_free) == (free_blocks, free_slots)  # quarantined
    assert engine.reserve(3 * 8) is None  # would need a's blocks
    assert engine.has_unfinished()
    assert engine.step() == []  # reads the step in flight (a's row is dropped: aborted)
    assert_all_free(engine)
    assert engine.reserve(3 * 8) is not None


def test_length_limit_finishes_at_launch_and_launches_nothing_more(tiny):
    engine = new_engine(tiny, True)
    engine.add_request([4, 5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True), request_id="one")
    assert engine.step() == []
    # Finished by length when launched: its caches wait in quarantine, and no further step includes it.
    assert "one" not in engine.scheduler.requests and engine.cache.quarantine
    (o,) = engine.step()
    assert o.finished and o.finish_reason == "length" and len(o.token_ids) == 1
    assert engine.last_step_rows == 1 and not engine.has_unfinished()
    assert_all_free(engine)


def test_prefill_only_engine_pipelines_and_hands_over_computed_caches(tiny):
    """A prefill node's steps never sample: every step is pipelined. A prefilled output comes only once its
    step is read (a transfer must not read caches still being written), with the same caches as sync."""
    cfg, _ = tiny
    rng = random.Random(3)
    prompts = {f"p{i}": [rng.randrange(3, cfg.vocab_size) for _ in range(n)] for i, n in enumerate((5, 33, 70))}
    held = {}
    for async_on in (False, True):
        engine = new_engine(tiny, async_on, prefill_only=True)
        for rid, p in prompts.items():
            engine.add_request(p, SamplingParams(max_tokens=4), request_id=rid, prefill_only=True)
        outs = [o for _ in range(40) if engine.has_unfinished() for o in engine.step()]
        assert sorted(o.request_id for o in outs) == sorted(prompts)
        assert all(o.finished and o.finish_reason == "prefilled" and o.held_state_slot is not None for o in outs)
        held[async_on] = {o.request_id: (engine.pools.ssm[o.held_state_slot].clone(),
                                         engine.pools.kv[list(o.held_block_ids)].clone()) for o in outs}
    for rid in prompts:
        assert torch.equal(held[True][rid][0], held[False][rid][0])
        assert torch.equal(held[True][rid][1], held[False][rid][1])


def test_abort_between_a_prefill_finishing_and_its_output_frees_the_held_caches(tiny):
    """R7 with async scheduling: a prefill-only request finishes when its last chunk is launched, and its caches
    are handed over with that step's output. An abort in between (a client cancel) must free them."""
    engine = new_engine(tiny, True, prefill_only=True)
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=1), request_id="p", prefill_only=True)
    assert engine.step() == []  # launched; finished in the scheduler, not read
    assert "p" not in engine.scheduler.requests
    assert engine.abort("p")
    assert engine.step() == []  # read: no prefilled output for an aborted request
    assert not engine.has_unfinished()
    assert_all_free(engine)


def test_abort_from_the_engine_thread_reports_no_pending_token(tiny):
    engine = new_engine(tiny, True)
    thread = EngineThread(engine).start()
    try:
        got = []

        def add(e):
            rid = e.add_request([3, 4, 5], SamplingParams(max_tokens=10_000, ignore_eos=True), request_id="x")
            thread.on_output(rid, got.append)

        thread.call(add).result(timeout=30)
        while not any(o.new_token_ids for o in got):
            pass
        assert thread.abort("x").result(timeout=30)
        last = got[-1]
        assert last.finished and last.finish_reason == "abort" and PENDING not in last.token_ids
    finally:
        thread.stop()
    assert_all_free(engine)


def test_a_pending_input_without_its_step_is_refused(tiny):
    engine = new_engine(tiny, True)
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=5, ignore_eos=True), request_id="a")
    engine.step()
    out = engine.scheduler.schedule()  # a's input is step 1's token, PENDING
    assert out.rows[0].token_ids == (PENDING,)
    with pytest.raises(RuntimeError, match="PENDING input token that no step in flight samples"):
        engine.runner.launch(out, None)


def test_config_and_cli_flag():
    import argparse

    from baton.node.engine_args import add_engine_args, engine_config_from_args

    with pytest.raises(ValueError, match="'async_scheduling': expected True or False, got 'yes'"):
        EngineConfig(async_scheduling="yes")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).async_scheduling is True
    assert engine_config_from_args(p.parse_args(["--async-scheduling", "off"])).async_scheduling is False


# ---- GPU ---------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_async_equals_sync(tiny, graphs):
    """On CUDA (decode steps as graphs, or eager): the same tokens with and without async scheduling."""
    vocab = tiny[0].vocab_size
    waves = workload(4, vocab)
    ref = serve(new_engine(tiny, False, device="cuda", cuda_graphs=graphs), waves)
    engine = new_engine(tiny, True, device="cuda", cuda_graphs=graphs)
    assert summary(serve(engine, waves)) == summary(ref)
    assert_all_free(engine)


@pytest.mark.gpu
def test_gpu_pipelined_steps_never_synchronize(tiny):
    """Item 3's "no host-device sync inside a step except reading sampled tokens": with CUDA's sync debug mode
    on, decode steps (graphs), mixed prefill + decode steps (eager) and seeded sampling make no synchronising
    call but the wait on each step's token event (`PendingStep.result`). Every other one is reported, with
    where it was made."""
    vocab = tiny[0].vocab_size
    engine = new_engine(tiny, True, device="cuda")
    assert engine.runner.graphs is not None
    engine.capture_graphs()
    waves = workload(5, vocab)
    serve(engine, waves[:1])  # warm-up: Triton compiles outside the check
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            done = serve(engine, waves)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert len(done) == sum(len(w) for w in waves)
    # (The mode's own "prototype feature" warning is not a synchronising call.)
    syncs = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                    if "called a synchronizing CUDA operation" in str(w.message))
    allowed = {k for k in syncs if k.startswith("pending_step.py:")}
    assert not set(syncs) - allowed, f"synchronising calls: {dict(syncs)}"
    assert_all_free(engine)


@pytest.mark.gpu
def test_gpu_a_step_that_samples_nothing_is_still_waited_for():
    """A prefill node's step samples nothing, but its outputs hand caches to another process: reading it must
    wait until its kernels are done."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(30):
        a = (a @ a).tanh()  # some milliseconds of queued work, standing in for a prefill step
    pending = PendingStep([], None, torch.device("cuda"))
    assert pending.result() == ({}, None)
    assert torch.cuda.current_stream().query()


@pytest.mark.gpu
def test_gpu_step_device_seconds_time_the_work_between_the_marks():
    """`device_seconds()` is the GPU's time from a step's start mark to its end event: a queued 20 ms spin reads
    as about 20 ms, whatever the host did meanwhile; a step without a mark reads 0."""
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    cycles = int(0.02 * torch.cuda.clock_rate() * 1e6)  # clock_rate in MHz: ~20 ms of spinning
    started = device_mark(dev)
    torch.cuda._sleep(cycles)
    pending = PendingStep([], None, dev, started=started)
    assert pending.result() == ({}, None)
    # The SM clock may run below clock_rate (power or thermal limits): longer, never much shorter.
    assert 0.015 < pending.device_seconds() < 0.2
    unmarked = PendingStep([], None, dev)
    unmarked.result()
    assert unmarked.device_seconds() == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_engine_counts_the_gpu_time_of_its_steps(tiny, graphs):
    """The engine sums its steps' GPU time (`EngineStats.device_seconds`): more than nothing, less than the wall
    time the engine ran for."""
    engine = new_engine(tiny, True, device="cuda", cuda_graphs=graphs)
    waves = workload(4, tiny[0].vocab_size)
    serve(engine, waves[:1])  # warm-up: Triton compiles and captures are host time, not GPU time
    before = engine.stats.device_seconds
    t0 = time.perf_counter()
    serve(engine, waves)
    wall = time.perf_counter() - t0
    assert 0 < engine.stats.device_seconds - before < wall
