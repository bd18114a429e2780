"""Chaos benchmark (issue #46, must-show 7): a real local cluster (router + 2 prefill + 2 decode node processes,
tiny model, loopback) serves `--requests` Generate calls at a fixed concurrency while things go wrong on purpose:

- `--abort-rate` of the requests are aborted by the client at a random point: half by cancelling the stream, half
  by the Abort call (then the stream is read to its end);
- the decode nodes fail `--fault-rate` of their pulls with a TransferError (the test-only fault hook,
  `baton.transfer.fault_injection`: BATON_TEST_TRANSFER_FAULT_RATE / _SEED in the decode nodes' environment), so
  that the real fallback runs (the decode node prefills the request itself);
- a prefill node and a decode node are SIGKILLed at `--kills` (fractions of the requests sent; by default the
  node of each role that has the most requests running, waiting or leased at that moment) and restarted on their
  ports at once (`Cluster.respawn`); the router's in-flight count is read just before each kill.

Every request is greedy with `ignore_eos` and `--max-tokens`, so its output is known: the offline engine
(`LLMEngine.generate`, same engine flags) computes every unique prompt's reference once, batched. Each request
ends as one of:
- answered: finished with all its tokens; wrong-tokens counts those whose tokens differ from the reference;
- aborted: ended by the client's own cancel or Abort;
- failed-with-status: ended with a gRPC status (UNAVAILABLE when its decode node died after streaming tokens);
- hung: not ended within `--deadline-s` (the client's timeout: DEADLINE_EXCEEDED, or no answer at all).
Tokens streamed before an abort or a failure must be a prefix of the reference too (counted in wrong-tokens).

At the end, once the restarted nodes are back in rotation and every node is idle (`--settle-s` at most), each node's
Load says what it still holds: leaked KV blocks (total - free), leaked state slots (total - free), held leases,
requests running or waiting; and every process must still be alive. Must be 0: hung, wrong-tokens, every leak,
dead processes, nodes not back; failed-with-status must stay <= the sum of the in-flight counts at the kills. The
exit status is 1 when one of these does not hold.

  python benchmarks/chaos.py                                   # 10,000 requests (RESULTS.md: time on 2 CPU cores)
  python benchmarks/chaos.py --requests 300 --json /tmp/chaos.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from baton.cli.cluster import Cluster
from baton.client import AsyncClient
from baton.client.errors import BatonError
from baton.proto.v1 import generation_pb2 as gen
from baton.proto.v1 import generation_pb2_grpc as gen_grpc
from baton.proto.v1 import worker_pb2 as wk
from baton.proto.v1 import worker_pb2_grpc as wk_grpc
from baton.transfer.fault_injection import FAULT_RATE_ENV, FAULT_SEED_ENV, INJECTED_MESSAGE

# Token ids 0..2 are pad / bos / eos in every preset; prompts draw from [FIRST_ID, vocab_size).
FIRST_ID = 3
# Every node's engine flags (and the offline reference's): room for every request of a node at once.
ENGINE = {"block_size": 8, "max_num_batched_tokens": 64, "max_num_seqs": 16, "num_kv_blocks": 512}
# How long past its own deadline a request may take before the driver gives up on it (counted as hung).
GUARD_S = 10.0
# How long the router may take to notice a killed node (its connections reset at once; else its next Load poll).
NOTICE_S = 10.0
ANSWERED, ABORTED, FAILED, HUNG = "answered", "aborted", "failed", "hung"


@dataclass(frozen=True)
class ChaosConfig:
    requests: int = 10_000
    concurrency: int = 16
    abort_rate: float = 0.1
    fault_rate: float = 0.05
    seed: int = 0
    # Long enough that a decode node killed mid-run has streams that sent tokens (they end with UNAVAILABLE).
    max_tokens: int = 32
    prompt_min: int = 4
    prompt_max: int = 24
    # Distinct prompts the requests draw from (each one's reference is computed once).
    unique_prompts: int = 256
    deadline_s: float = 30.0
    # (fraction of the requests sent, process) pairs: SIGKILL then restart. A role ("prefill", "decode") for a
    # process picks the node of that role busiest at the kill.
    kills: tuple[tuple[float, str], ...] = ((0.3, "prefill"), (0.6, "decode"))
    prefill_workers: int = 2
    decode_workers: int = 2
    # The longest the end waits for restarted nodes to rejoin and for every node to go idle.
    settle_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("requests", "concurrency", "max_tokens", "prompt_min", "unique_prompts", "decode_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.prompt_max < self.prompt_min:
            raise ValueError(f"prompt_max: expected >= prompt_min ({self.prompt_min}), got {self.prompt_max}")
        for name in ("abort_rate", "fault_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: expected a fraction in [0, 1], got {getattr(self, name)}")
        if not self.deadline_s > 0 or not self.settle_s > 0:
            raise ValueError(f"deadline_s, settle_s: expected > 0, got {self.deadline_s}, {self.settle_s}")
        names = {f"prefill-{i}" for i in range(self.prefill_workers)} | \
                {f"decode-{i}" for i in range(self.decode_workers)}
        names |= {"decode"} | ({"prefill"} if self.prefill_workers else set())
        for frac, name in self.kills:
            if not 0.0 <= frac < 1.0 or name not in names:
                raise ValueError(f"kills: expected (fraction in [0, 1), one of {sorted(names)}), "
                                 f"got {(frac, name)}")


@dataclass(frozen=True)
class Planned:
    index: int
    prompt: int  # index into the unique prompts
    # Tokens received before the client aborts (0: right after sending); None: never aborted.
    abort_after: int | None
    abort_by: str  # "cancel" (the stream) or "rpc" (the Abort call)


def plan(cfg: ChaosConfig, vocab_size: int) -> tuple[list[list[int]], list[Planned]]:
    """The unique prompts and every request's plan, all drawn from `cfg.seed`."""
    rng = random.Random(cfg.seed)
    prompts = [[rng.randrange(FIRST_ID, vocab_size) for _ in range(rng.randint(cfg.prompt_min, cfg.prompt_max))]
               for _ in range(cfg.unique_prompts)]
    reqs = []
    for i in range(cfg.requests):
        aborted = rng.random() < cfg.abort_rate
        reqs.append(Planned(i, rng.randrange(cfg.unique_prompts),
                            rng.randrange(cfg.max_tokens) if aborted else None,
                            rng.choice(("cancel", "rpc"))))
    return prompts, reqs


def references(model: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[int, ...]]:
    """Every prompt's greedy output in the offline engine (same engine flags as the nodes)."""
    from baton.engine.engine_config import EngineConfig
    from baton.engine.llm_engine import LLMEngine
    from baton.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_pretrained(model, EngineConfig(**ENGINE))
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [tuple(o.token_ids) for o in outs]


# ---- one request ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Result:
    index: int
    outcome: str  # ANSWERED, ABORTED, FAILED or HUNG
    status: str  # "OK", "ABORTED", or what ended it (a gRPC status name, "FINISH_ABORT", "NO_FINISH", "GUARD")
    tokens: int
    wrong: bool
    detail: str = ""


async def run_one(client: AsyncClient, p: Planned, prompt: list[int], reference: tuple[int, ...],
                  cfg: ChaosConfig) -> Result:
    tokens: list[int] = []
    finish, tried, aborted, status, detail = None, False, False, "OK", ""

    async def abort(stream) -> bool:
        """Whether the request was aborted (an Abort that finds nothing leaves it running)."""
        nonlocal tried
        tried = True
        if p.abort_by == "cancel":
            stream.cancel()
            return True
        return await client.abort(f"chaos-{p.index}")

    try:
        async with asyncio.timeout(cfg.deadline_s + GUARD_S):
            stream = client.stream(prompt, max_tokens=cfg.max_tokens, ignore_eos=True,
                                   request_id=f"chaos-{p.index}")
            async with stream:
                if p.abort_after == 0:
                    aborted = await abort(stream)
                async for chunk in stream:
                    tokens += chunk.token_ids
                    if chunk.finish_reason is not None:
                        finish = chunk.finish_reason
                        break
                    if p.abort_after is not None and not tried and len(tokens) >= p.abort_after:
                        aborted = await abort(stream)
    except BatonError as e:
        status, detail = e.code, e.message
    except TimeoutError:
        status = "GUARD"
    wrong = tuple(tokens) != reference[:len(tokens)]
    if status in ("DEADLINE_EXCEEDED", "GUARD"):
        return Result(p.index, HUNG, status, len(tokens), wrong, detail)
    if status != "OK":
        return Result(p.index, FAILED, status, len(tokens), wrong, detail)
    if finish in ("length", "stop"):
        return Result(p.index, ANSWERED, "OK", len(tokens), wrong or len(tokens) != cfg.max_tokens)
    if aborted and (finish == "abort" or (finish is None and p.abort_by == "cancel")):
        return Result(p.index, ABORTED, "ABORTED", len(tokens), wrong)
    return Result(p.index, FAILED, "FINISH_ABORT" if finish == "abort" else "NO_FINISH", len(tokens), wrong)


# ---- kills ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kill:
    name: str
    at_request: int
    # Generate calls in flight at the router just before the SIGKILL (its baton_router_in_flight_requests).
    router_in_flight: int
    # Requests running, waiting or leased on the killed node just before (its Load; -1: it did not answer).
    node_requests: int
    # Seconds from the SIGKILL until the router counted the restarted node healthy again (None: not back).
    back_after_s: float | None


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sample `name` (with `labels`) at the Prometheus endpoint `url`; 0 when absent."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return s.value
    return 0.0


async def healthy_counts(router_addr: str) -> tuple[int, int]:
    async with grpc.aio.insecure_channel(router_addr) as channel:
        h = await gen_grpc.GenerationStub(channel).Health(gen.HealthRequest(), timeout=5)
    return h.prefill_workers, h.decode_workers


async def wait_all_healthy(cluster: Cluster, timeout: float) -> bool:
    full = (cluster.prefill_workers, cluster.decode_workers)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.RpcError):
            if await healthy_counts(cluster.router_addr) == full:
                return True
        await asyncio.sleep(0.1)
    return False


def node_addr(cluster: Cluster, name: str) -> str:
    return [*cluster.prefill_addrs, *cluster.decode_addrs][cluster.node_names.index(name)]


def node_load(cluster: Cluster, name: str) -> wk.LoadResponse | None:
    """Node `name`'s Load (asked with the cluster credential), or None when it does not answer."""
    assert cluster.credential is not None
    try:
        with grpc.insecure_channel(node_addr(cluster, name)) as ch:
            return wk_grpc.WorkerStub(ch).Load(wk.LoadRequest(), timeout=5,
                                               metadata=cluster.credential.grpc_metadata())
    except grpc.RpcError:
        return None


def busiest(cluster: Cluster, target: str) -> tuple[str, int]:
    """`target` when it names a node, else the node of role `target` with the most requests running, waiting or
    leased now; with that count (-1: it did not answer)."""
    names = [target] if target in cluster.node_names else [n for n in cluster.node_names if n.rpartition("-")[0]
                                                            == target]
    counts = {}
    for name in names:
        x = node_load(cluster, name)
        counts[name] = -1 if x is None else x.running + x.waiting + x.held_leases
    name = max(names, key=lambda n: counts[n])
    return name, counts[name]


def worker_healthy(cluster: Cluster, name: str) -> bool:
    """Whether the router counts node `name` healthy (its /v1/workers)."""
    addr = node_addr(cluster, name)
    with urllib.request.urlopen(cluster.router_http_url + "/v1/workers", timeout=5) as r:
        return any(w["address"] == addr and w["healthy"] for w in json.loads(r.read()))


async def wait_worker(cluster: Cluster, name: str, healthy: bool, timeout: float) -> bool:
    """Whether the router came to count node `name` healthy (or not) within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if await asyncio.to_thread(worker_healthy, cluster, name) == healthy:
                return True
        await asyncio.sleep(0.1)
    return False


async def kill_and_restart(cluster: Cluster, target: str, at_request: int, rejoin_s: float) -> Kill:
    """SIGKILL node `target` (or the busiest of role `target`), restart it on its ports at once, and wait (at most
    `rejoin_s`) until the router has it in rotation again."""
    name, node_requests = await asyncio.to_thread(busiest, cluster, target)
    in_flight = await asyncio.to_thread(metric, cluster.router_http_url + "/metrics",
                                        "baton_router_in_flight_requests")
    killed = time.monotonic()
    await asyncio.to_thread(cluster.kill, name)
    await asyncio.to_thread(cluster.respawn, name)
    # The router first notices the death (a restarted node loads its model before it answers), then the return.
    await wait_worker(cluster, name, False, NOTICE_S)
    back = await wait_worker(cluster, name, True, rejoin_s)
    return Kill(name, at_request, int(in_flight), node_requests, time.monotonic() - killed if back else None)


# ---- the end: what every node still holds -------------------------------------------------------------------

@dataclass(frozen=True)
class NodeState:
    name: str
    leaked_blocks: int
    leaked_slots: int
    held_leases: int
    running: int
    waiting: int
    alive: bool
    # Pulls that fell back to a local prefill (decode nodes; counted since the node's last start).
    fallbacks: int

    @property
    def leaks(self) -> int:
        return self.leaked_blocks + self.leaked_slots + self.held_leases + self.running + self.waiting


def node_states(cluster: Cluster) -> list[NodeState]:
    out = []
    for name in cluster.node_names:
        alive = cluster.procs[name].poll() is None
        x = node_load(cluster, name)
        try:
            url = cluster.node_http_url(node_addr(cluster, name)) + "/metrics"
            fallbacks = int(metric(url, "baton_node_transfer_fallbacks_total"))
        except OSError:
            x = None
        if x is None:
            out.append(NodeState(name, -1, -1, -1, -1, -1, False, 0))
            continue
        out.append(NodeState(name, x.total_kv_blocks - x.free_kv_blocks, x.total_state_slots - x.free_state_slots,
                             x.held_leases, x.running, x.waiting, alive, fallbacks))
    return out


async def settle(cluster: Cluster, timeout: float) -> list[NodeState]:
    """Every node's state once all are idle, or as they are after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        states = await asyncio.to_thread(node_states, cluster)
        if all(s.leaks == 0 for s in states) or time.monotonic() > deadline:
            return states
        await asyncio.sleep(0.2)


# ---- the run -------------------------------------------------------------------------------------------

@dataclass
class Report:
    config: ChaosConfig
    wall_s: float
    results: list[Result] = field(repr=False)
    kills: list[Kill]
    nodes: list[NodeState]
    dead_processes: list[str]
    # Requests the client set out to abort (some finish first: they count as answered).
    aborts_planned: int = 0
    # Pulls the fault hook failed, as the decode nodes logged them (over restarts).
    injected_faults: int = 0

    def count(self, outcome: str) -> int:
        return sum(r.outcome == outcome for r in self.results)

    @property
    def wrong_tokens(self) -> int:
        return sum(r.wrong for r in self.results)

    @property
    def failed_bound(self) -> int:
        return sum(k.router_in_flight for k in self.kills)

    def problems(self) -> list[str]:
        """Every must-be-zero count that is not, and a failed count above its bound."""
        out = []
        if self.count(HUNG):
            out.append(f"hung: {self.count(HUNG)}")
        if self.wrong_tokens:
            out.append(f"wrong-tokens: {self.wrong_tokens}")
        if self.count(FAILED) > self.failed_bound:
            out.append(f"failed-with-status: {self.count(FAILED)} > {self.failed_bound} in flight at the kills")
        out += [f"{n.name}: did not answer Load" if n.leaked_blocks < 0 else
                f"{n.name}: leaked blocks {n.leaked_blocks}, slots {n.leaked_slots}, held leases "
                f"{n.held_leases}, running {n.running}, waiting {n.waiting}" for n in self.nodes if n.leaks]
        out += [f"{name}: not running at the end" for name in self.dead_processes]
        out += [f"{k.name}: not back in rotation after its restart" for k in self.kills if k.back_after_s is None]
        return out

    def summary(self) -> dict:
        statuses = Counter(r.status for r in self.results if r.outcome == FAILED)
        return {"answered": self.count(ANSWERED), "aborted": self.count(ABORTED),
                "aborts_planned": self.aborts_planned, "failed": self.count(FAILED),
                "failed_statuses": dict(statuses), "hung": self.count(HUNG), "wrong_tokens": self.wrong_tokens,
                "failed_bound": self.failed_bound, "injected_faults": self.injected_faults,
                "problems": self.problems()}

    def table(self) -> str:
        c, s = self.config, self.summary()
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(s["failed_statuses"].items())) or "-"
        lines = [f"{c.requests} requests in {self.wall_s:.1f} s ({c.requests / self.wall_s:.1f}/s), concurrency "
                 f"{c.concurrency}, max_tokens {c.max_tokens}, aborts {c.abort_rate:g}, transfer faults "
                 f"{c.fault_rate:g} ({self.injected_faults} injected), seed {c.seed}",
                 "",
                 "| outcome | count |", "|---|---:|",
                 f"| answered | {s['answered']} |",
                 f"| aborted (by the client; {s['aborts_planned']} tried, the rest finished first) | "
                 f"{s['aborted']} |",
                 f"| failed-with-status ({statuses}) | {s['failed']} (bound {s['failed_bound']}) |",
                 f"| hung | {s['hung']} |", f"| wrong-tokens | {s['wrong_tokens']} |",
                 "",
                 "| kill | at request | router in flight | on the node | back in rotation after |",
                 "|---|---:|---:|---:|---:|"]
        lines += [f"| {k.name} | {k.at_request} | {k.router_in_flight} | {k.node_requests} | "
                  f"{'not back' if k.back_after_s is None else f'{k.back_after_s:.1f} s'} |" for k in self.kills]
        lines += ["", "| node | leaked blocks | leaked slots | held leases | running | waiting | alive | "
                      "pull fallbacks |", "|---|---:|---:|---:|---:|---:|---|---:|"]
        rows = [*self.nodes, NodeState("total", *(sum(getattr(n, f) for n in self.nodes) for f in
                                                  ("leaked_blocks", "leaked_slots", "held_leases", "running",
                                                   "waiting")), all(n.alive for n in self.nodes),
                                       sum(n.fallbacks for n in self.nodes))]
        lines += [f"| {n.name} | {n.leaked_blocks} | {n.leaked_slots} | {n.held_leases} | {n.running} | "
                  f"{n.waiting} | {'yes' if n.alive else 'NO'} | {n.fallbacks} |" for n in rows]
        problems = self.problems()
        lines += ["", "OK: every must-be-zero count is 0" if not problems else "FAILED: " + "; ".join(problems)]
        return "\n".join(lines)


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """`values` in this process's environment (which the cluster's processes inherit) while inside."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def injected_faults(log_dir: str) -> int:
    """Pulls failed by the fault hook: the decode nodes log each one (`Puller.pull`), appending across restarts."""
    return sum(line.count(INJECTED_MESSAGE) for f in Path(log_dir).glob("decode-*.log")
               for line in f.read_text(errors="replace").splitlines())


def start_cluster(cfg: ChaosConfig, model: str, log_dir: str) -> Cluster:
    engine_args = tuple(x for k, v in ENGINE.items() for x in ("--" + k.replace("_", "-"), str(v)))
    # One engine thread per process: five processes share the cores, and more threads each only contend.
    env = {FAULT_RATE_ENV: str(cfg.fault_rate), FAULT_SEED_ENV: str(cfg.seed),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with environ(env):
        # The environment is recorded per process, so that a restarted node gets the fault hook too.
        return Cluster(model, prefill_workers=cfg.prefill_workers, decode_workers=cfg.decode_workers,
                       engine_args=engine_args, log_dir=log_dir).start()


async def drive(cfg: ChaosConfig, cluster: Cluster, prompts: list[list[int]], refs: list[tuple[int, ...]],
                reqs: list[Planned], progress: bool = True) -> tuple[list[Result], list[Kill], float]:
    """Sends every planned request (`cfg.concurrency` at a time), killing and restarting nodes on the way."""
    kill_at: dict[int, list[str]] = {}
    for frac, target in cfg.kills:
        kill_at.setdefault(round(frac * cfg.requests), []).append(target)
    results: list[Result] = []
    outcomes: Counter[str] = Counter()
    kills: list[asyncio.Task[Kill]] = []
    bar = tqdm(total=cfg.requests, desc="chaos", unit="req", disable=not progress, file=sys.stderr)
    started = time.monotonic()
    async with AsyncClient(cluster.router_addr, timeout=cfg.deadline_s, retries=0) as client:
        free = asyncio.Semaphore(cfg.concurrency)

        async def one(p: Planned) -> None:
            try:
                r = await run_one(client, p, prompts[p.prompt], refs[p.prompt], cfg)
            finally:
                free.release()
            results.append(r)
            outcomes[r.outcome] += 1
            bar.update()
            if r.outcome != ANSWERED:
                bar.set_postfix(outcomes, refresh=False)

        tasks = []
        for p in reqs:
            for target in kill_at.get(p.index, ()):
                kills.append(asyncio.create_task(
                    kill_and_restart(cluster, target, p.index, cfg.settle_s + cfg.deadline_s)))
            await free.acquire()
            tasks.append(asyncio.create_task(one(p)))
        await asyncio.gather(*tasks)
        wall = time.monotonic() - started
        done = list(await asyncio.gather(*kills))
    bar.close()
    return sorted(results, key=lambda r: r.index), done, wall


def run(cfg: ChaosConfig, model: str, log_dir: str, progress: bool = True) -> Report:
    """The whole benchmark on the model in `model` (a tiny one: see `main`); the cluster is stopped after."""
    cluster = start_cluster(cfg, model, log_dir)
    try:
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        prompts, reqs = plan(cfg, vocab)
        refs = references(model, prompts, cfg.max_tokens)

        async def go() -> tuple[list[Result], list[Kill], float, list[NodeState]]:
            results, kills, wall = await drive(cfg, cluster, prompts, refs, reqs, progress)
            await wait_all_healthy(cluster, cfg.settle_s)
            return results, kills, wall, await settle(cluster, cfg.settle_s)

        results, kills, wall, nodes = asyncio.run(go())
        dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
        return Report(cfg, wall, results, kills, nodes, dead, sum(p.abort_after is not None for p in reqs),
                      injected_faults(log_dir))
    finally:
        cluster.stop(timeout=15)


def parse_kills(text: str) -> tuple[tuple[float, str], ...]:
    """"0.3:prefill-0,0.6:decode-0" -> ((0.3, "prefill-0"), (0.6, "decode-0")); "" -> ()."""
    out = []
    for item in filter(None, text.split(",")):
        frac, _, name = item.partition(":")
        try:
            out.append((float(frac), name))
        except ValueError:
            raise ValueError(f"--kills: expected FRACTION:PROCESS items, got {item!r}") from None
    return tuple(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ChaosConfig()
    ap.add_argument("--requests", type=int, default=d.requests)
    ap.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight at a time")
    ap.add_argument("--abort-rate", type=float, default=d.abort_rate, help="fraction aborted by the client")
    ap.add_argument("--fault-rate", type=float, default=d.fault_rate, help="fraction of pulls failed on purpose")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens)
    ap.add_argument("--prompt-min", type=int, default=d.prompt_min)
    ap.add_argument("--prompt-max", type=int, default=d.prompt_max)
    ap.add_argument("--unique-prompts", type=int, default=d.unique_prompts)
    ap.add_argument("--deadline-s", type=float, default=d.deadline_s, help="a request not ended by then is hung")
    ap.add_argument("--kills", default=",".join(f"{f:g}:{n}" for f, n in d.kills),
                    help="FRACTION:TARGET,...: once that fraction of requests was sent, SIGKILL the node "
                         "TARGET (prefill-0, decode-1, ...) or the busiest node of role TARGET (prefill, decode), "
                         "then restart it")
    ap.add_argument("--settle-s", type=float, default=d.settle_s,
                    help="the longest the end waits for nodes to rejoin and go idle")
    ap.add_argument("--model-dir", type=Path, default=None, help="the tiny model (default: written to a temp dir)")
    ap.add_argument("--log-dir", type=Path, default=None, help="node and router logs (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="write the summary, kills and nodes here")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    try:
        cfg = ChaosConfig(a.requests, a.concurrency, a.abort_rate, a.fault_rate, a.seed, a.max_tokens,
                          a.prompt_min, a.prompt_max, a.unique_prompts, a.deadline_s, parse_kills(a.kills),
                          settle_s=a.settle_s)
    except ValueError as e:
        ap.error(str(e))
    with tempfile.TemporaryDirectory(prefix="baton-chaos-") as tmp:
        model = a.model_dir or Path(tmp) / "tiny"
        if not (model / "config.json").exists():
            from baton.engine.make_model import make_model

            make_model(model, preset="tiny", seed=a.seed, progress=False, tokenizer=False)
        log_dir = a.log_dir or Path(tmp) / "logs"
        report = run(cfg, str(model), str(log_dir), progress=not a.no_progress)
    print(report.table())
    if a.json is not None:
        a.json.write_text(json.dumps({"config": asdict(cfg), "wall_s": report.wall_s, **report.summary(),
                                      "kills": [asdict(k) for k in report.kills],
                                      "nodes": [asdict(n) for n in report.nodes]}, indent=2))
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
