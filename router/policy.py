"""Worker selection: power of two choices over integer loads.

Sampling two healthy workers and keeping the less loaded one spreads load almost as well as scanning all
of them, yet two routers (or two requests between polls) working from slightly stale numbers do not all
pile onto the same "least loaded" worker.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass


class Role(enum.StrEnum):
    """A worker's role; the values are those of `LoadResponse.role`."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class WorkerLoad:
    """What the policy knows of one worker. Free counts may go negative when the router has sent more
    work since the last poll than the worker had room for; that still orders workers correctly."""

    healthy: bool
    outstanding_prefill_tokens: int = 0
    free_state_slots: int = 0
    free_kv_blocks: int = 0


def score(load: WorkerLoad, role: Role) -> tuple[int, ...]:
    """Higher is better. Prefill: fewest tokens queued ahead. Decode: a free state slot is what admits a
    request, so slots come first; KV blocks decide between workers with as many free slots."""
    if role is Role.PREFILL:
        return (-load.outstanding_prefill_tokens,)
    return (load.free_state_slots, load.free_kv_blocks)


def pick(loads: Sequence[WorkerLoad], rng: random.Random, role: Role,
         exclude: Collection[int] = ()) -> int | None:
    """Index of the chosen worker, or None when no healthy worker outside `exclude` is left."""
    candidates = [i for i, w in enumerate(loads) if w.healthy and i not in exclude]
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    a, b = rng.sample(candidates, 2)
    sa, sb = score(loads[a], role), score(loads[b], role)
    if sa == sb:
        return rng.choice((a, b))
    return a if sa > sb else b
