"""Prometheus metrics of a prefill or decode node (names `baton_node_*`) and its HTTP endpoints.

Engine state is read on the engine thread only: `on_step` is a step hook (it runs after every engine loop
iteration) that copies a few ints into gauges and turns the engine's cumulative counters into counter
increments and per-step histogram observations. Transfer counters (`baton.transfer` stats, the lease
table) are read when scraped: they are plain ints. README.md "Metrics" lists every metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from baton.engine.engine_thread import EngineThread
from baton.engine.llm_engine import EngineStats, LLMEngine
from baton.serving.ops_http import HttpServer, health_route, metrics_route
from baton.transfer.stats import TransferStats

STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_TOKENS_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384


class _TransferCollector(Collector):
    """`baton.transfer` counters, read at scrape time."""

    def __init__(self, stats: TransferStats, fallbacks: Callable[[], int] | None) -> None:
        self.stats = stats
        self.fallbacks = fallbacks

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        yield CounterMetricFamily("baton_node_transfers", "NIXL READs completed (decode side)", value=s.transfers)
        yield CounterMetricFamily("baton_node_transfer_bytes", "Bytes moved by completed READs (decode side)",
                                  value=s.bytes)
        yield CounterMetricFamily("baton_node_transfer_seconds", "Wall time of completed READs (decode side)",
                                  value=s.seconds)
        yield CounterMetricFamily("baton_node_transfer_descriptors",
                                  "Descriptors (runs of consecutive blocks, per pool) the READs issued (decode side): "
                                  "one per pool (3 for a hybrid model) when its blocks are consecutive on both "
                                  "sides; more when they are scattered, which costs bandwidth", value=s.descriptors)
        yield CounterMetricFamily("baton_node_transfer_skipped_blocks",
                                  "KV blocks READs left out because this node's prefix cache held them for the "
                                  "prompt already (decode side)", value=s.skipped_blocks)
        yield CounterMetricFamily("baton_node_transfer_failures",
                                  "READs that ended in an error or a timeout (decode side)", value=s.failures)
        yield CounterMetricFamily("baton_node_lease_expiries",
                                  "Leases that expired before the READ completed (prefill side)",
                                  value=s.lease_expiries)
        yield CounterMetricFamily("baton_node_completed_leases",
                                  "Leases freed by the decode side's notification (prefill side)",
                                  value=s.leases_completed)
        if self.fallbacks is not None:
            yield CounterMetricFamily("baton_node_transfer_fallbacks",
                                      "Pulls that failed, so that the node prefilled locally (decode side)",
                                      value=self.fallbacks())


class _ObserverErrorsCollector(Collector):
    """The engine thread's count of step hooks and output callbacks that raised, read at scrape time."""

    def __init__(self, thread: EngineThread) -> None:
        self.thread = thread

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("baton_node_observer_errors",
                                  "Step hooks (metrics, lease bookkeeping) and output callbacks that raised on the "
                                  "engine thread; each is logged and the engine goes on",
                                  value=self.thread.observer_errors)


class NodeMetrics:
    def __init__(self, role: str, engine_id: str, transfer: TransferStats | None = None, *,
                 held_leases: Callable[[], int] | None = None, fallbacks: Callable[[], int] | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        """`transfer`: the node's TransferAgent stats; `held_leases` (prefill) and `fallbacks` (decode) are
        read at scrape time."""
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # True once the gRPC server is listening, false again once it drains; /health also needs a live engine
        # thread.
        self.ready = False
        Gauge("baton_node_info", "Always 1; labels name the node", ["role", "engine_id"],
              registry=r).labels(role=role, engine_id=engine_id).set(1)
        self.waiting = Gauge("baton_node_waiting_requests", "Requests waiting for admission (queue depth)",
                             registry=r)
        self.running = Gauge("baton_node_running_requests", "Requests admitted and running", registry=r)
        self.kv_used = Gauge("baton_node_kv_used_blocks", "KV blocks in use (held leases included)", registry=r)
        self.kv_total = Gauge("baton_node_kv_total_blocks", "KV blocks in the pool", registry=r)
        self.kv_ratio = Gauge("baton_node_kv_usage_ratio", "KV blocks in use / in the pool", registry=r)
        self.slots_used = Gauge("baton_node_state_used_slots", "Mamba state slots in use", registry=r)
        self.slots_total = Gauge("baton_node_state_total_slots", "Mamba state slots in the pool", registry=r)
        self.slots_ratio = Gauge("baton_node_state_usage_ratio", "State slots in use / in the pool", registry=r)
        self.steps = Counter("baton_node_engine_steps", "Engine steps that ran a batch", registry=r)
        self.step_paths = Counter("baton_node_path_steps", "Engine steps by how they ran: decode_graph (a CUDA graph "
                                  "of decode / verify rows), mixed_graph (decode rows + one prompt chunk, "
                                  "--mixed-graph-tokens) or eager (host-bound on a GPU)", ["path"], registry=r)
        for path in ("decode_graph", "mixed_graph", "eager"):
            self.step_paths.labels(path=path)
        self.step_seconds = Histogram("baton_node_step_duration_seconds", "Wall time of one engine step",
                                      buckets=STEP_SECONDS_BUCKETS, registry=r)
        self.device_seconds = Counter("baton_node_step_device_seconds", "GPU time of engine steps: CUDA events from "
                                      "each step's first queued work to its last (0 on CPU). Its rate is how busy "
                                      "the GPU was; beside the rate of step_duration_seconds_sum (how busy the engine "
                                      "loop was) it shows whether the GPU or the host sets the pace", registry=r)
        self.step_tokens = Histogram("baton_node_step_tokens", "Tokens computed in one engine step",
                                     buckets=STEP_TOKENS_BUCKETS, registry=r)
        self.prompt_tokens = Counter("baton_node_prompt_tokens", "Prefill tokens computed (recomputes included)",
                                     registry=r)
        self.decode_tokens = Counter("baton_node_decode_tokens",
                                     "Tokens fed by decode rows (the last token + MTP drafts to verify)", registry=r)
        self.spec_drafted = Counter("baton_node_spec_drafted_tokens", "MTP draft tokens verified", registry=r)
        self.spec_accepted = Counter("baton_node_spec_accepted_tokens", "MTP draft tokens accepted", registry=r)
        self.acceptance = Gauge("baton_node_spec_acceptance_length_tokens",
                                "Mean tokens emitted per verify row since start (accepted drafts + 1); "
                                "0 without speculative decoding", registry=r)
        # Prefix cache (engine `prefix_cache.py`): hit rate = rate(hit) / rate(queried); all stay 0 with it off.
        self.prefix_queried = Counter("baton_node_prefix_queried_tokens", "Prompt tokens of admitted requests looked "
                                      "up in the prefix cache", registry=r)
        self.prefix_hits = Counter("baton_node_prefix_hit_tokens", "Of those, tokens served from the prefix cache "
                                   "(not prefilled again)", registry=r)
        self.prefix_checkpoints = Gauge("baton_node_prefix_checkpoint_slots", "Checkpoint slots holding a recurrent "
                                        "state of the prefix cache", registry=r)
        self.prefix_checkpoint_bytes = Gauge("baton_node_prefix_checkpoint_bytes", "Memory those checkpoints hold",
                                             registry=r)
        self.prefix_evictions = Counter("baton_node_prefix_evictions", "Cached KV blocks and state checkpoints "
                                        "evicted (least recently used first) to make room", ["kind"], registry=r)
        for kind in ("block", "checkpoint"):
            self.prefix_evictions.labels(kind=kind)
        if transfer is not None:
            r.register(_TransferCollector(transfer, fallbacks))
        if held_leases is not None:
            Gauge("baton_node_held_leases", "Finished prefills whose caches are leased, waiting for their READ "
                  "(prefill side)", registry=r).set_function(held_leases)
        # steps, step_seconds, prompt, decode, drafted, accepted, decode-graph steps, mixed-graph steps, GPU seconds
        self._seen = (0, 0.0, 0, 0, 0, 0, 0, 0, 0.0)
        # prefix: queried, hit tokens, block evictions, checkpoint evictions
        self._prefix_seen = (0, 0, 0, 0)

    def on_step(self, engine: LLMEngine) -> None:
        """Step hook (engine thread). Cheap: a few ints into gauges; observations only after a real step."""
        s = engine.scheduler
        self.waiting.set(len(s.waiting))
        self.running.set(len(s.running))
        kv_total, kv_used = s.cache.blocks.capacity, s.cache.blocks.capacity - s.cache.blocks.num_free
        self.kv_total.set(kv_total)
        self.kv_used.set(kv_used)
        self.kv_ratio.set(kv_used / kv_total if kv_total else 0.0)
        slots_total, slots_used = s.cache.slots.capacity, s.cache.slots.capacity - s.cache.slots.num_free
        self.slots_total.set(slots_total)
        self.slots_used.set(slots_used)
        self.slots_ratio.set(slots_used / slots_total if slots_total else 0.0)
        st = engine.stats
        self._on_prefix(st)
        now = (st.steps, st.step_seconds, st.prompt_tokens, st.decode_tokens, st.spec_drafted, st.spec_accepted,
               st.graph_steps, st.mixed_graph_steps, st.device_seconds)
        if now[0] == self._seen[0] and now[-1] == self._seen[-1]:
            return
        steps, seconds, prompt, decode, drafted, accepted, graphed, mixed_graphed, device_s = (
            a - b for a, b in zip(now, self._seen, strict=True))
        self._seen = now
        self.steps.inc(steps)
        self.device_seconds.inc(device_s)
        self.step_paths.labels(path="decode_graph").inc(graphed)
        self.step_paths.labels(path="mixed_graph").inc(mixed_graphed)
        self.step_paths.labels(path="eager").inc(steps - graphed - mixed_graphed)
        # The hook runs after every step, so `steps` is 1 (more only if the hook was added late).
        for _ in range(steps):
            self.step_seconds.observe(seconds / steps)
            self.step_tokens.observe((prompt + decode) / steps)
        self.prompt_tokens.inc(prompt)
        self.decode_tokens.inc(decode)
        self.spec_drafted.inc(drafted)
        self.spec_accepted.inc(accepted)
        self.acceptance.set(st.mean_acceptance_length)

    def _on_prefix(self, st: EngineStats) -> None:
        self.prefix_checkpoints.set(st.prefix_checkpoints)
        self.prefix_checkpoint_bytes.set(st.prefix_checkpoint_bytes)
        now = (st.prefix_queried_tokens, st.prefix_hit_tokens, st.prefix_block_evictions,
               st.prefix_checkpoint_evictions)
        if now == self._prefix_seen:
            return
        queried, hits, blocks, checkpoints = (a - b for a, b in zip(now, self._prefix_seen, strict=True))
        self._prefix_seen = now
        self.prefix_queried.inc(queried)
        self.prefix_hits.inc(hits)
        self.prefix_evictions.labels(kind="block").inc(blocks)
        self.prefix_evictions.labels(kind="checkpoint").inc(checkpoints)


def start_node_http(metrics: NodeMetrics, thread: EngineThread, host: str, port: int) -> HttpServer:
    """/metrics, /health (readiness: 200 once serving, until the drain begins, while the engine thread is alive;
    else 503) and /live (liveness: 200 while the engine thread is alive, draining included)."""
    metrics.registry.register(_ObserverErrorsCollector(thread))
    routes = {"/metrics": metrics_route(metrics.registry),
              "/health": health_route(lambda: metrics.ready and thread.alive()),
              "/live": health_route(thread.alive)}
    return HttpServer(routes, host, port, name="baton-node-http")
