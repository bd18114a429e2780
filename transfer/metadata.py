"""`AgentMetadata`: what a node publishes on its side channel so that a peer can READ from it.

The compatibility part (`CompatInfo`) must be equal on both sides for a transfer to mean anything: same
model, dtypes, layer layout, whole-model pool layouts (`shard_map.PoolShards`), block size, speculative-decoding
config and protocol. A mismatch is refused with an `IncompatiblePeer` naming the first differing field. The
tensor-parallel sizes may differ: a node of several ranks publishes every rank's agent (`ranks`), and each reading
rank reads the heads and channels it holds from the ranks that hold them (`shard_map`).
"""

from __future__ import annotations

import hashlib
import json

import msgspec

from baton.engine.config import ModelConfig
from baton.transfer.cuda_ipc import IpcRegion
from baton.transfer.errors import IncompatiblePeer
from baton.transfer.layout import RegionLayout
from baton.transfer.shard_map import PoolShards

PROTOCOL_VERSION = 4  # 2: pools keyed by name; 3: tp_size; 4: pool shardings and every rank's agent


class CompatInfo(msgspec.Struct, frozen=True):
    protocol_version: int
    model_fingerprint: str       # sha256 of the model's config.json content
    layer_pattern: str           # hybrid_override_pattern, e.g. "M*M-"
    tp_size: int                 # the node's tensor-parallel ranks (its pools hold one rank's heads); may differ
    block_size: int
    dtypes: dict[str, str]                  # pool name ("kv", then the declared states) -> dtype
    shards: dict[str, PoolShards]           # pool name -> its whole-model layout and how the ranks split it
    num_speculative_tokens: int  # K of MTP decoding (the drafter's KV travels too, R8)
    mtp_layers: int


class RankAgent(msgspec.Struct, frozen=True):
    """One tensor-parallel rank's NIXL agent and pools."""
    tp_rank: int
    agent_name: str
    nixl_metadata: bytes
    regions: dict[str, RegionLayout]


class AgentMetadata(msgspec.Struct, frozen=True):
    engine_id: str
    agent_name: str
    nixl_metadata: bytes
    compat: CompatInfo
    compat_hash: str
    regions: dict[str, RegionLayout]  # "kv", then the state pools
    # Same-host CUDA IPC reads (`transfer.cuda_ipc`): this host's id, and the pools' IPC exports when the
    # node offers them (none by default: peers then READ through NIXL only).
    host_id: str = ""
    ipc: dict[str, IpcRegion] = msgspec.field(default_factory=dict)
    tp_rank: int = 0
    # A node of several ranks: every rank's agent, rank 0's (this one) first; empty at one rank.
    ranks: tuple[RankAgent, ...] = ()

    def rank_agents(self) -> tuple[RankAgent, ...]:
        """Every rank's agent, in rank order."""
        return self.ranks or (RankAgent(self.tp_rank, self.agent_name, self.nixl_metadata, self.regions),)


def single_rank_shards(regions: dict[str, RegionLayout]) -> dict[str, PoolShards]:
    """The sharding of pools that one rank holds whole and that no other TP size reads: each item one unit."""
    return {name: PoolShards(outer=1, parts=(1,), unit_bytes=r.item_bytes, tp_size=1) for name, r in regions.items()}


def model_fingerprint(cfg: ModelConfig) -> str:
    raw = {k: v for k, v in cfg.raw.items() if not k.startswith("_")}
    return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]


def make_compat(cfg: ModelConfig, regions: dict[str, RegionLayout], block_size: int,
                num_speculative_tokens: int = 0, shards: dict[str, PoolShards] | None = None) -> CompatInfo:
    """`shards`: the pools' shardings (`shard_map.pool_shards`); None for pools one rank holds whole."""
    shards = shards if shards is not None else single_rank_shards(regions)
    if set(shards) != set(regions):
        raise ValueError(f"pool shardings: expected one per pool {sorted(regions)}, got {sorted(shards)}")
    tp = {s.tp_size for s in shards.values()}
    if len(tp) != 1:
        raise ValueError(f"pool shardings: expected one tp_size for every pool, got {sorted(tp)}")
    return CompatInfo(
        protocol_version=PROTOCOL_VERSION,
        model_fingerprint=model_fingerprint(cfg),
        layer_pattern=cfg.pattern,
        tp_size=tp.pop(),
        block_size=block_size,
        dtypes={name: r.dtype for name, r in regions.items()},
        shards=dict(shards),
        num_speculative_tokens=num_speculative_tokens,
        mtp_layers=cfg.num_nextn_predict_layers,
    )


def _fields(compat: CompatInfo) -> list[tuple[str, object]]:
    """(name, value) of every compared field, a pool's dtype and layout each as a field of its own ("ssm_dtype",
    "kv_layout": its chunks, whole-model parts and unit bytes), so that a mismatch names the pool. The TP size is
    not compared: any two sizes of one model's layout transfer."""
    out: list[tuple[str, object]] = []
    for field in CompatInfo.__struct_fields__:
        value = getattr(compat, field)
        if field == "dtypes":
            out += [(f"{name}_dtype", v) for name, v in value.items()]
        elif field == "shards":
            out += [(f"{name}_layout", (v.outer, v.parts, v.unit_bytes)) for name, v in value.items()]
        elif field != "tp_size":
            out.append((field, value))
    return out


def compat_hash(compat: CompatInfo) -> str:
    return hashlib.sha256(msgspec.msgpack.encode(compat)).hexdigest()[:16]


def check_compatible(local: AgentMetadata, remote: AgentMetadata) -> None:
    """Raise `IncompatiblePeer` naming the first field that differs (protocol version first)."""
    theirs = dict(_fields(remote.compat))
    mine = dict(_fields(local.compat))
    for field in [*mine, *(f for f in theirs if f not in mine)]:
        if mine.get(field) != theirs.get(field):
            raise IncompatiblePeer(field, mine.get(field), theirs.get(field), peer=remote.engine_id)
    if compat_hash(remote.compat) != remote.compat_hash:
        raise IncompatiblePeer("compat_hash", compat_hash(remote.compat), remote.compat_hash, peer=remote.engine_id)
    if len(remote.rank_agents()) != remote.compat.tp_size:
        raise IncompatiblePeer("ranks", remote.compat.tp_size, len(remote.rank_agents()), peer=remote.engine_id)
