"""The engine's warm-up (`engine/warm_up.py`, `LLMEngine.warm_up`): before serving it runs fresh prompts, a prompt
continued in a second chunk and one from a prefix-cache hit through the real step path (so that a GPU compiles
those kernels then, not inside a request), and leaves the engine exactly as it found it: no block, slot,
checkpoint, counter or stat of its own, and the same greedy outputs afterwards."""

import pytest

from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import EngineStats, LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from baton.engine.warm_up import MANY_ROWS, SHORT_TAILS, WarmUp, warm_up_prompt, warm_up_waves

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = make_model(tmp_path_factory.mktemp("warm") / "m", "tiny", seed=3, progress=False,
                     overrides={"vocab_size": 64}, tokenizer=False)
    return load_checkpoint(out)


def new_engine(model, **kw) -> LLMEngine:
    cfg, weights = model
    base = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=32, dtype="float32", num_kv_blocks=128,
                prefix_checkpoint_stride=2)
    return LLMEngine(cfg, weights, EngineConfig(**{**base, **kw}))


def test_waves_continue_a_long_prompt_extend_it_then_run_many_rows():
    waves = warm_up_waves(budget=512, max_len=8192, stride_tokens=256)
    assert waves[0] == [(33, 0), (48, 0)]
    [(long, own)], [(longer, own_2)], many = waves[1:4]
    assert own == own_2 == 0
    assert long > 512 and longer == long + 50  # a second chunk, then the same prefix and more
    assert len(many) == MANY_ROWS and {s for s, _ in many} == {long} and len({o for _, o in many}) == MANY_ROWS
    # A stride longer than the budget still puts a checkpoint boundary inside the long prompt.
    assert warm_up_waves(budget=64, max_len=8192, stride_tokens=1024)[1][0][0] > 1024
    # Without a cache the many rows are short; every prompt within the longest the engine takes.
    waves = warm_up_waves(budget=4096, max_len=1000, stride_tokens=None)
    assert {s for s, _ in waves[3]} == {16}
    assert max(s + o for w in waves for s, o in w) <= 999  # and one generated token
    # A very short context still gets prompts it can take.
    assert all(2 <= s + o <= 19 for w in warm_up_waves(budget=512, max_len=20, stride_tokens=64) for s, o in w)


@pytest.mark.parametrize("stride", [256, None])
def test_short_tails_compute_each_power_of_two_on_either_role(stride):
    """After the many rows, steps of one short row each: from the long prompt's cached prefix (a checkpoint
    boundary) where there is a cache, fresh otherwise; a prefill node computes own - 1 tokens (N-1), an aggregated
    one own, and between them every power of two up to 64 is some step's longest row."""
    waves = warm_up_waves(budget=512, max_len=8192, stride_tokens=stride)
    long = waves[1][0][0]
    tails = waves[4:]
    assert all(len(w) == 1 for w in tails)
    hits = {s for [(s, _)] in tails}
    assert hits == ({256 * ((long - 1) // 256)} if stride else {0})
    owns = [o for [(_, o)] in tails]
    assert owns == [o for o in SHORT_TAILS if o + min(hits) >= 2]
    powers = {1, 2, 4, 8, 16, 32, 64}
    assert powers <= {o - 1 for o in owns}  # a prefill node's
    assert powers - ({1} if stride is None else set()) <= set(owns)  # an aggregated one's (fresh: no 1-token prompt)
    # Only tails the step budget takes.
    assert max(o for [(_, o)] in warm_up_waves(budget=20, max_len=8192, stride_tokens=stride)[4:]) == 17


def test_waves_refuse_a_bad_budget():
    with pytest.raises(ValueError, match="step budget >= 1"):
        warm_up_waves(budget=0, max_len=100, stride_tokens=None)


def test_prompts_share_their_leading_ids_and_stay_in_the_vocabulary():
    a, b, c = warm_up_prompt(40, 0, 16, 0), warm_up_prompt(90, 0, 16, 1), warm_up_prompt(40, 5, 16, 2)
    assert b[:40] == a == c[:40] and all(3 <= t < 16 for t in b + c)
    assert warm_up_prompt(40, 5, 16, 3)[40:] != c[40:]


def test_nothing_runs_on_the_cpu_unless_asked(model):
    engine = new_engine(model)
    assert engine.warm_up() == WarmUp()
    assert engine.stats == EngineStats()


@pytest.mark.parametrize("prefill_only", [False, True], ids=["engine", "prefill-only"])
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_warm_up_runs_every_path_and_leaves_the_engine_as_it_was(model, cache, prefill_only):
    engine = new_engine(model, enable_prefix_caching=cache, prefill_only=prefill_only)
    ran = engine.warm_up(everywhere=True)
    tails = sum(o <= 32 for o in SHORT_TAILS) - (not cache)  # (a fresh one-token prompt is left out)
    assert ran.prompts == 4 + MANY_ROWS + tails
    assert ran.steps > 3 + MANY_ROWS // 4 + tails  # long prompts in two chunks each, a step per tail
    assert (ran.hit_tokens > 0) == cache
    assert f"{4 + MANY_ROWS + tails} prompts" in ran.summary()
    assert engine.stats == EngineStats()
    assert engine.cache.blocks.num_used == 0 and engine.cache.slots.num_used == 0
    pc = engine.scheduler.prefix
    assert pc is None or (pc.num_checkpoints == 0 and pc.hit_tokens == 0 and pc.queried_tokens == 0)
    if prefill_only:
        return
    # The prompts share the warm-up's leading ids: a hit there would be a leftover of the warm-up.
    prompts = [warm_up_prompt(45, 0, 64, 0), warm_up_prompt(10, 3, 64, 1)]
    fresh = new_engine(model, enable_prefix_caching=cache).generate(prompts, GREEDY)
    got = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in fresh]
    assert engine.stats.prefix_hit_tokens == 0


def test_warm_up_refuses_an_engine_with_requests(model):
    engine = new_engine(model)
    engine.add_request([1, 2, 3], GREEDY, request_id="r")
    with pytest.raises(ValueError, match="idle engine"):
        engine.warm_up(everywhere=True)
