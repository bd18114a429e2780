"""Triton kernels of the align step: the (token, expert) rows sorted by expert and padded per expert to a multiple
of BLOCK_M, built on the device in two launches with no host reads (the arrays' sizes follow from the token count
alone, so a CUDA graph can hold it). Same arrays as `reference.align_reference`, bit for bit.

Launch 1 (one program per expert): count the expert's rows; each program also fills its stripe of the outputs with
the sentinels (row id T * top_k, expert -1), which launch 2 then overwrites where rows land. Launch 2 (one program
per expert): the expert's padded start is the sum of the padded counts before it; its rows go there in increasing
row order (an exclusive prefix sum of the matches within each scanned chunk), and its blocks get its id. Each
program scans all T * top_k ids: O(E * T * top_k) compares, which parallelise over E and stay far below the GEMMs,
and keep the order stable with no atomics (the same layout every run).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.moe.reference import max_padded_rows
from baton.engine.ops.moe.tuning import ALIGN_BLOCK
from baton.engine.ops.triton_common import cdiv, next_power_of_2


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, sorted_ptr, expert_ids_ptr, n, size, num_blocks, num_experts,
                  BLOCK: tl.constexpr):
    e = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        ids = tl.load(ids_ptr + start + lanes, mask=start + lanes < n, other=-1)
        acc += (ids == e).to(tl.int32)
    tl.store(counts_ptr + e, tl.sum(acc, 0))
    # This program's stripe of the sentinels (launch 2 overwrites the slots rows and blocks land in).
    for start in range(e * BLOCK, size, num_experts * BLOCK):
        tl.store(sorted_ptr + start + lanes, tl.zeros([BLOCK], tl.int32) + n, mask=start + lanes < size)
    for start in range(e * BLOCK, num_blocks, num_experts * BLOCK):
        tl.store(expert_ids_ptr + start + lanes, tl.zeros([BLOCK], tl.int32) - 1, mask=start + lanes < num_blocks)


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, sorted_ptr, expert_ids_ptr, total_ptr, n, num_experts,
                  BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    e = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(offs_e < e, padded, 0), 0)
    mine = tl.sum(tl.where(offs_e == e, padded, 0), 0)
    if e == 0:
        tl.store(total_ptr, tl.sum(padded, 0))
    lanes = tl.arange(0, BLOCK)
    first_block = start // BLOCK_M
    for b in range(first_block, first_block + mine // BLOCK_M, BLOCK):
        tl.store(expert_ids_ptr + b + lanes, tl.zeros([BLOCK], tl.int32) + e,
                 mask=b + lanes < first_block + mine // BLOCK_M)
    placed = 0
    for chunk in range(0, n, BLOCK):
        ids = tl.load(ids_ptr + chunk + lanes, mask=chunk + lanes < n, other=-1)
        hit = (ids == e).to(tl.int32)
        pos = start + placed + tl.cumsum(hit, 0) - hit  # exclusive prefix sum: row order within the expert
        tl.store(sorted_ptr + pos, (chunk + lanes).to(tl.int32), mask=hit != 0)
        placed += tl.sum(hit, 0)


def moe_align_triton(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """(sorted_ids [max_padded_rows] int32, expert_ids [cdiv(max_padded_rows, block_m)] int32, num_padded [1]
    int32) of `topk_ids` [T, top_k] (ids in [0, num_experts)); the layout of `reference.align_reference`."""
    if topk_ids.dim() != 2:
        raise ValueError(f"moe_align_triton: topk_ids expected 2 dims [T, top_k], got shape {tuple(topk_ids.shape)}")
    ids = topk_ids.contiguous()
    n, dev = ids.numel(), ids.device
    size = max_padded_rows(n, num_experts, block_m)
    num_blocks = cdiv(size, block_m)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    total = torch.zeros(1, dtype=torch.int32, device=dev)
    if n == 0:
        return sorted_ids, expert_ids, total
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    _count_kernel[(num_experts,)](ids, counts, sorted_ids, expert_ids, n, size, num_blocks, num_experts,
                                  BLOCK=ALIGN_BLOCK, num_warps=4)
    _place_kernel[(num_experts,)](ids, counts, sorted_ids, expert_ids, total, n, num_experts, BLOCK_M=block_m,
                                  BLOCK=ALIGN_BLOCK, BLOCK_E=next_power_of_2(num_experts), num_warps=4)
    return sorted_ids, expert_ids, total
