"""Host ints -> a device tensor without waiting for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory with a blocking copy: the host waits until
the stream has finished everything queued before it, i.e. the step in flight. Built in pinned memory and
copied with `non_blocking=True`, the copy is queued on the stream like a kernel and the host goes on. The
caching host allocator keeps a pinned block alive until the copies queued from it have run, so the block is
never rewritten under a pending copy (R5's async-copy rule).

A step's inputs are flat lists of Python ints (tens of thousands in a large decode step, its block tables most of
them). `torch.tensor` converts one int at a time; `array.array` packs them several times faster, and the tensor is
a view of its buffer (`host_tensor`).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from itertools import accumulate

import torch

# array.array type codes of the integer dtypes a step's index inputs use (both 8 / 4 bytes on Linux x86-64).
_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}


def host_tensor(values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """`values` as a CPU tensor of `dtype`: a flat list or tuple of ints to an integer dtype through
    `array.array`, anything else (nested lists, floats, bools to a bool dtype) through `torch.tensor`; the same
    values either way, and the same errors for values the dtype cannot hold."""
    code = _ARRAY_CODES.get(dtype)
    if code is not None and isinstance(values, (list, tuple)):
        if not values:
            return torch.empty(0, dtype=dtype)
        try:
            return torch.frombuffer(array.array(code, values), dtype=dtype)
        except (TypeError, OverflowError):
            pass  # nested, non-integer or out-of-range values: torch.tensor decides (and raises its error)
    return torch.tensor(values, dtype=dtype)


def float_bits(values: Sequence[float]) -> list[int]:
    """Each value's float32 bit pattern as an int (int32 range): floats travel in an int64 buffer, and
    `.to(torch.int32).view(torch.float32)` on the other side gives the float32 values back exactly."""
    return list(array.array("i", array.array("f", values).tobytes()))


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (ints, bools or floats, nested lists allowed) as a `dtype` tensor on `device`; on CUDA, queued
    on the current stream without a host wait."""
    host = host_tensor(values, dtype)
    if device.type != "cuda":
        return host.to(device)
    pinned = torch.empty(host.shape, dtype=dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)


# Triton specializes a pointer argument on whether it is 16-byte aligned: a kernel compiles once per case it meets.
POINTER_ALIGN_BYTES = 16


def to_device_parts(parts: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Each list of ints in `parts` as a 1-D `dtype` tensor on `device`, all through one copy (`to_device`), each
    starting 16-byte aligned: the same pointer specialization for a kernel whatever the parts' lengths."""
    per = max(1, POINTER_ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size())
    padded = [len(p) + (-len(p)) % per for p in parts]
    flat: list[int] = []
    for p, n in zip(parts, padded, strict=True):
        flat += p
        flat += [0] * (n - len(p))
    buf = to_device(flat, dtype, device)
    starts = [0, *accumulate(padded)]
    return [buf[a : a + len(p)] for a, p in zip(starts, parts, strict=False)]
