"""Logprobs in OpenAI's two shapes, from the `TokenLogprob` messages the service streams.

- chat: `choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}],
  "refusal": null}`;
- completions (the legacy shape): `choices[].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`, where
  `top_logprobs` holds one {token text: logprob} object per token and, with `echo`, the prompt's tokens come first
  (the first with null logprob and alternatives: it has no context).

A token's text is its own decoded text (without a tokenizer "token_id:<id>", as vLLM writes it) and its `bytes` its
own bytes (exact for a byte-level tokenizer, whose token may be part of a character); `text_offset` counts
those texts' characters from the start of the choice's text (the echoed prompt included). A logprob of -inf (a token
the logits processing masked) is not JSON: it is sent as LOGPROB_FLOOR, as OpenAI and vLLM do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from baton.engine.tokenizer import TextTokenizer
from baton.proto.v1 import generation_pb2

LOGPROB_FLOOR = -9999.0


def _finite(v: float) -> float:
    # (NaN fails the comparison too, and is not JSON either.)
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenTexts:
    """Token id -> its text, cached (a stream asks for the same ids again and again)."""

    def __init__(self, tokenizer: TextTokenizer | None) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._tok.decode([token_id]) if self._tok is not None else f"token_id:{token_id}"
            if len(self._cache) < 1 << 16:
                self._cache[token_id] = s
        return s

    def bytes_of(self, token_id: int) -> list[int]:
        table = self._tok.token_bytes if self._tok is not None else None
        if table is not None and 0 <= token_id < len(table):
            return list(table[token_id])
        return list(self(token_id).encode())


def chat_content(items: Sequence[generation_pb2.TokenLogprob], text: TokenTexts) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` entries of these tokens."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        s = text(token_id)
        return {"token": s, "logprob": _finite(logprob), "bytes": text.bytes_of(token_id)}

    return [{**entry(it.token_id, it.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in it.top]}
            for it in items]


@dataclass
class CompletionLogprobs:
    """One choice's legacy logprobs, built in order (the echoed prompt, then the generated tokens); `offset` is
    where the next token's text starts in the choice's text."""

    offset: int = 0

    def entries(self, prompt_first: int | None, items: Sequence[generation_pb2.TokenLogprob],
                text: TokenTexts) -> dict[str, list]:
        """The shape for `items` (preceded by the prompt's first token, which has no logprobs, where
        `prompt_first` is its id), advancing `offset`."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

        def put(token_id: int, logprob: float | None, top: dict[str, float] | None) -> None:
            s = text(token_id)
            out["tokens"].append(s)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(s)

        if prompt_first is not None:
            put(prompt_first, None, None)
        for it in items:
            put(it.token_id, _finite(it.logprob), {text(t.token_id): _finite(t.logprob) for t in it.top})
        return out


def merge(a: dict[str, list], b: dict[str, list]) -> dict[str, list]:
    """Two consecutive runs of the legacy shape as one."""
    return {k: a[k] + b[k] for k in a}
