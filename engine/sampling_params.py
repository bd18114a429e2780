"""Per-request sampling parameters.

Validated once, at construction, so the sampler's hot path never has to check them. Bad values fail
with a `ValueError` naming the field, what we expected and what we got.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .structured_output import StructuredOutput

# Seeds are fed to `torch.Generator.manual_seed`, which takes a 64-bit value; keeping them below 2**63
# means they also round-trip through signed int64 (JSON clients, numpy) unchanged.
SEED_LIMIT = 2**63
# OpenAI's ranges: presence / frequency penalties in [-2, 2], logit_bias values in [-100, 100].
PENALTY_LIMIT = 2.0
BIAS_LIMIT = 100.0


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
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max after temperature; 0 = off
    presence_penalty: float = 0.0  # subtracted once from the logit of every token generated so far
    frequency_penalty: float = 0.0  # subtracted per occurrence of a token generated so far
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt + generated tokens
    # (token id, bias) pairs added to the raw logits; a dict {id: bias} is accepted and normalised to sorted pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # the stop ids (EOS unless ignore_eos, and stop_token_ids) are masked until this many
    # Return each generated token's logprob and this many top alternatives (`logprobs`); None = none.
    logprobs: int | None = None
    # Return each prompt token's logprob (the first has none) and this many top alternatives; None = none.
    prompt_logprobs: int | None = None
    # The grammar the output must match (JSON object / schema, regex, Lark): a token mask before the draw.
    structured_output: StructuredOutput | None = None

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
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise _bad("min_p", "a float in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
                raise _bad(name, f"a float in [{-PENALTY_LIMIT}, {PENALTY_LIMIT}]", v)
        rp = self.repetition_penalty
        if not _is_real(rp) or not math.isfinite(rp) or rp <= 0:
            raise _bad("repetition_penalty", "a finite float > 0 (1 = off)", rp)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _bad("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise _bad(name, "None or an integer >= 0 (the top alternatives per token)", v)
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise _bad("structured_output", "None or a StructuredOutput", self.structured_output)
        if self.structured_output is not None and self.min_tokens:
            # The grammar decides where the output ends; masking EOS there could leave no token to draw.
            raise _bad("min_tokens", "0 with a structured_output", self.min_tokens)
        # Frozen dataclass: normalise through object.__setattr__ so params stay hashable and comparable.
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether the logits depend on the tokens seen so far (presence, frequency or repetition penalty)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processed(self) -> bool:
        """Whether any logits processing applies (`logits_processing`): penalties, logit_bias, min_tokens, a
        min_p that a sampled row uses, or a grammar."""
        return (self.penalised or bool(self.logit_bias) or self.min_tokens > 0
                or (self.min_p > 0 and not self.greedy) or self.structured_output is not None)

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Checks what depends on the model: every stop id and logit_bias key must be a real token."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise _bad("stop_token_ids", f"ids in [0, vocab_size={vocab_size})", t)
        for t, _ in self.logit_bias:
            if t >= vocab_size:
                raise _bad("logit_bias", f"token ids in [0, vocab_size={vocab_size})", t)


def _bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """A logit_bias given as {id: bias} or (id, bias) pairs -> sorted (id, float bias) pairs, one per id."""
    items = bias.items() if isinstance(bias, dict) else bias
    if not isinstance(items, list | tuple) and not isinstance(bias, dict):
        raise _bad("logit_bias", "a mapping of token id -> bias", bias)
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise _bad("logit_bias", "(token id, bias) pairs", item)
        t, b = item
        if not _is_int(t) or t < 0:
            raise _bad("logit_bias", "token ids that are integers >= 0", t)
        if not _is_real(b) or not -BIAS_LIMIT <= b <= BIAS_LIMIT:
            raise _bad("logit_bias", f"biases in [{-BIAS_LIMIT}, {BIAS_LIMIT}]", b)
        if t in pairs:
            raise _bad("logit_bias", "each token id once", t)
        pairs[t] = float(b)
    return tuple(sorted(pairs.items()))
