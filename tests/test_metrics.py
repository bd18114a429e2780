"""Prometheus metrics and the HTTP endpoints (docs/metrics.md "Metrics").

- every metric is named `baton_*` with a unit suffix;
- the router over fake workers: every routing decision, retries of both stages, outcomes, latencies and MTP
  counters move, and /health follows the decode workers' health;
- a real cluster (router + prefill + decode processes, MTP on): after local-prefill and disaggregated
  requests, and provocations for the rest (scrapes while requests queue and run, leases nobody pulls, a
  READ from a killed prefill node, an abort, client cancels, an invalid request, no decode worker left),
  every metric of the router and of both nodes exists on /metrics and moved: the only ones that stay 0
  belong to the other role (a prefill node never decodes nor READs; a decode node holds no leases), and
  the router's retries, which need a second worker per stage, move over the fake workers. /health and
  /v1/workers answer.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.cli.cluster import Cluster
from baton.client import Client
from baton.client.errors import BatonError, InvalidArgumentError
from baton.engine.make_model import make_model
from baton.node.metrics import NodeMetrics
from baton.proto.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from baton.router.config import RouterConfig
from baton.router.metrics import RouterMetrics
from baton.router.server import start_router
from baton.transfer.stats import TransferStats
from tests.node_channel import node_channel
from tests.test_router_fakes import eventually, run, spec_totals, start_fake

UNITS = ("seconds", "bytes", "tokens", "requests", "blocks", "slots", "ratio", "workers", "leases", "steps",
         "transfers", "descriptors", "failures", "expiries", "fallbacks", "retries", "decisions", "evictions", "info")

# Sample name -> how it must have moved in the real cluster after its traffic and provocations:
# "positive" (summed over labels), "zero" (it belongs to the other role: the comments above PREFILL_METRICS
# and DECODE_METRICS say why), or "exists: <where it is checked instead>".
ROUTER_METRICS = {
    "baton_router_requests_total": "positive",  # and every outcome label: see OUTCOMES_PROVOKED
    "baton_router_in_flight_requests": "positive",  # scraped while three streams run
    "baton_router_time_to_first_token_seconds_count": "positive",
    "baton_router_prefill_seconds_count": "positive",
    "baton_router_decode_first_token_seconds_count": "positive",
    "baton_router_inter_token_latency_seconds_count": "positive",
    "baton_router_e2e_request_latency_seconds_count": "positive",
    "baton_router_prompt_tokens_total": "positive",
    "baton_router_generation_tokens_total": "positive",
    "baton_router_routing_decisions_total": "positive",
    # A retry needs a second worker of the failing stage to fail over to: a third node process here. The
    # fake-worker test provokes one per stage (a worker fails, the other takes the request) and checks both.
    "baton_router_retries_total": "exists: moved in test_router_metrics_and_http_endpoints_over_fake_workers",
    "baton_router_rejected_requests_total": "exists: moved in tests/test_router_limits.py",
    "baton_router_spec_drafted_tokens_total": "positive",
    "baton_router_spec_accepted_tokens_total": "positive",
    "baton_router_healthy_workers": "positive",
    # Prefix affinity is off by default (--prefix-affinity-weight 0): these move with it on, through real decode
    # nodes, in tests/test_router_affinity_cluster.py.
    "baton_router_prefix_predicted_hit_tokens_total": "exists: moved in tests/test_router_affinity_cluster.py",
    "baton_router_prefix_affinity_decisions_total": "exists: moved in tests/test_router_affinity_cluster.py",
    "baton_router_prefix_index_blocks": "exists: moved in tests/test_router_affinity_cluster.py",
}
NODE_METRICS = {  # in both nodes
    "baton_node_info": "positive",
    "baton_node_waiting_requests": "positive",  # scraped while more requests than --max-num-seqs are queued
    "baton_node_running_requests": "positive",  # scraped mid-prefill / mid-stream
    "baton_node_kv_used_blocks": "positive",
    "baton_node_kv_total_blocks": "positive",
    "baton_node_kv_usage_ratio": "positive",
    "baton_node_state_used_slots": "positive",
    "baton_node_state_total_slots": "positive",
    "baton_node_state_usage_ratio": "positive",
    "baton_node_engine_steps_total": "positive",
    "baton_node_path_steps_total": "positive",  # eager on the CPU (no graphs there)
    "baton_node_step_duration_seconds_count": "positive",
    "baton_node_step_duration_seconds_sum": "positive",
    "baton_node_step_tokens_count": "positive",
    "baton_node_step_tokens_sum": "positive",
    "baton_node_prompt_tokens_total": "positive",
    # CUDA-event time: 0 on this CPU cluster (test_async_scheduling.py checks it on a GPU).
    "baton_node_step_device_seconds_total": "zero",
    # The prefix cache is on by default: every admitted prompt is looked up. This traffic shares no prefix and
    # evicts nothing: hits, checkpoints and evictions move in a node of their own.
    "baton_node_prefix_queried_tokens_total": "positive",
    "baton_node_prefix_hit_tokens_total": "exists: moved in tests/test_prefix_node_metrics.py",
    "baton_node_prefix_checkpoint_slots": "exists: moved in tests/test_prefix_node_metrics.py",
    "baton_node_prefix_checkpoint_bytes": "exists: moved in tests/test_prefix_node_metrics.py",
    "baton_node_prefix_evictions_total": "exists: moved in tests/test_prefix_node_metrics.py",
}
# The prefill node never decodes (so never verifies MTP drafts) and never READs: the decode side counts the
# READs, the prefill side their leases (completed, expired, held).
PREFILL_METRICS = {**NODE_METRICS,
                   "baton_node_decode_tokens_total": "zero",
                   "baton_node_spec_drafted_tokens_total": "zero",
                   "baton_node_spec_accepted_tokens_total": "zero",
                   "baton_node_spec_acceptance_length_tokens": "zero",
                   "baton_node_transfers_total": "zero",
                   "baton_node_transfer_bytes_total": "zero",
                   "baton_node_transfer_seconds_total": "zero",
                   "baton_node_transfer_descriptors_total": "zero",
                   "baton_node_transfer_skipped_blocks_total": "zero",
                   "baton_node_transfer_failures_total": "zero",
                   "baton_node_completed_leases_total": "positive",  # the router's disaggregated requests
                   "baton_node_lease_expiries_total": "positive",  # a lease nobody pulled
                   "baton_node_held_leases": "positive"}  # scraped while leases are held
# The decode node holds no leases: it READs, and falls back to a local prefill when a READ fails.
DECODE_METRICS = {**NODE_METRICS,
                  "baton_node_decode_tokens_total": "positive",
                  "baton_node_spec_drafted_tokens_total": "positive",
                  "baton_node_spec_accepted_tokens_total": "positive",
                  "baton_node_spec_acceptance_length_tokens": "positive",
                  "baton_node_transfers_total": "positive",
                  "baton_node_transfer_bytes_total": "positive",
                  "baton_node_transfer_seconds_total": "positive",
                  "baton_node_transfer_descriptors_total": "positive",
                  # This traffic sends no prompt twice: tests/test_transfer_skip.py moves it.
                  "baton_node_transfer_skipped_blocks_total": "exists: moved in tests/test_transfer_skip.py",
                  "baton_node_transfer_failures_total": "positive",  # a READ from a killed prefill node
                  "baton_node_transfer_fallbacks_total": "positive",  # ... after which it prefilled locally
                  "baton_node_completed_leases_total": "zero",
                  "baton_node_lease_expiries_total": "zero"}
# Every outcome label of baton_router_requests_total is provoked in the real cluster.
OUTCOMES_PROVOKED = ("ok", "error", "aborted", "cancelled", "invalid")


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
    moved = sorted(n for n, how in expected.items() if how == "zero" and any(samples[n].values()))
    assert not moved, f"{who}: moved, but belong to the other role: {moved}"


class Scraper:
    """Scrapes one /metrics endpoint and keeps, per sample, the highest value any scrape saw: gauges that
    moved during traffic (in flight, running, held leases) count as moved once back at 0."""

    def __init__(self, url: str) -> None:
        self.url = url + "/metrics"
        self.peak: dict[str, dict[tuple, float]] = {}

    def __call__(self) -> dict[str, dict[tuple, float]]:
        now = scrape(self.url)
        for name, values in now.items():
            peak = self.peak.setdefault(name, {})
            for labels, v in values.items():
                peak[labels] = max(v, peak.get(labels, v))
        return now


def wait_for(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition",
             interval: float = 0.02) -> object:
    """Polls `cond` (the `eventually` of tests.test_router_fakes, for blocking code); returns its truthy value."""
    deadline = time.monotonic() + timeout
    while not (out := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)
    return out


def value(samples: dict[str, dict[tuple, float]], name: str, **labels: str) -> float:
    return samples[name][tuple(sorted(labels.items()))]


def test_names_have_the_prefix_and_a_unit_suffix():
    stats = TransferStats()
    node = NodeMetrics("decode", "d0", stats, held_leases=lambda: 0, fallbacks=lambda: 0)
    families = [*RouterMetrics().registry.collect(), *node.registry.collect()]
    exported = {fam.name + "_total" if fam.type == "counter" else fam.name for fam in families}
    # The real-cluster test checks exactly these.
    checked = {n.removesuffix("_count").removesuffix("_sum")
               for n in (*ROUTER_METRICS, *PREFILL_METRICS, *DECODE_METRICS)}
    assert checked == exported
    # Each metric must move ("positive"), stay 0 on the role it does not belong to ("zero"), or say where
    # it is checked instead ("exists: <where>").
    for name, how in (*ROUTER_METRICS.items(), *PREFILL_METRICS.items(), *DECODE_METRICS.items()):
        assert how in ("positive", "zero") or how.startswith("exists: "), (name, how)
    for fam in families:
        assert fam.name.startswith(("baton_router_", "baton_node_")), fam.name
        # prometheus_client keeps a counter's family name without `_total` and adds it to the samples.
        assert fam.name.rsplit("_", 1)[1] in UNITS, f"{fam.name}: no unit suffix"
        if fam.type == "counter":
            assert {s.name for s in fam.samples} <= {fam.name + "_total", fam.name + "_created"}, fam.name
    # Every exported metric is in docs/metrics.md's tables.
    from pathlib import Path
    doc = (Path(__file__).parent.parent / "docs" / "metrics.md").read_text()
    for fam in families:
        shown = fam.name + "_total" if fam.type == "counter" else fam.name
        assert f"`{shown}`" in doc, f"{shown} is not documented in docs/metrics.md"


def test_router_metrics_and_http_endpoints_over_fake_workers():
    async def go():
        started = [await start_fake("prefill", "p0"), await start_fake("prefill", "p1"),
                   await start_fake("decode", "d0"), await start_fake("decode", "d1")]
        (p0, _, _), (p1, _, _), (d0, _, _), (d1, _, _) = started
        d0.spec_k = d1.spec_k = 2
        cfg = RouterConfig(tuple(a for _, _, a in started[:2]), tuple(a for _, _, a in started[2:]),
                           local_prefill_threshold=2,
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
                (("decision", "prefill_overflow"),): 0, (("decision", "fallback"),): 1}
            assert m["baton_router_retries_total"][(("stage", "prefill"),)] == 1
            assert m["baton_router_requests_total"][(("outcome", "ok"),)] == 3
            assert m["baton_router_requests_total"][(("outcome", "invalid"),)] == 1
            assert m["baton_router_prompt_tokens_total"][()] == 10
            assert m["baton_router_generation_tokens_total"][()] == 3 * 16
            assert m["baton_router_spec_drafted_tokens_total"][()] == 3 * spec_totals(2, 16)[0]
            assert m["baton_router_spec_accepted_tokens_total"][()] == 3 * spec_totals(2, 16)[1]
            assert m["baton_router_time_to_first_token_seconds_count"][()] == 3
            # TTFT's phases: the one prefill that returned a handle (the failed ones are not timed), the decode
            # calls by how the caches came (the short prompt and the fallback prefilled on the decode node).
            assert m["baton_router_prefill_seconds_count"][()] == 1
            assert m["baton_router_decode_first_token_seconds_count"] == {(("prefill", "pulled"),): 1,
                                                                           (("prefill", "local"),): 2}
            assert m["baton_router_e2e_request_latency_seconds_count"][()] == 3
            assert m["baton_router_inter_token_latency_seconds_count"][()] > 0
            assert m["baton_router_in_flight_requests"][()] == 0
            # The failed prefill workers were taken out of rotation; their next Load poll brings them back.
            await eventually(lambda: router.service.prefill_pool.healthy_count() == 2, what="prefill healthy")
            status, body = await asyncio.to_thread(http_get, url + "/health")
            assert status == 200 and json.loads(body) == {"ok": True, "prefill_workers": 2, "decode_workers": 2}
            status, body = await asyncio.to_thread(http_get, url + "/v1/workers")
            workers = json.loads(body)
            assert status == 200 and sorted((w["role"], w["address"]) for w in workers) == sorted([
                ("prefill", started[0][2]), ("prefill", started[1][2]), ("decode", started[2][2]),
                ("decode", started[3][2])])
            # The fakes report no HTTP port: no metrics URL.
            assert all(w["healthy"] and w["metrics_url"] is None for w in workers)
            assert (await asyncio.to_thread(http_get, url + "/nope"))[0] == 404
            # Both decode workers fail before any token: retried once on the other one, then an error.
            d0.decode_error = d1.decode_error = grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError):
                await generate([5, 6])
            # The outcome is counted before the status is sent: a scrape once the client has it sees it.
            m = await asyncio.to_thread(scrape, url + "/metrics")
            assert m["baton_router_retries_total"] == {(("stage", "prefill"),): 1, (("stage", "decode"),): 1}
            assert m["baton_router_requests_total"][(("outcome", "error"),)] == 1
            # Without a healthy decode worker the router cannot serve: 503, as Health says.
            d0.load_fails = d1.load_fails = True
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


LEASE_S = 3.0  # the prefill node's leases: long enough for a pull (the decode side keeps a 1 s margin)


def ids(n: int) -> list[int]:
    return [(3 * i + n) % 8 for i in range(n)]


def until(scraper: Scraper, cond: Callable[[dict], bool], what: str, timeout: float = 10.0,
          interval: float = 0.02) -> dict[str, dict[tuple, float]]:
    """Scrapes until `cond(samples)` holds; returns those samples."""
    def poll() -> dict[str, dict[tuple, float]] | None:
        m = scraper()
        return m if cond(m) else None

    return wait_for(poll, timeout, what, interval)


def test_every_metric_of_a_real_cluster_moves(mtp_model, tmp_path):
    """Traffic, then a provocation for every metric that traffic alone leaves still: gauges scraped while
    requests queue and run, leases nobody pulls (held, then expired), a READ from a killed prefill node
    (failure, fallback), and every router outcome (abort, client cancel, invalid, no decode worker left)."""
    # --max-num-seqs 2 (= state slots): a third request waits; leased caches keep their slot. The prefill node's
    # 8-token steps make a long prompt's prefill last long enough for a scrape to see it on a busy box.
    engine_args = ("--block-size", "8", "--max-num-batched-tokens", "32", "--max-num-seqs", "2",
                   "--num-kv-blocks", "256", "--speculative-tokens", "2")
    waiting, running = "baton_node_waiting_requests", "baton_node_running_requests"
    held, in_flight, requests = "baton_node_held_leases", "baton_router_in_flight_requests", "baton_router_requests_total"
    with Cluster(mtp_model, prefill_workers=1, decode_workers=1, local_prefill_threshold=4,
                 engine_args=engine_args, prefill_args=("--lease-seconds", str(LEASE_S), "--max-num-batched-tokens", "8"),
                 log_dir=str(tmp_path / "logs")) as cluster:
        assert cluster.http_port == cluster.port + 1
        prefill_url, decode_url = (cluster.node_http_url(a) for a in (*cluster.prefill_addrs, *cluster.decode_addrs))
        router_m, prefill_m, decode_m = Scraper(cluster.router_http_url), Scraper(prefill_url), Scraper(decode_url)
        with Client(cluster.router_addr) as client:
            for n in (3, 4, 20, 40):  # two prefilled on the decode node, two disaggregated
                out = client.generate(ids(n), max_tokens=16, ignore_eos=True)
                assert len(out.token_ids) == 16
        router = router_m()
        decisions = router["baton_router_routing_decisions_total"]
        assert decisions[(("decision", "local_prefill"),)] == 2
        assert decisions[(("decision", "disaggregated"),)] == 2
        assert value(router, requests, outcome="ok") == 4
        assert value(router, "baton_router_generation_tokens_total") == 64
        # The READs' notifications reach the prefill node's lease table at its next engine loop iteration.
        until(prefill_m, lambda m: value(m, "baton_node_completed_leases_total") == 2, "two completed leases")
        for url in (cluster.router_http_url, prefill_url, decode_url):
            status, body = http_get(url + "/health")
            assert status == 200 and json.loads(body)["ok"] is True, (url, body)
        status, body = http_get(cluster.router_http_url + "/v1/workers")
        assert status == 200
        assert [(w["role"], w["address"], w["metrics_url"], w["healthy"]) for w in json.loads(body)] == [
            ("prefill", cluster.prefill_addrs[0], prefill_url + "/metrics", True),
            ("decode", cluster.decode_addrs[0], decode_url + "/metrics", True)]

        with node_channel(cluster.prefill_addrs[0]) as pch, \
                node_channel(cluster.decode_addrs[0]) as dch:
            prefill, decode = worker_pb2_grpc.WorkerStub(pch), worker_pb2_grpc.WorkerStub(dch)
            # 1. Prefill node: two prefills nobody pulls hold their caches under leases, both state slots ...
            for i in range(2):
                prefill.Prefill(worker_pb2.PrefillRequest(request_id=f"held-{i}", prompt_token_ids=ids(20)),
                                timeout=10)
            m = until(prefill_m, lambda m: value(m, held) == 2 and value(m, "baton_node_state_used_slots") == 2,
                      "two held leases")
            assert value(m, "baton_node_state_usage_ratio") == 1.0
            assert value(m, "baton_node_kv_used_blocks") > 0 and value(m, "baton_node_kv_usage_ratio") > 0
            # ... so that a third prefill waits for a slot, for as long as they are held.
            queued = prefill.Prefill.future(worker_pb2.PrefillRequest(request_id="queued", prompt_token_ids=ids(1000)),
                                            timeout=30)
            until(prefill_m, lambda m: value(m, waiting) == 1 and value(m, running) == 0, "a queued prefill")
            # Releasing one lease admits it: its 125 chunks run while we scrape as fast as we can.
            assert prefill.Abort(worker_pb2.WorkerAbortRequest(request_id="held-0"), timeout=5).found
            until(prefill_m, lambda m: value(m, running) == 1 or queued.done(), "a running prefill", interval=0)
            assert value(prefill_m.peak, running) == 1, "the prefill ran between two scrapes"
            assert queued.result().handle.num_tokens == 999
            assert value(prefill_m(), held) >= 1  # queued's lease (and held-1's, unless it already expired)

            # 2. Decode node and router during traffic: three streams, two running, one queued behind them.
            with Client(cluster.router_addr, retries=0) as client:
                streams = [client.stream([1, 2, 3], max_tokens=1500, ignore_eos=True, request_id=f"long-{i}")
                           for i in range(3)]
                m = until(decode_m, lambda m: value(m, running) == 2 and value(m, waiting) == 1,
                          "two streams running, one queued")
                assert value(m, "baton_node_kv_used_blocks") > 0 and value(m, "baton_node_kv_usage_ratio") > 0
                assert value(m, "baton_node_state_used_slots") > 0 and value(m, "baton_node_state_usage_ratio") > 0
                assert value(router_m(), in_flight) == 3
                # One aborted by id (its stream ends with an abort message), two cancelled by the client.
                assert client.abort("long-0")
                assert [c.finish_reason for c in streams[0]][-1] == "abort"
                for s in streams[1:]:
                    s.cancel()
                m = until(router_m, lambda m: value(m, in_flight) == 0 and value(m, requests, outcome="cancelled") == 2,
                          "the cancelled streams to end")
                assert value(m, requests, outcome="aborted") == 1
                with pytest.raises(InvalidArgumentError):
                    client.generate([1000], max_tokens=4)

            # 3. The lease nobody pulled expires.
            until(prefill_m, lambda m: value(m, "baton_node_lease_expiries_total") >= 1, "a lease expiry",
                  timeout=LEASE_S + 5)
            check(prefill_m.peak, PREFILL_METRICS, "prefill node")

            # 4. A failed READ: the decode node (handshaken with the prefill node by the traffic above) pulls
            # a handle whose prefill node was killed since; it prefills locally instead.
            handle = prefill.Prefill(worker_pb2.PrefillRequest(request_id="doomed", prompt_token_ids=ids(20)),
                                     timeout=10).handle
            cluster.kill("prefill-0")
            t0 = time.monotonic()
            out = list(decode.Decode(worker_pb2.DecodeRequest(
                request_id="doomed", prompt_token_ids=ids(20),
                sampling=generation_pb2.SamplingParams(max_tokens=4, ignore_eos=True), handle=handle), timeout=30))
            print(f"failed pull + local prefill: {time.monotonic() - t0:.2f} s")
            assert out[0].prefilled_locally and sum(len(o.token_ids) for o in out) == 4
            m = decode_m()
            assert value(m, "baton_node_transfer_failures_total") == 1
            assert value(m, "baton_node_transfer_fallbacks_total") == 1
            check(decode_m.peak, DECODE_METRICS, "decode node")

        # 5. No decode worker left: the request fails (outcome error).
        cluster.kill("decode-0")
        with Client(cluster.router_addr, retries=0) as client, pytest.raises(BatonError):
            client.generate([1, 2, 3], max_tokens=4)
        # (The router counts a failed request before it sends the status; polled like the counts above.)
        expected = {"ok": 4, "error": 1, "aborted": 1, "cancelled": 2, "invalid": 1}
        until(router_m, lambda m: {o: value(m, requests, outcome=o) for o in OUTCOMES_PROVOKED} == expected,
              "every outcome counted")
        check(router_m.peak, ROUTER_METRICS, "router")
    for url in (cluster.router_http_url, prefill_url, decode_url):
        with pytest.raises(OSError):
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url + "/health", timeout=2)
