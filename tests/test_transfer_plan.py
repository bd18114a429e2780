"""Descriptor plans: contiguous runs coalesce into one descriptor for all layers; scattered ids do not."""

import numpy as np
import pytest
import torch

from baton.transfer.layout import RegionLayout
from baton.transfer.plan import (
    _one_run,
    block_ids,
    join,
    plan_blocks,
    plan_checked_blocks,
    plan_request,
    plan_slots,
    runs,
)


def regions(num_blocks=32, slots=4):
    kv = torch.zeros(num_blocks, 3, 2, 4, 2, 8)  # [blocks, L_attn, 2, bs, Hkv, D]
    conv = torch.zeros(slots, 2, 40, 3)
    ssm = torch.zeros(slots, 2, 4, 8, 16)
    return {n: RegionLayout.of(n, t) for n, t in (("kv", kv), ("conv", conv), ("ssm", ssm))}, (kv, conv, ssm)


def test_runs_break_where_either_side_jumps():
    def of(lo, re, enabled=True):
        starts, counts = runs(np.array(lo), np.array(re), enabled)
        return list(zip(starts.tolist(), counts.tolist(), strict=True))

    assert of(list(range(10)), list(range(100, 110))) == [(0, 10)]
    # Scattered remote ids: nothing merges.
    assert len(of([0, 1, 2, 3], [9, 4, 7, 1])) == 4
    # Runs break where either side jumps: (index of the run's first id, its length).
    assert of([0, 1, 2, 5, 6], [3, 4, 9, 10, 11]) == [(0, 2), (2, 1), (3, 2)]
    assert len(of(list(range(10)), list(range(10)), enabled=False)) == 10
    assert of([], []) == []
    kv = regions()[0]["kv"]
    with pytest.raises(ValueError, match="as many local as remote"):
        block_ids(kv, kv, [1, 2], [1])


def test_plan_contiguous_vs_scattered_descriptor_counts():
    local, (kv, _, _) = regions()
    remote, (rkv, _, _) = regions()
    # 16 contiguous blocks: ONE descriptor for the KV of all 3 layers, plus one conv and one SSM slot.
    p = plan_request(local, remote, list(range(16)), list(range(8, 24)), 1, 3)
    assert p.num_descriptors == 3
    assert p.num_bytes == 16 * local["kv"].item_bytes + local["conv"].item_bytes + local["ssm"].item_bytes
    assert p.local[0].tolist() == [kv[0].data_ptr(), 16 * local["kv"].item_bytes, 0]
    assert p.remote[0].tolist() == [rkv[8].data_ptr(), 16 * local["kv"].item_bytes, 0]
    # Scattered: one per block. Per-block mode on contiguous ids: one per block too.
    rng = np.random.default_rng(0)
    scattered = rng.permutation(32)[:16].tolist()
    assert plan_request(local, remote, list(range(16)), scattered, 1, 3).num_descriptors == 16 + 2
    per_block = plan_request(local, remote, list(range(16)), list(range(16)), 1, 3, coalesced=False)
    assert per_block.num_descriptors == 18 and per_block.num_bytes == p.num_bytes
    # Peer-style: one per block per layer (3 attention layers here).
    per_layer = plan_request(local, remote, list(range(16)), list(range(16)), 1, 3, coalesced=False,
                             split_layers=True)
    assert per_layer.num_descriptors == 16 * 3 + 2 and per_layer.num_bytes == p.num_bytes
    assert per_layer.local[1, 0] - per_layer.local[0, 0] == local["kv"].item_bytes // 3


def test_plan_rejects_out_of_range_and_mismatched_layouts():
    local, _ = regions()
    remote, _ = regions(num_blocks=8)
    with pytest.raises(ValueError, match="kv item"):
        plan_request(local, remote, [0, 1], [7, 8], 0, 0)
    other = dict(remote, kv=RegionLayout.of("kv", torch.zeros(8, 3, 2, 4, 2, 4)))
    with pytest.raises(ValueError, match="kv layout"):
        plan_request(local, other, [0], [0], 0, 0)


def test_coalesced_plan_moves_exactly_the_per_block_bytes_for_mixed_runs():
    """Runs of every length mixed with jumps on either side: the coalesced descriptors, cut back into blocks,
    are the per-block plan's, in order."""
    local, _ = regions(num_blocks=64)
    remote, _ = regions(num_blocks=64)
    item = local["kv"].item_bytes

    def blocks(rows):
        return [(int(a) + i * item, item, int(d)) for a, ln, d in rows[:-2] for i in range(int(ln) // item)]
    rng = np.random.default_rng(1)
    for _ in range(20):
        n = int(rng.integers(1, 40))
        lo = rng.permutation(64)[:n]
        lo[: n // 2] = np.sort(lo[: n // 2])  # some local runs
        re = rng.permutation(64)[:n]
        re[: n // 3] = np.arange(n // 3) + 5  # some remote runs
        c = plan_request(local, remote, lo.tolist(), re.tolist(), 2, 0)
        b = plan_request(local, remote, lo.tolist(), re.tolist(), 2, 0, coalesced=False)
        assert blocks(c.local) == [tuple(r) for r in b.local[:-2].tolist()]
        assert blocks(c.remote) == [tuple(r) for r in b.remote[:-2].tolist()]
        assert c.local[-2:].tolist() == b.local[-2:].tolist() and c.num_bytes == b.num_bytes == \
            n * item + local["conv"].item_bytes + local["ssm"].item_bytes
        assert c.num_descriptors == len(runs(lo, re)[0]) + 2


def test_a_request_plans_as_its_slot_plus_its_blocks_and_a_pool_without_layers_moves_nothing():
    """The CUDA IPC reader queues the state slot (`plan_slots`, no block ids) before it plans the blocks: the two
    parts joined are exactly `plan_request`'s descriptors; a bad slot or bad block id is refused by its part."""
    local, _ = regions()
    remote, _ = regions(num_blocks=24)
    ids_l, ids_r = [3, 4, 5, 9, 1], [10, 11, 12, 2, 23]
    whole = plan_request(local, remote, ids_l, ids_r, 1, 3)
    slots, blocks = plan_slots(local, remote, 1, 3), plan_blocks(local, remote, ids_l, ids_r)
    assert slots.num_descriptors == 2 and slots.num_bytes == local["conv"].item_bytes + local["ssm"].item_bytes
    joined = join(blocks, slots)
    assert np.array_equal(joined.local, whole.local) and np.array_equal(joined.remote, whole.remote)
    assert joined.num_bytes == whole.num_bytes and joined.num_descriptors == 3 + 2
    with pytest.raises(ValueError, match=r"conv item: expected an id in \[0, 4\), got 4"):
        plan_slots(local, remote, 1, 4)
    with pytest.raises(ValueError, match=r"kv item: expected an id in \[0, 24\), got 24"):
        plan_blocks(local, remote, [0], [24])
    # No attention layers: no KV bytes whatever the block ids; no Mamba layers: no slot descriptors.
    no_kv = dict(local, kv=RegionLayout.of("kv", torch.zeros(32, 0, 2, 4, 2, 8)))
    assert plan_blocks(no_kv, dict(remote, kv=no_kv["kv"]), [0, 1], [0, 1]).num_descriptors == 0
    no_state = {**local, "conv": RegionLayout.of("conv", torch.zeros(4, 0, 40, 3)),
                "ssm": RegionLayout.of("ssm", torch.zeros(4, 0, 4, 8, 16))}
    assert plan_slots(no_state, no_state, 1, 3).num_descriptors == 0


def test_one_run_on_both_sides_plans_from_host_ints_as_the_general_path_does():
    """Lists that are one run on both sides (most transfers, `engine/allocator.py`) take a path without numpy; its
    plan is the general path's. Anything else (a jump, numpy ids, a run past the pool, unequal lengths, another
    layout) is left to the general path, which plans or refuses it."""
    local, _ = regions(num_blocks=32)
    remote, _ = regions(num_blocks=24)

    def general(lo, re):
        return plan_checked_blocks(local, remote, np.array(lo, dtype=np.int64), np.array(re, dtype=np.int64))

    cases = (([3], [20]), (list(range(32)), list(range(24)) + list(range(8))), (list(range(5, 29)), list(range(24))))
    for lo, re in cases:
        fast = _one_run(local["kv"], remote["kv"], lo, re)
        want = general(lo, re)
        if len(runs(np.array(lo), np.array(re))[0]) != 1:
            assert fast is None
            continue
        assert fast is not None and fast.num_bytes == want.num_bytes
        assert np.array_equal(fast.local, want.local) and np.array_equal(fast.remote, want.remote)
        assert fast.local.dtype == fast.remote.dtype == np.int64
    kv, rkv = local["kv"], remote["kv"]
    assert _one_run(kv, rkv, [0, 1, 3], [0, 1, 2]) is None  # a jump
    assert _one_run(kv, rkv, [0, 2, 1, 3], [0, 1, 2, 3]) is None  # first and last fit, the middle does not
    assert _one_run(kv, rkv, np.arange(4), [0, 1, 2, 3]) is None  # numpy: the general path
    assert _one_run(kv, rkv, [0, 1], [23, 24]) is None  # past the remote pool: refused below
    assert _one_run(kv, rkv, [0, 1], [0, 1, 2]) is None
    other = RegionLayout.of("kv", torch.zeros(8, 3, 2, 4, 2, 4))
    assert _one_run(kv, other, [0, 1], [0, 1]) is None
    with pytest.raises(ValueError, match=r"kv item: expected an id in \[0, 24\), got 24"):
        plan_blocks(local, remote, [0, 1], [23, 24])
    with pytest.raises(ValueError, match="kv layout"):
        plan_blocks(local, dict(remote, kv=other), [0, 1], [0, 1])
    with pytest.raises(ValueError, match="as many local as remote"):
        plan_blocks(local, remote, [0, 1], [0, 1, 2])
    # Per block, and per block per layer, never take it.
    assert plan_blocks(local, remote, [0, 1, 2], [4, 5, 6], coalesced=False).num_descriptors == 3
