"""The decode node's Worker service: Decode streams a request's tokens.

With a transfer handle the request enters the engine with N-1 computed tokens and the pulled state, so
its first step computes only token N (query length 1, R1) inside whatever mixed batch runs; it is still a
prefill row with an initial state (R2), never a decode row. Without a handle (short prompt, failed
prefill, failed pull) the node prefills locally.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from baton.decode_node.puller import Puller
from baton.engine.engine_thread import EngineThread
from baton.engine.llm_engine import LLMEngine
from baton.node.bridge import OutputStream, in_engine
from baton.node.load import info_response, load_response
from baton.node.transfer_handles import handle_error
from baton.proto.auth import ClusterCredential
from baton.proto.convert import FINISH_TO_PROTO, logprobs_to_proto, sampling_from_proto
from baton.proto.v1 import worker_pb2 as wk
from baton.proto.v1 import worker_pb2_grpc as wk_grpc

ROLE = "decode"


class DecodeService(wk_grpc.WorkerServicer):
    def __init__(self, thread: EngineThread, puller: Puller, engine_id: str, model: str, has_tokenizer: bool,
                 credential: ClusterCredential | None = None) -> None:
        """`credential`: transfer handles must carry its signature (None: handles are taken unchecked)."""
        self.thread = thread
        self.credential = credential
        self.puller = puller
        self.engine_id = engine_id
        self.model = model
        self.has_tokenizer = has_tokenizer
        # Reported in Info, so that the router can list this node's metrics URL (0: no HTTP endpoints).
        self.http_port = 0

    async def Decode(self, request: wk.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[wk.DecodeResponse]:
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: expected a non-empty id")
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        pulled = None
        if request.HasField("handle"):
            h = request.handle
            # Checked before any connection or READ: a handle names remote memory and a remote address.
            if bad := handle_error(h, rid, len(prompt), self.credential):
                await context.abort(*bad)
            pulled = await self.puller.pull(rid, h, prompt)
        stream = OutputStream()

        def add(engine: LLMEngine) -> None:
            if pulled is not None:
                blocks, slot = pulled
                try:
                    engine.add_computed_request(prompt, params, rid, blocks, slot, len(prompt) - 1)
                except ValueError:
                    engine.free_held(blocks, slot)
                    raise
            else:
                engine.add_request(prompt, params, request_id=rid)
            self.thread.on_output(rid, stream.push)

        try:
            await in_engine(self.thread, add)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except asyncio.CancelledError:
            # Calls run in order on the engine thread: this runs after `add` if `add` ran, else instead of it.
            def cleanup(engine: LLMEngine) -> None:
                if rid in engine.scheduler.requests:
                    self.thread.abort(rid)
                elif pulled is not None:
                    engine.free_held(*pulled)

            self.thread.call(cleanup)
            raise
        first, finished = True, False
        try:
            async for out in stream:
                finished = out.finished
                yield wk.DecodeResponse(token_ids=list(out.new_token_ids),
                                        finish_reason=FINISH_TO_PROTO[out.finish_reason],
                                        prompt_tokens=len(prompt), prefilled_locally=first and pulled is None,
                                        num_drafted_tokens=out.num_drafted, num_accepted_tokens=out.num_accepted,
                                        logprobs=logprobs_to_proto(out.logprobs or ()),
                                        prompt_logprobs=logprobs_to_proto(out.prompt_logprobs or ()))
                first = False
        finally:
            if not finished:  # the router cancelled the stream: free everything now
                self.thread.abort(rid)

    async def Prefill(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this is a decode node; Prefill runs on prefill nodes")

    async def Abort(self, request: wk.WorkerAbortRequest, context) -> wk.WorkerAbortResponse:
        return wk.WorkerAbortResponse(found=await asyncio.wrap_future(self.thread.abort(request.request_id)))

    async def Load(self, request, context) -> wk.LoadResponse:
        return await in_engine(self.thread, lambda e: load_response(e, ROLE))

    async def Info(self, request, context) -> wk.InfoResponse:
        return await in_engine(self.thread, lambda e: info_response(e, ROLE, self.engine_id, self.model,
                                                                    self.has_tokenizer, self.http_port))
