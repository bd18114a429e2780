"""The grammar matchers of the requests with a `structured_output`, and the token masks they give each step.

A matcher follows its request's output list (`catch_up` consumes the tokens appended since it last looked), so
the engine never feeds it token by token. A step's mask at a row's position j is the grammar's state after the
row's outputs and drafts 0..j-1 (a verify row: each draft is consumed, the mask taken, then all of them are rolled
back), so the drafts a verify step accepts satisfy the grammar and its greedy tokens are those of plain decoding.
Masks are computed on the host and need the row's newest output there: rows with a grammar never run with a
token still in flight (`LLMEngine.step`, `ModelRunner.processes`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from .request import PENDING
from .structured_output import StructuredOutput, grammar_text

log = logging.getLogger(__name__)


@dataclass
class _Row:
    matcher: llguidance.LLMatcher
    outputs: Sequence[int]  # the request's output list, read as it grows
    consumed: int = 0


class Grammars:
    """Per request with a grammar: its matcher over the checkpoint's tokenizer vocabulary."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words of one position's bitmask
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))
        self._rows: dict[str, _Row] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def __bool__(self) -> bool:
        return bool(self._rows)

    def add(self, request_id: str, spec: StructuredOutput, outputs: Sequence[int]) -> None:
        matcher = llguidance.LLMatcher(self._tokenizer, grammar_text(spec))
        if matcher.is_error():
            raise ValueError(f"structured_output {spec.kind}: expected a grammar over this tokenizer, got: "
                             f"{matcher.get_error()}")
        self._rows[request_id] = _Row(matcher, outputs)

    def remove(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def catch_up(self, request_id: str) -> bool:
        """Consume the request's new outputs; True when its grammar is complete (nothing but EOS may follow)."""
        row = self._rows[request_id]
        new = list(row.outputs[row.consumed:])
        if PENDING in new:
            raise RuntimeError(f"grammar: {request_id!r} has an output still in flight (a bug)")
        row.consumed += len(new)
        if new and not row.matcher.consume_tokens(new):
            # Only a matcher that failed (e.g. a parser limit hit) lets a refused token through: that request
            # ends here rather than the engine loop.
            log.warning("grammar: %r emitted tokens its grammar refuses (%s): %s; ending it", request_id, new,
                        row.matcher.get_error())
            return True
        return row.matcher.is_stopped() or row.matcher.is_error()

    def masks(self, request_id: str, drafts: Sequence[int], width: int) -> np.ndarray:
        """The allowed tokens at a row's `width` positions, bit t % 32 of word t // 32 ([width, words] int32):
        position j after the row's outputs and drafts 0..j-1. Positions after a draft the grammar refuses are
        never reached (that draft is rejected) and allow everything."""
        self.catch_up(request_id)
        matcher = self._rows[request_id].matcher
        bits = np.full((width, self.words), -1, dtype=np.int32)
        consumed = 0
        for j in range(width):
            fill_next_token_bitmask(matcher, bits, j)
            if j >= len(drafts) or matcher.try_consume_tokens([drafts[j]]) != 1:
                break
            consumed += 1
        if consumed:
            matcher.rollback(consumed)
        return bits
