"""An approximate, per-worker index of the prompt prefixes a worker recently computed, from the router's own
routing history (prefix affinity, issue #51).

A prompt's full blocks are hashed as a chain: the hash of block i covers the model identity (the seed) and every
token of blocks 0..i, so one hash stands for a whole prefix, as in the engine's prefix cache. The index is an LRU
of such hashes, bounded in blocks; it predicts what a worker's cache holds, it does not know it (the worker may
have evicted it since), so it only ever biases where a request goes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

DIGEST_BYTES = 8


def chain_seed(model_identity: str) -> bytes:
    """The hash a chain starts from: blocks of different models never share a hash."""
    return hashlib.blake2b(model_identity.encode(), digest_size=DIGEST_BYTES).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, seed: bytes) -> list[bytes]:
    """The chained hashes of the full blocks of `token_ids` (a trailing partial block has none)."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size: expected an integer >= 1, got {block_size!r}")
    out: list[bytes] = []
    prev = seed
    # Token ids are uint32 on the wire: their native 4-byte encoding is stable within this process.
    data = array("I", token_ids).tobytes()
    step = 4 * block_size
    for end in range(step, len(data) + 1, step):
        prev = hashlib.blake2b(prev + data[end - step:end], digest_size=DIGEST_BYTES).digest()
        out.append(prev)
    return out


class PrefixIndex:
    """Chained block hashes a worker recently computed, least recently recorded evicted first, at most `capacity`
    of them. Invariant: a chain is recorded deepest block first, so within one chain a block is never evicted
    before the blocks after it, and a leading walk (`hit_blocks`) loses a prefix from its end."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"PrefixIndex capacity: expected an integer >= 1, got {capacity!r}")
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def record(self, chain: Sequence[bytes]) -> None:
        """The worker was sent a prompt whose full blocks hash to `chain`: it will hold them."""
        for h in reversed(chain):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def hit_blocks(self, chain: Sequence[bytes]) -> int:
        """How many leading blocks of `chain` the worker is expected to hold: the walk stops at the first miss,
        since a block's cached state is usable only after every block before it."""
        n = 0
        for h in chain:
            if h not in self._lru:
                break
            n += 1
        return n

    def clear(self) -> None:
        self._lru.clear()
