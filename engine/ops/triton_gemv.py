"""Triton GEMV for few-token steps with the op before the linear layer fused in (`ops.fused_linear`).

Same signature, prologues and return values as the torch reference `fused_linear`. One launch computes
y = f(a) @ W^T (+ bias) over a grid of (blocks of BLOCK_N output features, blocks of BLOCK_M rows); each program
streams its W rows once, in [BLOCK_N, BLOCK_K] tiles, and builds the f(a) tile it multiplies them with from a
(and the residual / gate) as it goes, in fp32 registers, in one pass:

- The norms' RMS scales the dot product instead of each input: for a row's group (all of K; group_size
  channels for gated_norm), y = rsqrt(mean(v^2) + eps) * sum_k round(norm_weight_k * v_k) W_nk, with v the
  input before the norm (a, residual + a, or a * silu(gate)); the sum of squares is taken in the same pass.
  The separate ops round twice (the normalized input, then its product with the weight; gated: also the
  normalized value); here round(norm_weight * v) is the one rounding, so y differs from theirs by about one
  16-bit rounding of each input, in either direction.
- add_norm stores s = residual + a (rounded to a's dtype, exactly torch's add) from the programs of the first
  block of N only; every program computes the same s for itself.
- relu2 is torch's relu(a).square() bit for bit; the inputs are a few KB per row, read from L2 by every
  program (M x inputs x K per program: for large M that outgrows the weight itself, so the engine uses this
  for few-token steps only); W, the bulk, is read once.
- Products: BLOCK_M >= 16 uses tl.dot (16-bit operands, fp32 accumulator); smaller BLOCK_M (one or a few rows)
  multiplies and sums in fp32 registers: the same products. Under Triton's interpreter tl.dot takes the
  rounded values in fp32 (`NATIVE_DOT` off: numpy has no bf16).

The weight rows are addressed through their stride, a / residual / gate rows through theirs (a slice of a wider
tensor needs no copy); the last dimension must be unit-stride. No host reads of device tensors, so a step's
launches can be captured in a CUDA graph. Launch shape (`GemvTiles`) depends on M only through BLOCK_M.
On Hopper (`triton_common.pdl`) each program loads its first W tile before it waits for the kernel before it,
then lets the next kernel launch: a chain of GEMVs streams W with no launch gap between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.fused_linear import check_fused_linear
from baton.engine.ops.triton_common import interpreted as _interpreted
from baton.engine.ops.triton_common import pdl, pdl_wait, round_to

_CODES = {"none": 0, "relu2": 1, "norm": 2, "add_norm": 3, "gated_norm": 4}




@triton.jit
def _prologue_raw(a_ptr, r_ptr, g_ptr, s_ptr, rows64, offs, mask, s_a_m, s_r_m, s_g_m, K,
                  STORE_S, PRO: tl.constexpr):
    """fp32 values of one input tile before any norm: a (none, norm), round(relu(a)^2) (relu2), round(a + r)
    (add_norm; stored to s where STORE_S), a * silu(gate) (gated_norm)."""
    a = tl.load(a_ptr + rows64 * s_a_m + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if PRO == 1:  # relu2, rounded as torch's square of a 16-bit tensor
        r = tl.maximum(a, 0.0)
        a = round_to(r * r, a_ptr.dtype.element_ty).to(tl.float32)
    elif PRO == 3:
        r = tl.load(r_ptr + rows64 * s_r_m + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        a = round_to(a + r, a_ptr.dtype.element_ty)
        if STORE_S:
            tl.store(s_ptr + rows64 * K + offs[None, :], a, mask=mask)
        a = a.to(tl.float32)
    elif PRO == 4:
        z = tl.load(g_ptr + rows64 * s_g_m + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        a = a * tl.math.div_rn(z, 1.0 + tl.exp(-z))  # silu as torch computes it
    return a


@triton.jit
def _gemv_kernel(
    a_ptr, r_ptr, g_ptr, nw_ptr, s_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, GROUP,
    s_a_m, s_r_m, s_g_m, s_w_n, s_y_m,
    width, eps,
    PRO: tl.constexpr, HAS_BIAS: tl.constexpr, NATIVE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    rows64 = rows.to(tl.int64)[:, None]
    cols64 = cols.to(tl.int64)[:, None]
    dtype = w_ptr.dtype.element_ty
    if PDL:  # the first W tile (a constant) is loaded while the kernel before this one finishes
        first = tl.arange(0, BLOCK_K)
        w_first = tl.load(w_ptr + cols64 * s_w_n + first[None, :], mask=cmask[:, None] & (first < tl.minimum(GROUP, K))[None, :],
                          other=0.0)
    pdl_wait(PDL)
    NORM: tl.constexpr = PRO >= 2
    store_s = pid_n == 0  # add_norm: the first block of N stores s = residual + a
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, K, GROUP):  # one group (all of K) but for gated_norm
        g_end = tl.minimum(g0 + GROUP, K)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(g0, g_end, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            kmask = offs < g_end
            mask = rmask[:, None] & kmask[None, :]
            x = _prologue_raw(a_ptr, r_ptr, g_ptr, s_ptr, rows64, offs, mask, s_a_m, s_r_m, s_g_m, K, store_s, PRO)
            if NORM:  # the RMS scales the dot product, after it: x is weighted here and rounded once
                ss += tl.sum(x * x, axis=1)
                nw = tl.load(nw_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
                x = round_to(nw[None, :] * x, a_ptr.dtype.element_ty).to(tl.float32)
            if PDL:
                if k0 == 0:
                    w = w_first
                else:
                    w = tl.load(w_ptr + cols64 * s_w_n + offs[None, :], mask=cmask[:, None] & kmask[None, :],
                                other=0.0)
            else:
                w = tl.load(w_ptr + cols64 * s_w_n + offs[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
            if BLOCK_M >= 16:
                if NATIVE_DOT:
                    part += tl.dot(x.to(dtype), tl.trans(w))
                else:
                    part += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                part += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if NORM:
            part = part * tl.math.rsqrt(tl.math.div_rn(ss, width) + eps)[:, None]
        acc += part
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows64 * s_y_m + cols[None, :], round_to(acc, y_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@dataclass(frozen=True)
class GemvTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    # Software-pipeline stages of the K loop (3: Triton's own default on CUDA, what every tile was tuned with).
    num_stages: int = 3


def default_tiles(m: int, n: int, k: int, on_cuda: bool) -> GemvTiles:
    """Tiles for M rows (untuned on the GPU beyond the usual GEMV shape: many programs, long K tiles; `gemv_bench.py`
    sweeps them). Past 64 rows each block of rows reads the whole weight again: cuBLAS is the better choice there."""
    if not on_cuda:  # interpreter: few, large programs
        return GemvTiles(16 if m > 4 else max(1, triton.next_power_of_2(m)), min(64, triton.next_power_of_2(n)),
                         min(128, triton.next_power_of_2(k)), 4)
    if m == 1:  # the best of gemv_bench's sweep on an H100 with PDL, on every 8b-like layer but down_proj (within 2 %)
        return GemvTiles(1, 4, 2048, 4)
    if m <= 4:
        return GemvTiles(triton.next_power_of_2(m), 16, 256, 4)
    if m <= 16:
        return GemvTiles(16, 32, 128, 4)
    # One block of rows up to 64, so that W is read once (each block of rows reads all of it again).
    return GemvTiles(32, 32, 128, 4) if m <= 32 else GemvTiles(64, 32, 64, 4)


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[0] == 0 else t.contiguous()


def fused_linear_triton(a: Tensor, weight: Tensor, bias: Tensor | None = None, *, prologue: str = "none",
                        residual: Tensor | None = None, gate: Tensor | None = None, norm_weight: Tensor | None = None,
                        eps: float = 1e-5, group_size: int | None = None,
                        tiles: GemvTiles | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """y = f(a) @ weight^T (+ bias) in one launch; see `ops.fused_linear.fused_linear`."""
    fn = "fused_linear_triton"
    check_fused_linear(fn, a, weight, bias, prologue, residual, gate, norm_weight, group_size)
    m, k = a.shape
    n = weight.shape[0]
    a = _rows(a)
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    r = a if residual is None else _rows(residual)
    g = a if gate is None else _rows(gate)
    y = torch.empty((m, n), dtype=a.dtype, device=a.device)
    s = torch.empty((m, k), dtype=a.dtype, device=a.device) if prologue == "add_norm" else None
    if m and n:
        t = tiles or default_tiles(m, n, k, a.is_cuda)
        group = group_size if prologue == "gated_norm" else max(k, 1)
        nw = norm_weight.contiguous() if norm_weight is not None else a
        _gemv_kernel[(triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m))](
            a, r, g, nw, a if s is None else s, w, a if bias is None else bias, y,
            m, n, k, group, a.stride(0), r.stride(0), g.stride(0), w.stride(0), y.stride(0),
            float(group), eps,
            PRO=_CODES[prologue], HAS_BIAS=bias is not None, NATIVE_DOT=not _interpreted(),
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps,
            num_stages=t.num_stages, **pdl(a),
        )  # fmt: skip
    elif s is not None and m:
        s.copy_(residual + a)
    return y if s is None else (y, s)
