"""A node's drain: on SIGTERM it stops admission, lets the work in flight finish, then exits.

While draining, new `Prefill`/`Decode` calls and `Load` polls end with UNAVAILABLE (the router retries them on
another node and takes this one out of rotation after its failed polls) and /health answers 503 (Kubernetes
stops sending); `Abort` and `Info` are still served, so that the router can free what it holds here. Work in
flight is every Prefill or Decode call that was admitted, plus, on a prefill node, every lease held for a decode
node that has not pulled yet (the engine thread and the side channel keep running for them). What is still in
flight when the drain timeout passes ends with UNAVAILABLE and a message saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import grpc

from baton.node.metrics import NodeMetrics

log = logging.getLogger("baton.node")

DEFAULT_DRAIN_TIMEOUT_S = 60.0
# Calls that count as work in flight; `Load` is refused while draining but is no work.
_WORK = frozenset({"Prefill", "Decode"})
_REFUSED = _WORK | {"Load"}
_POLL_S = 0.05
# Once the timeout passed: how long streams get to reach their next message, then cancelled calls to end.
_STREAM_END_S = 0.5
_CANCEL_END_S = 4.0


class NodeDrain:
    def __init__(self, timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S, metrics: NodeMetrics | None = None,
                 held_leases: Callable[[], int] | None = None) -> None:
        """`metrics`: its readiness (/health) goes false when the drain begins; `held_leases` (prefill nodes): the
        leases still waiting for their READ."""
        if not timeout_s >= 0:
            raise ValueError(f"drain timeout: expected seconds >= 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.held_leases = held_leases or (lambda: 0)
        self.draining = False
        # Set when the drain ended with calls in flight: they end with UNAVAILABLE, saying why (`_cut`).
        self.expired = False
        self._why = ""
        self._calls: set[asyncio.Task] = set()
        self.interceptor = _DrainInterceptor(self)

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    def begin(self) -> None:
        self.draining = True
        if self.metrics is not None:
            self.metrics.ready = False

    async def run(self, cut_short: asyncio.Event | None = None) -> bool:
        """Begins the drain and waits until no call is in flight and no lease is held, at most `timeout_s` (or
        until `cut_short` is set); then ends the calls left with UNAVAILABLE. True when everything finished."""
        self.begin()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        log.warning("draining: %d call(s) in flight, %d lease(s) held; up to %g s", self.in_flight,
                    self.held_leases(), self.timeout_s)
        self._why = f"its drain timeout ({self.timeout_s:g} s) passed"
        while (self._calls or self.held_leases()) and loop.time() < deadline:
            if cut_short is not None and cut_short.is_set():
                self._why = "a second signal cut its drain short"
                break
            await asyncio.sleep(_POLL_S)
        calls, held = list(self._calls), self.held_leases()
        if not calls and not held:
            log.warning("drained: nothing left in flight")
            return True
        log.warning("drain ended with %d call(s) in flight and %d lease(s) held: they end now", len(calls), held)
        self.expired = True
        # Streams that are sending end at their next message; calls that wait (a prefill, a stream between
        # tokens) are cancelled. Each sends its status before it ends; bounded, in case one does not end.
        await self._wait_calls(_STREAM_END_S)
        for task in list(self._calls):
            task.cancel()
        await self._wait_calls(_CANCEL_END_S)
        return False

    async def _wait_calls(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self._calls:
                    await asyncio.sleep(_POLL_S)

    def _refusal(self) -> str:
        return "node is draining (shutting down): retry on another node"

    def _cut(self) -> str:
        return f"node shut down before this call finished: {self._why}"

    def gate(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """`handler` wrapped: refused while draining; counted while in flight when it is work."""
        name = method.rsplit("/", 1)[-1]
        if name not in _REFUSED:
            return handler
        counts = name in _WORK
        drain = self

        async def unary(request, context: grpc.aio.ServicerContext):
            if drain.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, drain._refusal())
            if not counts:
                return await handler.unary_unary(request, context)
            with drain._tracked() as task:
                try:
                    return await handler.unary_unary(request, context)
                except asyncio.CancelledError:
                    if not drain.expired:
                        raise
                    task.uncancel()
                    await context.abort(grpc.StatusCode.UNAVAILABLE, drain._cut())

        async def stream(request, context: grpc.aio.ServicerContext):
            if drain.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, drain._refusal())
            with drain._tracked() as task:
                inner = handler.unary_stream(request, context)
                try:
                    async for response in inner:
                        yield response
                        # A stream that is sending ends here, between two messages: a cancellation would land
                        # in gRPC's send instead of in the service.
                        if drain.expired:
                            break
                    else:
                        return
                except asyncio.CancelledError:
                    if not drain.expired:
                        raise
                    task.uncancel()
                # The service's own clean-up frees what the call held.
                await inner.aclose()
                await context.abort(grpc.StatusCode.UNAVAILABLE, drain._cut())

        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                   handler.response_serializer)

    @contextlib.contextmanager
    def _tracked(self):
        task = asyncio.current_task()
        assert task is not None
        self._calls.add(task)
        try:
            yield task
        finally:
            self._calls.discard(task)


class _DrainInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, drain: NodeDrain) -> None:
        self._drain = drain

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        return handler if handler is None else self._drain.gate(handler, details.method)
