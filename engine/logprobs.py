"""Log-probabilities of the tokens a step decides (and of prompt tokens), with each position's top-k alternatives.

Which logits: a generated token's logprobs are the log-softmax of the logits its row decides on after the logits
processing (`logits_processing`: logit_bias, min_tokens, the penalties and the min_p mask), before temperature,
top-k and top-p. That is the distribution whose argmax a greedy row emits (so a greedy token is always the top-1
alternative, and a logit_bias shows in its logprobs, as OpenAI's do), and it does not depend on the temperature, so
a row's logprobs mean the same at any temperature; a row without processing gets the raw model logprobs (vLLM's
default). Prompt tokens are never processed: their logprobs are the raw model's. With speculative decoding they
are the target model's logits at each emitted position (the verify step's), never the drafter's.

On the device a step's logprob rows are one tensor [L, 2 + 2k] float32 (`pack`: the chosen token's id and logprob,
the k best logprobs and their ids, ids as floats: exact below 2**24), copied to the host with the step's tokens; a `LogprobRows`
names which request each run of rows belongs to. `pack` is the torch reference; on a GPU the engine packs the rows
with `ops.logprob_topk`'s kernels (`Kernels.logprob_pack`), without the float32 log-softmax over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .token_logprob import TokenLogprob

__all__ = ["LogprobRows", "Segment", "TokenLogprob", "check_logprobs", "pack"]


def pack(logits: Tensor, tokens: Tensor, k: int) -> Tensor:
    """logits [L, V] (any float dtype), tokens [L] int64 (the token of each position), k >= 0 -> [L, 2 + 2k]
    float32: the token, log_softmax(logits)[token], the k largest logprobs (descending) and their ids."""
    lp = logits.float().log_softmax(dim=-1)  # [L, V]
    tokens = tokens.to(torch.int64)[:, None]  # [L, 1]
    vals, ids = lp.topk(k, dim=-1, sorted=True)  # [L, k] each
    return torch.cat([tokens.float(), lp.gather(1, tokens), vals, ids.float()], dim=1)


@dataclass(frozen=True)
class Segment:
    """`rows` consecutive packed rows of one request, each with its `k` alternatives; `start`: the index (in the
    request's prompt or outputs) of the token the first row scores."""

    request_id: str
    rows: int
    k: int
    start: int = 0


class LogprobRows:
    """A step's packed logprob rows (`pack`, [L, 2 + 2kmax] on the device) and whose they are; `to_host` starts
    their copy to pinned memory (before the step's end event is recorded), `read` unpacks them once it is done."""

    def __init__(self, packed: Tensor, segments: Sequence[Segment]) -> None:
        n = sum(s.rows for s in segments)
        if packed.dim() != 2 or packed.shape[0] != n:
            raise ValueError(f"packed: expected [{n}, 2 + 2k] rows for the segments, got {tuple(packed.shape)}")
        self.packed = packed
        self.segments = tuple(segments)
        self._host = packed

    def to_host(self) -> None:
        if self.packed.device.type == "cuda":
            self._host = torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
            self._host.copy_(self.packed, non_blocking=True)

    def read(self) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """request id -> (start, one TokenLogprob per row); call it once the copy is done."""
        host = self._host.tolist()
        kmax = (self.packed.shape[1] - 2) // 2
        out: dict[str, tuple[int, list[TokenLogprob]]] = {}
        at = 0
        for s in self.segments:
            out[s.request_id] = (s.start, [
                TokenLogprob(int(r[0]), r[1], tuple((int(r[2 + kmax + j]), r[2 + j]) for j in range(s.k)))
                for r in host[at:at + s.rows]])
            at += s.rows
        return out


def check_logprobs(name: str, k: int | None, limit: int) -> None:
    """A request's `logprobs` / `prompt_logprobs` against the engine's bound (None: not asked)."""
    if k is not None and k > limit:
        raise ValueError(f"sampling field '{name}': expected at most max_logprobs={limit} alternatives, got {k}")
