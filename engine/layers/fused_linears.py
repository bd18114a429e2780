"""Linear layers that read the same input, run as one GEMM.

The checkpoint's layers stay the parameters (their names load and shard), but after `fuse_weights` (run once the
weights are in place) their weights are views of one [sum of outputs, hidden] tensor: at decode batch sizes each
projection is a weight read and a launch of its own, and the small ones do not fill the GPU. An in-place load
(`load_state_dict` without assign) writes through the views; a load that assigns new tensors unties them, and
`fused_weight` then says so (the layer falls back to its separate GEMMs until fused again).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def fuse_weights(parts: Sequence[nn.Module]) -> torch.Tensor | None:
    """One tensor holding `parts`' weights in order, each part's weight made its view (no copy kept); None, nothing
    changed, unless every part is a bias-free `nn.Linear` (an FP8 layer has its own scales)."""
    if not all(isinstance(p, nn.Linear) and p.bias is None for p in parts):
        return None
    fused = torch.cat([p.weight.detach() for p in parts])
    start = 0
    for p in parts:
        n = p.weight.shape[0]
        p.weight = nn.Parameter(fused[start:start + n], requires_grad=False)
        start += n
    return fused


def fused_weight(parts: Sequence[nn.Module], fused: torch.Tensor | None) -> torch.Tensor | None:
    """`fused` while every part's weight is still its view, in order (host pointers only: no device work); else
    None."""
    if fused is None:
        return None
    start = 0
    for p in parts:
        w = p.weight
        if w.untyped_storage().data_ptr() != fused.untyped_storage().data_ptr() or \
                w.storage_offset() != start * fused.shape[1]:
            return None
        start += w.shape[0]
    return fused
