"""Verify steps of rows whose logits are processed by penalties and min_p replay the verify graph's processed twin
(`graph_processing`): the penalties read the runner's resident counts, which the graph itself grows by the tokens
each step emits. Every request's tokens, drafts and accepted counts equal eager steps' (`RejectionSampler.verify`
with the rows' `LogitsInputs`). CPU: the graphs' static layout runs eagerly, on the torch references.
"""

from __future__ import annotations

import pytest

from baton.engine.cuda_graphs import FILTERED, GREEDY, PROCESSED, TEMPERED
from baton.engine.graph_processing import graph_processable
from baton.engine.logits_processing import RowHistory
from baton.engine.sampling_params import SamplingParams
from tests.test_chained_verify import _graph_engine
from tests.test_spec_decode import Log, new_engine, prompt_of, run, small_spec_model  # noqa: F401

# By prompt length: the penalties and min_p (and sampling) each request has; 2 has none, 7 a logit_bias and 5 a
# min_tokens: the steps holding those two (7 finishes early; 5 reaches its min_tokens) run eagerly.
PROCESSING = {
    3: dict(presence_penalty=1.5),
    11: dict(frequency_penalty=0.7, repetition_penalty=1.3),
    1: dict(repetition_penalty=2.0),
    6: dict(temperature=0.9, seed=6, min_p=0.2, presence_penalty=0.5),
    9: dict(temperature=1.2, seed=9, top_k=3, frequency_penalty=0.4),
    4: dict(temperature=0.8, seed=4, min_p=0.3),
    7: dict(logit_bias=((3, 2.5), (5, -4.0))),
    5: dict(min_tokens=3),
}
MAX_TOKENS = {9: 6, 6: 12, 4: 12, 3: 15, 11: 13, 1: 15, 7: 3, 5: 6, 2: 4}
# By step: the requests that arrive before it. The sampled rows finish first (top-k first), the greedy ones last,
# so that every processed variant runs.
ARRIVALS = {0: (9, 6, 4, 3, 11, 1), 8: (7,), 10: (5, 2)}


def _arrivals() -> list[list[tuple]]:
    return [[("local", f"n{n}", prompt_of(n, n)) for n in ARRIVALS.get(i, ())] for i in range(max(ARRIVALS) + 1)]


def _params(processing: dict[int, dict]) -> dict[str, SamplingParams]:
    return {f"n{n}": SamplingParams(max_tokens=m, ignore_eos=True, **processing.get(n, {}))
            for n, m in MAX_TOKENS.items()}


def _check_processed_graphs(ref_engine, engine) -> dict:
    params = _params(PROCESSING)
    ref_log = Log(ref_engine)
    ref = run(ref_engine, _arrivals(), params)
    graphs = engine.runner.graphs
    variants: list[int] = []
    forward = graphs._forward
    graphs._forward = lambda n, variant=GREEDY: variants.append(variant) or forward(n, variant)
    log = Log(engine)
    got = run(engine, _arrivals(), params)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
    assert log.rows == ref_log.rows
    # Greedy, tempered and filtered rows beside the processed ones ran in the processed twins; the steps holding the
    # logit_bias row or the min_tokens row before its third token ran eagerly.
    assert {PROCESSED + GREEDY, PROCESSED + TEMPERED, PROCESSED + FILTERED} <= set(variants)
    assert 0 < engine.stats.graph_steps < engine.stats.steps
    assert 0 < engine.stats.spec_accepted < engine.stats.spec_drafted
    assert engine.stats.spec_accepted == ref_engine.stats.spec_accepted
    return got


@pytest.mark.interpreter
def test_penalised_and_min_p_rows_verify_in_the_processed_graphs_as_eager_steps(small_spec_model):  # noqa: F811
    pytest.importorskip("triton")
    # No graphs on the reference: eager verify steps.
    got = _check_processed_graphs(new_engine(small_spec_model, 2, kernels="torch"),
                                  _graph_engine(small_spec_model, 2, kernels="triton"))
    # The processing changed what the rows emit: without it the same requests decide otherwise.
    plain = run(new_engine(small_spec_model, 2, kernels="torch"), _arrivals(), _params({}))
    assert {r: o.token_ids for r, o in plain.items()} != {r: o.token_ids for r, o in got.items()}


@pytest.mark.gpu
def test_processed_graphs_capture_and_replay_on_the_gpu(small_spec_model):  # noqa: F811
    """The processed twins captured in CUDA graphs (the kernels' processing, the counts grown inside the graph)
    give the eager GPU engine's tokens, drafts and accepted counts."""
    _check_processed_graphs(new_engine(small_spec_model, 2, device="cuda"),
                            new_engine(small_spec_model, 2, device="cuda", cuda_graphs=True))


@pytest.mark.parametrize("params, outputs, expected", [
    (SamplingParams(), (), True),
    (SamplingParams(presence_penalty=1.0, repetition_penalty=1.2), (1, 2), True),
    (SamplingParams(temperature=1.0, min_p=0.1), (), True),
    (SamplingParams(logit_bias=((1, 1.0),)), (), False),
    (SamplingParams(min_tokens=3), (1, 2), False),
    (SamplingParams(min_tokens=3), (1, 2, 3), True),
])
def test_what_a_graph_processes(params, outputs, expected):
    assert graph_processable(params, RowHistory((0,), outputs, frozenset({7}))) is expected
