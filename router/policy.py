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
    # The worker's step budget (max_num_batched_tokens, from its Info; 0 unknown): decode workers' prefill
    # backlog counts in whole steps of it.
    step_tokens: int = 0


# Steps a prefill worker has launched and not answered yet: with async scheduling, the one on the device and the
# next, launched behind it. The router counts a prompt until its Prefill call returns (and so does the worker's
# Load), so up to this many steps of the worker's budget in that count are being computed, not waiting.
PREFILL_STEPS_IN_FLIGHT = 2


def queued_prefill_tokens(load: WorkerLoad) -> int:
    """A prefill worker's prompt tokens waiting for a step: its outstanding ones less the steps it has in flight
    (all of them outstanding while its step budget is unknown). A worker with that much outstanding is saturated,
    so its steps are full; one with less has nothing waiting."""
    return max(0, load.outstanding_prefill_tokens - PREFILL_STEPS_IN_FLIGHT * load.step_tokens)


def score(load: WorkerLoad, role: Role) -> tuple[int, ...]:
    """Higher is better. Prefill: fewest tokens queued ahead. Decode: a free state slot is what admits a
    request, so having one comes first; then the fewest whole steps of prompt tokens it has queued to prefill
    itself (short prompts, fallbacks, aggregated serving, prefill overflow: each such step holds up the decode rows
    of every request on it, so a burst of prompts is spread rather than piled on one worker); then more free slots,
    then more KV blocks. A backlog of less than one step does not count (token N of a transferred request is one
    token)."""
    if role is Role.PREFILL:
        return (-load.outstanding_prefill_tokens,)
    steps = load.outstanding_prefill_tokens // load.step_tokens if load.step_tokens > 0 else 0
    return (int(load.free_state_slots > 0), -steps, load.free_state_slots, load.free_kv_blocks)


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
