"""The prefix cache's node metrics (docs/metrics.md) move in a real aggregated node: a prompt sharing a prefix with
an earlier one is served partly from the cache (hit tokens), checkpoints are held (slots, bytes), and distinct prompts
through a small pool evict blocks and checkpoints. test_metrics.py's real cluster shares no prefix and evicts
nothing, so it points here."""

from baton.cli.cluster import Cluster
from baton.client import Client
from baton.engine.make_model import make_model
from tests.test_metrics import Scraper, value

BLOCK = 8


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 7 + 5 * i) % 251 for i in range(n)]


def test_hits_checkpoints_and_evictions_move(tmp_path):
    model = make_model(tmp_path / "m", "tiny", progress=False, tokenizer=False)
    # Checkpoints at every block boundary, two checkpoint slots (one per state slot) and KV blocks for about three
    # prompts: a shared prefix is found, and distinct prompts soon evict.
    engine_args = ("--block-size", str(BLOCK), "--max-num-batched-tokens", "64", "--max-num-seqs", "2",
                   "--num-kv-blocks", "24", "--prefix-checkpoint-stride", "1")
    with Cluster(str(model), prefill_workers=0, decode_workers=1, local_prefill_threshold=2**31 - 1,
                 engine_args=engine_args, log_dir=str(tmp_path / "logs")) as cluster:
        node = Scraper(cluster.node_http_url(cluster.decode_addrs[0]))
        shared = prompt(40, 1)
        with Client(cluster.router_addr) as client:
            first = client.generate(shared + [7], max_tokens=4, ignore_eos=True)
            m = node()
            assert value(m, "baton_node_prefix_hit_tokens_total") == 0
            assert value(m, "baton_node_prefix_queried_tokens_total") == 41
            assert value(m, "baton_node_prefix_checkpoint_slots") > 0 and value(
                m, "baton_node_prefix_checkpoint_bytes") > 0
            again = client.generate(shared + [7], max_tokens=4, ignore_eos=True)
            assert again.token_ids == first.token_ids  # served from the cache, the same tokens
            m = node()
            assert 0 < value(m, "baton_node_prefix_hit_tokens_total") <= 40
            for seed in range(2, 8):
                client.generate(prompt(64, seed), max_tokens=4, ignore_eos=True)
        m = node()
        assert value(m, "baton_node_prefix_evictions_total", kind="block") > 0
        assert value(m, "baton_node_prefix_evictions_total", kind="checkpoint") > 0
        assert value(m, "baton_node_prefix_queried_tokens_total") == 2 * 41 + 6 * 64
