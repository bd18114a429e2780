"""The sparse MoE block of Qwen3.5-MoE and Qwen3-Next: a softmax router picks each token's top-k experts
(renormalised over them when `norm_topk_prob`), each a gated SiLU MLP, plus a shared expert scaled by
sigmoid(shared_expert_gate(x)). The routing math and the routed experts live in `ops.moe` (this engine's
`moe_route_softmax` and `moe_experts`: the torch references on CPU, the routing kernel and the fused-MoE kernels on
CUDA); the shared expert stays ordinary
linears.

Parameter names mirror HF transformers 5.x (`mlp.gate.weight`, `mlp.experts.gate_up_proj` [E, 2I, H] with each
expert's gate rows before its up rows, `mlp.experts.down_proj` [E, H, I], `mlp.shared_expert.*`,
`mlp.shared_expert_gate.weight`). Router probabilities are fp32 and the weights are cast to the hidden dtype, as HF.
The routed experts of an FP8 checkpoint stay FP8 with their scales (`layers.fp8_experts`: the gate rows and the up
rows of `gate_up_proj` each with their own, as the per-expert checkpoints quantize them).
"""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.config import ModelConfig
from baton.engine.layers.fp8_experts import ExpertStacks
from baton.engine.layers.gated_mlp import GatedMLP
from baton.engine.ops.kernels import Kernels


class _Experts(ExpertStacks):
    STACKS = (("gate_up_proj", 2), ("down_proj", 1))

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))


class QwenSparseMoE(nn.Module):
    # This engine's implementation of each op, set once at load (`ops.kernels.bind_kernels`).
    kernels: Kernels | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, e = cfg.hidden_size, cfg.n_routed_experts
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = _Experts(e, h, cfg.moe_intermediate_size)
        self.shared_expert = GatedMLP(h, cfg.moe_shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        experts, weights = self.kernels.moe_route_softmax(self.gate(x), self.top_k, self.norm_topk_prob)  # [T, k]
        e = self.experts
        out = self.kernels.moe_experts(x, e.gate_up_proj, e.down_proj, experts, weights.to(x.dtype), activation="silu",
                                       gated=True, w_up_scale=e.scale("gate_up_proj"), w_down_scale=e.scale("down_proj"),
                                       block=e.block)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out + shared
