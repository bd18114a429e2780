"""Which bytes of which prefill rank a decode rank reads when the two nodes' tensor-parallel sizes differ.

Every pool item (a KV block, a state slot) of a rank is `outer` chunks, each the rank's share of a split dimension
(KV heads; a state's heads or channels) times `unit_bytes` (one head's or channel's bytes): a KV block
[L, 2, block_size, Hkv, D] has L * 2 * block_size chunks of Hkv heads of D elements; a state slot [L, C, ...] has
L chunks of C channels. The split dimension is made of parts (Mamba2's conv channels are x | B | C), each split
evenly over the ranks in rank order, a rank's shares of the parts concatenated (`engine.parallel.shard_weights`).
A part of fewer units than ranks (KV heads) gives each rank one unit, replicated.

A decode rank reads each unit it holds from one prefill rank that holds it (replicas spread over the readers), as
byte pieces within an item: one piece per chunk and source range, or a single whole-item piece where both ranks
hold the same units (equal TP sizes), which then coalesces over consecutive items as the plain plan does.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import torch

from baton.engine.state_spec import StateSpec
from baton.transfer.layout import RegionLayout


class PoolShards(msgspec.Struct, frozen=True):
    outer: int                  # chunks per item, before the split dimension
    parts: tuple[int, ...]      # the split dimension's parts, in units of the whole model
    unit_bytes: int             # one unit (head, channel) of one chunk
    tp_size: int

    def held(self, part: int, rank: int) -> tuple[int, int]:
        """(first unit, count) of `part` that `rank` holds."""
        units, tp = self.parts[part], self.tp_size
        if units >= tp:
            return rank * (units // tp), units // tp
        return rank * units // tp, 1

    def chunk_units(self) -> int:
        """Units one chunk of a rank's item holds."""
        return sum(self.held(p, 0)[1] for p in range(len(self.parts)))

    def item_bytes(self) -> int:
        return self.outer * self.chunk_units() * self.unit_bytes


def _check(shards: PoolShards, name: str) -> None:
    for units in shards.parts:
        if units >= shards.tp_size and units % shards.tp_size or units < shards.tp_size and shards.tp_size % units:
            raise ValueError(f"{name} sharding: expected parts that are multiples or divisors of tp_size "
                             f"{shards.tp_size}, got {shards.parts}")


def pool_shards(pools: dict[str, torch.Tensor], spec: StateSpec, num_kv_heads: int, tp_size: int
                ) -> dict[str, PoolShards]:
    """Each travelling pool's sharding: `pools` as `CachePools.by_name` gives them (this rank's), `spec` the
    mixer's declaration at this rank's shapes, `num_kv_heads` the whole model's."""
    out: dict[str, PoolShards] = {}
    kv = pools["kv"]
    if kv.dim() >= 6:  # [blocks, L, 2, block_size, Hkv, D]
        out["kv"] = PoolShards(outer=math.prod(kv.shape[1:4]), parts=(num_kv_heads,),
                               unit_bytes=kv.shape[5] * kv.element_size(), tp_size=tp_size)
    else:  # a model without attention layers: empty items
        out["kv"] = PoolShards(outer=0, parts=(1,), unit_bytes=0, tp_size=tp_size)
    for t in spec.states:
        pool = pools[t.name]
        out[t.name] = PoolShards(outer=spec.num_layers, parts=tuple(p * tp_size for p in t.parts),
                                 unit_bytes=math.prod(t.shape[1:]) * pool.element_size(), tp_size=tp_size)
    for name, s in out.items():
        _check(s, name)
    return out


def _source(src: PoolShards, part: int, unit: int, dst_rank: int) -> int:
    """The source rank a reader at `dst_rank` takes `unit` of `part` from: one of the ranks holding it."""
    units, tp = src.parts[part], src.tp_size
    if units >= tp:
        return unit // (units // tp)
    holders = [r for r in range(tp) if r * units // tp == unit]
    return holders[dst_rank % len(holders)]


def chunk_pieces(src: PoolShards, dst: PoolShards, dst_rank: int) -> dict[int, list[tuple[int, int, int]]]:
    """Per source rank, the (source unit offset, destination unit offset, units) runs of one chunk that
    `dst_rank` reads from it (offsets within a chunk of each side's item)."""
    if src.parts != dst.parts or src.unit_bytes != dst.unit_bytes or src.outer != dst.outer:
        raise ValueError(f"pool sharding: expected the same whole-model layout on both sides, got {src.outer} "
                         f"chunks of parts {src.parts} x {src.unit_bytes} B (source) and {dst.outer} of "
                         f"{dst.parts} x {dst.unit_bytes} B (destination)")
    out: dict[int, list[tuple[int, int, int]]] = {}
    dst_off = 0
    src_part_off = [0] * src.tp_size  # each source rank's offset of the current part in its chunk
    for p in range(len(dst.parts)):
        d0, dn = dst.held(p, dst_rank)
        for u in range(d0, d0 + dn):
            i = _source(src, p, u, dst_rank)
            s0, _ = src.held(p, i)
            s_off = src_part_off[i] + (u - s0)
            runs = out.setdefault(i, [])
            if runs and runs[-1][0] + runs[-1][2] == s_off and runs[-1][1] + runs[-1][2] == dst_off:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((s_off, dst_off, 1))
            dst_off += 1
        for i in range(src.tp_size):
            src_part_off[i] += src.held(p, i)[1]
    return out


def item_pieces(src: PoolShards, dst: PoolShards, dst_rank: int) -> dict[int, np.ndarray]:
    """Per source rank, the [n, 3] (source byte offset, destination byte offset, bytes) pieces of one item: a
    chunk's runs repeated over the item's chunks, merged into one piece where both sides' chunks are that run."""
    src_chunk, dst_chunk, ub = src.chunk_units(), dst.chunk_units(), src.unit_bytes
    out: dict[int, np.ndarray] = {}
    for i, runs in chunk_pieces(src, dst, dst_rank).items():
        if len(runs) == 1 and runs[0] == (0, 0, src_chunk) and src_chunk == dst_chunk:
            out[i] = np.array([[0, 0, src.outer * src_chunk * ub]], dtype=np.int64)
            continue
        r = np.array(runs, dtype=np.int64)  # [k, 3] in units
        o = np.arange(src.outer, dtype=np.int64)[:, None]
        s_off = (o * src_chunk + r[:, 0]) * ub
        d_off = (o * dst_chunk + r[:, 1]) * ub
        n = np.broadcast_to(r[:, 2] * ub, s_off.shape)
        out[i] = np.stack([s_off.reshape(-1), d_off.reshape(-1), n.reshape(-1)], axis=1)
    return out


def expand(pieces: np.ndarray, local: RegionLayout, remote: RegionLayout, local_ids: np.ndarray,
           remote_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (local rows, remote rows) [n, 3] (addr, bytes, dev) of `pieces` in every item pair (ids as int64)."""
    l_addr = (local.base_addr + local_ids * local.item_bytes)[:, None] + pieces[:, 1]
    r_addr = (remote.base_addr + remote_ids * remote.item_bytes)[:, None] + pieces[:, 0]
    n = np.broadcast_to(pieces[:, 2], l_addr.shape).reshape(-1)
    loc = np.stack([l_addr.reshape(-1), n, np.full_like(n, local.dev_id)], axis=1)
    rem = np.stack([r_addr.reshape(-1), n, np.full_like(n, remote.dev_id)], axis=1)
    return loc, rem
