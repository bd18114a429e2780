"""Triton kernel of RoPE (`ops.rope.reference.apply_rope`): q and k rotated in one launch instead of the
reference's chain of cat / mul / add kernels.

Same values as the reference: each program takes one token and a block of heads (of q or of k), computes the
angles position * inv_freq in fp32 and their cos / sin (libdevice's, as torch's CUDA cos / sin; numpy's in the
interpreter), rounds them to the input's dtype as the reference does, then rounds each product and the sum to
that dtype, so every rounding point is the reference's (no fused multiply-add: `enable_fp_fusion=False`). The
channels past the rotary ones are copied unchanged. q and k are written to new contiguous [T, H, D] tensors, as
the reference returns; any token / head strides are read in place (a slice of a fused projection needs no
copy), a last dim that is not unit-stride is made contiguous first. No host reads of device values:
graph-capturable. (GatedAttention's q and k are its norms' fresh outputs, so rotating them in place would be safe
there; the kernel keeps the reference's out-of-place contract.)
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.triton_common import cdiv, interpreted, next_power_of_2, pdl, pdl_wait, round_to

try:
    from triton.language.extra import libdevice
except ImportError:  # an older Triton layout
    from triton.language.extra.cuda import libdevice

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 1024
# The interpreter has no libdevice (extern calls); there tl.cos / tl.sin run numpy's.
_INTERPRETED = tl.constexpr(interpreted())


@triton.jit
def _cos_sin(angle):
    if _INTERPRETED:
        c, s = tl.cos(angle), tl.sin(angle)
    else:
        c, s = libdevice.cos(angle), libdevice.sin(angle)
    return c, s


@triton.jit
def _rotate_heads(x_ptr, o_ptr, t, h0, n_heads, stride_t, stride_h, c, s,
                  HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  BLOCK_PASS: tl.constexpr):
    dt = o_ptr.dtype.element_ty
    h = h0 + tl.arange(0, BLOCK_H)[:, None]
    hmask = h < n_heads
    i = tl.arange(0, BLOCK_HALF)[None, :]
    m = hmask & (i < HALF)
    x_row = x_ptr + t * stride_t + h.to(tl.int64) * stride_h
    o_row = o_ptr + (t * n_heads + h.to(tl.int64)) * (2 * HALF + PASS)
    x1 = tl.load(x_row + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + i, mask=m, other=0.0).to(tl.float32)
    # The reference's x * cos + rotate_half(x) * sin in x's dtype: each product and the sum rounded to it.
    y1 = round_to(x1 * c, dt).to(tl.float32) - round_to(x2 * s, dt).to(tl.float32)
    y2 = round_to(x2 * c, dt).to(tl.float32) + round_to(x1 * s, dt).to(tl.float32)
    tl.store(o_row + i, round_to(y1, dt), mask=m)
    tl.store(o_row + HALF + i, round_to(y2, dt), mask=m)
    if PASS > 0:
        j = tl.arange(0, BLOCK_PASS)[None, :]
        pm = hmask & (j < PASS)
        tl.store(o_row + 2 * HALF + j, tl.load(x_row + 2 * HALF + j, mask=pm), mask=pm)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, inv_ptr, HQ, HK, q_blocks,
                 stride_qt, stride_qh, stride_kt, stride_kh,
                 HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_PASS: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    inv = tl.load(inv_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)
    pdl_wait(PDL)  # (inv_freq above is a constant buffer; the positions are this step's)
    angle = tl.load(pos_ptr + t).to(tl.float32) * inv
    c, s = _cos_sin(angle)
    # cos / sin take the input's dtype before they multiply, as the reference casts them.
    c = round_to(c, qo_ptr.dtype.element_ty).to(tl.float32)
    s = round_to(s, qo_ptr.dtype.element_ty).to(tl.float32)
    if hb < q_blocks:
        _rotate_heads(q_ptr, qo_ptr, t, hb * BLOCK_H, HQ, stride_qt, stride_qh, c, s,
                      HALF, PASS, BLOCK_H, BLOCK_HALF, BLOCK_PASS)
    else:
        _rotate_heads(k_ptr, ko_ptr, t, (hb - q_blocks) * BLOCK_H, HK, stride_kt, stride_kh, c, s,
                      HALF, PASS, BLOCK_H, BLOCK_HALF, BLOCK_PASS)


def _unit_channel_stride(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 or x.numel() == 0 else x.contiguous()


def apply_rope_triton(q: Tensor, k: Tensor, positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """q [T, Hq, D], k [T, Hk, D] -> rotated copies (contiguous, the inputs' dtype); the first 2 * len(inv_freq)
    channels of each head rotate by positions [T] (integers) times inv_freq [rotary_dim / 2]."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"apply_rope_triton: expected q [T, Hq, D] and k [T, Hk, D], got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype:
        raise TypeError(f"apply_rope_triton: q and k expected one dtype of {_FLOAT_DTYPES}, got {q.dtype} "
                        f"and {k.dtype}")
    if inv_freq.dim() != 1 or inv_freq.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"apply_rope_triton: inv_freq expected 1-D float, got {tuple(inv_freq.shape)} "
                        f"{inv_freq.dtype}")
    t, hq, d = q.shape
    hk, half = k.shape[1], inv_freq.shape[0]
    if positions.shape != (t,) or positions.dtype.is_floating_point or positions.dtype.is_complex:
        raise ValueError(f"apply_rope_triton: positions expected [{t}] integers, got {tuple(positions.shape)} "
                         f"{positions.dtype}")
    if not 0 < 2 * half <= d or d > MAX_HEAD_DIM:
        raise ValueError(f"apply_rope_triton: rotary dim {2 * half} must be in (0, head_dim {d}], "
                         f"head_dim at most {MAX_HEAD_DIM}")
    if len({q.device, k.device, positions.device, inv_freq.device}) != 1:
        raise ValueError(f"apply_rope_triton: q on {q.device}, k on {k.device}, positions on {positions.device}, "
                         f"inv_freq on {inv_freq.device}")
    q, k = _unit_channel_stride(q), _unit_channel_stride(k)
    positions, inv_freq = positions.contiguous(), inv_freq.contiguous()
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t == 0 or hq + hk == 0:
        return qo, ko
    block_half, passthrough = next_power_of_2(half), d - 2 * half
    block_pass = next_power_of_2(passthrough) if passthrough else 1
    # Heads per program: a tile of about 2048 channels, fewer for few heads (one program per token and
    # block of q's or k's heads; the interpreter runs programs one by one, so there it takes them all).
    cap = 64 if interpreted() else max(1, 2048 // next_power_of_2(d))
    block_h = min(next_power_of_2(max(hq, hk)), cap)
    q_blocks = cdiv(hq, block_h)
    _rope_kernel[(t, q_blocks + cdiv(hk, block_h))](
        q, k, qo, ko, positions, inv_freq, hq, hk, q_blocks, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        HALF=half, PASS=passthrough, BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
        num_warps=4, enable_fp_fusion=False, **pdl(q))
    return qo, ko
