"""The CUDA IPC reader's range-copy kernel (`baton.transfer.range_copy`) against its torch reference: scattered
ranges of mixed lengths, pieces cut at any size, bad ranges refused before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.transfer.range_copy import copy_ranges, copy_ranges_reference, pieces


def scattered_ranges(rng: np.random.Generator, item: int, n_items: int, count: int) -> np.ndarray:
    """`count` runs of 1-3 items at distinct item ids on each side (a coalesced plan of scattered blocks)."""
    lens = rng.integers(1, 4, size=count)
    starts_d = rng.permutation(n_items // 3)[:count] * 3
    starts_s = rng.permutation(n_items // 3)[:count] * 3
    return np.stack([starts_d * item, starts_s * item, lens * item], axis=1).astype(np.int64)


def test_pieces_cover_every_range_exactly_in_words():
    r = np.array([[0, 800, 24], [64, 0, 8], [4096, 8192, 2000]], dtype=np.int64)
    p = pieces(r, piece_bytes=16)
    # 24 B -> 16 + 8; 8 -> 8; 2000 -> 125 pieces of 16 (2000 / 16). In 8-byte words.
    assert p[:3].tolist() == [[0, 100, 2], [2, 102, 1], [8, 0, 1]]
    assert len(p) == 2 + 1 + 125 and p[:, 2].sum() * 8 == r[:, 2].sum()
    assert p[-1].tolist() == [(4096 + 1984) // 8, (8192 + 1984) // 8, 2]


@pytest.mark.parametrize("piece_bytes, block_words", [(256, 8), (1024, 16), (96, 32)])
def test_range_copy_kernel_equals_torch_reference_on_scattered_ranges(piece_bytes, block_words):
    rng = np.random.default_rng(piece_bytes)
    item, n_items = 200, 96  # 25 words an item: pieces and loop tails end inside items
    src = torch.randint(0, 256, (n_items * item,), dtype=torch.uint8)
    ranges = scattered_ranges(rng, item, n_items, 20)
    got, ref = torch.zeros_like(src), torch.zeros_like(src)
    copy_ranges(got, src, ranges, piece_bytes=piece_bytes, block_words=block_words, num_warps=1)
    copy_ranges_reference(ref, src, ranges)
    assert torch.equal(got, ref)
    assert int((ref != 0).sum()) > 0.8 * int(ranges[:, 2].sum())  # the copied bytes (random, rarely 0) and only them
    assert torch.equal(ref[ranges[0, 0]:ranges[0, 0] + ranges[0, 2]], src[ranges[0, 1]:ranges[0, 1] + ranges[0, 2]])


def test_range_copy_refuses_bad_ranges_and_writes_nothing():
    src = torch.randint(1, 256, (512,), dtype=torch.uint8)
    dst = torch.zeros(256, dtype=torch.uint8)
    cases = {
        "multiples of 8": np.array([[0, 0, 8], [4, 0, 8]]),
        "inside dst": np.array([[0, 0, 8], [256, 0, 8]]),
        "inside dst .* or empty": np.array([[0, 0, 0]]),
        r"\[n, 3\]": np.array([0, 0, 8]),
    }
    for match, r in cases.items():
        for fn in (copy_ranges, copy_ranges_reference):
            with pytest.raises(ValueError, match=match):
                fn(dst, src, r.astype(np.int64))
    with pytest.raises(ValueError, match="flat uint8"):
        copy_ranges(dst.view(torch.int16), src, np.zeros((0, 3), dtype=np.int64))
    assert not dst.any()
    copy_ranges(dst, src, np.zeros((0, 3), dtype=np.int64))  # nothing to copy: a no-op
    assert not dst.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_range_copy_equals_reference_at_8b_like_block_size():
    """1,024 scattered 256 KiB blocks (a 16k-token 8b-like request's KV), as the reader's default pieces."""
    rng = np.random.default_rng(0)
    item, n_items = 256 << 10, 2048
    src = torch.randint(0, 256, (n_items * item,), dtype=torch.uint8, device="cuda")
    ranges = scattered_ranges(rng, item, n_items, 400)
    got, ref = torch.zeros_like(src), torch.zeros_like(src)
    copy_ranges(got, src, ranges)
    copy_ranges_reference(ref, src, ranges)
    torch.cuda.synchronize()
    assert torch.equal(got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_table_stage_reused_across_many_launches_and_grown_keeps_every_copy_exact():
    """More launches than the pinned ring holds, each with another table (and one that outgrows it), back to back
    on one stream with no sync between: every destination equals the reference."""
    from baton.transfer.range_copy import TableStage

    rng = np.random.default_rng(3)
    item, n_items = 4096, 600
    src = torch.randint(0, 256, (n_items * item,), dtype=torch.uint8, device="cuda")
    stage = TableStage(torch.device("cuda"), rows=64, ring=2)
    outs, refs = [], []
    for count in (10, 50, 20, 199, 5, 60, 33):  # 199 runs of up to 3 items: > 64 pieces, the stage grows
        ranges = scattered_ranges(rng, item, n_items, count)
        got, ref = torch.zeros_like(src), torch.zeros_like(src)
        copy_ranges(got, src, ranges, piece_bytes=item, stage=stage)
        copy_ranges_reference(ref, src, ranges)
        outs.append(got)
        refs.append(ref)
    torch.cuda.synchronize()
    assert stage.rows > 64
    assert all(torch.equal(g, r) for g, r in zip(outs, refs, strict=True))
