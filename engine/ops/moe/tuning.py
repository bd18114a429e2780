"""Tiles of the fused-MoE kernels, each with its reason. They follow the fused-MoE defaults of the open serving
engines for Hopper and are not yet swept on the H200 here (benchmarks/moe_bench.py measures them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # sorted rows per program (the align step pads each expert's rows to a multiple of it)
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


# Decode-sized steps (at most about one row per expert): most experts hold one or two rows, so a 16-row block (tl.dot's
# smallest side) wastes the least padding, and the GEMM is a weight stream that wants wide K steps.
SMALL = MoeTiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
# Prefill-sized steps: many rows per expert, so 64-row blocks reuse each weight tile 4x more per load.
LARGE = MoeTiles(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
# The smallest tiles tl.dot takes (16 per side): the interpreter's tests run tiny shapes on them.
INTERPRETER = MoeTiles(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)

# Sorted rows per expert (num_tokens * top_k / num_experts) from which the large tiles pay: below, a 64-row block
# would be mostly padding.
LARGE_FROM_ROWS_PER_EXPERT = 32

# Columns per program of the un-permute sum (a memory-bound reduction over top_k rows).
SUM_BLOCK = 1024
# Sorted rows each align program scans per step.
ALIGN_BLOCK = 1024


def moe_tiles(num_rows: int, num_experts: int, interpreted: bool) -> MoeTiles:
    """The tiles for `num_rows` = num_tokens * top_k sorted rows over `num_experts` experts."""
    if interpreted:
        return INTERPRETER
    return LARGE if num_rows >= LARGE_FROM_ROWS_PER_EXPERT * num_experts else SMALL
