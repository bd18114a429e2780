"""Aborts a worker did not answer, kept to be sent again once it answers.

A node that stops answering (frozen, cut off) while the router gives up on a request misses that request's Abort,
yet may hold its caches once it runs again: a prefill's lease whose decode node gave up the READ, or whose handle
never reached the router. Nothing else tells the node to free them before the lease expires, so the pool sends those
aborts again after the node's next answered Load poll. Only aborts the router had already decided on are re-sent: a
handle a decode node consumed is never among them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from baton.router.worker_ids import ID_REUSE_AFTER_S

# Well inside the time a worker id stays reserved after its request ended, so that a re-sent abort, even one still on
# its way, cannot reach a newer request that took the id again.
KEEP_S = ID_REUSE_AFTER_S / 2
# Per worker: a node that misses aborts for a long time costs the router bounded memory.
MAX_KEPT = 4096


class UnsentAborts:
    """Request ids whose Abort one worker did not answer, oldest first, each kept `keep_s` after it first failed."""

    def __init__(self, keep_s: float = KEEP_S, max_kept: int = MAX_KEPT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (isinstance(keep_s, int | float) and not isinstance(keep_s, bool) and 0 < keep_s <= ID_REUSE_AFTER_S):
            raise ValueError(f"keep_s: expected a number in (0, {ID_REUSE_AFTER_S:g}], got {keep_s!r}")
        if not isinstance(max_kept, int) or isinstance(max_kept, bool) or max_kept < 1:
            raise ValueError(f"max_kept: expected an integer >= 1, got {max_kept!r}")
        self.keep_s = keep_s
        self.max_kept = max_kept
        self.clock = clock
        self._since: dict[str, float] = {}
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self._since)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._since

    def add(self, request_id: str) -> None:
        """Keeps `request_id`; one already kept keeps its first failure's time, so failed re-sends never extend it."""
        if request_id in self._since:
            return
        self._since[request_id] = self.clock()
        while len(self._since) > self.max_kept:
            del self._since[next(iter(self._since))]
            self.num_dropped += 1

    def discard(self, request_id: str) -> None:
        self._since.pop(request_id, None)

    def due(self) -> list[str]:
        """The ids still worth sending, oldest first; those kept `keep_s` are forgotten (their ids may be reused)."""
        horizon = self.clock() - self.keep_s
        for rid, at in list(self._since.items()):
            if at > horizon:
                break
            del self._since[rid]
            self.num_dropped += 1
        return list(self._since)
