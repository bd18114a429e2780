"""asyncio client of Baton's `baton.v1.Generation` API (grpc.aio); the same surface as `Client`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from baton.client._common import (
    CompletionBuilder,
    RetryPolicy,
    Sampling,
    call_metadata,
    channel_credentials,
    generate_request,
    to_chunk,
    to_health,
    to_model_info,
)
from baton.client.errors import from_rpc_error
from baton.client.types import Chunk, Completion, Health, ModelInfo
from baton.proto.v1 import generation_pb2 as pb
from baton.proto.v1 import generation_pb2_grpc

T = TypeVar("T")


class AsyncStream(AsyncIterator[Chunk]):
    """The chunks of one Generate call (see `baton.client.client.Stream`; the same rules, awaited)."""

    def __init__(self, start: Callable[[], Any], retry: RetryPolicy, request_id: str | None) -> None:
        self._start = start
        self._retry = retry
        self._attempt = 0
        self._received = False
        self._finished = False
        self._cancelled = False
        self.request_id = request_id
        self._call = start()

    async def __anext__(self) -> Chunk:
        resp = await self._next_response()
        if resp is None:
            raise StopAsyncIteration
        return to_chunk(resp)

    def cancel(self) -> None:
        if not self._finished:
            self._cancelled = self._finished = True
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()

    async def _next_response(self) -> pb.GenerateResponse | None:
        while not self._finished:
            try:
                resp = await self._call.read()
            except asyncio.CancelledError:
                # cancel() from another task ends the iteration; a cancellation of this task propagates.
                current = asyncio.current_task()
                if self._cancelled and not (current is not None and current.cancelling()):
                    return None
                raise
            except grpc.RpcError as e:
                if self._cancelled:
                    return None
                if self._received or not self._retry.should_retry(e, self._attempt):
                    self._finished = True
                    raise from_rpc_error(e) from e
                await asyncio.sleep(self._retry.delay(self._attempt))
                self._attempt += 1
                self._call = self._start()
                continue
            if resp is grpc.aio.EOF:
                self._finished = True
                return None
            self._received = True
            self.request_id = resp.request_id or self.request_id
            return resp
        return None


class AsyncClient:
    """asyncio client of a Baton router; arguments as for `baton.client.Client`.

    Create it inside the event loop that uses it (grpc.aio channels belong to one loop).
    """

    def __init__(self, addr: str, *, timeout: float | None = None, api_key: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, retries: int = 3, backoff: float = 0.1) -> None:
        self._retry = RetryPolicy(retries, backoff)
        creds = channel_credentials(tls, root_certificates)
        options = self._retry.channel_options()
        self._channel = (grpc.aio.insecure_channel(addr, options=options) if creds is None
                         else grpc.aio.secure_channel(addr, creds, options=options))
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._timeout = timeout
        self._metadata = call_metadata(api_key)

    async def generate(self, prompt: Sequence[int] | str, *, request_id: str | None = None,
                 **options: Any) -> Completion:
        """Generates for one prompt (token ids or text) and returns the whole completion (its n choices in
        `choices`). Keyword options: the fields of `Sampling` (max_tokens, temperature, top_p, top_k, seed,
        stop_token_ids, ignore_eos, min_p, presence_penalty, frequency_penalty, repetition_penalty, logit_bias,
        min_tokens, stop, n, logprobs, prompt_logprobs, structured_output)."""
        sampling = Sampling(**options)
        builder = CompletionBuilder(prompt, sampling.n, sampling.logprobs is not None,
                                    sampling.prompt_logprobs is not None)
        async with self._start(generate_request(prompt, sampling, request_id), request_id) as s:
            while (resp := await s._next_response()) is not None:
                builder.add(resp)
        return builder.build()

    def stream(self, prompt: Sequence[int] | str, *, request_id: str | None = None, **options: Any) -> AsyncStream:
        """Starts generating for one prompt; iterate the returned stream for its chunks (each names its choice in
        `index`). Keyword options as for `generate`."""
        return self._start(generate_request(prompt, Sampling(**options), request_id), request_id)

    def _start(self, req: pb.GenerateRequest, request_id: str | None) -> AsyncStream:
        return AsyncStream(lambda: self._stub.Generate(req, timeout=self._timeout, metadata=self._metadata),
                      self._retry, request_id)

    async def abort(self, request_id: str) -> bool:
        """Aborts a running request; False when the router does not know it (finished or never seen)."""
        return (await self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id))).found

    async def health(self) -> Health:
        return to_health(await self._unary(self._stub.Health, pb.HealthRequest()))

    async def model_info(self) -> ModelInfo:
        return to_model_info(await self._unary(self._stub.ModelInfo, pb.ModelInfoRequest()))

    async def close(self) -> None:
        """Closes the channel; calls still running are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _unary(self, method: Callable[..., Awaitable[T]], request: object) -> T:
        attempt = 0
        while True:
            try:
                return await method(request, timeout=self._timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                if not self._retry.should_retry(e, attempt):
                    raise from_rpc_error(e) from e
            await asyncio.sleep(self._retry.delay(attempt))
            attempt += 1
