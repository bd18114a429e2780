"""Per-token, per-group FP8 quantization of a block-wise FP8 layer's input in one launch (DeepSeek-V3's 1 x 128
activation groups).

`reference.quantize_activation(x, None, group)` is the torch reference: the same scales (amax / FP8_MAX, at least
a tiny positive value) and the same e4m3 values (x / scale rounded to nearest even). As torch ops it is about ten
kernels with [M, K] fp32 intermediates; here each program reads BLOCK_G groups of one row once and writes their
e4m3 values and scales.

The scales are stored group-major ([G, M], returned as its [M, G] transpose view), so that the block-scaled GEMM's
per-K-step load of one group's scales for a block of rows is contiguous. No host reads: graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.fp8_linear.reference import _TINY, FP8_DTYPE
from baton.engine.ops.triton_common import cdiv, next_power_of_2, round_to
from baton.engine.quant_config import FP8_MAX


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, G, s_x_m, s_q_m, tiny, fp8_max,
                      GROUP: tl.constexpr, BLOCK_G: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    col = grp[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [BLOCK_G, GROUP]
    mask = (grp < G)[:, None] & (col < K)
    x = tl.load(x_ptr + row * s_x_m + col, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), fp8_max), tiny)  # [BLOCK_G]
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -fp8_max, fp8_max)
    tl.store(q_ptr + row * s_q_m + col, round_to(q, q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + grp.to(tl.int64) * M + row, scale, mask=grp < G)


def quantize_activation_triton(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """(x_q float8_e4m3fn [M, K], scales fp32 [M, ceil(K/group)] (a view of a [G, M] tensor)) of x [M, K], one scale
    per row and `group` channels; x's rows may be strided (unit stride along K)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_activation_triton: expected x [M, K], got shape {tuple(x.shape)}")
    if group <= 0 or group & (group - 1):
        raise ValueError(f"quantize_activation_triton: group expected a power of two, got {group}")
    if x.shape[1] and x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    g = cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale_t = torch.empty((g, m), dtype=torch.float32, device=x.device)
    if m and k:
        block_g = max(1, min(next_power_of_2(g), 4096 // group))  # a few KB of one row per program
        _act_quant_kernel[(m, cdiv(g, block_g))](x, q, scale_t, m, k, g, x.stride(0), q.stride(0), _TINY, FP8_MAX,
                                                 GROUP=group, BLOCK_G=block_g, num_warps=4)
    return q, scale_t.t()
