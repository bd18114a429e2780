"""What `Client` and `AsyncClient` share: channel settings, request building, response conversion, retries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from baton.client.errors import BatonError
from baton.client.types import Chunk, Completion, FinishReason, Health, ModelInfo
from baton.proto.v1 import generation_pb2 as pb

_FINISH_REASONS: dict[int, FinishReason] = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class RetryPolicy:
    """Retry UNAVAILABLE (router restarting, no worker up yet) `retries` times, waiting backoff * 2**attempt."""

    retries: int
    backoff: float

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.backoff < 0:
            raise ValueError(f"backoff must be >= 0, got {self.backoff}")

    def should_retry(self, e: grpc.RpcError, attempt: int) -> bool:
        return attempt < self.retries and hasattr(e, "code") and e.code() == grpc.StatusCode.UNAVAILABLE

    def delay(self, attempt: int) -> float:
        return self.backoff * 2**attempt

    def channel_options(self) -> list[tuple[str, int]]:
        # A channel that failed to connect waits out its own reconnect backoff (1 s, growing to 120 s) and
        # fails every call at once meanwhile, so our retries would all be spent before it tries again.
        # Reconnecting on our schedule lets a retry reach a router that has just come back.
        first = max(1, round(self.backoff * 1000))
        return [("grpc.initial_reconnect_backoff_ms", first),
                ("grpc.max_reconnect_backoff_ms", max(first, round(self.delay(self.retries) * 1000)))]


def channel_credentials(tls: bool, root_certificates: bytes | None) -> grpc.ChannelCredentials | None:
    """TLS credentials, or None for a plaintext channel. Root certificates imply TLS."""
    if not tls and root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


def call_metadata(api_key: str | None) -> Metadata:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def generate_request(prompt: Sequence[int] | str, *, max_tokens: int, temperature: float, top_p: float, top_k: int,
                     seed: int | None, stop_token_ids: Sequence[int], ignore_eos: bool,
                     request_id: str | None) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                 seed=seed, stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    # Empty request_id: the router assigns one and sends it back in every response.
    req = pb.GenerateRequest(request_id=request_id or "", sampling=sampling)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def finish_reason(resp: pb.GenerateResponse) -> FinishReason | None:
    return _FINISH_REASONS.get(resp.finish_reason)


def to_chunk(resp: pb.GenerateResponse) -> Chunk:
    return Chunk(request_id=resp.request_id, token_ids=tuple(resp.token_ids), text=resp.text,
                 finish_reason=finish_reason(resp))


class CompletionBuilder:
    """Collects the responses of one Generate stream into a `Completion`."""

    def __init__(self, prompt: Sequence[int] | str) -> None:
        self._prompt_ids = None if isinstance(prompt, str) else tuple(prompt)
        self._request_id = ""
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._last: pb.GenerateResponse | None = None

    def add(self, resp: pb.GenerateResponse) -> None:
        self._request_id = resp.request_id or self._request_id
        self._token_ids.extend(resp.token_ids)
        self._text.append(resp.text)
        self._last = resp

    def build(self) -> Completion:
        reason = finish_reason(self._last) if self._last is not None else None
        if reason is None:
            # The server closed the stream without a last message: never hand out a truncated answer.
            raise BatonError("UNKNOWN", "the Generate stream ended without a finish reason")
        usage = self._last.usage
        return Completion(request_id=self._request_id, prompt_token_ids=self._prompt_ids,
                          token_ids=tuple(self._token_ids), text="".join(self._text), finish_reason=reason,
                          prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                          num_drafted_tokens=usage.num_drafted_tokens, num_accepted_tokens=usage.num_accepted_tokens)


def to_health(resp: pb.HealthResponse) -> Health:
    return Health(ok=resp.ok, prefill_workers=resp.prefill_workers, decode_workers=resp.decode_workers)


def to_model_info(resp: pb.ModelInfoResponse) -> ModelInfo:
    return ModelInfo(model=resp.model, vocab_size=resp.vocab_size, max_model_len=resp.max_model_len,
                     has_tokenizer=resp.has_tokenizer, layer_pattern=resp.layer_pattern,
                     eos_token_ids=tuple(resp.eos_token_ids))
