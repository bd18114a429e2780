"""The non-gated MLP of NemotronH: down(act(up(x))), relu2 = relu(x)^2 by default (one Triton launch on
the GPU path, `ops.act.kernel`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from baton.engine.layers.gemv_weight import gemv_weight
from baton.engine.layers.project import project
from baton.engine.ops.kernels import Kernels

if TYPE_CHECKING:
    from baton.engine.layers.norms import PendingNorm


def activation(name: str):
    """The activation function; None for relu2, which runs as this engine's op (`MLP.kernels.relu2`)."""
    if name == "relu2":
        return None
    if name == "silu":
        return nn.functional.silu
    if name == "gelu":
        return nn.functional.gelu
    if name == "relu":
        return torch.relu
    raise ValueError(f"mlp_hidden_act: expected relu2, silu, gelu or relu, got {name!r}")


class MLP(nn.Module):
    # This engine's implementation of each op, set once at load (`ops.kernels.bind_kernels`).
    kernels: Kernels | None = None

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)
        self.act_name = act

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        if batch is not None and batch.fused_gemv:
            # A few-token step that reaches this MLP with its input made (a MoE layer's shared expert): both
            # linears through the GEMV kernel, as the step's others, relu2 in down_proj's.
            up = project(self.up_proj, x, batch, self.kernels)
            return project(self.down_proj, self.act(up), batch, self.kernels) if self.act is not None else \
                self._relu2_down(up)
        up = self.up_proj(x)
        return self.down_proj(self.kernels.relu2(up) if self.act is None else self.act(up))

    def forward_pending(self, p: PendingNorm, batch=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Few-token steps: the block's add + norm run in up_proj's GEMV, relu2 in down_proj's."""
        up, residual = p.apply(self.up_proj)
        if self.act_name != "relu2":
            return self.down_proj(self.act(up)), residual
        return self._relu2_down(up), residual

    def _relu2_down(self, up: torch.Tensor) -> torch.Tensor:
        """down_proj(relu2(up)) with relu2 in the GEMV's prologue."""
        gw = gemv_weight(self.down_proj, self.kernels)
        if gw is None:  # an FP8 layer the GEMV does not read here (`gemv_weight`)
            return self.down_proj(self.kernels.relu2(up))
        return self.kernels.fused_linear(up, gw.weight, gw.bias, prologue="relu2", weight_scale=gw.weight_scale,
                                         block=gw.block)
