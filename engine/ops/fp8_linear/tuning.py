"""Launch tiles of the block-scaled FP8 GEMM (`kernel.fp8_linear_blockwise`) by row count, each entry with its
reason. `benchmarks/fp8_gemm_bench.py` times them (and `SWEEP`) against bf16 cuBLAS at the 8b-like layer shapes;
its results go to benchmarks/RESULTS.md, and a better tile replaces its entry here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fp8GemmTiles:
    block_m: int
    block_n: int
    # A divisor of the weight block's width: each K step then has one activation scale per row and one weight
    # scale per column, applied to that step's fp32 product.
    block_k: int
    num_warps: int
    num_stages: int
    # Programs launched consecutively along M for one block of N (grouped order): they share W's tiles in L2.
    group_m: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Fp8GemmTiles: {name} expected a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1 or self.group_m < 1:
            raise ValueError(f"Fp8GemmTiles: expected num_warps in 1..16 (a power of two), num_stages >= 1 and "
                             f"group_m >= 1, got {self.num_warps}, {self.num_stages}, {self.group_m}")


# (largest row count, tiles, why): the first entry whose row count is >= M.
GEMM_TILES: tuple[tuple[int, Fp8GemmTiles, str], ...] = (
    (16, Fp8GemmTiles(16, 64, 128, 4, 4),
     "a weight read: the smallest MMA row block, and narrow blocks of N so that every SM has programs"),
    (64, Fp8GemmTiles(64, 64, 128, 4, 4),
     "still weight-bound: one block of rows (W read once), blocks of N narrow enough to fill the SMs"),
    (512, Fp8GemmTiles(64, 128, 128, 4, 4, 8),
     "between the two: one warpgroup per 64 x 128 accumulator (Hopper's MMA row block), four 24 KB stages"),
    (1 << 62, Fp8GemmTiles(128, 128, 128, 8, 4, 8),
     "prefill, compute-bound: the usual Hopper FP8 tile, two warpgroups on a 128 x 128 fp32 accumulator, four "
     "32 KB stages, 8 blocks of rows per block of N in launch order so that W's tiles are reused from L2"),
)

# Other tiles the benchmark times at each row count (the defaults above are always timed).
SWEEP: tuple[Fp8GemmTiles, ...] = (
    Fp8GemmTiles(128, 128, 128, 8, 3, 8),
    Fp8GemmTiles(128, 256, 128, 8, 3, 8),
    Fp8GemmTiles(128, 128, 64, 8, 5, 8),
    Fp8GemmTiles(64, 128, 128, 4, 3, 8),
    Fp8GemmTiles(64, 256, 128, 8, 3, 8),
    Fp8GemmTiles(32, 64, 128, 4, 4),
    Fp8GemmTiles(16, 128, 128, 4, 4),
)


def gemm_tiles(m: int) -> Fp8GemmTiles:
    return next(t for rows, t, _ in GEMM_TILES if m <= rows)
