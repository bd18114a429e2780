"""KV block ids: a free list plus the full blocks the prefix cache keeps, shared by requests and reclaimable.

Invariants (checked, never assumed):
- every id is free (in the free list), owned by one request (private), or cached: a full block the prefix cache
  keeps under its hash, held by `refs` >= 0 requests; a cached block no request holds is reclaimable;
- `num_free` counts the free and the reclaimable ids: a running request is never refused a block that a cache
  entry could give back, since `allocate` evicts reclaimable blocks (least recently released first) before it
  ever fails;
- freeing a private id gives it back to the free list; freeing a cached id drops one hold; dropping a hold that
  does not exist raises, freeing nothing.

It offers `FreeList`'s interface (`allocate`, `free`, `num_free`, ...), so that the scheduler and the nodes count
reclaimable blocks as free without knowing about the prefix cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from baton.engine.allocator import FreeList


class BlockPool:
    def __init__(self, capacity: int, name: str = "kv blocks") -> None:
        self.free_list = FreeList(capacity, name)
        self.name = name
        self.capacity = capacity
        self.refs: dict[int, int] = {}  # cached block -> requests holding it
        # Cached blocks no request holds, least recently released first.
        self._reclaimable: OrderedDict[int, None] = OrderedDict()
        # Called with each cached block as it is evicted (the prefix cache drops its entries for it).
        self.on_evict: Callable[[int], None] | None = None
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return self.free_list.num_free + len(self._reclaimable)

    @property
    def num_used(self) -> int:
        """Ids some request holds (private or cached)."""
        return self.capacity - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.refs)

    @property
    def num_free_runs(self) -> int:
        return self.free_list.num_free_runs

    def free_runs(self) -> list[tuple[int, int]]:
        return self.free_list.free_runs()

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """n private ids (`FreeList.allocate`'s placement), evicting reclaimable cached blocks first where the free
        list is short."""
        if n > self.num_free:
            raise MemoryError(f"{self.name}: asked for {n}, only {self.num_free} free of {self.capacity}")
        short = n - self.free_list.num_free
        if short > 0:
            self.evict(short)
        return self.free_list.allocate(n, after=after)

    def free(self, ids: list[int] | tuple[int, ...]) -> None:
        """Give a request's ids back, all or nothing: private ones to the free list, a hold on cached ones. Cached
        blocks become reclaimable last block first, so that a prefix's tail is evicted before its head."""
        cached = [i for i in ids if i in self.refs]
        bad = [i for i in cached if self.refs[i] <= 0] or ([] if len(set(cached)) == len(cached) else cached)
        if bad:
            raise RuntimeError(f"{self.name}: cached block {bad[0]} freed but not held (double free?)")
        private = [i for i in ids if i not in self.refs]
        if private:
            self.free_list.free(private)
        for i in reversed(cached):
            self.refs[i] -= 1
            if not self.refs[i]:
                self._reclaimable[i] = None

    def cache(self, block: int) -> None:
        """Keep a private block, held by its one owner, in the cache once that owner frees it."""
        if block in self.refs:
            raise RuntimeError(f"{self.name}: block {block} is cached already (a bug)")
        self.refs[block] = 1

    def hold(self, block: int) -> None:
        """One more request holds a cached block (a prefix hit): it is not reclaimable while held."""
        if self.refs[block] == 0:
            del self._reclaimable[block]
        self.refs[block] += 1

    def evict(self, n: int) -> None:
        """Give the n least recently released reclaimable blocks back to the free list."""
        if n > len(self._reclaimable):
            raise RuntimeError(f"{self.name}: expected {n} reclaimable blocks, got {len(self._reclaimable)} (a bug)")
        gone = []
        for _ in range(n):
            block, _ = self._reclaimable.popitem(last=False)
            del self.refs[block]
            gone.append(block)
            if self.on_evict is not None:
                self.on_evict(block)
        self.evictions += n
        self.free_list.free(gone)
