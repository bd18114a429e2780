"""A prefill node's `Load` answer counts a prompt from its arrival until its handle is handed back, as the router
does: the router keeps a prompt in its estimate until the Prefill call returns and then takes it off the last
poll's count, so a poll that dropped prompts once their last chunk was launched (two steps before they return,
with async scheduling) left the router counting them twice over: not at all in the poll, then taken off it again."""

import pytest

from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from baton.node.load import load_response


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    make_model(out, preset="tiny", seed=5, progress=False)
    return load_checkpoint(out)


def _outstanding(engine: LLMEngine, role: str) -> int:
    return load_response(engine, role).outstanding_prefill_tokens


def test_prefill_node_load_counts_each_prompt_until_its_handle_is_handed_back(tiny):
    cfg, weights = tiny
    engine = LLMEngine(cfg, weights, EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, block_size=8,
                                                  prefill_only=True))
    for rid, n in (("a", 20), ("b", 30), ("c", 40)):
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=1), request_id=rid, prefill_only=True)
    # N-1 tokens each: what the node computes, and what the router adds for the call.
    assert _outstanding(engine, "prefill") == 19 + 29 + 39
    assert engine.step() == []  # step 1 launched (a's 19 tokens, b's first 13), not read: nothing handed back
    assert _outstanding(engine, "prefill") == 19 + 29 + 39
    outs = engine.step()  # step 2 launched (b's last 16, c's first 16); step 1 read: a handed back
    assert [o.request_id for o in outs] == ["a"]
    assert _outstanding(engine, "prefill") == 29 + 39
    outs = engine.step()  # step 3 launched (c's last 23); step 2 read: b handed back
    assert [o.request_id for o in outs] == ["b"]
    assert _outstanding(engine, "prefill") == 39
    assert [o.request_id for o in engine.step()] == ["c"]
    assert _outstanding(engine, "prefill") == 0


def test_decode_node_load_still_counts_prompt_tokens_left_to_compute(tiny):
    # A decode node's requests return only when they finish decoding: its backlog is the prompt work left.
    cfg, weights = tiny
    engine = LLMEngine(cfg, weights, EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, block_size=8))
    engine.add_request(list(range(3, 43)), SamplingParams(max_tokens=4), request_id="a")
    assert _outstanding(engine, "decode") == 40
    engine.step()  # its first 32 tokens launched
    assert _outstanding(engine, "decode") == 8
