"""Which tensor-parallel rank this process is, of how many. Frozen and validated.

Invariant: `size == 1` means no parallelism at all (no process group, every collective a no-op).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or isinstance(self.tp_size, bool) or self.tp_size < 1:
            raise ValueError(f"parallel field 'tp_size': expected a positive integer, got {self.tp_size!r}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 0 <= self.rank < self.tp_size:
            raise ValueError(f"parallel field 'rank': expected an integer in 0..{self.tp_size - 1}, got {self.rank!r}")
