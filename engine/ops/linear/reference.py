"""A linear layer with the op before it fused in: y = f(a) @ W^T (+ bias), for the few-token steps of decode.

At decode batch sizes every linear layer is a read of its weight and little else, and the small op in front of
it (the residual add and the next RMSNorm, the MLP's relu2, the Mamba2 mixer's gated norm) is a kernel launch
of its own, a few µs each, 100 per 8b-like decode step. `ops.linear.kernel` computes f(a) while it loads a, in
the GEMV's own programs; this file is its torch reference (the CPU path) and the argument checks both share.

Prologues f, each what the separate op computes (layers/norms.py, layers/mlp.py), in a's dtype:

    none        x = a
    relu2       x = relu(a)^2
    norm        x = RMSNorm(a) with norm_weight                                  (the first block's input)
    add_norm    s = residual + a;  x = RMSNorm(s) with norm_weight; returns (y, s)   (a block's add + next norm)
    gated_norm  x = GatedRMSNorm(a, gate) with norm_weight, per group_size channels  (before Mamba2's out_proj)

FP8 weights (float8_e4m3fn, `layers.fp8_linear`): W = weight * weight_scale, the scale per tensor (`block` None) or
per (block[0], block[1]) block; the reference dequantizes W to fp32, rounds it once to a's dtype and runs the same
F.linear (what `ops.fp8_linear.reference` computes without activation rounding: the GEMV reads 16-bit inputs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from baton.engine.ops.fp8_linear.reference import FP8_DTYPE, dequantize

PROLOGUES = ("none", "relu2", "norm", "add_norm", "gated_norm")


def check_weight_scale(fn: str, weight: Tensor, weight_scale: Tensor | None, block: tuple[int, int] | None) -> None:
    """An FP8 weight has its scale (a scalar, or one per `block`), a 16-bit one none: ValueError otherwise."""
    if (weight.dtype == FP8_DTYPE) != (weight_scale is not None):
        raise ValueError(f"{fn}: expected weight_scale with (and only with) a {FP8_DTYPE} weight, got a "
                         f"{weight.dtype} weight and {'no' if weight_scale is None else 'a'} weight_scale")
    if weight_scale is None:
        if block is not None:
            raise ValueError(f"{fn}: block expected None without weight_scale, got {block}")
        return
    n, k = weight.shape
    want = () if block is None else (-(-n // block[0]), -(-k // block[1]))
    if block is not None and (block[0] <= 0 or block[1] <= 0):
        raise ValueError(f"{fn}: block expected positive sizes, got {block}")
    if tuple(weight_scale.shape) != want and not (block is None and weight_scale.numel() == 1):
        raise ValueError(f"{fn}: weight_scale expected shape {want} for weight {(n, k)} and block {block}, "
                         f"got {tuple(weight_scale.shape)}")
    if weight_scale.device != weight.device:
        raise ValueError(f"{fn}: weight_scale on {weight_scale.device}, weight on {weight.device}")


def check_fused_linear(fn: str, a: Tensor, weight: Tensor, bias: Tensor | None, prologue: str,
                       residual: Tensor | None, gate: Tensor | None, norm_weight: Tensor | None,
                       group_size: int | None, weight_scale: Tensor | None = None,
                       block: tuple[int, int] | None = None) -> None:
    """Shapes, dtypes and devices of a fused linear's arguments: ValueError naming the argument."""
    if prologue not in PROLOGUES:
        raise ValueError(f"{fn}: prologue expected one of {', '.join(PROLOGUES)}, got {prologue!r}")
    if a.dim() != 2 or weight.dim() != 2 or a.shape[1] != weight.shape[1]:
        raise ValueError(f"{fn}: expected a [M, K] and weight [N, K], got {tuple(a.shape)} and {tuple(weight.shape)}")
    check_weight_scale(fn, weight, weight_scale, block)
    if a.dtype != weight.dtype and weight_scale is None:
        raise ValueError(f"{fn}: expected a and weight of one dtype, got {a.dtype} and {weight.dtype}")
    m, k = a.shape
    n = weight.shape[0]
    need = {"add_norm": ("residual", "norm_weight"), "norm": ("norm_weight",),
            "gated_norm": ("gate", "norm_weight")}.get(prologue, ())
    given = {"residual": residual, "gate": gate, "norm_weight": norm_weight}
    for name, t in given.items():
        if (t is not None) != (name in need):
            raise ValueError(f"{fn}: prologue {prologue!r} expected {name} {'given' if name in need else 'None'}, "
                             f"got {'None' if t is None else 'a tensor'}")
    for name, t, shape in (("residual", residual, (m, k)), ("gate", gate, (m, k)), ("norm_weight", norm_weight, (k,)),
                           ("bias", bias, (n,))):
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"{fn}: {name} expected shape {shape}, got {tuple(t.shape)}")
        if t.device != a.device:
            raise ValueError(f"{fn}: {name} on {t.device}, a on {a.device}")
    if residual is not None and residual.dtype != a.dtype:
        raise ValueError(f"{fn}: residual expected {a.dtype} as a, got {residual.dtype}")
    if weight.device != a.device:
        raise ValueError(f"{fn}: weight on {weight.device}, a on {a.device}")
    if prologue == "gated_norm" and (group_size is None or group_size <= 0 or k % group_size):
        raise ValueError(f"{fn}: group_size expected a positive divisor of K = {k}, got {group_size}")


def fused_linear(a: Tensor, weight: Tensor, bias: Tensor | None = None, *, prologue: str = "none",
                 residual: Tensor | None = None, gate: Tensor | None = None, norm_weight: Tensor | None = None,
                 eps: float = 1e-5, group_size: int | None = None, weight_scale: Tensor | None = None,
                 block: tuple[int, int] | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Torch reference: f(a) by the separate ops' references, then F.linear (an FP8 weight dequantized first).
    Returns y [M, N] in a's dtype, and for add_norm (y, s) with s = residual + a."""
    from baton.engine.ops.act.reference import relu2_reference
    from baton.engine.ops.norm.reference import (
        add_rms_norm_reference,
        gated_rms_norm_reference,
        rms_norm_reference,
    )

    check_fused_linear("fused_linear", a, weight, bias, prologue, residual, gate, norm_weight, group_size,
                       weight_scale, block)
    if weight_scale is not None:
        weight = dequantize(weight, weight_scale.reshape(()) if block is None else weight_scale, block).to(a.dtype)
    s = None
    if prologue == "relu2":
        x = relu2_reference(a)
    elif prologue == "norm":
        x = rms_norm_reference(a, norm_weight, eps)
    elif prologue == "add_norm":
        x, s = add_rms_norm_reference(a, residual, norm_weight, eps)
    elif prologue == "gated_norm":
        x = gated_rms_norm_reference(a, gate, norm_weight, group_size, eps).to(a.dtype)
    else:
        x = a
    y = torch.nn.functional.linear(x, weight, None if bias is None else bias.to(a.dtype))
    return y if s is None else (y, s)
