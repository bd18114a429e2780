"""Typed results of the client: frozen dataclasses, never raw protobuf messages."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]
GrammarKind = Literal["json_object", "json_schema", "regex", "lark"]


@dataclass(frozen=True)
class Grammar:
    """The grammar a request's output must match (`Sampling.structured_output`); build one with `json_object()`,
    `json_schema(schema)`, `regex(pattern)` or `lark(grammar)`. The server checks it (INVALID_ARGUMENT)."""

    kind: GrammarKind
    value: str = ""

    @classmethod
    def json_object(cls) -> Grammar:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Grammar:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        return cls("lark", grammar)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob and its most likely alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Chunk:
    """One streamed message: the new tokens since the previous chunk."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    # None while the request is still generating; set on the last chunk only.
    finish_reason: FinishReason | None
    # The choice these tokens belong to (0..n-1; always 0 for n = 1).
    index: int = 0
    # One per token_ids entry when the request asked for `logprobs` (None where the chunk has none).
    logprobs: tuple[TokenLogprob, ...] | None = None
    # Prompt tokens 1..N-1 (the first has no context) when it asked for `prompt_logprobs`: on the first chunk only.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Choice:
    """One of a request's n choices, collected from its stream."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when asked


@dataclass(frozen=True)
class Completion:
    """A whole request, collected from its stream: choice 0's tokens, text and finish reason (the request's own for
    n = 1), every choice in `choices`, and the usage summed over them."""

    request_id: str
    # The prompt as sent; None for a text prompt (the server tokenizes it).
    prompt_token_ids: tuple[int, ...] | None
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    # MTP speculative decoding: draft tokens verified for this request, and how many of them were accepted
    # (both 0 when the decode node runs without it).
    num_drafted_tokens: int
    num_accepted_tokens: int
    choices: tuple[Choice, ...] = ()
    # Choice 0's logprobs, one per token, when asked.
    logprobs: tuple[TokenLogprob, ...] | None = None
    # Prompt tokens 1..N-1 (the first has no context), when asked.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Health:
    ok: bool
    prefill_workers: int
    decode_workers: int


@dataclass(frozen=True)
class ModelInfo:
    model: str
    vocab_size: int
    max_model_len: int
    has_tokenizer: bool
    layer_pattern: str
    eos_token_ids: tuple[int, ...]
