"""The GPU path of an FP8 linear layer (float8_e4m3fn tensor cores: compute capability 8.9 and up, Hopper's 9.0).

* Per-tensor weights (ModelOpt FP8): the input is quantized with the checkpoint's static `input_scale` where it has
  one, else dynamically (one scale per token where the output is bf16, which cuBLASLt's row-wise scaling requires;
  one per tensor otherwise), and `torch._scaled_mm` (cuBLASLt) multiplies: cuBLAS already runs FP8 GEMMs at the
  tensor cores' rate, and a Triton kernel would only repeat it. Shapes it refuses (in or out features not a
  multiple of 16) take the reference with the same activation rounding.
* Block-wise weights (128x128, DeepSeek-V3 / Qwen3 FP8): cuBLAS has no per-block scales on Hopper, so a Triton
  GEMM runs `tl.dot` on e4m3 tiles within one K group (the activation group = the weight block's width; the FP8
  tensor-core rate) and scales each step's fp32 product by the token group's and the weight block's scale before
  accumulating, as DeepSeek-V3 prescribes. The input is quantized per token and group of `block[1]` channels by
  one Triton launch (`kernel_act_quant`; `reference.quantize_activation` is its reference). Its tiles come from
  `tuning.GEMM_TILES` by row count.

No host reads of device values: graph-capturable.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.fp8_linear.kernel_act_quant import quantize_activation_triton
from baton.engine.ops.fp8_linear.reference import (
    FP8_DTYPE,
    fp8_linear_reference,
    quantize_activation,
)
from baton.engine.ops.fp8_linear.tuning import Fp8GemmTiles, gemm_tiles
from baton.engine.ops.triton_common import cdiv, round_to
from baton.engine.quant_config import FP8_MAX


def _scaled_mm_ok(k: int, n: int) -> bool:
    return k % 16 == 0 and n % 16 == 0


def fp8_linear_per_tensor(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None = None,
                          input_scale: Tensor | None = None) -> Tensor:
    """x [..., K] @ (weight * weight_scale)^T + bias through `torch._scaled_mm`, in x's dtype."""
    n, k = weight.shape
    if not _scaled_mm_ok(k, n):
        return fp8_linear_reference(x, weight, weight_scale, None, bias, input_scale, act_quant=True)
    lead, dtype = x.shape[:-1], x.dtype
    x2 = x.reshape(-1, k)
    w_scale = weight_scale.float().reshape(1)
    if input_scale is not None:
        xq, x_scale = quantize_activation(x2, input_scale, None)
        x_scale = x_scale.reshape(1)
    elif dtype == torch.bfloat16:
        xq, x_scale = quantize_activation(x2, None, None)  # [M, 1]: row-wise
        w_scale = w_scale.expand(1, n).contiguous()
    else:
        x_scale = (x2.abs().amax().float() / FP8_MAX).clamp(min=1e-12).reshape(1)
        xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=dtype)
    if bias is not None:
        out = out + bias.to(dtype)
    return out.reshape(*lead, n)


@triton.jit
def _block_fp8_gemm(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_asm, stride_ask,
                    stride_bn, stride_bsn, stride_cm, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr, SCALE_N: tl.constexpr,
                    GROUP_M: tl.constexpr):
    """C = (A * a_scale) (B * b_scale)^T (+ bias): A [M, K] e4m3 with one scale per row and GROUP_K channels, B
    [N, K] e4m3 with one per (SCALE_N, GROUP_K) block. Each K step of BLOCK_K (dividing GROUP_K) lies in one
    group: its fp8 x fp8 product (fp32) is scaled by its rows' and columns' scales and added to the accumulator.
    Programs run in grouped order: GROUP_M blocks of rows, then the next block of N."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    b_rows = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn
    bs_rows = bs_ptr + (offs_n // SCALE_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        g = (kb * BLOCK_K) // GROUP_K
        a_s = tl.load(as_ptr + offs_m * stride_asm + g * stride_ask, mask=m_ok, other=0.0)
        b_s = tl.load(bs_rows + g, mask=n_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * (a_s[:, None] * b_s[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c, round_to(acc, c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_linear_blockwise(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, block: tuple[int, int],
                         bias: Tensor | None = None, tiles: Fp8GemmTiles | None = None) -> Tensor:
    """x [..., K] @ (weight * weight_scale_inv per `block`)^T + bias through the Triton block-scaled GEMM, in x's
    dtype; x quantized per token and `block[1]` channels (`kernel_act_quant`). `tiles`: the launch (default: the
    tuning table's for the row count)."""
    n, k = weight.shape
    lead, dtype = x.shape[:-1], x.dtype
    x2 = x.reshape(-1, k)
    if block[1] & (block[1] - 1):  # (the one-launch quantizer's groups are powers of two)
        xq, x_scale = quantize_activation(x2, None, block[1])
    else:
        xq, x_scale = quantize_activation_triton(x2, block[1])  # [M, K] e4m3, [M, ceil(K/bk)] fp32
    m = xq.shape[0]
    out = torch.empty(m, n, dtype=dtype, device=x.device)
    if tiles is None:  # the table's, its K step narrowed to a power-of-two divisor of the block's width
        t = gemm_tiles(m)
        t = dataclasses.replace(t, block_k=max(16, min(t.block_k, block[1] & -block[1])))
    else:
        t = tiles
    if block[1] % t.block_k:
        raise ValueError(f"fp8_linear_blockwise: tiles' block_k expected a divisor of the weight block's width "
                         f"{block[1]}, got {t.block_k}")
    if m and n:
        w_scale = weight_scale_inv if weight_scale_inv.dtype == torch.float32 else weight_scale_inv.float()
        w_scale = w_scale.contiguous()
        grid = (cdiv(m, t.block_m) * cdiv(n, t.block_n),)
        _block_fp8_gemm[grid](xq, x_scale, weight, w_scale, out, bias if bias is not None else out, m, n, k,
                              xq.stride(0), x_scale.stride(0), x_scale.stride(1), weight.stride(0),
                              w_scale.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=t.block_m,
                              BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_K=block[1], SCALE_N=block[0],
                              GROUP_M=t.group_m, num_warps=t.num_warps, num_stages=t.num_stages)
    return out.reshape(*lead, n)
