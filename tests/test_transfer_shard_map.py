"""Heterogeneous tensor-parallel transfer maps (transfer/shard_map.py): reading, with the pieces the map gives, from
the ranks of a TP = a node into a rank of a TP = b node yields exactly the shard that rank would hold of the whole
model's tensor, for KV blocks (replicated heads included) and segmented state channels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.engine.config import ModelConfig
from baton.engine.layers.gated_deltanet import GatedDeltaNetMixer
from baton.engine.layers.mamba2 import Mamba2Mixer
from baton.engine.make_model import build_config
from baton.engine.parallel.shard_config import shard_config
from baton.engine.state_spec import StateSpec
from baton.transfer.layout import RegionLayout
from baton.transfer.shard_map import PoolShards, chunk_pieces, expand, item_pieces, pool_shards


def shard(full: torch.Tensor, dim: int, parts: tuple[int, ...], tp: int, rank: int) -> torch.Tensor:
    """A rank's share of each part of `full` along `dim` (one unit, replicated, where a part has fewer than tp)."""
    out = []
    for seg in full.split(list(parts), dim=dim):
        units = seg.shape[dim]
        if units >= tp:
            out.append(seg.narrow(dim, rank * (units // tp), units // tp))
        else:
            out.append(seg.narrow(dim, rank * units // tp, 1))
    return torch.cat(out, dim=dim).contiguous()


def layout(name: str, pool: torch.Tensor) -> RegionLayout:
    """A pool's layout addressed from 0 (offsets into its own bytes), for copying with numpy."""
    return RegionLayout(name=name, base_addr=0, num_items=pool.shape[0], item_bytes=pool[0].numel() * pool.element_size(),
                        item_shape=tuple(pool.shape[1:]), dtype=str(pool.dtype), mem_type="DRAM", dev_id=0)


def read(dst: torch.Tensor, srcs: list[torch.Tensor], shards_src: PoolShards, shards_dst: PoolShards, dst_rank: int,
         local_ids: list[int], remote_ids: list[int]) -> int:
    """Copy what `dst_rank` reads from every source rank into `dst`; returns the descriptors it took."""
    out = dst.view(torch.uint8).reshape(-1).numpy()
    n = 0
    for i, pieces in item_pieces(shards_src, shards_dst, dst_rank).items():
        src = srcs[i].view(torch.uint8).reshape(-1).numpy()
        loc, rem = expand(pieces, layout("x", dst), layout("x", srcs[i]), np.array(local_ids), np.array(remote_ids))
        for (la, ln, _), (ra, rn, _) in zip(loc, rem, strict=True):
            assert ln == rn
            out[la:la + ln] = src[ra:ra + rn]
        n += len(loc)
    return n


PAIRS = [(1, 2), (2, 1), (4, 2), (2, 4), (1, 4), (4, 1), (2, 2), (4, 4)]


@pytest.mark.parametrize("a,b", PAIRS)
@pytest.mark.parametrize("heads", [1, 2, 4, 8])
def test_kv_blocks_between_tp_sizes_land_as_the_readers_shard(a, b, heads):
    torch.manual_seed(0)
    L, bs, D, items = 3, 4, 8, 6
    full = torch.randn(items, L, 2, bs, heads, D, dtype=torch.bfloat16)
    src = [shard(full, 4, (heads,), a, i) for i in range(a)]
    s_src = PoolShards(outer=L * 2 * bs, parts=(heads,), unit_bytes=D * 2, tp_size=a)
    s_dst = PoolShards(outer=L * 2 * bs, parts=(heads,), unit_bytes=D * 2, tp_size=b)
    assert s_src.item_bytes() == src[0][0].numel() * 2
    remote_ids, local_ids = [0, 1, 2, 5], [3, 4, 0, 1]
    for j in range(b):
        want = shard(full, 4, (heads,), b, j)
        got = torch.zeros_like(want)
        descriptors = read(got, src, s_src, s_dst, j, local_ids, remote_ids)
        for lo, re in zip(local_ids, remote_ids, strict=True):
            assert torch.equal(got[lo], want[re]), (a, b, heads, j)
        untouched = [i for i in range(items) if i not in local_ids]
        assert not got[untouched].any()
        if a == b or min(heads, a) == min(heads, b) == heads and heads < min(a, b):
            assert descriptors == len(local_ids)  # the same heads on both sides: one piece per item


@pytest.mark.parametrize("a,b", PAIRS)
def test_segmented_state_channels_between_tp_sizes(a, b):
    torch.manual_seed(1)
    L, k, items = 2, 3, 3
    parts = (16, 8, 8)  # x | B | C of the whole model
    full = torch.randn(items, L, sum(parts), k)
    src = [shard(full, 2, parts, a, i) for i in range(a)]
    s_src = PoolShards(outer=L, parts=parts, unit_bytes=k * 4, tp_size=a)
    s_dst = PoolShards(outer=L, parts=parts, unit_bytes=k * 4, tp_size=b)
    for j in range(b):
        want = shard(full, 2, parts, b, j)
        got = torch.zeros_like(want)
        read(got, src, s_src, s_dst, j, [2], [1])
        assert torch.equal(got[2], want[1])
        assert not got[:2].any()


def test_replicated_heads_are_read_from_each_holder_in_turn():
    # Two KV heads over four prefill ranks (each head on two of them), read by four decode ranks: the readers of a
    # head share its holders instead of all reading one.
    src = PoolShards(outer=1, parts=(2,), unit_bytes=4, tp_size=4)
    dst = PoolShards(outer=1, parts=(2,), unit_bytes=4, tp_size=4)
    assert [next(iter(chunk_pieces(src, dst, j))) for j in range(4)] == [0, 1, 2, 3]
    narrow = PoolShards(outer=1, parts=(2,), unit_bytes=4, tp_size=1)
    assert chunk_pieces(src, narrow, 0) == {0: [(0, 0, 1)], 2: [(0, 1, 1)]}


def test_layouts_that_differ_are_refused():
    a = PoolShards(outer=2, parts=(4,), unit_bytes=8, tp_size=2)
    with pytest.raises(ValueError, match="same whole-model layout"):
        chunk_pieces(a, PoolShards(outer=2, parts=(8,), unit_bytes=8, tp_size=1), 0)
    with pytest.raises(ValueError, match="multiples or divisors"):
        pool_shards({"kv": torch.zeros(2, 1, 2, 4, 1, 8)}, StateSpec(num_layers=0), num_kv_heads=3, tp_size=2)


@pytest.mark.parametrize("preset", ["tiny", "qwen3.5-tiny"])
@pytest.mark.parametrize("tp", [1, 2])
def test_pool_shards_of_a_mixers_declared_states_match_its_pools(preset, tp):
    full = ModelConfig.from_hf_dict(build_config(preset))
    cfg = shard_config(full, tp)
    mixer = GatedDeltaNetMixer if preset.startswith("qwen") else Mamba2Mixer
    spec = mixer.state_spec(cfg, 2)
    pools = {"kv": torch.zeros(5, 1, 2, 4, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16)}
    for t in spec.states:
        pools[t.name] = torch.zeros(3, spec.num_layers, *t.shape)
    shards = pool_shards(pools, spec, num_kv_heads=full.num_key_value_heads, tp_size=tp)
    for name, pool in pools.items():
        assert shards[name].item_bytes() == pool[0].numel() * pool.element_size(), name
    whole = mixer.state_spec(full, 2)
    for t in whole.states:
        assert shards[t.name].parts == t.parts, t.name  # the whole model's parts, whatever the rank's
    assert shards["kv"].parts == (full.num_key_value_heads,)
