"""CUDA graphs of mixed steps (engine/mixed_graphs.py): decode rows plus one prompt chunk padded to Q tokens give the
tokens of steps built the usual way; the scheduler gives such steps one chunk of at most Q tokens."""

from __future__ import annotations

import pytest
import torch

from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import AUTO_MIXED_GRAPH_TOKENS, resolved_mixed_graph_tokens
from baton.engine.mixed_graph_buckets import bucket_sizes
from baton.engine.sampling_params import SamplingParams
from tests.test_spec_decode import Log, new_engine, prompt_of, run, small_spec_model, spec_model  # noqa: F401

Q = 20  # more than the tiny model's scan chunk (16): a padded chunk spans two scan chunks


def _arrivals():
    # Short prompts start decoding; longer ones arrive while they decode and go in chunks of up to Q tokens
    # (45 = 20 + 20 + 5: chunks shorter than Q too, and the last one samples).
    lengths = [(3,), (11,), (45, 1), (6,), (37,), (2, 23), (9,), (), (30,)]
    return [[("local", f"n{n}-{i}", prompt_of(n, i)) for n in group] for i, group in enumerate(lengths)]


def test_mixed_graph_tokens_is_validated():
    with pytest.raises(ValueError, match="mixed_graph_tokens': expected an integer >= 0 or None, got -1"):
        EngineConfig(mixed_graph_tokens=-1)
    with pytest.raises(ValueError, match="mixed_graph_tokens': expected 0 with speculative decoding"):
        EngineConfig(mixed_graph_tokens=64, num_speculative_tokens=2, max_num_batched_tokens=512)


@pytest.mark.parametrize("q,expected", [(512, (32, 128, 512)), (256, (64, 256)), (128, (32, 128)), (64, (64,)),
                                        (20, (20,)), (1, (1,))])
def test_bucket_sizes(q, expected):
    assert bucket_sizes(q) == expected


def test_bad_buckets_are_refused(small_spec_model):  # noqa: F811
    engine = new_engine(small_spec_model, 0, mixed_graph_tokens=Q)
    for bad in ((8, 16), (0, Q), ()):
        with pytest.raises(ValueError, match=f"expected chunk sizes in 1..{Q}, the largest {Q}"):
            engine.make_mixed_graphs(torch.device("cpu"), bad)
    mixed = engine.make_mixed_graphs(torch.device("cpu"), (4, Q))
    assert [mixed.bucket_for(n) for n in (1, 4, 5, Q)] == [4, 4, Q, Q]
    with pytest.raises(ValueError, match=f"expected a chunk of 1..{Q} tokens, got {Q + 1}"):
        mixed.bucket_for(Q + 1)


def test_mixed_graphs_are_off_on_cpu_and_without_the_option(small_spec_model):  # noqa: F811
    assert new_engine(small_spec_model, 0, mixed_graph_tokens=Q).runner.mixed_graphs is None  # no graphs on a CPU
    engine = new_engine(small_spec_model, 0)
    assert engine.runner.mixed_graphs is None
    assert engine.config.mixed_graph_tokens == 0  # the default, decided: no decode graphs on a CPU


@pytest.mark.parametrize("fields,device,graphable,expected", [
    ({}, "cuda", True, AUTO_MIXED_GRAPH_TOKENS),               # where decode steps replay graphs
    ({"max_num_batched_tokens": 192, "max_num_seqs": 64}, "cuda", True, 192),  # at most the step budget
    ({}, "cpu", True, 0),                                     # no CUDA graphs on a CPU
    ({}, "cuda", False, 0),                                   # MoE layers or the torch kernels
    ({"cuda_graphs": False}, "cuda", True, 0),
    ({"prefill_only": True}, "cuda", True, 0),                # never decodes
    ({"num_speculative_tokens": 2, "max_num_batched_tokens": 512}, "cuda", True, 0),  # K = 0 only
    ({"mixed_graph_tokens": 0}, "cuda", True, 0),             # given: as given
    ({"mixed_graph_tokens": 64}, "cpu", False, 64),
])  # fmt: skip
def test_the_default_mixed_graph_tokens_is_decided_by_where_graphs_run(fields, device, graphable, expected):
    cfg = EngineConfig(**fields)
    assert resolved_mixed_graph_tokens(cfg, torch.device(device), graphable) == expected


@pytest.mark.interpreter
@pytest.mark.parametrize("q,buckets", [(Q, None), (48, (16, 48))])
# The chunk's padding tokens past its real length belong to no row: the scan and the conv leave their outputs as
# allocated (uninitialized), and the gated norm squares whatever that memory held, in their own rows only. The
# interpreter (numpy) warns when such a square overflows (or the like); the real rows are compared below.
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
def test_static_padded_mixed_layout_equals_eager_steps_on_cpu(small_spec_model, q, buckets):  # noqa: F811
    """Decode rows and one chunk in the graphs' static layout (decode rows padded to the graph size on the scratch
    block and slot, the chunk padded to its bucket's size with its real length a device input), run eagerly on the
    CPU on the Triton kernels (interpreted), give the tokens and rows of the same steps built the usual way; with
    two buckets each chunk goes to the smallest that holds it."""
    pytest.importorskip("triton")
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    Q = q  # noqa: N806 (the module's Q in the first case)
    kw = {"mixed_graph_tokens": Q, "long_prefill_token_threshold": None}
    ref_engine = new_engine(small_spec_model, 0, **kw, kernels="torch")
    ref_log = Log(ref_engine)
    ref = run(ref_engine, _arrivals(), params)
    engine = new_engine(small_spec_model, 0, **kw, kernels="triton")
    engine.runner.graphs = engine.make_step_graphs(torch.device("cpu"))
    mixed = engine.runner.mixed_graphs = engine.make_mixed_graphs(torch.device("cpu"), buckets)
    calls = []
    used: list[tuple[int, int]] = []  # (bucket, chunk length)
    for q_b, graphs in mixed.buckets.items():
        def counting_run(dec, chunk, fill=None, _run=graphs.run, _q=q_b):
            calls.append((len(dec.state_slots), len(chunk.ids), fill is not None))
            used.append((_q, len(chunk.ids)))
            return _run(dec, chunk, fill=fill)

        graphs.run = counting_run
    log = Log(engine)
    got = run(engine, _arrivals(), params)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
    assert log.rows == ref_log.rows
    # Mixed steps of several decode-row counts (padded: 3, 5, 6 or 7 rows run as 4 or 8), chunks of Q tokens and
    # shorter ones, some with PENDING decode tokens taken from the step in flight.
    assert len(calls) > 5 and {n for n, _, _ in calls} - {1, 2, 4, 8}
    assert any(f for _, _, f in calls)
    if buckets is None:  # one bucket: chunks of Q and shorter
        assert {L for _, L, _ in calls} >= {Q, 5}
    # Each chunk replayed the smallest bucket holding it (with two buckets, both were used).
    sizes = sorted(mixed.buckets)
    assert all(b == min(s for s in sizes if s >= L) for b, L in used) and {b for b, _ in used} == set(sizes)
    # Every step with decode rows carried one chunk at most, of at most Q tokens.
    for out in log.steps:
        if out.num_decodes:
            assert out.num_prefills <= 1 and all(r.num_tokens <= Q for r in out.rows[out.num_decodes:])
    # The engine counts the steps each graph replayed; a node exports them by path, the rest as eager steps.
    st = engine.stats
    assert st.mixed_graph_steps == len(calls) and st.graph_steps > 0 and st.graph_steps + len(calls) < st.steps
    from baton.node.metrics import NodeMetrics

    metrics = NodeMetrics("decode", "d0")
    metrics.on_step(engine)
    paths = {s.labels["path"]: s.value for fam in metrics.registry.collect() if fam.name == "baton_node_path_steps"
             for s in fam.samples if s.name.endswith("_total")}
    assert paths == {"decode_graph": st.graph_steps, "mixed_graph": len(calls),
                     "eager": st.steps - st.graph_steps - len(calls)}


def _engine(model, dtype: str, q: int):
    cfg, weights = model
    from baton.engine.llm_engine import LLMEngine

    return LLMEngine(cfg, weights, EngineConfig(block_size=4, max_num_seqs=12, max_num_batched_tokens=96,
                                                dtype=dtype, num_kv_blocks=256, device="cuda", mixed_graph_tokens=q))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,q", [("float32", Q), ("bfloat16", Q), ("bfloat16", 128)])
def test_gpu_mixed_graphs_equal_eager_mixed_steps(spec_model, dtype, q):  # noqa: F811
    """On the GPU, the same schedule (one chunk of at most Q tokens beside decode rows) with mixed steps replayed
    as CUDA graphs and run eagerly gives the same greedy tokens; graphs of several sizes were captured (Q = 128: in
    two buckets, 32 and 128)."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    eager_engine = _engine(spec_model, dtype, q)
    eager_engine.runner.mixed_graphs = None
    eager = run(eager_engine, _arrivals(), params)
    engine = _engine(spec_model, dtype, q)
    mixed = engine.runner.mixed_graphs
    assert mixed is not None and sorted(mixed.buckets) == list(bucket_sizes(q))
    got = run(engine, _arrivals(), params)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in eager.items()}
    assert mixed.num_graphs >= 2
    assert all(g.graphs for g in mixed.buckets.values())  # every bucket replayed


@pytest.mark.interpreter
def test_padding_chunk_fits_when_max_model_len_is_below_q(small_spec_model):  # noqa: F811
    """The graphs are captured on a padding chunk of Q tokens, which may be longer than any sequence the engine
    takes (max_model_len 16 < Q = 48, as in mtp_bench's engines): its block table covers all Q tokens, so every
    size's padded step runs on the Triton kernels (interpreted) within the static buffers and gives finite logits.
    (Otherwise its attention reads block ids past the block tables' end: a crash on the CPU, a CUDA error on a GPU
    in `capture_graphs`.)"""
    pytest.importorskip("triton")
    engine = new_engine(small_spec_model, 0, mixed_graph_tokens=48, long_prefill_token_threshold=None,
                        max_model_len=16, kernels="triton")
    mixed = engine.make_mixed_graphs(torch.device("cpu"))
    assert sorted(mixed.buckets) == [48]
    graphs = mixed.buckets[48]
    assert graphs.max_blocks * engine.config.block_size >= 48
    with torch.inference_mode():
        for n in graphs.sizes:
            graphs._pad(n)
            assert torch.isfinite(graphs._forward(n)).all()


@pytest.mark.gpu
def test_gpu_capture_graphs_when_max_model_len_is_below_q(spec_model):  # noqa: F811
    """`capture_graphs` captures every mixed size of an engine whose max_model_len is below Q, and the engine then
    serves the usual schedule with the same tokens as without mixed graphs."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cfg, weights = spec_model
    from baton.engine.llm_engine import LLMEngine

    def engine_of(q: int) -> LLMEngine:
        return LLMEngine(cfg, weights, EngineConfig(block_size=4, max_num_seqs=12, max_num_batched_tokens=96,
                                                    dtype="float32", num_kv_blocks=256, device="cuda",
                                                    mixed_graph_tokens=q, max_model_len=60))
    engine = engine_of(64)
    assert engine.capture_graphs() > len(engine.runner.graphs.sizes)
    ref = run(engine_of(0), _arrivals(), params)
    got = run(engine, _arrivals(), params)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
