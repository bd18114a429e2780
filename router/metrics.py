"""The router's Prometheus metrics (names `baton_router_*`), on a registry of its own per router, so that
several routers in one process (tests) never share or collide. README.md "Metrics" lists them."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Outcomes of a Generate call.
OK, ERROR, ABORTED, CANCELLED, INVALID = "ok", "error", "aborted", "cancelled", "invalid"
OUTCOMES = (OK, ERROR, ABORTED, CANCELLED, INVALID)
# How a request's prompt was prefilled.
DISAGGREGATED, LOCAL_PREFILL, FALLBACK = "disaggregated", "local_prefill", "fallback"
PREFILL_OVERFLOW = "prefill_overflow"
DECISIONS = (DISAGGREGATED, LOCAL_PREFILL, PREFILL_OVERFLOW, FALLBACK)
STAGES = ("prefill", "decode")
# Why a Generate call was refused (`router/limits.py`) or cut (its client stopped reading).
GLOBAL_LIMIT, CLIENT_LIMIT, WRITE_TIMEOUT = "max_inflight_requests", "max_inflight_per_client", "stream_write_timeout"
REJECT_REASONS = (GLOBAL_LIMIT, CLIENT_LIMIT, WRITE_TIMEOUT)
# Why a worker was picked while prefix affinity is on (`router/affinity.py`).
BY_AFFINITY, BY_LOAD = "affinity", "load"
PICK_REASONS = (BY_AFFINITY, BY_LOAD)
ROLES = ("prefill", "decode")
# How a decode node got a prompt's caches before its first token: a READ of a prefill node's handle, or its own prefill.
PULLED, LOCAL = "pulled", "local"
FIRST_TOKEN_PREFILL = (PULLED, LOCAL)

# Seconds: from sub-millisecond (small models, ITL) to minutes (long prompts queued behind others).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("baton_router_requests", "Generate calls by outcome: ok (finished), error, "
                                "aborted (Generation.Abort), cancelled (client gone / deadline / shutdown), "
                                "invalid (rejected by validation, or by the OpenAI front before a Generate call)", ["outcome"], registry=r)
        self.in_flight = Gauge("baton_router_in_flight_requests", "Generate calls in flight", registry=r)
        self.ttft = Histogram("baton_router_time_to_first_token_seconds",
                              "From the Generate call to its first token sent", buckets=LATENCY_BUCKETS, registry=r)
        # TTFT's two disaggregated phases, so that a dashboard says which one a slow first token waited on.
        self.prefill_seconds = Histogram("baton_router_prefill_seconds",
                                         "Prefill calls that returned a handle: from the call to the handle (the "
                                         "prefill node's queue, its N-1 tokens, the round trip)",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.decode_first_seconds = Histogram("baton_router_decode_first_token_seconds",
                                              "Decode calls that sent a first token: from the call to it, by how the "
                                              "prompt's caches came (pulled: the READ of a prefill node's handle, "
                                              "then token N; local: the decode node prefilled the prompt)",
                                              ["prefill"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("baton_router_inter_token_latency_seconds",
                             "Time between output tokens (a message of k tokens counts its gap / k, k times)",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("baton_router_e2e_request_latency_seconds",
                             "From the Generate call to its last message, requests that finished (outcome ok)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("baton_router_prompt_tokens", "Prompt tokens of accepted requests",
                                     registry=r)
        self.generation_tokens = Counter("baton_router_generation_tokens", "Output tokens sent to clients",
                                         registry=r)
        self.decisions = Counter("baton_router_routing_decisions", "How prompts were prefilled: disaggregated "
                                 "(prefill node + transfer), local_prefill (short prompt, on the decode node), "
                                 "prefill_overflow (every prefill node's queue past the limit, on the decode node), "
                                 "fallback (prefill or pull failed; the decode node prefilled)", ["decision"],
                                 registry=r)
        self.retries = Counter("baton_router_retries", "Worker calls retried on another worker, by stage",
                               ["stage"], registry=r)
        self.spec_drafted = Counter("baton_router_spec_drafted_tokens",
                                    "MTP draft tokens verified for requests that ended (final Usage)", registry=r)
        self.spec_accepted = Counter("baton_router_spec_accepted_tokens",
                                     "MTP draft tokens accepted for requests that ended (final Usage)", registry=r)
        self.rejected = Counter("baton_router_rejected_requests", "Generate calls refused by a limit with RESOURCE_EXHAUSTED "
                                "(max_inflight_requests, max_inflight_per_client), or cut because their client read "
                                "nothing for --stream-write-timeout-s (stream_write_timeout), by reason", ["reason"],
                                registry=r)
        self.healthy_workers = Gauge("baton_router_healthy_workers", "Workers in rotation, by role", ["role"],
                                     registry=r)
        self.prefix_hit_tokens = Counter("baton_router_prefix_predicted_hit_tokens",
                                         "Prompt tokens the worker a prompt was sent to is predicted to hold in its "
                                         "prefix cache (the router's own index; prefix affinity on), by role",
                                         ["role"], registry=r)
        self.affinity_picks = Counter("baton_router_prefix_affinity_decisions", "Workers picked for a prompt while "
                                      "prefix affinity is on: affinity (for the prefix it holds, where load alone "
                                      "would have picked another or tossed a coin) or load, by role",
                                      ["role", "by"], registry=r)
        self.prefix_index_blocks = Gauge("baton_router_prefix_index_blocks", "Block hashes in the router's per-worker "
                                         "prefix indexes, summed over the workers of a role", ["role"], registry=r)
        # Every label value is exported from the start (at 0), so that rates and dashboards need no traffic.
        for o in OUTCOMES:
            self.requests.labels(outcome=o)
        for how in FIRST_TOKEN_PREFILL:
            self.decode_first_seconds.labels(prefill=how)
        for d in DECISIONS:
            self.decisions.labels(decision=d)
        for s in STAGES:
            self.retries.labels(stage=s)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason=reason)
        for role in ROLES:
            self.prefix_hit_tokens.labels(role=role)
            for by in PICK_REASONS:
                self.affinity_picks.labels(role=role, by=by)

    def watch_workers(self, role: str, healthy_count: Callable[[], int]) -> None:
        """Read `healthy_count()` at every scrape."""
        self.healthy_workers.labels(role=role).set_function(healthy_count)

    def watch_prefix_index(self, role: str, blocks: Callable[[], int]) -> None:
        """Read `blocks()` at every scrape."""
        self.prefix_index_blocks.labels(role=role).set_function(blocks)

    def picked(self, role: str, hit_tokens: int, by_affinity: bool) -> None:
        """A worker of `role` was picked for a prompt with prefix affinity on."""
        self.prefix_hit_tokens.labels(role=role).inc(hit_tokens)
        self.affinity_picks.labels(role=role, by=BY_AFFINITY if by_affinity else BY_LOAD).inc()

    def tokens_sent(self, n: int, gap_s: float | None) -> None:
        """`n` tokens went out in one message, `gap_s` after the previous one (None: the first)."""
        if n and gap_s is not None:
            per_token = gap_s / n
            for _ in range(n):
                self.itl.observe(per_token)
