"""Verify steps chained on the one in flight (async scheduling with drafts, `LLMEngine._chain`).

A chained step takes its inputs on the device from the previous step's results, before the host has read them.
It must be the step the scheduler would have made after reading: the same tokens, drafts and accepted counts as
one step at a time, for rows that go on; rows whose request finished (length, stop token) or was aborted in
between are dropped, and their caches stay out of the free lists until the chained step is done. CPU: the graphs'
static layout runs eagerly on the Triton kernels (interpreted), as on the GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baton.engine.cuda_graphs import FILTERED, GREEDY, TEMPERED
from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.request import Request
from baton.engine.runner import kv_slots
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler import Scheduler
from baton.engine.step_update import StepUpdate
from tests.test_cuda_graphs import dense_spec_model  # noqa: F401
from tests.test_kernels_in_engine import small_qwen_spec_model  # noqa: F401
from tests.test_spec_decode import Log, new_engine, prompt_of, run, small_spec_model  # noqa: F401


def _graph_engine(model, k: int, **kw) -> LLMEngine:
    engine = new_engine(model, k, **kw)
    engine.runner.graphs = engine.make_step_graphs(torch.device("cpu"))
    return engine


class Chains:
    """Counts the chained launches (and those that dropped rows); after each step, checks the chained step's
    inputs, built on the device, against the rows the scheduler gives it once its predecessor is read."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.count = self.dropped = self.checked = self.padded = 0
        runner = engine.runner
        launch = runner.launch_chained

        def counted(prev, ids, slots, rooms, tables):
            self.count += 1
            self.dropped += len(ids) < len(prev.request_ids)
            return launch(prev, ids, slots, rooms, tables)

        runner.launch_chained = counted

    def check(self, engine: LLMEngine) -> None:
        launched = engine.pipeline.chained
        if launched is None:
            return
        g, bs, T = engine.runner.graphs, engine.config.block_size, engine.runner.graphs.T
        where = {rid: i for i, rid in enumerate(launched.flight.request_ids)}
        scratch = engine.pools.scratch_block * bs
        for row in launched.out.rows:
            i, k = where[row.request_id], row.num_tokens
            pad = T - k  # fewer drafts near a length limit: padded as ModelRunner._decode_graph pads them
            assert g.ids[i * T:(i + 1) * T].tolist() == [*row.token_ids, *[0] * pad]
            start = row.num_computed_tokens
            assert g.slot_mapping[i * T:(i + 1) * T].tolist() == [*kv_slots(row.block_ids, start, start + k, bs),
                                                                   *[scratch] * pad]
            assert (g.seq_lens[i].item(), g.verify_base[i].item(), g.num_tokens[i].item()) == (start + T, start, k)
            self.padded += pad > 0
            assert g.state_slots[i].item() == row.state_slot
            self.checked += 1


class PathCounts:
    """A node's metrics hook after every step (as `EngineThread` runs it): a step is counted by how it ran when it
    is read, so that no path's count ever runs ahead of the steps (a negative eager count raised in the hook
    and stopped a GPU decode node's engine thread with drafts on)."""

    def __init__(self, engine: LLMEngine) -> None:
        from baton.node.metrics import NodeMetrics

        self.metrics = NodeMetrics("decode", "d0")

    def check(self, engine: LLMEngine) -> None:
        st = engine.stats
        assert st.graph_steps + st.mixed_graph_steps <= st.steps
        self.metrics.on_step(engine)

    def paths(self) -> dict[str, float]:
        return {s.labels["path"]: s.value for fam in self.metrics.registry.collect()
                if fam.name == "baton_node_path_steps" for s in fam.samples if s.name.endswith("_total")}


def _arrivals():
    """Staggered prompts; different max_tokens and a stop token, so that requests finish on different steps
    (chained steps then drop rows) while others go on."""
    lengths = (3, 11, 1, 6, 2, 9, 4, 7)
    return [[("local", f"n{n}", prompt_of(n, n))] for n in lengths]


# (max_tokens per prompt length: short under the interpreter, longer on the GPU)
SHORT = {3: 7, 11: 12, 1: 10, 6: 13, 2: 5, 9: 11, 4: 12, 7: 8}
LONG = {3: 9, 11: 17, 1: 13, 6: 20, 2: 7, 9: 15, 4: 19, 7: 11}


def _params(max_tokens: dict[int, int]):
    stops = {1: (5,), 9: (2,)}
    return {f"n{n}": SamplingParams(max_tokens=m, ignore_eos=True, stop_token_ids=stops.get(n, ()))
            for n, m in max_tokens.items()}


def _run(engine: LLMEngine, after_step=None, max_tokens: dict[int, int] = SHORT) -> dict:
    return run(engine, _arrivals(), _params(max_tokens), after_step)  # (R7: every block and slot back at the end)


@pytest.mark.interpreter
@pytest.mark.parametrize("family", ["mamba2", "gdn"])
@pytest.mark.parametrize("k", [2])
def test_chained_verify_steps_equal_steps_one_at_a_time(small_spec_model, small_qwen_spec_model, k, family):  # noqa: F811
    """vllm-45100's scenario for both recurrent mixers: requests go from prefill to their first verify while other
    rows verify, chained on the step in flight, the accepted counts read only on the device."""
    pytest.importorskip("triton")
    small_spec_model = small_spec_model if family == "mamba2" else small_qwen_spec_model
    # One step at a time: eager steps on the torch references (the interpreter would double this test's time;
    # tests/test_cuda_graphs.py holds the static layout, tests/test_kernels_in_engine.py the kernels, to them).
    ref_engine = new_engine(small_spec_model, k, async_scheduling=False, kernels="torch")
    ref_log = Log(ref_engine)
    ref = _run(ref_engine)
    engine = _graph_engine(small_spec_model, k, kernels="triton")
    assert engine.depth == 1 and ref_engine.depth == 0
    log = Log(engine)
    chains = Chains(engine)
    metrics = PathCounts(engine)
    got = _run(engine, lambda e: (chains.check(e), metrics.check(e)))
    assert {r: (o.token_ids, o.finish_reason) for r, o in got.items()} == \
        {r: (o.token_ids, o.finish_reason) for r, o in ref.items()}
    # Every verify step replayed the graph, chained ones counted when read, as a node's metrics export them.
    st = engine.stats
    assert metrics.paths() == {"decode_graph": st.graph_steps, "mixed_graph": 0, "eager": st.steps - st.graph_steps}
    assert st.graph_steps > chains.count
    assert {o.finish_reason for o in got.values()} == {"length", "stop"}
    # Row by row (tokens fed, emitted, next drafts) as one step at a time; chained steps dropped finished rows.
    assert log.rows == ref_log.rows
    assert chains.count >= 8 and chains.dropped > 0 and chains.checked > 20 and chains.padded > 0
    assert 0 < engine.stats.spec_accepted < engine.stats.spec_drafted
    assert engine.stats.spec_accepted == ref_engine.stats.spec_accepted


@pytest.mark.interpreter
def test_sampled_rows_verify_in_the_graph_and_chain_as_eager_steps(small_spec_model):  # noqa: F811
    """Rows that sample at a temperature (seeded), some with top-k / top-p, beside greedy ones: their verify steps
    replay the graph's tempered and filtered variants (`RejectionSampler.verify_tempered`) and chain on the one in
    flight, and every request's tokens, drafts and accepted counts equal eager steps one at a time
    (`RejectionSampler.verify` with the SamplingParams)."""
    pytest.importorskip("triton")
    temps = {3: 0.8, 11: 1.3, 6: 0.6, 9: 1.0, 4: 0.9}
    filters = {6: dict(top_k=3), 9: dict(top_p=0.7), 4: dict(top_k=4, top_p=0.9)}  # 6 finishes last (13 tokens)
    params = {}
    for rid, p in _params(SHORT).items():
        n = int(rid[1:])
        params[rid] = dataclasses.replace(p, temperature=temps.get(n, 0.0), seed=n, **filters.get(n, {}))
    ref_engine = new_engine(small_spec_model, 2, kernels="torch")  # no graphs: eager verify steps, one at a time
    ref_log = Log(ref_engine)
    ref = run(ref_engine, _arrivals(), params)
    engine = _graph_engine(small_spec_model, 2, kernels="triton")
    graphs = engine.runner.graphs
    variants = []
    forward = graphs._forward
    graphs._forward = lambda n, variant=GREEDY: variants.append(variant) or forward(n, variant)
    log = Log(engine)
    chains = Chains(engine)
    got = run(engine, _arrivals(), params, chains.check)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
    assert log.rows == ref_log.rows
    assert variants.count(FILTERED) >= 5 and chains.count >= 5  # the sampling graphs ran, chained too
    assert 0 < engine.stats.spec_accepted < engine.stats.spec_drafted
    # Alone, a top-p row's verify steps replay the filtered graph, a temperature row's the tempered one.
    for sampling, variant in ((dict(top_p=0.9), FILTERED), ({}, TEMPERED)):
        variants.clear()
        engine.generate([prompt_of(5, 1)], SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True,
                                                          **sampling))
        assert variant in variants and set(variants) <= {variant}


_ABORT_PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
_ABORT_PROMPTS = {f"r{i}": prompt_of(4 + i, i) for i in range(3)}
_AGAIN = prompt_of(5, 7)  # a new request under the aborted one's id, added while its row is in flight
_abort_refs: dict[int, dict] = {}


def _abort_reference(model) -> dict:
    """Every request's output without the abort, and the new request's alone: eager steps one at a time on the
    torch references, computed once for both cases."""
    if id(model) not in _abort_refs:
        engine = new_engine(model, 2, async_scheduling=False, kernels="torch")
        ref = dict(zip(_ABORT_PROMPTS, engine.generate(list(_ABORT_PROMPTS.values()), _ABORT_PARAMS),
                       strict=True))
        ref["again"] = engine.generate([_AGAIN], _ABORT_PARAMS)[0]
        _abort_refs[id(model)] = ref
    return _abort_refs[id(model)]


@pytest.mark.interpreter
@pytest.mark.parametrize("reuse_id", [False, True], ids=["then-new-id", "id-reused-at-once"])
def test_abort_while_a_chained_step_is_in_flight(small_spec_model, reuse_id):  # noqa: F811
    """An aborted request's row still runs in the chained step: its blocks and slot stay out of the free lists
    until that step is read, and it gets no output from it; the others go on unchanged. A new request under the
    same id, added at once or a step later, gets its own tokens."""
    pytest.importorskip("triton")
    ref = _abort_reference(small_spec_model)
    engine = _graph_engine(small_spec_model, 2, kernels="triton")
    for rid, p in _ABORT_PROMPTS.items():
        engine.add_request(p, _ABORT_PARAMS, request_id=rid)
    got = {}
    while engine.pipeline.chained is None:
        got.update({o.request_id: o for o in engine.step() if o.finished})
    sched = engine.scheduler
    free_blocks, free_slots = sched.cache.blocks.num_free, sched.cache.slots.num_free
    assert engine.abort("r1")
    assert (sched.cache.blocks.num_free, sched.cache.slots.num_free) == (free_blocks, free_slots)  # quarantined
    if reuse_id:  # at once, while the old r1's row is in flight
        engine.add_request(_AGAIN, _ABORT_PARAMS, request_id="r1")
    after = engine.step()  # reads the chained step (chaining the next one for r0 and r2 unless a request waits)
    assert all(o.request_id != "r1" for o in after)
    assert sched.cache.slots.num_free == free_slots + 1  # back once the step that ran its row was read
    if reuse_id:
        assert engine.pipeline.chained is None and sched.waiting[0].prompt_token_ids == tuple(_AGAIN)
    else:
        assert [r.request_id for r in engine.pipeline.chained.out.rows] == ["r0", "r2"]
        engine.add_request(_AGAIN, _ABORT_PARAMS, request_id="r1")  # waits: the next step is scheduled, not chained
    got.update({o.request_id: o for o in after if o.finished})
    while engine.has_unfinished():
        got.update({o.request_id: o for o in engine.step() if o.finished})
    assert sched.cache.blocks.num_free == sched.cache.blocks.capacity and sched.cache.slots.num_free == sched.cache.slots.capacity
    assert set(got) == {"r0", "r1", "r2"} and all(got[r].token_ids == ref[r].token_ids for r in ("r0", "r2"))
    assert got["r1"].token_ids == ref["again"].token_ids and got["r1"].prompt_token_ids == tuple(_AGAIN)


def _sched(k: int = 2, blocks: int = 64) -> Scheduler:
    cfg = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, num_speculative_tokens=k,
                       num_kv_blocks=blocks)
    return Scheduler(cfg, blocks, 8)


def _decoding(s: Scheduler, specs: list[tuple[str, int, int]], outputs: int) -> list[Request]:
    """Requests (id, prompt length, max_tokens) in decode with `outputs` tokens out and K = 2 drafts each, as after
    a verify step."""
    reqs = [Request(request_id=rid, prompt_token_ids=tuple(range(n)), sampling=SamplingParams(max_tokens=m),
                    arrival=i, stop_ids=frozenset(), max_model_len=1000, prefill_only=False)
            for i, (rid, n, m) in enumerate(specs)]
    for req in reqs:
        s.add(req)
    StepUpdate(s).update(s.schedule(), {r.request_id: 1 for r in reqs}, {r.request_id: [1, 1] for r in reqs})
    for _ in range(outputs - 1):
        StepUpdate(s).update(s.schedule(), {r.request_id: [1] for r in reqs}, {r.request_id: [1, 1] for r in reqs})
    assert all(req.in_decode and len(req.output_token_ids) == outputs for req in reqs)
    return reqs


def test_chain_allocates_the_worst_case_and_gives_the_rows_schedule_would():
    s = _sched()
    # b: 3 out of max_tokens 8: after `out`, maybe room for fewer than K drafts
    a, b = _decoding(s, [("a", 5, 40), ("b", 9, 8)], 3)
    out = s.schedule()
    assert [r.num_draft for r in out.rows] == [2, 2]
    plan = s.chain(out)
    assert plan is not None and [p[:3] for p in plan] == [("a", a.state_slot, 40 - 3 - 1), ("b", b.state_slot, 8 - 3 - 1)]
    for req, row, (*_, table) in zip((a, b), out.rows, plan, strict=True):
        # every draft of `out` accepted, then 1 + K tokens and the drafter's K - 1 lookahead positions
        worst = req.num_computed_tokens + row.num_tokens + 3 + 1
        assert len(table) * 4 >= worst and table == req.block_table()
    # after reading `out`, the chained step's rows are what schedule() gives
    StepUpdate(s).update(out, {"a": [1, 1], "b": [1, 1, 1]}, {"a": [3, 3], "b": [4, 4]})  # b: 3 emitted, 6 out
    chained = s.chained_output(["a", "b"])
    assert [(r.token_ids, r.num_computed_tokens, r.num_draft) for r in chained.rows] == \
        [((1, 3, 3), a.num_computed_tokens, 2), ((1, 4), b.num_computed_tokens, 1)]
    # what the device computes from b's room and its emitted count (3): the scheduler's draft count
    assert min(2, max(0, plan[1][2] - 3)) == s._num_draft(b) == 1
    # a finished request has no row
    s.abort("a")
    assert [r.request_id for r in s.chained_output(["a", "b"]).rows] == ["b"]


def test_chain_refuses_a_waiting_request_a_prefill_and_missing_blocks():
    s = _sched()
    _decoding(s, [("a", 5, 40)], 3)
    out = s.schedule()
    s.add(Request(request_id="w", prompt_token_ids=(1, 2), sampling=SamplingParams(), arrival=9,
                  stop_ids=frozenset(), max_model_len=1000, prefill_only=False))
    assert s.chain(out) is None  # it would be admitted
    s.schedule()  # admitted: a prefill row beside a's
    assert s.chain(s.schedule()) is None
    s = _sched(blocks=4)
    _decoding(s, [("a", 3, 4), ("b", 3, 4)], 1)
    out = s.schedule()
    assert s.cache.blocks.num_free == 0 and [r.num_draft for r in out.rows] == [2, 2]
    free = s.cache.blocks.num_free
    assert s.chain(out) is None and s.cache.blocks.num_free == free  # the worst case does not fit: nothing allocated


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_gpu_chained_verify_graphs_equal_steps_one_at_a_time(dense_spec_model, k, sampled):  # noqa: F811
    """On the GPU, with captured graphs: chained verify steps give the tokens, drafts and finish reasons of steps
    run one at a time, and their device-built inputs are the scheduler's rows. sampled: some rows sample at a
    temperature (seeded), some with top-k / top-p, so steps replay the graphs of sampling rows; one at a time is
    then eager steps."""
    cfg, weights = dense_spec_model
    config = EngineConfig(block_size=4, max_num_seqs=12, max_num_batched_tokens=96, long_prefill_token_threshold=8,
                          dtype="float32", num_kv_blocks=256, device="cuda", num_speculative_tokens=k)
    params = _params(LONG)
    if sampled:
        # odd prompt lengths sample (all with one seed: their noise differs by position only), even ones are greedy
        params = {rid: dataclasses.replace(p, temperature=0.5 + 0.1 * n if (n := int(rid[1:])) % 2 else 0.0, seed=7,
                                           top_k=5 if n == 3 else 0, top_p=0.8 if n == 9 else 1.0)
                  for rid, p in params.items()}
    ref_engine = LLMEngine(cfg, weights, dataclasses.replace(config, async_scheduling=False, cuda_graphs=not sampled))
    ref_log = Log(ref_engine)
    ref = run(ref_engine, _arrivals(), params)
    engine = LLMEngine(cfg, weights, config)
    assert engine.runner.graphs is not None and engine.depth == 1
    log = Log(engine)
    chains = Chains(engine)
    got = run(engine, _arrivals(), params, chains.check)
    assert {r: (o.token_ids, o.finish_reason) for r, o in got.items()} == \
        {r: (o.token_ids, o.finish_reason) for r, o in ref.items()}
    assert log.rows == ref_log.rows
    assert chains.count > 10 and chains.dropped > 0 and chains.checked > 20
    variants = engine.runner.graphs.variants
    assert (variants[TEMPERED] and variants[FILTERED]) if sampled else variants[GREEDY]  # captured, replayed
