"""CUDA graphs of the decode step (engine/cuda_graphs.py): the same tokens as eager steps, padding rows that
touch nothing but the scratch caches, and one graph per padded size."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from baton.engine.cuda_graphs import capture_missing, gc_paused, graph_sizes
from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from tests.test_spec_decode import (  # noqa: F401
    Log,
    new_engine,
    prefill_elsewhere,
    prompt_of,
    run,
    small_spec_model,
    spec_model,
)


def test_graph_sizes_cover_every_batch_up_to_the_max():
    assert graph_sizes(1) == [1]
    assert graph_sizes(8) == [1, 2, 4, 8]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256 and all(b - a <= 8 for a, b in zip(sizes, sizes[1:], strict=False))
    # Decode (verify) graphs: every 2 rows below 64 (a padding row costs about a real row's state update), then 8.
    assert graph_sizes(20, fine=True) == [1, 2, 4, 8, 10, 12, 14, 16, 18, 20]
    fine = graph_sizes(256, fine=True)
    assert fine[:8] == [1, 2, 4, 8, 10, 12, 14, 16] and {34, 62, 64, 72, 256} <= set(fine)
    assert not {33, 35, 63, 66, 68} & set(fine)
    assert set(sizes) <= set(fine) and len(fine) == len(sizes) + 21


class _Cycle:
    """A reference cycle whose finalizer records that the collector ran (as a stale CUDAGraph's reset would)."""

    def __init__(self, log: list[str]):
        self.me, self.log = self, log

    def __del__(self):
        self.log.append("finalized")


def test_gc_paused_keeps_finalizers_out_of_a_capture_and_restores_the_collector():
    assert gc.isenabled()
    threshold = gc.get_threshold()
    log: list[str] = []
    gc.set_threshold(1)  # a collection at almost every allocation, were the collector on
    try:
        _Cycle(log)  # garbage from before: collected on entry, not inside
        with gc_paused():
            assert log == ["finalized"] and not gc.isenabled()
            for _ in range(1000):
                _Cycle(log)
            assert log == ["finalized"]
            with gc_paused():  # nested (capture_missing around capture_graph): no collection, still off
                assert not gc.isenabled() and log == ["finalized"]
            assert not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(RuntimeError, match="boom"), gc_paused():
            raise RuntimeError("boom")
        assert gc.isenabled()
        gc.disable()  # off by the caller's choice: left off
        with gc_paused():
            pass
        assert not gc.isenabled()
        gc.enable()
        gc.collect()
        assert log.count("finalized") == 1001
    finally:
        gc.set_threshold(*threshold)
        gc.enable()


def test_capture_missing_pauses_the_collector_over_all_captures():
    seen: list[tuple[int, bool]] = []
    graphs: dict = {2: "old"}
    n = capture_missing(graphs, [1, 2, 4], lambda size: seen.append((size, gc.isenabled())) or f"g{size}")
    assert n == 2 and seen == [(4, False), (1, False)] and graphs == {1: "g1", 2: "old", 4: "g4"}
    assert gc.isenabled()


def test_cuda_graphs_flag_is_validated():
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")


def test_graphs_are_off_on_cpu(spec_model):  # noqa: F811
    cfg, weights = spec_model
    engine = LLMEngine(cfg, weights, EngineConfig(dtype="float32", num_kv_blocks=64))
    assert engine.runner.graphs is None


@pytest.mark.interpreter
@pytest.mark.parametrize("k, fused", [(0, False), (2, False), (0, True)], ids=["0", "2", "0-fused-gemv"])
def test_static_padded_step_layout_equals_eager_steps_on_cpu(small_spec_model, k, fused):  # noqa: F811
    """The graphs' static, padded layout (scratch block and slot for padding rows; with K drafts the whole
    greedy verify step: rejection, replay counts, drafter catch-up and chain, and verify rows with fewer drafts
    padded to 1+K), run eagerly on the CPU, gives the tokens, drafts and accepted counts of steps built the usual
    way. On the Triton kernels (interpreted), as on the GPU: padding rows share the scratch slot, which the
    references' host checks refuse. A transferred request's first step (token N, no drafts) joins them.
    fused: graph sizes of up to 4 rows run the fused-prologue GEMVs (`fused_gemv_max_tokens`), larger ones not."""
    pytest.importorskip("triton")
    moved = prompt_of(8, 12)
    arrivals = [[("local", f"n{n}", prompt_of(n, n))] for n in (3, 11, 1, 6, 2, 9, 4, 7, 5)]
    arrivals.append([("moved", "moved", moved, None)])  # after the last local prefill: a decode-only step
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def with_prefill(arrivals):  # each run gets its own prefilled copy of the moved request
        return [[a if a[0] == "local" else (*a[:3], prefill_elsewhere(small_spec_model, k, moved)) for a in group]
                for group in arrivals]

    # The usual steps on the torch references (tests/test_kernels_in_engine.py holds the kernels to them; the
    # interpreter would double this test's time), the static layout on the kernels.
    ref_engine = new_engine(small_spec_model, k, kernels="torch")
    ref_log = Log(ref_engine)
    ref = run(ref_engine, with_prefill(arrivals), params)
    # (With drafts one step at a time, so that every verify step goes through `run`; verify steps chained on the one
    # in flight: tests/test_chained_verify.py.)
    engine = new_engine(small_spec_model, k, fused_gemv_max_tokens=4 if fused else 0, async_scheduling=not k,
                        kernels="triton")
    engine.runner.graphs = engine.make_step_graphs(torch.device("cpu"))
    used, counts = [], []
    static_run = engine.runner.graphs.run

    def counting_run(*a, **kw):
        used.append(len(kw["state_slots"]))
        counts.append(kw.get("num_tokens"))
        return static_run(*a, **kw)

    engine.runner.graphs.run = counting_run
    log = Log(engine)
    steps = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    got = run(engine, with_prefill(arrivals), params)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
    assert log.rows == ref_log.rows
    # Steps of several sizes went through the static layout, padded (3, 5, 6, 7 rows run as 4 or 8).
    assert len(used) > 5 and set(used) - {1, 2, 4, 8}
    # The moved request's token N was a decode row of a graph step; with K drafts, rows with fewer were padded.
    out, row = next((o, r) for o in steps for r in o.rows if r.request_id == "moved")
    assert (row.is_decode, row.num_computed_tokens, row.token_ids) == (True, len(moved) - 1, (moved[-1],))
    assert engine.runner._graphable(out)  # (greedy rows: with K drafts the whole step is the graph's)
    if k:
        assert any(c is not None and min(c) < 1 + k for c in counts)
    graphs = engine.runner.graphs
    assert graphs.sizes == [1, 2, 4, 8, 10, 12]  # (12 rows at most: decode and verify graphs every 2 rows from 8)
    # Each size's attention program map was built once, for its fixed query starts, and used by every layer.
    starts = graphs._starts
    assert set(starts) >= {graphs.size_for(u) for u in used}
    assert all(meta is not None and meta.query_start_loc is qsl for qsl, meta in starts.values())
    if k:
        assert 0 < engine.stats.spec_accepted < engine.stats.spec_drafted
    if fused:
        assert graphs.fused_gemv_max_tokens == 4 and {graphs.size_for(u) for u in used} & {1, 2, 4} \
            and {graphs.size_for(u) for u in used} - {1, 2, 4}


def _engine(model, graphs: bool, dtype: str = "float32", k: int = 0) -> LLMEngine:
    cfg, weights = model
    return LLMEngine(cfg, weights, EngineConfig(block_size=4, max_num_seqs=12, max_num_batched_tokens=96,
                                                long_prefill_token_threshold=8, dtype=dtype, num_kv_blocks=256,
                                                device="cuda", cuda_graphs=graphs, num_speculative_tokens=k))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_equals_eager_decode(spec_model, dtype):  # noqa: F811
    """Staggered arrivals give decode steps of 1..9 rows (padded to 1, 2, 4, 8, 12), mixed with prefill steps
    that run eagerly; greedy tokens must equal the eager engine's, and the scratch caches take the padding."""
    arrivals = [[("local", f"n{n}", prompt_of(n, n))] for n in (3, 11, 1, 6, 2, 9, 4, 7, 5)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    eager = run(_engine(spec_model, False, dtype), arrivals, params)
    engine = _engine(spec_model, True, dtype)
    assert engine.runner.graphs is not None
    got = run(engine, arrivals, params)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in eager.items()}
    assert set(engine.runner.graphs.graphs) >= {1, 2, 4, 8}
    # Padding rows ran, and wrote the scratch slot (past the scheduler's slots), not a request's.
    assert engine.pools.states["ssm"][engine.pools.scratch_slot].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("k", [0, 1])
def test_graphs_with_fused_gemv_equal_eager_steps(dense_spec_model, k):
    """Decode (verify) graphs of up to 8 tokens capture the fused-prologue GEMVs; fp32 tokens (and drafts)
    equal the eager engine's on cuBLAS and the separate kernels."""
    arrivals = [[("local", f"n{n}", prompt_of(n, n))] for n in (3, 11, 1, 6, 2, 9, 4, 7, 5)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    eager_engine = _engine(dense_spec_model, False, k=k)
    eager_log = Log(eager_engine)
    eager = run(eager_engine, arrivals, params)
    cfg, weights = dense_spec_model
    engine = LLMEngine(cfg, weights, dataclasses.replace(eager_engine.config, cuda_graphs=True,
                                                          fused_gemv_max_tokens=8))
    log = Log(engine)
    got = run(engine, arrivals, params)
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in eager.items()}
    assert log.rows == eager_log.rows


@pytest.fixture(scope="module")
def dense_spec_model(tmp_path_factory):
    """The spec tests' model with a dense drafter (`*-`): an MoE drafter cannot be captured."""
    out = make_model(tmp_path_factory.mktemp("dense") / "m", "tiny", mtp_layers=1, seed=11, progress=False,
                     overrides={"vocab_size": 8, "mtp_hybrid_override_pattern": "*-"}, tokenizer=False)
    return load_checkpoint(out)


def test_graphs_are_not_used_where_a_layer_cannot_be_captured(spec_model, dense_spec_model):  # noqa: F811
    # NemotronH's drafter in the spec tests is `*E`: the references' MoE expert loop reads routing decisions on the
    # host, the fused MoE kernels do not (Qwen3.5's drafter is a dense decoder layer).
    cfg, _ = spec_model
    engine = new_engine(spec_model, 2)
    assert engine.graphs_capturable() == ("E" not in cfg.mtp_layer_types or engine.kernels.triton)
    assert new_engine(spec_model, 0).graphs_capturable()
    assert new_engine(dense_spec_model, 2).graphs_capturable()


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["dense", "moe"])
@pytest.mark.parametrize("k", [1, 3])
def test_verify_graphs_equal_eager_verify_and_k0(dense_spec_model, spec_model, k, drafter):  # noqa: F811
    """With K drafts, verify steps whose rows all carry K drafts replay a graph (1+K tokens per row, replay
    counts read on the device). Tokens, drafts and accepted counts equal the eager engine's; greedy tokens
    equal K = 0 (R6 on the GPU). An MoE drafter (`*E`) is captured on the fused MoE kernels."""
    dense_spec_model = dense_spec_model if drafter == "dense" else spec_model
    arrivals = [[("local", f"n{n}", prompt_of(n, n))] for n in (3, 11, 1, 6, 2, 9, 4, 7, 5)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = run(_engine(dense_spec_model, False), arrivals, params)
    eager_engine = _engine(dense_spec_model, False, k=k)
    eager_log = Log(eager_engine)
    eager = run(eager_engine, arrivals, params)
    engine = _engine(dense_spec_model, True, k=k)
    log = Log(engine)
    got = run(engine, arrivals, params)
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs, "no verify graph was replayed"
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in eager.items()}
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
    assert log.rows == eager_log.rows  # drafts and emitted tokens, row by row
    assert 0 < engine.stats.spec_accepted < engine.stats.spec_drafted
    # Verify steps (graphs and eager) count their GPU time (read with their tokens).
    assert engine.stats.device_seconds > 0 and eager_engine.stats.device_seconds > 0


@pytest.mark.gpu
def test_capture_graphs_captures_every_size_up_front(spec_model):  # noqa: F811
    engine = _engine(spec_model, True)
    mixed = engine.runner.mixed_graphs
    assert mixed is not None  # on by default where decode steps replay graphs (K = 0)
    # decode graphs, and mixed ones for every chunk size
    assert engine.capture_graphs() == len(graph_sizes(12, fine=True)) + len(graph_sizes(12)) * len(mixed.buckets)
    assert engine.capture_graphs() == 0  # already there
    got = run(engine, [[("local", "a", prompt_of(5))]], SamplingParams(max_tokens=6, ignore_eos=True))
    ref = run(_engine(spec_model, False), [[("local", "a", prompt_of(5))]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert got["a"].token_ids == ref["a"].token_ids
