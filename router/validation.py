"""Checks a GenerateRequest against the served model before any worker sees it (INVALID_ARGUMENT)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from baton.engine.tokenizer import TextTokenizer
from baton.proto.convert import sampling_from_proto
from baton.proto.v1 import generation_pb2


@dataclass(frozen=True)
class ValidatedRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    # Forwarded to the decode node as the client sent it: the node applies the same defaults.
    sampling: generation_pb2.SamplingParams


def _prompt_ids(request: generation_pb2.GenerateRequest, tokenizer: TextTokenizer | None) -> tuple[int, ...]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise ValueError("prompt: expected token_ids or text, got neither")
    if kind == "token_ids":
        return tuple(request.token_ids.ids)
    if tokenizer is None:
        raise ValueError("prompt.text: this router has no tokenizer (start it with --tokenizer PATH); "
                         "send token_ids instead")
    # No BOS is added, as in `TextTokenizer.encode`: send token_ids for a prompt that needs one.
    return tuple(tokenizer.encode(request.text))


def validate(request: generation_pb2.GenerateRequest, model: generation_pb2.ModelInfoResponse,
             tokenizer: TextTokenizer | None) -> ValidatedRequest:
    """Raises ValueError naming the field, what was expected and what came."""
    prompt = _prompt_ids(request, tokenizer)
    if not prompt:
        raise ValueError("prompt: expected at least one token, got an empty prompt")
    bad = [t for t in prompt if t >= model.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids: expected ids in [0, vocab_size={model.vocab_size}), got {bad[:5]}")
    # The model must have room for at least one generated token.
    if model.max_model_len and len(prompt) >= model.max_model_len:
        raise ValueError(f"prompt: expected fewer than max_model_len={model.max_model_len} tokens, "
                         f"got {len(prompt)}")
    params = sampling_from_proto(request.sampling)
    params.validate_for_vocab(model.vocab_size)
    request_id = request.request_id or uuid.uuid4().hex
    return ValidatedRequest(request_id, prompt, request.sampling)
