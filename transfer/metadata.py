"""`AgentMetadata`: what a node publishes on its side channel so that a peer can READ from it.

The compatibility part (`CompatInfo`) must be equal on both sides for a transfer to mean anything: same
model, tensor-parallel size, dtypes, layer layout, cache item shapes, block size, speculative-decoding config and
protocol. A mismatch is refused with an `IncompatiblePeer` naming the first differing field; nodes of more than one
tensor-parallel rank are refused too (`check_compatible`: their pools hold one rank's shard).
"""

from __future__ import annotations

import hashlib
import json

import msgspec

from baton.engine.config import ModelConfig
from baton.transfer.cuda_ipc import IpcRegion
from baton.transfer.errors import IncompatiblePeer, TransferError
from baton.transfer.layout import RegionLayout

PROTOCOL_VERSION = 3  # 2: pools keyed by name (the mixer's declared states) in CompatInfo; 3: tp_size


class CompatInfo(msgspec.Struct, frozen=True):
    protocol_version: int
    model_fingerprint: str       # sha256 of the model's config.json content
    layer_pattern: str           # hybrid_override_pattern, e.g. "M*M-"
    tp_size: int                 # the node's tensor-parallel ranks (its pools hold one rank's heads)
    block_size: int
    dtypes: dict[str, str]                  # pool name ("kv", then the declared states) -> dtype
    item_shapes: dict[str, tuple[int, ...]]  # pool name -> one item's shape
    num_speculative_tokens: int  # K of MTP decoding (the drafter's KV travels too, R8)
    mtp_layers: int


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


def model_fingerprint(cfg: ModelConfig) -> str:
    raw = {k: v for k, v in cfg.raw.items() if not k.startswith("_")}
    return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]


def make_compat(cfg: ModelConfig, regions: dict[str, RegionLayout], block_size: int,
                num_speculative_tokens: int = 0, tp_size: int = 1) -> CompatInfo:
    return CompatInfo(
        protocol_version=PROTOCOL_VERSION,
        model_fingerprint=model_fingerprint(cfg),
        layer_pattern=cfg.pattern,
        tp_size=tp_size,
        block_size=block_size,
        dtypes={name: r.dtype for name, r in regions.items()},
        item_shapes={name: r.item_shape for name, r in regions.items()},
        num_speculative_tokens=num_speculative_tokens,
        mtp_layers=cfg.num_nextn_predict_layers,
    )


def _fields(compat: CompatInfo) -> list[tuple[str, object]]:
    """(name, value) of every compared field, a pool's dtype and item shape each as a field of its own
    ("ssm_dtype", "kv_item_shape"), so that a mismatch names the pool."""
    out: list[tuple[str, object]] = []
    for field in CompatInfo.__struct_fields__:
        value = getattr(compat, field)
        if field == "dtypes":
            out += [(f"{name}_dtype", v) for name, v in value.items()]
        elif field == "item_shapes":
            out += [(f"{name}_item_shape", v) for name, v in value.items()]
        else:
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
    if local.compat.tp_size > 1:
        # TODO(#50): each rank reads its shard from the prefill rank that holds it.
        raise TransferError(f"peer {remote.engine_id!r}: expected nodes of one tensor-parallel rank for a transfer, "
                            f"got tp_size {local.compat.tp_size} on both (a rank's pools hold only its shard)",
                            peer=remote.engine_id)
