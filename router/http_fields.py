"""Which body fields the OpenAI front implements, per path; every other field is refused (400 naming it), never
ignored: a client that asks for something Baton does not do learns it at once instead of getting another answer.

- `IMPLEMENTED`: parsed and honoured (`http_openai_request.py`), including Baton's documented extensions, as vLLM
  names them (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`,
  `return_token_ids`).
- `NEUTRAL_ONLY`: not implemented, but accepted with null or a value that asks for nothing (`best_of: 1`,
  `suffix: ""`, `functions: []`, ...): clients and frameworks send those by default. Any other value is refused with
  code "unsupported_parameter".
- Any other field (OpenAI's or not) is refused with code "unknown_parameter", as OpenAI does.

`tests/test_openai_fields.py` walks the `openai` client's parameter lists and checks each is one or the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from baton.router.http_errors import ApiError

COMPLETIONS, CHAT = "completions", "chat"

_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
                     "n", "presence_penalty", "frequency_penalty", "logit_bias",
                     "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
                     "return_token_ids", "response_format"})
IMPLEMENTED = {
    COMPLETIONS: _COMMON | {"prompt", "logprobs", "echo"},
    CHAT: _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                     "parallel_tool_calls"},
}
# Keys of `stream_options` the front implements.
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})


@dataclass(frozen=True)
class Neutral:
    """Values of a field that ask for nothing Baton would have to do (null always counts)."""

    values: tuple[Any, ...]
    paths: frozenset[str] = frozenset({COMPLETIONS, CHAT})

    def accepts(self, v: Any) -> bool:
        return v is None or any(_same(v, n) for n in self.values)


_CHAT, _COMPLETIONS = frozenset({CHAT}), frozenset({COMPLETIONS})
NEUTRAL_ONLY = {
    # Ranking best_of candidates by log probability is not implemented: n choices are all returned.
    "best_of": Neutral((1,), _COMPLETIONS),
    "suffix": Neutral(("",), _COMPLETIONS),
    "user": Neutral(()),
    "functions": Neutral(([],), _CHAT),
    "function_call": Neutral(("none",), _CHAT),
    "modalities": Neutral((["text"],), _CHAT),
    "audio": Neutral((), _CHAT),
    "prediction": Neutral((), _CHAT),
    "reasoning_effort": Neutral((), _CHAT),
    "verbosity": Neutral((), _CHAT),
    "web_search_options": Neutral((), _CHAT),
    # Nothing is stored, moderated or cached by a client-chosen key: only the values asking for none pass.
    "store": Neutral((False,), _CHAT),
    "metadata": Neutral(({},), _CHAT),
    "service_tier": Neutral(("auto", "default"), _CHAT),
    "safety_identifier": Neutral((), _CHAT),
    "prompt_cache_key": Neutral((), _CHAT),
    "prompt_cache_retention": Neutral((), _CHAT),
    "prompt_cache_options": Neutral((), _CHAT),
    "moderation": Neutral((), _CHAT),
}


def _same(v: Any, n: Any) -> bool:
    """`v == n`, but a boolean equals only a boolean (JSON's `false` is not `0`) and 1 equals 1.0."""
    if isinstance(v, bool) or isinstance(n, bool):
        return type(v) is type(n) and v == n
    if isinstance(n, int | float):
        return isinstance(v, int | float) and v == n
    return type(v) is type(n) and v == n


def _shown(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 200 else s[:200] + "..."


def _key(name: str) -> str:
    """A client's key as an error's param: cut short, and never empty (`""` names the empty key)."""
    return (name if len(name) <= 64 else name[:64] + "...") or '""'


def _expected(neutral: Neutral) -> str:
    return " or ".join([*(repr(n) for n in neutral.values), "null"])


def check_fields(body: dict, path: str) -> None:
    """Raises ApiError 400 naming the first field of `body` that `path` ("completions" or "chat") neither
    implements nor sees with a neutral value."""
    for name, v in body.items():
        if name in IMPLEMENTED[path]:
            continue
        neutral = NEUTRAL_ONLY.get(name)
        shown = _key(name)
        if neutral is None or path not in neutral.paths:
            raise ApiError(400, f"{shown}: unrecognized request argument (this server implements "
                                f"{', '.join(sorted(IMPLEMENTED[path]))})", param=shown, code="unknown_parameter")
        if not neutral.accepts(v):
            raise ApiError(400, f"{shown}: not implemented by this server: expected {_expected(neutral)}, "
                                f"got {_shown(v)}", param=shown, code="unsupported_parameter")
    options = body.get("stream_options")
    if isinstance(options, dict):
        for key in options:
            if key not in STREAM_OPTIONS:
                name = f"stream_options.{_key(key)}"
                raise ApiError(400, f"{name}: unrecognized stream option (this server implements "
                                    f"{', '.join(sorted(STREAM_OPTIONS))})", param=name, code="unknown_parameter")
