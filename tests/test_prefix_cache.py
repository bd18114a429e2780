"""The prefix cache (`engine/prefix_cache.py`): greedy outputs, drafts and acceptance counts with the cache equal
those without it, for both recurrent mixers (Mamba2 and Gated DeltaNet), prompts ending on a checkpoint, one token
after one, shorter than a block, with MTP K = 0..2, prefill-only requests (R1) moved to a decode engine, concurrent
requests sharing and evicting prefixes under a small pool, checkpoints taken inside a chunk (checkpoint rows); a hit
really skips compute; nothing leaks (R7).

The tests use small checkpoint strides (a boundary every two blocks) so that short prompts cross several.
"""

import argparse

import pytest
import torch

from baton.engine.block_pool import BlockPool
from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.prefix_cache import PrefixCache
from baton.engine.request import Request
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler import Scheduler
from baton.engine.scheduler_output import CheckpointRow, ScheduledRow, SchedulerOutput, with_checkpoint_row
from baton.node.engine_args import add_engine_args, engine_config_from_args, engine_flags

BLOCK, STRIDE = 4, 2  # a checkpoint boundary every 8 tokens
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
VOCAB = 16


# Each family with its recurrent mixer, cut to a few layers (a drafter of attention + MLP) to keep the file fast.
SHAPES = {"tiny": {"hybrid_override_pattern": "M*M-", "mtp_hybrid_override_pattern": "*-"}, "qwen3.5-tiny": {}}


@pytest.fixture(scope="module", params=sorted(SHAPES), ids=["gdn", "mamba2"])
def model(request, tmp_path_factory):
    out = make_model(tmp_path_factory.mktemp("prefix") / "m", request.param, mtp_layers=1, seed=5, progress=False,
                     overrides={"vocab_size": VOCAB, **SHAPES[request.param]}, tokenizer=False)
    return load_checkpoint(out)


def new_engine(model, k: int = 0, cache: bool = True, **kw) -> LLMEngine:
    cfg, weights = model
    base = dict(block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64, long_prefill_token_threshold=12,
                num_speculative_tokens=k, dtype="float32", num_kv_blocks=96, enable_prefix_caching=cache,
                prefix_checkpoint_stride=STRIDE)
    return LLMEngine(cfg, weights, EngineConfig(**{**base, **kw}))


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


SHARED = tokens(24, 1)
OTHER = SHARED[16] % (VOCAB - 1) + 1  # a token other than SHARED[16]
# A prefix ending on a checkpoint then more, exactly a checkpoint's length (reuse is capped below it), one token
# after a checkpoint, shorter than a block, the whole shared prefix, and one sharing nothing.
PROMPTS = [SHARED[:16] + tokens(5, 2), SHARED[:16], SHARED[:17], SHARED[:3], SHARED + tokens(3, 3), tokens(11, 4)]


def serve(engine: LLMEngine, prompts: list[list[int]]) -> list[tuple]:
    """Each prompt alone (the cache fills as they go): (tokens, drafted, accepted) each."""
    outs = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert engine.cache.blocks.num_used == 0 and engine.cache.slots.num_used == 0  # R7
    return [(o.token_ids, o.num_drafted, o.num_accepted) for o in outs]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_outputs_drafts_and_acceptance_equal_the_cache_off(model, k):
    off = serve(new_engine(model, k, cache=False), PROMPTS)
    engine = new_engine(model, k)
    assert serve(engine, PROMPTS) == off
    s = engine.stats
    assert s.prefix_hit_tokens > 0 and s.prefix_checkpoints_taken > 0
    assert s.prefix_hit_tokens + s.prompt_tokens == s.prefix_queried_tokens


def test_a_hit_skips_compute_and_always_computes_the_last_token(model):
    engine = new_engine(model)
    engine.generate([SHARED[:20]], GREEDY)  # checkpoints at 8 and 16
    before = engine.stats.prompt_tokens
    engine.generate([SHARED[:20] + [1, 2]], GREEDY)
    assert engine.stats.prompt_tokens - before == 22 - 16 and engine.stats.prefix_hit_tokens == 16
    # A prompt of exactly a checkpoint's length reuses the one before: its last token is computed.
    before = engine.stats.prompt_tokens
    engine.generate([SHARED[:16]], GREEDY)
    assert engine.stats.prompt_tokens - before == 8


def checkpoint_states(engine: LLMEngine, prompt: list[int], at: int) -> list[torch.Tensor]:
    """The states of the checkpoint a request with `prompt` would resume from, which must be at `at` tokens."""
    pc = engine.scheduler.prefix
    pc.begin_step()
    hit = pc.lookup(request("probe", prompt), len(prompt) - 1)
    assert hit is not None and hit.num_tokens == at
    return [c[hit.checkpoint] for c in engine.pools.checkpoints.values()]


def checkpoint_rows_of(engine: LLMEngine) -> list[tuple[CheckpointRow, ScheduledRow]]:
    """A list that gets every checkpoint row the engine's scheduler plans from now on, each with its prefill row."""
    got: list[tuple[CheckpointRow, ScheduledRow]] = []
    schedule = engine.scheduler.schedule

    def spy() -> SchedulerOutput:
        out = schedule()
        rows = {r.request_id: r for r in out.rows}
        got.extend((c, rows[c.request_id]) for c in out.checkpoint_rows)
        return out

    engine.scheduler.schedule = spy
    return got


def assert_checkpoint_rows_hold_the_prefix_state(model, **kw) -> None:
    """Chunks of 12 tokens: the second, [12, 20), starts from the first's state and takes the checkpoint at 16 in a
    checkpoint row (its lent slot forked from the row's); that checkpoint holds the state a prefill of exactly 16
    tokens leaves (a prefill-only request of 17: R1)."""
    engine = new_engine(model, **kw)
    rows = checkpoint_rows_of(engine)
    engine.generate([SHARED[:20]], GREEDY)
    assert [(c.num_tokens, r.has_initial_state) for c, r in rows] == [(8, False), (4, True)]
    off = new_engine(model, cache=False, prefill_only=True, **kw)
    want = held_caches(off, prefill(off, SHARED[:17]), 16)[1:]
    for a, b in zip(checkpoint_states(engine, SHARED[:17] + [1], 16), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_row_holds_the_state_a_prefill_of_the_prefix_leaves(model):
    assert_checkpoint_rows_hold_the_prefix_state(model)


def test_the_memory_probe_step_with_a_checkpoint_row_runs_and_samples_what_the_plain_step_does(model):
    """The engine's memory probe on a GPU runs its largest chunk with a checkpoint row of all its tokens but one into
    the scratch slot (`with_checkpoint_row`): that step runs, and samples what the step without it does."""
    got = []
    for extra in (False, True):
        engine = new_engine(model, cache=False)
        engine.add_request(SHARED[:10], GREEDY, request_id="probe")  # one chunk, which samples
        out = engine.scheduler.schedule()
        if extra:
            out = with_checkpoint_row(out, engine.pools.scratch_slot)
            assert out.checkpoint_rows[0].num_tokens == out.rows[0].num_tokens - 1
        got.append(engine.runner.execute(out).sampled)
    assert got[0] == got[1] and list(got[0]) == ["probe"]
    with pytest.raises(ValueError, match="one prefill row"):
        with_checkpoint_row(SchedulerOutput(rows=(), preempted=()), 0)


def test_prefix_checkpoint_memory_is_reported(model):
    engine = new_engine(model, prefix_checkpoint_slots=3)
    plan = engine.plan
    assert plan.num_checkpoints == 3 and plan.checkpoint_bytes > 0
    assert engine.pools.checkpoint_pool_bytes() == 3 * plan.checkpoint_bytes
    assert "prefix cache: 3 state checkpoints" in engine.memory_summary()
    assert "prefix cache off" in new_engine(model, cache=False).memory_summary()


def test_concurrent_requests_share_and_evict_prefixes_under_a_small_pool(model):
    """Few blocks and three checkpoint slots for many requests on a few shared prefixes: blocks and checkpoints are
    evicted, and requests preempted (then admitted again, maybe on a hit), while requests run; outputs stay those of
    the cache off, and nothing leaks."""
    heads = [tokens(16, 10 + i) for i in range(3)]
    prompts = [heads[i % 3] + tokens(1 + i % 5, 20 + i) for i in range(8)]
    small = dict(num_kv_blocks=12, prefix_checkpoint_slots=3, max_num_seqs=3)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    off = new_engine(model, cache=False, **small).generate(prompts, params)
    engine = new_engine(model, **small)
    got = engine.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in off]
    s = engine.stats
    assert s.prefix_hit_tokens > 0 and s.prefix_block_evictions > 0 and s.prefix_checkpoint_evictions > 0
    assert s.preemptions > 0
    assert s.prefix_checkpoints <= 3 and s.prefix_checkpoint_bytes == s.prefix_checkpoints * engine.plan.checkpoint_bytes
    assert engine.cache.blocks.num_used == 0 and engine.cache.slots.num_used == 0


@pytest.mark.parametrize("seed", [2, 3])  # 2 takes checkpoints inside chunks, 3 none
def test_random_shared_prefixes_under_contended_slots_give_the_cache_off_outputs(model, seed):
    """Prompts drawn from a few shared heads with tails of random lengths, arriving together, under a step budget and
    a state pool so small that a checkpoint inside a chunk sometimes finds a slot to lend and sometimes is cut; with
    random strides and chunk caps: the outputs are those of the cache off, and nothing leaks."""
    g = torch.Generator().manual_seed(100 + seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=g))

    heads = [tokens(draw(9, 30), 40 + 10 * seed + i) for i in range(3)]
    prompts = [heads[draw(0, 3)][:draw(5, 30)] + tokens(draw(1, 12), 60 + 10 * seed + i) for i in range(10)]
    kw = dict(max_num_seqs=draw(2, 5), max_num_batched_tokens=draw(16, 40), long_prefill_token_threshold=draw(5, 14),
              prefix_checkpoint_stride=draw(1, 4), prefix_checkpoint_slots=draw(3, 6))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    off = new_engine(model, cache=False, **kw).generate(prompts, params)
    engine = new_engine(model, **kw)
    got = engine.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in off], kw
    assert engine.stats.prefix_hit_tokens > 0, kw
    assert engine.cache.blocks.num_used == 0 and engine.cache.slots.num_used == 0


def held_caches(engine: LLMEngine, held, n: int) -> list[torch.Tensor]:
    """A prefilled request's KV (every layer, the drafter's included) at positions 0..n-1, and its state."""
    p = engine.pools
    blocks = list(held.held_block_ids)
    kv = torch.stack([p.kv[blocks[i // BLOCK], :, :, i % BLOCK] for i in range(n)])
    return [kv, *(s[held.held_state_slot] for s in p.states.values())]


def prefill(engine: LLMEngine, prompt: list[int]):
    engine.add_request(prompt, SamplingParams(max_tokens=1), prefill_only=True)
    (held,) = [o for _ in range(30) for o in engine.step() if o.finished]
    assert held.finish_reason == "prefilled"
    return held


@pytest.mark.parametrize("k", [0, 1])
def test_prefill_only_hits_hand_over_the_caches_a_full_prefill_computes(model, k):
    """A prefill node (R1: N-1 tokens) with a prefix hit, including one whose cached prefix covers all N-1 tokens
    (reuse stops one checkpoint short: at least one token is computed), hands over the same KV (the drafter's too,
    R8) and state as without the cache; moved to a decode engine, the request decodes what aggregated serving
    does. A prompt that leaves the cached one right after a checkpoint reuses it only without a drafter: the
    drafter's KV before the checkpoint read the token after it."""
    second = [SHARED[:17], SHARED[:19] + [3, 4], SHARED[:12], SHARED[:16] + [OTHER, 5, 6]]
    off, on = new_engine(model, k, cache=False, prefill_only=True), new_engine(model, k, prefill_only=True)
    for p in [SHARED[:17], SHARED[:18], SHARED[:11]]:  # fills checkpoints at 8 and 16
        on.free_held(*(lambda h: (h.held_block_ids, h.held_state_slot))(prefill(on, p)))
    dec = new_engine(model, k, cache=False)
    agg = new_engine(model, k, cache=False)
    hits = on.stats.prefix_hit_tokens
    for i, p in enumerate(second):
        h_off, h_on = prefill(off, p), prefill(on, p)
        for a, b in zip(held_caches(off, h_off, len(p) - 1), held_caches(on, h_on, len(p) - 1), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        off.free_held(h_off.held_block_ids, h_off.held_state_slot)
        blocks, slot = dec.reserve(len(p) - 1)
        dec.pools.kv[blocks] = on.pools.kv[list(h_on.held_block_ids)]
        for name, s in dec.pools.states.items():
            s[slot] = on.pools.states[name][h_on.held_state_slot]
        dec.add_computed_request(p, GREEDY, f"moved-{i}", blocks, slot, num_computed=len(p) - 1)
        on.free_held(h_on.held_block_ids, h_on.held_state_slot)
        (moved,) = [o for _ in range(40) for o in dec.step() if o.finished]
        (ref,) = agg.generate([p], GREEDY)
        assert (moved.token_ids, moved.num_drafted, moved.num_accepted) == (ref.token_ids, ref.num_drafted,
                                                                           ref.num_accepted)
    # [:17] reuses 8 (its N-1 = 16 tokens are cached, but one must be computed), [:21] 16, [:12] 8, and the last 16
    # without a drafter, 8 with one.
    on.step()  # accounts the last step
    assert on.stats.prefix_hit_tokens - hits == 8 + 16 + 8 + (8 if k else 16)
    assert on.cache.blocks.num_used == 0 and on.cache.slots.num_used == 0


# ---- the bookkeeping alone (ints) ---------------------------------------------------------------------------
def request(rid: str, prompt: list[int], prefill_only: bool = False, arrival: int = 0) -> Request:
    return Request(rid, tuple(prompt), SamplingParams(max_tokens=4, ignore_eos=True), arrival=arrival,
                   prefill_only=prefill_only)


def test_block_pool_evicts_least_recently_released_and_never_a_held_block():
    pool = BlockPool(6)
    a = pool.allocate(3)
    for b in a:
        pool.cache(b)
    pool.free(a)  # reclaimable, the tail first
    assert pool.num_free == 6 and pool.num_used == 0 and pool.num_cached == 3
    pool.hold(a[0])
    evicted = []
    pool.on_evict = evicted.append
    assert len(pool.allocate(5)) == 5 and evicted == [a[2], a[1]] and pool.num_free == 0
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.free([a[0]])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[0]])


def test_a_checkpoint_inside_a_chunk_is_taken_by_a_checkpoint_row_and_cut_at_only_without_a_slot_to_lend():
    """A chunk that reaches a checkpoint boundary the cache lacks before its end is not cut there: the step runs a
    checkpoint row into a lent state slot (free again once the step is done) and copies that into the checkpoint. It
    is cut at the boundary where no slot can be lent, and in an engine with mixed graphs."""
    cfg = EngineConfig(block_size=4, max_num_batched_tokens=64, long_prefill_token_threshold=12, max_num_seqs=4,
                       prefix_checkpoint_stride=2)

    def chunks(cache: int, slots: int) -> list[tuple[int, tuple, tuple]]:
        s = Scheduler(cfg, 32, slots, num_checkpoints=cache)
        s.add(request("a", list(range(1, 30))))
        out = []
        while not s.requests["a"].in_decode:
            o = s.schedule()
            step = s.cache.step_launched()
            a = s.requests["a"]
            out.append((o.rows[0].num_tokens, o.checkpoint_rows, tuple((p == a.state_slot, k) for p, k in o.checkpoints)))
            a.num_computed_tokens += o.rows[0].num_tokens
            s.cache.step_done(step)
            assert s.cache.slots.num_free == slots - 1  # the lent slot is back
        return out

    assert [n for n, _, _ in chunks(0, 4)] == [12, 12, 5]
    lent = chunks(2, 4)
    assert [n for n, _, _ in lent] == [12, 12, 5]
    (_, rows, copies), (_, rows2, copies2), _ = lent
    assert [(r.request_id, r.num_tokens) for r in rows] == [("a", 8)] and copies == ((False, 0),)
    assert rows2 == () and copies2 == ((True, 1),)  # the chunk ends on boundary 24: its own state
    # One state slot, the request's: nothing to lend, so the chunks are cut at the boundaries as before.
    assert [(n, rows) for n, rows, _ in chunks(2, 1)] == [(8, ()), (8, ()), (8, ()), (5, ())]

    # Beside a decode row with mixed graphs (one chunk of at most 16 tokens): cut at the boundary.
    s = Scheduler(EngineConfig(**{**cfg.__dict__, "mixed_graph_tokens": 16}), 32, 4, num_checkpoints=2)
    s.add(request("d", [7, 7]))
    s.requests["d"].num_computed_tokens += s.schedule().rows[0].num_tokens
    s.requests["d"].output_token_ids.append(3)
    s.add(request("a", list(range(1, 30))))
    o = s.schedule()
    assert [(r.request_id, r.num_tokens) for r in o.rows] == [("d", 1), ("a", 8)] and o.checkpoint_rows == ()


def test_checkpoints_are_visible_from_the_next_step_and_keyed_by_the_next_token_with_a_drafter():
    pool = BlockPool(16)
    pc = PrefixCache(pool, 4, num_checkpoints=2, stride=1, seed=b"m", match_successor=True)
    a = request("a", [1, 2, 3, 4, 5, 6])
    a.set_blocks(pool.allocate(2))
    slot = pc.take(a, 4)
    assert slot is not None and pc.take(a, 4) is None  # one checkpoint per key
    b, c = request("b", [1, 2, 3, 4, 5, 9]), request("c", [1, 2, 3, 4, 7, 9])
    assert pc.lookup(b, 5) is None  # taken by the step being scheduled
    pc.begin_step()
    hit = pc.lookup(b, 5)
    assert hit is not None and (hit.block_ids, hit.checkpoint, hit.num_tokens) == ((a.block_ids[0],), slot, 4)
    assert pc.lookup(c, 5) is None  # the drafter's KV at position 3 read token 5: c's differs
    assert pc.lookup(b, 3) is None  # limited below the checkpoint


def test_a_checkpoint_its_request_superseded_is_evicted_first_unless_a_lookup_used_it():
    """A prefill cut into chunks takes a checkpoint at each chunk's end; once its request takes a deeper one, the
    shallower goes to the LRU's cold end (the conversation's next turn resumes from the deepest), so it is the one
    evicted when slots run short, not an older checkpoint another request may still hit. One that a lookup used since
    it was taken keeps its place."""
    pool = BlockPool(16)
    pc = PrefixCache(pool, 4, num_checkpoints=2, stride=1, seed=b"m", match_successor=False)
    old = request("old", [9, 9, 9, 9, 1])
    old.set_blocks(pool.allocate(1))
    pc.take(old, 4)
    a = request("a", list(range(1, 14)))
    a.set_blocks(pool.allocate(3))
    pc.take(a, 4)  # the first chunk's end: the two slots are full now
    pc.take(a, 8)  # the second chunk's: the first is superseded, and its slot is the one given up
    pc.begin_step()
    assert pc.lookup(request("o", [9, 9, 9, 9, 2]), 4) is not None  # the older checkpoint stayed
    assert pc.lookup(request("b", list(range(1, 10))), 8).num_tokens == 8
    assert pc.checkpoint_evictions == 1

    pc = PrefixCache(BlockPool(16), 4, num_checkpoints=2, stride=1, seed=b"m", match_successor=False)
    old = request("old", [9, 9, 9, 9, 1])
    old.set_blocks(pc.blocks.allocate(1))
    pc.take(old, 4)
    a = request("a", list(range(1, 14)))
    a.set_blocks(pc.blocks.allocate(3))
    pc.take(a, 4)
    pc.begin_step()
    pc.use(pc.lookup(c := request("c", list(range(1, 6))), 4), c)  # another request resumes from a's first checkpoint
    pc.take(a, 8)  # ... so it is not demoted: the older one, least recently used, goes
    pc.begin_step()
    assert pc.lookup(request("o", [9, 9, 9, 9, 2]), 4) is None
    assert pc.lookup(request("c", list(range(1, 6))), 4) is not None


def test_the_checkpoint_a_turn_resumed_from_is_evicted_first_once_it_takes_a_deeper_one_unless_shared():
    """A conversation's next turn resumes from its last turn's checkpoint and takes a deeper one: only that one is
    what the turn after resumes from, so the one it hit goes to the LRU's cold end, ahead of an older checkpoint
    (another conversation's, waiting for its next turn). One that two requests hit (a shared system prompt's) keeps
    its place."""
    def cache_with_old() -> PrefixCache:
        pc = PrefixCache(BlockPool(16), 4, num_checkpoints=2, stride=1, seed=b"m", match_successor=False)
        old = request("old", [9, 9, 9, 9, 1])
        old.set_blocks(pc.blocks.allocate(1))
        pc.take(old, 4)
        first = request("t1", list(range(1, 6)))
        first.set_blocks(pc.blocks.allocate(2))
        pc.take(first, 4)
        pc.begin_step()
        return pc

    for shared in (False, True):
        pc = cache_with_old()
        if shared:
            pc.use(pc.lookup(other := request("other", [1, 2, 3, 4, 7]), 4), other)
        turn = request("t2", list(range(1, 10)))
        hit = pc.lookup(turn, 8)
        assert hit is not None and hit.num_tokens == 4
        pc.use(hit, turn)
        turn.set_blocks([*hit.block_ids, *pc.blocks.allocate(2)])
        pc.take(turn, 8)  # no slot left: the coldest goes
        pc.begin_step()
        assert pc.lookup(request("t3", list(range(1, 10))), 8).num_tokens == 8
        assert (pc.lookup(request("o", [9, 9, 9, 9, 2]), 4) is not None) is not shared
        assert (pc.lookup(request("u", [1, 2, 3, 4, 8]), 4) is not None) is shared
        assert pc.checkpoint_evictions == 1


def test_engine_flags_turn_the_cache_off_and_set_the_stride():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = p.parse_args(["--no-prefix-cache", "--prefix-checkpoint-stride", "4"])
    cfg = engine_config_from_args(a)
    assert not cfg.enable_prefix_caching and cfg.prefix_checkpoint_stride == 4
    assert engine_flags(a)[-3:] == ["--prefix-checkpoint-stride", "4", "--no-prefix-cache"]
    assert engine_config_from_args(p.parse_args([])).enable_prefix_caching
    with pytest.raises(ValueError, match="prefix_checkpoint_stride"):
        EngineConfig(prefix_checkpoint_stride=0)
