"""Serving benchmark (issue #7 item 4e): disaggregated 1P1D against 2 aggregated replicas on 2 GPUs, under
open-loop Poisson load.

Configurations (each a real local cluster: router + node processes, `baton.cli.cluster.Cluster`):
- **disagg** (1P1D): router + 1 prefill node (GPU 0) + 1 decode node (GPU 1). Every prompt longer than
  `--disagg-local-prefill-threshold` (default 0: all) is prefilled on the prefill node, its KV + state pulled
  over NIXL by the decode node; with `--disagg-prefill-queue-limit-tokens Q`, prompts arriving while the prefill
  node has more than Q tokens queued are prefilled on the decode node instead (the router's `prefill_overflow`).
- **agg** (2 aggregated replicas): router + 2 decode nodes (GPU 0, GPU 1), no prefill node, local prefill
  threshold = 2**31 - 1: every prompt is prefilled on the decode node that serves it (mixed batches).
GPU pinning (`Cluster.node_gpus`): each node process gets `CUDA_VISIBLE_DEVICES` rotated so that its own GPU
comes first (it runs on `cuda`, i.e. its GPU) while the other GPUs stay visible for CUDA IPC (NIXL's cuda_ipc
transport).

Load: for each offered rate λ (requests/s), arrivals are a Poisson process (exponential gaps, seeded per
rate) over `--duration-s`; each request's prompt length and output length are uniform integers in
[`--prompt-min`, `--prompt-max`] and [`--output-min`, `--output-max`]; prompt tokens are uniform random ids
in [3, vocab_size) (0..2 are pad/bos/eos); `ignore_eos`, greedy. The same schedule is replayed on both
configurations. Requests are sent at their arrival times whatever the completions (open loop), through the
asyncio SDK (`baton.client.AsyncClient`, streaming). Per request: TTFT = first token received − scheduled
arrival; ITL = gaps between streamed messages (a message of k tokens counts gap/k, k times, as the router's
metric); TPOT = (E2E − TTFT) / (output tokens − 1), the request's mean ITL.

SLO (goodput): a request is good when it completed, TTFT ≤ `--slo-ttft-s` (default 2 s) and TPOT ≤
`--slo-tpot-ms` (default 50 ms; `--smoke`: 5 s and 500 ms). Per rate point: throughput = completed requests / window and goodput = good
requests / window, window = start of the arrival window → max(its end, the last completion) (so goodput ≤
throughput). Requests unfinished
`--drain-s` after the last arrival are cancelled and count as failed (not good). Summary: the highest goodput
of each configuration over the sweep and their ratio disagg / agg (issue #7's goal: ≥ 2×).

Warm-up (not measured): `--warmup-requests` sent at once, then `--warmup-s` of open-loop load at the sweep's first
rate (default 10 s on GPU), so that Triton compiles for the chunk shapes of staggered arrivals happen before the
first measured rate rather than inside it.

Rates: `--rates 1,2,4` (requests/s), or `auto` (default on GPU): after the warm-up, a burst of
`--calibration-requests` concurrent requests on the first configuration run (agg) measures its closed-loop
capacity C (requests/s); the sweep is `--rate-fractions` × C, reused for the second configuration.

Model: `--model-preset 1b-hybrid` (default on GPU): the `8b-like` preset scaled down to 0.92B parameters
(27 layers `M-M-M*-M-M-M-M*-M-M-M*-M-M-`, hidden 2048, 64 Mamba heads × 64, d_state 128, 8 groups, 16 query /
4 KV heads × 128, MLP 8192, vocab 32768, max 16384 positions, bf16, random weights); `8b-like` (Nemotron-H-8B's
shape at 16384 positions; give it a larger pool, e.g. `--cache-memory-mb 32768`); `tiny` for `--smoke`.
Written with `make_model` (no tokenizer: prompts are token ids; weights drawn on the GPU in GPU runs) into
`--model-dir` (default TMP/baton-serving-PRESET), and reused when that directory already holds the same config.

Engine (every node, `--engine-args`), GPU default: bf16 on `cuda`, 64 running requests, 2048-token step
budget (long prompts are prefilled in 2048-token chunks, mixed with decode rows on aggregated nodes), 8 GiB
of KV + state pool, max length 16384. `--prefill-engine-args` adds flags for the disagg prefill node only (e.g.
a larger step budget: its steps carry no decode rows whose latency a long step would hurt).

Per rate point each node's engine work is also recorded (`nodes`, from its /metrics before and after the point):
how busy its engine loop was and how busy its GPU was (CUDA-event time of its steps), its mean step time, prompt and
decode tokens/s — where a node is host-bound; and,
from its gauges sampled every 0.5 s while the point runs, its mean queue (waiting requests), the peak share of its
state slots in use and its peak of held leases (finished prefills waiting for their READ) — why a node idles;
and the router's routing decisions over the point (`routing`: disaggregated, prefill_overflow, ...).

Output: `OUT/serving_<config>.json` per configuration (written after every rate point), `OUT/serving_summary.json`,
markdown tables last on stdout; node and router logs under `--log-dir` (default TMP/baton-serving-logs).
`python benchmarks/plot_results.py OUT` draws the PNGs. To split the configurations over two runs: `--configs agg`,
then `--configs disagg --rates <agg's rates>` (or `--rates-from serving_agg.json`) into the same OUT, or
`--summarize` over a directory holding both files.

  python benchmarks/serving_bench.py --out /tmp/serving                # 2 GPUs, ~7-8 min
  python benchmarks/serving_bench.py --smoke --out /tmp/serving-smoke  # CPU, tiny model, ~35 s
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from baton.cli.cluster import Cluster
from baton.client import AsyncClient

AGG_LOCAL_PREFILL_THRESHOLD = 2**31 - 1
# The summary's SLO sweep: max goodput of each configuration at these TPOT bounds (ms), from the same runs; the
# bounds are dense at the tight end, where the 1P1D / aggregated ratio moves most (RESULTS.md, the serving history).
SLO_SWEEP_TPOT_MS = (6.0, 7.0, 7.5, 8.0, 9.0, 10.0, 12.0, 15.0, 20.0, 30.0, 50.0)
# Token ids 0..2 are pad / bos / eos in every preset; prompts draw from [FIRST_ID, vocab_size).
FIRST_ID = 3
CONFIG_NAMES = ("agg", "disagg")
SUMMARY_FILE = "serving_summary.json"

# name -> (make_model preset, overrides)
MODEL_PRESETS: dict[str, tuple[str, dict[str, object]]] = {
    "tiny": ("tiny", {}),
    "1b-hybrid": ("8b-like", {
        "vocab_size": 32768, "hidden_size": 2048, "hybrid_override_pattern": "M-M-M*-M-M-M-M*-M-M-M*-M-M-",
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 8192,
        "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "chunk_size": 128,
        "max_position_embeddings": 16384,
    }),
    # Nemotron-H-8B's shape (8.1B parameters), at 16384 positions. Needs a larger pool than the default
    # engine args give: its fp32 SSM state is 96 MiB per request (e.g. --cache-memory-mb 32768).
    "8b-like": ("8b-like", {"max_position_embeddings": 16384}),
}

# Flag defaults: GPU run, and --smoke (CPU, tiny model, a few seconds per configuration).
DEFAULTS: dict[str, dict[str, object]] = {
    "gpu": {
        "model_preset": "1b-hybrid", "prompt_min": 2048, "prompt_max": 8192, "output_min": 64, "output_max": 256,
        "duration_s": 20.0, "drain_s": 15.0, "rates": "auto", "rate_fractions": "0.25,0.5,0.75,1.0,1.25",
        "warmup_requests": 24, "warmup_s": 10.0, "calibration_requests": 32, "gpus": 2, "slo_ttft_s": 2.0,
        "slo_tpot_ms": 50.0,
        "engine_args": "--device cuda --dtype bfloat16 --max-num-seqs 64 --max-num-batched-tokens 2048 "
                       "--cache-memory-mb 8192 --max-model-len 16384",
    },
    "smoke": {
        "model_preset": "tiny", "prompt_min": 16, "prompt_max": 64, "output_min": 4, "output_max": 12,
        "duration_s": 4.0, "drain_s": 20.0, "rates": "2,4", "rate_fractions": "0.5,1.0",
        "warmup_requests": 2, "warmup_s": 0.0, "calibration_requests": 4, "gpus": 0, "slo_ttft_s": 5.0,
        "slo_tpot_ms": 500.0,
        "engine_args": "--block-size 8 --max-num-seqs 8 --max-num-batched-tokens 64 --num-kv-blocks 256",
    },
}


# ---- configuration ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoadSpec:
    """What one rate point sends: Poisson arrivals over `duration_s`, uniform prompt and output lengths."""

    prompt_min: int
    prompt_max: int
    output_min: int
    output_max: int
    duration_s: float
    seed: int

    def __post_init__(self) -> None:
        for name in ("prompt_min", "output_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 2:
                raise ValueError(f"{name}: expected an integer >= 2, got {v!r}")
        if self.prompt_max < self.prompt_min:
            raise ValueError(f"prompt_max: expected >= prompt_min ({self.prompt_min}), got {self.prompt_max}")
        if self.output_max < self.output_min:
            raise ValueError(f"output_max: expected >= output_min ({self.output_min}), got {self.output_max}")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"duration_s: expected a finite number > 0, got {self.duration_s!r}")


@dataclass(frozen=True)
class Slo:
    """A request is good when it completed within both bounds."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"slo {name}: expected a finite number > 0, got {v!r}")


@dataclass(frozen=True)
class ClusterSpec:
    """One configuration under test."""

    name: str
    prefill_workers: int
    decode_workers: int
    local_prefill_threshold: int
    description: str
    # Router --prefill-queue-limit-tokens (0: off).
    prefill_queue_limit_tokens: int = 0


@dataclass(frozen=True)
class BenchConfig:
    out: Path
    model_dir: Path
    model_preset: str
    load: LoadSpec
    slo: Slo
    # Explicit rates (requests/s), or () for calibration: rate_fractions × measured capacity.
    rates: tuple[float, ...]
    rate_fractions: tuple[float, ...]
    drain_s: float
    warmup_requests: int
    # Then this many seconds of open-loop load at the sweep's first rate, not measured: the burst alone leaves
    # Triton kernels to compile for chunk shapes that only staggered arrivals produce, during the first rate.
    warmup_s: float
    calibration_requests: int
    gpus: int
    engine_args: tuple[str, ...]
    # disagg: engine flags of the prefill node only, after engine_args (a later flag wins), e.g. a larger step
    # budget: a prefill node has no decode rows whose latency a long step would hurt.
    prefill_engine_args: tuple[str, ...]
    decode_engine_args: tuple[str, ...]
    configs: tuple[str, ...]
    disagg_local_prefill_threshold: int
    progress: bool
    log_dir: Path | None
    # Run nothing; summarize the JSON files already in `out`.
    summarize: bool = False
    # TPOT bounds (ms) at which the summary also scores both configurations' max goodput (same TTFT bound).
    slo_sweep_tpot_ms: tuple[float, ...] = SLO_SWEEP_TPOT_MS
    # Nodes move caches through CUDA IPC mappings (`--cuda-ipc` on every node) instead of NIXL's UCX copy.
    cuda_ipc: bool = False
    # disagg: the router's --prefill-queue-limit-tokens (0: off): past it, prompts are prefilled on the decode node.
    disagg_prefill_queue_limit_tokens: int = 0

    def __post_init__(self) -> None:
        if self.model_preset not in MODEL_PRESETS:
            raise ValueError(f"model_preset: expected one of {', '.join(MODEL_PRESETS)}, got {self.model_preset!r}")
        if any(not (math.isfinite(r) and r > 0) for r in (*self.rates, *self.rate_fractions)):
            raise ValueError(f"rates / rate_fractions: expected finite numbers > 0, got {self.rates} / "
                             f"{self.rate_fractions}")
        if not self.rates and not self.rate_fractions:
            raise ValueError("rates: expected explicit rates or rate fractions for calibration, got neither")
        if self.drain_s <= 0:
            raise ValueError(f"drain_s: expected > 0, got {self.drain_s}")
        if not (math.isfinite(self.warmup_s) and self.warmup_s >= 0):
            raise ValueError(f"warmup_s: expected a finite number >= 0, got {self.warmup_s}")
        if self.warmup_requests < 0 or self.calibration_requests < 1:
            raise ValueError(f"warmup_requests / calibration_requests: expected >= 0 / >= 1, got "
                             f"{self.warmup_requests} / {self.calibration_requests}")
        if self.disagg_prefill_queue_limit_tokens < 0:
            raise ValueError(f"disagg_prefill_queue_limit_tokens: expected >= 0 (0 = off), got "
                             f"{self.disagg_prefill_queue_limit_tokens}")
        if self.gpus < 0:
            raise ValueError(f"gpus: expected >= 0 (0 = leave CUDA_VISIBLE_DEVICES alone), got {self.gpus}")
        if any(not (math.isfinite(t) and t > 0) for t in self.slo_sweep_tpot_ms):
            raise ValueError(f"slo_sweep_tpot_ms: expected finite numbers > 0, got {self.slo_sweep_tpot_ms}")
        bad = [c for c in self.configs if c not in CONFIG_NAMES]
        if bad or not self.configs or len(set(self.configs)) != len(self.configs):
            raise ValueError(f"configs: expected distinct names out of {', '.join(CONFIG_NAMES)}, "
                             f"got {','.join(self.configs)}")


def cluster_specs(disagg_threshold: int, disagg_queue_limit: int = 0) -> dict[str, ClusterSpec]:
    return {
        "agg": ClusterSpec("agg", prefill_workers=0, decode_workers=2,
                           local_prefill_threshold=AGG_LOCAL_PREFILL_THRESHOLD,
                           description="2 aggregated replicas: router + 2 decode nodes (GPU 0, GPU 1), "
                                       "every prompt prefilled locally"),
        "disagg": ClusterSpec("disagg", prefill_workers=1, decode_workers=1,
                              local_prefill_threshold=disagg_threshold,
                              description="1P1D: router + prefill node (GPU 0) + decode node (GPU 1), "
                                          "KV + state over NIXL" + (f"; prompts on the decode node while the "
                                          f"prefill queue is past {disagg_queue_limit} tokens"
                                          if disagg_queue_limit else ""),
                              prefill_queue_limit_tokens=disagg_queue_limit),
    }


# ---- load ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestSpec:
    index: int
    # Seconds after the start of the rate point.
    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process of `rate` per second (exponential gaps)."""
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate: expected a finite number > 0, got {rate!r}")
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def make_requests(load: LoadSpec, rate: float, vocab_size: int, salt: int = 0) -> list[RequestSpec]:
    """The schedule of one rate point: deterministic in (load.seed, rate, salt), so that every configuration
    is sent the same requests at the same times."""
    if vocab_size <= FIRST_ID:
        raise ValueError(f"vocab_size: expected > {FIRST_ID}, got {vocab_size}")
    rng = random.Random(f"{load.seed}:{rate!r}:{salt}")
    arrivals = poisson_arrivals(rate, load.duration_s, rng)
    return [RequestSpec(i, t, tuple(rng.randrange(FIRST_ID, vocab_size)
                                    for _ in range(rng.randint(load.prompt_min, load.prompt_max))),
                        rng.randint(load.output_min, load.output_max))
            for i, t in enumerate(arrivals)]


def burst(load: LoadSpec, n: int, vocab_size: int, salt: int) -> list[RequestSpec]:
    """`n` requests all arriving at 0 (warm-up, calibration), lengths from the same distribution."""
    rng = random.Random(f"{load.seed}:burst:{salt}")
    return [RequestSpec(i, 0.0, tuple(rng.randrange(FIRST_ID, vocab_size)
                                      for _ in range(rng.randint(load.prompt_min, load.prompt_max))),
                        rng.randint(load.output_min, load.output_max)) for i in range(n)]


# ---- measuring -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestResult:
    index: int
    arrival_s: float
    prompt_tokens: int
    # Seconds after the start of the rate point; None when the request did not complete.
    finished_s: float | None
    ttft_s: float | None
    # Gaps between output tokens (a message of k tokens: gap / k, k times).
    itls_s: tuple[float, ...]
    output_tokens: int
    error: str | None

    @property
    def completed(self) -> bool:
        return self.error is None and self.finished_s is not None

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (E2E − TTFT) / (n − 1); 0 for a single token."""
        if not self.completed or self.ttft_s is None:
            return None
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def meets(self, slo: Slo) -> bool:
        return self.completed and meets(self.ttft_s, self.tpot_s, slo)


async def run_one(client: AsyncClient, req: RequestSpec, t0: float) -> RequestResult:
    """Waits for the request's arrival time, streams it, and times every message against the arrival."""
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
    ttft: float | None = None
    itls: list[float] = []
    n = 0
    last: float | None = None
    try:
        async with client.stream(list(req.prompt), max_tokens=req.max_tokens, ignore_eos=True) as s:
            async for chunk in s:
                now = time.perf_counter() - t0
                k = len(chunk.token_ids)
                if k:
                    if ttft is None:
                        ttft = now - req.arrival_s
                    elif last is not None:
                        itls.extend([(now - last) / k] * k)
                    last = now
                    n += k
        return RequestResult(req.index, req.arrival_s, len(req.prompt), time.perf_counter() - t0, ttft,
                             tuple(itls), n, None if n == req.max_tokens else f"got {n} of {req.max_tokens} tokens")
    except asyncio.CancelledError:
        return RequestResult(req.index, req.arrival_s, len(req.prompt), None, ttft, tuple(itls), n, "cancelled")
    except Exception as e:  # noqa: BLE001 (a failed request is a result, not the end of the benchmark)
        return RequestResult(req.index, req.arrival_s, len(req.prompt), None, ttft, tuple(itls), n,
                             f"{type(e).__name__}: {e}")


async def run_schedule(addr: str, reqs: Sequence[RequestSpec], drain_s: float,
                       channels: int = 4) -> list[RequestResult]:
    """Open loop: every request starts at its arrival time whatever the others do; requests still running
    `drain_s` after the last arrival are cancelled (results with error 'cancelled')."""
    clients = [AsyncClient(addr, timeout=None, retries=0) for _ in range(channels)]
    try:
        t0 = time.perf_counter() + 0.05
        tasks = [asyncio.create_task(run_one(clients[r.index % channels], r, t0)) for r in reqs]
        last_arrival = max((r.arrival_s for r in reqs), default=0.0)
        deadline = t0 + last_arrival + drain_s
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
            for t in pending:
                t.cancel()
        return [await t for t in tasks]
    finally:
        for c in clients:
            await c.close()


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    mean: float


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) of ascending values; q in [0, 100]."""
    if not sorted_values:
        raise ValueError("percentile: expected at least one value, got none")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: expected q in [0, 100], got {q}")
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> Percentiles | None:
    if not values:
        return None
    v = sorted(values)
    return Percentiles(percentile(v, 50), percentile(v, 90), percentile(v, 99), sum(v) / len(v))


@dataclass(frozen=True)
class NodeLoad:
    """One node's engine work over a rate point (its /metrics scraped before and after the point's requests): how
    busy its engine loop was, and with what. A loop busy ~100 % of the window with a step time far above the GPU's
    is host-bound."""
    steps: int
    busy: float           # seconds inside engine steps / the point's window
    step_ms: float        # mean wall time of one engine step (0 without steps)
    prompt_tok_s: float   # prefill tokens computed / window
    decode_tok_s: float   # decode tokens fed / window
    # The READs it completed over the point (decode side; 0 in files written before these fields existed):
    transfers: int = 0
    transfer_gbps: float = 0.0             # their bytes / their summed wall time: one READ's mean bandwidth
    descriptors_per_transfer: float = 0.0  # 3 (a hybrid model) when every pool's blocks were consecutive
    # Steps that ran eagerly, neither a decode nor a mixed CUDA graph (host-bound on a GPU; all of them on a CPU).
    eager_steps: int = 0
    # From its gauges sampled while the point ran (`GaugeSampler`; 0 without samples): the mean of its waiting
    # requests, the peak share of its state slots in use, the peak of its held leases (a prefill node's finished
    # prompts whose caches wait for the decode node's READ: at the state pool's size it admits no more prompts).
    mean_waiting: float = 0.0
    peak_state_slots: float = 0.0
    peak_held_leases: int = 0
    gauge_samples: int = 0
    # GPU time of its steps / window (CUDA events, `baton_node_step_device_seconds`; 0 on CPU and in older files):
    # well below 100 % while the engine loop is busy, the GPU waits on the host between or inside steps.
    gpu_busy: float = 0.0


@dataclass(frozen=True)
class RatePoint:
    config: str
    offered_rps: float
    requests: int
    completed: int
    failed: int
    # Start of the arrival window -> max(its end, the last completion) (seconds).
    window_s: float
    throughput_rps: float
    goodput_rps: float
    slo_attainment: float
    output_tok_s: float
    ttft_s: Percentiles | None
    itl_s: Percentiles | None
    tpot_s: Percentiles | None
    e2e_s: Percentiles | None
    errors: tuple[str, ...]
    # Per request, (TTFT s, TPOT s), None where it did not complete: goodput at another SLO, from the same run.
    per_request: tuple[tuple[float | None, float | None], ...] = ()
    # Node name -> its engine work over this point (empty in files written before this field existed).
    nodes: Mapping[str, NodeLoad] = field(default_factory=dict)
    # The router's routing decisions over this point (`baton_router_routing_decisions_total` deltas), by decision.
    routing: Mapping[str, float] = field(default_factory=dict)


def meets(ttft_s: float | None, tpot_s: float | None, slo: Slo) -> bool:
    return ttft_s is not None and tpot_s is not None and ttft_s <= slo.ttft_s and tpot_s <= slo.tpot_s


def with_slo(p: RatePoint, slo: Slo) -> RatePoint:
    """The point's goodput and SLO attainment under another SLO, from its per-request records."""
    if len(p.per_request) != p.requests:
        raise ValueError(f"rate point {p.config} @ {p.offered_rps:g} req/s: expected per-request records for "
                         f"{p.requests} requests (written since this field exists), got {len(p.per_request)}")
    good = sum(meets(t, o, slo) for t, o in p.per_request)
    return replace(p, goodput_rps=good / p.window_s, slo_attainment=good / p.requests if p.requests else 0.0)


def rate_point(config: str, rate: float, duration_s: float, results: Sequence[RequestResult],
               slo: Slo) -> RatePoint:
    """Aggregates one rate point. Throughput and goodput share one window, from the start of the arrival
    window to its end or the last completion, whichever is later; so goodput <= throughput."""
    done = [r for r in results if r.completed]
    window = max([duration_s, *(r.finished_s for r in done)])
    good = sum(r.meets(slo) for r in results)
    return RatePoint(
        config=config, offered_rps=rate, requests=len(results), completed=len(done),
        failed=len(results) - len(done), window_s=window, throughput_rps=len(done) / window,
        goodput_rps=good / window, slo_attainment=good / len(results) if results else 0.0,
        output_tok_s=sum(r.output_tokens for r in done) / window,
        ttft_s=summarize([r.ttft_s for r in done if r.ttft_s is not None]),
        itl_s=summarize([x for r in done for x in r.itls_s]),
        tpot_s=summarize([r.tpot_s for r in done if r.tpot_s is not None]),
        e2e_s=summarize([r.e2e_s for r in done if r.e2e_s is not None]),
        errors=tuple(sorted({r.error for r in results if r.error is not None}))[:5],
        per_request=tuple((r.ttft_s, r.tpot_s) if r.completed else (None, None) for r in results))


# ---- clusters ---------------------------------------------------------------------------------------------

def _scrape(metrics_url: str) -> str:
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        return resp.read().decode()


def routing_decisions(metrics_url: str) -> dict[str, float]:
    """`baton_router_routing_decisions_total` by decision, scraped from the router's /metrics."""
    text = _scrape(metrics_url)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("baton_router_routing_decisions_total{"):
            labels, _, value = line.rpartition(" ")
            decision = labels.split('decision="', 1)[1].split('"', 1)[0]
            out[decision] = float(value)
    return out


# The node counters a rate point's NodeLoad is computed from (`node/metrics.py`); the transfer ones only where the
# node has a transfer agent (0 otherwise).
NODE_COUNTERS = {"steps": "baton_node_engine_steps_total", "step_s": "baton_node_step_duration_seconds_sum",
                 "prompt": "baton_node_prompt_tokens_total", "decode": "baton_node_decode_tokens_total"}
TRANSFER_COUNTERS = {"reads": "baton_node_transfers_total", "read_bytes": "baton_node_transfer_bytes_total",
                     "read_s": "baton_node_transfer_seconds_total", "descs": "baton_node_transfer_descriptors_total",
                     "eager": 'baton_node_path_steps_total{path="eager"}',
                     "gpu_s": "baton_node_step_device_seconds_total"}


def node_counters(metrics_url: str) -> dict[str, float]:
    """NODE_COUNTERS' and TRANSFER_COUNTERS' values scraped from a node's /metrics (0 for those it lacks)."""
    values = {}
    for line in _scrape(metrics_url).splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    missing = [m for m in NODE_COUNTERS.values() if m not in values]
    if missing:
        raise ValueError(f"{metrics_url}: expected the node counters {missing}, got none")
    return {**{k: float(values[m]) for k, m in NODE_COUNTERS.items()},
            **{k: float(values.get(m, 0.0)) for k, m in TRANSFER_COUNTERS.items()}}


# The node gauges sampled while a rate point runs (`node/metrics.py`; held leases only on a prefill node, 0 elsewhere).
NODE_GAUGES = {"waiting": "baton_node_waiting_requests", "slots_used": "baton_node_state_used_slots",
               "slots_total": "baton_node_state_total_slots", "held": "baton_node_held_leases"}
GAUGE_INTERVAL_S = 0.5


def node_gauges(text: str) -> dict[str, float]:
    """NODE_GAUGES' values in a node's /metrics text (0 for those it lacks)."""
    values = dict(line.partition(" ")[::2] for line in text.splitlines() if line and not line.startswith("#"))
    return {k: float(values.get(m, 0.0)) for k, m in NODE_GAUGES.items()}


class GaugeSampler:
    """Scrapes each node's gauges every `interval_s` on a thread while a rate point runs (`with` block); a scrape
    that fails is skipped (a node busy past the 10 s timeout leaves a gap, not an error)."""

    def __init__(self, urls: Mapping[str, str], interval_s: float = GAUGE_INTERVAL_S) -> None:
        self.urls = dict(urls)
        self.interval_s = interval_s
        self.samples: dict[str, list[dict[str, float]]] = {n: [] for n in self.urls}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gauge-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for name, url in self.urls.items():
                with contextlib.suppress(OSError, ValueError):
                    self.samples[name].append(node_gauges(_scrape(url)))

    def __enter__(self) -> GaugeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def node_load(before: Mapping[str, float], after: Mapping[str, float], window_s: float,
              samples: Sequence[Mapping[str, float]] = ()) -> NodeLoad:
    steps = int(after["steps"] - before["steps"])
    step_s = after["step_s"] - before["step_s"]
    reads = int(after.get("reads", 0.0) - before.get("reads", 0.0))
    read_s = after.get("read_s", 0.0) - before.get("read_s", 0.0)
    read_bytes = after.get("read_bytes", 0.0) - before.get("read_bytes", 0.0)
    descs = after.get("descs", 0.0) - before.get("descs", 0.0)
    return NodeLoad(steps=steps, busy=step_s / window_s, step_ms=1e3 * step_s / steps if steps else 0.0,
                    prompt_tok_s=(after["prompt"] - before["prompt"]) / window_s,
                    decode_tok_s=(after["decode"] - before["decode"]) / window_s, transfers=reads,
                    transfer_gbps=read_bytes / read_s / 1e9 if read_s > 0 else 0.0,
                    descriptors_per_transfer=descs / reads if reads else 0.0,
                    eager_steps=int(after.get("eager", 0.0) - before.get("eager", 0.0)),
                    mean_waiting=sum(g["waiting"] for g in samples) / len(samples) if samples else 0.0,
                    peak_state_slots=max((g["slots_used"] / g["slots_total"] for g in samples if g["slots_total"]),
                                         default=0.0),
                    peak_held_leases=int(max((g["held"] for g in samples), default=0.0)), gauge_samples=len(samples),
                    gpu_busy=(after.get("gpu_s", 0.0) - before.get("gpu_s", 0.0)) / window_s)


# ---- model -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSummary:
    preset: str
    base_preset: str
    directory: str
    parameters: int
    pattern: str
    hidden_size: int
    vocab_size: int
    dtype: str


def weights_device(cfg: BenchConfig) -> str:
    """Where make_model draws the weights: on the GPU in GPU runs (seconds for 8b-like, minutes on the CPU)."""
    import torch

    return "cuda" if cfg.gpus > 0 and torch.cuda.is_available() else "cpu"


def ensure_model(cfg: BenchConfig) -> ModelSummary:
    """Writes the checkpoint unless `model_dir` already holds this preset's (a marker file records it)."""
    from baton.engine.config import ModelConfig
    from baton.engine.loader import read_hf_config
    from baton.engine.make_model import build_config, make_model
    from baton.engine.weights import expected_weight_shapes, num_parameters

    base, overrides = MODEL_PRESETS[cfg.model_preset]
    want = json.loads(json.dumps(build_config(base, 0, overrides), sort_keys=True))
    marker = cfg.model_dir / "serving_bench_model.json"
    if not (marker.exists() and json.loads(marker.read_text()) == want):
        t = time.perf_counter()
        make_model(cfg.model_dir, preset=base, seed=0, overrides=overrides, progress=cfg.progress, tokenizer=False,
                   device=weights_device(cfg))
        marker.write_text(json.dumps(want, sort_keys=True))
        print(f"model {cfg.model_preset} written to {cfg.model_dir} in {time.perf_counter() - t:.1f} s", flush=True)
    m = ModelConfig.from_hf_dict(read_hf_config(cfg.model_dir))
    return ModelSummary(cfg.model_preset, base, str(cfg.model_dir), num_parameters(expected_weight_shapes(m)),
                        m.pattern, m.hidden_size, m.vocab_size, m.torch_dtype)


def card_names() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        return [x.strip() for x in out.splitlines() if x.strip()]
    return []


# ---- one configuration ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConfigResult:
    spec: ClusterSpec
    start_s: float
    warmup_s: float
    # Closed-loop burst throughput (requests/s), when this configuration calibrated the rates.
    calibrated_capacity_rps: float | None
    points: tuple[RatePoint, ...]
    routing: dict[str, float]
    node_gpus: dict[str, int]


def make_cluster(cfg: BenchConfig, spec: ClusterSpec) -> Cluster:
    """The (not yet started) cluster of one configuration; its nodes spread over GPUs 0..gpus-1 (prefill nodes
    first: disagg = prefill on GPU 0, decode on GPU 1; agg = decode nodes on GPU 0 and GPU 1)."""
    return Cluster(str(cfg.model_dir), prefill_workers=spec.prefill_workers, decode_workers=spec.decode_workers,
                   local_prefill_threshold=spec.local_prefill_threshold, engine_args=cfg.engine_args,
                   node_args=("--cuda-ipc",) if cfg.cuda_ipc else (),
                   prefill_args=cfg.prefill_engine_args,
                   decode_args=cfg.decode_engine_args if spec.prefill_workers else (), node_gpus=tuple(range(cfg.gpus)),
                   log_dir=str(cfg.log_dir / spec.name) if cfg.log_dir else None,
                   router_args=("--prefill-queue-limit-tokens", str(spec.prefill_queue_limit_tokens))
                   if spec.prefill_queue_limit_tokens else ())


def run_config(cfg: BenchConfig, spec: ClusterSpec, vocab_size: int, rates: tuple[float, ...], bar: tqdm,
               save: Callable[[ConfigResult], None]) -> ConfigResult:
    """Starts the cluster, warms it up, calibrates the rates if none are given, then sweeps them; `save` gets
    the result so far after every rate point (a run cut short still leaves its points on disk)."""
    t = time.perf_counter()
    cluster = make_cluster(cfg, spec)
    node_gpus = {n: cluster.node_gpu(n) for n in cluster.node_names} if cluster.node_gpus else {}
    with cluster:
        start_s = time.perf_counter() - t
        bar.write(f"[{spec.name}] cluster up in {start_s:.1f} s: {spec.description}")
        t = time.perf_counter()
        if cfg.warmup_requests:
            warm = asyncio.run(run_schedule(cluster.router_addr, burst(cfg.load, cfg.warmup_requests, vocab_size, 1),
                                            drain_s=600.0))
            failed = [r.error for r in warm if not r.completed]
            if failed:
                raise RuntimeError(f"[{spec.name}] warm-up: {len(failed)} of {len(warm)} requests failed: "
                                   f"{sorted(set(failed))[:3]}")
        warmup_s = time.perf_counter() - t
        bar.write(f"[{spec.name}] warm-up ({cfg.warmup_requests} requests at once) {warmup_s:.1f} s")
        capacity = None
        if not rates:
            capacity = calibrate(cluster.router_addr, cfg, vocab_size)
            rates = tuple(round(f * capacity, 3) for f in cfg.rate_fractions)
            bar.write(f"[{spec.name}] closed-loop capacity {capacity:.3f} req/s -> rates {rates}")
        if cfg.warmup_s > 0:
            t = time.perf_counter()
            warm = make_requests(replace(cfg.load, duration_s=cfg.warmup_s), rates[0], vocab_size, salt=-1)
            asyncio.run(run_schedule(cluster.router_addr, warm, cfg.drain_s))
            warmup_s += time.perf_counter() - t
            bar.write(f"[{spec.name}] open-loop warm-up: {len(warm)} requests over {cfg.warmup_s:.0f} s at "
                      f"{rates[0]:.3f} req/s")
        addrs = cluster.prefill_addrs + cluster.decode_addrs  # in node_names' order
        node_urls = {n: cluster.node_http_url(a) + "/metrics" for n, a in zip(cluster.node_names, addrs, strict=True)}
        router_url = cluster.router_http_url + "/metrics"
        points: list[RatePoint] = []
        for i, rate in enumerate(rates):
            reqs = make_requests(cfg.load, rate, vocab_size, salt=i)
            before = {n: node_counters(u) for n, u in node_urls.items()}
            routed = routing_decisions(router_url)
            with GaugeSampler(node_urls) as gauges:
                results = asyncio.run(run_schedule(cluster.router_addr, reqs, cfg.drain_s))
            p = rate_point(spec.name, rate, cfg.load.duration_s, results, cfg.slo)
            p = replace(p, nodes={n: node_load(before[n], node_counters(u), p.window_s, gauges.samples[n])
                                  for n, u in node_urls.items()},
                        routing={k: v - routed.get(k, 0.0) for k, v in routing_decisions(router_url).items()})
            points.append(p)
            save(ConfigResult(spec, start_s, warmup_s, capacity, tuple(points), {}, node_gpus))
            bar.write(f"[{spec.name}] {rate:.3f} req/s offered: {p.completed}/{p.requests} done, "
                      f"{p.throughput_rps:.3f} req/s, goodput {p.goodput_rps:.3f} req/s, TTFT p50 "
                      f"{_ms(p.ttft_s, 'p50')} ms, ITL p50 {_ms(p.itl_s, 'p50')} ms; routed "
                      + ", ".join(f"{k} {v:.0f}" for k, v in sorted(p.routing.items()) if v))
            bar.update(1)
        result = ConfigResult(spec, start_s, warmup_s, capacity, tuple(points),
                              routing_decisions(router_url), node_gpus)
    save(result)
    return result


def calibrate(addr: str, cfg: BenchConfig, vocab_size: int) -> float:
    """Closed-loop capacity: `calibration_requests` sent at once, completed requests / makespan."""
    reqs = burst(cfg.load, cfg.calibration_requests, vocab_size, 2)
    results = asyncio.run(run_schedule(addr, reqs, drain_s=600.0))
    done = [r for r in results if r.completed]
    if not done:
        raise RuntimeError(f"calibration: no request completed: {sorted({r.error for r in results})[:3]}")
    return len(done) / max(r.finished_s for r in done)


def _ms(p: Percentiles | None, which: str) -> str:
    return "-" if p is None else f"{1e3 * getattr(p, which):.1f}"


# ---- summary and output ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Summary:
    max_goodput_rps: dict[str, float]
    at_rate_rps: dict[str, float]
    # disagg / agg, when both ran and agg's max goodput is > 0.
    goodput_ratio: float | None
    goal_ratio: float = 2.0


def summary_of(points: Mapping[str, Sequence[RatePoint]]) -> Summary:
    best = {name: max(ps, key=lambda p: p.goodput_rps) for name, ps in points.items() if ps}
    g = {k: p.goodput_rps for k, p in best.items()}
    ratio = g["disagg"] / g["agg"] if "disagg" in g and g.get("agg", 0.0) > 0 else None
    return Summary(g, {k: p.offered_rps for k, p in best.items()}, ratio)


@dataclass(frozen=True)
class SloSweepRow:
    """Each configuration's max goodput (over its rate points) under one TPOT bound, and their ratio."""
    tpot_ms: float
    max_goodput_rps: dict[str, float]
    at_rate_rps: dict[str, float]
    goodput_ratio: float | None


def slo_sweep(points: Mapping[str, Sequence[RatePoint]], ttft_s: float,
              tpot_ms: Sequence[float]) -> tuple[SloSweepRow, ...]:
    """The summary re-scored at each TPOT bound from the per-request records (none where a point lacks them):
    where the goodput ratio depends on the SLO, the whole curve is the result, not one chosen bound."""
    if not points or any(len(p.per_request) != p.requests for ps in points.values() for p in ps):
        return ()
    rows = []
    for t in tpot_ms:
        slo = Slo(ttft_s, t / 1e3)
        s = summary_of({name: [with_slo(p, slo) for p in ps] for name, ps in points.items()})
        rows.append(SloSweepRow(t, s.max_goodput_rps, s.at_rate_rps, s.goodput_ratio))
    return tuple(rows)


def markdown_slo_sweep(rows: Sequence[SloSweepRow], ttft_s: float) -> str:
    if not rows:
        return ""
    names = list(rows[0].max_goodput_rps)
    lines = [f"Max goodput against the TPOT bound (TTFT <= {ttft_s:g} s), from the same requests:", "",
             "| TPOT SLO ms | " + " | ".join(f"{n} max goodput req/s (at offered)" for n in names)
             + " | disagg / agg |", "| ---: |" + " ---: |" * (len(names) + 1)]
    for r in rows:
        cells = [f"{r.max_goodput_rps[n]:.3f} ({r.at_rate_rps[n]:g})" for n in names]
        ratio = "-" if r.goodput_ratio is None else f"{r.goodput_ratio:.2f}x"
        lines.append(f"| {r.tpot_ms:g} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def markdown_table(points: Mapping[str, Sequence[RatePoint]], slo: Slo) -> str:
    head = ("| config | offered req/s | done | req/s | goodput req/s | SLO met | TTFT p50 / p90 / p99 ms "
            "| ITL p50 / p90 / p99 ms | TPOT p50 ms | E2E p50 s |")
    lines = [f"SLO: TTFT <= {slo.ttft_s:g} s and TPOT (mean ITL) <= {1e3 * slo.tpot_s:g} ms", "", head,
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for ps in points.values():
        for p in ps:
            trio = [" / ".join(_ms(x, q) for q in ("p50", "p90", "p99")) for x in (p.ttft_s, p.itl_s)]
            e2e = "-" if p.e2e_s is None else f"{p.e2e_s.p50:.2f}"
            lines.append(f"| {p.config} | {p.offered_rps:.3f} | {p.completed}/{p.requests} | {p.throughput_rps:.3f} "
                         f"| {p.goodput_rps:.3f} | {100 * p.slo_attainment:.0f} % | {trio[0]} | {trio[1]} "
                         f"| {_ms(p.tpot_s, 'p50')} | {e2e} |")
    loads = [(p, n, ld) for ps in points.values() for p in ps for n, ld in p.nodes.items()]
    if loads:
        lines += ["", "| config | offered req/s | node | engine busy | GPU busy | steps | eager steps | step ms "
                      "| prompt tok/s "
                      "| decode tok/s | READs | READ GB/s | descriptors / READ | waiting (mean) | state slots (peak) "
                      "| held leases (peak) |",
                  "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
                  "| ---: | ---: |"]
        lines += [f"| {p.config} | {p.offered_rps:.3f} | {n} | {100 * ld.busy:.0f} % "
                  f"| {f'{100 * ld.gpu_busy:.0f} %' if ld.gpu_busy else '–'} | {ld.steps} "
                  f"| {100 * ld.eager_steps / ld.steps if ld.steps else 0:.0f} % | {ld.step_ms:.2f} "
                  f"| {ld.prompt_tok_s:,.0f} | {ld.decode_tok_s:,.0f} | {ld.transfers} "
                  + (f"| {ld.transfer_gbps:.1f} | {ld.descriptors_per_transfer:.1f} " if ld.transfers else "| – | – ")
                  + f"| {ld.mean_waiting:.1f} | {100 * ld.peak_state_slots:.0f} % | {ld.peak_held_leases} |"
                  for p, n, ld in loads]
    s = summary_of(points)
    lines.append("")
    for k, v in s.max_goodput_rps.items():
        lines.append(f"- max goodput {k}: {v:.3f} req/s (at {s.at_rate_rps[k]:.3f} req/s offered)")
    if s.goodput_ratio is not None:
        verdict = "met" if s.goodput_ratio >= s.goal_ratio else "not met"
        lines.append(f"- disagg / agg max goodput: {s.goodput_ratio:.2f}x (goal >= {s.goal_ratio:g}x: {verdict})")
    return "\n".join(lines)


def config_file(out: Path, name: str) -> Path:
    return out / f"serving_{name}.json"


def write_config(cfg: BenchConfig, meta: Mapping[str, object], r: ConfigResult) -> None:
    cfg.out.mkdir(parents=True, exist_ok=True)
    doc = {**meta, "config": asdict(r.spec), "start_s": r.start_s, "warmup_s": r.warmup_s,
           "calibrated_capacity_rps": r.calibrated_capacity_rps, "routing_including_warmup": r.routing,
           "node_gpus": r.node_gpus, "points": [asdict(p) for p in r.points]}
    config_file(cfg.out, r.spec.name).write_text(json.dumps(doc, indent=1))


def point_from_json(d: Mapping[str, object]) -> RatePoint:
    stats = {k: None if d[k] is None else Percentiles(**d[k]) for k in ("ttft_s", "itl_s", "tpot_s", "e2e_s")}
    per_request = tuple(tuple(r) for r in d.get("per_request", ()))
    nodes = {n: NodeLoad(**v) for n, v in d.get("nodes", {}).items()}
    return RatePoint(**{**d, **stats, "errors": tuple(d["errors"]), "per_request": per_request, "nodes": nodes})


def load_points(out: Path) -> dict[str, tuple[RatePoint, ...]]:
    """Every configuration's points found in `out` (also those of an earlier invocation, e.g. one device call
    per configuration with --rates-from)."""
    found = {}
    for name in CONFIG_NAMES:
        f = config_file(out, name)
        if f.exists():
            found[name] = tuple(point_from_json(p) for p in json.loads(f.read_text())["points"])
    return found


def write_summary(cfg: BenchConfig, meta: Mapping[str, object],
                  points: Mapping[str, Sequence[RatePoint]] | None = None) -> tuple[dict[str, tuple[RatePoint, ...]],
                                                                             tuple[SloSweepRow, ...]]:
    """serving_summary.json (the summary at meta's SLO, and the SLO sweep) of `points` (default: what `out`
    holds)."""
    points = dict(load_points(cfg.out) if points is None else points)
    sweep = slo_sweep(points, cfg.slo.ttft_s, cfg.slo_sweep_tpot_ms)
    doc = {**meta, **asdict(summary_of(points)), "slo_sweep": [asdict(r) for r in sweep]}
    (cfg.out / SUMMARY_FILE).write_text(json.dumps(doc, indent=1))
    return points, sweep


def rates_from(path: Path) -> tuple[float, ...]:
    """The offered rates of an earlier run's `serving_<config>.json`."""
    rates = tuple(float(p["offered_rps"]) for p in json.loads(Path(path).read_text())["points"])
    if not rates:
        raise ValueError(f"--rates-from: expected rate points in {path}, got none")
    return rates


# ---- command line ----------------------------------------------------------------------------------------

def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def parse_args(argv: Sequence[str] | None = None) -> BenchConfig:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny model, tiny lengths, 2 rates, a few seconds")
    ap.add_argument("--out", type=Path, required=True, help="results directory (JSON)")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="checkpoint directory, reused when it holds this preset (default TMP/baton-serving-PRESET)")
    ap.add_argument("--model-preset", choices=tuple(MODEL_PRESETS), default=None)
    for name, kind, what in (("prompt-min", int, "shortest prompt (tokens)"), ("prompt-max", int, "longest prompt"),
                             ("output-min", int, "fewest output tokens"), ("output-max", int, "most output tokens"),
                             ("duration-s", float, "arrival window per rate (s)"),
                             ("drain-s", float, "after the last arrival, cancel what still runs after this (s)"),
                             ("warmup-requests", int, "requests sent at once before measuring"),
                             ("warmup-s", float, "then open-loop load at the first rate for this long, unmeasured"),
                             ("calibration-requests", int, "burst size measuring capacity for --rates auto"),
                             ("gpus", int, "GPUs to spread nodes over (0 = do not pin)"),
                             ("slo-ttft-s", float, "SLO: time to first token (s)"),
                             ("slo-tpot-ms", float, "SLO: mean inter-token latency per request (ms)")):
        key = name.replace("-", "_")
        ap.add_argument("--" + name, type=kind, default=None,
                        help=f"{what} (default {DEFAULTS['gpu'][key]}; --smoke {DEFAULTS['smoke'][key]})")
    ap.add_argument("--rates", default=None, help="'auto' or comma-separated requests/s (default auto; --smoke 2,4)")
    ap.add_argument("--rates-from", type=Path, default=None,
                    help="take the offered rates of an earlier serving_<config>.json (overrides --rates)")
    ap.add_argument("--rate-fractions", default=None, help="with --rates auto: fractions of measured capacity")
    ap.add_argument("--engine-args", default=None,
                    help=f"engine flags of every node, one string (default '{DEFAULTS['gpu']['engine_args']}'; "
                         f"--smoke '{DEFAULTS['smoke']['engine_args']}')")
    ap.add_argument("--prefill-engine-args", default="",
                    help="disagg: engine flags of the prefill node only, after --engine-args (a later flag wins), "
                         "e.g. '--max-num-batched-tokens 8192' (default: none)")
    ap.add_argument("--disagg-decode-engine-args", default="",
                    help="disagg: engine flags of the decode node only, after --engine-args (a later flag wins), "
                         "e.g. '--max-num-batched-tokens 512' to bound the steps that carry prompts it prefills "
                         "itself (--disagg-prefill-queue-limit-tokens, --disagg-local-prefill-threshold); the "
                         "aggregated nodes keep --engine-args (default: none)")
    ap.add_argument("--configs", default="agg,disagg", help="which configurations, in run order")
    ap.add_argument("--disagg-local-prefill-threshold", type=int, default=0,
                    help="disagg: prompts of at most this many tokens are prefilled on the decode node")
    ap.add_argument("--disagg-prefill-queue-limit-tokens", type=int, default=0,
                    help="disagg: the router's --prefill-queue-limit-tokens (past it, prompts are prefilled on the "
                         "decode node; default 0: off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="node and router logs, DIR/<config>/<process>.log (default TMP/baton-serving-logs)")
    ap.add_argument("--summarize", action="store_true",
                    help="run nothing: table and serving_summary.json from the serving_<config>.json in OUT")
    ap.add_argument("--slo-sweep-tpot-ms", default=",".join(f"{t:g}" for t in SLO_SWEEP_TPOT_MS),
                    help="TPOT bounds (ms) at which the summary also scores max goodput, comma-separated "
                         "(default %(default)s)")
    ap.add_argument("--cuda-ipc", action="store_true",
                    help="every node gets --cuda-ipc: caches move through CUDA IPC mappings instead of NIXL's UCX copy")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    d = DEFAULTS["smoke" if a.smoke else "gpu"]

    def pick(name: str) -> object:
        v = getattr(a, name)
        return d[name] if v is None else v

    rates_text = str(pick("rates")).strip()
    rates = () if rates_text == "auto" else _floats(rates_text, "--rates")
    if a.rates_from is not None:
        rates = rates_from(a.rates_from)
    tmp = Path(tempfile.gettempdir())
    preset = str(pick("model_preset"))
    return BenchConfig(
        out=a.out, model_dir=a.model_dir or tmp / f"baton-serving-{preset}", model_preset=preset,
        load=LoadSpec(int(pick("prompt_min")), int(pick("prompt_max")), int(pick("output_min")),
                      int(pick("output_max")), float(pick("duration_s")), a.seed),
        slo=Slo(float(pick("slo_ttft_s")), float(pick("slo_tpot_ms")) / 1e3),
        rates=rates, rate_fractions=_floats(str(pick("rate_fractions")), "--rate-fractions"),
        drain_s=float(pick("drain_s")), warmup_requests=int(pick("warmup_requests")), warmup_s=float(pick("warmup_s")),
        calibration_requests=int(pick("calibration_requests")), gpus=int(pick("gpus")),
        engine_args=tuple(str(pick("engine_args")).split()),
        prefill_engine_args=tuple(a.prefill_engine_args.split()),
        decode_engine_args=tuple(a.disagg_decode_engine_args.split()),
        configs=tuple(c.strip() for c in a.configs.split(",") if c.strip()),
        disagg_local_prefill_threshold=a.disagg_local_prefill_threshold, progress=not a.no_progress,
        log_dir=a.log_dir or tmp / "baton-serving-logs", summarize=a.summarize,
        slo_sweep_tpot_ms=_floats(a.slo_sweep_tpot_ms, "--slo-sweep-tpot-ms"), cuda_ipc=a.cuda_ipc,
        disagg_prefill_queue_limit_tokens=a.disagg_prefill_queue_limit_tokens)


def check_engine_args(engine_args: Sequence[str]) -> None:
    """Refuses engine flags the nodes would refuse, before any process starts (ValueError)."""
    from baton.node.engine_args import engine_config_from_args, parse_engine_flags

    engine_config_from_args(parse_engine_flags(engine_args, "--engine-args"))


def check_model_len(cfg: BenchConfig, model: ModelSummary) -> None:
    """Longest prompt + output must fit the model (and --max-model-len, when given)."""
    from baton.engine.loader import read_hf_config

    limit = int(read_hf_config(cfg.model_dir).get("max_position_embeddings", 0))
    args = list(cfg.engine_args)
    if "--max-model-len" in args:
        limit = min(limit, int(args[args.index("--max-model-len") + 1]))
    need = cfg.load.prompt_max + cfg.load.output_max
    if need > limit:
        raise ValueError(f"prompt_max + output_max: expected <= {limit} (model {model.preset}'s length), got {need}")


def summarize_only(cfg: BenchConfig) -> int:
    """The table and summary of an earlier run's files (e.g. one device call per configuration). Files with
    per-request records are scored against the --slo-* flags (their defaults unless given); older files keep
    the SLO they were run with."""
    docs = [json.loads(config_file(cfg.out, n).read_text()) for n in CONFIG_NAMES if config_file(cfg.out, n).exists()]
    if not docs:
        raise ValueError(f"--summarize: expected serving_<config>.json files in {cfg.out}, found none")
    meta = {k: v for k, v in docs[0].items() if k in ("model", "cards", "engine_args", "prefill_engine_args",
                                                       "decode_engine_args", "load", "slo", "drain_s", "gpus",
                                                       "command")}
    points = load_points(cfg.out)
    if all(len(p.per_request) == p.requests for ps in points.values() for p in ps):
        points = {name: tuple(with_slo(p, cfg.slo) for p in ps) for name, ps in points.items()}
        meta["slo"] = asdict(cfg.slo)
    points, sweep = write_summary(cfg, meta, points)
    print(markdown_table(points, Slo(**meta["slo"])), flush=True)
    if sweep:
        print("\n" + markdown_slo_sweep(sweep, cfg.slo.ttft_s), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.summarize:
        return summarize_only(cfg)
    check_engine_args(cfg.engine_args)
    check_engine_args((*cfg.engine_args, *cfg.prefill_engine_args))
    check_engine_args((*cfg.engine_args, *cfg.decode_engine_args))
    model = ensure_model(cfg)
    check_model_len(cfg, model)
    meta = {"model": asdict(model), "cards": card_names(), "engine_args": list(cfg.engine_args),
            "prefill_engine_args": list(cfg.prefill_engine_args),
            "decode_engine_args": list(cfg.decode_engine_args), "cuda_ipc": cfg.cuda_ipc,
            "disagg_prefill_queue_limit_tokens": cfg.disagg_prefill_queue_limit_tokens,
            "load": asdict(cfg.load), "slo": asdict(cfg.slo), "drain_s": cfg.drain_s, "gpus": cfg.gpus,
            "command": " ".join(sys.argv)}
    print(f"model {model.preset} (make-model preset {model.base_preset}"
          f"{' + overrides' if MODEL_PRESETS[model.preset][1] else ''}): {model.parameters / 1e6:.1f}M parameters, "
          f"{model.pattern}, hidden {model.hidden_size}, vocab {model.vocab_size}, {model.dtype}; cards "
          f"{card_names() or ['CPU']}", flush=True)
    specs = cluster_specs(cfg.disagg_local_prefill_threshold, cfg.disagg_prefill_queue_limit_tokens)
    rates = cfg.rates
    n_points = len(rates or cfg.rate_fractions) * len(cfg.configs)
    with tqdm(total=n_points, desc="serving sweep", unit="point", disable=not cfg.progress,
              file=sys.stderr) as bar:
        for name in cfg.configs:
            r = run_config(cfg, specs[name], model.vocab_size, rates, bar,
                           save=lambda partial: write_config(cfg, meta, partial))
            # The configurations after the first replay the same rates (and so the same schedules).
            rates = tuple(p.offered_rps for p in r.points)
    print(f"results in {cfg.out}; logs in {cfg.log_dir}", flush=True)
    points, sweep = write_summary(cfg, meta)
    print(markdown_table(points, cfg.slo), flush=True)
    if sweep:
        print("\n" + markdown_slo_sweep(sweep, cfg.slo.ttft_s), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:  # bad flags or inputs: one line, no traceback
        print(f"serving_bench: {e}", file=sys.stderr)
        sys.exit(2)
