"""Many concurrent SSE streams through the router's HTTP front, each on its own HTTP/1.1 connection.

Over fake workers: 500 streams all complete with their tokens. Against a real cluster (router + prefill +
decode processes, tiny model): 500 streams all complete, each equal to the offline engine's greedy output,
and both nodes end with every block and slot free.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx2
import pytest

from baton.cli.cluster import Cluster
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from tests.test_e2e import ENGINE_ARGS, all_free, offline
from tests.test_openai_http import fake_front
from tests.test_router_fakes import expected_tokens, run


async def _stream(c: httpx2.AsyncClient, url: str, body: dict) -> list[int]:
    """The token ids of one streamed completion (asserting it ends with [DONE] and carries no error)."""
    async with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in ch for ch in chunks), chunks
    return [t for ch in chunks for choice in ch["choices"] for t in choice["token_ids"]]


async def _many(url: str, bodies: list[dict]) -> list[list[int]]:
    # One connection per stream: the server holds them all at once.
    limits = httpx2.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx2.AsyncClient(trust_env=False, timeout=120, limits=limits) as c:
        return await asyncio.gather(*(_stream(c, url, b) for b in bodies))


def test_500_concurrent_sse_streams_over_fakes():
    async def go():
        async with fake_front() as env:
            env.decode.token_delay_s = 0.01
            bodies = [{"model": "fake", "prompt": [5, 6, i % 50 + 3], "max_tokens": 8, "return_token_ids": True}
                      for i in range(500)]
            t0 = time.monotonic()
            out = await _many(env.url, bodies)
            assert out == [expected_tokens(b["prompt"], 8) for b in bodies]
            assert time.monotonic() - t0 < 60
            await asyncio.sleep(0.1)
            assert env.router.http.app.front.in_flight == 0

    run(go())


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("streams") / "tiny"
    make_model(out, preset="tiny", seed=37, progress=False)
    return out


def _real_cluster_streams(model: Path, log_dir: Path, n: int) -> None:
    prompts = [[(7 * i + 11 * j) % 400 + 3 for j in range(12 + i)] for i in range(5)]
    ref = offline(str(model), prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    # Room for many requests at once (the last of a repeated flag wins).
    engine_args = (*ENGINE_ARGS, "--max-num-seqs", "64", "--max-num-batched-tokens", "128")
    with Cluster(str(model), prefill_workers=1, decode_workers=1, engine_args=engine_args,
                 log_dir=str(log_dir)) as cluster:
        bodies = [{"model": "tiny", "prompt": prompts[i % 5], "max_tokens": 6, "temperature": 0,
                   "ignore_eos": True, "return_token_ids": True} for i in range(n)]
        out = asyncio.run(asyncio.wait_for(_many(cluster.router_http_url, bodies), 600))
        assert out == [ref[i % 5] for i in range(n)]
        free, loads = all_free(cluster)
        assert free, loads


def test_500_concurrent_sse_streams_against_a_real_cluster(model, tmp_path):
    _real_cluster_streams(model, tmp_path / "logs", 500)
