"""The engine side of the KV block and state slot pools: which ids are free, owned, held or quarantined.

Invariants:
- every block and slot is free, owned by one request, held for a transfer (a prefilled request's lease, or a
  reservation a transfer fills), or quarantined (a slot lent to one step is, from the start); never two of these; a
  block the prefix cache keeps may be held by several requests at once, and counts as free while none holds it
  (`BlockPool`);
- ids released while a step is in flight (launched > done) stay quarantined until that step is done: no new request,
  and no transfer into a reserved block, ever shares them with a step that may still write them;
- a request grows right after its last block where free (one run: one transfer descriptor).
"""

from __future__ import annotations

from baton.engine.allocator import FreeList
from baton.engine.block_pool import BlockPool
from baton.engine.request import Request


class CacheManager:
    def __init__(self, block_size: int, num_blocks: int, num_slots: int) -> None:
        """num_slots: state slots (one per request that holds a state)."""
        self.block_size = block_size
        # Blocks the prefix cache keeps count as free until taken (`BlockPool`).
        self.blocks = BlockPool(num_blocks, "kv blocks")
        self.slots = FreeList(num_slots, "state slots")
        # Steps launched / known done, and what was released while some were in flight:
        # (the latest step launched then, block ids, state slot or None).
        self.launched = 0
        self.done = 0
        self.quarantine: list[tuple[int, list[int], int | None]] = []

    # ---- a request's blocks and slot ----------------------------------------------------------------
    def blocks_needed(self, req: Request, n: int, lookahead: int = 0) -> int:
        total = -(-(req.num_computed_tokens + n + lookahead) // self.block_size)
        return max(0, total - len(req.block_ids))

    def allocate_for(self, req: Request, n: int, lookahead: int = 0) -> None:
        self.grow(req, self.blocks_needed(req, n, lookahead))

    def grow(self, req: Request, need: int) -> None:
        """need more blocks for req, right after its last one where free (one run: one transfer descriptor)."""
        if need:
            req.add_blocks(self.blocks.allocate(need, after=req.block_ids[-1] if req.block_ids else None))

    def fit(self, req: Request, n: int) -> int:
        """Largest m <= n whose blocks fit in the request's blocks plus the free pool."""
        room = (len(req.block_ids) + self.blocks.num_free) * self.block_size - req.num_computed_tokens
        return max(0, min(n, room))

    def assign_slot(self, req: Request) -> None:
        req.state_slot = self.slots.allocate(1)[0]

    def lend_slot(self) -> int:
        """A state slot for the step being scheduled only (the next one launched): free again once it is done."""
        slot = self.slots.allocate(1)[0]
        self.quarantine.append((self.launched + 1, [], slot))
        return slot

    def release(self, req: Request) -> None:
        """Take req's blocks and slot back: free now, or once the steps in flight are done."""
        blocks, slot = req.block_ids, req.state_slot
        req.set_blocks([])
        req.state_slot = None
        if self.launched > self.done:
            # A step in flight may still write them: free once it is done (step_done).
            if blocks or slot is not None:
                self.quarantine.append((self.launched, blocks, slot))
        else:
            self._free(blocks, slot)

    # ---- steps in flight ----------------------------------------------------------------------------
    def step_launched(self) -> int:
        """A step was launched and is not done yet; returns its number."""
        self.launched += 1
        return self.launched

    def step_done(self, step: int) -> None:
        """Every step up to `step` is done: what was released while they ran goes back to the free lists."""
        self.done = max(self.done, step)
        # (Not in step order: a slot lent to the step being scheduled may precede a release made while scheduling it.)
        if any(item[0] <= self.done for item in self.quarantine):
            keep = []
            for item in self.quarantine:
                if item[0] > self.done:
                    keep.append(item)
                else:
                    self._free(item[1], item[2])
            self.quarantine = keep

    # ---- transfers (the engine side of leases) ------------------------------------------------------
    def reserve(self, num_blocks: int) -> tuple[list[int], int] | None:
        """Blocks and a state slot for a request whose caches arrive from elsewhere (a transfer), or None
        when they are not free now. Give them back with `free_held` if the transfer fails."""
        if not self.slots.can_allocate(1) or not self.blocks.can_allocate(num_blocks):
            return None
        return self.blocks.allocate(num_blocks), self.slots.allocate(1)[0]

    def reserve_after(self, held: list[int], num_blocks: int) -> tuple[list[int], int] | None:
        """As `reserve`, the first blocks being `held`: cached blocks that already hold the transfer's first KV
        (the prefix cache's), taken with a hold each rather than allocated."""
        reclaimed = sum(self.blocks.refs[b] == 0 for b in held)  # holding one takes it off the reclaimable ones
        if not self.slots.can_allocate(1) or not self.blocks.can_allocate(num_blocks - len(held) + reclaimed):
            return None
        for b in held:
            self.blocks.hold(b)
        return held + self.blocks.allocate(num_blocks - len(held)), self.slots.allocate(1)[0]

    def adopt(self, req: Request, block_ids: list[int], state_slot: int, num_computed: int) -> None:
        """Make reserved caches, holding req's first `num_computed` tokens, req's own."""
        if len(block_ids) * self.block_size < num_computed:
            raise ValueError(f"block_ids: expected room for {num_computed} tokens, got {len(block_ids)} blocks")
        req.set_blocks(list(block_ids))
        req.state_slot = state_slot

    def free_held(self, block_ids: list[int] | tuple[int, ...], state_slot: int) -> None:
        """Return the caches of a prefilled (held) request, or of a failed reservation, to the pools."""
        self._free(list(block_ids), state_slot)

    def _free(self, blocks: list[int], slot: int | None) -> None:
        if blocks:
            self.blocks.free(blocks)
        if slot is not None:
            self.slots.free([slot])
