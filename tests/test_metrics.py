"""Prometheus metrics and the HTTP endpoints (README.md "Metrics").

- every metric is named `baton_*` with a unit suffix;
- the router over fake workers: every routing decision, retries, outcomes, latencies and MTP counters move,
  and /health follows the decode workers' health;
- a real cluster (router + prefill + decode processes, MTP on): after a local-prefill and a disaggregated
  request, every metric of the router and of both nodes exists on /metrics, and the ones that traffic
  implies moved; /health and /v1/workers answer.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.cli.cluster import Cluster
from baton.client import Client
from baton.engine.make_model import make_model
from baton.node.metrics import NodeMetrics
from baton.proto.v1 import generation_pb2, generation_pb2_grpc
from baton.router.config import RouterConfig
from baton.router.metrics import RouterMetrics
from baton.router.server import start_router
from baton.transfer.stats import TransferStats
from tests.test_router_fakes import eventually, run, spec_totals, start_fake

UNITS = ("seconds", "bytes", "tokens", "requests", "blocks", "slots", "ratio", "workers", "leases", "steps",
         "transfers", "failures", "expiries", "fallbacks", "retries", "decisions", "info")

ROUTER_METRICS = {  # sample name -> how it must have moved in the real cluster
    "baton_router_requests_total": "positive",
    "baton_router_in_flight_requests": "exists",
    "baton_router_time_to_first_token_seconds_count": "positive",
    "baton_router_inter_token_latency_seconds_count": "positive",
    "baton_router_e2e_request_latency_seconds_count": "positive",
    "baton_router_prompt_tokens_total": "positive",
    "baton_router_generation_tokens_total": "positive",
    "baton_router_routing_decisions_total": "positive",
    "baton_router_retries_total": "exists",
    "baton_router_spec_drafted_tokens_total": "positive",
    "baton_router_spec_accepted_tokens_total": "positive",
    "baton_router_healthy_workers": "positive",
}
NODE_METRICS = {  # in both nodes
    "baton_node_info": "positive",
    "baton_node_waiting_requests": "exists",
    "baton_node_running_requests": "exists",
    "baton_node_kv_used_blocks": "exists",
    "baton_node_kv_total_blocks": "positive",
    "baton_node_kv_usage_ratio": "exists",
    "baton_node_state_used_slots": "exists",
    "baton_node_state_total_slots": "positive",
    "baton_node_state_usage_ratio": "exists",
    "baton_node_engine_steps_total": "positive",
    "baton_node_step_duration_seconds_count": "positive",
    "baton_node_step_duration_seconds_sum": "positive",
    "baton_node_step_tokens_count": "positive",
    "baton_node_step_tokens_sum": "positive",
    "baton_node_prompt_tokens_total": "positive",
    "baton_node_decode_tokens_total": "exists",
    "baton_node_spec_drafted_tokens_total": "exists",
    "baton_node_spec_accepted_tokens_total": "exists",
    "baton_node_spec_acceptance_length_tokens": "exists",
    "baton_node_transfers_total": "exists",
    "baton_node_transfer_bytes_total": "exists",
    "baton_node_transfer_seconds_total": "exists",
    "baton_node_transfer_failures_total": "exists",
    "baton_node_lease_expiries_total": "exists",
    "baton_node_completed_leases_total": "exists",
}
PREFILL_METRICS = {**NODE_METRICS, "baton_node_held_leases": "exists",
                   "baton_node_completed_leases_total": "positive"}
DECODE_METRICS = {**NODE_METRICS, "baton_node_transfer_fallbacks_total": "exists",
                  "baton_node_decode_tokens_total": "positive", "baton_node_spec_drafted_tokens_total": "positive",
                  "baton_node_spec_accepted_tokens_total": "positive",
                  "baton_node_spec_acceptance_length_tokens": "positive", "baton_node_transfers_total": "positive",
                  "baton_node_transfer_bytes_total": "positive", "baton_node_transfer_seconds_total": "positive"}


def http_get(url: str) -> tuple[int, str]:
    # Straight to 127.0.0.1: an http_proxy set for other tools must not see these requests.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """sample name -> {sorted labels: value}"""
    status, text = http_get(url)
    assert status == 200, text
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def check(samples: dict[str, dict[tuple, float]], expected: dict[str, str], who: str) -> None:
    missing = sorted(set(expected) - set(samples))
    assert not missing, f"{who}: missing {missing}"
    still = sorted(n for n, how in expected.items() if how == "positive" and not sum(samples[n].values()) > 0)
    assert not still, f"{who}: did not move: {still}"


def test_names_have_the_prefix_and_a_unit_suffix():
    stats = TransferStats()
    node = NodeMetrics("decode", "d0", stats, held_leases=lambda: 0, fallbacks=lambda: 0)
    families = [*RouterMetrics().registry.collect(), *node.registry.collect()]
    exported = {fam.name + "_total" if fam.type == "counter" else fam.name for fam in families}
    # The real-cluster test checks exactly these.
    checked = {n.removesuffix("_count").removesuffix("_sum")
               for n in (*ROUTER_METRICS, *PREFILL_METRICS, *DECODE_METRICS)}
    assert checked == exported
    for fam in families:
        assert fam.name.startswith(("baton_router_", "baton_node_")), fam.name
        # prometheus_client keeps a counter's family name without `_total` and adds it to the samples.
        assert fam.name.rsplit("_", 1)[1] in UNITS, f"{fam.name}: no unit suffix"
        if fam.type == "counter":
            assert {s.name for s in fam.samples} <= {fam.name + "_total", fam.name + "_created"}, fam.name
    # Every documented metric is in README.md's table.
    from pathlib import Path
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for fam in families:
        shown = fam.name + "_total" if fam.type == "counter" else fam.name
        assert f"`{shown}`" in readme, f"{shown} is not documented in README.md"


def test_router_metrics_and_http_endpoints_over_fake_workers():
    async def go():
        started = [await start_fake("prefill", "p0"), await start_fake("prefill", "p1"),
                   await start_fake("decode", "d0")]
        (p0, _, _), (p1, _, _), (d0, _, _) = started
        d0.spec_k = 2
        cfg = RouterConfig(tuple(a for _, _, a in started[:2]), (started[2][2],), local_prefill_threshold=2,
                           load_poll_interval_s=0.1, control_timeout_s=1.0)
        router = await start_router(cfg, 0, http_port=0)
        url = f"http://127.0.0.1:{router.http.port}"
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def generate(ids, **kw):
            req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids), **kw)
            return [m async for m in stub.Generate(req, timeout=10)]

        try:
            await generate([5, 6])                       # local prefill
            await generate([5, 6, 7, 8])                 # disaggregated
            p0.prefill_failures = p1.prefill_failures = 1
            await generate([5, 6, 7, 9])                 # prefill fails, is retried, fails: fallback
            with pytest.raises(grpc.aio.AioRpcError):
                await generate([10**6])                  # invalid
            m = await asyncio.to_thread(scrape, url + "/metrics")
            assert m["baton_router_routing_decisions_total"] == {
                (("decision", "local_prefill"),): 1, (("decision", "disaggregated"),): 1,
                (("decision", "fallback"),): 1}
            assert m["baton_router_retries_total"][(("stage", "prefill"),)] == 1
            assert m["baton_router_requests_total"][(("outcome", "ok"),)] == 3
            assert m["baton_router_requests_total"][(("outcome", "invalid"),)] == 1
            assert m["baton_router_prompt_tokens_total"][()] == 10
            assert m["baton_router_generation_tokens_total"][()] == 3 * 16
            assert m["baton_router_spec_drafted_tokens_total"][()] == 3 * spec_totals(2, 16)[0]
            assert m["baton_router_spec_accepted_tokens_total"][()] == 3 * spec_totals(2, 16)[1]
            assert m["baton_router_time_to_first_token_seconds_count"][()] == 3
            assert m["baton_router_e2e_request_latency_seconds_count"][()] == 3
            assert m["baton_router_inter_token_latency_seconds_count"][()] > 0
            assert m["baton_router_in_flight_requests"][()] == 0
            # The failed prefill workers were taken out of rotation; their next Load poll brings them back.
            await eventually(lambda: router.service.prefill_pool.healthy_count() == 2, what="prefill healthy")
            status, body = await asyncio.to_thread(http_get, url + "/health")
            assert status == 200 and json.loads(body) == {"ok": True, "prefill_workers": 2, "decode_workers": 1}
            status, body = await asyncio.to_thread(http_get, url + "/v1/workers")
            workers = json.loads(body)
            assert status == 200 and sorted((w["role"], w["address"]) for w in workers) == sorted([
                ("prefill", started[0][2]), ("prefill", started[1][2]), ("decode", started[2][2])])
            # The fakes report no HTTP port: no metrics URL.
            assert all(w["healthy"] and w["metrics_url"] is None for w in workers)
            assert (await asyncio.to_thread(http_get, url + "/nope"))[0] == 404
            # Without a healthy decode worker the router cannot serve: 503, as Health says.
            d0.load_fails = True
            await eventually(lambda: not router.service.decode_pool.healthy_count(), what="decode unhealthy")
            status, body = await asyncio.to_thread(http_get, url + "/health")
            assert status == 503 and json.loads(body)["ok"] is False
        finally:
            await channel.close()
            await router.stop(0)
            await asyncio.gather(*(s.stop(0) for _, s, _ in started))
        with pytest.raises(OSError):  # the HTTP server is closed with the router
            await asyncio.to_thread(urllib.request.build_opener(urllib.request.ProxyHandler({})).open,
                                    url + "/health", None, 2)

    run(go())


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    # A vocabulary of 8 makes the random drafter right often enough that drafts get accepted.
    out = tmp_path_factory.mktemp("metrics") / "tiny-mtp"
    return str(make_model(out, preset="tiny", mtp_layers=1, seed=3, overrides={"vocab_size": 8}, progress=False,
                          tokenizer=False))


def test_every_metric_of_a_real_cluster_moves(mtp_model, tmp_path):
    engine_args = ("--block-size", "8", "--max-num-batched-tokens", "32", "--max-num-seqs", "8", "--num-kv-blocks", "128",
                   "--speculative-tokens", "2")
    with Cluster(mtp_model, prefill_workers=1, decode_workers=1, local_prefill_threshold=4,
                 engine_args=engine_args, log_dir=str(tmp_path / "logs")) as cluster:
        assert cluster.http_port == cluster.port + 1
        with Client(cluster.router_addr) as client:
            for n in (3, 4, 20, 40):  # two prefilled on the decode node, two disaggregated
                out = client.generate([(3 * i + n) % 8 for i in range(n)], max_tokens=16, ignore_eos=True)
                assert len(out.token_ids) == 16
        router = scrape(cluster.router_http_url + "/metrics")
        check(router, ROUTER_METRICS, "router")
        decisions = router["baton_router_routing_decisions_total"]
        assert decisions[(("decision", "local_prefill"),)] == 2
        assert decisions[(("decision", "disaggregated"),)] == 2
        assert router["baton_router_requests_total"][(("outcome", "ok"),)] == 4
        assert router["baton_router_generation_tokens_total"][()] == 64
        prefill_url, decode_url = (cluster.node_http_url(a) for a in (*cluster.prefill_addrs, *cluster.decode_addrs))
        check(scrape(prefill_url + "/metrics"), PREFILL_METRICS, "prefill node")
        check(scrape(decode_url + "/metrics"), DECODE_METRICS, "decode node")
        for url in (cluster.router_http_url, prefill_url, decode_url):
            status, body = http_get(url + "/health")
            assert status == 200 and json.loads(body)["ok"] is True, (url, body)
        status, body = http_get(cluster.router_http_url + "/v1/workers")
        assert status == 200
        assert [(w["role"], w["address"], w["metrics_url"], w["healthy"]) for w in json.loads(body)] == [
            ("prefill", cluster.prefill_addrs[0], prefill_url + "/metrics", True),
            ("decode", cluster.decode_addrs[0], decode_url + "/metrics", True)]
    for url in (cluster.router_http_url, prefill_url, decode_url):
        with pytest.raises(OSError):
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url + "/health", timeout=2)
