"""Decode nodes skip the transfer of KV blocks their prefix cache holds (issue #51 item 3): the blocks a READ filled
are remembered, so a later disaggregated request whose prompt starts with the same tokens reads only the blocks after
them (and the state, always); with MTP the chain's last block is read again (its drafter KV read the token after it,
R8). The tokens are the offline engine's either way."""

import pytest

from baton.cli.cluster import Cluster
from baton.client import Client
from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from tests.test_metrics import Scraper, value

BLOCK = 8
ENGINE = {"block_size": BLOCK, "max_num_batched_tokens": 64, "max_num_seqs": 4, "num_kv_blocks": 256}
MAX_TOKENS = 6


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % 250 + 3 for i in range(n)]


@pytest.mark.parametrize("k", [0, 2])
def test_a_repeated_prefix_is_read_once(tmp_path, k):
    model = make_model(tmp_path / "m", "tiny", mtp_layers=1, seed=3, progress=False, tokenizer=False)
    shared = prompt(43)
    prompts = [shared, shared, shared + prompt(12, 1), prompt(43, 2)]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = LLMEngine.from_pretrained(model, EngineConfig(**ENGINE, num_speculative_tokens=k))
    want = [list(o.token_ids) for o in offline.generate(prompts, params)]
    args = tuple(x for key, v in ENGINE.items() for x in ("--" + key.replace("_", "-"), str(v)))
    with Cluster(str(model), prefill_workers=1, decode_workers=1, local_prefill_threshold=0,
                 engine_args=(*args, "--speculative-tokens", str(k)), log_dir=str(tmp_path / "logs")) as cluster:
        decode = Scraper(cluster.node_http_url(cluster.decode_addrs[0]))
        skipped = []
        with Client(cluster.router_addr) as client:
            for p, w in zip(prompts, want, strict=True):
                assert list(client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids) == w
                skipped.append(value(decode(), "baton_node_transfer_skipped_blocks_total"))
        assert value(decode(), "baton_node_transfers_total") == len(prompts)
    # N-1 = 42 tokens: 5 full blocks and a partial one. The first READ moves all six; the same prompt again finds the
    # five full ones (four with a drafter); the longer prompt shares them too; a prompt sharing nothing skips none.
    full = 42 // BLOCK - (1 if k else 0)
    assert skipped == [0, full, 2 * full, 2 * full]
