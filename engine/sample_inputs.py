"""A sampling step's per-row inputs on the device, from one host -> device copy.

Drawing the next token of rows without drafts (`RejectionSampler.sample`) needs, per row, its noise seed, the
position of the token it draws, a draft count of 0, its top-k and top-p, and its temperature for the op that draws
it: `tempered_decisions` for rows at a temperature alone, `filtered_decisions` for rows with a top-k or top-p. As
five separate tensors these were five small copies and a fill on the GPU's stream, ahead of the draw's kernels: a
decode step is GPU-bound (with async scheduling the host launches step n+1 while the GPU runs step n), so those
few microseconds were the step's. Here they are one int64 buffer, copied once from pinned memory; the float32
values ride in it two to a word and come out as views, with no conversion kernel.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .host_copy import to_device
from .sampling_params import SamplingParams


def is_tempered(p: SamplingParams) -> bool:
    """A row that samples at a temperature alone: `tempered_decisions` (a kernel on the GPU) decides it."""
    return not p.greedy and p.top_k == 0 and p.top_p >= 1.0


def is_filtered(p: SamplingParams) -> bool:
    """A row that samples with a top-k or top-p: `filtered_decisions` decides it."""
    return not p.greedy and not is_tempered(p)


@dataclass(frozen=True)
class SampleInputs:
    """Per row, on the device: seeds / positions / no_drafts / top_k [R] int64, and float32 [R] views:
    `temperature` (rows at a temperature alone, 0 elsewhere), `temperature_f` (rows with a top-k or top-p, 0
    elsewhere) and `top_p`."""

    seeds: Tensor
    positions: Tensor
    no_drafts: Tensor
    top_k: Tensor
    temperature: Tensor
    temperature_f: Tensor
    top_p: Tensor


def _words(floats: list[float]) -> list[int]:
    """float32 values packed two to an int64 word, in memory order (a trailing 0.0 pads an odd count)."""
    if len(floats) % 2:
        floats = [*floats, 0.0]
    return list(array.array("q", array.array("f", floats).tobytes()))


def sample_inputs(params: Sequence[SamplingParams], seeds: Sequence[int] | Tensor,
                  positions: Sequence[int] | Tensor, device: torch.device) -> SampleInputs:
    """The rows' inputs in one copy: seeds and positions as host ints (or already on the device: then used as
    they are), the rest from `params`."""
    n = len(params)
    for name, v in (("seeds", seeds), ("positions", positions)):
        if len(v) != n:
            raise ValueError(f"{name}: expected one per row ({n}), got {len(v)}")
    on_host = [list(v) for v in (seeds, positions) if not isinstance(v, Tensor)]
    ints = [v for part in on_host for v in part] + [0] * n + [p.top_k for p in params]
    floats = ([p.temperature if is_tempered(p) else 0.0 for p in params]
              + [p.temperature if is_filtered(p) else 0.0 for p in params] + [float(p.top_p) for p in params])
    buf = to_device(ints + _words(floats), torch.int64, device)
    at = 0
    views = []
    for v in (seeds, positions):
        if isinstance(v, Tensor):
            views.append(v)
        else:
            views.append(buf[at:at + n])
            at += n
    no_drafts, top_k = buf[at:at + n], buf[at + n:at + 2 * n]
    f = buf[at + 2 * n:].view(torch.float32)
    return SampleInputs(views[0], views[1], no_drafts, top_k, f[:n], f[n:2 * n], f[2 * n:3 * n])
