"""Triton kernels of the routed experts: the fused-MoE grouped GEMM, launched twice, and the un-permute sum.

After the align step (`kernel_align.py`: the T * top_k (token, expert) rows sorted by expert, each expert's rows
padded to a multiple of BLOCK_M, every block of BLOCK_M sorted rows one expert's), one kernel runs both GEMMs on a
grid of (padded blocks) x (N tiles):

- up: program (m, n) gathers its BLOCK_M rows of x (row id // top_k; the padding's sentinel rows load zeros), loads
  its expert's [BLOCK_K, BLOCK_N] weight tiles, and accumulates tl.dot in fp32; the activation runs in the epilogue
  (relu2, relu or silu; gated: the program accumulates the gate tile and the up tile, I rows apart, and stores
  silu(gate) * up). The activation lands in a [padded rows, I] buffer at the sorted positions (contiguous stores);
- down: program (m, n) reads its rows of that buffer, multiplies the fp32 result by each row's routing weight and
  stores it at the row's (token, slot) index of a [T * top_k, d_out] buffer in x's dtype (the sentinels store
  nothing).
Then one small kernel sums each token's top_k rows in fp32 and rounds once to x's dtype.

Every grid and buffer size follows from T, top_k, E and the tiles alone (blocks past the padded total, read on the
device, return at once): no host reads, so a CUDA graph holds the whole path and replays it with other routing.
16-bit inputs take native tl.dot (bf16 / fp16 MMA, fp32 accumulate); fp32 inputs, and all inputs under Triton's
interpreter (whose tl.dot takes no 16-bit operands), take tl.dot in IEEE fp32.

FP8 experts (weight-only, W8A16: float8_e4m3fn stacks with fp32 scales, laid out as `reference.py` says): each
program loads its expert's e4m3 weight tiles (half the bytes of a 16-bit stack: decode is bound by them) and
dequantizes them in registers before the same tl.dot, as the FP8 GEMV does (`ops.linear.kernel`). Per-tensor scales
(WSCALE 1): the tile converts exactly to x's dtype and the expert's scale multiplies the fp32 sums (gated: the gate's
and the up's each theirs) before the activation. Block scales (WSCALE 2): the tile times its columns' scales, rounded
once to x's dtype, as the reference's dequantized weight; BLOCK_K is cut to divide the scale block's K so that no K
tile crosses a scale block, and the scale is indexed per column, so BLOCK_N needs no such fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.moe.kernel_align import moe_align_triton
from baton.engine.ops.moe.reference import check_moe_shapes
from baton.engine.ops.moe.tuning import SUM_BLOCK, MoeTiles, moe_tiles
from baton.engine.ops.triton_common import cdiv, interpreted, round_to

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Epilogue activations (constexpr codes); gelu has no kernel (no erf in the interpreter, no model here uses it).
_ACT = {"relu2": 1, "relu": 2, "silu": 3}
_GATED_SILU = 4


@triton.jit
def _weight_tile(b, sc_ptr, sc_cols, n_mask, k0, dtype: tl.constexpr, WSCALE: tl.constexpr, SCALE_K: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] weight tile in `dtype`: 16-bit as loaded; per-tensor FP8 converted exactly (its scale
    multiplies the sums); block-wise FP8 times each column's scale of the K block k0 lies in, rounded once."""
    if WSCALE == 2:
        sc = tl.load(sc_ptr + sc_cols + k0 // SCALE_K, mask=n_mask, other=0.0)
        b = round_to(b.to(tl.float32) * sc[None, :], dtype)
    elif WSCALE == 1:
        b = b.to(dtype)
    return b


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, c_ptr, sorted_ptr, expert_ids_ptr, total_ptr, weights_ptr, sc_ptr,
    N, K, num_rows, gate_offset, sc_up,
    s_a_m, s_w_e, s_w_n, s_w_k, s_c_m, s_sc_e, s_sc_n,
    TOP_K: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr, ACT: tl.constexpr, WEIGHTED: tl.constexpr,
    NATIVE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WSCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return  # a block past the padded total (the grid is sized for the most padding)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_sorted = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rid = tl.load(sorted_ptr + offs_sorted)
    valid = rid < num_rows
    if GATHER:  # noqa: SIM108 (a constexpr branch)
        a_rows = rid // TOP_K  # x's row of each (token, slot) row
    else:
        a_rows = offs_sorted  # the up kernel's output, stored at the sorted positions
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * s_a_m + offs_k[None, :]
    b_ptrs = w_ptr + expert * s_w_e + offs_n.to(tl.int64)[None, :] * s_w_n + offs_k[:, None] * s_w_k
    dtype = a_ptr.dtype.element_ty
    # FP8 scales of this expert: per tensor its one (gated: the up's sc_up further); per block each column's row of
    # the scale grid (gated: the up segment's grid starts sc_up further)
    sc_expert = sc_ptr + expert * s_sc_e
    sc_cols = (offs_n // SCALE_N).to(tl.int64) * s_sc_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # gated only (the up rows' tile)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        b = _weight_tile(b, sc_expert, sc_cols, n_mask, k0, dtype, WSCALE, SCALE_K)
        if NATIVE_DOT:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        if ACT == 4:
            b_up = tl.load(b_ptrs + gate_offset * s_w_n, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            b_up = _weight_tile(b_up, sc_expert + sc_up, sc_cols, n_mask, k0, dtype, WSCALE, SCALE_K)
            if NATIVE_DOT:
                acc_up = tl.dot(a, b_up, acc_up)
            else:
                acc_up = tl.dot(a.to(tl.float32), b_up.to(tl.float32), acc_up, input_precision="ieee")
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * s_w_k
    if WSCALE == 1:
        acc = acc * tl.load(sc_expert)
        if ACT == 4:
            acc_up = acc_up * tl.load(sc_expert + sc_up)
    if ACT == 1:
        acc = tl.where(acc < 0.0, 0.0, acc)
        acc = acc * acc
    elif ACT == 2:
        acc = tl.where(acc < 0.0, 0.0, acc)
    elif ACT == 3:
        acc = acc / (1.0 + tl.exp(-acc))
    elif ACT == 4:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + rid, mask=valid, other=0.0).to(tl.float32)[:, None]
    if SCATTER:
        c_ptrs = c_ptr + rid.to(tl.int64)[:, None] * s_c_m + offs_n[None, :]
        tl.store(c_ptrs, round_to(acc, c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])
    else:
        c_ptrs = c_ptr + offs_sorted.to(tl.int64)[:, None] * s_c_m + offs_n[None, :]
        tl.store(c_ptrs, round_to(acc, c_ptr.dtype.element_ty), mask=n_mask[None, :])


@triton.jit
def _sum_rows_kernel(rows_ptr, out_ptr, d, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (t * TOP_K + j) * d + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * d + offs, round_to(acc, out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class _Scales:
    """One stack's FP8 scale arguments: WSCALE (0 16-bit, 1 per tensor, 2 per block), the fp32 scales, their expert
    and row strides, the up segment's offset (gated), the block."""

    wscale: int
    scale: Tensor
    s_e: int
    s_n: int
    up: int
    block: tuple[int, int]


def _scales(scale: Tensor | None, block: tuple[int, int] | None, parts: int, placeholder: Tensor) -> _Scales:
    if scale is None:
        return _Scales(0, placeholder, 0, 0, 0, (1, 1))
    sc = scale.float().contiguous()
    if block is None:  # [E] or gated [E, 2]
        return _Scales(1, sc, parts, 0, 1 if parts == 2 else 0, (1, 1))
    # [E, parts * rows per segment, K blocks]: the up segment's grid starts half-way down
    return _Scales(2, sc, sc.stride(0), sc.stride(1), (sc.shape[1] // parts) * sc.stride(1), block)


def _block_k(tiles: MoeTiles, sc: _Scales) -> int:
    """The K tile: the tiles', cut to divide a block scale's K (no tile crosses a scale block)."""
    if sc.wscale != 2:
        return tiles.block_k
    k = sc.block[1]
    fit = k & -k  # the largest power of two dividing the block's K
    if fit < 16:
        raise ValueError(f"moe_experts_triton: block expected a K size divisible by 16 (tl.dot's smallest K tile), "
                         f"got {sc.block}")
    return min(tiles.block_k, fit)


def _gemm(a: Tensor, w: Tensor, c: Tensor, align: tuple[Tensor, Tensor, Tensor], weights: Tensor, n_cols: int,
          num_rows: int, top_k: int, act: int, gather: bool, tiles: MoeTiles, sc: _Scales) -> None:
    sorted_ids, expert_ids, total = align
    grid = (expert_ids.numel(), cdiv(n_cols, tiles.block_n))
    _moe_gemm_kernel[grid](
        a, w, c, sorted_ids, expert_ids, total, weights, sc.scale, n_cols, a.shape[1], num_rows, n_cols, sc.up,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), c.stride(0), sc.s_e, sc.s_n,
        TOP_K=top_k, GATHER=gather, SCATTER=not gather, ACT=act, WEIGHTED=not gather,
        NATIVE_DOT=a.dtype != torch.float32 and not interpreted(),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=_block_k(tiles, sc),
        WSCALE=sc.wscale, SCALE_N=sc.block[0], SCALE_K=sc.block[1],
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def moe_experts_triton(x: Tensor, w_up: Tensor, w_down: Tensor, topk_ids: Tensor, topk_weights: Tensor, *,
                       activation: str = "relu2", gated: bool = False, tiles: MoeTiles | None = None,
                       w_up_scale: Tensor | None = None, w_down_scale: Tensor | None = None,
                       block: tuple[int, int] | None = None) -> Tensor:
    """The routed experts of `reference.moe_experts_reference` (same arguments, FP8 stacks with their scales
    included), on the fused-MoE kernels: [T, d_out] in x's dtype. `tiles` overrides `tuning.moe_tiles` (the tests'
    choice)."""
    inter = check_moe_shapes("moe_experts_triton", x, w_up, w_down, topk_ids, topk_weights, activation, gated,
                             w_up_scale, w_down_scale, block)
    if x.dtype not in _FLOAT_DTYPES or any(w.dtype != x.dtype for w, s in ((w_up, w_up_scale), (w_down, w_down_scale))
                                           if s is None):
        raise TypeError(f"moe_experts_triton: x, w_up, w_down expected one dtype of {_FLOAT_DTYPES} (or FP8 weights "
                        f"with their scales), got {x.dtype}, {w_up.dtype}, {w_down.dtype}")
    if not gated and activation not in _ACT:
        raise ValueError(f"moe_experts_triton: activation expected one of {tuple(_ACT)}, got {activation!r}")
    t, top_k = topk_ids.shape
    num_experts, d_out = w_up.shape[0], w_down.shape[1]
    num_rows = t * top_k
    out = torch.empty(t, d_out, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    tiles = tiles or moe_tiles(num_rows, num_experts, interpreted())
    x = x if x.stride(1) == 1 else x.contiguous()
    w_up = w_up if w_up.stride(2) == 1 else w_up.contiguous()
    w_down = w_down if w_down.stride(2) == 1 else w_down.contiguous()
    weights = topk_weights.contiguous()
    align = moe_align_triton(topk_ids, num_experts, tiles.block_m)
    h = torch.empty(align[0].numel(), inter, dtype=x.dtype, device=x.device)  # the activation, by sorted position
    _gemm(x, w_up, h, align, weights, inter, num_rows, top_k, _GATED_SILU if gated else _ACT[activation], True, tiles,
          _scales(w_up_scale, block, 2 if gated else 1, weights))
    rows = torch.empty(num_rows, d_out, dtype=x.dtype, device=x.device)  # weighted, by (token, slot)
    _gemm(h, w_down, rows, align, weights, d_out, num_rows, top_k, 0, False, tiles,
          _scales(w_down_scale, block, 1, weights))
    _sum_rows_kernel[(t, cdiv(d_out, SUM_BLOCK))](rows, out, d_out, TOP_K=top_k, BLOCK=SUM_BLOCK, num_warps=4)
    return out
