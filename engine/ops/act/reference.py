"""The torch reference of the MLP's activation, relu2 = relu(x)^2 (`kernel.py` is its kernel; also the CPU
path, `ops.kernels`)."""

from __future__ import annotations

import torch


def relu2_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()
