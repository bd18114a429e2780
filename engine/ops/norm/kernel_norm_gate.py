"""Triton kernel of the Gated DeltaNet mixer's norm-then-gate RMSNorm, beside its torch reference
`ops.norm.reference.norm_gate_reference` (HF `Qwen3_5RMSNormGated`): same signature, semantics and dtypes.

`norm_gate_triton(x, gate, weight, eps)`: per row of x [..., N], h = fp32(x) * rsqrt(mean(x^2) + eps) rounded to
x.dtype; p = weight * h in the promoted dtype of (weight, x) (the product rounded once to it); out = p *
silu(fp32(gate)) rounded to x.dtype. Grid: one program per row, the whole row in one tile of BLOCK_N (the next power
of two of N, masked) channels, fp32 math in registers, one read of x and gate and one write of out. Rows are
addressed through their stride, so a split of a wider tensor needs no copy; an input whose last dimension is not
unit-stride is made contiguous first. No host reads of device tensors. The mean's and silu's divisions are
IEEE-rounded (`div_rn`) as torch's are; on the GPU `rsqrt` and `exp` are the fast approximations, so outputs agree
with the reference to a few fp32 ulps (one rounding step of a rare element in bf16).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.norm.kernel import MAX_WIDTH, _check, _rows_of
from baton.engine.ops.triton_common import next_power_of_2, pdl, pdl_wait, round_to


@triton.jit
def _norm_gate_kernel(
    x_ptr,  # [M, N], unit column stride
    z_ptr,  # [M, N] gate, unit column stride
    w_ptr,  # [N]
    y_ptr,  # [M, N], contiguous
    N,
    stride_xm,
    stride_zm,
    stride_w,
    width,  # float(N), for the mean's division
    eps,
    ROUND_PRODUCT: tl.constexpr,  # whether weight * h rounds to x's dtype (the promoted dtype is x's, not fp32)
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(w_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)  # (the norm weight above is a constant)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * stride_zm + cols, mask=mask, other=0.0).to(tl.float32)
    ms = tl.math.div_rn(tl.sum(x * x, axis=0), width)  # masked lanes add 0
    h = round_to(x * tl.math.rsqrt(ms + eps), x_ptr.dtype.element_ty).to(tl.float32)
    p = w * h
    if ROUND_PRODUCT:
        p = round_to(p, x_ptr.dtype.element_ty).to(tl.float32)
    out = p * tl.math.div_rn(z, 1.0 + tl.exp(-z))  # silu as torch computes it: z / (1 + exp(-z))
    tl.store(y_ptr + row * N + cols, round_to(out, y_ptr.dtype.element_ty), mask=mask)


def norm_gate_triton(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [..., N] with weight [N], then times silu(gate) (gate [..., N]); returns x.dtype, shape of x."""
    _check("x", x)
    _check("gate", gate)
    _check("weight", weight)
    n = x.shape[-1]
    if gate.shape != x.shape:
        raise ValueError(f"gate: expected shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    if weight.shape != (n,):
        raise ValueError(f"weight: expected shape ({n},), got {tuple(weight.shape)}")
    if gate.device != x.device or weight.device != x.device:
        raise ValueError(f"x on {x.device}, gate on {gate.device}, weight on {weight.device}")
    if n > MAX_WIDTH:
        raise ValueError(f"norm width {n} exceeds the single-tile limit {MAX_WIDTH}")
    x2, z2 = _rows_of(x, n), _rows_of(gate, n)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.view(x.shape)
    block_n = next_power_of_2(n)
    round_product = x.dtype != torch.float32 and torch.promote_types(weight.dtype, x.dtype) == x.dtype
    _norm_gate_kernel[(m,)](
        x2, z2, weight, y, n, x2.stride(0), z2.stride(0), weight.stride(0), float(n), eps,
        ROUND_PRODUCT=round_product, BLOCK_N=block_n, num_warps=4 if block_n <= 2048 else 8, **pdl(x2),
    )  # fmt: skip
    return y.view(x.shape)
