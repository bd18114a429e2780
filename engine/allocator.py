"""Free-list allocator of integer ids: KV blocks and Mamba state slots both use it.

Invariants (checked, never assumed): every id in [0, capacity) is either free or owned, never both;
freeing an id that is not owned is a bug and raises; `num_free + num_used == capacity` always.

Allocation takes the lowest free ids. That keeps a request's blocks in long consecutive runs whenever the
pool allows, and a run of blocks is one transfer descriptor for all layers (see `baton.transfer.plan`).
"""

from __future__ import annotations

import heapq


class FreeList:
    def __init__(self, capacity: int, name: str) -> None:
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"{name} capacity: expected a positive integer, got {capacity!r}")
        self.name = name
        self.capacity = capacity
        self._free: list[int] = list(range(capacity))  # a heap
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"{self.name}: expected n >= 0, got {n}")
        if n > len(self._free):
            raise MemoryError(f"{self.name}: asked for {n}, only {len(self._free)} free of {self.capacity}")
        ids = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int] | tuple[int, ...]) -> None:
        for i in ids:
            if i not in self._used:
                raise RuntimeError(f"{self.name}: id {i} freed but not allocated (double free?)")
            self._used.remove(i)
            heapq.heappush(self._free, i)
