"""One position's logprobs as the engine returns them (torch-free: the nodes' proto conversions read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its logprob, and the `k` most likely (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
