"""The disaggregation flow of one request: Prefill (retry, then local fallback), then a Decode stream.

Every worker call is bounded (Prefill by `prefill_timeout_s`, every Decode read by
`decode_idle_timeout_s`, both by the client's deadline), so a request always ends with tokens or a status.
A node that stops answering ends its calls sooner: keepalive pings fail them with UNAVAILABLE when its process or
link is gone, and the pool cancels them when it lets its Load polls pass unanswered (`Worker.stop_calls`). Either
way a request that has streamed nothing is retried elsewhere; one that has streamed tokens ends with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from baton.proto.v1 import generation_pb2, worker_pb2
from baton.router import metrics as rm
from baton.router.config import RouterConfig
from baton.router.errors import RequestAborted, RouterError, describe
from baton.router.inflight import InFlight
from baton.router.policy import Role, queued_prefill_tokens
from baton.router.validation import ValidatedRequest
from baton.router.workers import Picked, Worker, WorkerPool

log = logging.getLogger(__name__)

_UNSPECIFIED = generation_pb2.FINISH_REASON_UNSPECIFIED
# A decode worker that fails with these before streaming any token lost nothing the client saw.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@dataclass
class DecodeStream:
    worker: Worker
    call: grpc.aio.UnaryStreamCall
    # The first message that carries tokens or a finish reason.
    first: worker_pb2.DecodeResponse
    # The worker's `stops` when the stream started: a cancelled read with a different count means it stopped
    # answering.
    stops: int = 0


@dataclass(frozen=True)
class Prefilled:
    worker: Worker
    handle: worker_pb2.TransferHandle
    # Prompt tokens 1..N-1 scored by the prefill node (sampling.prompt_logprobs): its N-1 positions are all there are.
    prompt_logprobs: Sequence[generation_pb2.TokenLogprob] = ()


class _Retryable(Exception):
    pass


def _check_aborted(state: InFlight) -> None:
    # Generation.Abort cancels the awaited call: the failure that follows is the abort, not a reason to
    # retry or fall back.
    if state.aborted:
        raise RequestAborted(state.request_id)


def _min_timeout(a: float, b: float | None) -> float:
    return a if b is None else max(0.0, min(a, b))


def _stopped(state: InFlight, worker: Worker, stops: int) -> bool:
    """Whether a worker call that ended in CancelledError was cancelled because `worker` stopped answering
    (rather than by the request's own abort or the cancellation of its task, which must propagate)."""
    task = asyncio.current_task()
    return not state.aborted and not (task is not None and task.cancelling()) and worker.stops != stops


class Flow:
    def __init__(self, config: RouterConfig, prefill: WorkerPool, decode: WorkerPool,
                 metrics: rm.RouterMetrics | None = None) -> None:
        self.config = config
        # Where prefix affinity picks are counted (GenerationService puts its own here).
        self.metrics = metrics if metrics is not None else rm.RouterMetrics()
        self.prefill_pool = prefill
        self.decode_pool = decode
        # Abort RPCs run in the background (they must survive the cancellation of the request's task);
        # keeping references stops them from being garbage-collected mid-flight.
        self._background: set[asyncio.Task[bool]] = set()

    # ---- releasing ------------------------------------------------------------------------------
    def release(self, state: InFlight, worker: Worker) -> asyncio.Task[bool] | None:
        """Aborts `state` on `worker` if it may still hold something of it; returns the Abort task."""
        if worker not in state.live:
            return None
        state.live.discard(worker)
        pool = self.prefill_pool if worker.role is Role.PREFILL else self.decode_pool
        task = asyncio.create_task(pool.abort(worker, state.request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def release_all(self, state: InFlight) -> list[asyncio.Task[bool]]:
        tasks = [self.release(state, w) for w in list(state.live)]
        return [t for t in tasks if t is not None]

    async def drain(self) -> None:
        """Waits for the Abort RPCs still running (each bounded by the control timeout)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # ---- prefill --------------------------------------------------------------------------------
    def route(self, prompt_len: int) -> str:
        """Where a prompt is prefilled (a `router.metrics` decision): conditional disaggregation. Short prompts
        are cheaper to prefill on the decode node (local_prefill); so is every prompt while all healthy prefill
        workers have more than `prefill_queue_limit_tokens` queued, past the steps they have in flight
        (prefill_overflow); no healthy prefill worker: fallback; else disaggregated."""
        if prompt_len == 1 or prompt_len <= self.config.local_prefill_threshold:
            return rm.LOCAL_PREFILL
        loads = [w.tracker.load(True) for w in self.prefill_pool.workers if w.healthy]
        if not loads:
            return rm.FALLBACK
        limit = self.config.prefill_queue_limit_tokens
        if limit and min(queued_prefill_tokens(load) for load in loads) > limit:
            return rm.PREFILL_OVERFLOW
        return rm.DISAGGREGATED

    def _pick(self, pool: WorkerPool, token_ids: Sequence[int], tried: list[Worker]) -> Picked | None:
        picked = pool.pick_for(token_ids, exclude=tried)
        if picked is not None and pool.affinity:
            self.metrics.picked(pool.role.value, picked.hit_tokens, picked.by_affinity)
        return picked

    async def prefill(self, state: InFlight, req: ValidatedRequest,
                      client_timeout: float | None) -> Prefilled | None:
        """A finished prefill (its worker holds the caches under a lease until the decode node pulls them
        or is aborted), or None: the decode node then prefills locally."""
        tried: list[Worker] = []
        for _ in range(2):
            _check_aborted(state)
            # The node computes the first N-1 tokens: those are the blocks its prefix cache gets.
            computed = req.prompt_token_ids[:-1]
            picked = self._pick(self.prefill_pool, computed, tried)
            if picked is None:
                break
            worker = picked.worker
            self.prefill_pool.record(picked)
            state.prefill_retries += bool(tried)
            tried.append(worker)
            started = time.monotonic()
            resp = await self._prefill_on(state, worker, req, client_timeout)
            if resp is not None:
                self.metrics.prefill_seconds.observe(time.monotonic() - started)
                return Prefilled(worker, resp.handle, tuple(resp.prompt_logprobs))
        log.warning("request %s: prefill failed on %s; the decode node prefills locally",
                    state.request_id, tried or "no healthy worker")
        return None

    async def _prefill_on(self, state: InFlight, worker: Worker, req: ValidatedRequest,
                          client_timeout: float | None) -> worker_pb2.PrefillResponse | None:
        rid, n = state.request_id, len(req.prompt_token_ids)
        state.live.add(worker)
        # The node computes N-1 of the N tokens: that is what its outstanding_prefill_tokens will count.
        worker.tracker.add(rid, n - 1)
        # A failed or timed-out prefill may still be computing or holding a lease: `release` frees it.
        msg = worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=req.prompt_token_ids)
        if req.sampling.HasField("prompt_logprobs"):
            msg.prompt_logprobs = req.sampling.prompt_logprobs
        call = worker.stub.Prefill(msg, timeout=_min_timeout(self.config.prefill_timeout_s, client_timeout))
        state.call = call
        stops = worker.stops
        worker.watch(call)
        try:
            resp = await call
        except grpc.aio.AioRpcError as e:
            self.release(state, worker)
            _check_aborted(state)
            log.warning("request %s: prefill failed on %s", rid, describe(worker, e))
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.prefill_pool.mark_unhealthy(worker, e.details() or "UNAVAILABLE")
            return None
        except asyncio.CancelledError:
            if not _stopped(state, worker, stops):
                raise
            self.release(state, worker)
            log.warning("request %s: prefill cancelled on %r: it stopped answering (%s)", rid, worker,
                        worker.stop_reason)
            return None
        finally:
            state.call = None
            worker.tracker.remove(rid)
        # R1: a handle for anything but N-1 tokens would make decode recompute or skip state updates.
        if not resp.HasField("handle") or resp.handle.num_tokens != n - 1:
            log.error("request %s: %r returned a handle for %d tokens, expected %d", rid, worker,
                      resp.handle.num_tokens, n - 1)
            self.release(state, worker)
            return None
        return resp

    # ---- decode ---------------------------------------------------------------------------------
    async def open_decode(self, state: InFlight, req: ValidatedRequest, prefilled: Prefilled | None,
                          client_timeout: float | None) -> DecodeStream:
        """Starts the Decode stream and waits for its first token. A worker that fails before it is
        replaced once; the retry prefills locally, since the failed worker may have consumed part of
        the handle, and the handle's lease is released on the prefill worker."""
        tried: list[Worker] = []
        failure = ""
        handle, prefill_worker = (prefilled.handle, prefilled.worker) if prefilled else (None, None)
        while True:
            _check_aborted(state)
            # Without a handle the decode node prefills the prompt itself: its prefix cache is what counts.
            if handle is None:
                picked = self._pick(self.decode_pool, req.prompt_token_ids, tried)
                worker = picked.worker if picked is not None else None
                if picked is not None:
                    self.decode_pool.record(picked)
            else:
                worker = self.decode_pool.pick(exclude=tried)
            if worker is None:
                if failure:
                    raise RouterError(grpc.StatusCode.UNAVAILABLE,
                                      f"{failure}; no other healthy decode worker to retry on")
                raise RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
            tried.append(worker)
            try:
                return await self._decode_on(state, worker, req, handle, prefill_worker, client_timeout)
            except _Retryable as e:
                if failure:
                    raise RouterError(grpc.StatusCode.UNAVAILABLE,
                                      f"{failure}; the retry failed too: {e}") from None
                failure = str(e)
                log.warning("request %s: %s; retrying on another decode worker", state.request_id, failure)
                state.decode_retries += 1
                if prefill_worker is not None:
                    self.release(state, prefill_worker)
                    state.route = "fallback"
                handle = prefill_worker = None

    async def _decode_on(self, state: InFlight, worker: Worker, req: ValidatedRequest,
                         handle: worker_pb2.TransferHandle | None, prefill_worker: Worker | None,
                         client_timeout: float | None) -> DecodeStream:
        rid = state.request_id
        state.live.add(worker)
        state.tracked.add(worker)
        # With a handle the node computes token N alone; without, the whole prompt.
        n = len(req.prompt_token_ids)
        worker.tracker.add(rid, n, prefill_tokens=1 if handle is not None else n)
        msg = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=req.prompt_token_ids,
                                       sampling=req.sampling, handle=handle)
        if handle is not None:
            # The prefill node scored the prompt (`Prefilled.prompt_logprobs`); the decode node computes token N only.
            msg.sampling.ClearField("prompt_logprobs")
        started = time.monotonic()
        call = worker.stub.Decode(msg, timeout=client_timeout)
        state.call = call
        stops = worker.stops
        worker.watch(call)
        first_message = True
        pulled = handle is not None
        try:
            while True:
                resp = await self._read(worker, call)
                if resp is None:
                    raise RouterError(grpc.StatusCode.INTERNAL,
                                      f"{worker!r} ended the stream before any token or finish reason")
                if first_message and prefill_worker is not None:
                    first_message = False
                    if resp.prefilled_locally:
                        # The pull failed and the node recomputed: the prefill lease is no longer needed.
                        self.release(state, prefill_worker)
                        state.route = "fallback"
                        pulled = False
                    else:
                        state.live.discard(prefill_worker)
                if resp.token_ids or resp.finish_reason != _UNSPECIFIED:
                    worker.tracker.acknowledged(rid)
                    if resp.token_ids:
                        self.metrics.decode_first_seconds.labels(prefill=rm.PULLED if pulled else rm.LOCAL).observe(
                            time.monotonic() - started)
                    return DecodeStream(worker, call, resp, stops)
        except grpc.aio.AioRpcError as e:
            self.release(state, worker)
            _check_aborted(state)
            if e.code() in _RETRYABLE:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self.decode_pool.mark_unhealthy(worker, e.details() or "UNAVAILABLE")
                raise _Retryable(describe(worker, e)) from None
            raise self._translate(worker, e, 0) from None
        except asyncio.CancelledError:
            if not _stopped(state, worker, stops):
                raise
            self.release(state, worker)
            raise _Retryable(f"{worker!r} stopped answering ({worker.stop_reason})") from None
        except RouterError:
            self.release(state, worker)
            raise
        finally:
            state.call = None

    async def next(self, state: InFlight, stream: DecodeStream) -> worker_pb2.DecodeResponse:
        """The next message of a stream that already sent tokens to the client."""
        state.call = stream.call
        try:
            resp = await self._read(stream.worker, stream.call)
        except grpc.aio.AioRpcError as e:
            _check_aborted(state)
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.decode_pool.mark_unhealthy(stream.worker, e.details() or "UNAVAILABLE")
            raise self._translate(stream.worker, e, state.completion_tokens) from None
        except asyncio.CancelledError:
            if not _stopped(state, stream.worker, stream.stops):
                raise
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              f"{stream.worker!r} stopped answering ({stream.worker.stop_reason}) after "
                              f"{state.completion_tokens} tokens were streamed") from None
        finally:
            state.call = None
        if resp is None:
            raise RouterError(grpc.StatusCode.INTERNAL,
                              f"{stream.worker!r} ended the stream without a finish reason")
        return resp

    async def _read(self, worker: Worker, call: grpc.aio.UnaryStreamCall) -> worker_pb2.DecodeResponse | None:
        t = self.config.decode_idle_timeout_s
        try:
            async with asyncio.timeout(t):
                resp = await call.read()
        except TimeoutError:
            call.cancel()
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{worker!r} sent nothing for {t:g} s") from None
        return None if resp is grpc.aio.EOF else resp

    @staticmethod
    def _translate(worker: Worker, e: grpc.aio.AioRpcError, streamed: int) -> RouterError:
        code = e.code()
        if code in _RETRYABLE:
            return RouterError(grpc.StatusCode.UNAVAILABLE,
                               f"{describe(worker, e)} (after {streamed} tokens were streamed)")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return RouterError(code, f"out of capacity: {describe(worker, e)}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RouterError(code, f"deadline exceeded: {describe(worker, e)}")
        return RouterError(code, describe(worker, e))
