"""Triton kernels of the two RMSNorms: the model's `RMSNorm` and the Mamba2 mixer's gated, grouped `GatedRMSNorm`.

Same semantics, dtypes and casts as the torch references `ops.norm.reference.rms_norm_reference` and
`ops.norm.reference.gated_rms_norm_reference` (the modules' CPU path), one kernel launch each instead of the
reference's chain of small elementwise / reduce kernels:

- `rms_norm_triton(x, weight, eps)`: x -> fp32; y = x * rsqrt(mean(x^2) + eps); out = (fp32(weight) * y)
  rounded once to x.dtype.
- `add_rms_norm_triton(x, residual, weight, eps)`: the residual stream's add fused into the next RMSNorm:
  s = residual + x rounded once to their dtype (what torch's add gives), then (RMSNorm(s), s). One read of
  each input instead of the add's two reads and write plus the norm's read.
- `gated_rms_norm_triton(x, gate, weight, group_size, eps)`: h = fp32(x) * silu(fp32(gate)); per group of
  `group_size` channels g = h * rsqrt(mean(h^2) + eps); g rounded to x.dtype (the reference's `.to(dtype)`),
  then out = weight * g in the promoted dtype of (weight, x), i.e. the product of the two values rounded
  once to that dtype (exact in fp32 for bf16/fp16 operands, so this matches torch's own elementwise mul).

Kernels: a 2-D tile of BLOCK_M rows x BLOCK_N channels per program (BLOCK_N = the next power of two of the
row / group width, masked), fp32 math in registers, one read of each input and one write of the output.
RMSNorm: grid = (cdiv(M, BLOCK_M),); gated: grid = (cdiv(M, BLOCK_M), groups), one group of each row
block per program. On CUDA BLOCK_M depends only on the width (1 for widths >= 1024), so a new batch size
never compiles a new variant; under the interpreter (CPU tensors) BLOCK_M covers many rows to keep the
number of (serially interpreted) programs small.

Differences from the reference that remain: the fp32 sum of squares is a tree reduction (torch sums in
another order), and on GPU `rsqrt` / `exp` are the fast hardware approximations (torch's CUDA rsqrt is
too; its exp is not). The divisions (the mean's sum / N, silu's z / (1 + exp(-z))) are IEEE-rounded
(`div_rn`), as torch's are, rather than Triton's default approximate fp32 division. So fp32 outputs agree to a few ulp and bf16/fp16 outputs to one rounding step of a rare element.

Inputs of any leading shape [..., N] are flattened (`reshape`: a view for 2-D or contiguous inputs, a copy
only for a leading layout that cannot be viewed). Rows are addressed through their stride, so a split of
a wider tensor (the mixer's `gate`, a slice of in_proj's output) needs no copy; an input whose last
dimension is not unit-stride is made contiguous first (keeps the loads vectorised). No host reads of
device tensors (shapes and dtypes only), so the launches can be captured in CUDA graphs. Not
differentiable (inference only). Width limit: one tile per row / group, at most MAX_WIDTH channels.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.triton_common import cdiv, next_power_of_2, pdl, pdl_wait, round_to

MAX_WIDTH = 65536
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# The row count only bounds a mask: specialized (== 1, divisible by 16) it would compile again per kind of step.
@triton.jit(do_not_specialize=["M"])
def _rms_norm_kernel(
    x_ptr,  # [M, N], unit column stride
    r_ptr,  # [M, N], unit column stride: the residual (ADD only)
    s_ptr,  # [M, N], contiguous: x + residual in x's dtype (ADD only)
    w_ptr,  # [N]
    y_ptr,  # [M, N], contiguous
    M,
    N,
    stride_xm,
    stride_rm,
    stride_w,
    width,  # float(N), for the mean's division (an fp32 argument: never specialised)
    eps,
    ADD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = (rows < M)[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD:  # the residual add first, rounded once to the stream's dtype (torch's add), then its norm
        r = tl.load(r_ptr + rows64 * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = round_to(x + r, s_ptr.dtype.element_ty)
        tl.store(s_ptr + rows64 * N + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    ms = tl.math.div_rn(tl.sum(x * x, axis=1), width)  # masked lanes add 0; sum / N correctly rounded
    r = tl.math.rsqrt(ms + eps)
    w = tl.load(w_ptr + cols * stride_w, mask=cmask, other=0.0).to(tl.float32)
    y = w[None, :] * (x * r[:, None])
    tl.store(y_ptr + rows64 * N + cols[None, :], round_to(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _gated_rms_norm_kernel(
    x_ptr,  # [M, N], unit column stride
    z_ptr,  # [M, N] gate, unit column stride
    w_ptr,  # [N]
    y_ptr,  # [M, N], contiguous
    M,
    N,
    GS,  # channels per group; N = groups * GS
    stride_xm,
    stride_zm,
    stride_w,
    width,  # float(GS)
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_g = tl.arange(0, BLOCK_N)
    cmask = cols_g < GS
    cols = tl.program_id(1) * GS + cols_g
    mask = (rows < M)[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    w = tl.load(w_ptr + cols * stride_w, mask=cmask, other=0.0).to(tl.float32)
    pdl_wait(PDL)  # (the norm weight above is a constant)
    x = tl.load(x_ptr + rows64 * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + rows64 * stride_zm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = x * tl.math.div_rn(z, 1.0 + tl.exp(-z))  # silu as torch computes it: z / (1 + exp(-z))
    ms = tl.math.div_rn(tl.sum(h * h, axis=1), width)  # masked lanes: x = 0 -> h = 0
    g = h * tl.math.rsqrt(ms + eps)[:, None]
    g = round_to(g, x_ptr.dtype.element_ty).to(tl.float32)  # the reference's g.to(x.dtype)
    tl.store(y_ptr + rows64 * N + cols[None, :], round_to(w[None, :] * g, y_ptr.dtype.element_ty), mask=mask)


def _launch_config(rows: int, width: int, on_cuda: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for rows of `width` channels."""
    if width > MAX_WIDTH:
        raise ValueError(f"norm width {width} exceeds the single-tile limit {MAX_WIDTH}")
    block_n = next_power_of_2(width)
    if on_cuda:
        block_m = max(1, min(16, 1024 // block_n))  # a function of the width only: no recompiles per batch size
    else:  # interpreter: few programs, each a vectorised numpy tile
        block_m = max(1, min(next_power_of_2(max(rows, 1)), 65536 // block_n))
    tile = block_m * block_n
    num_warps = 16 if tile >= 8192 else 8 if tile >= 2048 else 4
    return block_m, block_n, num_warps


def _rows_of(t: Tensor, width: int) -> Tensor:
    """[..., width] -> [M, width] with unit column stride (a view where possible)."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def _check(name: str, t: Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected one of {_FLOAT_DTYPES}, got {t.dtype}")


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim of x [..., N] with weight [N]; returns x.dtype, shape of x."""
    _check("x", x)
    _check("weight", weight)
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight: expected shape ({n},), got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight on {weight.device}, x on {x.device}")
    x2 = _rows_of(x, n)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.view(x.shape)
    block_m, block_n, num_warps = _launch_config(m, n, x.is_cuda)
    _rms_norm_kernel[(cdiv(m, block_m),)](
        x2, x2, y, weight, y, m, n, x2.stride(0), 0, weight.stride(0), float(n), eps,
        ADD=False, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return y.view(x.shape)


def add_rms_norm_triton(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The pre-norm residual stream's step in one launch: s = residual + x (rounded once to their dtype, as
    torch adds), returns (RMSNorm(s) with weight [N], s), both of x's dtype and shape."""
    _check("x", x)
    _check("residual", residual)
    _check("weight", weight)
    n = x.shape[-1]
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual: expected {tuple(x.shape)} {x.dtype} as x, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    if weight.shape != (n,):
        raise ValueError(f"weight: expected shape ({n},), got {tuple(weight.shape)}")
    if residual.device != x.device or weight.device != x.device:
        raise ValueError(f"x on {x.device}, residual on {residual.device}, weight on {weight.device}")
    x2, r2 = _rows_of(x, n), _rows_of(residual, n)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    s = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.view(x.shape), s.view(x.shape)
    block_m, block_n, num_warps = _launch_config(m, n, x.is_cuda)
    _rms_norm_kernel[(cdiv(m, block_m),)](
        x2, r2, s, weight, y, m, n, x2.stride(0), r2.stride(0), weight.stride(0), float(n), eps,
        ADD=True, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return y.view(x.shape), s.view(x.shape)


def gated_rms_norm_triton(x: Tensor, gate: Tensor, weight: Tensor, group_size: int, eps: float) -> Tensor:
    """norm(x * silu(gate)) with the RMS per group of `group_size` channels, times weight [N]; x and gate
    [..., N] (any row strides). Returns torch.promote_types(weight.dtype, x.dtype), shape of x."""
    _check("x", x)
    _check("gate", gate)
    _check("weight", weight)
    n = x.shape[-1]
    if gate.shape != x.shape:
        raise ValueError(f"gate: expected shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    if weight.shape != (n,):
        raise ValueError(f"weight: expected shape ({n},), got {tuple(weight.shape)}")
    if group_size <= 0 or n % group_size:
        raise ValueError(f"group_size {group_size} does not divide the width {n}")
    if gate.device != x.device or weight.device != x.device:
        raise ValueError(f"x on {x.device}, gate on {gate.device}, weight on {weight.device}")
    x2, z2 = _rows_of(x, n), _rows_of(gate, n)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if m == 0 or n == 0:
        return y.view(x.shape)
    block_m, block_n, num_warps = _launch_config(m, group_size, x.is_cuda)
    _gated_rms_norm_kernel[(cdiv(m, block_m), n // group_size)](
        x2, z2, weight, y, m, n, group_size, x2.stride(0), z2.stride(0), weight.stride(0), float(group_size), eps,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, **pdl(x2),
    )
    return y.view(x.shape)
