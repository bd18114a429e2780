"""`baton.v1.Generation` served by the router: validation, the request flow, streaming, abort, health."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from pathlib import PurePath

import grpc

from baton.engine.tokenizer import TextTokenizer
from baton.proto.v1 import generation_pb2, generation_pb2_grpc, worker_pb2
from baton.router import metrics as rm
from baton.router.choices import MAX_CHOICES, ChoiceContext, fan_out
from baton.router.errors import RequestAborted, RouterError, StreamStalled
from baton.router.flow import DecodeStream, Flow
from baton.router.inflight import InFlight
from baton.router.limits import Admission, Caller, caller_of, retry_after_metadata
from baton.router.stop_strings import StopMatcher
from baton.router.validation import ValidatedRequest, validate
from baton.router.worker_ids import ID_REUSE_AFTER_S
from baton.router.workers import WorkerPool

log = logging.getLogger(__name__)

_UNSPECIFIED = generation_pb2.FINISH_REASON_UNSPECIFIED
# Text prompts longer than this are tokenized on a worker thread, off the event loop.
_TOKENIZE_INLINE_CHARS = 4096


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, flow: Flow, tokenizer: TextTokenizer | None = None,
                 metrics: rm.RouterMetrics | None = None, keyed_clients: bool = False,
                 served_model_name: str | None = None) -> None:
        """`keyed_clients`: API keys are configured, so a client is its key (`limits.caller_of`).
        `served_model_name`: the model's name to clients (default: the name of the workers' model directory)."""
        if served_model_name is not None and not served_model_name.strip():
            raise ValueError(f"served_model_name: expected a non-empty name, got {served_model_name!r}")
        self.flow = flow
        self.served_model_name = served_model_name
        self.tokenizer = tokenizer
        self.keyed_clients = keyed_clients
        self.admission = Admission(flow.config.max_inflight_requests, flow.config.max_inflight_per_client)
        # Requests in flight by the id their workers know them by, and by (caller's principal, client's id).
        self._inflight: dict[str, InFlight] = {}
        self._by_caller: dict[tuple[str, str], InFlight] = {}
        # Worker ids of requests that ended -> when (oldest first).
        self._ended_ids: dict[str, float] = {}
        # Requests that a stop string ended early (`_stream`): they end as ok, not aborted.
        self._finished: set[str] = set()
        # Requests of n > 1 choices in flight, by (caller's principal, client's id) -> n (`_choices`).
        self._fans: dict[tuple[str, str], int] = {}
        # Set when the router drains (SIGTERM): new requests are refused and Health says not ok.
        self.draining = False
        self.metrics = metrics if metrics is not None else flow.metrics
        flow.metrics = self.metrics
        self.metrics.watch_workers("prefill", lambda: self.prefill_pool.healthy_count())
        self.metrics.watch_workers("decode", lambda: self.decode_pool.healthy_count())
        self.metrics.watch_prefix_index("prefill", lambda: self.prefill_pool.index_blocks())
        self.metrics.watch_prefix_index("decode", lambda: self.decode_pool.index_blocks())

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
        if request.n > 1:
            await self._choices(request, context)
            return
        started = time.monotonic()
        if self.draining:
            self.metrics.requests.labels(outcome=rm.ERROR).inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "router is draining (shutting down): retry on another router")
        caller = caller_of(context, self.keyed_clients)
        refusal = self.admission.admit(caller.client)
        if refusal is not None:
            self.metrics.requests.labels(outcome=rm.ERROR).inc()
            self.metrics.rejected.labels(reason=refusal.reason).inc()
            if hasattr(context, "set_trailing_metadata"):  # (the OpenAI front's stand-in has none)
                context.set_trailing_metadata(retry_after_metadata())
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message)
        try:
            await self._admitted(request, context, caller, started)
        finally:
            self.admission.release(caller.client)

    async def _choices(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """n > 1: the choices as n Generate calls of their own (`choices.fan_out`), their messages on this stream
        with their `index`; one that fails ends the call with its status and cancels the others."""
        if request.n > MAX_CHOICES:
            self.metrics.requests.labels(outcome=rm.INVALID).inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"n: expected at most {MAX_CHOICES} choices, got {request.n}")
        client_id = request.request_id or uuid.uuid4().hex
        one = generation_pb2.GenerateRequest()
        one.CopyFrom(request)
        one.request_id = client_id
        key = (caller_of(context, self.keyed_clients).principal, client_id)
        if key in self._fans:
            self.metrics.requests.labels(outcome=rm.INVALID).inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {client_id!r} is already in flight")
        self._fans[key] = request.n
        lock = asyncio.Lock()
        try:
            async with asyncio.TaskGroup() as tg:
                for i, r in enumerate(fan_out(one, request.n)):
                    tg.create_task(self.Generate(r, ChoiceContext(context, i, client_id, lock)))
        except BaseExceptionGroup as group:
            # The first failure is the call's (an abort's status, as one request's would be).
            raise group.exceptions[0] from None
        finally:
            del self._fans[key]

    async def _validate(self, request: generation_pb2.GenerateRequest) -> ValidatedRequest:
        model, cfg = self._model(), self.flow.config
        limits = (cfg.max_stop_ids, cfg.max_logprobs)
        if request.WhichOneof("prompt") == "text" and len(request.text) > _TOKENIZE_INLINE_CHARS:
            # Tokenizing a long text takes long enough to stall every other stream on this loop.
            return await asyncio.to_thread(validate, request, model, self.tokenizer, *limits)
        return validate(request, model, self.tokenizer, *limits)

    async def _admitted(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                        caller: Caller, started: float) -> None:
        try:
            req = await self._validate(request)
        except ValueError as e:
            self.metrics.requests.labels(outcome=rm.INVALID).inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RouterError as e:
            self.metrics.requests.labels(outcome=rm.ERROR).inc()
            await context.abort(e.code, e.message)
        key = (caller.principal, req.request_id)
        if key in self._by_caller:
            self.metrics.requests.labels(outcome=rm.INVALID).inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_id: {req.request_id!r} is already in flight")
        # Another caller's request with this id keeps its id on the workers; this one gets a distinct one there,
        # so that neither can reach the other's and the answer tells nothing about it. So does a request whose id
        # a request that just ended had on the workers.
        worker_id = req.request_id
        if worker_id in self._inflight or self._recently_ended(worker_id):
            worker_id = f"{req.request_id}~{uuid.uuid4().hex[:12]}"
            req = dataclasses.replace(req, request_id=worker_id)
        state = InFlight(worker_id, len(req.prompt_token_ids), principal=caller.principal, client_id=key[1])
        self._inflight[worker_id] = state
        self._by_caller[key] = state
        self.metrics.in_flight.inc()
        outcome = rm.ERROR
        # A failure's status is sent once the outcome is counted, so that a scrape after the client saw it counts it.
        failed: tuple[grpc.StatusCode, str] | None = None
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
            outcome, failed = await self._end_aborted(state, context)
        except RouterError as e:
            if state.aborted:
                outcome, failed = await self._end_aborted(state, context)
            else:
                log.warning("request %s failed: %s: %s", state.request_id, e.code.name, e.message)
                failed = (e.code, e.message)
        except RequestAborted:
            outcome, failed = await self._end_aborted(state, context)
        except StreamStalled:
            self._stalled(state, context)
        finally:
            del self._inflight[worker_id]
            del self._by_caller[key]
            self._finished.discard(worker_id)
            state.untrack()
            self._ended_ids.pop(worker_id, None)  # (re-inserted last: the dict stays oldest first)
            self._ended_ids[worker_id] = time.monotonic()
            self.flow.release_all(state)
            self._record(state, outcome, started)
        if failed is not None:
            await context.abort(*failed)

    def _recently_ended(self, worker_id: str) -> bool:
        horizon = time.monotonic() - ID_REUSE_AFTER_S
        for rid, at in list(self._ended_ids.items()):
            if at >= horizon:
                break
            del self._ended_ids[rid]
        return worker_id in self._ended_ids

    async def _write(self, context: grpc.aio.ServicerContext, msg: generation_pb2.GenerateResponse) -> None:
        """`context.write`, bounded: a client that reads nothing for `stream_write_timeout_s` (its flow-control
        window full) loses the request, so that it cannot hold a slot on the nodes for as long as it likes."""
        try:
            async with asyncio.timeout(self.flow.config.stream_write_timeout_s):
                await context.write(msg)
        except TimeoutError:
            raise StreamStalled from None

    def _stalled(self, state: InFlight, context: grpc.aio.ServicerContext) -> None:
        # No abort(): sending the status waits behind the unread messages; the call ends with it when the client
        # reads again, or when its connection or deadline ends, while the request's slots are freed now.
        t = self.flow.config.stream_write_timeout_s
        log.warning("request %s: its client read nothing for %g s; cancelled", state.request_id, t)
        self.metrics.rejected.labels(reason=rm.WRITE_TIMEOUT).inc()
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details(f"the client read nothing for {t:g} s (--stream-write-timeout-s): request cancelled")

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
            await self._stream(state, stream, context, started, req.stops,
                               prefilled.prompt_logprobs if prefilled is not None else ())
        finally:
            # Ends our side of the stream on every path (a no-op once the worker has closed it).
            stream.call.cancel()

    async def _stream(self, state: InFlight, stream: DecodeStream, context: grpc.aio.ServicerContext,
                      started: float, stops: tuple[str, ...] = (),
                      prompt_logprobs: Sequence[generation_pb2.TokenLogprob] = ()) -> None:
        """`prompt_logprobs`: the prefill node's, sent with the first message unless the decode node scored the
        prompt itself (a local prefill after a failed pull)."""
        # Deltas never end inside a multi-byte character; together they equal decode(all output ids).
        detok = self.tokenizer.detokenizer() if self.tokenizer else None
        matcher = StopMatcher(stops) if stops else None
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
            matched = False
            if matcher is not None:
                text, matched = matcher.push(text, final)
            out = generation_pb2.GenerateResponse(request_id=state.client_id, token_ids=ids, text=text,
                                                  logprobs=msg.logprobs)
            if msg is stream.first:
                out.prompt_logprobs.extend(msg.prompt_logprobs or prompt_logprobs)
            if matched:
                out.finish_reason = generation_pb2.FINISH_REASON_STOP
                self._set_usage(out.usage, state)
            elif final:
                out.finish_reason = msg.finish_reason
                self._set_usage(out.usage, state)
                # The stream ended as the worker meant it to: nothing is left to abort there.
                state.live.discard(stream.worker)
            if ids or text or final:
                await self._write(context, out)
            if ids:
                now = time.monotonic()
                if last_sent is None:
                    self.metrics.ttft.observe(now - started)
                self.metrics.tokens_sent(len(ids), None if last_sent is None else now - last_sent)
                last_sent = now
            if matched:
                # A stop string ended it: the workers stop generating, and it counts as finished.
                self._finished.add(state.request_id)
                state.abort()
                self.flow.release_all(state)
                return
            if final:
                return
            if state.aborted:
                raise RequestAborted(state.request_id)
            msg = await self.flow.next(state, stream)

    async def _end_aborted(self, state: InFlight, context: grpc.aio.ServicerContext,
                           ) -> tuple[str, tuple[grpc.StatusCode, str] | None]:
        """The outcome of an aborted request, and the status to end its call with: ok, writing nothing, if a stop
        string ended it; an error with the status `end_all` gave it; else aborted, its abort message written."""
        if state.request_id in self._finished:
            return rm.OK, None
        if state.end_status is not None:
            return rm.ERROR, state.end_status
        await self._write_abort(state, context)
        return rm.ABORTED, None

    async def _write_abort(self, state: InFlight, context: grpc.aio.ServicerContext) -> None:
        out = generation_pb2.GenerateResponse(request_id=state.client_id,
                                              finish_reason=generation_pb2.FINISH_REASON_ABORT)
        self._set_usage(out.usage, state)
        try:
            await self._write(context, out)
        except StreamStalled:
            self._stalled(state, context)

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
        # Only the caller's own requests: another's id is answered exactly as an unknown one.
        caller = caller_of(context, self.keyed_clients)
        rid = request.request_id
        # A request of n choices is its choices' requests ("<id>", "<id>/1", ...), those still in flight.
        n = self._fans.get((caller.principal, rid), 1)
        states = [s for i in range(n) if (s := self._by_caller.get((caller.principal, f"{rid}/{i}" if i else rid)))]
        if not states:
            return generation_pb2.AbortResponse(found=False)
        tasks = []
        for state in states:
            state.abort()
            tasks += self.flow.release_all(state)
        # Wait for the workers' answers, so that an Abort that returned means the nodes were told.
        if tasks:
            await asyncio.gather(*tasks)
        return generation_pb2.AbortResponse(found=True)

    def end_all(self, code: grpc.StatusCode, message: str) -> int:
        """Ends every request in flight with `code` and `message` (aborted on its workers); returns how many."""
        states = list(self._inflight.values())
        for state in states:
            state.end(code, message)
        return len(states)

    async def Health(self, request: generation_pb2.HealthRequest,
                     context: grpc.aio.ServicerContext) -> generation_pb2.HealthResponse:
        return self.health()

    def health(self) -> generation_pb2.HealthResponse:
        """The router can serve while at least one decode worker is healthy (it can prefill locally).
        Only reads ints and bools: the HTTP thread calls it too."""
        decode = self.decode_pool.healthy_count()
        return generation_pb2.HealthResponse(ok=decode > 0 and not self.draining,
                                             prefill_workers=self.prefill_pool.healthy_count(), decode_workers=decode)

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

    def model_name(self) -> str | None:
        """The model's name to clients (None until a decode worker has reported its model). Never the workers'
        directory path: that tells clients about the servers' file systems."""
        if self.served_model_name:
            return self.served_model_name
        info = self.decode_pool.model_info()
        if info is None:
            return None
        return PurePath(info.model.model.rstrip("/")).name or "model"

    async def ModelInfo(self, request: generation_pb2.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> generation_pb2.ModelInfoResponse:
        info: worker_pb2.InfoResponse | None = self.decode_pool.model_info()
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker has reported its model yet")
        out = generation_pb2.ModelInfoResponse()
        out.CopyFrom(info.model)
        out.model = self.model_name()
        # Text is tokenized here, in the router: that is what decides whether text prompts work.
        out.has_tokenizer = self.tokenizer is not None
        return out
