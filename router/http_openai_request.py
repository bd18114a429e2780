"""An OpenAI request body (already decoded by `http_json.py`) as the router's Generate requests.

Every field is type- and range-checked here; a wrong one is a 400 naming it. Ranges the service checks
against the model (vocabulary, context length, sampling) come back from it as INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from baton.proto.convert import sampling_from_proto
from baton.proto.v1 import generation_pb2
from baton.router.http_errors import ApiError, bad, unsupported
from baton.router.http_structured import AutoToolCalls, ToolCalls
from baton.router.stop_strings import MAX_STOP_CHARS, MAX_STOPS
from baton.router.validation import MAX_LOGIT_BIAS

# A float32 field (temperature, top_p) holds at most this.
_FLOAT32_MAX = 3.4028234663852886e38


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_int(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not is_int(v) or not lo <= v <= hi:
        raise bad(name, f"an integer in [{lo}, {hi}]", v)
    return v


def _opt_float(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or abs(v) > _FLOAT32_MAX:
        raise bad(name, "a finite number", v)
    return float(v)


def opt_bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(name, "a boolean", v)
    return v


def sampling(body: dict, chat: bool) -> generation_pb2.SamplingParams:
    """OpenAI's parameters (and vLLM-style extensions: top_k, stop_token_ids, ignore_eos) as the proto's.
    Ranges beyond the proto's types are checked by the service's validation (400 with its message); fields
    Baton does not implement were refused before (`http_fields.py`)."""
    p = generation_pb2.SamplingParams()
    name = max_tokens_field(body, chat)
    max_tokens = _opt_int(body, name, 0, 2**32 - 1) if name is not None else None
    if max_tokens is not None:
        p.max_tokens = max_tokens
    # OpenAI's defaults (temperature 1, top_p 1), not the gRPC API's greedy default.
    t = _opt_float(body, "temperature")
    p.temperature = 1.0 if t is None else t
    top_p = _opt_float(body, "top_p")
    if top_p is not None:
        p.top_p = top_p
    if (top_k := _opt_int(body, "top_k", -1, 2**32 - 1)) is not None and top_k > 0:
        p.top_k = top_k
    if (seed := _opt_int(body, "seed", 0, 2**64 - 1)) is not None:
        p.seed = seed
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(is_int(i) and 0 <= i < 2**32 for i in stop_ids):
            raise bad("stop_token_ids", "a list of token ids", stop_ids)
        p.stop_token_ids.extend(stop_ids)
    p.ignore_eos = opt_bool(body, "ignore_eos")
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if (v := _opt_float(body, name)) is not None:
            setattr(p, name, v)
    if (min_tokens := _opt_int(body, "min_tokens", 0, 2**32 - 1)) is not None:
        p.min_tokens = min_tokens
    p.logit_bias.update(logit_bias(body))
    return p


def logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's logit_bias: token ids as strings (JSON keys) -> biases; ranges are SamplingParams' (`check_sampling`)."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"an object of at most {MAX_LOGIT_BIAS} token ids (as strings) -> biases", v)
    out: dict[int, float] = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.isdigit() and int(k) < 2**32):
            raise bad("logit_bias", "token ids as decimal strings", k)
        if not isinstance(b, int | float) or isinstance(b, bool) or not math.isfinite(b):
            raise bad("logit_bias", "numeric biases in [-100, 100]", b)
        out[int(k)] = float(b)
    return out


def check_sampling(p: generation_pb2.SamplingParams) -> None:
    """400 naming the field of the first sampling value out of range (what SamplingParams refuses)."""
    try:
        sampling_from_proto(p)
    except ValueError as e:
        msg = str(e)
        name = msg.split("'")[1] if msg.startswith("sampling field '") else None
        raise ApiError(400, msg, param=name) from None


def logprobs(body: dict, chat: bool, most: int) -> tuple[int | None, bool]:
    """(the top alternatives per token, None when no logprobs are asked for; echo). Chat: `logprobs` true with
    `top_logprobs` alternatives (0 when absent); completions: `logprobs` is the count (false or null: none) and `echo`
    returns the prompt before the completion (with `logprobs`, the prompt tokens' logprobs too)."""
    if chat:
        on = opt_bool(body, "logprobs")
        top = _opt_int(body, "top_logprobs", 0, most)
        if top and not on:
            raise bad("top_logprobs", "to come with logprobs: true", top)
        return (top or 0) if on else None, False
    v = body.get("logprobs")
    k = None if v is None or v is False else _opt_int(body, "logprobs", 0, most)
    return k, opt_bool(body, "echo")


def choices(body: dict, most: int) -> int:
    """`n`, the choices per prompt (1 when absent); `best_of` is refused beyond 1 by `http_fields`."""
    n = _opt_int(body, "n", 1, 2**32 - 1)
    if n is None:
        return 1
    if n > most:
        raise ApiError(400, f"n: expected at most {most} choices in all (n x prompts, --max-choices), got {n}",
                       param="n", code="too_many_choices")
    return n


def max_tokens_field(body: dict, chat: bool) -> str | None:
    """The field that sets the output length: chat's `max_completion_tokens` wins over `max_tokens`."""
    for name in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        if body.get(name) is not None:
            return name
    return None


def check_room(field: str | None, max_tokens: int, prompt_tokens: int, max_model_len: int) -> None:
    """400 naming `field` when the prompt and the asked-for output do not fit the context (OpenAI and vLLM refuse
    this too; cutting the output short instead would hide that the client asked for more than it can get)."""
    if field is None or not max_model_len or prompt_tokens >= max_model_len:  # (a prompt too long: the service)
        return
    if prompt_tokens + max_tokens > max_model_len:
        raise ApiError(400, f"{field}: expected at most max_model_len - prompt tokens = {max_model_len} - "
                            f"{prompt_tokens} = {max_model_len - prompt_tokens}, got {max_tokens}", param=field,
                       code="context_length_exceeded")


def stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    out = [stop] if isinstance(stop, str) else stop
    if (not isinstance(out, list) or not 0 < len(out) <= MAX_STOPS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in out)):
        raise bad("stop", f"a non-empty string of at most {MAX_STOP_CHARS} characters or a list of 1 to "
                          f"{MAX_STOPS} of them", stop)
    return tuple(out)


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(is_int(i) for i in v)


def prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        return list(prompt)
    raise bad("prompt", "a string, a non-empty list of token ids, or a non-empty list of those", prompt)


def check_ids(ids: list[int]) -> None:
    if not all(0 <= t < 2**32 for t in ids):
        raise bad("prompt", "token ids in [0, 2^32)", [t for t in ids if not 0 <= t < 2**32][:5])


def _content(message: dict, i: int) -> str | None:
    c = message.get("content")
    if c is None or isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise unsupported(f"messages[{i}].content", "a content part other than text")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content", "a string or a list of text parts", c)


def messages(body: dict) -> list[dict]:
    ms = body.get("messages")
    if not isinstance(ms, list) or not ms:
        raise bad("messages", "a non-empty list of messages", ms)
    out = []
    for i, m in enumerate(ms):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", "an object with a string role", m)
        out.append({**m, "content": _content(m, i)})
    return out


def stream_options(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats). The latter (vLLM's extension) puts the usage so far on
    every chunk; as vLLM does, it takes effect only with include_usage."""
    stream = opt_bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not isinstance(options, dict):
        raise bad("stream_options", "an object", options)
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        v = options.get(name)
        if v is not None and not isinstance(v, bool):
            raise bad(f"stream_options.{name}", "a boolean", v)
        flags.append(bool(v))
    return stream, flags[0], flags[0] and flags[1]


def check_model(body: dict, model: str) -> None:
    v = body.get("model")
    if v is None:
        return
    if not isinstance(v, str):
        raise bad("model", "a string", v)
    if v != model:
        raise ApiError(404, f"The model `{v[:200]}` does not exist (this server serves `{model}`).",
                       param="model", code="model_not_found")


@dataclass
class Job:
    """One parsed HTTP request: its Generate calls (one per prompt) and how to answer."""

    id: str
    chat: bool
    model: str
    requests: list[generation_pb2.GenerateRequest]
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    # Chat with tools: a forced call answered as `tool_calls`, or "auto" split into content and calls
    # (`http_structured`).
    tool_calls: ToolCalls | AutoToolCalls | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # Top alternatives per token when the request asked for logprobs, else None (`logprobs`).
    logprobs: int | None = None
    # Completions: the choices' text (and logprobs) start with their prompt's.
    echo: bool = False
    # Streams: every chunk carries the usage so far (`stream_options.continuous_usage_stats`).
    continuous_usage: bool = False
