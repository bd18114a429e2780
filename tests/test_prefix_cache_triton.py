"""Checkpoints taken inside a prefill chunk (checkpoint rows: the recurrent mixers' appended sequences) on the Triton
kernels, in the interpreter on a CPU: requests resuming from them give the cache-off tokens of the torch references,
for both recurrent mixers (Mamba2's chunk layout is built for the appended sequences too); compiled on a GPU."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from tests.test_prefix_cache import (  # noqa: E402, F401
    GREEDY,
    SHARED,
    assert_checkpoint_rows_hold_the_prefix_state,
    checkpoint_rows_of,
    model,
    new_engine,
)

pytestmark = pytest.mark.interpreter


def test_requests_resuming_from_checkpoint_rows_on_the_kernels_equal_the_references(model):  # noqa: F811
    # One chunk of 20 tokens takes the checkpoint at 16 inside it (boundaries every 8); the next two resume there.
    prompts = [SHARED[:20], SHARED[:20] + [1, 2], SHARED[:17] + [3]]
    ref = [new_engine(model, cache=False, kernels="torch").generate([p], GREEDY)[0].token_ids for p in prompts]
    engine = new_engine(model, kernels="triton", long_prefill_token_threshold=64)
    rows = checkpoint_rows_of(engine)
    assert [engine.generate([p], GREEDY)[0].token_ids for p in prompts] == ref
    assert [c.num_tokens for c, _ in rows] == [16]
    assert engine.stats.prefix_hit_tokens == 2 * 16


def test_a_checkpoint_row_on_the_kernels_holds_the_state_a_prefill_of_the_prefix_leaves(model):  # noqa: F811
    assert_checkpoint_rows_hold_the_prefix_state(model, kernels="triton")


@pytest.mark.gpu
def test_a_checkpoint_row_on_the_gpu_holds_the_state_a_prefill_of_the_prefix_leaves(model):  # noqa: F811
    # Without mixed-step graphs, as on a prefill node: an engine with them cuts the chunk instead.
    assert_checkpoint_rows_hold_the_prefix_state(model, kernels="triton", device="cuda", mixed_graph_tokens=0)
