"""Helpers of the frozen- and killed-node tests: a steady load of Generate calls through a real cluster's router that
records how every request ended, freezing a node (SIGSTOP), and what the router and the nodes report."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from baton.cli.cluster import Cluster
from baton.proto.v1 import generation_pb2 as gen
from baton.proto.v1 import generation_pb2_grpc as gen_grpc
from baton.proto.v1 import worker_pb2 as wk
from baton.proto.v1 import worker_pb2_grpc as wk_grpc
from benchmarks.chaos import metric
from tests.node_channel import node_channel
from tests.process_stop import stop_group

ENGINE = {"block_size": 8, "max_num_batched_tokens": 32, "max_num_seqs": 8, "num_kv_blocks": 512}
ENGINE_ARGS = tuple(x for k, v in ENGINE.items() for x in ("--" + k.replace("_", "-"), str(v)))


@dataclass(frozen=True)
class Outcome:
    started: float  # time.monotonic()
    ended: float
    tokens: int
    status: str  # "OK", or the name of the gRPC status the call ended with
    details: str


def prompt(i: int) -> list[int]:
    """Prompts of 2 to 61 tokens: every one is prefilled on a prefill node (the router's default threshold)."""
    return [(7 * i + 5 * j) % 500 + 3 for j in range(2 + (i * 13) % 60)]


async def _one(stub: gen_grpc.GenerationStub, i: int, max_tokens: int, deadline_s: float) -> Outcome:
    req = gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt(i)),
                              sampling=gen.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    started, tokens = time.monotonic(), 0
    try:
        async for m in stub.Generate(req, timeout=deadline_s):
            tokens += len(m.token_ids)
    except grpc.aio.AioRpcError as e:
        return Outcome(started, time.monotonic(), tokens, e.code().name, e.details() or "")
    return Outcome(started, time.monotonic(), tokens, "OK", "")


async def steady_load(router_addr: str, stop: asyncio.Event, loops: int = 8, max_tokens: int = 64,
                      deadline_s: float = 60.0) -> list[Outcome]:
    """`loops` requests in flight at a time (each loop sends its next when the last ended) until `stop` is set;
    returns how every request ended."""
    out: list[Outcome] = []

    async def loop(k: int) -> None:
        i = k
        while not stop.is_set():
            out.append(await _one(stub, i, max_tokens, deadline_s))
            i += loops

    async with grpc.aio.insecure_channel(router_addr) as channel:
        stub = gen_grpc.GenerationStub(channel)
        await asyncio.gather(*(loop(k) for k in range(loops)))
    return out


async def burst(router_addr: str, n: int, first: int = 10_000, max_tokens: int = 64,
                deadline_s: float = 60.0) -> list[Outcome]:
    """`n` requests sent at once; how each ended."""
    async with grpc.aio.insecure_channel(router_addr) as channel:
        stub = gen_grpc.GenerationStub(channel)
        return list(await asyncio.gather(*(_one(stub, first + i, max_tokens, deadline_s) for i in range(n))))


def waits_after(outcomes: list[Outcome], t: float) -> list[float]:
    """For every request still running at `t`: how long it ran after `t`, or after it started if later."""
    return [o.ended - max(o.started, t) for o in outcomes if o.ended > t]


@contextlib.contextmanager
def frozen(cluster: Cluster, name: str) -> Iterator[None]:
    """Process `name` (and anything it started) stopped by SIGSTOP while inside; always continued after."""
    pgid = cluster.procs[name].pid  # started in a session of its own: its process group
    try:
        stop_group(pgid)
        yield
    finally:
        os.killpg(pgid, signal.SIGCONT)


async def router_health(router_addr: str) -> gen.HealthResponse:
    async with grpc.aio.insecure_channel(router_addr) as channel:
        return await gen_grpc.GenerationStub(channel).Health(gen.HealthRequest(), timeout=5)


async def wait_for_health(router_addr: str, prefill: int, decode: int, timeout: float) -> float:
    """Seconds until the router counts `prefill` and `decode` healthy workers; AssertionError after `timeout`."""
    started = time.monotonic()
    while True:
        h = await router_health(router_addr)
        if (h.prefill_workers, h.decode_workers) == (prefill, decode):
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"router health after {timeout} s: {h.prefill_workers} prefill and "
                                 f"{h.decode_workers} decode workers, expected {prefill} and {decode}")
        await asyncio.sleep(0.05)


def node_metric(cluster: Cluster, addr: str, name: str) -> float:
    return metric(cluster.node_http_url(addr) + "/metrics", name)


def all_free(cluster: Cluster, timeout: float = 10.0,
             addrs: list[str] | None = None) -> tuple[bool, list[wk.LoadResponse]]:
    """Every node's pools (or those of the nodes at `addrs`) back to fully free (no held leases, nothing running),
    polling until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        loads = []
        for addr in addrs if addrs is not None else [*cluster.prefill_addrs, *cluster.decode_addrs]:
            with node_channel(addr) as ch:
                loads.append(wk_grpc.WorkerStub(ch).Load(wk.LoadRequest(), timeout=5))
        free = all(x.free_kv_blocks == x.total_kv_blocks and x.free_state_slots == x.total_state_slots
                   and x.held_leases == 0 and x.running == 0 and x.waiting == 0 for x in loads)
        if free or time.monotonic() > deadline:
            return free, loads
        time.sleep(0.05)
