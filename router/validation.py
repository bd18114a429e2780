"""Checks a GenerateRequest against the served model before any worker sees it (INVALID_ARGUMENT).

Every field is range-checked here, where it enters: what passes fits the model (token ids below its vocabulary,
lengths within its context) and the nodes' message limit (`proto/message_limits.py`). Integers too wide for
their proto field never get this far (`proto/grpc_decode.py`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from baton.engine.tokenizer import TextTokenizer
from baton.proto.convert import sampling_from_proto
from baton.proto.message_limits import WORKER_MAX_MESSAGE_BYTES
from baton.proto.v1 import generation_pb2
from baton.router.stop_strings import check_stops

# Request ids travel to every node and into their logs.
MAX_REQUEST_ID_CHARS = 256
# Bytes a worker message may need beyond its token ids (ids, handle fields, sampling scalars), at most.
_WORKER_MESSAGE_OVERHEAD = 4096
# A uint32 on the wire takes at most this many bytes.
_MAX_VARINT_BYTES = 5
# Entries of a request's logit_bias (each rides in every worker message of the request).
MAX_LOGIT_BIAS = 1024
# Bytes of a request's grammar (a JSON schema, regex or Lark text), which rides in its Decode message.
MAX_GRAMMAR_BYTES = 256 * 1024


@dataclass(frozen=True)
class ValidatedRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    # Forwarded to the decode node as the client sent it: the node applies the same defaults.
    sampling: generation_pb2.SamplingParams
    # Stop strings, matched by the router on the detokenized text.
    stops: tuple[str, ...] = ()


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


def _check_prompt_length(n: int, model: generation_pb2.ModelInfoResponse) -> None:
    if not n:
        raise ValueError("prompt: expected at least one token, got an empty prompt")
    # The model must have room for at least one generated token.
    if model.max_model_len and n >= model.max_model_len:
        raise ValueError(f"prompt: expected fewer than max_model_len={model.max_model_len} tokens, got {n}")


def validate(request: generation_pb2.GenerateRequest, model: generation_pb2.ModelInfoResponse,
             tokenizer: TextTokenizer | None, max_stop_ids: int = 256, max_logprobs: int = 20) -> ValidatedRequest:
    """Raises ValueError naming the field, what was expected and what came. Cheap checks come first, so that a
    huge request is refused before it is walked."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id: expected at most {MAX_REQUEST_ID_CHARS} characters, "
                         f"got {len(request.request_id)}")
    if request.WhichOneof("prompt") == "token_ids":
        _check_prompt_length(len(request.token_ids.ids), model)
    check_stops(request.stop, tokenizer is not None)
    s = request.sampling
    if len(s.stop_token_ids) > max_stop_ids:
        raise ValueError(f"sampling.stop_token_ids: expected at most {max_stop_ids} ids (--max-stop-ids), "
                         f"got {len(s.stop_token_ids)}")
    if model.max_model_len and s.HasField("max_tokens") and s.max_tokens > model.max_model_len:
        raise ValueError(f"sampling.max_tokens: expected at most max_model_len={model.max_model_len}, "
                         f"got {s.max_tokens}")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"sampling.logit_bias: expected at most {MAX_LOGIT_BIAS} entries, got {len(s.logit_bias)}")
    for name in ("logprobs", "prompt_logprobs"):
        if s.HasField(name) and getattr(s, name) > max_logprobs:
            raise ValueError(f"sampling.{name}: expected at most {max_logprobs} alternatives (--max-logprobs), "
                             f"got {getattr(s, name)}")
    if s.HasField("top_k") and s.top_k > model.vocab_size:
        raise ValueError(f"sampling.top_k: expected at most vocab_size={model.vocab_size} (0: off), got {s.top_k}")
    grammar_bytes = 0
    if s.HasField("structured_output"):
        kind = s.structured_output.WhichOneof("kind")
        grammar_bytes = len(getattr(s.structured_output, kind).encode()) if kind not in (None, "json_object") else 0
        if grammar_bytes > MAX_GRAMMAR_BYTES:
            raise ValueError(f"sampling.structured_output.{kind}: expected at most {MAX_GRAMMAR_BYTES} bytes, "
                             f"got {grammar_bytes}")
        if not model.has_tokenizer:
            raise ValueError("sampling.structured_output: expected a model with a tokenizer (grammars are matched "
                             "over its vocabulary), got one without")
    params = sampling_from_proto(s)
    params.validate_for_vocab(model.vocab_size)
    prompt = _prompt_ids(request, tokenizer)
    _check_prompt_length(len(prompt), model)
    # Refused, not cut short: the client would not learn that it asked for more than the context holds.
    if model.max_model_len and s.HasField("max_tokens") and len(prompt) + s.max_tokens > model.max_model_len:
        room = model.max_model_len - len(prompt)
        raise ValueError(f"sampling.max_tokens: expected at most max_model_len - prompt tokens = "
                         f"{model.max_model_len} - {len(prompt)} = {room}, got {s.max_tokens}")
    if max(prompt) >= model.vocab_size:
        bad = [t for t in prompt if t >= model.vocab_size]
        raise ValueError(f"prompt token ids: expected ids in [0, vocab_size={model.vocab_size}), got {bad[:5]}")
    # A Decode message carries the prompt, the stop ids, the logit_bias entries (each no wider than three uint32s)
    # and at most one KV block id per prompt token.
    ids = 2 * len(prompt) + len(s.stop_token_ids) + 3 * len(s.logit_bias)
    if _MAX_VARINT_BYTES * ids + grammar_bytes + _WORKER_MESSAGE_OVERHEAD > WORKER_MAX_MESSAGE_BYTES:
        most = (WORKER_MAX_MESSAGE_BYTES - grammar_bytes - _WORKER_MESSAGE_OVERHEAD) // (2 * _MAX_VARINT_BYTES)
        raise ValueError(f"prompt: expected at most {most} tokens (the nodes' message limit), got {len(prompt)}")
    request_id = request.request_id or uuid.uuid4().hex
    return ValidatedRequest(request_id, prompt, s, tuple(request.stop))
