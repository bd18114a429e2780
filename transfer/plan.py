"""Descriptor plans: which byte ranges a READ moves, coalesced into contiguous runs.

A run is a stretch where both the local and the remote item ids are consecutive; with id-major pools
(one item = that block or slot of every layer) a run is ONE descriptor whatever the number of layers.
Peers issue one descriptor per block per layer; many small descriptors reach a fraction of the link's bandwidth
that one large region does, hence the coalescing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baton.transfer.layout import RegionLayout

Ids = list[int] | tuple[int, ...] | np.ndarray  # block ids, as callers hold them


def runs(local_ids: np.ndarray, remote_ids: np.ndarray, enabled: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(first index, length) of each run: it breaks where either side's next id is not the one after (every id
    is its own run when not `enabled`)."""
    n = len(local_ids)
    if not enabled:
        return np.arange(n), np.ones(n, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(local_ids) != 1) | (np.diff(remote_ids) != 1)) + 1
    starts = np.concatenate(([0], breaks)) if n else breaks
    return starts, np.diff(np.concatenate((starts, [n])))


def _check_lengths(local_ids: Ids, remote_ids: Ids) -> None:
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"block ids: expected as many local as remote ids, got {len(local_ids)} local, "
                         f"{len(remote_ids)} remote")


def _ids(ids: Ids) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64).reshape(-1)


@dataclass(frozen=True)
class TransferPlan:
    local: np.ndarray   # [n, 3] int64 rows (addr, length, dev_id): where the bytes land
    remote: np.ndarray  # [n, 3] int64 rows: where they are read from
    num_bytes: int

    @property
    def num_descriptors(self) -> int:
        return int(self.local.shape[0])


def same_item(local: RegionLayout, remote: RegionLayout) -> bool:
    return (local.item_bytes, local.item_shape, local.dtype) == (remote.item_bytes, remote.item_shape, remote.dtype)


def check_pair(local: RegionLayout, remote: RegionLayout) -> None:
    if not same_item(local, remote):
        raise ValueError(f"{local.name} layout: expected the peer's item {remote.item_shape} {remote.dtype} "
                         f"({remote.item_bytes} B), got {local.item_shape} {local.dtype} ({local.item_bytes} B)")


def _check_ids(layout: RegionLayout, ids: np.ndarray) -> None:
    bad = ids[(ids < 0) | (ids >= layout.num_items)]
    if bad.size:
        raise ValueError(f"{layout.name} item: expected an id in [0, {layout.num_items}), got {int(bad[0])}")


def plan_request(local: dict[str, RegionLayout], remote: dict[str, RegionLayout],
                 local_blocks: list[int], remote_blocks: list[int], local_slot: int, remote_slot: int,
                 coalesced: bool = True, split_layers: bool = False) -> TransferPlan:
    """The READ of one request: its KV blocks, then its state slot in every state pool.

    `coalesced=False` issues one descriptor per block; `split_layers=True` additionally one per layer of
    each block (how peers with per-layer caches transfer; kept for the benchmark's comparison). Built with
    numpy, and from host ints where the ids are one run on both sides (`_one_run`), because a Python loop over a
    long request's block ids would take a large share of the READ's own time.
    """
    return join(plan_blocks(local, remote, local_blocks, remote_blocks, coalesced, split_layers),
                plan_slots(local, remote, local_slot, remote_slot))


def plan_slots(local: dict[str, RegionLayout], remote: dict[str, RegionLayout], local_slot: int,
               remote_slot: int) -> TransferPlan:
    """A request's state slot: one descriptor per state pool (every region but "kv", in the local order; none for
    a pool without layers).

    Plain ints, no block ids: a reader can start these bytes (a third of a 16k-token request, all of a short
    one) before it plans the blocks."""
    rows_l, rows_r = [], []
    for name in state_names(local):
        lo, re = local[name], remote[name]
        if lo.item_bytes:
            check_pair(lo, re)
            rows_l.append((lo.item_addr(local_slot), lo.item_bytes, lo.dev_id))
            rows_r.append((re.item_addr(remote_slot), re.item_bytes, re.dev_id))
    loc = np.array(rows_l, dtype=np.int64).reshape(-1, 3)
    return TransferPlan(local=loc, remote=np.array(rows_r, dtype=np.int64).reshape(-1, 3),
                        num_bytes=int(loc[:, 1].sum()))


def state_names(regions: dict[str, RegionLayout]) -> list[str]:
    """The state pools' names: every region but the KV pool, as the engine declared them."""
    return [name for name in regions if name != "kv"]


def plan_blocks(local: dict[str, RegionLayout], remote: dict[str, RegionLayout], local_blocks: Ids,
                remote_blocks: Ids, coalesced: bool = True, split_layers: bool = False) -> TransferPlan:
    """A request's KV blocks: one descriptor per run of consecutive ids on both sides (see `plan_request`)."""
    if coalesced and not split_layers:
        one = _one_run(local["kv"], remote["kv"], local_blocks, remote_blocks)
        if one is not None:
            return one
    lo_ids, re_ids = block_ids(local["kv"], remote["kv"], local_blocks, remote_blocks)
    return plan_checked_blocks(local, remote, lo_ids, re_ids, coalesced, split_layers)


def _first_of_run(ids: Ids) -> int | None:
    """The first id of a Python list of ints that is one run of consecutive ids, else None (anything else)."""
    if type(ids) is not list or not ids or type(ids[0]) is not int or type(ids[-1]) is not int:
        return None
    first = ids[0]
    if ids[-1] - first != len(ids) - 1:
        return None
    return first if ids == list(range(first, first + len(ids))) else None


def _one_run(lo: RegionLayout, re: RegionLayout, local_blocks: Ids, remote_blocks: Ids) -> TransferPlan | None:
    """The plan of block ids that are one run on both sides, in range, of one layout (what the allocator gives a
    request in most transfers: `engine/allocator.py`), built from host ints; None for anything else, which the
    general path plans (or refuses). It skips the general path's numpy work, which sits on the READ's critical
    path."""
    first_l, first_r = _first_of_run(local_blocks), _first_of_run(remote_blocks)
    n = len(local_blocks)
    if (first_l is None or first_r is None or n != len(remote_blocks) or not lo.item_bytes or not same_item(lo, re)
            or first_l < 0 or first_r < 0 or first_l + n > lo.num_items or first_r + n > re.num_items):
        return None
    size = n * lo.item_bytes
    return TransferPlan(local=np.array([[lo.base_addr + first_l * lo.item_bytes, size, lo.dev_id]], dtype=np.int64),
                        remote=np.array([[re.base_addr + first_r * re.item_bytes, size, re.dev_id]], dtype=np.int64),
                        num_bytes=size)


def plan_checked_blocks(local: dict[str, RegionLayout], remote: dict[str, RegionLayout], lo_ids: np.ndarray,
                        re_ids: np.ndarray, coalesced: bool = True, split_layers: bool = False) -> TransferPlan:
    """`plan_blocks` of ids `block_ids` returned (checked, int64): a caller that checked them already plans
    without checking twice."""
    lo, re = local["kv"], remote["kv"]
    if not len(lo_ids) or not lo.item_bytes:  # a pool with no attention layers moves nothing
        empty = np.zeros((0, 3), dtype=np.int64)
        return TransferPlan(local=empty, remote=empty, num_bytes=0)
    pieces = lo.item_shape[0] if split_layers else 1
    if pieces == 1:
        starts, counts = runs(lo_ids, re_ids, coalesced)
        nbytes = counts * lo.item_bytes
        l_addr, r_addr = lo_ids[starts] * lo.item_bytes + lo.base_addr, re_ids[starts] * re.item_bytes + re.base_addr
    else:  # every block's layers apart
        piece = lo.item_bytes // pieces
        k = np.arange(pieces, dtype=np.int64) * piece
        l_addr = ((lo_ids * lo.item_bytes + lo.base_addr)[:, None] + k).reshape(-1)
        r_addr = ((re_ids * re.item_bytes + re.base_addr)[:, None] + k).reshape(-1)
        nbytes = np.full(len(l_addr), piece, dtype=np.int64)
    return TransferPlan(local=np.stack([l_addr, nbytes, np.full_like(nbytes, lo.dev_id)], axis=1),
                        remote=np.stack([r_addr, nbytes, np.full_like(nbytes, re.dev_id)], axis=1),
                        num_bytes=int(nbytes.sum()))


def block_ids(local: RegionLayout, remote: RegionLayout, local_blocks: Ids,
              remote_blocks: Ids) -> tuple[np.ndarray, np.ndarray]:
    """The block ids as int64 arrays, checked: as many on both sides, each inside its pool, the same item layout
    (an empty list, or a pool without attention layers, passes with no further check)."""
    _check_lengths(local_blocks, remote_blocks)
    lo_ids, re_ids = _ids(local_blocks), _ids(remote_blocks)
    if len(lo_ids) and local.item_bytes:
        check_pair(local, remote)
        _check_ids(local, lo_ids)
        _check_ids(remote, re_ids)
    return lo_ids, re_ids


def empty_plan() -> TransferPlan:
    """A plan that moves nothing."""
    empty = np.zeros((0, 3), dtype=np.int64)
    return TransferPlan(local=empty, remote=empty, num_bytes=0)


def join(*plans: TransferPlan) -> TransferPlan:
    """One plan of several, in order (one READ's descriptor lists)."""
    return TransferPlan(local=np.concatenate([p.local for p in plans]),
                        remote=np.concatenate([p.remote for p in plans]),
                        num_bytes=sum(p.num_bytes for p in plans))
