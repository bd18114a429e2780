"""Blocking client of Baton's `baton.v1.Generation` API."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

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


class Stream(Iterator[Chunk]):
    """The chunks of one Generate call.

    `close()` / `cancel()`, leaving a `with` block or dropping the stream before its end cancels the call,
    and the router then aborts the request. UNAVAILABLE before the first response restarts the call (per
    the client's retry policy); after it, the error is raised, since a restart would repeat tokens.
    """

    def __init__(self, start: Callable[[], Any], retry: RetryPolicy, request_id: str | None) -> None:
        self._start = start
        self._retry = retry
        self._attempt = 0
        self._received = False
        self._finished = False
        self._cancelled = False
        # Known at once when the caller chose it, else from the first response.
        self.request_id = request_id
        self._call = start()

    def __next__(self) -> Chunk:
        resp = self._next_response()
        if resp is None:
            raise StopIteration
        return to_chunk(resp)

    def cancel(self) -> None:
        if not self._finished:
            self._cancelled = self._finished = True
            self._call.cancel()

    close = cancel

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def _next_response(self) -> pb.GenerateResponse | None:
        while not self._finished:
            try:
                resp = next(self._call)
            except StopIteration:
                self._finished = True
                return None
            except grpc.RpcError as e:
                # cancel() from another thread ends the iteration instead of raising CANCELLED.
                if self._cancelled:
                    return None
                if self._received or not self._retry.should_retry(e, self._attempt):
                    self._finished = True
                    raise from_rpc_error(e) from e
                time.sleep(self._retry.delay(self._attempt))
                self._attempt += 1
                self._call = self._start()
                continue
            self._received = True
            self.request_id = resp.request_id or self.request_id
            return resp
        return None


class Client:
    """Blocking client of a Baton router.

    timeout: deadline in seconds of each call (of a whole stream for generate/stream), None for none.
    api_key: sent as `authorization: Bearer <key>` metadata. tls / root_certificates: a TLS channel
    (root certificates imply TLS; without them the system roots are used). retries / backoff: UNAVAILABLE
    is retried `retries` times after backoff * 2**attempt seconds.
    """

    def __init__(self, addr: str, *, timeout: float | None = None, api_key: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, retries: int = 3, backoff: float = 0.1) -> None:
        self._retry = RetryPolicy(retries, backoff)
        creds = channel_credentials(tls, root_certificates)
        options = self._retry.channel_options()
        self._channel = (grpc.insecure_channel(addr, options=options) if creds is None
                         else grpc.secure_channel(addr, creds, options=options))
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._timeout = timeout
        self._metadata = call_metadata(api_key)

    def generate(self, prompt: Sequence[int] | str, *, request_id: str | None = None,
                 **options: Any) -> Completion:
        """Generates for one prompt (token ids or text) and returns the whole completion (its n choices in
        `choices`). Keyword options: the fields of `Sampling` (max_tokens, temperature, top_p, top_k, seed,
        stop_token_ids, ignore_eos, min_p, presence_penalty, frequency_penalty, repetition_penalty, logit_bias,
        min_tokens, stop, n, logprobs, prompt_logprobs, structured_output)."""
        sampling = Sampling(**options)
        builder = CompletionBuilder(prompt, sampling.n, sampling.logprobs is not None,
                                    sampling.prompt_logprobs is not None)
        with self._start(generate_request(prompt, sampling, request_id), request_id) as s:
            while (resp := s._next_response()) is not None:
                builder.add(resp)
        return builder.build()

    def stream(self, prompt: Sequence[int] | str, *, request_id: str | None = None, **options: Any) -> Stream:
        """Starts generating for one prompt; iterate the returned stream for its chunks (each names its choice in
        `index`). Keyword options as for `generate`."""
        return self._start(generate_request(prompt, Sampling(**options), request_id), request_id)

    def _start(self, req: pb.GenerateRequest, request_id: str | None) -> Stream:
        return Stream(lambda: self._stub.Generate(req, timeout=self._timeout, metadata=self._metadata),
                      self._retry, request_id)

    def abort(self, request_id: str) -> bool:
        """Aborts a running request; False when the router does not know it (finished or never seen)."""
        return self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id)).found

    def health(self) -> Health:
        return to_health(self._unary(self._stub.Health, pb.HealthRequest()))

    def model_info(self) -> ModelInfo:
        return to_model_info(self._unary(self._stub.ModelInfo, pb.ModelInfoRequest()))

    def close(self) -> None:
        """Closes the channel; calls still running are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, method: Callable[..., T], request: object) -> T:
        attempt = 0
        while True:
            try:
                return method(request, timeout=self._timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                if not self._retry.should_retry(e, attempt):
                    raise from_rpc_error(e) from e
            time.sleep(self._retry.delay(attempt))
            attempt += 1
