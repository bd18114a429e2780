"""The gated MLP of Qwen3.5: down(silu(gate(x)) * up(x)). After `fuse()` gate_proj and up_proj are views of one
weight and run as one GEMM (`fused_linears`); in few-token steps the block's norm runs in that GEMV
(`forward_pending`) and down_proj reads its weight with the GEMV kernel too (`project`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from baton.engine.layers.fused_linears import fuse_weights, fused_weight
from baton.engine.layers.project import project
from baton.engine.ops.kernels import Kernels

if TYPE_CHECKING:
    from baton.engine.forward_batch import ForwardBatch
    from baton.engine.layers.norms import PendingNorm


class GatedMLP(nn.Module):
    # This engine's implementation of each op, set once at load (`ops.kernels.bind_kernels`).
    kernels: Kernels | None = None

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self._gate_up: torch.Tensor | None = None

    def fuse(self) -> None:
        self._gate_up = fuse_weights((self.gate_proj, self.up_proj))

    def _fused(self) -> torch.Tensor | None:
        return fused_weight((self.gate_proj, self.up_proj), self._gate_up)

    def _down(self, gate_up: torch.Tensor, batch: ForwardBatch | None) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        h = nn.functional.silu(gate) * up
        return self.down_proj(h) if batch is None else project(self.down_proj, h, batch, self.kernels)

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        w = self._fused()
        if w is None:
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return self._down(nn.functional.linear(x, w), batch)

    def forward_pending(self, p: PendingNorm, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Few-token steps: the block's add + norm run in the gate/up GEMV."""
        w = self._fused()
        if w is None:
            x, residual = p.materialize()
            return self.forward(x, batch), residual
        gate_up, residual = p.linear(w)
        return self._down(gate_up, batch), residual
