"""What `Client` and `AsyncClient` share: channel settings, request building, response conversion, retries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from baton.client.errors import BatonError
from baton.client.types import (
    Choice,
    Chunk,
    Completion,
    FinishReason,
    Grammar,
    Health,
    ModelInfo,
    TokenLogprob,
)
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


@dataclass(frozen=True)
class Sampling:
    """A request's sampling options, as `Client.generate` / `stream` take them (the server validates them)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    # Stop strings: the text ends before the first match (needs the router's tokenizer).
    stop: Sequence[str] = ()
    # Choices to generate; each has its own seed, derived from `seed`.
    n: int = 1
    # Logprobs of each generated token with this many top alternatives (None: none); of each prompt token but the
    # first (None: none).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The grammar the output must match (needs the server's tokenizer); the request stops once it is complete.
    structured_output: Grammar | None = None


def generate_request(prompt: Sequence[int] | str, options: Sampling, request_id: str | None) -> pb.GenerateRequest:
    o = options
    sampling = pb.SamplingParams(max_tokens=o.max_tokens, temperature=o.temperature, top_p=o.top_p, top_k=o.top_k,
                                 seed=o.seed, stop_token_ids=list(o.stop_token_ids), ignore_eos=o.ignore_eos,
                                 logit_bias=dict(o.logit_bias))
    d = Sampling()
    # Only what differs from the defaults: an older router refuses a field it does not know, even a neutral one.
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs",
                 "prompt_logprobs"):
        if getattr(o, name) != getattr(d, name):
            setattr(sampling, name, getattr(o, name))
    if (g := o.structured_output) is not None:
        if g.kind == "json_object":
            sampling.structured_output.json_object = True
        else:
            sampling.structured_output.CopyFrom(pb.StructuredOutput(**{g.kind: g.value}))
    # Empty request_id: the router assigns one and sends it back in every response.
    req = pb.GenerateRequest(request_id=request_id or "", sampling=sampling, stop=list(o.stop),
                             n=o.n if o.n != 1 else 0)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def finish_reason(resp: pb.GenerateResponse) -> FinishReason | None:
    return _FINISH_REASONS.get(resp.finish_reason)


def to_logprobs(items: Sequence[pb.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(token_id=t.token_id, logprob=t.logprob,
                              top=tuple((a.token_id, a.logprob) for a in t.top)) for t in items)


def to_chunk(resp: pb.GenerateResponse) -> Chunk:
    return Chunk(request_id=resp.request_id, token_ids=tuple(resp.token_ids), text=resp.text,
                 finish_reason=finish_reason(resp), index=resp.index,
                 logprobs=to_logprobs(resp.logprobs) if resp.logprobs else None,
                 prompt_logprobs=to_logprobs(resp.prompt_logprobs) if resp.prompt_logprobs else None)


class CompletionBuilder:
    """Collects the responses of one Generate stream (n choices, by their index) into a `Completion`."""

    def __init__(self, prompt: Sequence[int] | str, n: int = 1, logprobs: bool = False,
                 prompt_logprobs: bool = False) -> None:
        """`logprobs` / `prompt_logprobs`: whether the request asked for them."""
        self._prompt_ids = None if isinstance(prompt, str) else tuple(prompt)
        self._request_id = ""
        self._n = n
        self._logprobs: list[list[pb.TokenLogprob]] | None = [[] for _ in range(n)] if logprobs else None
        self._prompt_logprobs: list[pb.TokenLogprob] | None = [] if prompt_logprobs else None
        self._token_ids: list[list[int]] = [[] for _ in range(n)]
        self._text: list[list[str]] = [[] for _ in range(n)]
        self._last: list[pb.GenerateResponse | None] = [None] * n

    def add(self, resp: pb.GenerateResponse) -> None:
        i = resp.index
        if i >= self._n:
            raise BatonError("UNKNOWN", f"a response of choice {i}: expected choices 0..{self._n - 1}")
        self._request_id = resp.request_id or self._request_id
        self._token_ids[i].extend(resp.token_ids)
        self._text[i].append(resp.text)
        self._last[i] = resp
        if self._logprobs is not None:
            self._logprobs[i].extend(resp.logprobs)
        if self._prompt_logprobs is not None and i == 0:
            self._prompt_logprobs.extend(resp.prompt_logprobs)

    def build(self) -> Completion:
        choices = []
        for i, last in enumerate(self._last):
            reason = finish_reason(last) if last is not None else None
            if last is None or reason is None:
                # The server closed the stream without a last message: never hand out a truncated answer.
                raise BatonError("UNKNOWN", f"the Generate stream ended without a finish reason for choice {i}")
            choices.append(Choice(index=i, token_ids=tuple(self._token_ids[i]), text="".join(self._text[i]),
                                  finish_reason=reason, completion_tokens=last.usage.completion_tokens,
                                  logprobs=None if self._logprobs is None else to_logprobs(self._logprobs[i])))
        usages = [last.usage for last in self._last if last is not None]
        first = choices[0]
        return Completion(request_id=self._request_id, prompt_token_ids=self._prompt_ids,
                          token_ids=first.token_ids, text=first.text, finish_reason=first.finish_reason,
                          prompt_tokens=usages[0].prompt_tokens,
                          completion_tokens=sum(u.completion_tokens for u in usages),
                          num_drafted_tokens=sum(u.num_drafted_tokens for u in usages),
                          num_accepted_tokens=sum(u.num_accepted_tokens for u in usages), choices=tuple(choices),
                          logprobs=first.logprobs,
                          prompt_logprobs=None if self._prompt_logprobs is None else to_logprobs(self._prompt_logprobs))


def to_health(resp: pb.HealthResponse) -> Health:
    return Health(ok=resp.ok, prefill_workers=resp.prefill_workers, decode_workers=resp.decode_workers)


def to_model_info(resp: pb.ModelInfoResponse) -> ModelInfo:
    return ModelInfo(model=resp.model, vocab_size=resp.vocab_size, max_model_len=resp.max_model_len,
                     has_tokenizer=resp.has_tokenizer, layer_pattern=resp.layer_pattern,
                     eos_token_ids=tuple(resp.eos_token_ids))
