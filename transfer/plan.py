"""Descriptor plans: which byte ranges a READ moves, coalesced into contiguous runs.

A run is a stretch where both the local and the remote item ids are consecutive; with id-major pools
(one item = that block or slot of every layer) a run is ONE descriptor whatever the number of layers.
Peers issue one descriptor per block per layer; on NVLink 2,048 scattered 256 KiB descriptors reached
44-59 GB/s against 394 GB/s for one region, hence the coalescing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baton.transfer.layout import RegionLayout


@dataclass(frozen=True)
class Run:
    local_start: int
    remote_start: int
    count: int


def coalesce(local_ids: list[int] | tuple[int, ...], remote_ids: list[int] | tuple[int, ...],
             enabled: bool = True) -> list[Run]:
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"block ids: expected as many local as remote ids, got {len(local_ids)} local, "
                         f"{len(remote_ids)} remote")
    runs: list[Run] = []
    for lo, re in zip(local_ids, remote_ids, strict=True):
        last = runs[-1] if runs else None
        if (enabled and last is not None and lo == last.local_start + last.count
                and re == last.remote_start + last.count):
            runs[-1] = Run(last.local_start, last.remote_start, last.count + 1)
        else:
            runs.append(Run(lo, re, 1))
    return runs


@dataclass(frozen=True)
class TransferPlan:
    local: np.ndarray   # [n, 3] int64 rows (addr, length, dev_id): where the bytes land
    remote: np.ndarray  # [n, 3] int64 rows: where they are read from
    num_bytes: int

    @property
    def num_descriptors(self) -> int:
        return int(self.local.shape[0])


def _check_pair(local: RegionLayout, remote: RegionLayout) -> None:
    if (local.item_bytes, local.item_shape, local.dtype) != (remote.item_bytes, remote.item_shape, remote.dtype):
        raise ValueError(f"{local.name} layout: expected the peer's item {remote.item_shape} {remote.dtype} "
                         f"({remote.item_bytes} B), got {local.item_shape} {local.dtype} ({local.item_bytes} B)")


def plan_request(local: dict[str, RegionLayout], remote: dict[str, RegionLayout],
                 local_blocks: list[int], remote_blocks: list[int], local_slot: int, remote_slot: int,
                 coalesced: bool = True, split_layers: bool = False) -> TransferPlan:
    """The READ of one request: its KV blocks, then its conv and SSM state slot.

    `coalesced=False` issues one descriptor per block; `split_layers=True` additionally one per layer of
    each block (how peers with per-layer caches transfer; kept for the benchmark's comparison).
    """
    rows_l: list[tuple[int, int, int]] = []
    rows_r: list[tuple[int, int, int]] = []

    def add(name: str, runs: list[Run]) -> None:
        lo, re = local[name], remote[name]
        _check_pair(lo, re)
        pieces = lo.item_shape[0] if split_layers and name == "kv" else 1
        piece = lo.item_bytes // pieces
        for run in runs:
            # Both ends of the run must lie inside their pools.
            lo.item_addr(run.local_start + run.count - 1)
            re.item_addr(run.remote_start + run.count - 1)
            if pieces == 1:
                n = run.count * lo.item_bytes
                rows_l.append((lo.item_addr(run.local_start), n, lo.dev_id))
                rows_r.append((re.item_addr(run.remote_start), n, re.dev_id))
                continue
            for i in range(run.count):
                for k in range(pieces):
                    rows_l.append((lo.item_addr(run.local_start + i) + k * piece, piece, lo.dev_id))
                    rows_r.append((re.item_addr(run.remote_start + i) + k * piece, piece, re.dev_id))

    # A pool with no layers (no attention, or no Mamba layers) moves nothing.
    if local_blocks and local["kv"].item_bytes:
        add("kv", coalesce(local_blocks, remote_blocks, enabled=coalesced))
    for name in ("conv", "ssm"):
        if local[name].item_bytes:
            add(name, [Run(local_slot, remote_slot, 1)])
    return TransferPlan(local=_descs(rows_l), remote=_descs(rows_r), num_bytes=sum(r[1] for r in rows_l))


def _descs(rows: list[tuple[int, int, int]]) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(-1, 3)
