"""Worker selection by prefix affinity balanced against load (issue #51).

A worker that already holds a prompt's leading blocks in its prefix cache prefills only the rest, so sending the
prompt there saves those tokens of compute. The router predicts that from its own routing history
(`prefix_index.PrefixIndex`): `hits[i]` is the number of leading prompt tokens worker i is expected to hold.

The choice stays power of two choices (`policy.pick`), with one candidate informed: `a` is a worker holding the
most (ties broken by the RNG), `b` a random other one. `a` wins by affinity while its extra load, in tokens of
prompt it has to prefill (`load_tokens`), is at most `weight` times the extra prompt tokens it holds:

    load_tokens(a) - load_tokens(b) <= weight * (hits[a] - hits[b])

With weight 1 a saved token is worth a queued one, so the request goes where it finishes prefilling first. Past
that budget, and whenever a decode worker `a` has less than half the free state slots of `b` (so also when it has
none and `b` has one), load decides exactly as `policy.score` does. Load wins past a point in both: the token
budget is bounded by the prompt's own length (hits never exceed it), and a decode worker's running requests by the
slot rule. A hot prefix therefore piles onto its holder only until the holder's backlog is that much longer (or its
free slots that much fewer); then the request goes to `b`, which records the prefix too; from then on both hold
it, their hits tie, and load alone decides between them. Weight 0, or hits that tie over every candidate, is `policy.pick` itself, RNG draws
included.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from baton.router.policy import Role, WorkerLoad, pick, score


@dataclass(frozen=True)
class Choice:
    index: int
    # Leading prompt tokens the chosen worker is predicted to hold.
    hit_tokens: int
    # Chosen for the prefix it holds, where load alone would have chosen another worker or tossed a coin.
    by_affinity: bool


def load_tokens(load: WorkerLoad) -> int:
    """Prompt tokens a worker has to prefill before a new one: what a prefix hit is weighed against."""
    return load.outstanding_prefill_tokens


def _affinity_wins(a: WorkerLoad, b: WorkerLoad, hit_gap: int, role: Role, weight: float) -> bool:
    # A decode worker's running requests are not prompt tokens: each one there slows every decode step of it for
    # a prefill saved once, so a holder left with under half the other's free state slots (none at all included)
    # is past the point where a prefix is worth it.
    if role is Role.DECODE and 2 * a.free_state_slots < b.free_state_slots:
        return False
    return load_tokens(a) - load_tokens(b) <= weight * hit_gap


def pick_by_affinity(loads: Sequence[WorkerLoad], hits: Sequence[int], rng: random.Random, role: Role,
                     weight: float, exclude: Collection[int] = ()) -> Choice | None:
    """The chosen worker, or None when no healthy worker outside `exclude` is left. `hits[i]`: worker i's predicted
    prefix hit in tokens; `weight` >= 0 (0: load only)."""
    if len(hits) != len(loads):
        raise ValueError(f"hits: expected one per worker ({len(loads)}), got {len(hits)}")
    candidates = [i for i, w in enumerate(loads) if w.healthy and i not in exclude]
    if weight == 0 or len({hits[i] for i in candidates}) <= 1:
        i = pick(loads, rng, role, exclude)
        return None if i is None else Choice(i, hits[i], by_affinity=False)
    best = max(hits[i] for i in candidates)
    a = rng.choice([i for i in candidates if hits[i] == best])
    b = rng.choice([i for i in candidates if i != a])
    sa, sb = score(loads[a], role), score(loads[b], role)
    if hits[b] < hits[a] and _affinity_wins(loads[a], loads[b], hits[a] - hits[b], role, weight):
        return Choice(a, hits[a], by_affinity=sa <= sb)
    i = rng.choice((a, b)) if sa == sb else a if sa > sb else b
    return Choice(i, hits[i], by_affinity=False)
