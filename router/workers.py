"""A pool of workers of one role: discovery, channels, stubs, health from periodic `Load` polls, load tracking."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from baton.proto.keepalive import ROUTER_CHANNEL_OPTIONS
from baton.proto.v1 import worker_pb2, worker_pb2_grpc
from baton.router.affinity import pick_by_affinity
from baton.router.cluster_client import ClusterClient
from baton.router.config import RouterConfig
from baton.router.discovery import Discovery, StaticDiscovery, UnionDiscovery, discovery_for
from baton.router.load_tracker import LoadSnapshot, LoadTracker
from baton.router.policy import Role, pick
from baton.router.prefix_index import PrefixIndex, block_hashes, chain_seed
from baton.router.unsent_aborts import UnsentAborts

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = (
    # Long prompts travel as repeated uint32 (up to 5 bytes a token): lift the 4 MB default.
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    # A restarted node should be back in rotation within about a second, not after gRPC's default
    # exponential backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Router and nodes talk directly; an http_proxy set for other tools must not capture this traffic.
    ("grpc.enable_http_proxy", 0),
    # Pings while calls are in flight: a node that stops answering them fails those calls within seconds.
    *ROUTER_CHANNEL_OPTIONS,
)
# An Abort that failed with these never reached the node, or got no answer: it may still hold the request.
_UNANSWERED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True)
class Picked:
    worker: Worker
    # Leading prompt tokens it is predicted to hold in its prefix cache, and whether that is why it was picked.
    hit_tokens: int = 0
    by_affinity: bool = False
    # The prompt's block hash chain by its block size and model (affinity on), for `WorkerPool.record`.
    chain: tuple[bytes, ...] = ()


class Worker:
    """One node as seen from the router. Healthy only once it has answered both `Load` and `Info`."""

    def __init__(self, index: int, addr: str, role: Role, cluster: ClusterClient | None = None,
                 prefix_index_blocks: int = 32768) -> None:
        self.index = index
        self.addr = addr
        self.role = role
        # Every call carries the cluster token (nodes refuse calls without it).
        self.channel = (cluster or ClusterClient()).channel(addr, _CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.tracker = LoadTracker(role)
        self.healthy = False
        self.info: worker_pb2.InfoResponse | None = None
        # Load polls that failed in a row (reset by a successful one), and of them the last ones that got no
        # answer before their deadline (a node that refuses calls, e.g. while draining, still answers).
        self.failed_polls = 0
        self.silent_polls = 0
        # The calls of requests on this node (Prefill, Decode streams): cancelled when it stops answering.
        self._calls: set[grpc.aio.Call] = set()
        # How many times it stopped answering, and why the last time: a request whose call was cancelled
        # compares the count with the one it saw when the call started.
        self.stops = 0
        self.stop_reason = ""
        # Aborts it did not answer: sent again once it answers a Load poll.
        self.unsent_aborts = UnsentAborts()
        # No longer discovered: gets no new requests; its channel closes once its requests have ended.
        self.retired = False
        self.closed = False
        # The prompt prefixes this router sent it lately (prefix affinity).
        self.prefix_index = PrefixIndex(prefix_index_blocks)

    def __repr__(self) -> str:
        return f"{self.role.value} worker {self.addr}"

    def watch(self, call: grpc.aio.Call) -> None:
        """Cancel `call` if this node stops answering while it runs."""
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)

    def stop_calls(self, reason: str) -> int:
        """This node stopped answering: cancels the calls it serves (their requests then see `stops` changed);
        returns how many."""
        self.stops += 1
        self.stop_reason = reason
        calls = list(self._calls)
        self._calls.clear()
        for call in calls:
            call.cancel()
        return len(calls)


class WorkerPool:
    """The workers of one role. Which addresses it holds comes from its `Discovery` (static addresses by
    default), asked at start and then every `discovery.refresh_s` seconds; the policy only ever sees the
    workers currently discovered, and of those only the healthy ones."""

    def __init__(self, role: Role, addrs: Sequence[str] = (), *, discovery: Discovery | None = None,
                 poll_interval_s: float = 0.5, control_timeout_s: float = 5.0, unhealthy_after: int = 1,
                 poll_timeout_s: float = 2.0, rng: random.Random | None = None,
                 cluster: ClusterClient | None = None, prefix_affinity_weight: float = 0.0,
                 prefix_index_blocks: int = 32768, prefix_block_size: int = 16) -> None:
        """`prefix_affinity_weight` > 0: `pick_for` weighs the prompt prefix each worker is predicted to hold
        against its load (`router/affinity.py`); `prefix_block_size`: tokens per block of a worker whose Info has
        not told its own."""
        self.role = role
        self.prefix_affinity_weight = prefix_affinity_weight
        self.prefix_index_blocks = prefix_index_blocks
        self.prefix_block_size = prefix_block_size
        self.cluster = cluster
        if discovery is None:
            discovery = StaticDiscovery(addrs)
        elif addrs:
            discovery = UnionDiscovery((StaticDiscovery(addrs), discovery))
        self.discovery = discovery
        self.poll_interval_s = poll_interval_s
        self.control_timeout_s = control_timeout_s
        self.poll_timeout_s = poll_timeout_s
        self.unhealthy_after = unhealthy_after
        self._rng = rng or random.Random()
        self._active: dict[str, Worker] = {}
        # A fresh tuple on every change, never mutated: threads (the HTTP front) may read it while it changes.
        self._workers: tuple[Worker, ...] = ()
        self._retiring: dict[Worker, asyncio.Task[None]] = {}
        self._polls: dict[Worker, asyncio.Task[None]] = {}
        self._resends: dict[Worker, asyncio.Task[None]] = {}
        self._refresh_task: asyncio.Task[None] | None = None
        self._started = False
        self._next_index = 0

    @classmethod
    def from_config(cls, config: RouterConfig, role: Role, **kw: Any) -> WorkerPool:
        return cls(role, discovery=discovery_for(config, role), poll_interval_s=config.load_poll_interval_s,
                   control_timeout_s=config.control_timeout_s, unhealthy_after=config.unhealthy_after,
                   poll_timeout_s=config.poll_timeout_s, prefix_affinity_weight=config.prefix_affinity_weight,
                   prefix_index_blocks=config.prefix_index_blocks, prefix_block_size=config.prefix_block_size,
                   **kw)

    @property
    def workers(self) -> tuple[Worker, ...]:
        """The workers currently discovered (healthy or not); retiring ones are not among them."""
        return self._workers

    async def start(self) -> None:
        """Discovers and polls every worker once (so the first requests see real health), then keeps
        polling and, for a discovery that changes, discovering."""
        await self.refresh()
        await self.poll_once()
        self._started = True
        # One loop per worker: a worker that hangs until the control timeout delays only its own polls.
        for w in self._active.values():
            self._start_polling(w, first_poll=False)
        if self.discovery.refresh_s is not None:
            self._refresh_task = asyncio.create_task(self._refresh_forever(), name=f"baton-router-discovery-{self.role}")

    async def close(self) -> None:
        # Snapshot first: a cancelled retire task drops its worker from `_retiring` when it ends.
        to_close = [*self._active.values(), *self._retiring]
        tasks = [*self._polls.values(), *self._retiring.values(), *self._resends.values()]
        if self._refresh_task is not None:
            tasks.append(self._refresh_task)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._active, self._workers = {}, ()
        self._polls, self._retiring, self._resends, self._refresh_task, self._started = {}, {}, {}, None, False
        for w in to_close:
            w.closed = True
        # Closing twice is harmless: a retiring worker's own close may have been cancelled above.
        await asyncio.gather(*(w.channel.close() for w in to_close))

    # ---- discovery ------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Asks the discovery once and applies its answer; a failed lookup keeps the current workers."""
        try:
            addrs = await self.discovery.addresses()
        except Exception as e:  # noqa: BLE001 - any failure of a lookup must leave the pool as it is
            log.warning("%s worker discovery (%s) failed, keeping %d worker(s): %s: %s", self.role.value,
                        self.discovery.describe(), len(self._active), type(e).__name__, e)
            return
        self.set_addresses(addrs)

    async def _refresh_forever(self) -> None:
        assert self.discovery.refresh_s is not None
        while True:
            await asyncio.sleep(self.discovery.refresh_s)
            await self.refresh()

    def set_addresses(self, addrs: Collection[str]) -> None:
        """Makes the pool hold exactly `addrs`: new ones get a channel and are polled at once (they take
        requests after their first successful poll); gone ones get no new request, and their channels close
        once the requests they serve have ended."""
        for addr in [a for a in self._active if a not in addrs]:
            self._retire(self._active.pop(addr))
        for addr in sorted(a for a in addrs if a not in self._active):
            revived = next((w for w in self._retiring if w.addr == addr and not w.closed), None)
            if revived is not None:
                self._retiring.pop(revived).cancel()
                revived.retired = False
                w = revived
                log.info("%r is discovered again", w)
            else:
                w = Worker(self._next_index, addr, self.role, self.cluster, self.prefix_index_blocks)
                self._next_index += 1
                log.info("%r discovered", w)
            self._active[addr] = w
            if self._started:
                self._start_polling(w, first_poll=True)
        self._workers = tuple(self._active.values())

    def _retire(self, w: Worker) -> None:
        w.retired = True
        # Gone from rotation: what it held no longer attracts requests (and a rediscovered one starts afresh).
        w.prefix_index.clear()
        task = self._polls.pop(w, None)
        if task is not None:
            task.cancel()
        log.info("%r is no longer discovered: out of rotation; %d request(s) in flight there finish first",
                 w, w.tracker.in_flight)
        task = asyncio.create_task(self._close_when_idle(w), name=f"baton-router-retire-{w.addr}")
        self._retiring[w] = task
        task.add_done_callback(lambda t: self._retiring.pop(w) if self._retiring.get(w) is t else None)

    async def _close_when_idle(self, w: Worker) -> None:
        while w.tracker.in_flight:
            await asyncio.sleep(min(self.poll_interval_s, 0.1))
        # From here on, Aborts for it are skipped (pool.abort); RPCs already running get the grace period.
        w.closed = True
        log.info("%r closed", w)
        await w.channel.close(grace=self.control_timeout_s)

    # ---- health ---------------------------------------------------------------------------------
    def _start_polling(self, w: Worker, first_poll: bool) -> None:
        self._polls[w] = asyncio.create_task(self._poll_forever(w, first_poll), name=f"baton-router-poll-{w.addr}")

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.workers))

    async def _poll_forever(self, w: Worker, first_poll: bool) -> None:
        if first_poll:
            await self._poll(w)
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self._poll(w)

    async def _poll(self, w: Worker) -> None:
        epoch = w.tracker.begin_poll()
        try:
            load = await w.stub.Load(worker_pb2.LoadRequest(), timeout=self.poll_timeout_s)
            # Re-read Info whenever a worker comes (back) into rotation: a restarted node may differ.
            if w.info is None or not w.healthy:
                # A node coming back may have restarted with an empty prefix cache.
                w.prefix_index.clear()
                w.info = await w.stub.Info(worker_pb2.InfoRequest(), timeout=self.poll_timeout_s)
                w.tracker.block_size = w.info.block_size
                w.tracker.step_tokens = w.info.max_num_batched_tokens
        except grpc.aio.AioRpcError as e:
            self._poll_failed(w, e.code(), f"{e.code().name}: {e.details()}")
            return
        # A node started with the wrong role would fail every request sent to it: keep it out.
        if load.role and load.role != self.role.value:
            self.mark_unhealthy(w, f"it reports role {load.role!r}")
            return
        w.failed_polls = w.silent_polls = 0
        w.tracker.end_poll(epoch, LoadSnapshot(load.outstanding_prefill_tokens, load.free_state_slots,
                                               load.free_kv_blocks))
        if not w.healthy:
            log.info("%r is healthy", w)
            w.healthy = True
        if w.unsent_aborts and w not in self._resends:
            task = asyncio.create_task(self._resend_aborts(w), name=f"baton-router-resend-aborts-{w.addr}")
            self._resends[w] = task
            task.add_done_callback(lambda t: self._resends.pop(w) if self._resends.get(w) is t else None)

    def _poll_failed(self, w: Worker, code: grpc.StatusCode, reason: str) -> None:
        w.failed_polls += 1
        w.silent_polls = w.silent_polls + 1 if code == grpc.StatusCode.DEADLINE_EXCEEDED else 0
        if w.silent_polls >= self.unhealthy_after:
            self.stopped_answering(w, f"no answer to {w.silent_polls} Load poll(s) in a row within "
                                      f"{self.poll_timeout_s:g} s")
        elif w.failed_polls >= self.unhealthy_after:
            self.mark_unhealthy(w, f"{reason} ({w.failed_polls} failed Load poll(s) in a row)")
        elif w.healthy:
            log.info("%r: Load poll failed (%d of %d before it leaves rotation): %s", w, w.failed_polls,
                     self.unhealthy_after, reason)

    def mark_unhealthy(self, w: Worker, reason: str) -> None:
        """Takes `w` out of rotation until it answers a poll again."""
        if w.healthy:
            log.warning("%r taken out of rotation: %s", w, reason)
        w.healthy = False

    def stopped_answering(self, w: Worker, reason: str) -> None:
        """Takes `w` out of rotation and cancels the calls of the requests it serves: they are retried elsewhere
        if nothing was streamed yet, else end with UNAVAILABLE (router/flow.py)."""
        self.mark_unhealthy(w, reason)
        n = w.stop_calls(reason)
        if n:
            log.warning("%r stopped answering: %d request(s) there are retried elsewhere or ended", w, n)

    def healthy_count(self) -> int:
        return sum(w.healthy for w in self._workers)

    def pick(self, exclude: Collection[Worker] = ()) -> Worker | None:
        workers = self.workers
        loads = [w.tracker.load(w.healthy) for w in workers]
        i = pick(loads, self._rng, self.role, exclude={j for j, w in enumerate(workers) if w in exclude})
        return None if i is None else workers[i]

    @property
    def affinity(self) -> bool:
        return self.prefix_affinity_weight > 0

    def _block_size(self, w: Worker) -> int:
        bs = w.info.block_size if w.info is not None else 0
        return bs if bs > 0 else self.prefix_block_size

    def _chains(self, workers: Sequence[Worker], token_ids: Sequence[int]) -> list[list[bytes]]:
        """Each worker's block hash chain of `token_ids`: by its own block size and model (computed once per
        distinct pair)."""
        memo: dict[tuple[str, int], list[bytes]] = {}
        out = []
        for w in workers:
            m = w.info.model if w.info is not None else None
            key = (f"{m.model}\0{m.layer_pattern}" if m is not None else "", self._block_size(w))
            if key not in memo:
                memo[key] = block_hashes(token_ids, key[1], chain_seed(key[0]))
            out.append(memo[key])
        return out

    def pick_for(self, token_ids: Sequence[int], exclude: Collection[Worker] = ()) -> Picked | None:
        """`pick`, weighing the prefix of `token_ids` each worker is predicted to hold when affinity is on."""
        if not self.affinity:
            w = self.pick(exclude)
            return None if w is None else Picked(w)
        workers = self.workers
        loads = [w.tracker.load(w.healthy) for w in workers]
        chains = self._chains(workers, token_ids)
        hits = [w.prefix_index.hit_blocks(c) * self._block_size(w) for w, c in zip(workers, chains, strict=True)]
        choice = pick_by_affinity(loads, hits, self._rng, self.role, self.prefix_affinity_weight,
                                  exclude={j for j, w in enumerate(workers) if w in exclude})
        if choice is None:
            return None
        return Picked(workers[choice.index], choice.hit_tokens, choice.by_affinity, tuple(chains[choice.index]))

    @staticmethod
    def record(picked: Picked) -> None:
        """The prompt `picked` was chosen for is sent there to prefill: the worker will hold its full blocks
        (nothing is recorded with affinity off, where `pick_for` hashes nothing)."""
        picked.worker.prefix_index.record(picked.chain)

    def index_blocks(self) -> int:
        """Block hashes held over every worker's prefix index (read at every scrape, from another thread)."""
        return sum(len(w.prefix_index) for w in tuple(self._workers))

    def model_info(self) -> worker_pb2.InfoResponse | None:
        """The Info of a healthy worker, else the last one any worker gave, else None."""
        known = [w for w in self.workers if w.info is not None]
        for w in known:
            if w.healthy:
                return w.info
        return known[0].info if known else None

    async def abort(self, w: Worker, request_id: str) -> bool:
        """Best effort: a worker that does not answer is sent the abort again once it answers a Load poll."""
        if w.closed:
            log.info("abort of %s on %r skipped: it is no longer discovered", request_id, w)
            return False
        try:
            resp = await w.stub.Abort(worker_pb2.WorkerAbortRequest(request_id=request_id),
                                      timeout=self.control_timeout_s)
        except grpc.aio.AioRpcError as e:
            again = e.code() in _UNANSWERED
            if again:
                w.unsent_aborts.add(request_id)
            log.warning("abort of %s on %r failed: %s: %s%s", request_id, w, e.code().name, e.details(),
                        "; sent again once it answers" if again else "")
            return False
        w.unsent_aborts.discard(request_id)
        return resp.found

    async def _resend_aborts(self, w: Worker) -> None:
        """Sends `w` the aborts it did not answer, oldest first, until one fails again (it stopped answering)."""
        for rid in w.unsent_aborts.due():
            found = await self.abort(w, rid)
            if rid in w.unsent_aborts:
                return
            log.info("abort of %s re-sent to %r: %s", rid, w, "it still held the request" if found else "nothing held")
