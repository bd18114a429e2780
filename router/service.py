"""`baton.v1.Generation` served by the router: validation, the request flow, streaming, abort, health."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from baton.engine.tokenizer import TextTokenizer
from baton.proto.v1 import generation_pb2, generation_pb2_grpc, worker_pb2
from baton.router import metrics as rm
from baton.router.errors import RequestAborted, RouterError
from baton.router.flow import DecodeStream, Flow
from baton.router.inflight import InFlight
from baton.router.validation import ValidatedRequest, validate
from baton.router.workers import WorkerPool

log = logging.getLogger(__name__)

_UNSPECIFIED = generation_pb2.FINISH_REASON_UNSPECIFIED


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, flow: Flow, tokenizer: TextTokenizer | None = None,
                 metrics: rm.RouterMetrics | None = None) -> None:
        self.flow = flow
        self.tokenizer = tokenizer
        self._inflight: dict[str, InFlight] = {}
        # Requests that `finish` ended early (an OpenAI stop string matched): they end as ok, not aborted.
        self._finished: set[str] = set()
        self.metrics = metrics if metrics is not None else rm.RouterMetrics()
        self.metrics.watch_workers("prefill", lambda: self.prefill_pool.healthy_count())
        self.metrics.watch_workers("decode", lambda: self.decode_pool.healthy_count())

    @property
    def prefill_pool(self) -> WorkerPool:
        return self.flow.prefill_pool

    @property
    def decode_pool(self) -> WorkerPool:
        return self.flow.decode_pool

    def _model(self) -> generation_pb2.ModelInfoResponse:
        info = self.decode_pool.model_info()
        if info is None:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no decode worker has reported its model yet")
        return info.model

    # ---- Generate -------------------------------------------------------------------------------
    async def Generate(self, request: generation_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> None:
        started = time.monotonic()
        try:
            req = validate(request, self._model(), self.tokenizer)
        except ValueError as e:
            self.metrics.requests.labels(outcome=rm.INVALID).inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RouterError as e:
            self.metrics.requests.labels(outcome=rm.ERROR).inc()
            await context.abort(e.code, e.message)
        if req.request_id in self._inflight:
            self.metrics.requests.labels(outcome=rm.INVALID).inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_id: {req.request_id!r} is already in flight")
        state = InFlight(req.request_id, len(req.prompt_token_ids))
        self._inflight[req.request_id] = state
        self.metrics.in_flight.inc()
        outcome = rm.ERROR
        try:
            await self._generate(state, req, context, started)
            outcome = rm.OK
        except asyncio.CancelledError:
            # Our own cancel of a worker call (Generation.Abort) surfaces as CancelledError too; only a
            # cancellation of this task (client gone, deadline, shutdown) must propagate.
            task = asyncio.current_task()
            if not state.aborted or (task is not None and task.cancelling()):
                outcome = rm.CANCELLED
                raise
            outcome = await self._end_aborted(state, context)
        except RouterError as e:
            if state.aborted:
                outcome = await self._end_aborted(state, context)
            else:
                log.warning("request %s failed: %s: %s", state.request_id, e.code.name, e.message)
                await context.abort(e.code, e.message)
        except RequestAborted:
            outcome = await self._end_aborted(state, context)
        finally:
            del self._inflight[req.request_id]
            self._finished.discard(req.request_id)
            state.untrack()
            self.flow.release_all(state)
            self._record(state, outcome, started)

    def _record(self, state: InFlight, outcome: str, started: float) -> None:
        m = self.metrics
        m.in_flight.dec()
        m.requests.labels(outcome=outcome).inc()
        if outcome == rm.OK:
            m.e2e.observe(time.monotonic() - started)
        m.prompt_tokens.inc(state.prompt_tokens)
        m.generation_tokens.inc(state.completion_tokens)
        m.spec_drafted.inc(state.num_drafted_tokens)
        m.spec_accepted.inc(state.num_accepted_tokens)
        if state.prefill_retries:
            m.retries.labels(stage="prefill").inc(state.prefill_retries)
        if state.decode_retries:
            m.retries.labels(stage="decode").inc(state.decode_retries)

    async def _generate(self, state: InFlight, req: ValidatedRequest, context: grpc.aio.ServicerContext,
                        started: float) -> None:
        # Checked first: a prefill whose caches no decode worker could pull would only be wasted.
        if self.decode_pool.healthy_count() == 0:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
        prefilled = None
        # (A long prompt with no healthy prefill worker is a fallback too, not a routing choice.)
        state.route = self.flow.route(len(req.prompt_token_ids))
        if state.route == rm.DISAGGREGATED:
            prefilled = await self.flow.prefill(state, req, context.time_remaining())
            state.route = rm.DISAGGREGATED if prefilled is not None else rm.FALLBACK
        stream = await self.flow.open_decode(state, req, prefilled, context.time_remaining())
        # open_decode may have turned a disaggregated request into a fallback (failed pull, decode retry).
        self.metrics.decisions.labels(decision=state.route).inc()
        try:
            await self._stream(state, stream, context, started)
        finally:
            # Ends our side of the stream on every path (a no-op once the worker has closed it).
            stream.call.cancel()

    async def _stream(self, state: InFlight, stream: DecodeStream, context: grpc.aio.ServicerContext,
                      started: float) -> None:
        # Deltas never end inside a multi-byte character; together they equal decode(all output ids).
        detok = self.tokenizer.detokenizer() if self.tokenizer else None
        msg = stream.first
        last_sent: float | None = None
        while True:
            ids = list(msg.token_ids)
            state.completion_tokens += len(ids)
            state.num_drafted_tokens = msg.num_drafted_tokens
            state.num_accepted_tokens = msg.num_accepted_tokens
            final = msg.finish_reason != _UNSPECIFIED
            text = detok.push(ids) if detok else ""
            if final and detok:
                text += detok.flush()
            out = generation_pb2.GenerateResponse(request_id=state.request_id, token_ids=ids, text=text)
            if final:
                out.finish_reason = msg.finish_reason
                self._set_usage(out.usage, state)
                # The stream ended as the worker meant it to: nothing is left to abort there.
                state.live.discard(stream.worker)
            if ids or text or final:
                await context.write(out)
            if ids:
                now = time.monotonic()
                if last_sent is None:
                    self.metrics.ttft.observe(now - started)
                self.metrics.tokens_sent(len(ids), None if last_sent is None else now - last_sent)
                last_sent = now
            if final:
                return
            if state.aborted:
                raise RequestAborted(state.request_id)
            msg = await self.flow.next(state, stream)

    async def _end_aborted(self, state: InFlight, context: grpc.aio.ServicerContext) -> str:
        """The outcome of an aborted request: ok, writing nothing, if `finish` ended it; else aborted."""
        if state.request_id in self._finished:
            return rm.OK
        await self._write_abort(state, context)
        return rm.ABORTED

    async def _write_abort(self, state: InFlight, context: grpc.aio.ServicerContext) -> None:
        out = generation_pb2.GenerateResponse(request_id=state.request_id,
                                              finish_reason=generation_pb2.FINISH_REASON_ABORT)
        self._set_usage(out.usage, state)
        await context.write(out)

    @staticmethod
    def _set_usage(usage: generation_pb2.Usage, state: InFlight) -> None:
        usage.prompt_tokens = state.prompt_tokens
        usage.completion_tokens = state.completion_tokens
        usage.num_drafted_tokens = state.num_drafted_tokens
        usage.num_accepted_tokens = state.num_accepted_tokens

    async def wait_idle(self, timeout: float) -> None:
        """Waits (at most `timeout` s) until every Generate call has run its clean-up."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._inflight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    # ---- Abort, Health, ModelInfo ---------------------------------------------------------------
    async def Abort(self, request: generation_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> generation_pb2.AbortResponse:
        state = self._inflight.get(request.request_id)
        if state is None:
            return generation_pb2.AbortResponse(found=False)
        state.abort()
        # Wait for the workers' answers, so that an Abort that returned means the nodes were told.
        tasks = self.flow.release_all(state)
        if tasks:
            await asyncio.gather(*tasks)
        return generation_pb2.AbortResponse(found=True)

    def finish(self, request_id: str) -> bool:
        """Ends a request early as finished (the HTTP front saw a stop string): its workers are aborted as
        by `Abort`, but it counts as ok and its stream ends without an abort message. Runs on the loop."""
        state = self._inflight.get(request_id)
        if state is None:
            return False
        self._finished.add(request_id)
        state.abort()
        self.flow.release_all(state)
        return True

    async def Health(self, request: generation_pb2.HealthRequest,
                     context: grpc.aio.ServicerContext) -> generation_pb2.HealthResponse:
        return self.health()

    def health(self) -> generation_pb2.HealthResponse:
        """The router can serve while at least one decode worker is healthy (it can prefill locally).
        Only reads ints and bools: the HTTP thread calls it too."""
        decode = self.decode_pool.healthy_count()
        return generation_pb2.HealthResponse(ok=decode > 0, prefill_workers=self.prefill_pool.healthy_count(),
                                             decode_workers=decode)

    def workers(self) -> list[dict]:
        """`/v1/workers`: every configured worker with its role, address, health, metrics URL (None until it has
        answered Info with an HTTP port) and step budget (`max_num_batched_tokens`, None until Info). Read from the
        HTTP thread: objects are only read."""
        out = []
        for pool in (self.prefill_pool, self.decode_pool):
            for w in tuple(pool.workers):
                info = w.info
                host = w.addr.rpartition(":")[0]
                http_port = info.http_port if info is not None else 0
                out.append({"role": w.role.value, "address": w.addr, "healthy": w.healthy,
                            "engine_id": info.engine_id if info is not None else None,
                            "metrics_url": f"http://{host}:{http_port}/metrics" if http_port else None,
                            "max_num_batched_tokens": info.max_num_batched_tokens if info is not None else None})
        return out

    async def ModelInfo(self, request: generation_pb2.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> generation_pb2.ModelInfoResponse:
        info: worker_pb2.InfoResponse | None = self.decode_pool.model_info()
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker has reported its model yet")
        out = generation_pb2.ModelInfoResponse()
        out.CopyFrom(info.model)
        # Text is tokenized here, in the router: that is what decides whether text prompts work.
        out.has_tokenizer = self.tokenizer is not None
        return out
