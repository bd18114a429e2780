"""Prefix affinity in the router (issue #51): the per-worker index of chained block hashes, the policy that weighs
predicted prefix hits against load, the pool that keeps one index per worker, and the flow over fake prefill
nodes (tests/test_router_affinity_cluster.py: real decode nodes)."""

from __future__ import annotations

import asyncio
import random

import pytest

from baton.proto.v1 import generation_pb2, worker_pb2
from baton.router.affinity import pick_by_affinity
from baton.router.config import RouterConfig
from baton.router.metrics import RouterMetrics
from baton.router.policy import Role, WorkerLoad, pick
from baton.router.prefix_index import PrefixIndex, block_hashes, chain_seed
from baton.router.workers import WorkerPool
from tests.test_router_fakes import cluster, expected_tokens, run, tokens_of

SEED = chain_seed("model-a")

# ---- block hashes and the index ------------------------------------------------------------------


def test_block_hashes_chain_over_every_earlier_token():
    a = block_hashes(list(range(10)), 4, SEED)
    assert len(a) == 2  # the partial third block has no hash
    assert block_hashes(list(range(8)), 4, SEED) == a
    # Same second block after a different first one: a different hash (the chain covers the prefix).
    b = block_hashes([99, 1, 2, 3, 4, 5, 6, 7], 4, SEED)
    assert b[0] != a[0] and b[1] != a[1]
    assert block_hashes(list(range(8)), 4, chain_seed("model-b")) != a  # the model is the seed
    assert block_hashes(list(range(8)), 4, SEED) == a  # stable
    assert block_hashes([1, 2, 3], 4, SEED) == []
    with pytest.raises(ValueError, match="block_size: expected an integer >= 1, got 0"):
        block_hashes([1], 0, SEED)


def test_index_hits_a_shared_prefix_and_misses_everything_after_a_different_first_block():
    idx = PrefixIndex(100)
    system = list(range(100, 132))  # two blocks of 16
    idx.record(block_hashes(system + list(range(16)), 16, SEED))
    assert len(idx) == 3
    assert idx.hit_blocks(block_hashes(system + list(range(500, 532)), 16, SEED)) == 2
    assert idx.hit_blocks(block_hashes(system + list(range(16)) + [7] * 16, 16, SEED)) == 3
    # Only the first token differs: no block of it is a hit, though its later tokens match.
    other = [0, *system[1:], *range(16)]
    assert idx.hit_blocks(block_hashes(other, 16, SEED)) == 0
    assert PrefixIndex(5).hit_blocks([]) == 0


def test_index_evicts_least_recently_recorded_deepest_block_first():
    idx = PrefixIndex(4)
    old = block_hashes(list(range(48)), 16, SEED)  # 3 blocks
    idx.record(old)
    new = block_hashes(list(range(1000, 1032)), 16, SEED)  # 2 blocks: one of old's must go
    idx.record(new)
    assert len(idx) == 4
    # The deepest block of the old chain went, so its leading walk still finds its first two blocks.
    assert idx.hit_blocks(old) == 2 and idx.hit_blocks(new) == 2
    # Recording refreshes: old's two blocks are now the most recent, so the next eviction takes new's.
    idx.record(old[:2])
    idx.record(block_hashes(list(range(2000, 2032)), 16, SEED))
    assert idx.hit_blocks(old) == 2 and idx.hit_blocks(new) == 0
    idx.clear()
    assert len(idx) == 0 and idx.hit_blocks(old) == 0
    with pytest.raises(ValueError, match="capacity: expected an integer >= 1, got 0"):
        PrefixIndex(0)


# ---- the policy ----------------------------------------------------------------------------------


def prefill(outstanding: int) -> WorkerLoad:
    return WorkerLoad(True, outstanding_prefill_tokens=outstanding)


def test_equal_loads_pick_the_worker_holding_the_prefix():
    rng = random.Random(0)
    for role in Role:
        loads = [WorkerLoad(True, free_state_slots=4, free_kv_blocks=100)] * 3
        for holder in range(3):
            hits = [0, 0, 0]
            hits[holder] = 64
            for _ in range(20):
                c = pick_by_affinity(loads, hits, rng, role, 1.0)
                assert c.index == holder and c.hit_tokens == 64 and c.by_affinity


def test_load_wins_once_the_gap_exceeds_weight_times_the_hit():
    rng = random.Random(0)
    hits = [0, 100]
    # Worker 1 holds 100 tokens; with weight 2 it wins by affinity while it has at most 200 more tokens queued.
    c = pick_by_affinity([prefill(50), prefill(250)], hits, rng, Role.PREFILL, 2.0)
    assert (c.index, c.by_affinity) == (1, True)
    for _ in range(20):
        c = pick_by_affinity([prefill(50), prefill(251)], hits, rng, Role.PREFILL, 2.0)
        assert (c.index, c.hit_tokens, c.by_affinity) == (0, 0, False)
    # A holder that is also less loaded wins on load: not counted as affinity.
    c = pick_by_affinity([prefill(50), prefill(10)], hits, rng, Role.PREFILL, 2.0)
    assert (c.index, c.by_affinity) == (1, False)


def test_a_decode_worker_with_under_half_the_others_free_slots_loses_whatever_prefix_it_holds():
    rng = random.Random(0)
    for a_free, b_free in ((0, 3), (0, 1), (4, 9)):
        loads = [WorkerLoad(True, free_state_slots=a_free, free_kv_blocks=100), WorkerLoad(True, free_state_slots=b_free)]
        assert all(pick_by_affinity(loads, [10**6, 0], rng, Role.DECODE, 10.0).index == 1 for _ in range(20))
    # Half of them is still close enough: the prefix wins.
    loads = [WorkerLoad(True, free_state_slots=5), WorkerLoad(True, free_state_slots=10)]
    c = pick_by_affinity(loads, [64, 0], rng, Role.DECODE, 1.0)
    assert (c.index, c.by_affinity) == (0, True)


def test_weight_zero_or_tied_hits_make_exactly_the_load_only_choices():
    loads = [prefill(n) for n in (5, 5, 7, 3, 5, 9)]
    cases = [([0, 64, 0, 16, 0, 0], 0.0), ([32] * 6, 1.0), ([32] * 6, 5.0), ([0] * 6, 1.0)]
    for hits, weight in cases:
        r1, r2 = random.Random(7), random.Random(7)
        for _ in range(200):
            c = pick_by_affinity(loads, hits, r1, Role.PREFILL, weight, exclude={2})
            assert c.index == pick(loads, r2, Role.PREFILL, exclude={2}) and not c.by_affinity
        assert r1.random() == r2.random()  # the same draws: the RNG sequence is untouched


def test_a_hot_prefix_spreads_once_its_holder_is_loaded():
    """Every request shares a long prefix. Sent to the holder while its backlog stays within the budget; past it,
    to the other worker, which then holds the prefix too: from then on load alone decides between them."""
    rng = random.Random(1)
    idx = [PrefixIndex(1000), PrefixIndex(1000)]
    backlog = [0, 0]
    prompt = list(range(256))
    chain = block_hashes(prompt, 16, SEED)
    idx[0].record(chain)
    chosen = []
    for _ in range(8):
        hits = [i.hit_blocks(chain) * 16 for i in idx]
        c = pick_by_affinity([prefill(b) for b in backlog], hits, rng, Role.PREFILL, 1.0)
        chosen.append(c.index)
        backlog[c.index] += len(prompt)
        idx[c.index].record(chain)
    assert chosen[:2] == [0, 0] and 1 in chosen
    assert max(backlog) - min(backlog) <= 2 * len(prompt)


def test_hits_must_match_the_workers():
    with pytest.raises(ValueError, match=r"hits: expected one per worker \(2\), got 1"):
        pick_by_affinity([prefill(0), prefill(0)], [0], random.Random(0), Role.PREFILL, 1.0)


@pytest.mark.parametrize(("kw", "match"), [
    ({"prefix_affinity_weight": -1.0}, "prefix_affinity_weight: expected a finite number >= 0, got -1.0"),
    ({"prefix_affinity_weight": float("inf")}, "prefix_affinity_weight"),
    ({"prefix_affinity_weight": True}, "prefix_affinity_weight"),
    ({"prefix_index_blocks": 0}, "prefix_index_blocks: expected an integer >= 1, got 0"),
    ({"prefix_block_size": 0}, "prefix_block_size: expected an integer >= 1, got 0"),
])
def test_config_rejects_bad_affinity_values(kw, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig(decode_addrs=("h:1",), **kw)


# ---- the pool: one index per worker --------------------------------------------------------------


def _healthy(pool: WorkerPool, block_size: int) -> None:
    for w in pool.workers:
        w.healthy = True
        w.info = worker_pb2.InfoResponse(role="prefill", block_size=block_size,
                                         model=generation_pb2.ModelInfoResponse(model="/m/tiny"))


def test_pool_records_by_each_workers_block_size_and_drops_a_removed_workers_index():
    async def go():
        pool = WorkerPool(Role.PREFILL, ("127.0.0.1:1", "127.0.0.1:2"), rng=random.Random(0),
                          prefix_affinity_weight=1.0, prefix_index_blocks=64)
        try:
            pool.set_addresses(("127.0.0.1:1", "127.0.0.1:2"))
            _healthy(pool, 8)
            w0, w1 = pool.workers
            prompt = list(range(40))
            first = pool.pick_for(prompt, exclude=[w0])
            assert first.worker is w1 and first.hit_tokens == 0 and len(first.chain) == 5  # 40 // 8 full blocks
            pool.record(first)
            assert len(w1.prefix_index) == 5 and pool.index_blocks() == 5
            for _ in range(10):
                p = pool.pick_for(prompt + [1, 2, 3])
                assert p.worker is w1 and p.hit_tokens == 40 and p.by_affinity
            # Excluded (a retry): the other worker, with no hit.
            p = pool.pick_for(prompt, exclude=[w1])
            assert p.worker is w0 and p.hit_tokens == 0
            pool.set_addresses(("127.0.0.1:1",))  # w1 leaves: its index goes with it
            assert len(w1.prefix_index) == 0 and pool.index_blocks() == 0
            p = pool.pick_for(prompt)
            assert p.worker is w0 and p.hit_tokens == 0 and not p.by_affinity
        finally:
            await pool.close()

    asyncio.run(go())


def test_pool_with_affinity_off_records_nothing():
    async def go():
        pool = WorkerPool(Role.DECODE, ("127.0.0.1:1",), rng=random.Random(0))
        try:
            pool.set_addresses(("127.0.0.1:1",))
            _healthy(pool, 8)
            (w,) = pool.workers
            picked = pool.pick_for(list(range(64)))
            pool.record(picked)
            assert picked.worker is w and picked.chain == () and pool.index_blocks() == 0
        finally:
            await pool.close()

    asyncio.run(go())


def test_metrics_count_picks_by_reason_and_predicted_hit_tokens():
    m = RouterMetrics()
    m.picked("prefill", 48, True)
    m.picked("prefill", 0, False)
    m.watch_prefix_index("decode", lambda: 7)
    value = m.registry.get_sample_value
    assert value("baton_router_prefix_predicted_hit_tokens_total", {"role": "prefill"}) == 48
    assert value("baton_router_prefix_affinity_decisions_total", {"role": "prefill", "by": "affinity"}) == 1
    assert value("baton_router_prefix_affinity_decisions_total", {"role": "prefill", "by": "load"}) == 1
    assert value("baton_router_prefix_affinity_decisions_total", {"role": "decode", "by": "load"}) == 0
    assert value("baton_router_prefix_index_blocks", {"role": "decode"}) == 7


# ---- the flow over fake workers: prefill nodes -----------------------------------------------------


def test_prefill_nodes_get_a_shared_prefix_back_and_a_retry_goes_elsewhere():
    """Prompts sharing two blocks (of the N-1 tokens a prefill node computes) go to the prefill node that computed
    them; a prefill that fails there is retried on the other node, which then holds the prefix too."""
    prefix = list(range(200, 232))

    async def go():
        async with cluster(2, 1, prefix_affinity_weight=1.0) as c:
            m = c.router.service.metrics.registry.get_sample_value
            for i in range(4):
                prompt = [*prefix, *range(300 + 8 * i, 308 + 8 * i)]
                assert tokens_of(await c.generate(prompt)) == expected_tokens(prompt)
            counts = sorted(len(p.prefills) for p in c.prefill)
            assert counts == [0, 4]
            assert m("baton_router_prefix_affinity_decisions_total", {"role": "prefill", "by": "affinity"}) == 3
            assert m("baton_router_prefix_predicted_hit_tokens_total", {"role": "prefill"}) == 3 * len(prefix)
            # The local-prefill path is not taken: decode nodes record nothing.
            assert m("baton_router_prefix_index_blocks", {"role": "decode"}) == 0
            holder = next(p for p in c.prefill if p.prefills)
            other = next(p for p in c.prefill if p is not holder)
            holder.prefill_failures = 1
            prompt = [*prefix, *range(400, 408)]
            assert tokens_of(await c.generate(prompt)) == expected_tokens(prompt)
            assert len(other.prefills) == 1
            hits = m("baton_router_prefix_predicted_hit_tokens_total", {"role": "prefill"})
            assert hits == 4 * len(prefix)  # the retry's node held nothing yet
            prompt = [*prefix, *range(500, 508)]
            await c.generate(prompt)
            assert m("baton_router_prefix_predicted_hit_tokens_total", {"role": "prefill"}) == hits + len(prefix)

        async with cluster(2, 1) as c:  # weight 0: nothing is indexed or counted
            for _ in range(3):
                await c.generate([*prefix, 1, 2, 3])
            m = c.router.service.metrics.registry.get_sample_value
            assert m("baton_router_prefix_index_blocks", {"role": "prefill"}) == 0
            assert m("baton_router_prefix_affinity_decisions_total", {"role": "prefill", "by": "load"}) == 0

    run(go())
