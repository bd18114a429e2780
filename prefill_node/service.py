"""The prefill node's Worker service: Prefill computes N-1 tokens (never samples) and leases the caches.

R1: for an N-token prompt the engine computes exactly the first N-1 tokens. The decode node then computes
token N from h(N-1); computing all N here would make the decode node advance the recurrent state over
token N a second time.
"""

from __future__ import annotations

import asyncio

import grpc

from baton.engine.engine_thread import EngineThread
from baton.engine.llm_engine import LLMEngine, RequestOutput
from baton.engine.sampling_params import SamplingParams
from baton.node.bridge import OutputStream, in_engine
from baton.node.load import info_response, load_response
from baton.node.transfer_handles import handle_to_proto
from baton.proto.auth import ClusterCredential
from baton.proto.convert import logprobs_to_proto
from baton.proto.v1 import worker_pb2 as wk
from baton.proto.v1 import worker_pb2_grpc as wk_grpc
from baton.transfer.handle import TransferHandle
from baton.transfer.held_transfers import HeldTransfers

ROLE = "prefill"


class PrefillService(wk_grpc.WorkerServicer):
    def __init__(self, thread: EngineThread, held: HeldTransfers, side_channel: tuple[str, int], model: str,
                 has_tokenizer: bool, credential: ClusterCredential | None = None) -> None:
        """`credential`: signs the transfer handles (decode nodes of the cluster refuse unsigned ones)."""
        self.thread = thread
        self.credential = credential
        self.held = held
        self.side_channel = side_channel
        self.model = model
        self.has_tokenizer = has_tokenizer
        # Reported in Info, so that the router can list this node's metrics URL (0: no HTTP endpoints).
        self.http_port = 0
        # Lease bookkeeping (notifications, expiry) runs on the engine thread, which owns the pools.
        thread.step_hooks.append(lambda engine: held.poll())

    async def Prefill(self, request: wk.PrefillRequest, context: grpc.aio.ServicerContext) -> wk.PrefillResponse:
        prompt = list(request.prompt_token_ids)
        rid = request.request_id
        if len(prompt) < 2:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt_token_ids: expected at least 2 tokens for a remote prefill, got {len(prompt)}")
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: expected a non-empty id")
        stream = OutputStream()
        handles: dict[str, TransferHandle] = {}
        scored: dict[str, list] = {}  # rid -> the prompt's logprob messages, when asked
        k = request.prompt_logprobs if request.HasField("prompt_logprobs") else None

        def on_output(out: RequestOutput) -> None:
            # On the engine thread, in the same call that finished the prefill: the caches go straight
            # under a lease, so no cancellation can fall between "finished" and "held" and leak them.
            if out.finish_reason == "prefilled":
                handles[rid] = self.held.hold(rid, out.held_block_ids, out.held_state_slot, len(prompt) - 1)
                if out.prompt_logprobs is not None:
                    scored[rid] = logprobs_to_proto(out.prompt_logprobs)
            stream.push(out)

        def add(engine: LLMEngine) -> None:
            # Leases are taken on this thread too: checked here, the id cannot be leased twice.
            if rid in self.held.leases:
                raise ValueError(f"request_id: expected an id with no lease held, got {rid!r}, whose earlier "
                                 "prefill is still held for a decode node (pulled, aborted or expired frees it)")
            # Computes tokens 0..N-2 (R1); token N-1 stays the successor the MTP drafter reads at N-2 (R8).
            # The N-1 computed positions predict prompt tokens 1..N-1: every prompt logprob there is.
            engine.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=k), request_id=rid,
                               prefill_only=True)
            self.thread.on_output(rid, on_output)

        try:
            await in_engine(self.thread, add)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            async for _ in stream:
                pass
        except asyncio.CancelledError:
            # The router gave up (client cancelled): nothing may stay allocated or leased.
            self.thread.abort(rid)
            self.thread.call(lambda e: self.held.release(rid))
            raise
        handle = handles.get(rid)
        if handle is None:
            await context.abort(grpc.StatusCode.ABORTED, f"prefill of {rid!r} was aborted")
        # Whether this reply reaches the router is not known here (a grpc.aio handler is told neither that its peer
        # left once it has returned nor that the reply was lost): a router that gave up on the request re-sends its
        # Abort once this node answers again (router/unsent_aborts.py), and the lease's expiry bounds the rest.
        return wk.PrefillResponse(handle=handle_to_proto(handle, *self.side_channel, self.credential),
                                  prompt_logprobs=scored.get(rid, []))

    async def Decode(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this is a prefill node; Decode runs on decode nodes")
        yield  # a server-streaming handler is an async generator, as interceptors wrapping it expect

    async def Abort(self, request: wk.WorkerAbortRequest, context) -> wk.WorkerAbortResponse:
        """Abort a prefill in flight, or release the lease of a finished one."""
        rid = request.request_id
        found = await asyncio.wrap_future(self.thread.abort(rid))
        found = found or await in_engine(self.thread, lambda e: self.held.release(rid))
        return wk.WorkerAbortResponse(found=found)

    async def Load(self, request, context) -> wk.LoadResponse:
        return await in_engine(self.thread, lambda e: load_response(e, ROLE, len(self.held.leases)))

    async def Info(self, request, context) -> wk.InfoResponse:
        return await in_engine(self.thread, lambda e: info_response(e, ROLE, self.held.agent.engine_id, self.model,
                                                                    self.has_tokenizer, self.http_port))

