"""`baton.v1.Generation` served by the router: validation, the request flow, streaming, abort, health."""

from __future__ import annotations

import asyncio
import logging

import grpc

from baton.engine.tokenizer import TextTokenizer
from baton.proto.v1 import generation_pb2, generation_pb2_grpc, worker_pb2
from baton.router.errors import RequestAborted, RouterError
from baton.router.flow import DecodeStream, Flow
from baton.router.inflight import InFlight
from baton.router.validation import ValidatedRequest, validate
from baton.router.workers import WorkerPool

log = logging.getLogger(__name__)

_UNSPECIFIED = generation_pb2.FINISH_REASON_UNSPECIFIED


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, flow: Flow, tokenizer: TextTokenizer | None = None) -> None:
        self.flow = flow
        self.tokenizer = tokenizer
        self._inflight: dict[str, InFlight] = {}

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
        try:
            req = validate(request, self._model(), self.tokenizer)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RouterError as e:
            await context.abort(e.code, e.message)
        if req.request_id in self._inflight:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_id: {req.request_id!r} is already in flight")
        state = InFlight(req.request_id, len(req.prompt_token_ids))
        self._inflight[req.request_id] = state
        try:
            await self._generate(state, req, context)
        except asyncio.CancelledError:
            # Our own cancel of a worker call (Generation.Abort) surfaces as CancelledError too; only a
            # cancellation of this task (client gone, deadline, shutdown) must propagate.
            task = asyncio.current_task()
            if not state.aborted or (task is not None and task.cancelling()):
                raise
            await self._write_abort(state, context)
        except RouterError as e:
            if state.aborted:
                await self._write_abort(state, context)
            else:
                log.warning("request %s failed: %s: %s", state.request_id, e.code.name, e.message)
                await context.abort(e.code, e.message)
        except RequestAborted:
            await self._write_abort(state, context)
        finally:
            del self._inflight[req.request_id]
            state.untrack()
            self.flow.release_all(state)

    async def _generate(self, state: InFlight, req: ValidatedRequest, context: grpc.aio.ServicerContext) -> None:
        # Checked first: a prefill whose caches no decode worker could pull would only be wasted.
        if self.decode_pool.healthy_count() == 0:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
        prefilled = None
        if self.flow.wants_prefill(len(req.prompt_token_ids)):
            prefilled = await self.flow.prefill(state, req, context.time_remaining())
        stream = await self.flow.open_decode(state, req, prefilled, context.time_remaining())
        try:
            await self._stream(state, stream, context)
        finally:
            # Ends our side of the stream on every path (a no-op once the worker has closed it).
            stream.call.cancel()

    async def _stream(self, state: InFlight, stream: DecodeStream, context: grpc.aio.ServicerContext) -> None:
        # Deltas never end inside a multi-byte character; together they equal decode(all output ids).
        detok = self.tokenizer.detokenizer() if self.tokenizer else None
        msg = stream.first
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
            if final:
                return
            if state.aborted:
                raise RequestAborted(state.request_id)
            msg = await self.flow.next(state, stream)

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

    async def Health(self, request: generation_pb2.HealthRequest,
                     context: grpc.aio.ServicerContext) -> generation_pb2.HealthResponse:
        decode = self.decode_pool.healthy_count()
        return generation_pb2.HealthResponse(ok=decode > 0, prefill_workers=self.prefill_pool.healthy_count(),
                                             decode_workers=decode)

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
