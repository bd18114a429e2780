"""The sparse MoE block of Qwen3.5-MoE and Qwen3-Next (torch reference on every path; a fused MoE kernel is its own
issue): a softmax router picks each token's top-k experts (renormalised over them when `norm_topk_prob`), each a
gated SiLU MLP, plus a shared expert scaled by sigmoid(shared_expert_gate(x)).

Parameter names mirror HF transformers 5.x (`mlp.gate.weight`, `mlp.experts.gate_up_proj` [E, 2I, H] with each
expert's gate rows before its up rows, `mlp.experts.down_proj` [E, H, I], `mlp.shared_expert.*`,
`mlp.shared_expert_gate.weight`). Router probabilities are fp32 and the weights are cast to the hidden dtype, as HF.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.config import ModelConfig
from baton.engine.layers.gated_mlp import GatedMLP


class _Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))


class QwenSparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, e = cfg.hidden_size, cfg.n_routed_experts
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = _Experts(e, h, cfg.moe_intermediate_size)
        self.shared_expert = GatedMLP(h, cfg.moe_shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        # Each expert once over the tokens that picked it (no host loop over tokens).
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)
            gate, up = nn.functional.linear(x[token], self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(nn.functional.silu(gate) * up, self.experts.down_proj[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out + shared
