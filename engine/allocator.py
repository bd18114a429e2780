"""Free-list allocator of integer ids: KV blocks and Mamba state slots both use it.

Invariants (checked, never assumed): every id in [0, capacity) is either free or owned, never both;
freeing an id that is not owned is a bug and raises, freeing nothing; `num_free + num_used == capacity`
always; the free ids are kept as maximal runs of consecutive ids.

Placement keeps a request's blocks in few consecutive runs, because a run of blocks is one transfer
descriptor for all layers (`baton.transfer.plan`), and NIXL moves coalesced runs far faster than single blocks:
  1. `after`: a request that grows takes the ids right after its last one while they are free;
  2. the rest comes from the smallest free run that holds all of it (best fit, lowest start on ties), so
     small holes are filled by small requests and long runs stay whole for long ones;
  3. when no run holds it, the longest runs first (the fewest pieces).
Taking the lowest free ids instead lets decode's one-block growth
checkerboard the pool: `benchmarks/alloc_bench.py` measures the runs per transferred request under both.
"""

from __future__ import annotations

from bisect import bisect_left, insort


class FreeList:
    def __init__(self, capacity: int, name: str) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise ValueError(f"{name} capacity: expected a positive integer, got {capacity!r}")
        self.name = name
        self.capacity = capacity
        self._runs: dict[int, int] = {}  # start -> length of each maximal free run
        self._ends: dict[int, int] = {}  # end (exclusive) -> start
        self._by_len: dict[int, list[int]] = {}  # length -> sorted starts of the runs that long
        self._lens: list[int] = []  # sorted lengths that some free run has
        self._num_free = capacity
        self._used: set[int] = set()
        self._add_run(0, capacity)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def num_free_runs(self) -> int:
        """How many maximal runs the free ids form (1 = one consecutive stretch)."""
        return len(self._runs)

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of each free run, by start."""
        return sorted(self._runs.items())

    def can_allocate(self, n: int) -> bool:
        return n <= self._num_free

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """n free ids, placed as the module docstring says; `after`: the caller's last id (grow from it)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"{self.name}: expected n >= 0, got {n!r}")
        if after is not None and after not in self._used:
            raise ValueError(f"{self.name} after: expected an id {self.name} owns, got {after!r}")
        if n > self._num_free:
            raise MemoryError(f"{self.name}: asked for {n}, only {self._num_free} free of {self.capacity}")
        ids: list[int] = []
        if n and after is not None and after + 1 in self._runs:
            n -= self._take(after + 1, n, ids)
        while n:
            i = bisect_left(self._lens, n)
            length = self._lens[i] if i < len(self._lens) else self._lens[-1]
            n -= self._take(self._by_len[length][0], n, ids)
        self._used.update(ids)
        return ids

    def free(self, ids: list[int] | tuple[int, ...]) -> None:
        """Give ids back; all or nothing: an id not owned (or given twice) raises before any is freed."""
        ordered = sorted(ids)
        for j, i in enumerate(ordered):
            if i not in self._used or (j and ordered[j - 1] == i):
                raise RuntimeError(f"{self.name}: id {i} freed but not allocated (double free?)")
        self._used.difference_update(ordered)
        j = 0
        while j < len(ordered):  # each consecutive stretch, merged with the free runs on both sides
            start = end = ordered[j]
            while j < len(ordered) and ordered[j] == end:
                j += 1
                end += 1
            self._num_free += end - start
            before = self._ends.get(start)
            if before is not None:
                self._remove_run(before)
                start = before
            if end in self._runs:
                end += self._remove_run(end)
            self._add_run(start, end - start)

    def _take(self, start: int, n: int, ids: list[int]) -> int:
        """Up to n ids from the front of the free run at start, appended to ids; returns how many."""
        length = self._remove_run(start)
        k = min(n, length)
        if k < length:
            self._add_run(start + k, length - k)
        ids.extend(range(start, start + k))
        self._num_free -= k
        return k

    def _add_run(self, start: int, length: int) -> None:
        self._runs[start] = length
        self._ends[start + length] = start
        starts = self._by_len.get(length)
        if starts is None:
            self._by_len[length] = [start]
            insort(self._lens, length)
        else:
            insort(starts, start)

    def _remove_run(self, start: int) -> int:
        length = self._runs.pop(start)
        del self._ends[start + length]
        starts = self._by_len[length]
        starts.pop(bisect_left(starts, start))
        if not starts:
            del self._by_len[length]
            self._lens.pop(bisect_left(self._lens, length))
        return length
