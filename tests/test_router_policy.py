"""Router building blocks without servers: config validation, power of two choices, load bookkeeping."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from baton.router.config import RouterConfig
from baton.router.load_tracker import LoadSnapshot, LoadTracker
from baton.router.policy import Role, WorkerLoad, pick, queued_prefill_tokens

# ---- RouterConfig --------------------------------------------------------------------------------


def test_config_defaults_and_normalisation():
    c = RouterConfig(["127.0.0.1:1"], ["127.0.0.1:2", "h:3"])
    assert c.prefill_addrs == ("127.0.0.1:1",) and c.decode_addrs == ("127.0.0.1:2", "h:3")
    assert c.local_prefill_threshold == 0 and c.tokenizer_path is None
    assert RouterConfig((), ("h:1",)).prefill_addrs == ()
    hash(c)


@pytest.mark.parametrize(("kw", "match"), [
    ({"decode_addrs": ()}, "decode_addrs: expected at least 1"),
    ({"decode_addrs": ("nohost",)}, "decode_addrs: expected addresses of the form"),
    ({"decode_addrs": ("h:0",)}, "PORT in"),
    ({"decode_addrs": "h:1"}, "decode_addrs: expected a tuple"),
    ({"prefill_addrs": ("h:1", "h:1")}, "prefill_addrs: expected distinct"),
    ({"local_prefill_threshold": -1}, "local_prefill_threshold: expected an integer >= 0, got -1"),
    ({"local_prefill_threshold": True}, "local_prefill_threshold"),
    ({"prefill_queue_limit_tokens": -5}, "prefill_queue_limit_tokens: expected an integer >= 0, got -5"),
    ({"prefill_queue_limit_tokens": 1.5}, "prefill_queue_limit_tokens"),
    ({"prefill_timeout_s": 0}, "prefill_timeout_s: expected a finite number of seconds > 0, got 0"),
    ({"load_poll_interval_s": float("nan")}, "load_poll_interval_s"),
    ({"control_timeout_s": -1.0}, "control_timeout_s"),
    ({"decode_idle_timeout_s": float("inf")}, "decode_idle_timeout_s"),
    ({"tokenizer_path": ""}, "tokenizer_path"),
])
def test_config_rejects_bad_values(kw, match):
    args = {"prefill_addrs": ("h:1",), "decode_addrs": ("h:2",), **kw}
    with pytest.raises(ValueError, match=match):
        RouterConfig(**args)


# ---- pick ----------------------------------------------------------------------------------------


def test_pick_prefers_fewer_outstanding_prefill_tokens():
    rng = random.Random(0)
    loads = [WorkerLoad(True, outstanding_prefill_tokens=100), WorkerLoad(True, outstanding_prefill_tokens=5)]
    assert all(pick(loads, rng, Role.PREFILL) == 1 for _ in range(50))


def test_pick_decode_by_free_slots_then_blocks():
    rng = random.Random(0)
    slots = [WorkerLoad(True, free_state_slots=1, free_kv_blocks=999), WorkerLoad(True, free_state_slots=2)]
    assert all(pick(slots, rng, Role.DECODE) == 1 for _ in range(50))
    blocks = [WorkerLoad(True, free_state_slots=2, free_kv_blocks=10), WorkerLoad(True, free_state_slots=2,
                                                                                     free_kv_blocks=20)]
    assert all(pick(blocks, rng, Role.DECODE) == 1 for _ in range(50))


def test_pick_decode_spreads_whole_steps_of_queued_prefill_before_slots():
    """Decode workers that prefill prompts themselves: a worker whose backlog is whole steps longer loses even with
    more free slots; below one step (token N of transferred requests) slots decide; no free slot loses to any
    backlog; an unknown step budget (0) leaves the backlog out."""
    rng = random.Random(0)

    def wl(slots, queued, step=2048, blocks=100):
        return WorkerLoad(True, outstanding_prefill_tokens=queued, free_state_slots=slots, free_kv_blocks=blocks,
                          step_tokens=step)

    assert all(pick([wl(50, 4096), wl(10, 2047)], rng, Role.DECODE) == 1 for _ in range(50))
    assert all(pick([wl(50, 2047), wl(10, 0)], rng, Role.DECODE) == 0 for _ in range(50))
    assert all(pick([wl(0, 0), wl(1, 10**6)], rng, Role.DECODE) == 1 for _ in range(50))
    assert all(pick([wl(50, 10**6, step=0), wl(10, 0, step=0)], rng, Role.DECODE) == 0 for _ in range(50))


def test_pick_breaks_ties_at_random():
    rng = random.Random(1)
    loads = [WorkerLoad(True)] * 2
    counts = Counter(pick(loads, rng, Role.PREFILL) for _ in range(400))
    assert 150 < counts[0] < 250 and counts[0] + counts[1] == 400


def test_pick_skips_unhealthy_and_excluded():
    rng = random.Random(0)
    loads = [WorkerLoad(False), WorkerLoad(True, outstanding_prefill_tokens=10**6), WorkerLoad(True)]
    assert {pick(loads, rng, Role.PREFILL, exclude={2}) for _ in range(20)} == {1}
    assert pick(loads, rng, Role.PREFILL, exclude={1, 2}) is None
    assert pick([WorkerLoad(False)], rng, Role.DECODE) is None
    assert pick([], rng, Role.DECODE) is None


def test_two_choices_never_pick_the_worst_of_many():
    # P2C samples two distinct workers: the most loaded one can only win a pair by a tie, so never here.
    rng = random.Random(2)
    loads = [WorkerLoad(True, outstanding_prefill_tokens=t) for t in (0, 10, 20, 30, 40)]
    counts = Counter(pick(loads, rng, Role.PREFILL) for _ in range(2000))
    assert counts[4] == 0 and counts[0] > counts[1] > counts[2] > counts[3] > 0


def test_a_prefill_workers_queue_leaves_out_the_two_steps_it_may_have_in_flight():
    def queued(outstanding, step):
        return queued_prefill_tokens(WorkerLoad(True, outstanding_prefill_tokens=outstanding, step_tokens=step))

    assert queued(20_000, 8192) == 20_000 - 2 * 8192
    assert queued(10_000, 8192) == 0  # all of it in the step on the device and the one behind it
    assert queued(10_000, 0) == 10_000  # budget unknown (no Info yet): all of it
    t = LoadTracker(Role.PREFILL)
    t.step_tokens = 512
    t.add("a", 2000)
    assert t.load(True).step_tokens == 512 and queued_prefill_tokens(t.load(True)) == 2000 - 1024


# ---- LoadTracker ---------------------------------------------------------------------------------


def test_decode_tracker_counts_the_prompt_tokens_a_decode_worker_prefills_itself():
    t = LoadTracker(Role.DECODE)
    t.block_size, t.step_tokens = 16, 512
    t.add("local", 100)  # prefilled on the worker: all 100
    t.add("moved", 300, prefill_tokens=1)  # transferred: token N only
    load = t.load(True)
    assert (load.outstanding_prefill_tokens, load.step_tokens) == (101, 512)
    assert load.free_kv_blocks == -(7 + 19)  # blocks of both prompts, against an empty snapshot
    t.acknowledged("local")
    t.acknowledged("moved")
    epoch = t.begin_poll()
    t.end_poll(epoch, LoadSnapshot(outstanding_prefill_tokens=700, free_state_slots=4, free_kv_blocks=50))
    assert t.load(True).outstanding_prefill_tokens == 700  # the worker's own count took over


def test_tracker_counts_work_sent_since_the_poll_began():
    t = LoadTracker(Role.PREFILL)
    t.add("a", 100)  # before any poll: counted
    assert t.load(True).outstanding_prefill_tokens == 100
    epoch = t.begin_poll()
    t.add("b", 10)  # sent after the poll began: the worker's answer may not include it
    t.end_poll(epoch, LoadSnapshot(outstanding_prefill_tokens=100))  # includes "a"
    assert t.load(True).outstanding_prefill_tokens == 110
    t.remove("b")
    assert t.load(True).outstanding_prefill_tokens == 100
    assert t.load(False).healthy is False


def test_prefill_tracker_takes_returned_prompts_off_the_last_poll():
    # Prompts the last poll counted and whose Prefill calls returned since are no longer queued on the worker: the
    # estimate drops at once instead of at the next poll (which would trip the overflow limit while it idles).
    t = LoadTracker(Role.PREFILL)
    t.add("a", 4000)
    t.add("b", 3000)
    epoch = t.begin_poll()
    t.add("c", 500)  # after the poll began: counted on top of the answer
    t.end_poll(epoch, LoadSnapshot(outstanding_prefill_tokens=6000))  # a (partly computed) and b
    assert t.load(True).outstanding_prefill_tokens == 6500
    t.remove("a")
    assert t.load(True).outstanding_prefill_tokens == 2500
    t.remove("b")  # 7000 returned against 6000 polled: never below 0
    assert t.load(True).outstanding_prefill_tokens == 500
    t.end_poll(t.begin_poll(), LoadSnapshot(outstanding_prefill_tokens=300))  # the worker's count takes over
    assert t.load(True).outstanding_prefill_tokens == 300
    t.remove("c")  # counted by that poll: taken off it
    assert t.load(True).outstanding_prefill_tokens == 0
    # A decode worker's requests return when they finish decoding, long after their prompt: no such correction of
    # its prompt tokens, but its state slot is free again.
    d = LoadTracker(Role.DECODE)
    d.add("x", 100)
    d.acknowledged("x")
    d.end_poll(d.begin_poll(), LoadSnapshot(outstanding_prefill_tokens=100, free_state_slots=3))
    d.remove("x")
    assert (d.load(True).outstanding_prefill_tokens, d.load(True).free_state_slots) == (100, 4)
    d.end_poll(d.begin_poll(), LoadSnapshot(free_state_slots=4))  # the worker's count takes over
    assert d.load(True).free_state_slots == 4
    d.add("y", 8)  # ended before any poll counted it: only the unseen count had it
    d.remove("y")
    assert d.load(True).free_state_slots == 4


def test_tracker_ignores_an_older_poll_answer():
    t = LoadTracker(Role.PREFILL)
    old, new = t.begin_poll(), t.begin_poll()
    t.end_poll(new, LoadSnapshot(outstanding_prefill_tokens=1))
    t.end_poll(old, LoadSnapshot(outstanding_prefill_tokens=99))
    assert t.load(True).outstanding_prefill_tokens == 1


def test_tracker_decode_subtracts_slots_and_blocks():
    t = LoadTracker(Role.DECODE)
    t.end_poll(t.begin_poll(), LoadSnapshot(free_state_slots=4, free_kv_blocks=50))
    t.add("a", 33)
    assert (t.load(True).free_state_slots, t.load(True).free_kv_blocks) == (3, 50)  # block size unknown
    t.block_size = 16
    assert (t.load(True).free_state_slots, t.load(True).free_kv_blocks) == (3, 47)
    t.acknowledged("a")
    t.end_poll(t.begin_poll(), LoadSnapshot(free_state_slots=3, free_kv_blocks=47))
    assert (t.load(True).free_state_slots, t.load(True).free_kv_blocks) == (3, 47)  # no double count
    assert t.in_flight == 1


def test_decode_tracker_counts_a_request_until_a_poll_begun_after_its_first_token():
    # A poll may begin after a Decode call was sent and be answered before the worker's engine holds it (the call
    # still on its way in, or waiting without a state slot): the request must stay counted through that answer.
    t = LoadTracker(Role.DECODE)
    t.end_poll(t.begin_poll(), LoadSnapshot(free_state_slots=4, free_kv_blocks=50))
    t.add("a", 8)
    t.end_poll(t.begin_poll(), LoadSnapshot(free_state_slots=4, free_kv_blocks=50))  # answered before "a" arrived
    assert t.load(True).free_state_slots == 3
    racing = t.begin_poll()  # begun before the first token, answered after it
    t.acknowledged("a")
    t.end_poll(racing, LoadSnapshot(free_state_slots=4, free_kv_blocks=50))
    assert t.load(True).free_state_slots == 3
    t.end_poll(t.begin_poll(), LoadSnapshot(free_state_slots=3, free_kv_blocks=49))  # begun after: counts it
    assert t.load(True).free_state_slots == 3
    t.acknowledged("gone")  # an unknown request: nothing to do
    t.remove("a")
    assert t.in_flight == 0
