"""The penalties' inputs kept on the device, per state slot: how often the request in the slot generated each token,
and which tokens its prompt holds (`logits_processing.ResidentCounts`).

Invariant: while a penalised request runs in slot s and `owner[s]` is its incarnation (`ModelRunner.add_request`
numbers them), counts[s] holds every token it has sampled or accepted, those of steps still in flight included:
each step adds the tokens it decides behind its draw, in stream order (`logits_processing.count_decided`; a verify
row's accepted count is the device's, R3), so no host read and no host anchor is needed. A slot's rows are set from
the request's host history when a step first processes the request in a slot it does not own: at admission, at
readmission after a preemption (recompute: a new slot, or its old one that another request held since), and on the
decode node of a transferred request. The history is complete then: a request's first processed step after
(re)admission follows the read of every step that sampled for it before (a preempted request is readmitted at the
earliest by the next schedule, after the step in flight is read). Resetting a slot in stream order also comes after
the last step of the slot's previous request, whose counts that step may still be adding to.

Memory: V int32 counts and V / 8 bytes of prompt bits per slot (`table_bytes`), a small part of what one slot's
recurrent state and KV blocks hold, but not nothing at a large vocabulary and many slots: the cache plan sets it
aside (`cache_pools.plan_cache`), so that the tables, allocated at the first penalised request (an engine that never
gets one holds none), outside every CUDA graph (penalised rows are processed eagerly), always fit. int32 because a count grows with the output length, which may
pass a narrower type's range; the frequency penalty multiplies it, so it may not saturate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .host_copy import to_device
from .logits_processing import ResidentCounts, RowHistory
from .request import PENDING


def table_bytes(vocab_size: int) -> int:
    """One slot's share of the tables: its counts and its prompt bits (int32 words)."""
    return 4 * vocab_size + 4 * -(-vocab_size // 32)


class PenaltyCounts:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        if num_slots < 1 or vocab_size < 1:
            raise ValueError(f"num_slots, vocab_size: expected >= 1, got {num_slots}, {vocab_size}")
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self.device = device
        # [num_slots + 1, V] and [num_slots + 1, words] int32; row num_slots stays zero (`ResidentCounts`).
        self.counts: torch.Tensor | None = None
        self.prompt_bits: torch.Tensor | None = None
        # Slot -> the incarnation of the request whose counts it holds.
        self._owner: dict[int, int] = {}

    def resident(self, slots: Sequence[int], owners: Sequence[int | None], histories: Sequence[RowHistory | None],
                 repetition: Sequence[bool]) -> ResidentCounts:
        """The tables for a step's batch rows, in `slots`; a row with an owner (the incarnation of a penalised
        request; None for the others) whose slot holds another's counts gets its rows set from its history first
        (`repetition`: its prompt is read, by the repetition penalty)."""
        if not len(slots) == len(owners) == len(histories) == len(repetition):
            raise ValueError(f"slots, owners, histories, repetition: expected one per row, got {len(slots)}, "
                             f"{len(owners)}, {len(histories)}, {len(repetition)}")
        stale = [i for i, (s, o) in enumerate(zip(slots, owners, strict=True))
                 if o is not None and self._owner.get(s) != o]
        if self.counts is None:
            self.counts = torch.zeros(self.num_slots + 1, self.vocab_size, dtype=torch.int32, device=self.device)
            self.prompt_bits = torch.zeros(self.num_slots + 1, self.words, dtype=torch.int32, device=self.device)
        if stale:
            self._set([slots[i] for i in stale], [histories[i] for i in stale], [repetition[i] for i in stale])
            for i in stale:
                self._owner[slots[i]] = owners[i]
        return ResidentCounts(self.counts, self.prompt_bits, slots)

    def _set(self, slots: list[int], histories: list[RowHistory | None], repetition: list[bool]) -> None:
        """Rows `slots` := their requests' histories (outputs counted, the prompt's bits where `repetition`), in one
        host -> device copy."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots: expected distinct slots, got {slots}")
        bad = [s for s in slots if not 0 <= s < self.num_slots]
        if bad:
            raise ValueError(f"slots: expected 0..{self.num_slots - 1}, got {bad}")
        n = len(slots)
        rows: list[int] = []
        tokens: list[int] = []
        bits = np.zeros((n, self.words), dtype=np.uint32)
        for i, (h, rep) in enumerate(zip(histories, repetition, strict=True)):
            if h is None:
                raise ValueError(f"histories: expected the history of the request in slot {slots[i]}, got None")
            outs = h.outputs
            if PENDING in outs:
                raise RuntimeError(f"penalty counts: slot {slots[i]} is set from a history with a token not read yet "
                                   f"({list(outs)}) (a bug)")
            rows.extend([slots[i]] * len(outs))
            tokens.extend(outs)
            if rep and len(h.prompt):
                prompt = np.asarray(h.prompt, dtype=np.int64)
                np.bitwise_or.at(bits[i], prompt >> 5, np.left_shift(np.uint32(1), (prompt & 31).astype(np.uint32)))
        idx = to_device([*slots, *rows, *tokens], torch.int64, self.device)
        at, m = idx[:n], len(rows)
        self.counts[at] = 0
        self.counts.index_put_((idx[n:n + m], idx[n + m:]), torch.ones(m, dtype=torch.int32, device=self.device),
                               accumulate=True)
        self.prompt_bits[at] = to_device(bits.view(np.int32), torch.int32, self.device)
