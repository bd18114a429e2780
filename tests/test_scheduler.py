"""Scheduler policy on ints only: budget, decode-first reservation, chunk caps, FCFS, preemption, R2, R7."""

import random

import pytest

from baton.engine.engine_config import EngineConfig
from baton.engine.request import Request
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler import Scheduler
from baton.engine.step_update import StepUpdate

_arrival = iter(range(10**9))


def make_req(rid, n_prompt, max_tokens=4, stop=()):
    return Request(request_id=rid, prompt_token_ids=list(range(1, n_prompt + 1)),
                   sampling=SamplingParams(max_tokens=max_tokens), arrival=next(_arrival), stop_ids=frozenset(stop))


def run_step(s, token=7):
    out = s.schedule()
    StepUpdate(s).update(out, {r.request_id: token for r in out.rows if r.sample})
    return out


def test_r2_new_one_token_prompt_is_a_prefill_without_state():
    # R2: a new short prompt is a prefill whatever its query length; its slot is never read.
    s = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=64), num_blocks=16, num_slots=4)
    s.add(make_req("a", 1))
    out = s.schedule()
    (row,) = out.rows
    assert row.num_tokens == 1 and not row.is_decode and not row.has_initial_state and row.sample
    StepUpdate(s).update(out, {"a": 5})
    (row,) = s.schedule().rows
    assert row.is_decode and row.has_initial_state and row.token_ids == (5,)


def test_r5_decode_rows_reserved_first_and_prefill_chunks_capped():
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=20, long_prefill_token_threshold=8)
    s = Scheduler(cfg, num_blocks=64, num_slots=8)
    for i in range(3):
        s.add(make_req(f"d{i}", 2, max_tokens=10))
    run_step(s)  # all three prefill (2 tokens each) and sample
    s.add(make_req("long", 50))
    s.add(make_req("long2", 50))
    out = s.schedule()
    kinds = [(r.request_id, r.is_decode, r.num_tokens) for r in out.rows]
    assert kinds[:3] == [("d0", True, 1), ("d1", True, 1), ("d2", True, 1)]
    assert kinds[3] == ("long", False, 8)  # capped by long_prefill_token_threshold
    assert kinds[4] == ("long2", False, 8)
    assert out.num_tokens <= cfg.max_num_batched_tokens and out.is_mixed
    # Later chunks of a prompt have state; they neither sample nor count as decodes.
    StepUpdate(s).update(out, {r.request_id: 7 for r in out.rows if r.sample})
    row = next(r for r in s.schedule().rows if r.request_id == "long")
    assert row.has_initial_state and not row.is_decode and not row.sample and row.num_computed_tokens == 8


def test_budget_limits_admission_fcfs_without_overtaking():
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=10)
    s = Scheduler(cfg, num_blocks=4, num_slots=8)  # 4 blocks x 16 tokens
    s.add(make_req("big", 60))
    s.add(make_req("small", 1))
    out = s.schedule()
    assert [r.request_id for r in out.rows] == ["big"] and out.rows[0].num_tokens == 10
    StepUpdate(s).update(out, {})
    # "big" holds 1 block for 10 tokens; it grows into 4 blocks, "small" must wait and not overtake.
    ids = [[r.request_id for r in run_step(s).rows] for _ in range(5)]
    assert ids[0][0] == "big"
    assert all("small" not in x for x in ids[:4])


def test_preemption_by_recompute_when_blocks_run_out():
    cfg = EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    s = Scheduler(cfg, num_blocks=4, num_slots=4)
    a, b = make_req("a", 7, max_tokens=8), make_req("b", 7, max_tokens=8)
    s.add(a)
    s.add(b)
    run_step(s)  # each: 7 tokens -> 2 blocks; pool full
    assert s.cache.blocks.num_free == 0
    out = run_step(s)  # a and b decode position 7 (still in their 2nd block)
    assert not out.preempted
    out = run_step(s)
    assert out.preempted == ("b",)  # latest arrival preempted when a needs a 3rd block
    assert b.num_preemptions == 1 and out.rows[0].request_id == "a" and b.state_slot is None and not b.block_ids
    assert b.num_computed_tokens == 0 and b.status.value == "waiting"
    n_out = len(b.output_token_ids)
    # b comes back when a finishes, prefilling prompt + outputs from a zero state.
    while b.status.value != "running":
        run_step(s)
    assert b.num_prefill_tokens == 7 + n_out
    assert s.cache.blocks.num_free + s.cache.blocks.num_used == 4


def test_abort_frees_everything():
    s = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=64), num_blocks=16, num_slots=4)
    for i in range(3):
        s.add(make_req(f"r{i}", 20))
    run_step(s)
    s.abort("r1")
    s.abort("r2")
    s.abort("missing")
    assert s.abort("r0") is not None
    assert s.cache.blocks.num_used == 0 and s.cache.slots.num_used == 0 and not s.has_unfinished()


def test_stop_token_and_max_tokens():
    s = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=64), num_blocks=16, num_slots=4)
    s.add(make_req("stop", 3, max_tokens=10, stop=(9,)))
    s.add(make_req("len", 3, max_tokens=2))
    run_step(s, token=1)
    out = s.schedule()
    fin = StepUpdate(s).update(out, {"stop": 9, "len": 1})
    assert {r.request_id: r.finish_reason for r in fin} == {"stop": "stop", "len": "length"}
    assert s.cache.blocks.num_used == 0 and s.cache.slots.num_used == 0


def test_duplicate_or_unservable_request_rejected():
    s = Scheduler(EngineConfig(block_size=4), num_blocks=4, num_slots=4)
    s.add(make_req("x", 3))
    with pytest.raises(ValueError, match="duplicate"):
        s.add(make_req("x", 3))
    # 10 + 7 tokens need 5 blocks of 4 > the whole pool: rejected up front instead of starving.
    with pytest.raises(ValueError, match="at most 16 tokens"):
        s.add(make_req("y", 10, max_tokens=7))
    assert "y" not in s.requests


def test_r7_randomized_200_requests_with_aborts_and_preemptions_leak_nothing():
    # R7 at the scheduler level: whatever happens, every block and slot ends free.
    rng = random.Random(1234)
    cfg = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=32, long_prefill_token_threshold=12)
    s = Scheduler(cfg, num_blocks=40, num_slots=8)
    pending = [make_req(f"r{i}", rng.randint(1, 100), max_tokens=rng.randint(1, 60), stop=(3,))
               for i in range(200)]
    steps = 0
    mixed = 0
    while pending or s.has_unfinished():
        for _ in range(rng.randint(0, 4)):
            if pending:
                s.add(pending.pop(0))
        if s.requests and rng.random() < 0.1:
            s.abort(rng.choice(sorted(s.requests)))
        out = s.schedule()
        mixed += out.is_mixed
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len({r.state_slot for r in out.rows}) == len(out.rows)
        for r in out.rows:
            assert len(r.block_ids) * cfg.block_size >= r.num_computed_tokens + r.num_tokens
            assert r.has_initial_state == (r.num_computed_tokens > 0)
        StepUpdate(s).update(out, {r.request_id: rng.randrange(50) for r in out.rows if r.sample})
        used_blocks = sum(len(r.block_ids) for r in s.running)
        assert used_blocks == s.cache.blocks.num_used
        assert len(s.running) == s.cache.slots.num_used
        steps += 1
        assert steps < 20000
    assert s.num_preemptions > 0 and mixed > 0
    assert s.cache.blocks.num_free == 40 and s.cache.slots.num_free == 8


def test_mixed_graph_tokens_give_one_chunk_of_at_most_q_beside_decode_rows():
    # With decode rows running: one prompt chunk per step, of at most Q tokens (running prefills first, then
    # admission); without decode rows the budget and chunk cap apply as usual.
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=40, mixed_graph_tokens=6)
    s = Scheduler(cfg, num_blocks=64, num_slots=8)
    s.add(make_req("a", 10))
    s.add(make_req("b", 12))
    first = run_step(s)  # no decode rows yet: both prompts whole
    assert [(r.request_id, r.num_tokens) for r in first.rows] == [("a", 10), ("b", 12)]
    s.add(make_req("long", 15))
    s.add(make_req("next", 4))
    shapes = []
    for _ in range(4):
        out = run_step(s)
        shapes.append([(r.request_id, r.is_decode, r.num_tokens) for r in out.rows if not r.is_decode])
    assert shapes == [[("long", False, 6)], [("long", False, 6)], [("long", False, 3)], [("next", False, 4)]]


def test_decode_growth_continues_the_requests_run_and_newcomers_take_the_best_fitting_hole():
    # A decoding request's next block goes right after its last one while that is free (a run of blocks is one
    # transfer descriptor), not into the lowest free hole; a newcomer takes the hole that fits it.
    cfg = EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    s = Scheduler(cfg, num_blocks=32, num_slots=4)
    s.add(make_req("x", 8, max_tokens=1))
    s.add(make_req("a", 8, max_tokens=30))
    run_step(s)  # both prefill; x finishes at once and frees blocks 0 and 1
    a = s.requests["a"]
    assert "x" not in s.requests and a.block_ids == [2, 3] and s.cache.blocks.free_runs() == [(0, 2), (4, 28)]
    for _ in range(6):
        run_step(s)
    assert a.block_ids == [2, 3, 4, 5]  # lowest-first would have given it 0, then 1
    s.add(make_req("b", 5, max_tokens=10))  # 2 blocks: 8 positions, computed in the next 4 steps
    run_step(s)
    assert s.requests["b"].block_ids == [0, 1] and a.block_ids == [2, 3, 4, 5]
    assert s.cache.blocks.free_runs() == [(6, 26)]
    for _ in range(3):
        run_step(s)
    b = s.requests["b"]
    assert a.block_ids == [2, 3, 4, 5, 6] and b.block_ids == [0, 1] and b.num_computed_tokens == 8
