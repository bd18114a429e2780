"""RMSNorm and the gated, grouped RMSNorm of the Mamba2 mixer (computed in fp32, as the reference).

The torch references (and the CPU path) are `ops.norm.reference`; `ops.kernels` picks the fused Triton kernels of
`ops.norm.kernel` on CUDA (or with `EngineConfig.kernels` "triton"), one launch per norm (a residual add and the norm after
it are one launch too: `RMSNorm.add_forward`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from baton.engine.forward_batch import ForwardBatch
from baton.engine.layers.gemv_weight import gemv_weight
from baton.engine.ops.kernels import Kernels
from baton.engine.parallel.group import TPGroup


class RMSNorm(nn.Module):
    # This engine's implementation of each op, set once at load (`ops.kernels.bind_kernels`).
    kernels: Kernels | None = None

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(residual + x), residual + x) in one kernel on the Triton path."""
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


@dataclass(frozen=True)
class PendingNorm:
    """A block's input not computed yet: x = norm(residual + out), or norm(out) where residual is None (the
    first block: out is the embeddings). The mixer's first linear layer computes it as it loads it
    (`linear`); a mixer without that path takes it computed (`materialize`). Both also return the residual
    stream after the add (what the next block adds to)."""

    out: torch.Tensor
    residual: torch.Tensor | None
    norm: RMSNorm

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
               block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x @ weight^T + bias, the residual stream) in one GEMV launch (an FP8 weight with its scales)."""
        n = self.norm
        if self.residual is None:
            y = n.kernels.fused_linear(self.out, weight, bias, prologue="norm", norm_weight=n.weight, eps=n.eps,
                                       weight_scale=weight_scale, block=block)
            return y, self.out
        return n.kernels.fused_linear(self.out, weight, bias, prologue="add_norm", residual=self.residual,
                                      norm_weight=n.weight, eps=n.eps, weight_scale=weight_scale, block=block)

    def apply(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer(x), the residual stream): fused into the GEMV where the kernel reads the layer's weight
        (`gemv_weight`: an `nn.Linear`, an `FP8Linear` on FP8 hardware or the reference ops), else computed first."""
        gw = gemv_weight(layer, self.norm.kernels)
        if gw is not None:
            return self.linear(gw.weight, gw.bias, gw.weight_scale, gw.block)
        x, residual = self.materialize()
        return layer(x), residual

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, the residual stream)."""
        if self.residual is None:
            return self.norm(self.out), self.out
        return self.norm.add_forward(self.out, self.residual)


def pre_norm_stack(h: torch.Tensor, layers: Sequence[nn.Module], final_norm: RMSNorm, batch: ForwardBatch,
                   keep: torch.Tensor | None = None, keep_from: int | None = None, tp: TPGroup | None = None
                   ) -> torch.Tensor:
    """h + mixer(norm(h)) through `layers` (each with `.norm` and `.mixer(x, batch)`), then `final_norm`; each
    residual add runs fused into the norm after it (`RMSNorm.add_forward`). Returns final_norm's output.

    keep (token indices): only those tokens' outputs are returned, in keep's order. From layer `keep_from` on,
    the last one that writes a cache (KV or state), nothing else reads the other tokens: that layer's mixer
    projects only the kept tokens' outputs (`mixer(x, batch, keep=keep)`) and the layers after it run on them
    alone. A prefill step samples one token per row, so its tail (the 8b-like model's last out_proj and MLP,
    3 % of its linear FLOPs) runs on a few rows instead of thousands.

    With `batch.fused_gemv` the add and the norm go one step further, into the next mixer's first linear layer
    (`mixer.forward_pending(PendingNorm, batch) -> (out, residual)`, where the mixer has it); such a step has
    few tokens, and keep only selects the outputs.

    tp (tensor parallelism): each mixer's output is this rank's partial sum (its heads' or channels' share of the
    row-parallel projection), so it is all-reduced once per block, before the residual add."""
    reduce = (lambda x: x) if tp is None else tp.all_reduce
    if batch.fused_gemv:
        out, res = h, None
        for layer in layers:
            pending = PendingNorm(out, res, layer.norm)
            if hasattr(layer.mixer, "forward_pending"):
                out, res = layer.mixer.forward_pending(pending, batch)
            else:
                x, res = pending.materialize()
                out = layer.mixer(x, batch)
            out = reduce(out)
        x = PendingNorm(out, res, final_norm).materialize()[0]
        return x if keep is None else x[keep]
    if keep is not None and keep_from is None:
        return pre_norm_stack(h, layers, final_norm, batch, tp=tp)[keep]
    x = layers[0].norm(h)
    norms = [layer.norm for layer in layers[1:]] + [final_norm]
    for i, (layer, norm) in enumerate(zip(layers, norms, strict=True)):
        if keep is not None and i == keep_from:
            out = reduce(layer.mixer(x, batch, keep=keep))  # the kept tokens' outputs only
            h = h[keep]
            if not h.shape[0]:  # nothing to return: the caches are written
                return out
        else:
            out = reduce(layer.mixer(x, batch))
        x, h = norm.add_forward(out, h)  # h += mixer(x); x = the next norm of h
    return x


class GatedRMSNorm(nn.Module):
    """norm(x * silu(gate)) with the RMS taken per group of `group_size` channels."""

    # This engine's implementation of each op, set once at load (`ops.kernels.bind_kernels`).
    kernels: Kernels | None = None

    def __init__(self, hidden_size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.kernels.gated_rms_norm(x, gate, self.weight, self.group_size, self.eps)


class NormGate(nn.Module):
    """RMSNorm(x) * silu(gate) over the last dim: the norm BEFORE the gate (the Gated DeltaNet's output norm)."""

    # This engine's implementation of each op, set once at load (`ops.kernels.bind_kernels`).
    kernels: Kernels | None = None

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.kernels.norm_gate(x, gate, self.weight, self.eps)
