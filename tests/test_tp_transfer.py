"""Disaggregated serving between nodes of different tensor-parallel sizes (#50 item 3), real processes on CPU: a
prefill node of `a` ranks and a decode node of `b` ranks (gloo within a node, NIXL between every rank pair that
holds a shard the other needs) serve the greedy tokens of the aggregated one-rank engine, every request read over
NIXL (no fallback to a local prefill), with and without MTP (the drafter's KV travels with the target's, R8), and
every block, slot and lease is free afterwards on both nodes.
"""

from __future__ import annotations

import asyncio

import pytest

from baton.cli.cluster import Cluster
from baton.client import AsyncClient
from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from baton.node.rank_transfer import engine_pool_shards
from tests.node_faults import all_free
from tests.test_metrics import scrape, value

BLOCK, CHUNK = 8, 32
ENGINE = {"block_size": BLOCK, "max_num_batched_tokens": CHUNK, "max_num_seqs": 4, "num_kv_blocks": 128}
ENGINE_ARGS = (*(x for k, v in ENGINE.items() for x in ("--" + k.replace("_", "-"), str(v))), "--device", "cpu")
MAX_TOKENS = 8
# Lengths around a block and a chunk, and one spanning several of each.
PROMPTS = [[(5 * i + n) % 8 for i in range(n)] for n in (2, BLOCK + 1, CHUNK + 1, 70)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # Four Mamba2 groups split over four ranks; a vocabulary of 8 makes the random drafter right often enough that
    # drafts get accepted.
    return str(make_model(tmp_path_factory.mktemp("tp-transfer") / "tiny", preset="tiny", mtp_layers=1, seed=3,
                          overrides={"n_groups": 4, "vocab_size": 8}, progress=False, tokenizer=False))


@pytest.fixture(scope="module")
def reference(model):
    engine = LLMEngine.from_pretrained(model, EngineConfig(**ENGINE, device="cpu"))
    return [list(o.token_ids) for o in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS,
                                                                               ignore_eos=True))]


def whole_model_bytes(model: str, k: int) -> tuple[int, int]:
    """(bytes of one KV block, bytes of one state slot) of the whole model's travelling pools, drafter's included."""
    engine = LLMEngine.from_pretrained(model, EngineConfig(**ENGINE, device="cpu", num_speculative_tokens=k))
    shards = engine_pool_shards(engine)
    kv = sum(s.item_bytes() for name, s in shards.items() if "kv" in name)
    return kv, sum(s.item_bytes() for name, s in shards.items() if "kv" not in name)


# A decode rank reading two prefill ranks' shards, with and without the drafter's KV, and one rank's shard read by
# two; four prefill ranks oversubscribe the CI box's two cores: under -m slow.
@pytest.mark.parametrize("prefill_tp, decode_tp, k", [
    (2, 1, 0), (1, 2, 2), (2, 1, 2), pytest.param(4, 2, 2, marks=pytest.mark.slow)],
    ids=["tp2-to-tp1", "tp1-to-tp2-mtp", "tp2-to-tp1-mtp", "tp4-to-tp2-mtp"])
def test_prefill_and_decode_of_different_tp_sizes_give_the_one_rank_tokens(model, reference, tmp_path, prefill_tp,
                                                                            decode_tp, k):
    spec = ("--speculative-tokens", str(k)) if k else ()
    with Cluster(model, prefill_workers=1, decode_workers=1, engine_args=(*ENGINE_ARGS, *spec),
                 prefill_args=("--tensor-parallel-size", str(prefill_tp)),
                 decode_args=("--tensor-parallel-size", str(decode_tp)), log_dir=str(tmp_path / "logs")) as cluster:

        async def main():
            async with AsyncClient(cluster.router_addr) as client:
                return await asyncio.gather(*(client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True)
                                              for p in PROMPTS))

        outs = asyncio.run(main())
        assert [list(o.token_ids) for o in outs] == reference
        decode = scrape(cluster.node_http_url(cluster.decode_addrs[0]) + "/metrics")
        assert value(decode, "baton_node_transfers_total") == len(PROMPTS)
        assert value(decode, "baton_node_transfer_fallbacks_total") == 0
        # Every decode rank's share of the bytes is counted: together, the whole model's caches of the prompts.
        kv_bytes, state_bytes = whole_model_bytes(model, k)
        blocks = sum(-(-(len(p) - 1) // BLOCK) for p in PROMPTS) - value(decode, "baton_node_transfer_skipped_blocks_total")
        assert value(decode, "baton_node_transfer_bytes_total") == blocks * kv_bytes + len(PROMPTS) * state_bytes
        if k:
            assert value(decode, "baton_node_spec_accepted_tokens_total") > 0
        free, loads = all_free(cluster)
        assert free, loads
