"""The READ plans of one rank from a peer node when either node runs several tensor-parallel ranks: one plan per
peer rank it reads from (`shard_map`), each that rank's pieces of the request's blocks and state slot.

Where this rank and a peer rank hold the same heads and channels (equal TP sizes), the pieces are whole items and
the blocks coalesce into runs as a plain READ's do; otherwise each block is one descriptor per chunk and source
range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from baton.transfer.layout import RegionLayout
from baton.transfer.metadata import AgentMetadata
from baton.transfer.plan import TransferPlan, block_ids, join, plan_checked_blocks, state_names
from baton.transfer.shard_map import PoolShards, expand, item_pieces


@dataclass
class ShardedPeer:
    remote: AgentMetadata
    # Per pool, per peer rank read from: the [n, 3] (source offset, destination offset, bytes) pieces of an item.
    pieces: dict[str, dict[int, np.ndarray]]
    # NIXL agent names of the peer ranks loaded (those read, and rank 0 for the notification).
    names: dict[int, str] = field(default_factory=dict)

    @property
    def sources(self) -> list[int]:
        """The peer ranks this rank reads from."""
        return sorted({i for by_rank in self.pieces.values() for i in by_rank})

    @classmethod
    def of(cls, remote: AgentMetadata, mine: dict[str, PoolShards], my_rank: int) -> ShardedPeer:
        theirs = remote.compat.shards
        return cls(remote, {name: item_pieces(theirs[name], mine[name], my_rank) for name in mine
                            if mine[name].outer and mine[name].unit_bytes})

    def regions(self, rank: int) -> dict[str, RegionLayout]:
        return self.remote.rank_agents()[rank].regions


def _whole(pieces: np.ndarray, local: RegionLayout, remote: RegionLayout) -> bool:
    return (len(pieces) == 1 and int(pieces[0, 0]) == int(pieces[0, 1]) == 0
            and int(pieces[0, 2]) == local.item_bytes == remote.item_bytes)


def _rows(loc: np.ndarray, rem: np.ndarray) -> TransferPlan:
    return TransferPlan(local=loc, remote=rem, num_bytes=int(loc[:, 1].sum()))


def plan_sharded(peer: ShardedPeer, local: dict[str, RegionLayout], local_blocks: list[int],
                 remote_blocks: list[int], local_slot: int, remote_slot: int) -> dict[int, TransferPlan]:
    """Per peer rank read from, the plan of its pieces of the request (ValueError for ids outside a pool)."""
    out: dict[int, TransferPlan] = {}
    for rank in peer.sources:
        regions = peer.regions(rank)
        plans: list[TransferPlan] = []
        kv_pieces = peer.pieces.get("kv", {}).get(rank)
        if kv_pieces is not None and len(local_blocks):
            lo, re = local["kv"], regions["kv"]
            if _whole(kv_pieces, lo, re):
                ids_l, ids_r = block_ids(lo, re, local_blocks, remote_blocks)
                plans.append(plan_checked_blocks(local, regions, ids_l, ids_r))
            else:
                ids_l, ids_r = _checked_ids(lo, re, local_blocks, remote_blocks)
                plans.append(_rows(*expand(kv_pieces, lo, re, ids_l, ids_r)))
        for name in state_names(local):
            pieces = peer.pieces.get(name, {}).get(rank)
            if pieces is None:
                continue
            lo, re = local[name], regions[name]
            ids_l, ids_r = _checked_ids(lo, re, [local_slot], [remote_slot])
            plans.append(_rows(*expand(pieces, lo, re, ids_l, ids_r)))
        if plans:
            out[rank] = join(*plans)
    return out


def _checked_ids(local: RegionLayout, remote: RegionLayout, local_ids: list[int], remote_ids: list[int]
                 ) -> tuple[np.ndarray, np.ndarray]:
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"block ids: expected as many local as remote ids, got {len(local_ids)} local, "
                         f"{len(remote_ids)} remote")
    lo, re = np.asarray(local_ids, dtype=np.int64).reshape(-1), np.asarray(remote_ids, dtype=np.int64).reshape(-1)
    for layout, ids in ((local, lo), (remote, re)):
        bad = ids[(ids < 0) | (ids >= layout.num_items)]
        if bad.size:
            raise ValueError(f"{layout.name} item: expected an id in [0, {layout.num_items}), got {int(bad[0])}")
    return lo, re
