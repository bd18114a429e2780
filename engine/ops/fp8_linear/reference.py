"""Quantizers and the dequantizing torch reference of an FP8 linear layer.

Weight formats (`quant_config.py`): per-tensor, w = q * scale (scale a scalar); block-wise, w = q * scale[i // bn,
j // bk] for blocks of (bn, bk) = `block` (the last blocks may be partial). Both quantizers round to nearest
e4m3 after scaling the largest magnitude of the tensor (block) to `FP8_MAX`.

`fp8_linear_reference` dequantizes the weight to fp32, rounds it once to x's dtype and runs `F.linear` in x's
dtype: exactly what a model whose checkpoint held the dequantized weights computes, so the CPU tests compare an
FP8 checkpoint to one with `dequantize(...)` weights bit for bit. With `act_quant` it also rounds x through e4m3
as the GPU path does (static `input_scale`, else per token, or per token and `block[1]` channels), for testing
that path against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from baton.engine.quant_config import FP8_MAX

FP8_DTYPE = torch.float8_e4m3fn
_TINY = 1e-12  # keeps an all-zero tensor's scale positive (its quantized values are then all 0)


def _blocks(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def expand_block_scale(scale: Tensor, shape: tuple[int, int], block: tuple[int, int]) -> Tensor:
    """[ceil(N/bn), ceil(K/bk)] -> [N, K]: each block's scale on each of its elements."""
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:shape[0], :shape[1]]


def quantize_per_tensor(w: Tensor, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(q float8_e4m3fn, scale fp32 scalar) with w ~= q * scale; `scale` given: use it (a static one)."""
    w = w.float()
    if scale is None:
        scale = (w.abs().amax() / FP8_MAX).clamp(min=_TINY)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.float().reshape(())


def quantize_blockwise(w: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """(q float8_e4m3fn [N, K], scale fp32 [ceil(N/bn), ceil(K/bk)]) with w ~= q * scale per block."""
    n, k = w.shape
    nb, kb = _blocks((n, k), block)
    padded = torch.zeros(nb * block[0], kb * block[1], dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    amax = padded.view(nb, block[0], kb, block[1]).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=_TINY)
    q = (w.float() / expand_block_scale(scale, (n, k), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: Tensor, scale: Tensor, block: tuple[int, int] | None) -> Tensor:
    """The fp32 weight q * scale (per tensor, or per block of `block`)."""
    if block is None:
        return q.float() * scale.float()
    return q.float() * expand_block_scale(scale.float(), tuple(q.shape), block)


def quantize_activation(x: Tensor, input_scale: Tensor | None, group: int | None) -> tuple[Tensor, Tensor]:
    """(x_q float8_e4m3fn [M, K], its scales): the static `input_scale` (a scalar) where given, else one scale per
    row (`group` None) or per row and `group` channels ([M, ceil(K/group)])."""
    x = x.float()
    if input_scale is not None:
        return quantize_per_tensor(x, input_scale)
    m, k = x.shape
    if group is None:
        scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_TINY)  # [M, 1]
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    g = -(-k // group)
    padded = F.pad(x, (0, g * group - k))
    scale = (padded.view(m, g, group).abs().amax(dim=2) / FP8_MAX).clamp(min=_TINY)  # [M, G]
    full = scale.repeat_interleave(group, 1)[:, :k]
    return (x / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_activation(x_q: Tensor, scale: Tensor, group: int | None) -> Tensor:
    if scale.dim() == 0 or group is None:
        return x_q.float() * scale
    return x_q.float() * scale.repeat_interleave(group, 1)[:, :x_q.shape[1]]


def fp8_linear_reference(x: Tensor, weight: Tensor, weight_scale: Tensor, block: tuple[int, int] | None,
                         bias: Tensor | None = None, input_scale: Tensor | None = None,
                         act_quant: bool = False) -> Tensor:
    """x [..., K] @ dequantize(weight, weight_scale)^T + bias, in x's dtype; `act_quant`: x rounded through e4m3
    first (see the module docstring)."""
    dtype = x.dtype
    if act_quant:
        lead = x.shape[:-1]
        group = None if block is None else block[1]
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = quantize_activation(x2, input_scale, group)
        x = dequantize_activation(xq, xs, group).to(dtype).reshape(*lead, -1)
    w = dequantize(weight, weight_scale, block).to(dtype)
    return F.linear(x, w, None if bias is None else bias.to(dtype))
