"""Prefix affinity through a real router and two CPU decode nodes (no prefill node: each prompt is prefilled on
its decode node, whose prefix cache is then the one that counts): requests sharing a long prefix all go to the
node that prefilled it first, while distinct prompts in flight together are spread over both by load."""

from __future__ import annotations

import time

import pytest

from baton.cli.cluster import Cluster
from baton.client import Client
from baton.engine.make_model import make_model
from tests.test_metrics import Scraper, scrape, until, value

BLOCK = 8
PREFIX = [(7 * i + 5) % 500 + 1 for i in range(6 * BLOCK)]  # six full blocks shared by every hot request
HOT = 5
# The router's Load poll period here: short, so that a pause of a few of them gives every pick an exact count.
POLL_S = 0.05


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_model(tmp_path_factory.mktemp("affinity") / "tiny", preset="tiny", seed=5, progress=False,
                          tokenizer=False))


def test_a_shared_prefix_sticks_to_one_decode_node_and_distinct_prompts_spread(model, tmp_path):
    engine_args = ("--block-size", str(BLOCK), "--max-num-seqs", "4", "--num-kv-blocks", "256")
    # A weight of 4 covers a whole earlier request still in a stale Load poll of the holder (its tokens are at
    # most the prompt's, while the hit is six blocks of it).
    with Cluster(model, prefill_workers=0, decode_workers=2, engine_args=engine_args,
                 router_args=("--prefix-affinity-weight", "4", "--load-poll-interval", str(POLL_S)), log_dir=str(tmp_path / "logs")) as cluster:
        nodes = [cluster.node_http_url(a) + "/metrics" for a in cluster.decode_addrs]
        router = cluster.router_http_url + "/metrics"
        with Client(cluster.router_addr) as client:
            for i in range(HOT):
                out = client.generate([*PREFIX, *range(100 + 8 * i, 108 + 8 * i)], max_tokens=4, ignore_eos=True)
                assert len(out.token_ids) == 4
        computed = [value(scrape(url), "baton_node_prompt_tokens_total") for url in nodes]
        assert sorted(c > 0 for c in computed) == [False, True], computed  # every hot request on one node
        r = scrape(router)
        assert value(r, "baton_router_prefix_affinity_decisions_total", role="decode", by="affinity") == HOT - 1
        assert value(r, "baton_router_prefix_affinity_decisions_total", role="decode", by="load") == 1
        assert value(r, "baton_router_prefix_predicted_hit_tokens_total", role="decode") == (HOT - 1) * len(PREFIX)
        # Six prefix blocks plus one block of each request's own tail.
        assert value(r, "baton_router_prefix_index_blocks", role="decode") == 6 + HOT
        assert value(r, "baton_router_prefix_predicted_hit_tokens_total", role="prefill") == 0

        # Distinct prompts (each first block differs), in flight together: each is picked seeing the ones before.
        # Between a stream's end or first token and the next poll the router's slot count is an estimate that a
        # poll racing the stream can leave one off (`LoadTracker`), so each pick waits for fresh polls.
        with Client(cluster.router_addr, retries=0) as client:
            streams = []
            for i in range(4):
                time.sleep(4 * POLL_S)
                s = client.stream([400 + i, *range(1, 40)], max_tokens=1500, ignore_eos=True)
                next(iter(s))  # its first token: it has been routed and is running
                streams.append(s)
            for url in nodes:
                until(Scraper(url.removesuffix("/metrics")), lambda m: value(m, "baton_node_running_requests") == 2,
                      "two streams on each decode node")
            for s in streams:
                s.cancel()
        r = scrape(router)
        assert value(r, "baton_router_prefix_affinity_decisions_total", role="decode", by="affinity") == HOT - 1
