"""The CUDA IPC reader's block-copy kernel (`baton.transfer.block_copy`) against its torch reference: scattered
ids, block sizes that end inside a loop iteration, bad ids refused before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.transfer.block_copy import copy_blocks, copy_blocks_reference


def scattered(rng: np.random.Generator, n_items: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.permutation(n_items)[:count].astype(np.int64), rng.permutation(n_items)[:count].astype(np.int64)


@pytest.mark.parametrize("item_bytes, block_words", [(200, 8), (256, 32), (1024, 16)])
def test_block_copy_kernel_equals_torch_reference_on_scattered_ids(item_bytes, block_words):
    rng = np.random.default_rng(item_bytes)
    n_items = 64
    src = torch.randint(1, 256, (n_items * item_bytes,), dtype=torch.uint8)
    lo, re = scattered(rng, n_items, 23)
    got, ref = torch.zeros_like(src), torch.zeros_like(src)
    copy_blocks(got, src, lo, re, item_bytes, block_words=block_words, num_warps=1)
    copy_blocks_reference(ref, src, lo, re, item_bytes)
    assert torch.equal(got, ref)
    assert int((ref != 0).sum()) == 23 * item_bytes  # exactly the 23 blocks (src has no zero byte)
    d, s = int(lo[5]), int(re[5])
    assert torch.equal(ref[d * item_bytes:(d + 1) * item_bytes], src[s * item_bytes:(s + 1) * item_bytes])


def test_block_copy_refuses_bad_ids_and_sizes_and_writes_nothing():
    src = torch.randint(1, 256, (512,), dtype=torch.uint8)
    dst = torch.zeros(256, dtype=torch.uint8)
    ids = np.array([0, 1], dtype=np.int64)
    cases = [  # (local ids, remote ids, block bytes, message)
        (np.array([0, 4]), ids, 64, r"local block ids in \[0, 4\), got 4"),
        (ids, np.array([-1, 0]), 64, r"remote block ids in \[0, 8\), got -1"),
        (ids, np.array([0]), 64, "as many local as remote"),
        (ids, ids, 60, "multiple of 8"),
    ]
    for lo, re, item, match in cases:
        for fn in (copy_blocks, copy_blocks_reference):
            with pytest.raises(ValueError, match=match):
                fn(dst, src, lo.astype(np.int64), re.astype(np.int64), item)
    with pytest.raises(ValueError, match="flat uint8"):
        copy_blocks(dst.view(torch.int16), src, ids, ids, 64)
    assert not dst.any()
    empty = np.zeros(0, dtype=np.int64)
    copy_blocks(dst, src, empty, empty, 64)  # nothing to copy: a no-op
    assert not dst.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_block_copy_equals_reference_at_8b_like_block_size():
    """1,024 scattered 256 KiB blocks: a 16k-token 8b-like request's KV."""
    rng = np.random.default_rng(0)
    item, n_items = 256 << 10, 2048
    src = torch.randint(0, 256, (n_items * item,), dtype=torch.uint8, device="cuda")
    lo, re = scattered(rng, n_items, 1024)
    got, ref = torch.zeros_like(src), torch.zeros_like(src)
    copy_blocks(got, src, lo, re, item)
    copy_blocks_reference(ref, src, lo, re, item)
    torch.cuda.synchronize()
    assert torch.equal(got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_table_stage_reused_across_many_launches_and_grown_keeps_every_copy_exact():
    """More launches than the pinned ring holds, each with other ids (and one list that outgrows the table), back
    to back on one stream with no sync between: every destination equals the reference."""
    from baton.transfer.block_copy import TableStage

    rng = np.random.default_rng(3)
    item, n_items = 4096, 600
    src = torch.randint(0, 256, (n_items * item,), dtype=torch.uint8, device="cuda")
    stage = TableStage(torch.device("cuda"), size=64, ring=2)
    outs, refs = [], []
    for count in (10, 31, 20, 500, 5, 32, 33):  # 500 blocks: 1,000 ids > 64, the table grows
        lo, re = scattered(rng, n_items, count)
        got, ref = torch.zeros_like(src), torch.zeros_like(src)
        copy_blocks(got, src, lo, re, item, stage=stage)
        copy_blocks_reference(ref, src, lo, re, item)
        outs.append(got)
        refs.append(ref)
    torch.cuda.synchronize()
    assert stage.size >= 1000
    assert all(torch.equal(g, r) for g, r in zip(outs, refs, strict=True))
