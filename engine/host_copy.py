"""Host ints -> a device tensor without waiting for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory with a blocking copy: the host waits until
the stream has finished everything queued before it, i.e. the step in flight. Built in pinned memory and
copied with `non_blocking=True`, the copy is queued on the stream like a kernel and the host goes on. The
caching host allocator keeps a pinned block alive until the copies queued from it have run, so the block is
never rewritten under a pending copy (R5's async-copy rule).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (ints, bools or floats, nested lists allowed) as a `dtype` tensor on `device`; on CUDA, queued
    on the current stream without a host wait."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
