"""NemotronH MoE: sigmoid top-k router with group selection, non-gated experts, one shared expert."""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.config import ModelConfig
from baton.engine.layers.mlp import MLP, activation
from baton.engine.ops.kernels import Kernels


class TopkRouter(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # The router stays fp32 whatever the model dtype (as the reference keeps it).
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        e = cfg.n_routed_experts
        scores = torch.nn.functional.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias
        group_scores = choice.view(-1, cfg.n_group, e // cfg.n_group).topk(2, dim=-1)[0].sum(-1)  # [T, n_group]
        group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, cfg.n_group, e // cfg.n_group).reshape(-1, e)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        idx = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]  # [T, k]
        weights = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * cfg.routed_scaling_factor


class Experts(nn.Module):
    # This engine's implementation of each op, set once at load (`ops.kernels.bind_kernels`).
    kernels: Kernels | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d_in = cfg.moe_latent_size or cfg.hidden_size
        self.up_proj = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.moe_intermediate_size, d_in))
        self.down_proj = nn.Parameter(torch.empty(cfg.n_routed_experts, d_in, cfg.moe_intermediate_size))
        self.act = activation(cfg.mlp_hidden_act)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x, dtype=weights.dtype)  # [T, d_in]
        for e in idx.unique().tolist():
            tok, k = torch.where(idx == e)
            h = torch.nn.functional.linear(x[tok], self.up_proj[e])
            h = self.kernels.relu2(h) if self.act is None else self.act(h)
            h = torch.nn.functional.linear(h, self.down_proj[e]) * weights[tok, k, None]
            out.index_add_(0, tok, h.to(out.dtype))
        return out.to(x.dtype)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = TopkRouter(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size,
                                  cfg.mlp_hidden_act, cfg.mlp_bias)
        if cfg.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, cfg.moe_latent_size, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(cfg.moe_latent_size, cfg.hidden_size, bias=cfg.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        idx, weights = self.gate(x)
        h = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        h = self.experts(h, idx, weights)
        if self.fc2_latent_proj is not None:
            h = self.fc2_latent_proj(h)
        return h + self.shared_experts(x)
