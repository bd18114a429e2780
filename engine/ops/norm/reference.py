"""The torch references of the RMS norms (computed in fp32): plain, after a residual add, the gated, grouped one
of the Mamba2 mixer and the norm-then-gate one of the Gated DeltaNet mixer. `kernel.py` holds their kernels; they are also the CPU path (`ops.kernels`)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x).to(dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x): a residual add and the next pre-norm."""
    s = residual + x
    return rms_norm_reference(s, weight, eps), s


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int,
                             eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float() * nn.functional.silu(gate.float())
    g = x.view(*x.shape[:-1], -1, group_size)  # [T, G, group_size]
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view_as(x).to(dtype)


def norm_gate_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF `Qwen3_5RMSNormGated`: RMS-normalise x over its last dim, scale by weight in x's dtype, then times
    silu(gate) in fp32 (norm before gate, unlike `gated_rms_norm_reference`); returned in x's dtype."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * nn.functional.silu(gate.float())).to(dtype)
