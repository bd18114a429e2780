"""A pool of workers of one role: channels, stubs, health from periodic `Load` polls, load tracking."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Collection, Sequence

import grpc

from baton.proto.v1 import worker_pb2, worker_pb2_grpc
from baton.router.load_tracker import LoadSnapshot, LoadTracker
from baton.router.policy import Role, pick

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
)


class Worker:
    """One node as seen from the router. Healthy only once it has answered both `Load` and `Info`."""

    def __init__(self, index: int, addr: str, role: Role) -> None:
        self.index = index
        self.addr = addr
        self.role = role
        self.channel = grpc.aio.insecure_channel(addr, options=_CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.tracker = LoadTracker(role)
        self.healthy = False
        self.info: worker_pb2.InfoResponse | None = None

    def __repr__(self) -> str:
        return f"{self.role.value} worker {self.addr}"


class WorkerPool:
    def __init__(self, role: Role, addrs: Sequence[str], *, poll_interval_s: float = 0.5,
                 control_timeout_s: float = 5.0, rng: random.Random | None = None) -> None:
        self.role = role
        self.workers = tuple(Worker(i, a, role) for i, a in enumerate(addrs))
        self.poll_interval_s = poll_interval_s
        self.control_timeout_s = control_timeout_s
        self._rng = rng or random.Random()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Polls every worker once (so the first requests see real health), then keeps polling."""
        await self.poll_once()
        # One loop per worker: a worker that hangs until the control timeout delays only its own polls.
        self._tasks = [asyncio.create_task(self._poll_forever(w), name=f"baton-router-poll-{w.addr}")
                       for w in self.workers]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        await asyncio.gather(*(w.channel.close() for w in self.workers))

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.workers))

    async def _poll_forever(self, w: Worker) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self._poll(w)

    async def _poll(self, w: Worker) -> None:
        epoch = w.tracker.begin_poll()
        try:
            load = await w.stub.Load(worker_pb2.LoadRequest(), timeout=self.control_timeout_s)
            # Re-read Info whenever a worker comes (back) into rotation: a restarted node may differ.
            if w.info is None or not w.healthy:
                w.info = await w.stub.Info(worker_pb2.InfoRequest(), timeout=self.control_timeout_s)
                w.tracker.block_size = w.info.block_size
        except grpc.aio.AioRpcError as e:
            self.mark_unhealthy(w, f"{e.code().name}: {e.details()}")
            return
        # A node started with the wrong role would fail every request sent to it: keep it out.
        if load.role and load.role != self.role.value:
            self.mark_unhealthy(w, f"it reports role {load.role!r}")
            return
        w.tracker.end_poll(epoch, LoadSnapshot(load.outstanding_prefill_tokens, load.free_state_slots,
                                               load.free_kv_blocks))
        if not w.healthy:
            log.info("%r is healthy", w)
            w.healthy = True

    def mark_unhealthy(self, w: Worker, reason: str) -> None:
        """Takes `w` out of rotation until it answers a poll again."""
        if w.healthy:
            log.warning("%r taken out of rotation: %s", w, reason)
        w.healthy = False

    def healthy_count(self) -> int:
        return sum(w.healthy for w in self.workers)

    def pick(self, exclude: Collection[Worker] = ()) -> Worker | None:
        loads = [w.tracker.load(w.healthy) for w in self.workers]
        i = pick(loads, self._rng, self.role, exclude={w.index for w in exclude})
        return None if i is None else self.workers[i]

    def model_info(self) -> worker_pb2.InfoResponse | None:
        """The Info of a healthy worker, else the last one any worker gave, else None."""
        known = [w for w in self.workers if w.info is not None]
        for w in known:
            if w.healthy:
                return w.info
        return known[0].info if known else None

    async def abort(self, w: Worker, request_id: str) -> bool:
        """Best effort: a worker that cannot be reached holds nothing we can free from here."""
        try:
            resp = await w.stub.Abort(worker_pb2.WorkerAbortRequest(request_id=request_id),
                                      timeout=self.control_timeout_s)
        except grpc.aio.AioRpcError as e:
            log.warning("abort of %s on %r failed: %s: %s", request_id, w, e.code().name, e.details())
            return False
        return resp.found
