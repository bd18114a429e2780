"""Transfer descriptors per request under serving churn: the block allocator's placement vs lowest-first.

A prefilled request's KV moves to the decode node in one descriptor per run of blocks whose ids are
consecutive on both nodes (`baton.transfer.plan.runs`). A coalesced READ runs several times faster than one
descriptor per block (benchmarks/RESULTS.md, the transfer history), so how many runs a real request's blocks form
decides which of the two a serving system gets.

Two real `Scheduler`s on ints (no model, no device): a prefill node (prefill-only requests, chunked by its
token budget) and a decode node (`reserve` + `add_computed`, then decode steps that grow each request by a
block every block_size tokens). Time advances in decode steps; the prefill node steps once every
--prefill-every of them (an 8,192-token prefill step takes ~200 ms on an H200, a decode step ~5-20 ms).
Arrivals are Poisson (--rate per decode step, on average), prompts log-normal (--prompt-mean tokens), outputs uniform in
[--out-min, --out-max]; a finished prefill's READ ends --transfer-steps decode steps after the decode node
reserves its blocks, and then the prefill node frees its copy. Same seed, same arrivals for each allocator:

  FreeList     the engine's (`baton.engine.allocator`): growth after the request's last block, best fit,
               longest runs first
  LowestFirst  the lowest free ids first (the engine's policy before; a heap)

`served_request` places one large request amid this traffic and returns its block ids on both nodes;
`transfer_bench.py --layouts served,served-lowest` READs a request laid out that way (NIXL's rate depends on the
descriptor count on GPUs).

  python benchmarks/alloc_bench.py                  # 8b-like pool (17,408 blocks of 16), 3,000 requests
  python benchmarks/alloc_bench.py --smoke          # seconds
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from baton.engine.allocator import FreeList
from baton.engine.engine_config import EngineConfig
from baton.engine.request import Request, RequestStatus
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler import Scheduler
from baton.engine.step_update import StepUpdate
from baton.transfer.plan import runs

TOKEN = 5


class LowestFirst:
    """The baseline: the lowest free ids first, whatever the caller held before."""

    def __init__(self, capacity: int, name: str) -> None:
        self.name, self.capacity = name, capacity
        self._free = list(range(capacity))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{self.name}: asked for {n}, only {len(self._free)} free")
        ids = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int] | tuple[int, ...]) -> None:
        for i in ids:
            self._used.remove(i)
            heapq.heappush(self._free, i)


ALLOCATORS = {"FreeList": FreeList, "LowestFirst": LowestFirst}


@dataclass(frozen=True)
class Workload:
    requests: int
    rate: float  # arrivals per decode step
    prompt_mean: int
    out_min: int
    out_max: int
    num_blocks: int
    block_size: int
    prefill_tokens: int  # the prefill node's token budget per step
    prefill_every: int  # decode steps per prefill step
    transfer_steps: int
    decode_seqs: int
    seed: int


DEFAULTS = Workload(requests=3000, rate=0.15, prompt_mean=2500, out_min=32, out_max=1024, num_blocks=17408,
                    block_size=16, prefill_tokens=8192, prefill_every=20, transfer_steps=2, decode_seqs=256, seed=0)


@dataclass(frozen=True)
class Result:
    allocator: str
    transfers: int
    blocks_mean: float
    descriptors: tuple[float, float, float, float, int]  # mean, p50, p90, p99, max
    blocks_per_descriptor: float
    decode_pool_use: float  # mean fraction of the decode pool's blocks in use
    host_us_per_step: float  # decode node schedule() + update(), mean
    leaked: int  # blocks and slots still used on either node once every request is done and every READ ended


class Churn:
    """The two nodes under the workload, one decode step per `step()`; `transfers` collects (prefill block ids,
    decode block ids) of each request as the decode node reserves its blocks."""

    def __init__(self, w: Workload, allocator: str) -> None:
        self.w = w
        self.rng = np.random.default_rng(w.seed)
        self.sigma = 0.8
        self.mu = np.log(w.prompt_mean) - self.sigma**2 / 2
        self.pre = Scheduler(EngineConfig(block_size=w.block_size, max_num_seqs=w.decode_seqs, prefill_only=True,
                                          max_num_batched_tokens=w.prefill_tokens), w.num_blocks, w.decode_seqs)
        self.dec = Scheduler(EngineConfig(block_size=w.block_size, max_num_seqs=w.decode_seqs,
                                          max_num_batched_tokens=max(w.decode_seqs, 512)), w.num_blocks,
                             w.decode_seqs)
        self.pre_update, self.dec_update = StepUpdate(self.pre), StepUpdate(self.dec)
        cls = ALLOCATORS[allocator]
        self.pre.cache.blocks = cls(w.num_blocks, "prefill kv blocks")
        self.dec.cache.blocks = cls(w.num_blocks, "decode kv blocks")
        self.prefilled: list[Request] = []  # held on the prefill node, waiting for decode blocks
        self.reading: list[tuple[int, Request]] = []  # (step the READ ends, request)
        self.outputs: dict[str, int] = {}
        self.transfers: dict[str, tuple[list[int], list[int]]] = {}
        self.use: list[float] = []
        self.host = 0.0
        self.steps = self.arrived = self.done = 0

    def add(self, rid: str, prompt_tokens: int, output_tokens: int) -> None:
        self.outputs[rid] = output_tokens
        self.pre.add(Request(rid, [TOKEN] * prompt_tokens, SamplingParams(max_tokens=1), arrival=self.arrived,
                             prefill_only=True))
        self.arrived += 1

    def step(self) -> None:
        w, pre, dec = self.w, self.pre, self.dec
        for _ in range(min(int(self.rng.poisson(w.rate)), w.requests - self.arrived)):
            n = int(min(16384, max(16, self.rng.lognormal(self.mu, self.sigma))))
            self.add(f"r{self.arrived}", n, int(self.rng.integers(w.out_min, w.out_max + 1)))
        if self.steps % w.prefill_every == 0 and pre.has_unfinished():
            out = pre.schedule()
            self.prefilled += [r for r in self.pre_update.update(out, {}) if r.status is RequestStatus.FINISHED_PREFILLED]
        while self.prefilled:  # FCFS: the decode node takes prefilled requests in order, when it has room
            req = self.prefilled[0]
            got = dec.cache.reserve(len(req.block_ids))
            if got is None:
                break
            blocks, slot = got
            self.transfers[req.request_id] = (list(req.block_ids), blocks)
            self.prefilled.pop(0)
            self.reading.append((self.steps + w.transfer_steps, req))
            d = Request(req.request_id, list(req.prompt_token_ids),
                        SamplingParams(max_tokens=self.outputs[req.request_id], ignore_eos=True),
                        arrival=req.arrival)
            dec.add_computed(d, blocks, slot, req.num_tokens - 1)
        for item in [x for x in self.reading if x[0] <= self.steps]:
            self.reading.remove(item)
            pre.cache.free_held(item[1].block_ids, item[1].state_slot)
        if dec.has_unfinished():
            t0 = time.perf_counter()
            out = dec.schedule()
            self.done += len(self.dec_update.update(out, {r.request_id: TOKEN for r in out.rows if r.sample}))
            self.host += time.perf_counter() - t0
            self.use.append(dec.cache.blocks.num_used / w.num_blocks)
        self.steps += 1

    def leaked(self) -> int:
        """Blocks and slots used on either node once every READ has ended (0 when all requests are done)."""
        for _, req in self.reading:
            self.pre.cache.free_held(req.block_ids, req.state_slot)
        self.reading = []
        pre, dec = self.pre.cache, self.dec.cache
        return sum(x.num_used for x in (pre.blocks, pre.slots, dec.blocks, dec.slots))


def simulate(w: Workload, allocator: str, progress: bool = True) -> Result:
    churn = Churn(w, allocator)
    bar = tqdm(total=w.requests, desc=allocator, unit="req", disable=not progress, leave=False)
    while churn.done < w.requests:
        done = churn.done
        churn.step()
        bar.update(churn.done - done)
    bar.close()
    leaked = churn.leaked()
    counts = []
    for remote, local in churn.transfers.values():  # in transfer order: the decode node takes them FCFS
        counts.append((len(local), len(runs(np.asarray(local), np.asarray(remote))[0])))
    c = np.asarray(counts[len(counts) // 10:])  # past the warm-up: the first tenth starts on an empty pool
    d = c[:, 1]
    return Result(allocator, len(c), float(c[:, 0].mean()),
                  (float(d.mean()), float(np.percentile(d, 50)), float(np.percentile(d, 90)),
                   float(np.percentile(d, 99)), int(d.max())),
                  float(c[:, 0].sum() / d.sum()), float(np.mean(churn.use)),
                  1e6 * churn.host / max(1, len(churn.use)), leaked)


def served_request(w: Workload, allocator: str, tokens: int) -> tuple[list[int], list[int]]:
    """Where a request of `tokens` prompt tokens lands on both nodes in the middle of the workload (half of its
    requests arrived first, the others keep arriving): (prefill block ids, decode block ids), as the nodes'
    allocators place them."""
    churn = Churn(w, allocator)
    while churn.arrived < w.requests // 2:
        churn.step()
    churn.add("served", tokens + 1, 1)  # the prefill node computes all but the last token (R1)
    for _ in range(100_000):
        if "served" in churn.transfers:
            return churn.transfers["served"]
        churn.step()
    raise RuntimeError(f"served_request: the {tokens}-token request never reached the decode node")


def compact(ids: list[int]) -> list[int]:
    """The same ids renumbered into [0, 2 * len(ids)): order kept, consecutive ids stay consecutive and any
    gap shrinks to one id, so the runs (transfer descriptors) of a pair of id lists are unchanged."""
    order = sorted(set(ids))
    new, v = {}, 0
    for j, i in enumerate(order):
        v = 0 if j == 0 else v + (1 if i == order[j - 1] + 1 else 2)
        new[i] = v
    return [new[i] for i in ids]


def table(w: Workload, results: list[Result]) -> str:
    lines = [f"{w.requests} requests, prompts log-normal mean {w.prompt_mean} tokens, outputs {w.out_min}-"
             f"{w.out_max}, {w.rate} arrivals per decode step, pools of {w.num_blocks} blocks x {w.block_size}, "
             f"prefill {w.prefill_tokens} tokens every {w.prefill_every} decode steps, READs "
             f"{w.transfer_steps} steps, decode <= {w.decode_seqs} requests", "",
             "| allocator | transfers | blocks / request | descriptors / request: mean / p50 / p90 / p99 / max | "
             "blocks / descriptor | decode pool use | decode host µs / step | leaked |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in results:
        m, p50, p90, p99, mx = r.descriptors
        lines.append(f"| {r.allocator} | {r.transfers} | {r.blocks_mean:.1f} | {m:.2f} / {p50:.0f} / {p90:.0f} / "
                     f"{p99:.0f} / {mx} | {r.blocks_per_descriptor:.1f} | {100 * r.decode_pool_use:.0f} % | "
                     f"{r.host_us_per_step:.0f} | {r.leaked} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Result]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = DEFAULTS
    ap.add_argument("--requests", type=int, default=d.requests)
    ap.add_argument("--rate", type=float, default=d.rate, help="mean arrivals per decode step (Poisson)")
    ap.add_argument("--prompt-mean", type=int, default=d.prompt_mean)
    ap.add_argument("--out-min", type=int, default=d.out_min)
    ap.add_argument("--out-max", type=int, default=d.out_max)
    ap.add_argument("--num-blocks", type=int, default=d.num_blocks, help="8b-like on an H200: engine_bench's KV pool")
    ap.add_argument("--block-size", type=int, default=d.block_size)
    ap.add_argument("--prefill-tokens", type=int, default=d.prefill_tokens)
    ap.add_argument("--prefill-every", type=int, default=d.prefill_every)
    ap.add_argument("--transfer-steps", type=int, default=d.transfer_steps)
    ap.add_argument("--decode-seqs", type=int, default=d.decode_seqs)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--smoke", action="store_true", help="300 requests on a 2,048-block pool")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    if not a.rate > 0:
        raise ValueError(f"--rate: expected arrivals per decode step > 0, got {a.rate}")
    names = a.allocators.split(",")
    for name in names:
        if name not in ALLOCATORS:
            raise ValueError(f"--allocators: expected names from {sorted(ALLOCATORS)}, got {name!r}")
    w = Workload(300 if a.smoke else a.requests, a.rate, 600 if a.smoke else a.prompt_mean, a.out_min,
                 256 if a.smoke else a.out_max, 2048 if a.smoke else a.num_blocks, a.block_size, a.prefill_tokens,
                 a.prefill_every, a.transfer_steps, 64 if a.smoke else a.decode_seqs, a.seed)
    results = [simulate(w, name, progress=not a.no_progress) for name in names]
    print(table(w, results))
    if a.json:
        a.json.write_text(json.dumps({"workload": w.__dict__, "results": [r.__dict__ for r in results]}, indent=1))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
