"""The prefix cache: full KV blocks keyed by a hash chain over their tokens, and recurrent-state checkpoints at block
boundaries, so that a request whose prompt starts like an earlier one prefills only the rest.

A hybrid model's state after a prefix is no function of any one block, so a prefix is reusable only up to a
boundary where a checkpoint of the state was taken (a copy of a request's state slot: every declared state tensor
of every mixer layer, `state_spec`). Hence:
- block i's hash is H(block i-1's hash, block i's tokens), the chain seeded with the model's identity: equal
  hashes mean equal prefixes, under the same weights;
- a checkpoint at boundary P is keyed by the hash of the block ending at P and, where the engine runs an MTP
  drafter, by token P too: the drafter's KV at position P-1 is computed from h(P-1) and token P (R8), so it is
  reusable only where the next token is the same;
- a lookup takes the longest chain of cached blocks that ends on a checkpoint, up to a limit the scheduler sets.
The scheduler takes the last boundary (a multiple of `stride` blocks) each prefill chunk reaches, inside the chunk or
at its end (`scheduler.py`), and the runner copies the state slots on the device (`SchedulerOutput.checkpoints`
after a step, `.restores` before one).
Works on ints and bytes only.

Invariants: a checkpoint exists only while the block it ends on is cached (evicting that block drops it); a
checkpoint taken by a step is invisible to lookups until the next `begin_step` (that step is launched by then, and
every later step runs after it on the device); when no checkpoint slot is free the least recently used checkpoint
gives its slot up. A request that takes a deeper checkpoint than the one it stood on sends that one to the cold end
of the LRU where no other request has used it: the one it took last, unless a lookup has used it since (a prefill
split into chunks by the step budget takes one at each chunk's last boundary), and the one its own lookup hit, unless
another lookup hit it too (a conversation's earlier turn). Only the deepest is what the conversation's next turn
resumes from; a checkpoint several requests hit, such as a shared system prompt's, keeps its place.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from baton.engine.block_pool import BlockPool
from baton.engine.request import Request

# (the hash of the block a checkpoint ends on, the token after it or -1 where no drafter reads it)
CheckpointKey = tuple[bytes, int]


@dataclass(frozen=True)
class PrefixHit:
    block_ids: tuple[int, ...]  # the cached blocks of the prefix, in order
    checkpoint: int             # the checkpoint slot holding the state after the prefix
    num_tokens: int             # the prefix's length (a multiple of the block size)
    key: CheckpointKey


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixCache:
    def __init__(self, blocks: BlockPool, block_size: int, num_checkpoints: int, stride: int, seed: bytes,
                 match_successor: bool) -> None:
        """num_checkpoints: checkpoint slots; stride: blocks between checkpoint boundaries; seed: the model's
        identity; match_successor: key checkpoints by the token after them too (an engine with an MTP drafter)."""
        if num_checkpoints < 1 or stride < 1:
            raise ValueError(f"prefix cache: expected at least one checkpoint slot and a stride >= 1, got "
                             f"{num_checkpoints} slots and stride {stride}")
        self.blocks = blocks
        blocks.on_evict = self._block_evicted
        self.block_size = block_size
        self.stride_tokens = stride * block_size
        self.seed = seed
        self.match_successor = match_successor
        self.num_checkpoint_slots = num_checkpoints
        self._by_hash: dict[bytes, int] = {}  # block hash -> the cached block holding those tokens
        self._hash_of: dict[int, bytes] = {}  # cached block -> its hash
        self._checkpoints: OrderedDict[CheckpointKey, int] = OrderedDict()  # -> slot, least recently used first
        self._ending_at: dict[bytes, list[CheckpointKey]] = {}  # block hash -> the checkpoints ending there
        self._fresh: set[CheckpointKey] = set()  # taken by the step being scheduled
        self._uses: dict[CheckpointKey, int] = {}  # lookups that took it since it was taken
        self._free_slots = list(range(num_checkpoints - 1, -1, -1))
        # Counters since start (plain ints, exported by the nodes).
        self.queried_tokens = 0     # prefill tokens of admitted requests
        self.hit_tokens = 0         # of those, served from the cache
        self.checkpoints_taken = 0
        self.checkpoint_evictions = 0

    @property
    def num_checkpoints(self) -> int:
        """Checkpoints held now."""
        return len(self._checkpoints)

    @property
    def block_evictions(self) -> int:
        return self.blocks.evictions

    def begin_step(self) -> None:
        """A new step is being scheduled: checkpoints taken by earlier steps become visible."""
        self._fresh.clear()

    # ---- hashing ----------------------------------------------------------------------------------
    def hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """The hashes of req's first `num_blocks` full blocks (fewer where a token is not known yet), each
        computed once per request."""
        hs = req.block_hashes
        bs = self.block_size
        while len(hs) < num_blocks:
            i = len(hs)
            tokens = req.token_ids_between(i * bs, (i + 1) * bs)
            if len(tokens) < bs or min(tokens) < 0:  # a PENDING output (async scheduling) is no token yet
                break
            hs.append(chain_hash(hs[-1] if hs else self.seed, tokens))
        return hs[:num_blocks]

    def _key(self, req: Request, block_hash: bytes, end: int) -> CheckpointKey:
        return block_hash, req.token_ids_between(end, end + 1)[0] if self.match_successor else -1

    # ---- lookups ----------------------------------------------------------------------------------
    def lookup(self, req: Request, limit: int) -> PrefixHit | None:
        """The longest cached prefix of req, of at most `limit` tokens, that ends on a visible checkpoint."""
        bs = self.block_size
        blocks: list[int] = []
        best: PrefixHit | None = None
        for i, h in enumerate(self.hashes(req, limit // bs)):
            block = self._by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
            if h in self._ending_at:
                key = self._key(req, h, (i + 1) * bs)
                slot = self._checkpoints.get(key)
                if slot is not None and key not in self._fresh:
                    best = PrefixHit(tuple(blocks), slot, (i + 1) * bs, key)
        return best

    def reclaimable_in(self, hit: PrefixHit) -> int:
        """How many of the hit's blocks no request holds (taking them uses up that many free blocks)."""
        return sum(self.blocks.refs[b] == 0 for b in hit.block_ids)

    def use(self, hit: PrefixHit, req: Request) -> None:
        """req takes the hit: it holds the blocks, and the checkpoint becomes the most recently used."""
        for b in hit.block_ids:
            self.blocks.hold(b)
        self._checkpoints.move_to_end(hit.key)
        self._uses[hit.key] = self._uses.get(hit.key, 0) + 1
        req.hit_checkpoint = hit.key
        self.hit_tokens += hit.num_tokens

    # ---- checkpoints ------------------------------------------------------------------------------
    def missing(self, req: Request, end: int) -> bool:
        """Whether req could take a checkpoint at boundary `end` that the cache does not hold yet."""
        n = end // self.block_size
        hs = self.hashes(req, n)
        return len(hs) == n and self._key(req, hs[-1], end) not in self._checkpoints

    def take(self, req: Request, end: int) -> int | None:
        """Cache req's blocks up to boundary `end`, which the step being scheduled computes, and give the checkpoint
        slot its state there is copied into; None where the cache holds that checkpoint already."""
        if not self.missing(req, end):
            return None
        hs = self.hashes(req, end // self.block_size)
        self._cache_blocks(hs, req.block_ids)
        key = self._key(req, hs[-1], end)
        # The checkpoints req stood on, each demoted where no lookup but req's own has used it.
        for superseded, own_uses in ((req.last_checkpoint, 0), (req.hit_checkpoint, 1)):
            if superseded in self._checkpoints and self._uses.get(superseded, 0) <= own_uses:
                self._checkpoints.move_to_end(superseded, last=False)
        req.hit_checkpoint = None
        slot = self._free_slots.pop() if self._free_slots else self._evict_checkpoint()
        self._checkpoints[key] = slot
        self._ending_at.setdefault(hs[-1], []).append(key)
        self._fresh.add(key)
        req.last_checkpoint = key
        self.checkpoints_taken += 1
        return slot

    def _cache_blocks(self, hs: list[bytes], block_ids: list[int]) -> None:
        for h, block in zip(hs, block_ids, strict=False):
            # A block whose tokens are cached already (another request computed them too) stays req's own.
            if h not in self._by_hash and block not in self.blocks.refs:
                self.blocks.cache(block)
                self._by_hash[h] = block
                self._hash_of[block] = h

    # ---- transfers --------------------------------------------------------------------------------
    def remember(self, req: Request, num_blocks: int) -> None:
        """Cache req's first `num_blocks` blocks, which a transfer filled with their final KV, without a checkpoint:
        a later transfer of a prompt starting with the same tokens reads only the blocks after them."""
        self._cache_blocks(self.hashes(req, num_blocks), req.block_ids)

    def held_prefix(self, tokens: list[int], num_blocks: int) -> list[int]:
        """The cached blocks holding the KV of the first of tokens' `num_blocks` full blocks, in order, as long a
        chain as the cache holds. With an MTP drafter the chain's last block is left out: the drafter's KV at its
        last position read the token after it (R8), which the chain does not say."""
        bs = self.block_size
        out: list[int] = []
        h = self.seed
        for i in range(min(num_blocks, len(tokens) // bs)):
            h = chain_hash(h, tokens[i * bs:(i + 1) * bs])
            block = self._by_hash.get(h)
            if block is None:
                break
            out.append(block)
        return out[:-1] if self.match_successor else out

    def _evict_checkpoint(self) -> int:
        key, slot = self._checkpoints.popitem(last=False)
        keys = self._ending_at[key[0]]
        keys.remove(key)
        if not keys:
            del self._ending_at[key[0]]
        self._fresh.discard(key)
        self._uses.pop(key, None)
        self.checkpoint_evictions += 1
        return slot

    def _block_evicted(self, block: int) -> None:
        """A cached block went back to the free list: its hash and the checkpoints ending on it go too."""
        h = self._hash_of.pop(block)
        del self._by_hash[h]
        for key in self._ending_at.pop(h, ()):
            self._free_slots.append(self._checkpoints.pop(key))
            self._fresh.discard(key)
            self._uses.pop(key, None)
            self.checkpoint_evictions += 1
