"""End to end with real processes: client SDK -> router -> prefill node -> NIXL -> decode node -> stream.

R6: greedy output through the router equals the offline engine token for token, for prompt lengths 1, 2,
3, block_size±1, chunk±1 and 300, with 1P1D and 2P1D, all requests in flight at once.
R7: cancelling a stream mid-way frees every block and slot on both nodes.
Failure: killing the prefill node mid-request still gets the client a correct answer (local prefill).
MTP: a cluster started with --speculative-tokens serves `baton client generate` the same greedy tokens, and
the same draft / acceptance counts as the aggregated engine (R8).
"""

import asyncio
import contextlib
import json
import random
import subprocess
import sys

import pytest

from baton.cli.cluster import Cluster
from baton.client import AsyncClient
from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from baton.engine.tokenizer import load_tokenizer
from tests.node_faults import all_free

BLOCK, CHUNK = 8, 32
ENGINE = {"block_size": BLOCK, "max_num_batched_tokens": CHUNK, "max_num_seqs": 8, "num_kv_blocks": 512}
ENGINE_ARGS = tuple(x for k, v in ENGINE.items() for x in ("--" + k.replace("_", "-"), str(v)))
LENGTHS = (1, 2, 3, BLOCK - 1, BLOCK + 1, CHUNK - 1, CHUNK + 1, 300)
MAX_TOKENS = 16
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "tiny"
    make_model(out, preset="tiny", seed=31, progress=False)
    return str(out)


@pytest.fixture(scope="module")
def cluster_1p1d(model, tmp_path_factory):
    """One prefill and one decode node shared by the tests that leave them as they found them (each checks that
    every block and slot is free again at its end)."""
    with Cluster(model, prefill_workers=1, decode_workers=1, engine_args=ENGINE_ARGS,
                 log_dir=str(tmp_path_factory.mktemp("e2e-logs"))) as cluster:
        yield cluster


def prompts_for(lengths, salt=0):
    return [[(11 * i + 5 * n + salt) % 500 + 3 for i in range(n)] for n in lengths]


def offline(model, prompts, params):
    engine = LLMEngine.from_pretrained(model, EngineConfig(**ENGINE))
    return [list(o.token_ids) for o in engine.generate(prompts, params)]


async def collect(client, prompt, **kw):
    return await client.generate(prompt, **kw)


def test_prefill_node_killed_mid_request_falls_back_to_local_prefill(model, tmp_path):
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = prompts_for([300, 250, 40])
    ref = offline(model, prompts, params)
    with Cluster(model, prefill_workers=1, decode_workers=1, engine_args=ENGINE_ARGS,
                 log_dir=str(tmp_path / "logs")) as cluster:

        async def main():
            async with AsyncClient(cluster.router_addr) as client:
                tasks = [asyncio.create_task(collect(client, p, max_tokens=MAX_TOKENS, ignore_eos=True))
                         for p in prompts]
                await asyncio.sleep(0.05)  # the prefills are under way
                await asyncio.to_thread(cluster.kill, "prefill-0")
                return await asyncio.gather(*tasks)

        outs = asyncio.run(main())
        assert [list(o.token_ids) for o in outs] == ref
        # Nothing stays allocated on the surviving decode node (polled, as the other fault tests do).
        free, loads = all_free(cluster, addrs=cluster.decode_addrs)
        assert free, loads


def test_speculative_decoding_through_the_cli_client_equals_offline(tmp_path):
    # A vocabulary of 8 makes the random drafter right often enough that drafts get accepted.
    model = str(make_model(tmp_path / "tiny-mtp", preset="tiny", mtp_layers=1, seed=3,
                           overrides={"vocab_size": 8}, progress=False, tokenizer=False))
    prompts = [[(3 * i + n) % 8 for i in range(n)] for n in (1, 2, 3, 4, BLOCK + 1, CHUNK + 1, 70)]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with Cluster(model, prefill_workers=1, decode_workers=1, engine_args=(*ENGINE_ARGS, "--speculative-tokens", "2"),
                 log_dir=str(tmp_path / "logs")) as cluster:
        cmd = [sys.executable, "-m", "baton.cli.main", "client", "generate", "--addr", cluster.router_addr, "--json",
               "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--timeout", "60"]
        for p in prompts:
            cmd += ["--prompt-ids", " ".join(map(str, p))]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        free, loads = all_free(cluster)
        assert free, loads
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [x["prompt_ids"] for x in lines] == prompts
    # Greedy verification: the tokens of the engine without speculative decoding.
    assert [x["token_ids"] for x in lines] == offline(model, prompts, params)
    spec = [(x["spec"]["drafted"], x["spec"]["accepted"]) for x in lines]
    assert all(d > 0 and 0 <= a <= d for d, a in spec) and sum(a for _, a in spec) > 0
    # R8: the drafter's KV travelled with the target's, so drafts (and what was accepted) are those of the
    # aggregated engine.
    agg = LLMEngine.from_pretrained(model, EngineConfig(**ENGINE, num_speculative_tokens=2)).generate(prompts, params)
    assert spec == [(o.num_drafted, o.num_accepted) for o in agg]


@pytest.mark.parametrize("prefill_workers", [2, 1], ids=["2P1D", "1P1D"])
def test_r6_greedy_through_the_router_equals_offline(model, tmp_path, prefill_workers, request):
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = prompts_for(LENGTHS) + prompts_for(LENGTHS, salt=7)  # 16 requests in flight at once
    ref = offline(model, prompts, params)
    if prefill_workers == 1:
        shared = contextlib.nullcontext(request.getfixturevalue("cluster_1p1d"))
    else:
        shared = Cluster(model, prefill_workers=prefill_workers, decode_workers=1, engine_args=ENGINE_ARGS,
                         log_dir=str(tmp_path / "logs"))
    with shared as cluster:

        async def main():
            async with AsyncClient(cluster.router_addr) as client:
                return await asyncio.gather(*(collect(client, p, max_tokens=MAX_TOKENS, ignore_eos=True)
                                              for p in prompts))

        outs = asyncio.run(main())
        assert [list(o.token_ids) for o in outs] == ref
        assert all(o.finish_reason == "length" and o.completion_tokens == MAX_TOKENS for o in outs)
        assert [o.prompt_tokens for o in outs] == [len(p) for p in prompts]
        free, loads = all_free(cluster)
        assert free, loads


def test_r7_cancelled_stream_frees_everything_on_both_nodes_and_text_prompts_work(model, cluster_1p1d):
    with contextlib.nullcontext(cluster_1p1d) as cluster:

        async def main():
            async with AsyncClient(cluster.router_addr) as client:
                seen = 0
                stream = client.stream(prompts_for([120])[0], max_tokens=400, ignore_eos=True)
                async for chunk in stream:
                    seen += len(chunk.token_ids)
                    if seen >= 5:
                        break  # the client walks away mid-stream
                await stream.aclose()
                # Requests still work after the cancel; a text prompt goes through the router's tokenizer.
                again = await collect(client, prompts_for([40])[0], max_tokens=4, ignore_eos=True)
                text = await collect(client, TEXT, max_tokens=MAX_TOKENS, ignore_eos=True)
                return again, text

        again, text = asyncio.run(main())
        assert len(again.token_ids) == 4
        tok = load_tokenizer(model)
        ids = tok.encode(TEXT)
        assert text.prompt_tokens == len(ids) > 1
        assert [list(text.token_ids)] == offline(model, [ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        assert text.text == tok.decode(list(text.token_ids))
        free, loads = all_free(cluster)
        assert free, loads


def test_r7_cancels_at_random_moments_leak_nothing(model, cluster_1p1d):
    # Cancels land during the prefill, the lease, the pull, the first token or the stream.
    rng = random.Random(17)
    prompts = prompts_for([rng.randint(2, 300) for _ in range(12)])
    with contextlib.nullcontext(cluster_1p1d) as cluster:

        async def one(client, p, delay):
            task = asyncio.create_task(collect(client, p, max_tokens=64, ignore_eos=True))
            await asyncio.sleep(delay)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        async def main():
            async with AsyncClient(cluster.router_addr) as client:
                await asyncio.gather(*(one(client, p, rng.uniform(0.0, 0.6)) for p in prompts))
                # Still serving correctly afterwards.
                return await collect(client, prompts_for([33])[0], max_tokens=MAX_TOKENS, ignore_eos=True)

        after = asyncio.run(main())
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        assert [list(after.token_ids)] == offline(model, [prompts_for([33])[0]], params)
        free, loads = all_free(cluster, timeout=15.0)
        assert free, loads
