"""Per-request sampling parameters.

Validated once, at construction, so the sampler's hot path never has to check them. Bad values fail
with a `ValueError` naming the field, what we expected and what we got.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Seeds are fed to `torch.Generator.manual_seed`, which takes a 64-bit value; keeping them below 2**63
# means they also round-trip through signed int64 (JSON clients, numpy) unchanged.
SEED_LIMIT = 2**63


def _bad(field_name: str, expected: str, got: Any) -> ValueError:
    return ValueError(f"sampling field '{field_name}': expected {expected}, got {got!r}")


def _is_int(v: Any) -> bool:
    # bool is a subclass of int, but `max_tokens=True` is a bug, not a request for one token.
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token of one request. `temperature == 0` means greedy (argmax)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    seed: int | None = None  # None = fresh entropy per request
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens, on top of EOS
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _bad("max_tokens", "an integer >= 1", self.max_tokens)
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise _bad("temperature", "a finite float >= 0", self.temperature)
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:  # also rejects NaN
            raise _bad("top_p", "a float in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise _bad("top_k", "an integer >= 0 (0 = off)", self.top_k)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise _bad("seed", "None or an integer in [0, 2**63)", self.seed)
        ids = self.stop_token_ids
        if not isinstance(ids, list | tuple) or not all(_is_int(t) and t >= 0 for t in ids):
            raise _bad("stop_token_ids", "a list of integers >= 0", ids)
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", "a bool", self.ignore_eos)
        # Frozen dataclass: normalise through object.__setattr__ so params stay hashable and comparable.
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Checks what depends on the model: every stop id must be a real token."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise _bad("stop_token_ids", f"ids in [0, vocab_size={vocab_size})", t)
